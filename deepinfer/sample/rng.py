"""Counter-based randomness: a pure function of (seed, position, draw).

No generator state exists anywhere, so a request draws the same numbers whatever
else is in the batch, in whatever order, on whichever worker. The mixing
function is splitmix64's finalizer (Steele, Lea, Flood, "Fast splittable
pseudorandom number generators", OOPSLA 2014), applied once per key word so
that nearby keys (seed, position, position + 1, ...) give unrelated outputs.
"""
from __future__ import annotations

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MANTISSA_SCALE = 2.0**-53


def _mix64(z: int) -> int:
    """splitmix64 finalizer: a bijection on 64-bit integers with full avalanche."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def random_bits(seed: int, position: int, draw: int = 0) -> int:
    """64 random bits keyed by (seed, position, draw).

    Any Python int is a valid seed (reduced modulo 2**64, so negative seeds work);
    position and draw must be non-negative.
    """
    if position < 0 or draw < 0:
        raise ValueError(f"position and draw must be >= 0, got position={position}, draw={draw}")
    h = _mix64((seed + _GOLDEN_GAMMA) & _MASK64)
    h = _mix64(((h ^ (position & _MASK64)) + _GOLDEN_GAMMA) & _MASK64)
    h = _mix64(((h ^ (draw & _MASK64)) + 2 * _GOLDEN_GAMMA) & _MASK64)
    return h


def uniform(seed: int, position: int, draw: int = 0) -> float:
    """A float in [0, 1) with 53 random bits, keyed by (seed, position, draw)."""
    return (random_bits(seed, position, draw) >> 11) * _MANTISSA_SCALE
