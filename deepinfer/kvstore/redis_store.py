"""Redis tier: one value per block (the same self-checking record as on disk), expired by Redis itself.

Redis being down must cost the engine almost nothing: no client-side retries,
short socket timeouts, and after a connection failure the store stays quiet for
`retry_after` seconds (every call in that window is a counted miss or dropped
save) before it tries the server again, so it reconnects on its own when Redis
comes back. Each further failure in a row doubles the quiet time, up to
`max_retry_after`: a hung server (connections open, no answers) costs one socket
timeout per quiet period, so the engine, whose scheduler asks the store on its
critical path, spends ever less of its time waiting on it.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Sequence, cast

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from deepinfer.kvstore.base import Clock, Counters, Entry, KVStore, KVStoreConfig, KVStoreStats
from deepinfer.kvstore.record import CorruptRecord, decode, encode

_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError)


class RedisStore(KVStore):
    name = "redis"

    def __init__(
        self,
        config: KVStoreConfig,
        clock: Clock = time.time,
        namespace: str = "deepinfer:kv:",
        socket_timeout: float = 2.0,
        connect_timeout: float = 0.5,
        retry_after: float = 1.0,  # seconds, on time.monotonic
        max_retry_after: float = 30.0,
    ) -> None:
        super().__init__(config, clock)
        if not config.redis_url:
            raise ValueError("RedisStore needs config.redis_url")
        self.namespace = namespace.encode()
        self.retry_after = retry_after
        self.max_retry_after = max_retry_after
        self._failures_in_a_row = 0
        self._client = redis.Redis.from_url(
            config.redis_url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 0),
        )
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._counters = Counters(self.name)

    def contains(self, keys: Sequence[bytes]) -> int:
        if not keys or not self._available():
            return 0
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._name(key))
            found = pipe.execute()
        except redis.RedisError as exc:
            self._failed(exc)
            return 0
        self._answered()
        for i, present in enumerate(found):
            if not present:
                return i
        return len(keys)

    def get_entry(self, key: bytes) -> Entry | None:
        entry = self._read(key)
        if entry is None:
            self._counters.add("misses")
            return None
        self._counters.add("hits")
        self._counters.add("bytes_read", len(entry.payload))
        return entry

    def put_entry(self, key: bytes, payload: bytes, expires_at: float) -> None:
        ttl_ms = math.ceil((expires_at - self.clock()) * 1000)
        if ttl_ms <= 0 or not self._available():
            return
        try:
            self._client.set(self._name(key), encode(key, payload, expires_at), px=ttl_ms)
        except redis.RedisError as exc:
            self._failed(exc)
            return
        self._answered()
        self._counters.add("bytes_written", len(payload))

    def stats(self) -> KVStoreStats:
        return KVStoreStats((self._counters.snapshot(),))

    def close(self) -> None:
        self._client.close()

    def _name(self, key: bytes) -> bytes:
        return self.namespace + key.hex().encode()

    def _read(self, key: bytes) -> Entry | None:
        if not self._available():
            return None
        try:
            data = cast("bytes | None", self._client.get(self._name(key)))
        except redis.RedisError as exc:
            self._failed(exc)
            return None
        self._answered()
        if data is None:
            return None
        try:
            payload, expires_at = decode(data, key)
        except CorruptRecord:
            self._counters.add("corrupt")
            self._delete(key)
            return None
        if expires_at <= self.clock():
            self._counters.add("expired")
            self._delete(key)
            return None
        return Entry(payload, expires_at)

    def _available(self) -> bool:
        with self._lock:
            down = time.monotonic() < self._down_until
        if down:
            self._counters.add("connection_errors")
        return not down

    def _answered(self) -> None:
        with self._lock:
            self._failures_in_a_row = 0

    def _failed(self, exc: redis.RedisError) -> None:
        if isinstance(exc, _CONNECTION_ERRORS):
            self._counters.add("connection_errors")
            with self._lock:
                quiet = min(self.retry_after * 2**self._failures_in_a_row, self.max_retry_after)
                self._failures_in_a_row += 1
                self._down_until = time.monotonic() + quiet
        else:
            self._counters.add("io_errors")  # e.g. OOM under maxmemory, READONLY replica

    def _delete(self, key: bytes) -> None:
        try:
            self._client.delete(self._name(key))
        except redis.RedisError as exc:
            self._failed(exc)
