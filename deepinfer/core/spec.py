"""Speculative decoding, the scheduler half's counters: drafted and accepted tokens, acceptance per position."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Cumulative. A verified step with k drafts drafts k tokens and accepts the a <= k that match; it emits a + 1
    (the correction or bonus token comes from the target)."""

    num_drafts: int = 0  # verified steps that carried at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts at position i accepted
    drafted_per_position: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        width = max(drafted, len(self.drafted_per_position))
        for counts in (self.drafted_per_position, self.accepted_per_position):
            counts.extend([0] * (width - len(counts)))
        for i in range(drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verified step: accepted drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
