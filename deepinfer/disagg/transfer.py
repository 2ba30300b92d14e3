"""The direct hand-off, worker half: a prompt's KV blocks from a prefill engine's cache to a decode engine's, over zmq.

    decode -> prefill (DEALER -> ROUTER):  [b"pull", tag, handoff id, block indices (int32)] | [b"release", tag, id]
    prefill -> decode:                     [tag, header (JSON)] + one frame per run of consecutive blocks and cache
                                           tensor (layer 0 K, layer 0 V, ...): the run's rows, raw

The header says "ok" (with the cache layout digest of kv_transfer.layout_header, the runs and a crc32 per block) or
"unknown" (no such hand-off: already pulled, timed out, or never offered). A block is intact when the layouts match,
its frames have the expected sizes and its crc32 matches; blocks are written in order and the first bad one ends the
pull, so the decode engine computes the prompt from there. Frames are sent without copying (zmq reads the cache
memory; the blocks stay held until it is done) and written on the decode side with one numpy copy per run.

Both threads reach the caches only through numpy views made once on the engine thread: a thread that runs torch ops
starts its own OpenMP pool and slows the engine's.
"""
from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch
import zmq

from deepinfer.core.plan import KVPull
from deepinfer.disagg.stats import BYTES_BOUNDS, Buckets
from deepinfer.worker.kv_transfer import block_views, layout_header

logger = logging.getLogger("deepinfer.disagg")

SEND_TIMEOUT_S = 30.0  # zmq gives up on a peer that reads nothing for this long; the blocks are released then


def host_views(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int,
               block_size: int) -> tuple[list[np.ndarray], bytes]:
    """uint8 [num_blocks, bytes per block] numpy views of the caches (CPU only), and the layout header."""
    views = block_views(kv_caches, num_blocks, block_size)
    if views[0].device.type != "cpu":
        raise ValueError(f"the direct KV hand-off reads the cache from host memory; this one is on "
                         f"{views[0].device} (use --kv-handoff store)")
    return [v.reshape(num_blocks, -1).view(torch.uint8).numpy() for v in views], layout_header(views, block_size)


def runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """(first block id, length) of each run of consecutive ids, in order."""
    out: list[tuple[int, int]] = []
    for b in block_ids:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


@dataclass(frozen=True)
class Served:
    handoff_id: str
    outcome: str  # "pulled" | "released"
    num_bytes: int


