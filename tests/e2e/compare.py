"""Greedy comparison across engine configurations, the way vLLM compares: exact tokens, except that
float noise may flip a near-tie; a divergence is accepted only if each side's token is in the other
side's top-5 logprobs at that position, and the comparison stops there."""
from __future__ import annotations

from deepinfer.outputs import CompletionOutput


def assert_greedy_close(a: CompletionOutput, b: CompletionOutput, where: str = "") -> bool:
    """Returns True when the two are identical; raises AssertionError when they differ beyond a near-tie."""
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        if x != y:
            ok = x in b.logprobs[i] and y in a.logprobs[i]
            assert ok, f"{where}: tokens diverge at {i} ({x} vs {y}) and neither is in the other's top-5"
            return False
    assert len(a.token_ids) == len(b.token_ids), f"{where}: lengths differ"
    return True
