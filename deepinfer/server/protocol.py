"""OpenAI-compatible request models (responses are in responses.py), and the errors they raise.

Requests are strict and closed (extra="forbid"): every field we accept changes the result, and
any other field is rejected with a 400 that names it, rather than silently ignored.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError

from deepinfer.sampling_params import LOGIT_BIAS_RANGE, MAX_TEMPERATURE, REPETITION_PENALTY_RANGE, SamplingParams

# Limits the server enforces, published in the OpenAPI document (/openapi.json) as part of each field's schema.
MAX_N = 128  # choices per prompt (OpenAI's limit)
MAX_LOGPROBS = 20  # alternatives per position (OpenAI's limit; SamplingParams enforces the same)
MAX_STOP_STRINGS = 128  # each generated token is searched for every stop string
MAX_STOP_LENGTH = 1024  # characters; a stream holds back up to this many characters that could start a stop string
MAX_INT32 = 2**31 - 1
INT64 = dict(ge=-(2**63), le=2**63 - 1)


def _integral(value: Any) -> Any:
    """JSON Schema counts 2.0 as an integer, so the server does too (strict mode would refuse it); 2.5 stays refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _int(**limits: Any) -> Any:
    """An integer field type with its limits (inside the validator, so the JSON schema shows them as min / max)."""
    return Annotated[int, Field(**limits), BeforeValidator(_integral)]


# and below the model's vocabulary size: the OpenAPI document states it once the model is loaded (openapi.py)
TokenId = _int(ge=0, le=MAX_INT32, json_schema_extra={"x-token-id": True})
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
Count = _int(ge=1, le=MAX_INT32)
MAX_LOGIT_BIAS = 1024  # entries: each is one more logit written per step
# OpenAI's logit_bias: token ids (as JSON object keys, so strings) -> a bias
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")],
                           Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]],
                      Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={"additionalProperties": False},
                            description="token id -> bias added to its logit before sampling; ids below the model's "
                                        "vocabulary size")]


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    # NaN and the infinities are refused at parse time: no sampling parameter means anything with them
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # our JSON grammars are always strict: declared properties only, in order


class ResponseFormatText(_Request):
    """OpenAI's response_format "text": no constraint."""

    type: Literal["text"]

    def so_args(self) -> dict[str, Any] | None:
        return None


class ResponseFormatJsonObject(_Request):
    """Any JSON object."""

    type: Literal["json_object"]

    def so_args(self) -> dict[str, Any] | None:
        return {"schema_type": "json", "schema": None}


class ResponseFormatJsonSchema(_Request):
    """JSON that follows json_schema.schema."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat

    def so_args(self) -> dict[str, Any] | None:
        return {"schema_type": "json", "schema": self.json_schema.schema_}


def _response_format_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"tag:{kind}" if kind in ("text", "json_object", "json_schema") else None


# Tags are named "tag:..." so that error paths can drop them (see _looks_like_type).
ResponseFormat = Annotated[
    Annotated[ResponseFormatText, Tag("tag:text")] | Annotated[ResponseFormatJsonObject, Tag("tag:json_object")]
    | Annotated[ResponseFormatJsonSchema, Tag("tag:json_schema")],
    Discriminator(_response_format_kind, custom_error_type="invalid_response_format",
                  custom_error_message="type must be one of 'text', 'json_object', 'json_schema'"),
]


class SoArgsText(_Request):
    """deepinfer's so_args for a regex or an EBNF grammar (a grammar that does not compile is a 400)."""

    schema_type: Literal["regex", "ebnf"]
    schema_: NonEmptyStr = Field(alias="schema")

    def so_args(self) -> dict[str, Any]:
        return {"schema_type": self.schema_type, "schema": self.schema_}


class SoArgsJson(_Request):
    """deepinfer's so_args for JSON: a JSON schema (an object, or one as a string); none: any JSON object."""

    schema_type: Literal["json"]
    schema_: dict[str, Any] | str | None = Field(default=None, alias="schema")

    def so_args(self) -> dict[str, Any]:
        return {"schema_type": "json", "schema": self.schema_}


def _so_args_kind(value: Any) -> str | None:
    kind = value.get("schema_type") if isinstance(value, dict) else getattr(value, "schema_type", None)
    return {"regex": "tag:text", "ebnf": "tag:text", "json": "tag:json"}.get(kind) if isinstance(kind, str) else None


SoArgs = Annotated[
    Annotated[SoArgsText, Tag("tag:text")] | Annotated[SoArgsJson, Tag("tag:json")],
    Discriminator(_so_args_kind, custom_error_type="invalid_so_args",
                  custom_error_message="schema_type must be one of 'regex', 'json', 'ebnf'"),
]