class HandoffServer:
    """Prefill side: serves offered hand-offs to decode engines from a ROUTER socket on its own thread. The engine
    thread offers a hand-off's blocks, collects the ones pulled or released (take_done) and withdraws timed-out ones."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int, block_size: int,
                 host: str, port: int) -> None:
        self._views, self.header = host_views(kv_caches, num_blocks, block_size)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
        if port == 0:
            port = self._socket.bind_to_random_port(f"tcp://{host}")
        else:
            self._socket.bind(f"tcp://{host}:{port}")
        self.address = f"tcp://{host}:{port}"
        self._lock = threading.Lock()
        self._offers: dict[str, list[int]] = {}  # handoff id -> block ids, in the prompt's order
        self._serving: set[str] = set()
        self._done: queue.SimpleQueue[Served] = queue.SimpleQueue()
        self.event = threading.Event()  # set when something is done
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-handoff-server", daemon=True)
        self._thread.start()

    def offer(self, handoff_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._offers[handoff_id] = list(block_ids)

    def withdraw(self, handoff_id: str) -> bool:
        """Stops offering a hand-off; False while it is being sent (it is reported done once zmq let go of it)."""
        with self._lock:
            if handoff_id in self._serving:
                return False
            self._offers.pop(handoff_id, None)
            return True

    def take_done(self) -> list[Served]:
        self.event.clear()
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._closed = True
        self._thread.join(timeout=2)
        self._socket.close(linger=0)
        self._context.term()

    # ---- the server thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._closed:
            if not poller.poll(100):
                continue
            try:
                identity, op, tag, handoff, *rest = self._socket.recv_multipart()
                if op == b"release":
                    with self._lock:
                        if handoff.decode() not in self._serving and self._offers.pop(handoff.decode(), None):
                            self._finish(Served(handoff.decode(), "released", 0))
                elif op == b"pull" and rest:
                    self._serve(identity, tag, handoff.decode(), np.frombuffer(rest[0], dtype=np.int32).tolist())
            except Exception:  # noqa: BLE001 - a bad message must not stop the server (a pull then times out)
                logger.exception("KV hand-off server: a message failed")

    def _serve(self, identity: bytes, tag: bytes, handoff_id: str, indices: list[int]) -> None:
        with self._lock:
            blocks = self._offers.get(handoff_id)
            if blocks is not None and all(0 <= i < len(blocks) for i in indices):
                self._serving.add(handoff_id)
            else:
                blocks = None
        if blocks is None:
            self._socket.send_multipart([identity, tag, json.dumps({"status": "unknown"}).encode()])
            return
        frames: list[np.ndarray] = []
        try:
            header, frames = self.reply([blocks[i] for i in indices])
            tracker = self._socket.send_multipart([identity, tag, json.dumps(header).encode(), *frames], copy=False,
                                                  track=True)
            if tracker is not None:
                tracker.wait(SEND_TIMEOUT_S)  # zmq reads the held blocks until then
        except zmq.ZMQError as e:
            logger.warning("hand-off %s: sending failed (%s); releasing its blocks", handoff_id, e)
        finally:
            with self._lock:
                self._serving.discard(handoff_id)
                self._offers.pop(handoff_id, None)
                self._finish(Served(handoff_id, "pulled", sum(f.nbytes for f in frames)))

    def reply(self, block_ids: list[int]) -> tuple[dict, list[np.ndarray]]:
        """The header and frames carrying `block_ids` (views of the cache, not copies)."""
        frames, crcs = [], []
        for start, length in runs(block_ids):
            parts = [view[start : start + length] for view in self._views]
            frames.extend(parts)
            for j in range(length):
                crc = 0
                for part in parts:
                    crc = zlib.crc32(part[j], crc)
                crcs.append(crc)
        header = {"status": "ok", "layout": self.header.hex(), "runs": [length for _, length in runs(block_ids)],
                  "crc": crcs}
        return header, frames

    def _finish(self, served: Served) -> None:
        self._done.put(served)
        self.event.set()


@dataclass
class _Pull:
    request_id: str
    pull: KVPull
    deadline: float
    started: float = field(default_factory=time.perf_counter)


class HandoffPuller:
    """Decode side: pulls prompt KV from prefill engines on its own thread, each pull bounded by `timeout_s`; many
    pulls are in flight at once, so a dead prefill engine delays only its own requests. The engine thread starts pulls
    (start), collects finished ones (poll: request id -> leading blocks written intact) and releases hand-offs it does
    not need (release)."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int, block_size: int,
                 timeout_s: float) -> None:
        self._views, self.header = host_views(kv_caches, num_blocks, block_size)
        self.timeout_s = timeout_s
        self._context = zmq.Context()
        self._wake_out = self._context.socket(zmq.PAIR)  # engine thread -> puller thread: "look at the inbox"
        self._wake_in = self._context.socket(zmq.PAIR)
        endpoint = f"inproc://kv-puller-{id(self)}"
        self._wake_in.bind(endpoint)
        self._wake_out.connect(endpoint)
        self._inbox: queue.SimpleQueue[tuple[str, str, KVPull]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._results: dict[str, int] = {}
        self._pending: set[str] = set()  # started, not yet polled: touched by the engine thread only
        self.event = threading.Event()
        self.bytes = Buckets(BYTES_BOUNDS)  # per pull
        self.received_bytes = 0
        self.transfer_seconds = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-handoff-puller", daemon=True)
        self._thread.start()

    @property
    def loading(self) -> bool:
        return bool(self._pending)

    def start(self, pulls: dict[str, KVPull]) -> None:
        for request_id, pull in pulls.items():
            self._pending.add(request_id)
            self._inbox.put(("pull", request_id, pull))
        if pulls:
            self._wake_out.send(b"")

    def release(self, address: str, handoff_id: str) -> None:
        """Tells a prefill engine that this engine needs none of a hand-off (it can free the blocks at once)."""
        self._inbox.put(("release", "", KVPull(address, handoff_id, [], [])))
        self._wake_out.send(b"")

    def poll(self, wait: float = 0.0) -> dict[str, int]:
        if wait and self._pending and not self._results:
            self.event.wait(wait)
        with self._lock:
            done, self._results = self._results, {}
            self.event.clear()
        self._pending.difference_update(done)
        return done

    def close(self) -> None:
        self._closed = True
        self._wake_out.send(b"")
        self._thread.join(timeout=2)
        self._wake_out.close(linger=0)
        self._context.term()

    # ---- the puller thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        sockets: dict[str, zmq.Socket] = {}
        in_flight: dict[bytes, _Pull] = {}
        tags = itertools.count()
        poller = zmq.Poller()
        poller.register(self._wake_in, zmq.POLLIN)
        while not self._closed:
            now = time.perf_counter()
            timeout = min((p.deadline for p in in_flight.values()), default=now + 1.0) - now
            try:
                ready = dict(poller.poll(max(0, int(timeout * 1000)) + 1))
                if self._wake_in in ready:
                    while self._wake_in.poll(0):
                        self._wake_in.recv()
                    self._take_inbox(sockets, in_flight, tags, poller)
                for sock in sockets.values():
                    while sock in ready and sock.poll(0):
                        self._answer(in_flight, sock.recv_multipart(copy=False))
            except Exception:  # noqa: BLE001 - the thread must outlive a failure; pulls it strands time out
                logger.exception("KV hand-off puller: a step failed")
            now = time.perf_counter()
            for tag in [t for t, p in in_flight.items() if p.deadline <= now]:
                pull = in_flight.pop(tag)
                logger.warning("hand-off %s from %s: no answer within %.1fs; computing the prompt here",
                               pull.pull.handoff_id, pull.pull.address, self.timeout_s)
                self._complete(pull, 0, 0)
        for sock in sockets.values():
            sock.close(linger=0)
        self._wake_in.close(linger=0)

    def _take_inbox(self, sockets: dict, in_flight: dict, tags, poller: zmq.Poller) -> None:
        while True:
            try:
                op, request_id, pull = self._inbox.get_nowait()
            except queue.Empty:
                return
            tag = str(next(tags)).encode()
            try:
                sock = sockets.get(pull.address)
                if sock is None:
                    sock = self._context.socket(zmq.DEALER)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.connect(pull.address)
                    sockets[pull.address] = sock
                    poller.register(sock, zmq.POLLIN)
                if op == "release" or not pull.block_ids:
                    sock.send_multipart([b"release", tag, pull.handoff_id.encode()])
                else:
                    indices = np.asarray(pull.block_indices, dtype=np.int32).tobytes()
                    sock.send_multipart([b"pull", tag, pull.handoff_id.encode(), indices])
                    in_flight[tag] = _Pull(request_id, pull, time.perf_counter() + self.timeout_s)
                    continue
            except zmq.ZMQError as e:  # e.g. an address zmq cannot connect to: a failed pull, at once
                logger.warning("hand-off %s from %s: %s; computing the prompt here", pull.handoff_id, pull.address, e)
            if op == "pull":
                self._complete(_Pull(request_id, pull, 0.0), 0, 0)

    def _answer(self, in_flight: dict[bytes, _Pull], frames: list[zmq.Frame]) -> None:
        pull = in_flight.pop(frames[0].bytes, None) if frames else None
        if pull is None:
            return  # the answer to a pull that already timed out
        try:
            num_ok, num_bytes = self._write(pull.pull, frames[1:])
        except Exception:  # noqa: BLE001 - a malformed answer is a failed pull
            logger.exception("hand-off %s from %s: a bad answer", pull.pull.handoff_id, pull.pull.address)
            num_ok, num_bytes = 0, 0
        self._complete(pull, num_ok, num_bytes)

    def _write(self, pull: KVPull, frames: list[zmq.Frame]) -> tuple[int, int]:
        """Writes the intact leading blocks of an answer; (how many, bytes received)."""
        received = sum(len(f.buffer) for f in frames[1:])
        try:
            header = json.loads(frames[0].bytes)
        except (ValueError, IndexError):
            return 0, received
        if header.get("status") != "ok":
            logger.warning("hand-off %s from %s: %s; computing the prompt here", pull.handoff_id, pull.address,
                           header.get("status"))
            return 0, received
        if header.get("layout") != self.header.hex():
            logger.warning("hand-off %s from %s: another KV cache layout; computing the prompt here", pull.handoff_id,
                           pull.address)
            return 0, received
        lengths, crcs = header.get("runs", []), header.get("crc", [])
        parts = iter(frames[1:])
        done = 0
        for length in lengths:
            rows = []
            for view in self._views:
                part = next(parts, None)
                if part is None or len(part.buffer) != length * view.shape[1]:
                    return done, received
                rows.append(np.frombuffer(part.buffer, dtype=np.uint8).reshape(length, view.shape[1]))
            good = 0
            for j in range(length):
                crc = 0
                for row in rows:
                    crc = zlib.crc32(row[j], crc)
                if done + j >= len(crcs) or crc != crcs[done + j] or done + j >= len(pull.block_ids):
                    break
                good += 1
            targets = pull.block_ids[done : done + good]
            for view, row in zip(self._views, rows):
                view[targets] = row[:good]
            done += good
            if good < length:
                logger.warning("hand-off %s from %s: block %d arrived damaged; computing the prompt from there",
                               pull.handoff_id, pull.address, done)
                return done, received
        return done, received

    def _complete(self, pull: _Pull, num_ok: int, num_bytes: int) -> None:
        if num_bytes:
            self.bytes.observe(num_bytes)
            self.received_bytes += num_bytes
            self.transfer_seconds += time.perf_counter() - pull.started
        with self._lock:
            self._results[pull.request_id] = num_ok
        self.event.set()
