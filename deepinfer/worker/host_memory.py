"""Freed host memory kept for reuse, so that a step's large tensors do not start as fresh pages.

glibc's malloc gives an allocation above its mmap threshold (128 KiB at first, raised as such blocks are freed, to
32 MiB at most) pages of its own and returns them to the kernel when it is freed. A step's large tensors, above all
the logits (64 rows of SmolLM2's 49,152-token vocabulary are 12.6 MB, of Gemma 3's 262,144 tokens 67 MB), then start
every step as fresh pages that the kernel zeroes on first touch, one page fault per 4 KiB: measured on the 2-core
Zen 5 machine, Gemma 3 270M at batch 64 took 16,385 faults a decode step and 80-99 ms a step, 60-65 ms without them;
SmolLM2's head took 4.3-8.4 ms at 64 rows inside the engine where it takes 3.9 ms alone, whenever the threshold had
not yet risen past its logits. llama.cpp avoids this with buffers of its own, vLLM's CPU images with tcmalloc.

`keep_freed_memory`, called once the model is loaded (the loading's large temporaries were pages of their own and went
back to the kernel), sets glibc's malloc, process-wide, to serve every allocation from its heap (M_MMAP_MAX = 0) and
to keep freed memory at the heap's top up to 2 GiB (M_TRIM_THRESHOLD), so a freed block is reused by the next step.
Resident memory then stays at the serving peak instead of falling back between steps (Gemma 3, a 1 GiB KV cache,
64 prompts of 128 tokens: 2,109 MiB resident after them, 1,978 with glibc's defaults). Handing the freed memory back
first (malloc_trim) was tried: the steps then faulted the released pages back in, ~1,100 faults a step. Not glibc
(musl, macOS): nothing is changed. DEEPINFER_KEEP_HOST_MEMORY=0 (EngineConfig.keep_host_memory) leaves the defaults.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
KEEP_TOP_BYTES = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> str:
    """Applies the setting above; returns what was done, for the start-up log."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        version = libc.gnu_get_libc_version
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "the C library's defaults (not glibc)"
    version.restype = ctypes.c_char_p
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_MAX, 0) != 1 or mallopt(M_TRIM_THRESHOLD, KEEP_TOP_BYTES) != 1:
        return f"glibc {version().decode()} refused mallopt: its defaults"
    return f"glibc {version().decode()} keeps freed memory for reuse (no mmap per allocation, no trimming below 2 GiB)"
