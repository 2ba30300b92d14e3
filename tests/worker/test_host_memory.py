"""Freed host memory kept for reuse (worker/host_memory.py): decode steps whose logits are larger than glibc's largest
mmap threshold (32 MiB) take a page fault per 4 KiB of them each step with glibc's defaults, and next to none with
the setting. Each mode in its own process (mallopt is process-wide), the bundled SmolLM2, 192 rows of a 49,152-token
vocabulary: 37.7 MB of logits a step, 9,216 pages. The rows sample (seeded): plain greedy rows take their tokens from
the LM head without logits (ops/csrc/head_argmax.cpp)."""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import ctypes, json, resource, sys
# 4 KiB pages for this process, whatever the machine's transparent huge pages policy: with `always`, glibc's
# default mmap of the logits was sometimes backed by huge pages and faulted 1-2 times a step (seen at stop 62)
ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
import torch
from deepinfer import SamplingParams
from deepinfer.llm import LLM
torch.set_num_threads(2)
# room for all 192 sequences at every step: with 64 MiB (stops 47-62) the scheduler preempted half of them after ~16
# tokens, the logits fell below 32 MiB, glibc's threshold rose past them and the control read 0-1 faults a step
llm = LLM(max_num_seqs=192, kv_cache_memory=256 << 20)
engine = llm.engine
for i in range(192):
    engine.add_request(str(i), [1000 + i, 2000 + i, 3000 + i], SamplingParams(max_tokens=40, temperature=0.8,
                                                                                seq_seed=i, ignore_eos=True))
faults, rows = [], []
for _ in range(16):  # the prompts, then decode steps
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    rows.append(len(engine.scheduler.running))
print(json.dumps({"faults_per_step": sorted(faults[4:])[len(faults[4:]) // 2], "rows": rows}))
"""


def faults_per_step(keep: bool) -> float:
    """The median over 12 decode steps (kept: the heap grows by a second logits buffer once, at some early step)."""
    env = {**os.environ, "DEEPINFER_KEEP_HOST_MEMORY": "1" if keep else "0"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["rows"] == [192] * 16, f"every step should run all 192 rows (37.7 MB of logits): {measured['rows']}"
    return measured["faults_per_step"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_decode_steps_reuse_freed_memory_instead_of_faulting_fresh_pages():
    kept, default = faults_per_step(True), faults_per_step(False)
    assert default > 5000, f"glibc's defaults should fault the 9,216 pages of each step's logits, got {default}"
    assert kept < 200, f"with freed memory kept, a decode step should fault next to nothing, got {kept}"
