"""The router's HTTP front: the server's OpenAI routes, each request forwarded to one replica of its pool.

A request is retried on another replica until it has started streaming to the client: when the chosen replica
refuses the connection, answers 502/503/504 (overloaded, draining, loading), or is lost before the whole JSON
answer (or the first bytes of an event stream) arrived. A stream is committed with its first bytes and then
relayed chunk by chunk as they come, never buffered; if its replica is lost after that, the client gets an SSE
error event and [DONE], so no request ends silently or hangs. "Lost" means a transport error, or the health
probes taking the replica out of the rotation (a stalled process never closes its connections). A lost request
with no other replica in the rotation waits up to retry_wait_s for one to come (back) before it fails.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer.router.handoff import forward_disaggregated
from deepinfer.router.metrics import CONTENT_TYPE, RouterMetrics
from deepinfer.router.policy import NoHealthyReplica
from deepinfer.router.pool import Pool
from deepinfer.router.prompt import CHAT, COMPLETIONS, Prompt
from deepinfer.router.replica import Replica
from deepinfer.router.router import Router
from deepinfer.server.auth import Tenants, auth_checker
from deepinfer.server.protocol import APIError

logger = logging.getLogger("deepinfer.router")

RETRY_STATUSES = (502, 503, 504)
_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
        "accept-encoding", "content-encoding", "date", "server"}
T = TypeVar("T")


class _Lost(Exception):
    """The replica failed before the answer was complete: a transport error or it left the rotation."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause


