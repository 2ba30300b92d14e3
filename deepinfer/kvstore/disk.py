"""Disk tier: one self-checking file per block in a directory that several engines may share.

Layout: `<root>/<first two hex digits>/<key hex>.kvb`, each file a record (see
record.py). Writes go to a temp file in the same directory and are renamed into
place, so readers see a whole old file or a whole new one, never a torn one
(no fsync: a crash can still leave a bad file, which the checksum rejects).

Recency is the file's mtime: a hit touches it, so the least recently used
order survives restarts and is shared by engines that scan the same directory.
Each engine keeps an index of the files it knows (scanned at start-up, written
or discovered since) and enforces `disk_bytes` over that index.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from deepinfer.kvstore.base import Clock, Counters, Entry, KVStore, KVStoreConfig, KVStoreStats
from deepinfer.kvstore.record import HEADER_SIZE, CorruptRecord, decode, decode_header, encode_header

SUFFIX = ".kvb"
_STALE_TEMP_SECONDS = 3600.0  # wall-clock age past which a temp file is a crashed writer's leftover


@dataclass(frozen=True)
class _Known:
    size: int  # file bytes, what the capacity counts
    expires_at: float


class DiskStore(KVStore):
    name = "disk"

    def __init__(self, config: KVStoreConfig, clock: Clock = time.time) -> None:
        super().__init__(config, clock)
        if not config.disk_path:
            raise ValueError("DiskStore needs config.disk_path")
        self.root = Path(config.disk_path)
        self.capacity = config.disk_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, _Known] = OrderedDict()  # least recently used first
        self._used = 0
        self._counters = Counters(self.name)
        self._scan()

    @property
    def used_bytes(self) -> int:
        return self._used

    def path_of(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / (name + SUFFIX)

    def contains(self, keys: Sequence[bytes]) -> int:
        now = self.clock()
        for i, key in enumerate(keys):
            if not self._present(key, now):
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
        header = encode_header(key, payload, expires_at)
        size = len(header) + len(payload)
        if size > self.capacity:
            self._counters.add("rejected")
            return
        path = self.path_of(key)
        tmp = path.parent / f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "xb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError:
            self._counters.add("io_errors")
            _unlink_quietly(tmp)
            return
        self._remember(key, _Known(size, expires_at))
        self._counters.add("bytes_written", len(payload))

    def stats(self) -> KVStoreStats:
        return KVStoreStats((self._counters.snapshot(),))

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._used = 0

    def _read(self, key: bytes) -> Entry | None:
        path = self.path_of(key)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read()
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError:
            self._counters.add("io_errors")
            return None
        try:
            payload, expires_at = decode(data, key)
        except CorruptRecord:
            self._counters.add("corrupt")
            self._reclaim(key, path, st)
            return None
        if expires_at <= self.clock():
            self._counters.add("expired")
            self._reclaim(key, path, st)
            return None
        self._remember(key, _Known(len(data), expires_at))
        try:
            os.utime(path)
        except OSError:
            pass  # recency is a hint; a read-only mount still serves hits
        return Entry(payload, expires_at)

    def _present(self, key: bytes, now: float) -> bool:
        path = self.path_of(key)
        with self._lock:
            known = self._index.get(key)
        if known is not None and known.expires_at > now:
            try:
                if os.stat(path).st_size == known.size:
                    return True
            except FileNotFoundError:
                self._forget(key)  # deleted by another engine or by hand
                return False
            except OSError:
                self._counters.add("io_errors")
                return False
        # Unknown, changed, or expired by our index: the file may have been rewritten by another engine.
        probed = self._probe(key, path, now)
        if probed is None:
            return False
        self._remember(key, probed[0])
        return True

    def _probe(self, key: bytes, path: Path, now: float) -> tuple[_Known, os.stat_result] | None:
        """Checks a file's header and size without reading the payload; reclaims it if bad or expired."""
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                head = f.read(HEADER_SIZE + len(key))
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError:
            self._counters.add("io_errors")
            return None
        try:
            header = decode_header(head, key)
            if header.record_len != st.st_size:
                raise CorruptRecord(f"file is {st.st_size} bytes, header says {header.record_len}")
        except CorruptRecord:
            self._counters.add("corrupt")
            self._reclaim(key, path, st)
            return None
        if header.expires_at <= now:
            self._counters.add("expired")
            self._reclaim(key, path, st)
            return None
        return _Known(st.st_size, header.expires_at), st

    def _remember(self, key: bytes, known: _Known) -> None:
        """Records `key` as most recently used and evicts the least recently used files over capacity."""
        victims: list[bytes] = []
        with self._lock:
            old = self._index.pop(key, None)
            self._used += known.size - (old.size if old else 0)
            self._index[key] = known
            while self._used > self.capacity and len(self._index) > 1:
                victim, gone = self._index.popitem(last=False)
                self._used -= gone.size
                victims.append(victim)
        for victim in victims:
            _unlink_quietly(self.path_of(victim))
            self._counters.add("evictions")

    def _forget(self, key: bytes) -> None:
        with self._lock:
            old = self._index.pop(key, None)
            if old is not None:
                self._used -= old.size

    def _reclaim(self, key: bytes, path: Path, seen: os.stat_result) -> None:
        """Deletes a bad or expired file, unless another engine has meanwhile replaced it."""
        self._forget(key)
        try:
            current = os.stat(path)
            if (current.st_ino, current.st_dev) == (seen.st_ino, seen.st_dev):
                os.unlink(path)
        except OSError:
            pass

    def _scan(self) -> None:
        """Rebuilds the index from the directory, oldest mtime first; drops expired, bad and stale temp files."""
        now = self.clock()
        found: list[tuple[float, bytes, _Known]] = []
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fanout = [d for d in os.scandir(self.root) if d.is_dir() and len(d.name) == 2]
        except OSError:
            self._counters.add("io_errors")
            return
        for sub in fanout:
            try:
                files = list(os.scandir(sub.path))
            except OSError:
                self._counters.add("io_errors")
                continue
            for item in files:
                if item.name.endswith(".tmp"):
                    _drop_stale_temp(item)
                    continue
                if not item.name.endswith(SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(item.name[: -len(SUFFIX)])
                except ValueError:
                    continue
                probed = self._probe(key, Path(item.path), now)
                if probed is not None:
                    found.append((probed[1].st_mtime, key, probed[0]))
        found.sort(key=lambda t: t[0])
        for _, key, known in found:
            self._remember(key, known)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _drop_stale_temp(item: os.DirEntry[str]) -> None:
    try:
        if time.time() - item.stat().st_mtime > _STALE_TEMP_SECONDS:
            os.unlink(item.path)
    except OSError:
        pass
