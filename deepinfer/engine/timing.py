"""Where a step's time goes: cumulative seconds per phase, for the per-step profile and the decode sweep."""
from __future__ import annotations

from dataclasses import dataclass, fields

PHASES = ("schedule", "prepare", "forward", "sample", "propose", "update", "output")


@dataclass
class StepTimes:
    """schedule: plan and grammar masks; prepare: the runner's input tensors and metadata; forward: the model and
    its logits; sample: the sampler (and draft verification); propose: the next step's drafts; update: scheduler
    bookkeeping and grammars; output: detokenize, stop strings and request outputs. Seconds, summed over `steps`
    steps."""

    steps: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    propose: float = 0.0  # speculative decoding: the next step's drafts
    update: float = 0.0
    output: float = 0.0

    def add(self, phase: str, seconds: float) -> None:
        setattr(self, phase, getattr(self, phase) + seconds)

    def copy(self) -> StepTimes:
        return StepTimes(**{f.name: getattr(self, f.name) for f in fields(self)})

    def since(self, earlier: StepTimes) -> StepTimes:
        return StepTimes(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def per_step_ms(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {p: 1e3 * getattr(self, p) / n for p in PHASES}

    @property
    def outside_forward(self) -> float:
        """Share of the step spent outside the model's forward (0..1)."""
        total = sum(getattr(self, p) for p in PHASES)
        return 0.0 if total == 0 else 1 - self.forward / total
