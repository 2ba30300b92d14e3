"""Speculative decoding: draft proposers (multi-token prediction modules, n-gram lookup)."""