class StructuredOutputs(_Request):
    """vLLM's structured_outputs: exactly one of regex, json, json_object (true), grammar (EBNF), choice; a choice is
    a regex of its escaped alternatives. The fields are optional but never null, so that "exactly one" is the
    schema's minProperties = maxProperties = 1."""

    model_config = ConfigDict(json_schema_extra={"minProperties": 1, "maxProperties": 1})
    regex: NonEmptyStr = Field(default=None, json_schema_extra={"format": "regex"})
    json_: dict[str, Any] | str = Field(default=None, alias="json")
    json_object: Literal[True] = Field(default=None)
    grammar: NonEmptyStr = Field(default=None)  # EBNF
    choice: Annotated[list[NonEmptyStr], Field(min_length=1)] = Field(default=None)

    def so_args(self) -> dict[str, Any]:
        given = {"regex": self.regex, "json": self.json_, "json_object": self.json_object,
                 "grammar": self.grammar, "choice": self.choice}
        given = {name: value for name, value in given.items() if value is not None}
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of regex, json, json_object, grammar, choice; "
                             f"got {sorted(given) or 'none'}")
        ((kind, value),) = given.items()
        if kind == "choice":
            if not value or not all(value):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got {value!r}")
            return {"schema_type": "regex", "schema": "(" + "|".join(map(re.escape, value)) + ")"}
        if kind == "json_object":
            return {"schema_type": "json", "schema": None}
        return {"schema_type": {"grammar": "ebnf"}.get(kind, kind), "schema": value}


class _SamplingRequest(_Request):
    """Fields shared by completions and chat; None means the OpenAI default."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE, description="0, or below 1e-5: greedy")
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: _int(ge=-1, le=MAX_INT32) | None = Field(default=None, description="0 or -1: disabled")
    min_p: float | None = Field(default=None, ge=0, le=1)
    n: _int(ge=1, le=MAX_N) | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: _int(**INT64) | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, ge=REPETITION_PENALTY_RANGE[0],
                                             le=REPETITION_PENALTY_RANGE[1])
    logit_bias: LogitBias | None = None
    # vLLM's extensions
    ignore_eos: bool | None = None
    min_tokens: _int(ge=0, le=MAX_INT32) | None = None
    stop_token_ids: Annotated[list[_int(ge=0, le=MAX_INT32)], Field(max_length=MAX_STOP_STRINGS)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_LOGIT_BIAS)] | None = None
    truncate_prompt_tokens: _int(ge=1, le=MAX_INT32) | None = Field(default=None, description="keep only the "
                                                                    "prompt's last N tokens")
    bad_words: Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    user: str | None = None  # recorded in the request log line
    cache_salt: str | None = None  # prefix-cache tenant: requests with another salt never share KV blocks
    kv_ttl_class: Literal["agent", "chatbot"] | None = None  # how long the KV store keeps this request's blocks
    # prefill/decode disaggregation: a hand-off between a prefill and a decode engine (deepinfer/disagg/params.py)
    kv_transfer_params: dict[str, Any] | None = Field(default=None, description="set by the router between a prefill "
                                                      "and a decode engine")
    stream: bool | None = False
    stream_options: StreamOptions | None = Field(default=None, description="only with stream: true")
    # Structured output, at most one of: OpenAI's, deepinfer's ({"schema_type", "schema"}), vLLM's
    response_format: ResponseFormat | None = None
    so_args: SoArgs | None = Field(default=None, description="at most one of response_format, so_args and "
                                                             "structured_outputs")
    structured_outputs: StructuredOutputs | None = None

    def structured_output(self) -> tuple[str, dict[str, Any]] | None:
        """(the request field that constrains the output, its so_args); None when nothing does."""
        fields = {"response_format": self.response_format, "so_args": self.so_args,
                  "structured_outputs": self.structured_outputs}
        given = {name: value for name, value in fields.items() if value is not None}
        if len(given) > 1:
            raise ValueError(f"give at most one of response_format, so_args and structured_outputs, got {sorted(given)}")
        constraints = {name: value.so_args() for name, value in given.items()}
        return next(((name, so) for name, so in constraints.items() if so is not None), None)

    def _sampling(self, max_tokens: int | None, logprobs: int | None, **extra: Any) -> SamplingParams:
        """Raises ValueError naming the bad value (SamplingParams validates)."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "n": self.n, "stop": self.stop, "seq_seed": self.seed, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
            "cache_salt": self.cache_salt, "kv_ttl_class": self.kv_ttl_class, "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens, "stop_token_ids": self.stop_token_ids,
            "logit_bias": {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            "allowed_token_ids": self.allowed_token_ids, "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "truncate_prompt_tokens": self.truncate_prompt_tokens, "bad_words": self.bad_words,
        }
        constraint = self.structured_output()
        # each step hands over only what is new (no per-step copies that grow with the output); a response that is
        # not streamed joins them
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, so_args=constraint and constraint[1],
                              output_kind="delta",
                              **{k: v for k, v in given.items() if v is not None}, **extra)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# Cross-field rules in JSON Schema (if / then), so that the published contract holds them too.
