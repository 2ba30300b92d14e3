"""The scheduler's half of KV that arrives from elsewhere: KV store loads that break, background loads and pulls from
prefill engines that finish, and blocks held for a decode engine to pull. A base of core/scheduler.Scheduler, which
owns the state these methods read (kv, loads, connector, running, held) and _preempt / _new_request_data."""
from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.core.kv_loading import AsyncKVLoads
from deepinfer.core.kv_manager import LOAD, KVCacheManager, PrefixHit
from deepinfer.core.plan import KVPull, StepPlan, StepResult
from deepinfer.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from deepinfer.kvstore.connector import KVStoreConnector


class KVArrivals:
    kv: KVCacheManager
    loads: AsyncKVLoads | None
    connector: KVStoreConnector | None
    running: list[Request]
    requests: dict[str, Request]
    held: dict[str, Request]

    def take_arrivals(self) -> dict[str, bool]:
        """Decode requests whose prompt KV from a prefill engine arrived since the last call: True if all of it did."""
        if self.loads is None or not self.loads.arrivals:
            return {}
        arrivals, self.loads.arrivals = self.loads.arrivals, {}
        return arrivals

    def release_held(self, request_id: str) -> None:
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv.free(request)

    def _admit_pull(self, plan: StepPlan, request: Request, hit: PrefixHit) -> bool:
        """Admits a decode request whose prompt KV a prefill engine holds: it takes blocks for every position, and the
        ones the device cache lacks (the partial last block included) are pulled while it waits. False: no room."""
        n = request.num_tokens - hit.num_tokens  # the prompt's uncached tail and the first output token's position
        if not self.kv.can_allocate(request, n, hit):
            return False
        block_ids = self.kv.allocate(request, n, hit)
        self.waiting.popleft()
        self.kv.count_lookup(request.num_tokens, hit)
        remote = request.remote_kv
        first = sum(b != LOAD for b in hit.blocks[0])  # device-cached blocks come first, pulled ones after
        end = -(-remote.num_tokens // self.kv.block_size)
        table = self.kv.block_ids(request.request_id)
        plan.kv_pulls[request.request_id] = KVPull(remote.address, remote.handoff_id, list(range(first, end)),
                                                   table[first:end])
        request.num_computed_tokens = request.num_cached_tokens = remote.num_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loads.start(request, end - first)
        plan.new_requests.append(self._new_request_data(request, block_ids))
        return True

    def _loads_done(self, done: dict[str, int]) -> None:
        """Background loads the worker finished: a request runs from its first block that did not arrive."""
        for request_id, num_ok in done.items():
            orphan = self.loads.orphans.pop(request_id, None)
            if orphan is not None:
                self.kv.free(orphan)
                continue
            request = self.loads.loading.pop(request_id, None)
            promised = self.loads.promised.pop(request_id, 0)
            if request is None:
                continue
            self.loads.forget(request_id)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            remote, request.remote_kv = request.remote_kv, None  # a later preemption recomputes locally
            if remote is not None:
                self.loads.arrived(request_id, num_ok == promised)
            if remote is not None and remote.path == "direct":
                if num_ok < promised:  # the pulled blocks are the prompt's last `promised`; a broken one ends them
                    end = -(-remote.num_tokens // self.kv.block_size)
                    request.num_computed_tokens = min(remote.num_tokens, (end - promised + num_ok) * self.kv.block_size)
                    if request.num_preemptions == 0:
                        request.num_cached_tokens = request.num_computed_tokens
            elif num_ok < promised:
                self._roll_back(request, promised - num_ok)

    def _roll_back_failed_loads(self, plan: StepPlan, result: StepResult) -> None:
        """Loads inside the step (no background loads): a request whose chain broke sat this step out."""
        for request_id, num_ok in result.kv_load_failures.items():
            request = self.requests.get(request_id)
            lost = len(plan.kv_loads.get(request_id, ())) - num_ok
            if request is None or request.status is not RequestStatus.RUNNING:
                if self.connector is not None:
                    self.connector.count_failed(lost)
                continue
            self._roll_back(request, lost)

    def _roll_back(self, request: Request, num_lost_blocks: int) -> None:
        """A block the store promised but did not deliver, and every block after it, is recomputed. With layer
        groups a lost block can break any window, so the request starts over without the store."""
        if self.connector is not None:
            self.connector.count_failed(num_lost_blocks)
        if self.kv.layout.is_hybrid:
            self.running.remove(request)
            self._preempt(request)
            request.use_kv_store, request.num_cached_tokens = False, 0
            return
        lost = num_lost_blocks * self.kv.block_size
        request.num_computed_tokens -= lost
        if request.num_preemptions == 0:
            request.num_cached_tokens -= lost
