from __future__ import annotations

import time

import redis  # a dependency of deepinfer: never skipped

from deepinfer.kvstore import KVStoreConfig
from deepinfer.kvstore.redis_store import RedisStore

from .kvstore_helpers import chain, key, payload


def make(url: str, **kwargs: object) -> RedisStore:
    config = KVStoreConfig(kinds=("redis",), redis_url=url, ttl_classes=(("short", 0.5), ("chatbot", 600.0)))
    return RedisStore(config, retry_after=0.2, **kwargs)


def test_values_carry_the_record_format_and_a_server_ttl(redis_server) -> None:
    store = make(redis_server.url)
    store.put(key(0), payload(0, 100))
    raw = redis.Redis.from_url(redis_server.url)
    name = b"deepinfer:kv:" + key(0).hex().encode()
    assert raw.get(name)[:4] == b"DIKV"
    assert 590_000 < raw.pttl(name) <= 600_000
    store.close()


def test_real_expiry(redis_server) -> None:
    store = make(redis_server.url)
    store.put(key(0), b"short-lived", ttl_class="short")
    store.put(key(1), b"long-lived")
    assert store.contains([key(0)]) == 1
    time.sleep(0.6)
    assert store.contains([key(0)]) == 0
    assert store.get(key(0)) is None
    assert store.get(key(1)) == b"long-lived"
    store.close()


def test_corrupt_value_is_not_served_and_is_deleted(redis_server) -> None:
    store = make(redis_server.url)
    store.put(key(0), payload(0, 100))
    raw = redis.Redis.from_url(redis_server.url)
    name = b"deepinfer:kv:" + key(0).hex().encode()
    value = bytearray(raw.get(name))
    value[-1] ^= 0xFF
    raw.set(name, bytes(value))
    raw.set(b"deepinfer:kv:" + key(1).hex().encode(), b"garbage")
    assert store.get(key(0)) is None and store.get(key(1)) is None
    assert store.stats()["redis"].corrupt == 2
    assert raw.exists(name) == 0
    store.close()


def test_server_errors_are_counted(redis_server) -> None:
    store = make(redis_server.url)
    raw = redis.Redis.from_url(redis_server.url)
    raw.config_set("maxmemory", 1)  # noeviction policy: every write is refused with OOM
    store.put(key(0), payload(0, 1000))
    assert store.stats()["redis"].io_errors == 1
    raw.config_set("maxmemory", 0)
    store.put(key(0), payload(0, 1000))
    assert store.get(key(0)) == payload(0, 1000)
    store.close()


def test_redis_down_then_back(redis_server) -> None:
    store = make(redis_server.url)
    keys = chain(3)
    store.put(keys[0], payload(0))
    redis_server.stop()

    started = time.monotonic()
    assert store.get(keys[0]) is None
    store.put(keys[1], payload(1))
    assert store.contains(keys) == 0
    assert time.monotonic() - started < 1.0  # a dead server costs the engine almost nothing
    down = store.stats()["redis"]
    assert down.connection_errors >= 3 and down.misses == 1 and down.hits == 0

    redis_server.start()  # no persistence: the old blocks are gone, the connection is not
    time.sleep(0.25)  # past retry_after
    store.put(keys[2], payload(2))
    assert store.get(keys[2]) == payload(2)
    assert store.contains(keys[2:]) == 1
    assert store.stats()["redis"].hits == 1
    store.close()


def test_unreachable_server_at_start(redis_server) -> None:
    redis_server.stop()
    store = make(redis_server.url)  # constructing does not connect
    store.put(key(0), b"x")
    assert store.get(key(0)) is None
    assert store.stats()["redis"].connection_errors >= 2
    redis_server.start()
    time.sleep(0.25)
    store.put(key(0), b"x")
    assert store.get(key(0)) == b"x"
    store.close()


def test_a_hung_server_is_tried_ever_less_often_and_forgiven_once_it_answers(redis_server) -> None:
    """Connections open, no answers: each try costs a socket timeout, so the quiet time doubles per failure in a row
    (0.1, 0.2, 0.4, then the 0.4 cap here); one answer resets it."""
    from tests.reliability.proxy import SlowProxy

    proxy = SlowProxy(redis_server.port)
    store = RedisStore(KVStoreConfig(kinds=("redis",), redis_url=proxy.url), socket_timeout=0.1, retry_after=0.1,
                       max_retry_after=0.4)
    try:
        assert store.contains(chain(1)) == 0  # connects while the server still answers
        proxy.stalled = True
        blocked, started = 0, time.monotonic()
        while time.monotonic() - started < 2.0:
            before = time.monotonic()
            store.contains(chain(1))
            blocked += time.monotonic() - before > 0.05  # this call waited for a timeout
            time.sleep(0.005)
        # without the doubling: a try every 0.2 s (timeout + quiet), ten in two seconds
        assert 3 <= blocked <= 6, blocked
        proxy.stalled = False
        time.sleep(0.45)
        store.put(key(0), payload(0))
        assert store.get(key(0)) == payload(0)
        assert store._failures_in_a_row == 0
    finally:
        store.close()
        proxy.close()
