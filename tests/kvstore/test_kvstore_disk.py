from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from .kvstore_helpers import FakeClock, chain, key, payload

from deepinfer.kvstore import DiskStore, KVStoreConfig
from deepinfer.kvstore.record import HEADER_SIZE

BLOCK = 1000
FILE = HEADER_SIZE + 16 + BLOCK


def config(path: Path, **kwargs: object) -> KVStoreConfig:
    return KVStoreConfig(kinds=("disk",), disk_path=str(path), **kwargs)


def files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_file_layout_and_restart_persistence(tmp_path: Path) -> None:
    keys = chain(4)
    with DiskStore(config(tmp_path)) as store:
        for i, k in enumerate(keys):
            store.put(k, payload(i, BLOCK))
        path = store.path_of(keys[0])
    assert path == tmp_path / keys[0].hex()[:2] / f"{keys[0].hex()}.kvb"
    assert path.read_bytes()[:4] == b"DIKV" and path.stat().st_size == FILE
    assert len(files(tmp_path)) == 4  # no temp files left behind
    reopened = DiskStore(config(tmp_path))
    assert reopened.used_bytes == 4 * FILE
    assert reopened.contains(keys) == 4
    assert [reopened.get(k) for k in keys] == [payload(i, BLOCK) for i in range(4)]


def test_lru_eviction_over_capacity_survives_restart(tmp_path: Path) -> None:
    a, b, c, d = chain(4)
    store = DiskStore(config(tmp_path, disk_bytes=3 * FILE))
    for i, k in enumerate((a, b, c)):
        store.put(k, payload(i, BLOCK))
    # Recency is the file mtime; pin it so the test does not depend on timestamp resolution.
    for age, k in ((30, a), (20, b), (10, c)):
        os.utime(store.path_of(k), (1e9 - age, 1e9 - age))
    assert store.get(a) is not None  # touches a's mtime: b is now the least recently used
    restarted = DiskStore(config(tmp_path, disk_bytes=3 * FILE))
    restarted.put(d, payload(3, BLOCK))
    assert not restarted.path_of(b).exists()
    assert restarted.contains([a]) == restarted.contains([c]) == restarted.contains([d]) == 1
    assert restarted.stats()["disk"].evictions == 1
    assert restarted.used_bytes == 3 * FILE


def test_capacity_is_enforced_at_start_up(tmp_path: Path) -> None:
    store = DiskStore(config(tmp_path))
    for i, k in enumerate(chain(5)):
        store.put(k, payload(i, BLOCK))
    smaller = DiskStore(config(tmp_path, disk_bytes=2 * FILE))
    assert smaller.used_bytes == 2 * FILE
    assert len(files(tmp_path)) == 2


def test_ttl_with_injected_clock_reclaims_files(tmp_path: Path, clock: FakeClock) -> None:
    store = DiskStore(config(tmp_path), clock=clock)
    store.put(key(0), b"agent", ttl_class="agent")
    store.put(key(1), b"chat")
    clock.advance(3 * 86400 + 1)
    assert store.contains([key(1)]) == 1
    assert store.get(key(0)) is None
    assert not store.path_of(key(0)).exists()
    assert store.stats()["disk"].expired == 1
    clock.advance(4 * 86400)
    restarted = DiskStore(config(tmp_path), clock=clock)  # the start-up scan drops expired files too
    assert restarted.contains([key(1)]) == 0
    assert files(tmp_path) == []
    assert restarted.stats()["disk"].expired == 1


def test_flipped_bytes_are_never_served(tmp_path: Path) -> None:
    store = DiskStore(config(tmp_path))
    keys = chain(3)
    for i, k in enumerate(keys):
        store.put(k, payload(i, BLOCK))
    for k, offset in ((keys[0], HEADER_SIZE + 16 + 500), (keys[1], 16), (keys[2], 0)):  # payload, expiry, magic
        path = store.path_of(k)
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))
    assert [store.get(k) for k in keys] == [None, None, None]
    assert store.stats()["disk"].corrupt == 3
    assert files(tmp_path) == []  # reclaimed
    store.put(keys[0], payload(0, BLOCK))  # and the slot works again
    assert store.get(keys[0]) == payload(0, BLOCK)


def test_truncated_file_is_corrupt_in_contains_and_get(tmp_path: Path) -> None:
    store = DiskStore(config(tmp_path))
    keys = chain(3)
    for i, k in enumerate(keys):
        store.put(k, payload(i, BLOCK))
    os.truncate(store.path_of(keys[1]), FILE - 10)
    assert store.contains(keys) == 1
    assert store.stats()["disk"].corrupt == 1
    os.truncate(store.path_of(keys[2]), 20)  # shorter than a header
    assert store.get(keys[2]) is None
    assert store.stats()["disk"].corrupt == 2
    assert store.used_bytes == FILE


def test_deleted_file_is_a_miss(tmp_path: Path) -> None:
    store = DiskStore(config(tmp_path))
    keys = chain(3)
    for i, k in enumerate(keys):
        store.put(k, payload(i, BLOCK))
    os.unlink(store.path_of(keys[1]))
    assert store.contains(keys) == 1
    assert store.get(keys[1]) is None
    stats = store.stats()["disk"]
    assert (stats.misses, stats.errors) == (1, 0)


def test_unusable_directory_counts_errors_and_never_raises(tmp_path: Path) -> None:
    # Running as root, chmod cannot make a directory unwritable; a path under a regular file can.
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    store = DiskStore(config(blocker / "kv"))
    store.put(key(0), payload(0))
    assert store.get(key(0)) is None
    assert store.contains([key(0)]) == 0
    assert store.stats()["disk"].io_errors >= 2  # start-up scan and the put


def test_failed_rename_drops_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulates a read-only or full filesystem at the rename step, which root cannot get from chmod.
    store = DiskStore(config(tmp_path))
    store.put(key(0), payload(0))

    def read_only(src: object, dst: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "replace", read_only)
    store.put(key(1), payload(1))
    monkeypatch.undo()
    assert store.stats()["disk"].io_errors == 1
    assert store.contains([key(0), key(1)]) == 1
    assert [p.name.endswith(".tmp") for p in files(tmp_path)] == [False]  # the temp file was cleaned up
    store.put(key(1), payload(1))
    assert store.contains([key(0), key(1)]) == 2


def test_shared_directory_between_engines(tmp_path: Path) -> None:
    first, second = DiskStore(config(tmp_path)), DiskStore(config(tmp_path))
    keys = chain(3)
    for i, k in enumerate(keys):
        first.put(k, payload(i, BLOCK))
    assert second.contains(keys) == 3  # discovered without a restart
    assert second.get(keys[2]) == payload(2, BLOCK)
    assert second.used_bytes == 3 * FILE
    os.unlink(second.path_of(keys[0]))  # e.g. evicted by another engine
    assert first.contains(keys) == 0


def test_start_up_scan_ignores_foreign_files_and_drops_stale_temp_files(tmp_path: Path) -> None:
    store = DiskStore(config(tmp_path))
    store.put(key(0), payload(0))
    fanout = store.path_of(key(0)).parent
    stale = fanout / ".abc.1.x.tmp"
    fresh = fanout / ".abc.2.y.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(stale, (1.0, 1.0))
    (fanout / "README").write_text("not a block")
    (fanout / "zz.kvb").write_bytes(b"bad hex name")
    restarted = DiskStore(config(tmp_path))
    assert restarted.contains([key(0)]) == 1
    assert not stale.exists() and fresh.exists()
    assert (fanout / "README").exists()
