"""Tensors moved into memory backed by 2 MiB pages (Linux transparent huge pages), where the kernel grants them.

A decode step at one row reads every weight once, at the memory's bandwidth: with 4 KiB pages each 4 KiB of weights
is a TLB miss and a page walk, and the CPU's stream prefetchers stop at each 4 KiB boundary. A plain streaming read
of 256 MiB on the machine of stop 42 (2-core Zen 4, THP `madvise`) ran at 26.6-29.1 GB/s on 4 KiB pages and
34.8-35.3 GB/s on 2 MiB pages. Most distributions set THP to `madvise`: memory gets huge pages only where the
program asks (madvise(MADV_HUGEPAGE)), which is what this does; `never` leaves 4 KiB pages (nothing else changes),
`always` gives them anyway. The values are copied, not changed.

The packed quantized weights go here (transforms/quantize.py). End to end, the same requests alternating with the
weights on 4 KiB pages in one process: SmolLM2 batch 1 1.06x and 1.12x (paired medians of 10 rounds), batch 64
1.02x and 0.99x; Gemma 3 batch 1 0.97x and 0.98x (its step is mostly the 178 MB head, which already streamed at the
bandwidth with its software prefetches), batch 64 1.01x. KV caches stay on 4 KiB pages (lazy_zeros, not advised):
in huge pages they measured 0.99-1.01x at batch 64 and 1.00x at 16 x 1,024 tokens.
"""
from __future__ import annotations

import math
import mmap
import re
from dataclasses import dataclass

import torch

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line


@dataclass(frozen=True)
class ArenaReport:
    tensors: int
    nbytes: int  # bytes of the tensors moved
    huge_bytes: int  # bytes of the mapping in huge pages (AnonHugePages), -1 where it cannot be read
    mode: str  # /sys/kernel/mm/transparent_hugepage/enabled's choice, or "unknown"


def thp_mode() -> str:
    """'always', 'madvise' or 'never' (the bracketed choice), or 'unknown' where the kernel does not say."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            found = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return "unknown"
    return found.group(1) if found else "unknown"


def _huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping that contains `address`, from /proc/self/smaps; -1 if it cannot be read."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    start, end = (int(v, 16) for v in head.split("-"))
                    inside = start <= address < end
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return -1


def _advise(buf: mmap.mmap, start: int) -> None:
    """madvise(MADV_HUGEPAGE) from `start` to the end; a kernel built without transparent huge pages refuses it
    (EINVAL), and the memory then has 4 KiB pages, as torch's own."""
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, start, len(buf) - start)
    except OSError:
        pass


def _arena(sizes: list[int], advise: bool = True) -> tuple[torch.Tensor, list[int], int]:
    """One anonymous private mapping (advised for huge pages unless told not to), holding `sizes` bytes at
    cache-line offsets: (its bytes as a uint8 tensor, each piece's offset, where the first 2 MiB boundary lies)."""
    offsets, size = [], 0
    for n in sizes:
        size = -(-size // _ALIGN) * _ALIGN
        offsets.append(size)
        size += n
    # private: a shared anonymous mapping is shmem, whose huge pages follow another switch (shmem_enabled, often
    # never); one spare huge page of room to start on a 2 MiB boundary
    buf = mmap.mmap(-1, -(-size // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(buf, dtype=torch.uint8)  # keeps `buf` alive as long as any tensor uses it
    skip = (-base.data_ptr()) % HUGE_PAGE
    if advise:
        _advise(buf, skip)  # before the first touch: faults then take 2 MiB pages
    return base, [skip + off for off in offsets], skip


def move_to_huge_pages(tensors: list[torch.Tensor]) -> ArenaReport:
    """Each CPU tensor (contiguous, distinct) moved in place (Tensor.set_) into one mapping advised for huge pages:
    every reference to the tensor objects sees the new memory, so call this before anything keeps raw pointers to
    them (the decode stack does). The old memory is freed with its last reference."""
    mode = thp_mode()
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors or not hasattr(mmap, "MADV_HUGEPAGE"):
        return ArenaReport(0, 0, -1, mode)
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("move_to_huge_pages takes contiguous CPU tensors")
    sizes = [t.numel() * t.element_size() for t in tensors]
    base, offsets, skip = _arena(sizes)
    for t, off, n in zip(tensors, offsets, sizes):
        view = base[off : off + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        t.set_(view)
    return ArenaReport(len(tensors), sum(sizes), _huge_bytes(base.data_ptr() + skip), mode)


def lazy_zeros(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """CPU tensors of zeros in one anonymous private mapping, each on a cache line: the kernel gives a page zeroed
    when it is first touched, so nothing is written at start-up and only touched pages are resident. torch.zeros
    writes every byte: a KV cache of the default 4 GiB cost ~1.3 s of start-up and 4 GiB resident from the start.
    No huge-page advice: KV caches in huge pages measured alike (above), and a block touched would make 2 MiB
    resident."""
    sizes = [math.prod(shape) * dtype.itemsize for shape in shapes]
    base, offsets, _ = _arena(sizes, advise=False)
    return [base[off : off + n].view(dtype).view(shape) for off, n, shape in zip(offsets, sizes, shapes)]
