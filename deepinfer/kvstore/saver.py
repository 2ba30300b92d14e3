"""Saves blocks off the engine's critical path: a bounded queue drained by one daemon thread."""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

from deepinfer.kvstore.base import KVStore


@dataclass(frozen=True)
class SaverStats:
    queued: int  # accepted by save()
    saved: int  # put() returned (the store counts its own faults)
    dropped: int  # refused by save(): queue full or saver closed
    failed: int  # put() raised, which a store should never do
    pending: int  # accepted and not yet finished


class AsyncSaver:
    """`save` never blocks: when the queue is full the block is dropped and counted.

    A dropped save only costs a future recompute. The expiry time is fixed when
    `save` is called, not when the thread gets to it.
    """

    def __init__(self, store: KVStore, queue_size: int | None = None) -> None:
        size = store.config.save_queue_size if queue_size is None else queue_size
        if size < 1:
            raise ValueError(f"queue_size must be >= 1, got {size}")
        self.store = store
        self._queue: queue.Queue[tuple[bytes, bytes, float] | None] = queue.Queue(maxsize=size)  # None: stop
        self._cond = threading.Condition()
        self._counts = {"queued": 0, "saved": 0, "dropped": 0, "failed": 0, "pending": 0}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-saver", daemon=True)
        self._thread.start()

    def save(self, key: bytes, payload: bytes, ttl_class: str | None = None) -> bool:
        """Queues the block; False (and counted) if it was dropped. Raises ValueError on an unknown ttl class."""
        expires_at = self.store.clock() + self.store.config.ttl_for(ttl_class)
        with self._cond:
            if self._closed:
                self._counts["dropped"] += 1
                return False
            try:
                self._queue.put_nowait((key, payload, expires_at))
            except queue.Full:
                self._counts["dropped"] += 1
                return False
            self._counts["queued"] += 1
            self._counts["pending"] += 1
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every accepted save has finished; False if `timeout` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._counts["pending"] == 0, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Refuses new saves, finishes the queued ones (for up to `timeout` seconds) and stops the thread."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return  # the store is stuck; the daemon thread dies with the process
        self._thread.join(timeout)

    def stats(self) -> SaverStats:
        with self._cond:
            return SaverStats(**self._counts)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, payload, expires_at = item
            outcome = "saved"
            try:
                self.store.put_entry(key, payload, expires_at)
            except Exception:  # noqa: BLE001 - the thread must outlive a buggy store
                outcome = "failed"
            with self._cond:
                self._counts[outcome] += 1
                self._counts["pending"] -= 1
                self._cond.notify_all()
