"""OpenAI-compatible request and response models.

Requests are strict and closed (extra="forbid"): every field we accept changes the result, and
any other field is rejected with a 400 that names it, rather than silently ignored.
"""
from __future__ import annotations

import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deepinfer.sampling_params import SamplingParams

TokenIds = list[int]


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
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # our JSON grammars are always strict: declared properties only, in order


class ResponseFormat(_Request):
    """OpenAI's response_format: "text" (no constraint), "json_object" (any JSON object) or "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def so_args(self) -> dict[str, Any] | None:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(f"response_format.json_schema is required with type 'json_schema' and allowed only "
                             f"there, got type {self.type!r} {'with' if self.json_schema else 'without'} it")
        if self.type == "text":
            return None
        return {"schema_type": "json", "schema": self.json_schema.schema_ if self.json_schema else None}


class StructuredOutputs(_Request):
    """vLLM's structured_outputs: exactly one constraint; a choice is a regex of its escaped alternatives."""

    regex: str | None = None
    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    grammar: str | None = None  # EBNF
    choice: list[str] | None = None

    def so_args(self) -> dict[str, Any]:
        given = {"regex": self.regex, "json": self.json_, "json_object": self.json_object or None,
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
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    user: str | None = None  # recorded in the request log line
    cache_salt: str | None = None  # prefix-cache tenant: requests with another salt never share KV blocks
    kv_ttl_class: Literal["agent", "chatbot"] | None = None  # how long the KV store keeps this request's blocks
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Structured output, at most one of: OpenAI's, deepinfer's ({"schema_type", "schema"}), vLLM's
    response_format: ResponseFormat | None = None
    so_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None

    def structured_output(self) -> tuple[str, dict[str, Any]] | None:
        """(the request field that constrains the output, its so_args); None when nothing does."""
        given = {"response_format": self.response_format and self.response_format.so_args(), "so_args": self.so_args,
                 "structured_outputs": self.structured_outputs and self.structured_outputs.so_args()}
        given = {name: so_args for name, so_args in given.items() if so_args is not None}
        if len(given) > 1:
            raise ValueError(f"give at most one of response_format, so_args and structured_outputs, got {sorted(given)}")
        return next(iter(given.items()), None)

    def _sampling(self, max_tokens: int | None, logprobs: int | None, **extra: Any) -> SamplingParams:
        """Raises ValueError naming the bad value (SamplingParams validates)."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "n": self.n, "stop": self.stop, "seq_seed": self.seed, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
            "cache_salt": self.cache_salt, "kv_ttl_class": self.kv_ttl_class,
        }
        constraint = self.structured_output()
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, so_args=constraint and constraint[1],
                              **{k: v for k, v in given.items() if v is not None}, **extra)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = 16
    logprobs: int | None = None
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
    content: str | list[TextPart]

    def as_template_input(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": self.role, "content": text}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None

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
    """vLLM's /tokenize: a prompt, or messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: TokenIds


# ---- responses ---------------------------------------------------------------------------------

class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class Completion(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "deepinfer"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def parse_request(model: type[_Request], raw: bytes) -> Any:
    """Validates a JSON body; raises APIError(400) naming the first offending field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise _translate(e) from None


def _translate(error: ValidationError) -> APIError:
    first = error.errors(include_url=False)[0]
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
    return "[" in part or part in ("str", "int", "float", "bool", "list", "StreamOptions", "TextPart") or part.startswith("function-")
