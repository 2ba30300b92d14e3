"""Block keys, payloads and a settable clock for the KV store tests."""
from __future__ import annotations

import hashlib


def key(i: int) -> bytes:
    """A 128-bit key like the prefix cache's chained block hash."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def chain(n: int, start: int = 0) -> list[bytes]:
    return [key(i) for i in range(start, start + n)]


def payload(i: int, size: int = 256) -> bytes:
    return bytes((i * 31 + j) % 256 for j in range(size))


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
