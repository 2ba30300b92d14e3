"""What a KV block's numbers depend on, as one string: the weights' content, the architecture, dtype and kernel mode.

The string roots every block key (core/prefix_cache.root_key), so a disk or Redis store shared by several engines
never hands one model's KV to another. Names and sizes are not enough: two fine-tunes of one base have the same
file names and sizes. So the weights are identified by a digest of their bytes, read once per file and cached by
the file's (path, size, mtime, ctime, inode), in memory and in a small file under the cache directory, so a
restart does not read the weights again. GGUF and safetensors carry no digest of their own to trust instead.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Mapping

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")
_CHUNK = 8 << 20
_memo: dict[tuple, str] = {}
_memo_lock = threading.Lock()


def model_identity(path: str, hf_config: Mapping[str, Any], dtype: str, batch_invariant: bool,
                   cache_dir: str | None = None) -> str:
    """Names the numbers a KV block holds: the weights' content, architecture, dtype and kernel mode.

    Batch-invariant kernels round differently from the default ones, so their blocks are kept apart: mixing them
    would break bit-for-bit reproducibility. Two copies of the same weights at different paths share an identity.
    """
    arch = hashlib.blake2b(json.dumps(dict(hf_config), sort_keys=True, default=str).encode(), digest_size=8).hexdigest()
    mode = "batch-invariant" if batch_invariant else "default"
    return f"weights:{weights_digest(path, cache_dir)}|{arch}|{dtype}|{mode}"


def weights_digest(path: str, cache_dir: str | None = None) -> str:
    """blake2b-128 over every weight file of a model (a directory's weight files in name order, or one file)."""
    path = os.path.realpath(path)
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith(WEIGHT_SUFFIXES))
        if not names:
            raise ValueError(f"model directory {path!r} has no weight files ({', '.join(WEIGHT_SUFFIXES)})")
        files = [os.path.join(path, n) for n in names]
    elif os.path.isfile(path):
        names, files = [os.path.basename(path)], [path]
    else:
        raise ValueError(f"model path {path!r} is neither a file nor a directory")
    total = hashlib.blake2b(digest_size=16, person=b"deepinfer-wts")
    for name, file in zip(names, files):
        # the name is part of the digest only inside a directory: shards must not swap places
        total.update((name if len(files) > 1 else "").encode() + b"\x00" + file_digest(file, cache_dir).encode())
    return total.hexdigest()


def file_digest(path: str, cache_dir: str | None = None) -> str:
    """blake2b-128 of one file's bytes, cached by (real path, size, mtime, ctime, inode, device).

    ctime cannot be set by a user, so an edited file is always read again, even if its mtime was restored.
    """
    real = os.path.realpath(path)
    st = os.stat(real)
    stamp = (real, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
    with _memo_lock:
        known = _memo.get(stamp)
    if known is not None:
        return known
    record = _record_path(real, cache_dir)
    digest = _read_record(record, stamp)
    if digest is None:
        h = hashlib.blake2b(digest_size=16)
        with open(real, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        digest = h.hexdigest()
        _write_record(record, stamp, digest)
    with _memo_lock:
        _memo[stamp] = digest
    return digest


def _record_path(real: str, cache_dir: str | None) -> Path:
    # DEEPINFER_CACHE_DIR as models/loader.default_cache_dir reads it (that module imports torch; this one must not)
    root = cache_dir or os.environ.get("DEEPINFER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")
    name = hashlib.blake2b(real.encode(), digest_size=16).hexdigest()
    return Path(root) / "weight-digests" / f"{name}.json"


def _read_record(record: Path, stamp: tuple) -> str | None:
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("stamp") != list(stamp) or not isinstance(data.get("digest"), str):
        return None
    return data["digest"]


def _write_record(record: Path, stamp: tuple, digest: str) -> None:
    """Atomic (temp file + rename); a read-only cache directory only costs a re-read at the next start."""
    tmp = None
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=record.name, dir=record.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"stamp": list(stamp), "digest": digest}, f)
        os.replace(tmp, record)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