async def _unless_lost(step: Awaitable[T], replica: Replica, cause: str) -> T:
    """Awaits `step`, unless the replica goes down first; either failure raises _Lost."""
    task, down = asyncio.ensure_future(step), asyncio.ensure_future(replica.wait_down())
    try:
        await asyncio.wait({task, down}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        down.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise _Lost(cause, f"replica {replica.url} left the rotation")
    try:
        return task.result()
    except httpx.TransportError as e:
        replica.mark_down(f"{type(e).__name__} while forwarding: {e}")
        raise _Lost(cause, f"replica {replica.url}: {type(e).__name__}: {e}") from None


def build_router_app(router: Router, tenants: Tenants = Tenants(), max_request_bytes: int = 16 << 20) -> FastAPI:
    metrics = RouterMetrics(router)
    config = router.config

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="deepinfer router", version="0.1.0", lifespan=lifespan)
    app.state.router, app.state.metrics = router, metrics
    _install_error_handlers(app)
    auth = [Depends(auth_checker(tenants))]

    async def forward(request: Request, pool: Pool | None, method: str, path: str, body: bytes,
                      prompt: Prompt | None = None, keys: list[bytes] | None = None) -> Response:
        """Sends the request to replicas of `pool` (any routable replica if None) until one answers."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers["accept-encoding"] = "identity"  # relay bytes as the replica wrote them
        tried: list[Replica] = []
        refused: tuple[int, bytes, dict[str, str]] | None = None  # the last 502/503/504, returned if all refuse
        role = pool.role if pool else "any"
        lost = False  # a replica was lost with this request: wait for another to be in the rotation
        for _ in range(config.max_attempts):
            try:
                replica = _pick(pool, prompt, keys or [], tried)
            except NoHealthyReplica:
                if not (lost and await router.wait_routable(pool, tried, config.retry_wait_s)):
                    break
                replica = _pick(pool, prompt, keys or [], tried)
            tried.append(replica)
            replica.in_flight += 1
            handed_off = False
            try:
                upstream = await _unless_lost(router.http.send(
                    router.http.build_request(method, replica.url + path, content=body or None, headers=headers),
                    stream=True), replica, "lost")
                try:
                    if upstream.status_code in RETRY_STATUSES:
                        content = await _unless_lost(upstream.aread(), replica, "lost")
                        refused = (upstream.status_code, content, _response_headers(upstream))
                        metrics.retry(replica, "unavailable")
                        continue
                    if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                        chunks = upstream.aiter_raw()
                        first = await _unless_lost(anext(chunks, b""), replica, "lost")
                        handed_off = True
                        release = _Release(upstream, replica)
                        return _RelayResponse(_relay(chunks, first, replica, role, release), release,
                                              status_code=upstream.status_code, headers=_response_headers(upstream))
                    content = await _unless_lost(upstream.aread(), replica, "lost")
                    return Response(content, status_code=upstream.status_code, headers=_response_headers(upstream))
                finally:
                    if not handed_off:
                        await upstream.aclose()
            except _Lost as e:
                lost = True
                logger.warning("retrying elsewhere: %s", e)
                metrics.retry(replica, e.cause)
            finally:
                if not handed_off:
                    replica.in_flight -= 1
        if refused is not None:
            metrics.failure(role, "attempts_exhausted")
            status, content, answer_headers = refused
            return Response(content, status_code=status, headers=answer_headers)
        kind = "attempts_exhausted" if tried else "no_replica"
        metrics.failure(role, kind)
        message = (f"no replica could serve the request ({len(tried)} tried)" if tried
                   else "no replica is in the rotation (all down, loading or draining)")
        raise APIError(502 if tried else 503, message, type="server_error", code=kind,
                       headers={"Retry-After": "1"})

    def _pick(pool: Pool | None, prompt: Prompt | None, keys: list[bytes], tried: list[Replica]) -> Replica:
        if pool is None:
            replica = router.any_replica(tried)
            if replica is None:
                raise NoHealthyReplica("no routable replica")
            return replica
        replica, decision = pool.choose(keys, prompt.num_tokens if prompt else 1, tried)
        metrics.decision(replica, decision, len(prompt.token_ids) if prompt else 0, pool.routing.block_size)
        return replica

    async def _relay(chunks: AsyncIterator[bytes], first: bytes, replica: Replica, role: str,
                     release: _Release) -> AsyncIterator[bytes]:
        tail = first[-32:]
        try:
            if first:
                yield first
            while chunk := await _unless_lost(anext(chunks, b""), replica, "lost_while_streaming"):
                yield chunk
                tail = (tail + chunk)[-32:]
            if b"[DONE]" not in tail:
                raise _Lost("lost_while_streaming", f"replica {replica.url} ended the stream without [DONE]")
        except _Lost as e:
            logger.warning("stream cut: %s", e)
            metrics.failure(role, "lost_while_streaming")
            error = APIError(502, f"the replica serving this stream failed: {e}", type="server_error",
                             code="replica_lost")
            yield (b"" if tail.endswith(b"\n\n") else b"\n\n") + f"data: {json.dumps(error.body())}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            await release()

    async def generate(request: Request, path: str) -> Response:
        body = await _read_body(request, max_request_bytes)
        pool = router.pool_for(path)

        def read() -> tuple[Prompt | None, list[bytes]]:  # tokenizing and hashing a long prompt: off the loop
            prompt = router.prompts.read(path, body, request.state.tenant)
            return prompt, pool.block_keys(prompt)

        prompt, keys = await asyncio.to_thread(read)
        if router.disaggregated:  # prefill on one replica, decode on another (router/handoff.py)
            work = forward_disaggregated(forward, request, router, metrics, path, body, prompt, keys)
        else:
            work = forward(request, pool, "POST", path, body, prompt, keys)
        return await _unless_disconnected(request, work)

    @app.post(COMPLETIONS, dependencies=auth)
    async def completions(request: Request) -> Response:
        return await generate(request, COMPLETIONS)

    @app.post(CHAT, dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        return await generate(request, CHAT)

    @app.get("/v1/models", dependencies=auth)
    async def models(request: Request) -> Response:
        return await forward(request, None, "GET", "/v1/models", b"")

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> Response:
        return await forward(request, None, "POST", "/tokenize", await _read_body(request, max_request_bytes))

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> Response:
        return await forward(request, None, "POST", "/detokenize", await _read_body(request, max_request_bytes))

    @app.get("/health")
    async def health() -> JSONResponse:
        if router.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "loading_tokenizer" if not router.tokenizer_settled else "no_replica"},
                            status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/router/state", dependencies=auth)
    async def state() -> JSONResponse:
        return JSONResponse(router.summary())

    return app


class _Release:
    """Ends a relayed stream once: closes the replica's response and counts the request out of its in-flight."""

    def __init__(self, upstream: httpx.Response, replica: Replica) -> None:
        self._upstream, self._replica, self._done = upstream, replica, False

    async def __call__(self) -> None:
        if not self._done:
            self._done = True
            self._replica.in_flight -= 1
            await self._upstream.aclose()


class _RelayResponse(StreamingResponse):
    """Releases the stream however the response ends, even if its body never started (the client left first)."""

    def __init__(self, content: AsyncIterator[bytes], release: _Release, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._release()


def _response_headers(upstream: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body has more than {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """A client that leaves before its (non-streamed) answer cancels the forwarding: the replica sees its
    connection close and aborts the request."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise APIError(499, "the client closed the connection")
    return task.result()


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(error.status_code, str(error.detail), type=kind).body(),
                            status_code=error.status_code, headers=error.headers)
