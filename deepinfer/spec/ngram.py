"""n-gram drafts (prompt lookup decoding): the tokens that followed the most recent earlier occurrence of the
sequence's last n tokens, in its own prompt and output. No weights; every model."""
from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens for the sequence `tokens` (int array, prompt + output so far): match_ngram's drafts."""
    return match_ngram(tokens, k, min_n, max_n)[1]


def match_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> tuple[int, list[int]]:
    """The length n of the longest suffix of `tokens` (min_n <= n <= max_n) that occurred earlier, and up to k
    draft tokens from its latest occurrence; (0, []) where none did.

    Tries the longest suffix first (max_n down to min_n); for a suffix of n tokens, the latest earlier position
    where the same n tokens occur wins, and the draft is what followed it. Where that runs into the end of the
    sequence (the match lies p tokens back: a repeating stretch with period p), the draft goes on repeating it, as
    the match predicts: a run of one token drafts k of it, not one.
    """
    length = len(tokens)
    top = min(max_n, length - 1)
    if top < min_n:
        return 0, []
    # ends of earlier occurrences of the last token (an n-gram window ends at j <= length - 2), narrowed one token
    # further back at a time: those left at n end a match of the last n tokens, the latest one wins, longest n first
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    found, matched = -1, 0
    for n in range(1, top + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
        if not ends.size:
            break
        if n >= min_n:
            found, matched = int(ends[-1]), n
    if found < 0:
        return 0, []
    start = found + 1
    return matched, tokens[start + np.arange(k) % (length - start)].tolist()
