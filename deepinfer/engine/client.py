"""AsyncEngineClient: the Engine's step loop on one background thread, bridged to asyncio.

Why a thread and not a process: torch releases the GIL inside its kernels, so the HTTP event loop
keeps running while a step computes, and a thread costs no pickling or IPC of prompts and outputs.
On a 2-core box a second process would only add copies and context switches. The Engine is not
thread-safe, so exactly one thread (the one started here) ever calls add_request / abort_request /
step; everything else reaches it through a thread-safe command queue that the engine thread drains
between steps. Outputs go back in one loop.call_soon_threadsafe per step and are fanned out on the
event loop into per-request streams, so the HTTP side never blocks on a model step.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deepinfer.outputs import RequestOutput, merge_delta
from deepinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.disagg.params import KVTransferParams
    from deepinfer.engine.engine import Engine, EngineStats, ReplicaStatus

logger = logging.getLogger("deepinfer.client")


class EngineOverloaded(RuntimeError):
    """The engine's waiting queue is at max_waiting_requests; retry later."""


def default_max_waiting(num_blocks: int, max_num_seqs: int) -> int:
    """The waiting-queue bound when none is configured: the KV cache's block count, and at least max_num_seqs.

    Every admitted sequence holds at least one KV block, so a queue longer than the cache has blocks could not be
    admitted even if every running sequence finished at once; past that the engine answers 503 + Retry-After (the
    client retries, or a router sends the request elsewhere) instead of letting memory grow until the process dies.
    """
    return max(num_blocks, max_num_seqs)


class EngineNotReady(RuntimeError):
    """The engine is still loading, failed to load, or has shut down."""


