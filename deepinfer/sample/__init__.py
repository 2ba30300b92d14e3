"""Turning logits into tokens: penalties, masks, greedy and seeded sampling, logprobs."""
from deepinfer.sample.logprobs import compute_prompt_logprobs
from deepinfer.sample.sampler import Sampler, SamplerOutput, SamplingRow

__all__ = ["Sampler", "SamplerOutput", "SamplingRow", "compute_prompt_logprobs"]
