"""Disaggregation, the engine half: what a prefill or a decode engine does around its steps (disagg/ has the rest).

Prefill role: a request with do_remote_decode (max_tokens 1) runs as usual; when it finishes, its answer carries
kv_transfer_params. On the direct path its blocks stay held (Scheduler.held) and are offered on the hand-off socket
until a decode engine pulls them or kv_handoff_timeout_s passes; on the store path its full blocks went to the KV store
as they filled, and the answer waits until the store has them (flush).

Decode role: a request with do_remote_prefill starts with the prefill's first token as its first output token (streamed
at once) and its prompt's KV elsewhere (Request.remote_kv): the scheduler admits it holding blocks for the prompt and
the worker pulls them, or loads them from the store, while it waits. If the prompt's tokens differ from the prefill's,
the store has no engine here, or the KV does not arrive whole within the timeout, the prompt is computed here (a
fallback, counted), and the answer is the same.
"""
from __future__ import annotations

import logging
import secrets
import time
from typing import TYPE_CHECKING

from deepinfer.config import DisaggConfig
from deepinfer.core.request import RemoteKV, Request
from deepinfer.disagg.params import KVTransferParams, check_request, prompt_key
from deepinfer.disagg.stats import BYTES_BOUNDS, LATENCY_BOUNDS, Buckets, HandoffStats

__all__ = ["EngineHandoff", "HandoffStats", "KVTransferParams"]
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.core.kv_manager import KVCacheManager
    from deepinfer.core.plan import StepResult
    from deepinfer.core.scheduler import Scheduler
    from deepinfer.kvstore.connector import KVStoreConnector
    from deepinfer.worker.executor import Executor

logger = logging.getLogger("deepinfer.disagg")

SHARED_TIERS = ("disk", "redis")  # a memory tier lives in one process: a decode engine never sees it
IDLE_WAIT_S = 0.05  # an idle prefill engine holding hand-offs looks at them this often


