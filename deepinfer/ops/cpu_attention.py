"""Paged attention kernels for the CPU (csrc/attention.cpp), part of the compiled ops module (ops/cpu_ops.py).

The torch path gathers every decode row's blocks into a padded copy and then runs SDPA over it: at long contexts
and large batches that moves the KV cache three to four times per step. `paged_decode` reads each cached key and
value once: per (query, KV head) it scores the G query heads that share the KV head against one block segment of
keys, rescales a running max / sum / weighted value sum (online softmax, one rescale per segment), and writes
acc / sum; sliding windows start at max(0, len - W). `paged_prefill` runs the same per-query computation for each
token of a prefill chunk (one compiled copy of the segment step, no FMA contraction), so a token gets the same bits
from either path: the batch-invariant mode's attention (with AVX-512, four consecutive queries of one sequence, a
prompt's or a token and its drafts, run as one query tile that reads each block once: each query's arithmetic
unchanged, csrc/attention_tile_avx512.h). Queries in float32; the cache in float32 or bfloat16 (each
value widened to float32 as it is read, so a bfloat16 cache moves half the bytes). Built once per machine with torch's
cpp_extension (g++, ninja) into torch's extension cache; if that fails the engine logs why and keeps the torch path.
Prompt rows whose linear layers run on AMX tiles take `amx_attention` instead (csrc/amx_attention.cpp: bfloat16
queries and probabilities, 32-key blocks fixed by position; layers/attention.py and the decode stack route them).
"""
from __future__ import annotations

from types import ModuleType

from deepinfer.ops import cpu_ops


def load() -> ModuleType | None:
    """The compiled module (paged_decode, paged_prefill and the other ops); None if it cannot be built here."""
    return cpu_ops.load()
