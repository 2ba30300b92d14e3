"""A request's tokens as the penalties read them, kept up to date as tokens are generated instead of recounted from
the whole sequence every step: the distinct tokens of prompt and output (repetition penalty) and each output
token's count (presence and frequency penalties). The sampler gives the same logits as from the token lists: a
token listed twice was written twice with the same value, here it is written once."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


class _GrowingIds:
    """Distinct token ids in first-seen order (numpy, doubled when full), and where each one sits."""

    def __init__(self, capacity: int) -> None:
        self.ids = np.empty(max(capacity, 16), dtype=np.int64)
        self.index: dict[int, int] = {}

    def add(self, token: int) -> int:
        """The token's slot; a new slot if unseen."""
        slot = self.index.get(token)
        if slot is None:
            slot = len(self.index)
            if slot == len(self.ids):
                self.ids = np.concatenate([self.ids, np.empty_like(self.ids)])
            self.ids[slot] = token
            self.index[token] = slot
        return slot

    def view(self) -> np.ndarray:
        return self.ids[: len(self.index)]


class PenaltyState:
    def __init__(self, prompt: Sequence[int], output: Sequence[int] = ()) -> None:
        self._seen = _GrowingIds(2 * (len(prompt) + len(output)))
        self._output = _GrowingIds(2 * len(output) + 16)
        self._counts = np.zeros(len(self._output.ids), dtype=np.float32)
        for token in prompt:
            self._seen.add(token)
        self.extend(output)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self._seen.add(token)
            slot = self._output.add(token)
            if slot == len(self._counts):
                self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
            self._counts[slot] += 1

    @property
    def seen_ids(self) -> np.ndarray:
        """Distinct tokens of prompt and output (a view, valid until the next extend)."""
        return self._seen.view()

    @property
    def output_ids(self) -> np.ndarray:
        return self._output.view()

    @property
    def output_counts(self) -> np.ndarray:
        """float32 count of each of output_ids."""
        return self._counts[: len(self._output.index)]
