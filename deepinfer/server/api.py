"""HTTP routes: OpenAI completions and chat (JSON and SSE), models, health, metrics, tokenize."""
from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer.disagg.params import KVTransferParams, request_transfer, with_transfer_params
from deepinfer.engine.client import AsyncEngineClient, EngineNotReady, EngineOverloaded, RequestStream
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.auth import Tenants, auth_checker, salted
from deepinfer.server.metrics import CONTENT_TYPE, ServerMetrics
from deepinfer.server.openapi import openapi_document
from deepinfer.server.protocol import (
    APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse_request,
)
from deepinfer.server.render import ChatRenderer, CompletionRenderer, Renderer, TokenText
from deepinfer.server.replica_api import add_replica_routes
from deepinfer.server.responses import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from deepinfer.server.streaming import (RETRY_AFTER_S, SSEResponse, collect_unless_disconnected, merge_streams,
                                        sse_events)

logger = logging.getLogger("deepinfer.server")

DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # a 1M-token prompt as token ids is ~8 MB of JSON
T = TypeVar("T")


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...]
    tenants: Tenants = field(default_factory=Tenants)  # API key -> tenant; empty: no key needed
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names must name at least one model")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


def build_app(engine_client: AsyncEngineClient, settings: ServerSettings) -> FastAPI:
    """The app owns nothing global: its metrics registry, settings and drain flag live on app.state."""
    metrics = ServerMetrics(engine_client.stats, settings.model_name, lambda: engine_client.step_failures)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_client.start()
        yield
        await engine_client.shutdown()

    app = FastAPI(title="deepinfer", version="0.1.0", lifespan=lifespan)
    app.state.client = engine_client
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.draining = False
    _install_error_handlers(app, metrics)
    auth = [Depends(auth_checker(settings.tenants))]

    def openapi() -> dict[str, Any]:
        """Cached once the model is loaded: then it states the vocabulary's bound on token ids."""
        if app.openapi_schema is not None:
            return app.openapi_schema
        vocab = engine_client.engine.vocab_size if engine_client.ready else None
        doc = openapi_document(app, settings.tenants.required, vocab)
        if vocab is not None:
            app.openapi_schema = doc
        return doc

    app.openapi = openapi

    async def read(request: Request, model: type[T]) -> T:
        return parse_request(model, await _read_body(request, settings.max_request_bytes))
    token_texts: list[TokenText] = []  # one decoded-token cache per app, made once the tokenizer is loaded

    def token_text() -> TokenText:
        if not token_texts:
            token_texts.append(TokenText(engine_client.engine.tokenizer))
        return token_texts[0]

    def check_model(name: str | None) -> None:
        if name is not None and name not in settings.served_model_names:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {list(settings.served_model_names)}",
                           param="model", code="model_not_found")

    def check_serving() -> None:
        if app.state.draining:
            raise APIError(503, "the server is shutting down", type="server_error", code="draining",
                           headers={"Retry-After": RETRY_AFTER_S})
        if not engine_client.ready:
            raise APIError(503, "the model is still loading", type="server_error", code="loading",
                           headers={"Retry-After": RETRY_AFTER_S})

    async def check_constraint(body: CompletionRequest | ChatCompletionRequest, params: SamplingParams) -> None:
        """Compiles the request's grammar before anything is queued, off the event loop and the engine thread:
        a bad one is a 400 naming its field, and the engine then finds the grammar in its compile cache."""
        if params.so_args is None:
            return
        try:
            await asyncio.to_thread(engine_client.engine.structured.compile, params.so_args)
        except ValueError as e:
            raise APIError(400, str(e), param=body.structured_output()[0]) from None

    def check_size(prompts: list, params: SamplingParams) -> None:
        """A request with more sequences than may ever wait at once could never be queued: 400, not 503."""
        limit = engine_client.max_waiting_requests
        if len(prompts) * params.n > limit:
            raise APIError(400, f"{len(prompts)} prompt(s) x n={params.n} is more sequences than this server queues at "
                                f"once ({limit}); split the request", param="n" if params.n > 1 else "prompt")

    async def check_length(prompts: list, params: SamplingParams) -> None:
        """vLLM's and OpenAI's rule: a prompt and max_tokens together must fit the context, or the request is a 400
        (not a silent stop at max_model_len). A text prompt is tokenized for it only where its UTF-8 bytes (a token
        spells at least one, plus a few special tokens) could reach the limit; a prompt alone past it is the engine's
        error (param prompt)."""
        limit, wanted, kept = engine_client.engine.max_model_len, params.max_tokens, params.truncate_prompt_tokens
        if wanted is None or (kept is not None and kept + wanted <= limit):
            return  # no bound asked for, or the kept tail always fits
        for prompt in prompts:
            if isinstance(prompt, str) and len(prompt.encode()) + 8 + wanted <= limit:
                continue
            n = len(await _call(engine_client.tokenize, prompt)) if isinstance(prompt, str) else len(prompt)
            n = min(n, kept or n)
            if n < limit < n + wanted:
                raise APIError(400, f"max_tokens={wanted} is too large: this model's context is {limit} tokens and "
                                    f"the prompt has {n}, leaving {limit - n} to generate", param="max_tokens")

    async def generate(request: Request, renderer: Renderer, prompts: list, params: SamplingParams,
                       stream: bool, transfer: KVTransferParams | None = None) -> Response:
        check_size(prompts, params)
        await check_length(prompts, params)
        arrival = time.time()
        ids = [f"{renderer.request_id}-{i}" for i in range(len(prompts))]
        streams = await _add_all(engine_client, ids, prompts, params, arrival, transfer)
        trackers = [metrics.tracker(params) for _ in streams]

        def abort_unfinished() -> None:
            for s, tracker in zip(streams, trackers):
                if not s.finished:
                    engine_client.abort(s.request_id)
                tracker.abandon()  # counts an abort unless the request finished

        outputs = merge_streams(streams, trackers, abort_unfinished)
        if stream:
            return SSEResponse(sse_events(renderer, outputs), abort_unfinished)
        finals = await collect_unless_disconnected(request, outputs, len(streams))
        return Response(with_transfer_params(renderer.full_response(finals), finals), media_type="application/json")

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        body = await read(request, CompletionRequest)
        check_model(body.model)
        params = salted(_params(body.sampling_params), request.state.tenant)
        prompts = _params(body.prompts)
        check_serving()
        await check_constraint(body, params)
        renderer = CompletionRenderer(f"cmpl-{uuid.uuid4().hex}", settings.model_name, params, token_text(), body)
        _log(renderer.request_id, request.state.tenant, len(prompts), params, body.stream, body.user)
        transfer = _params(lambda: request_transfer(body.kv_transfer_params, len(prompts), params, bool(body.stream)))
        return await generate(request, renderer, prompts, params, bool(body.stream), transfer)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        body = await read(request, ChatCompletionRequest)
        check_model(body.model)
        params = salted(_params(body.sampling_params), request.state.tenant)
        check_serving()
        await check_constraint(body, params)
        messages = [m.as_template_input() for m in body.messages]
        prompt = await _call(engine_client.apply_chat_template, messages, body.add_generation_prompt is not False,
                             bool(body.continue_final_message))
        renderer = ChatRenderer(f"chatcmpl-{uuid.uuid4().hex}", settings.model_name, params, token_text(), body)
        _log(renderer.request_id, request.state.tenant, 1, params, body.stream, body.user)
        transfer = _params(lambda: request_transfer(body.kv_transfer_params, 1, params, bool(body.stream)))
        return await generate(request, renderer, [prompt], params, bool(body.stream), transfer)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> JSONResponse:
        max_len = engine_client.engine.max_model_len if engine_client.ready else None
        created = int(time.time())
        cards = [ModelCard(id=name, created=created, max_model_len=max_len) for name in settings.served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/health")
    async def health() -> Response:
        if app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not engine_client.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> Response:
        body = await read(request, TokenizeRequest)
        check_model(body.model)
        check_serving()
        engine = engine_client.engine
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            tokens = await _call(engine_client.apply_chat_template, [m.as_template_input() for m in body.messages])
        elif body.add_special_tokens:
            tokens = await _call(engine_client.tokenize, body.prompt)
        else:
            tokens = list(engine.tokenizer(body.prompt, add_special_tokens=False).input_ids)
        strs = engine.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        answer = TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens, token_strs=strs)
        return Response(answer.model_dump_json(), media_type="application/json")

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> Response:
        body = await read(request, DetokenizeRequest)
        check_model(body.model)
        check_serving()
        vocab = engine_client.engine.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        answer = DetokenizeResponse(prompt=await engine_client.detokenize(body.tokens))
        return Response(answer.model_dump_json(), media_type="application/json")

    add_replica_routes(app, engine_client, auth)
    return app


