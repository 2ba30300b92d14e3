"""A request's way in and out: its checks against the model (validate_request), and token ids -> text for outputs:
incremental detokenization, stop strings, logprobs, n > 1 fan-in."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

from deepinfer.config import SchedulerConfig
from deepinfer.core.request import Request
from deepinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from deepinfer.sampling_params import SamplingParams


@dataclass
class SequenceText:
    """One generated sequence's text, built token by token."""

    params: SamplingParams
    stream: DecodeStream
    text: str = ""
    num_tokens: int = 0  # output tokens consumed so far
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    emitted_tokens: int = 0  # output_kind "delta": tokens, characters and logprobs already handed out
    emitted_chars: int = 0
    emitted_logprobs: int = 0

    def add_tokens(self, tokenizer, tokens: list[int]) -> str | None:
        """Consumes new tokens; returns the stop string if one appeared (text is cut before it)."""
        for token in tokens:
            self.num_tokens += 1
            self.token_ids.append(token)
            if not self.params.detokenize:
                continue
            piece = self.stream.step(tokenizer, token)
            if not piece:
                continue
            old_len = len(self.text)
            self.text += piece
            if self.params.stop and self.num_tokens > self.params.min_tokens:
                stop = self._find_stop(old_len)
                if stop is not None:
                    return stop
        return None

    def _find_stop(self, old_len: int) -> str | None:
        longest = max(len(s) for s in self.params.stop)
        search_from = max(0, old_len - longest + 1)
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            at = self.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop)] if self.params.include_stop_str_in_output else self.text[:at]
        return stop

    def visible_text(self) -> str:
        """While running, hold back a tail that could still grow into a stop string (never emit it)."""
        if self.finish_reason is not None or not self.params.stop or self.params.include_stop_str_in_output:
            return self.text
        hold = max(len(s) for s in self.params.stop) - 1
        return self.text[: len(self.text) - hold] if hold else self.text


@dataclass
class RequestState:
    """The caller-facing request: prompt and n sequences (children in the scheduler)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[SequenceText]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    @property
    def output_kind(self) -> str:
        return self.sequences[0].params.output_kind

    def to_output(self) -> RequestOutput:
        """Everything so far, or with output_kind "delta" what is new since the last call."""
        finished = self.finished
        outputs = [_sequence_output(i, s, self.output_kind == "delta") for i, s in enumerate(self.sequences)]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=dataclasses.replace(self.metrics),  # a snapshot: the live one keeps changing
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
        )


def _sequence_output(index: int, s: SequenceText, delta: bool) -> CompletionOutput:
    text, tokens, logprobs = s.visible_text(), s.token_ids, s.logprobs
    if delta:
        text, tokens, logprobs = text[s.emitted_chars :], tokens[s.emitted_tokens :], logprobs[s.emitted_logprobs :]
        s.emitted_chars += len(text)
        s.emitted_tokens += len(tokens)
        s.emitted_logprobs += len(logprobs)
    return CompletionOutput(index=index, text=text, token_ids=list(tokens), finish_reason=s.finish_reason,
                            stop_reason=s.stop_reason, logprobs=list(logprobs) if s.params.logprobs is not None else None)


def new_sequence(params: SamplingParams) -> SequenceText:
    return SequenceText(params=params, stream=DecodeStream(skip_special_tokens=params.skip_special_tokens))


def record_step_metrics(state: RequestState, request: Request, now: float) -> None:
    if request.output_token_ids and state.metrics.first_token_time is None:
        state.metrics.first_token_time = now
    if request.output_token_ids:
        state.metrics.last_token_time = now


def now() -> float:
    return time.time()


def eos_ids(hf_config: dict, tokenizer) -> frozenset[int]:
    """The model's end-of-sequence ids: its config's and its tokenizer's."""
    raw = hf_config.get("eos_token_id")
    ids = set(raw if isinstance(raw, list) else [raw] if raw is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)


def bad_word_sequences(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's token sequences: as written at the start of a text and after a space (most tokenizers spell a
    word differently there), without duplicates."""
    out: list[list[int]] = []
    for word in words:
        for text in (word.strip(), " " + word.strip()):
            ids = list(tokenizer(text, add_special_tokens=False).input_ids)
            if ids and ids not in out:
                out.append(ids)
    return out


def validate_request(token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                     eos_token_ids: frozenset[int], scheduler: SchedulerConfig) -> None:
    """What a request's parameters cannot say alone: its prompt against the model, the token ids it names against
    the vocabulary. ValueError names what is wrong."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    if not token_ids:
        raise ValueError("prompt is empty")
    for what, ids in (("prompt token id", token_ids), ("logit_bias token id", params.logit_bias or ()),
                      ("allowed_token_ids token id", params.allowed_token_ids or ()),
                      ("bad_words_token_ids token id", [t for seq in params.bad_words_token_ids or () for t in seq])):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{what} {bad} is outside the vocabulary [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ValueError(f"prompt has {len(token_ids)} tokens but max_model_len is {max_model_len} "
                         f"(the prompt plus at least one generated token must fit)")
    if params.min_tokens and params.allowed_token_ids \
            and set(params.allowed_token_ids) <= eos_token_ids | set(params.stop_token_ids):
        raise ValueError("allowed_token_ids allows only stop tokens, which min_tokens holds back")
    if not scheduler.enable_chunked_prefill and len(token_ids) > scheduler.max_num_batched_tokens:
        raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_num_batched_tokens="
                         f"{scheduler.max_num_batched_tokens} with chunked prefill off")
