"""Kernels behind switches (batch-invariant reductions)."""
