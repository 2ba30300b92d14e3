"""The worker half of the KV store: copies whole blocks between the device KV cache and store payloads.

A payload is a 4-byte magic, a 16-byte digest of the cache layout (dtype, block size, every cache
tensor's elements per token), then for each cache tensor in order (layer 0 K, layer 0 V, layer 1 K,
...) the block's block_size rows, raw. A payload whose magic, digest or length does not match this
cache is a failed load, exactly like a missing one: the request recomputes from that block.
"""
from __future__ import annotations

from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from hashlib import blake2b

import numpy as np
import torch

from deepinfer.core.plan import StepPlan
from deepinfer.kvstore.base import KVStore
from deepinfer.kvstore.saver import AsyncSaver
from deepinfer.layers.attention import cache_copy

MAGIC = b"DKB1"


def block_views(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int,
                block_size: int) -> list[torch.Tensor]:
    """[num_blocks, block_size, elements per token] views sharing the caches' storage (layer 0 K, layer 0 V, ...);
    empty tensors carry nothing and are left out."""
    tensors = [t for pair in kv_caches for t in pair]
    if not tensors:
        raise ValueError("moving KV blocks needs at least one KV cache tensor")
    return [t.view(num_blocks, block_size, t.numel() // (num_blocks * block_size)) for t in tensors if t.numel()]


def layout_header(views: list[torch.Tensor], block_size: int) -> bytes:
    """MAGIC + a digest of the cache layout (dtype, block size, every tensor's elements per token): a block's bytes
    mean the same thing in two caches exactly when their headers are equal."""
    layout = f"{views[0].dtype}|{block_size}|{[v.shape[2] for v in views]}"
    return MAGIC + blake2b(layout.encode(), digest_size=16).digest()


class KVBlockTransfer:
    """`load` before a step's forward, `save` after it. Expects each cache tensor block-major:
    [num_blocks * block_size, ...] (or [num_blocks, block_size, ...]), contiguous."""

    def __init__(self, store: KVStore, saver: AsyncSaver, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 num_blocks: int, block_size: int) -> None:
        self.store = store
        self.saver = saver
        self._views = block_views(kv_caches, num_blocks, block_size)
        self.dtype = self._views[0].dtype
        self.device = self._views[0].device
        elem = self._views[0].element_size()
        self._row_bytes = [v.shape[1] * v.shape[2] * elem for v in self._views]
        self.header = layout_header(self._views, block_size)
        self.payload_bytes = len(self.header) + sum(self._row_bytes)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-load")
        self._pending: dict[str, futures.Future] = {}

    def load(self, plan: StepPlan) -> dict[str, int]:
        """Fills plan.kv_loads from the store; returns, per request whose chain broke, how many blocks arrived."""
        failures: dict[str, int] = {}
        block_ids: list[int] = []
        bodies: list[bytes] = []
        for request_id, refs in plan.kv_loads.items():
            for i, ref in enumerate(refs):
                payload = self.store.get(ref.key)
                if payload is None or len(payload) != self.payload_bytes or not payload.startswith(self.header):
                    failures[request_id] = i
                    break
                block_ids.append(ref.block_id)
                bodies.append(payload)
        if block_ids:
            self._write(block_ids, bodies)
        return failures

    def start_loads(self, plan: StepPlan) -> None:
        """Starts filling plan.kv_loads in a background thread (one request at a time, in order); `poll` reports
        them. The blocks belong to requests that do not run until then, so the forward never reads them."""
        for request_id, refs in plan.kv_loads.items():
            self._pending[request_id] = self._loader.submit(self._load_one, list(refs))

    def poll(self, wait: float = 0.0) -> dict[str, int]:
        """Finished background loads: request id -> how many leading blocks arrived intact. With `wait`, waits up
        to that many seconds for the first one when none is done (an idle engine has nothing else to do)."""
        if wait and self._pending and not any(f.done() for f in self._pending.values()):
            futures.wait(list(self._pending.values()), timeout=wait, return_when=futures.FIRST_COMPLETED)
        done = {rid: f.result() for rid, f in self._pending.items() if f.done()}
        for rid in done:
            del self._pending[rid]
        return done

    @property
    def loading(self) -> bool:
        return bool(self._pending)

    def _load_one(self, refs: list) -> int:
        block_ids, bodies = [], []
        for ref in refs:
            try:
                payload = self.store.get(ref.key)
            except Exception:  # a store that fails mid-load: what arrived so far counts
                payload = None
            if payload is None or len(payload) != self.payload_bytes or not payload.startswith(self.header):
                break
            block_ids.append(ref.block_id)
            bodies.append(payload)
        if block_ids:
            self._write(block_ids, bodies)
        return len(block_ids)

    def save(self, plan: StepPlan, first: bool = False) -> None:
        """Hands plan.kv_saves to the saver after the forward that filled them, or plan.kv_saves_first (`first`)
        before the forward. Never blocks on the store."""
        refs = [ref for refs in (plan.kv_saves_first if first else plan.kv_saves).values() for ref in refs]
        if not refs:
            return
        rows = self._read([ref.block_id for ref in refs])
        for ref, row in zip(refs, rows):
            self.saver.save(ref.key, self.header + row.tobytes(), ref.ttl_class)

    def _read(self, block_ids: list[int]) -> np.ndarray:
        """uint8 [len(block_ids), body bytes] on the host."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        parts = [v.index_select(0, index).reshape(len(block_ids), -1).view(torch.uint8) for v in self._views]
        return torch.cat(parts, dim=1).cpu().numpy()

    def _write(self, block_ids: list[int], payloads: list[bytes]) -> None:
        skip = len(self.header)
        host = np.frombuffer(bytearray().join(memoryview(p)[skip:] for p in payloads), dtype=np.uint8)
        data = torch.from_numpy(host.reshape(len(payloads), -1)).to(self.device)
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        offset = 0
        for view, size in zip(self._views, self._row_bytes):
            part = data[:, offset : offset + size].contiguous().view(self.dtype).view(len(block_ids), *view.shape[1:])
            cache_copy(view, index, part)
            offset += size