class EngineHandoff:
    def __init__(self, config: DisaggConfig, scheduler: Scheduler, kv: KVCacheManager,
                 kv_store: KVStoreConnector | None, executor: Executor, num_blocks: int, block_bytes: int,
                 vocab_size: int) -> None:
        self.config, self.role, self.vocab_size = config, config.role, vocab_size
        self.scheduler, self.kv, self.kv_store = scheduler, kv, kv_store
        self.block_bytes = block_bytes
        self.server = self.puller = None
        self._prefills: dict[str, str | None] = {}  # prefill: request id -> cache salt
        self._held: dict[str, tuple[str, float]] = {}  # prefill, direct: handoff id -> (request id, deadline)
        self._announce: list[Request] = []  # decode: requests whose first token is not out yet
        self._first_logprobs: dict[str, dict[int, float]] = {}
        self._started: dict[str, float] = {}  # decode: request id -> arrival (monotonic), until its KV arrived
        self._counts = dict.fromkeys(("offered", "pulled", "released", "expired", "remote_requests", "received",
                                      "fallbacks"), 0)
        self._sent = Buckets(BYTES_BOUNDS)
        self._offer_seconds = 0.0
        self._latency = Buckets(LATENCY_BOUNDS)
        if self.role == "both":
            return
        if kv.layout.is_hybrid:
            raise ValueError(f"role={self.role!r}: models with sliding-window layer groups are not disaggregated yet")
        runner = getattr(executor, "runner", None)
        if runner is None:
            raise ValueError(f"role={self.role!r} needs the in-process executor (not expert parallelism)")
        from deepinfer.disagg.transfer import HandoffPuller, HandoffServer  # zmq: only where a role needs it

        if self.role == "prefill" and config.kv_handoff == "direct":
            self.server = HandoffServer(runner.slot_caches, num_blocks, kv.block_size, config.kv_handoff_host,
                                        config.kv_handoff_port)
            logger.info("prefill role: KV hand-offs served directly at %s", self.server.address)
        elif self.role == "prefill":
            kinds = kv_store.store.config.kinds if kv_store is not None else ()
            if not set(kinds) & set(SHARED_TIERS):
                raise ValueError(f"--kv-handoff store needs a KV store tier the decode engines share ({SHARED_TIERS}); "
                                 f"this engine has {list(kinds) or 'none'}")
            logger.info("prefill role: KV hand-offs through the KV store (%s)", ", ".join(kinds))
        elif runner.device.type == "cpu":
            self.puller = HandoffPuller(runner.slot_caches, num_blocks, kv.block_size, config.kv_handoff_timeout_s)
            runner.kv_puller = self.puller
        else:
            logger.warning("decode role on %s: direct hand-offs are computed here (only the store path loads KV)",
                           runner.device)

    @property
    def busy(self) -> bool:
        """Hand-offs held for decode engines: the engine keeps stepping to release them when pulled or late."""
        return bool(self._held)

    # ---- arrival ------------------------------------------------------------------------------------------------
    def check(self, transfer: KVTransferParams | None, params: SamplingParams) -> None:
        """Raises ValueError for a hand-off this engine does not take."""
        if transfer is None:
            return
        wanted = "prefill" if transfer.do_remote_decode else "decode"
        if self.role != wanted:
            field = "do_remote_decode" if wanted == "prefill" else "do_remote_prefill"
            raise ValueError(f"kv_transfer_params with {field} goes to a {wanted} engine; this one's role is "
                             f"{self.role!r}")
        check_request(transfer, 1, params, stream=False)
        tokens = [transfer.first_token_id, *(t for t, _ in transfer.first_token_logprobs or ())]
        if transfer.do_remote_prefill and not all(0 <= t < self.vocab_size for t in tokens):
            raise ValueError(f"kv_transfer_params names token ids outside the vocabulary [0, {self.vocab_size}): "
                             f"{[t for t in tokens if not 0 <= t < self.vocab_size]}")

    def prepare(self, request: Request, transfer: KVTransferParams | None) -> None:
        """Before the scheduler sees the request (check()ed): marks a prefill to hand over, or gives a decode request
        its first token and the place its prompt's KV is."""
        if transfer is None:
            return
        rid = request.request_id
        if transfer.do_remote_decode:
            request.hold_kv = self.server is not None
            self._prefills[rid] = request.params.cache_salt
            return
        self._counts["remote_requests"] += 1
        key = prompt_key(self.kv.model_key, request.params.cache_salt, request.prompt_token_ids)
        if key != transfer.prompt_key:
            logger.warning("%s: the prompt's %d tokens here differ from the prefill's %d; computing it here", rid,
                           request.num_prompt_tokens, transfer.num_prompt_tokens)
            self._counts["fallbacks"] += 1
            return
        request.output_token_ids.append(transfer.first_token_id)
        if request.params.logprobs is not None and transfer.first_token_logprobs is not None:
            self._first_logprobs[rid] = dict(transfer.first_token_logprobs)
        self._announce.append(request)
        if transfer.path == "direct" and self.puller is not None:
            request.remote_kv = RemoteKV("direct", transfer.num_prompt_tokens, transfer.remote_address,
                                         transfer.handoff_id)
        elif transfer.path == "store" and self.kv_store is not None:
            request.remote_kv = RemoteKV("store", transfer.num_prompt_tokens)
        else:
            self._counts["fallbacks"] += 1
            return
        self._started[rid] = time.monotonic()

    def aborted(self, request: Request | None) -> None:
        """Forgets an aborted request; a decode request that never started its pull lets its hand-off go."""
        if request is None:
            return
        rid = request.request_id
        self._prefills.pop(rid, None)
        self._first_logprobs.pop(rid, None)
        self._started.pop(rid, None)
        remote = request.remote_kv
        loading = self.scheduler.loads is not None and rid in self.scheduler.loads.orphans
        if remote is not None and remote.path == "direct" and self.puller is not None and not loading:
            self.puller.release(remote.address, remote.handoff_id)

    # ---- around a step ------------------------------------------------------------------------------------------
    def before_step(self, idle: bool) -> None:
        """Prefill: releases the blocks of hand-offs pulled, let go or past their time (waiting a little for one when
        the engine has nothing else to do)."""
        if self.server is None or not self._held:
            return
        if idle and not self.server.event.is_set():
            self.server.event.wait(IDLE_WAIT_S)
        for served in self.server.take_done():
            request_id, _ = self._held.pop(served.handoff_id, (None, 0.0))
            if request_id is not None:
                self.scheduler.release_held(request_id)
                self._counts[served.outcome] += 1
                if served.num_bytes:
                    self._sent.observe(served.num_bytes)
        now = time.monotonic()
        for handoff_id, (request_id, deadline) in list(self._held.items()):
            if deadline <= now and self.server.withdraw(handoff_id):
                del self._held[handoff_id]
                self.scheduler.release_held(request_id)
                self._counts["expired"] += 1
                logger.warning("hand-off %s (%s) was not pulled within %.1fs; its blocks are released", handoff_id,
                               request_id, self.config.kv_handoff_timeout_s)

    def after_update(self, advanced: list[Request], result: StepResult) -> list[Request]:
        """Decode: counts the hand-offs whose KV arrived; puts the requests whose first token is not out yet first in
        `advanced` (with that token's logprobs in `result`)."""
        now = time.monotonic()
        for request_id, complete in self.scheduler.take_arrivals().items():
            started = self._started.pop(request_id, None)
            if started is not None:
                self._latency.observe(now - started)
            self._counts["received" if complete else "fallbacks"] += 1
        if not self._announce:
            return advanced
        announced, self._announce = self._announce, []
        for request in announced:
            logprobs = self._first_logprobs.pop(request.request_id, None)
            if logprobs is not None:
                result.logprobs[request.request_id] = [logprobs, *result.logprobs.get(request.request_id, ())]
            remote = request.remote_kv
            if request.is_finished and remote is not None:  # its first token ended it: none of the KV is needed
                self._started.pop(request.request_id, None)
                if remote.path == "direct":
                    self.puller.release(remote.address, remote.handoff_id)
        return announced + [r for r in advanced if r not in announced]

    def finish_outputs(self, outputs: list[RequestOutput]) -> None:
        """Prefill: the finished hand-offs' answers get kv_transfer_params; their KV is offered, or in the store."""
        for out in outputs:
            if not out.finished or out.request_id not in self._prefills:
                continue
            salt = self._prefills.pop(out.request_id)
            seq = out.outputs[0]
            if seq.finish_reason == "abort" or not seq.token_ids:
                continue
            num_tokens, started = len(out.prompt_token_ids), time.perf_counter()
            transfer = dict(path=self.config.kv_handoff, num_prompt_tokens=num_tokens, first_token_id=seq.token_ids[0],
                            first_token_logprobs=tuple(seq.logprobs[0].items()) if seq.logprobs else None,
                            prompt_key=prompt_key(self.kv.model_key, salt, list(out.prompt_token_ids)))
            if self.server is not None:
                handoff_id = secrets.token_hex(16)
                blocks = self.kv.block_ids(out.request_id)[: -(-num_tokens // self.kv.block_size)]
                self.server.offer(handoff_id, blocks)
                self._held[handoff_id] = (out.request_id, time.monotonic() + self.config.kv_handoff_timeout_s)
                transfer |= dict(remote_address=self.server.address, handoff_id=handoff_id)
            else:  # the store path: its full blocks were queued for the store as they filled
                if not self.kv_store.flush(self.config.kv_handoff_timeout_s):
                    logger.warning("%s: the KV store did not take its blocks within %.1fs; the decode engine will "
                                   "compute what is missing", out.request_id, self.config.kv_handoff_timeout_s)
                self._sent.observe(num_tokens // self.kv.block_size * self.block_bytes)
            self._counts["offered"] += 1
            self._offer_seconds += time.perf_counter() - started
            out.kv_transfer_params = KVTransferParams(do_remote_prefill=True, **transfer).to_json()

    # ---- reporting ----------------------------------------------------------------------------------------------
    def stats(self) -> HandoffStats | None:
        if self.role == "both":
            return None
        held = sum(len(self.kv.block_ids(rid)) for rid in self.scheduler.held)
        puller = self.puller
        return HandoffStats(role=self.role, path=self.config.kv_handoff, held_blocks=held,
                            sent_bytes=self._sent.snapshot(), offer_seconds=self._offer_seconds,
                            received_bytes=puller.received_bytes if puller else 0,
                            transfer_seconds=puller.transfer_seconds if puller else 0.0,
                            latency=self._latency.snapshot(), **self._counts)

    def close(self) -> None:
        for part in (self.server, self.puller):
            if part is not None:
                part.close()

