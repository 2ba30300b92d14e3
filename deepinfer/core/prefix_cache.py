"""Block keys for the prefix cache: a 128-bit cryptographic hash chained over full blocks.

key(i) = blake2b-128(key(i-1) | token ids of block i), with key(-1) = blake2b-128(extra keys).
Extra keys are the model identity, dtype and the request's cache_salt, so two tenants (or two
models sharing a KV store) never share a block. With a 128-bit cryptographic hash a collision
cannot be constructed, so a key match means the same tokens.
"""
from __future__ import annotations

from array import array
from hashlib import blake2b

DIGEST_SIZE = 16


def root_key(model_key: str, cache_salt: str | None) -> bytes:
    h = blake2b(digest_size=DIGEST_SIZE, person=b"deepinfer-root")
    h.update(model_key.encode())
    h.update(b"\x00salt\x00" + (cache_salt or "").encode())
    return h.digest()


def block_key(parent: bytes, token_ids: list[int]) -> bytes:
    h = blake2b(parent, digest_size=DIGEST_SIZE, person=b"deepinfer-blk")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_keys(keys: list[bytes], root: bytes, token_ids: list[int], block_size: int) -> None:
    """Appends the keys of every newly full block of `token_ids` to `keys` in place."""
    for start in range(len(keys) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = keys[-1] if keys else root
        keys.append(block_key(parent, token_ids[start : start + block_size]))