_NEEDS_STREAM = {"if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
                 "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}
_ONE_CONSTRAINT = {"not": {"anyOf": [
    {"required": [a, b], "properties": {a: {"type": "object"}, b: {"type": "object"}}}
    for a, b in (("response_format", "so_args"), ("response_format", "structured_outputs"),
                 ("so_args", "structured_outputs"))]}}
def _no_constraint_with_logprobs(logprobs: dict) -> dict:
    return {"if": {"required": ["logprobs"], "properties": {"logprobs": logprobs}},
            "then": {"properties": {f: {"type": "null"} for f in ("response_format", "so_args", "structured_outputs")}}}


_NEEDS_LOGPROBS = {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
                   "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}


class CompletionRequest(_SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        _NEEDS_STREAM, _ONE_CONSTRAINT, _no_constraint_with_logprobs({"type": "integer"})]})
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | TokenIds \
        | Annotated[list[TokenIds], Field(min_length=1)] = Field(
            description="text, a list of texts, token ids or a list of token-id lists; each prompt shorter than the "
                        "model's context (max_model_len in /v1/models)")
    max_tokens: Count | None = 16
    logprobs: _int(ge=0, le=MAX_LOGPROBS) | None = None
    echo: bool | None = False

    def prompts(self) -> list[str | TokenIds]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        return list(p)

    def sampling_params(self) -> SamplingParams:
        # echo with logprobs also returns the prompt's logprobs, as OpenAI's legacy API does
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling(self.max_tokens, self.logprobs, prompt_logprobs=prompt_logprobs)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]

    def as_template_input(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": self.role, "content": text}


class ChatCompletionRequest(_SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        _NEEDS_STREAM, _ONE_CONSTRAINT, _NEEDS_LOGPROBS, _no_constraint_with_logprobs({"const": True})]})
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = Field(default=None, description="alias of max_tokens; if both, equal")
    logprobs: bool | None = False
    top_logprobs: _int(ge=0, le=MAX_LOGPROBS) | None = Field(default=None, description="needs logprobs: true")
    # vLLM's: continue_final_message (with add_generation_prompt false) lets the model go on with the last,
    # assistant, message (assistant prefill)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None

    def sampling_params(self) -> SamplingParams:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError(f"max_tokens={self.max_tokens} and max_completion_tokens={self.max_completion_tokens} "
                             f"disagree; give one of them")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling(max_tokens, logprobs)


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or messages rendered with the chat template (exactly one of them)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    model: str | None = None
    # optional but never null, so that the schema's oneOf states exactly what the route accepts
    prompt: str = Field(default=None)
    messages: Annotated[list[ChatMessage], Field(min_length=1)] = Field(default=None)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId] = Field(description="each below the model's vocabulary size")


def parse_request(model: type[_Request], raw: bytes) -> Any:
    """Validates a JSON body; raises APIError(400) naming the first offending field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise _translate(e) from None


def _translate(error: ValidationError) -> APIError:
    errors = error.errors(include_url=False)
    # A union field fails once per member; the most telling failure is a constraint (not a type mismatch) on the
    # member that got furthest into the value, e.g. a negative token id rather than "not a string".
    first = min(errors, key=lambda e: (e["type"].endswith("_type"), -len(e["loc"])))
    if errors[0]["type"] == "json_invalid" or not errors[0]["loc"]:
        first = errors[0]
    kind, loc = first["type"], first["loc"]
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first['msg']}")
    if not loc:
        return APIError(400, f"the request body must be a JSON object, got {first['input']!r}"[:300])
    # Union members appear in loc as type names (e.g. ("prompt", "list[int]", 0)); keep the field path only.
    param = ".".join(str(p) for p in loc if isinstance(p, int) or not _looks_like_type(p))
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field {param!r}: this server does not support it", param=param)
    if kind == "missing":
        return APIError(400, f"field {param!r} is required", param=param)
    return APIError(400, f"invalid value for {param!r}: {first['msg']} (got {first['input']!r})"[:500], param=param)


def _looks_like_type(part: str) -> bool:
    return ("[" in part or part in ("str", "int", "float", "bool", "list", "StreamOptions", "TextPart")
            or part.startswith(("function-", "constrained-", "tag:")))