class RequestAborted(RuntimeError):
    """The request was aborted by the server (shutdown, drain timeout, engine failure)."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    accepted: asyncio.Future
    kv_transfer: KVTransferParams | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stop:
    pass


@dataclass
class _Call:
    """Runs fn(engine) on the engine thread between steps (read-only queries that must not race a step)."""
    fn: Callable[[Engine], Any]
    done: asyncio.Future


class RequestStream:
    """The outputs of one request, in order. A slow reader gets what piled up as one output: the newest (cumulative
    outputs) or the pile joined (delta outputs)."""

    def __init__(self, request_id: str, delta: bool = False) -> None:
        self.request_id = request_id
        self.delta = delta
        self._items: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._ready = asyncio.Event()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and not self._items:
            raise StopAsyncIteration
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        latest = self._items.popleft()
        while self._items and isinstance(latest, RequestOutput) and not latest.finished:
            later = self._items.popleft()
            latest = merge_delta(latest, later) if self.delta and isinstance(later, RequestOutput) else later
        if isinstance(latest, BaseException):
            self.finished = True
            raise latest
        if latest.finished:
            self.finished = True
        return latest


class AsyncEngineClient:
    """Asyncio front of one Engine. Create and use it on one event loop; call start() inside it.

    ``engine_factory`` runs on the engine thread, so the model loads without blocking the loop
    (the server answers /health with 503 meanwhile).
    """

    def __init__(self, engine_factory: Callable[[], Engine]) -> None:
        self._factory = engine_factory
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop | _Call] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loaded: asyncio.Future | None = None
        self._engine: Engine | None = None
        self._stats: EngineStats | None = None
        self._dead: BaseException | None = None
        self._live: set[str] = set()  # request ids inside the engine; touched only by the engine thread
        self.step_failures = 0  # engine steps that raised (each aborted every request in flight)

    # ---- life cycle (event loop side) -----------------------------------------------------
    def start(self) -> None:
        """Starts the engine thread; idempotent. Returns at once: the model loads in the thread."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loaded = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    async def wait_ready(self) -> Engine:
        """The loaded engine (read-only use: its config, tokenizer, max_model_len); raises if loading failed."""
        if self._loaded is None:
            raise EngineNotReady("the engine client was not started")
        return await asyncio.shield(self._loaded)

    @property
    def ready(self) -> bool:
        return self._engine is not None and self._dead is None

    @property
    def engine(self) -> Engine:
        """For read-only attributes only; never call its request methods from outside the engine thread."""
        if self._engine is None:
            raise EngineNotReady("the model is still loading" if self._dead is None else f"the engine failed: {self._dead}")
        return self._engine

    def stats(self) -> EngineStats | None:
        """The engine's stats after its latest step (None while loading)."""
        return self._stats

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def max_waiting_requests(self) -> int:
        """Sequences that may wait for the engine at once (configured, or derived from the KV capacity)."""
        sc = self.engine.config.scheduler
        if sc.max_waiting_requests is not None:
            return sc.max_waiting_requests
        return default_max_waiting(self.engine.num_blocks, sc.max_num_seqs)

    async def shutdown(self) -> None:
        """Aborts what is in flight and stops the engine thread."""
        self.abort_all()
        if self._thread is None:
            return
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join)

    # ---- requests (event loop side) --------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          arrival_time: float | None = None,
                          kv_transfer: KVTransferParams | None = None) -> RequestStream:
        """Queues a request once the engine thread has validated it.

        Raises ValueError (bad prompt or params), EngineOverloaded (waiting queue full) or
        EngineNotReady, before anything is queued. The caller must abort() the request if it
        stops reading the stream before it finishes.
        """
        if not self.ready:
            raise EngineNotReady("the model is still loading" if self._dead is None else f"the engine failed: {self._dead}")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, delta=getattr(params, "output_kind", None) == "delta")
        self._streams[request_id] = stream
        accepted = self._loop.create_future()
        self._commands.put(_Add(request_id, prompt, params, time.time() if arrival_time is None else arrival_time, accepted,
                                kv_transfer))
        try:
            await accepted
        except BaseException:
            # On cancellation the add may still land; the abort queued behind it undoes it.
            self.abort(request_id)
            raise
        return stream

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yields outputs (of params.output_kind) until the request finishes; aborts it if the caller stops early."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str, reason: BaseException | None = None) -> None:
        """Frees the request's KV blocks at the engine's next step boundary. Idempotent."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        if reason is not None:
            stream.put(reason)
        self._commands.put(_Abort(request_id))

    def abort_all(self, reason: str = "aborted by the server") -> None:
        for request_id in list(self._streams):
            self.abort(request_id, RequestAborted(reason))

    # ---- tokenization (event loop side; the tokenizer is read-only after load) ------------
    async def tokenize(self, prompt: str | list[int]) -> list[int]:
        return await asyncio.to_thread(self.engine.tokenize, prompt)

    async def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                                  continue_final_message: bool = False) -> list[int]:
        return await asyncio.to_thread(self.engine.apply_chat_template, messages, add_generation_prompt,
                                       continue_final_message)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await asyncio.to_thread(self.engine.tokenizer.decode, token_ids)

    async def replica_status(self, since: int | None, epoch: str | None) -> ReplicaStatus:
        """Engine.replica_status, answered between two steps (at once when the engine is idle)."""
        if not self.ready:
            raise EngineNotReady("the model is still loading" if self._dead is None else f"the engine failed: {self._dead}")
        done = self._loop.create_future()
        self._commands.put(_Call(lambda engine: engine.replica_status(since, epoch), done))
        return await done

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._factory()
        except BaseException as e:  # noqa: BLE001 - reported to the loop, which decides to exit
            logger.exception("engine failed to load")
            self._dead = e
            self._loop.call_soon_threadsafe(_settle, self._loaded, None, e)
            return
        self._stats = engine.stats()
        self._engine = engine
        self._loop.call_soon_threadsafe(_settle, self._loaded, engine, None)
        while True:
            if not self._apply_commands(engine, block=not engine.has_unfinished_requests()):
                break
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - one bad step must not kill the server
                logger.exception("engine step failed; aborting every request in flight")
                self.step_failures += 1
                self._abort_in_engine(engine)
                self._loop.call_soon_threadsafe(self._fail_all, e)
                continue
            finally:
                self._stats = engine.stats()
            for out in outputs:  # (each output's metrics are already a snapshot: RequestState.to_output)
                if out.finished:
                    self._live.discard(out.request_id)
            if outputs:
                self._loop.call_soon_threadsafe(self._dispatch, outputs)
        self._abort_in_engine(engine)

    def _apply_commands(self, engine: Engine, block: bool) -> bool:
        """Drains the command queue; False once a stop command arrives."""
        command = self._commands.get() if block else _get_nowait(self._commands)
        while command is not None:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Call):
                try:
                    self._loop.call_soon_threadsafe(_settle, command.done, command.fn(engine), None)
                except Exception as e:  # noqa: BLE001 - the caller gets the error
                    self._loop.call_soon_threadsafe(_settle, command.done, None, e)
            elif isinstance(command, _Abort):
                engine.abort_request(command.request_id)
                self._live.discard(command.request_id)
            else:
                self._add(engine, command)
            command = _get_nowait(self._commands)
        self._stats = engine.stats()
        return True

    def _add(self, engine: Engine, command: _Add) -> None:
        error: BaseException | None = None
        limit = self.max_waiting_requests
        waiting = engine.stats().num_waiting
        if waiting + command.params.n > limit:
            error = EngineOverloaded(f"{waiting} requests are waiting, the limit is {limit}")
        else:
            try:
                engine.add_request(command.request_id, command.prompt, command.params, command.arrival_time,
                                   command.kv_transfer)
                self._live.add(command.request_id)
            except ValueError as e:
                error = e
        self._loop.call_soon_threadsafe(_settle, command.accepted, None, error)

    def _abort_in_engine(self, engine: Engine) -> None:
        for request_id in self._live:
            engine.abort_request(request_id)
        self._live.clear()

    # ---- back on the event loop ----------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by the caller; the engine drops it at the next command drain
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.put(RequestAborted(f"engine step failed: {error}"))
        self._streams.clear()


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _get_nowait(q: queue.SimpleQueue) -> Any:
    try:
        return q.get_nowait()
    except queue.Empty:
        return None
