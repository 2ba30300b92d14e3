"""What the engine hands back to callers: plain dataclasses, cumulative per request."""
from __future__ import annotations

from dataclasses import dataclass, field

# One generated position's log-probabilities: token id -> logprob, holding the
# sampled token and the top-N alternatives (N = SamplingParams.logprobs).
TokenLogprobs = dict[int, float]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this request (all its sequences)
    num_accepted_tokens: int = 0  # and accepted


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None
    kv_transfer_params: dict | None = None  # a prefill engine's hand-off of this prompt's KV (disagg/params.py)


def merge_delta(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive output_kind="delta" outputs of one request as one: each sequence's text, tokens and logprobs
    joined; state (finish, metrics, errors, hand-off) from the later."""
    by_index = {s.index: s for s in earlier.outputs}
    joined = []
    for s in later.outputs:
        e = by_index.get(s.index)
        if e is None:
            joined.append(s)
            continue
        logprobs = None if e.logprobs is None and s.logprobs is None else (e.logprobs or []) + (s.logprobs or [])
        joined.append(CompletionOutput(index=s.index, text=e.text + s.text, token_ids=e.token_ids + s.token_ids,
                                       finish_reason=s.finish_reason, stop_reason=s.stop_reason, logprobs=logprobs))
    return RequestOutput(request_id=later.request_id, prompt=later.prompt, prompt_token_ids=later.prompt_token_ids,
                         outputs=joined, finished=later.finished, metrics=later.metrics,
                         num_cached_tokens=later.num_cached_tokens,
                         prompt_logprobs=later.prompt_logprobs if later.prompt_logprobs is not None
                         else earlier.prompt_logprobs,
                         error=later.error, kv_transfer_params=later.kv_transfer_params)
