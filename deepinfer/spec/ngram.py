"""n-gram drafts (prompt lookup decoding): the tokens that followed the most recent earlier occurrence of the
sequence's last n tokens, in its own prompt and output. No weights; every model."""
from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens for the sequence `tokens` (int array, prompt + output so far).

    Tries the longest suffix first (max_n down to min_n); for a suffix of n tokens, the latest earlier position
    where the same n tokens occur wins, and the draft is what followed it. Where that runs into the end of the
    sequence (the match lies p tokens back: a repeating stretch with period p), the draft goes on repeating it, as
    the match predicts: a run of one token drafts k of it, not one.
    """
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # starts 0 .. length - 1 - n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            period = length - start
            return [int(tokens[start + i % period]) for i in range(k)]
    return []