# ---- request plumbing ------------------------------------------------------------------------------

async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes before it is read whole (a chunked body is cut off as it grows)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body has {'more than ' if size > limit else ''}{size} bytes; this server "
                         f"accepts at most {limit} (--max-request-bytes)", code="request_too_large")


def _named_field(message: str) -> str | None:
    """The request field a ValueError's message starts with, if any."""
    first = re.match(r"[A-Za-z_]+", message)
    name = {"seq_seed": "seed"}.get(first.group(), first.group()) if first else None
    return name if name in CompletionRequest.model_fields.keys() | ChatCompletionRequest.model_fields.keys() else None


def _params(make: Callable[[], T]) -> T:
    """Runs a request's conversion; a ValueError becomes a 400 naming the field its message starts with."""
    try:
        return make()
    except ValueError as e:
        raise APIError(400, str(e), param=_named_field(str(e))) from None


async def _call(fn: Callable[..., Awaitable[T]], *args: object) -> T:
    try:
        return await fn(*args)
    except ValueError as e:
        raise APIError(400, str(e), param=_named_field(str(e))) from None


async def _add_all(client: AsyncEngineClient, ids: list[str], prompts: list, params: SamplingParams,
                   arrival: float, transfer: KVTransferParams | None = None) -> list[RequestStream]:
    """Queues every prompt or none: the first failure aborts the rest and becomes the HTTP error."""
    results = await asyncio.gather(*(client.add_request(i, p, params, arrival, transfer) for i, p in zip(ids, prompts)),
                                   return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if not errors:
        return results
    for request_id in ids:
        client.abort(request_id)
    error = errors[0]
    if isinstance(error, ValueError):  # the engine's checks: the prompt's, or a token id the request names
        raise APIError(400, str(error), param=_named_field(str(error)) or "prompt")
    if isinstance(error, EngineOverloaded):
        raise APIError(503, f"the server is overloaded ({error}); retry later", type="server_error",
                       code="overloaded", headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(error, EngineNotReady):
        raise APIError(503, str(error), type="server_error", headers={"Retry-After": RETRY_AFTER_S})
    raise error


def _log(request_id: str, tenant: str | None, prompts: int, params: SamplingParams, stream: bool | None,
         user: str | None) -> None:
    # the tenant's name, never its key; repr() keeps a client's 'user' string on one log line
    logger.info("%s: tenant=%s, %d prompt(s), n=%d, max_tokens=%s, temperature=%s, stream=%s, user=%r",
                request_id, tenant, prompts, params.n, params.max_tokens, params.temperature, bool(stream), user)


# ---- errors and auth ----------------------------------------------------------------------------------

def _error_response(error: APIError, metrics: ServerMetrics) -> JSONResponse:
    metrics.count_error(error.status)
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return _error_response(error, metrics)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        # headers carry e.g. a 405's Allow
        return _error_response(APIError(error.status_code, str(error.detail), type=kind, headers=error.headers), metrics)

    @app.exception_handler(RequestValidationError)
    async def invalid_parameters(request: Request, error: RequestValidationError) -> JSONResponse:
        # routes that let FastAPI validate their query parameters answer 400 in OpenAI's shape, not FastAPI's 422
        first = error.errors()[0] if error.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error_response(APIError(400, f"invalid value for {param!r}: {first.get('msg', error)}", param=param),
                               metrics)

    @app.exception_handler(EngineNotReady)
    async def not_ready(request: Request, error: EngineNotReady) -> JSONResponse:
        return _error_response(APIError(503, str(error), type="server_error",
                                        headers={"Retry-After": RETRY_AFTER_S}), metrics)

    @app.exception_handler(Exception)
    async def internal(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error_response(APIError(500, f"internal error: {type(error).__name__}: {error}",
                                        type="server_error"), metrics)
