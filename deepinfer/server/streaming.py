"""One HTTP request's engine outputs: merged as they come, streamed as server-sent events or collected whole, and
the unfinished requests aborted however the response ends (client gone, error)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from deepinfer.engine.client import RequestAborted, RequestStream
from deepinfer.outputs import RequestOutput, merge_delta
from deepinfer.server.metrics import RequestTracker
from deepinfer.server.protocol import APIError
from deepinfer.server.render import Renderer

RETRY_AFTER_S = "1"


async def merge_streams(streams: list[RequestStream], trackers: list[RequestTracker],
                 abort_unfinished: Callable[[], None]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all of one HTTP request's engine requests, as they come.

    Leaving early (client gone, error) aborts whatever has not finished, freeing its KV blocks at once.
    """
    pending: dict[asyncio.Task, int] = {}
    try:
        pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                out = task.result()
                trackers[i].update(out)
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        abort_unfinished()


class SSEResponse(StreamingResponse):
    """Aborts the unfinished requests however the response ends, even if it never started streaming
    (a client that disconnects at once cancels the response before its body iterator runs)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def collect_unless_disconnected(request: Request, outputs: AsyncIterator[tuple[int, RequestOutput]],
                                       count: int) -> list[RequestOutput]:
    async def collect() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * count
        async for i, out in outputs:  # delta outputs: joined into each prompt's whole output
            finals[i] = out if finals[i] is None else merge_delta(finals[i], out)
        return finals

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()  # unwinds _merge, which aborts the unfinished requests
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise APIError(499, "the client closed the connection")
    try:
        return work.result()
    except RequestAborted as e:
        raise APIError(503, str(e), type="server_error", headers={"Retry-After": RETRY_AFTER_S}) from None


async def sse_events(renderer: Renderer, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
    try:
        for chunk in renderer.first_chunks():
            yield f"data: {chunk}\n\n"
        async for i, out in outputs:
            for chunk in renderer.chunks(i, out):
                yield f"data: {chunk}\n\n"
        for chunk in renderer.last_chunks():
            yield f"data: {chunk}\n\n"
    except RequestAborted as e:
        yield f"data: {json.dumps(APIError(503, str(e), type='server_error').body())}\n\n"
    finally:
        await outputs.aclose()
    yield "data: [DONE]\n\n"
