"""Asynchronous KV loads, the scheduler half: nothing in a step waits for the store.

- Lookups: when a request reaches the head of the queue, one background thread asks the store which of its
  blocks it holds (every group's key, one by one); until the answer is in, that request is not admitted (the ones
  already running go on). The answer is a set of keys, so the prefix-cache lookup then runs from memory.
- Loads: a request admitted with blocks to load waits in WAITING_FOR_REMOTE_KVS, holding its blocks, while the
  worker fills them in the background; the step that reports the load done (StepResult.kv_loads_done) makes it
  run, after rolling back past any block that did not arrive intact.
- A request finished while its blocks are still being written keeps them until the write is done.
- Disaggregation: a decode request's prompt KV pulled from a prefill engine (or found in the store) is the same kind
  of background load; `arrivals` records when each one's KV arrived and whether all of it did.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

from deepinfer.core.request import Request


class AsyncKVLoads:
    def __init__(self, contains: Callable[[Sequence[bytes]], int]) -> None:
        self._contains = contains
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-lookup")
        self._lookups: dict[str, Future] = {}
        self.loading: dict[str, Request] = {}  # waiting for their blocks
        self.promised: dict[str, int] = {}  # blocks each loading request expects
        self.orphans: dict[str, Request] = {}  # finished while loading: freed when the load lands
        self.arrivals: dict[str, bool] = {}  # remote prompt KV that arrived since the engine last took them: complete?

    def prefetch(self, requests: list[tuple[Request, Callable[[], list[bytes]]]]) -> None:
        """Starts one background lookup for every request given that has none, so a batch of arrivals is answered
        together (and admitted in one step, as without a store)."""
        new = [(r.request_id, keys()) for r, keys in requests if r.request_id not in self._lookups]
        if not new:
            return
        future = self._pool.submit(self._present, new)
        for request_id, _ in new:
            self._lookups[request_id] = future

    def store_view(self, request: Request, keys: Callable[[], list[bytes]]) -> Callable[[Sequence[bytes]], int] | None:
        """How many leading keys of a query the store holds, answered from this request's finished lookup; None
        while the lookup runs (started here if it was not)."""
        self.prefetch([(request, keys)])
        future = self._lookups[request.request_id]
        if not future.done():
            return None
        present = future.result().get(request.request_id, frozenset())
        return lambda query: next((i for i, k in enumerate(query) if k not in present), len(query))

    def _present(self, batch: list[tuple[str, list[bytes]]]) -> dict[str, frozenset[bytes]]:
        found: dict[str, frozenset[bytes]] = {}
        for request_id, keys in batch:
            try:
                found[request_id] = frozenset(k for k in keys if self._contains([k]))
            except Exception:  # an unreachable store holds nothing: the request computes everything
                found[request_id] = frozenset()
        return found

    def forget(self, request_id: str) -> None:
        future = self._lookups.pop(request_id, None)
        if future is not None:
            future.cancel()

    def start(self, request: Request, num_blocks: int) -> None:
        self.loading[request.request_id] = request
        self.promised[request.request_id] = num_blocks

    def arrived(self, request_id: str, complete: bool) -> None:
        self.arrivals[request_id] = complete

    def __len__(self) -> int:
        return len(self.loading)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
