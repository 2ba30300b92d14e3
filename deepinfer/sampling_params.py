"""Per-request sampling parameters, validated once at construction."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from collections.abc import Collection
from typing import Any

SCHEMA_TYPES = ("regex", "json", "ebnf")
# vLLM's rule: a temperature this small is greedy. Smaller ones reach the float32 sampler as 0 or overflow it
# (logits / 1e-300 -> inf -> NaN weights), which the API fuzzer found (benchmarks/fuzz.py).
GREEDY_BELOW_TEMPERATURE = 1e-5
# Above float32's range a temperature becomes inf, and a masked logit then -inf / inf = NaN (found by the fuzzer with
# a structured-output request at temperature 1e308). 1e6 already makes every distribution uniform.
MAX_TEMPERATURE = 1e6
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # beyond it float32 logits overflow or underflow; no use needs more
TTL_CLASSES = ("agent", "chatbot")
# What each step's output of a request carries (vLLM's RequestOutputKind): everything so far, only what is new since
# the last output, or nothing until it finishes (the offline LLM's choice: no per-step output objects)
OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 (or below 1e-5, as in vLLM) means greedy. ``seq_seed`` (alias ``seed``) keys a
    counter-based generator by (seed, output position, draw index), so a seeded
    request draws the same numbers whatever else is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seq_seed: int | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    so_args: dict[str, Any] | None = None
    cache_salt: str | None = None
    kv_ttl_class: str | None = None
    # OpenAI's logit_bias: token id -> a value in [-100, 100] added to that token's logit before penalties, masks
    # and temperature (vLLM's order); -100 bans a token in practice, +100 all but forces it. Logprobs stay raw.
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: only these tokens may be sampled (after the bias and penalties; min_tokens still holds
    # back the stop tokens among them)
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep only the prompt's last N tokens (left truncation)
    # vLLM's bad_words: words never generated. The engine turns each into its token sequences (as written and after a
    # space): a sequence's last token is banned wherever the output so far ends with the tokens before it, unless
    # that would leave no token to draw (with allowed_token_ids, a grammar or min_tokens).
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None  # set by the engine from bad_words (or given directly)
    detokenize: bool = True  # False: token ids only, no text (vLLM's name; needed with skip_tokenizer_init)
    output_kind: str = "cumulative"  # one of OUTPUT_KINDS

    def __post_init__(self) -> None:
        if self.seq_seed is not None and self.seed is not None and self.seq_seed != self.seed:
            raise ValueError(f"seq_seed={self.seq_seed} and seed={self.seed} disagree; give one of them")
        if self.seq_seed is None and self.seed is not None:
            object.__setattr__(self, "seq_seed", self.seed)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if _is_number(self.temperature) and 0 < self.temperature < GREEDY_BELOW_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        elif self.stop is None:
            object.__setattr__(self, "stop", [])
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", [])
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"in [0, {MAX_TEMPERATURE:g}]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "an integer >= 0 (0 or -1 disables it)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, "in [-2, 2]")
        low, high = REPETITION_PENALTY_RANGE
        if not _is_number(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise bad("repetition_penalty", f"in [{low}, {high}]")
        if self.seq_seed is not None and not _is_int(self.seq_seed):
            raise bad("seq_seed", "an integer")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= 20):
                raise bad(name, "an integer in [0, 20] or None")
        if self.so_args is not None:
            _validate_so_args(self.so_args)
            if self.logprobs is not None:
                # found by the API fuzzer: the logprobs came back shorter than the tokens, so the server paired
                # tokens with another position's logprobs (and the chat renderer failed with a 500)
                raise ValueError(f"logprobs={self.logprobs} cannot be combined with so_args: tokens the grammar forces "
                                 f"(jump-forward) are appended without sampling and have no logprobs")
        if self.logit_bias is not None:
            _validate_logit_bias(self.logit_bias)
        if self.truncate_prompt_tokens is not None and (not _is_int(self.truncate_prompt_tokens)
                                                        or self.truncate_prompt_tokens < 1):
            raise bad("truncate_prompt_tokens", "an integer >= 1 or None")
        if self.bad_words is not None and (not isinstance(self.bad_words, list)
                                           or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise bad("bad_words", "a list of words (non-blank strings)")
        if self.bad_words_token_ids is not None and (
                not isinstance(self.bad_words_token_ids, list)
                or not all(isinstance(seq, list) and seq and all(_is_int(t) and t >= 0 for t in seq)
                           for seq in self.bad_words_token_ids)):
            raise bad("bad_words_token_ids", "a list of non-empty token id lists")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids \
                    or not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "a non-empty list of token ids (integers >= 0)")
            if self.so_args is not None:
                raise ValueError("allowed_token_ids cannot be combined with so_args: state the restriction in the "
                                 "grammar (a regex or an EBNF of the allowed strings)")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise bad("cache_salt", "a string")
        if self.kv_ttl_class is not None and self.kv_ttl_class not in TTL_CLASSES:
            raise bad("kv_ttl_class", f"one of {TTL_CLASSES}")
        if not isinstance(self.detokenize, bool):
            raise bad("detokenize", "a bool")
        if self.output_kind not in OUTPUT_KINDS:
            raise bad("output_kind", f"one of {OUTPUT_KINDS}")
        if not self.detokenize and self.stop:
            raise ValueError(f"stop strings need detokenize=True (text to search), got stop={self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def token_stop(self, token: int, eos_token_ids: Collection[int], num_output: int) -> tuple[str, int | None] | None:
        """Why sampling `token` as a sequence's output token number `num_output` ends it: ("stop", None) for an
        EOS (unless ignore_eos), ("stop", token) for one of stop_token_ids; None before min_tokens, or otherwise."""
        if num_output < self.min_tokens:
            return None
        if token in eos_token_ids and not self.ignore_eos:
            return "stop", None
        if token in self.stop_token_ids:
            return "stop", token
        return None


def _validate_so_args(so_args: Any) -> None:
    if not isinstance(so_args, dict):
        raise ValueError(f"so_args must be a dict with 'schema_type' and 'schema', got {so_args!r}")
    unknown = set(so_args) - {"schema_type", "schema"}
    if unknown:
        raise ValueError(f"so_args has unknown keys {sorted(unknown)}; expected 'schema_type' and 'schema'")
    kind = so_args.get("schema_type")
    if kind not in SCHEMA_TYPES:
        raise ValueError(f"so_args['schema_type'] must be one of {SCHEMA_TYPES}, got {kind!r}")
    schema = so_args.get("schema")
    if kind == "json":
        if schema is not None and not isinstance(schema, (str, dict)):
            raise ValueError(f"so_args['schema'] for json must be a dict, a JSON string or None, got {type(schema).__name__}")
    elif not isinstance(schema, str) or not schema:
        raise ValueError(f"so_args['schema'] for {kind} must be a non-empty string, got {schema!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's


def _validate_logit_bias(bias: Any) -> None:
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
    low, high = LOGIT_BIAS_RANGE
    for token, value in bias.items():
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if not _is_number(value) or not low <= value <= high:
            raise ValueError(f"logit_bias[{token}] must be a number in [{low:g}, {high:g}], got {value!r}")
