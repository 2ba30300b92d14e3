"""Freed host memory kept for reuse (worker/host_memory.py): with the setting, decode steps whose logits are larger
than glibc's largest mmap threshold (32 MiB) take next to no page faults. Each mode in its own process (mallopt is
process-wide), the bundled SmolLM2, 192 rows of a 49,152-token vocabulary: 37.7 MB of logits a step, 9,216 pages.
The rows sample (seeded): plain greedy rows take their tokens from the LM head without logits
(ops/csrc/head_argmax.cpp).

The control shows that the measurement sees fresh pages: glibc with its mmap threshold held at its initial 128 KiB
(M_MMAP_THRESHOLD, which also stops it moving), so every large allocation is pages of its own, one fault per 4 KiB
each step. glibc's plain defaults are not a stable control: a 37.7 MB allocation is served from the heap's top
whenever that much happens to be free there (memory under the 64 MiB trim threshold is kept), which depends on how
the step's other allocations interleave; under CPU load the defaults faulted only 2 of 12 decode steps (stop 64)."""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import ctypes, json, resource, sys
# 4 KiB pages for this process, whatever the machine's transparent huge pages policy: with `always`, glibc's
# default mmap of the logits was sometimes backed by huge pages and faulted 1-2 times a step (seen at stop 62)
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
if sys.argv[1] == "control":
    assert libc.mallopt(-3, 128 * 1024) == 1  # M_MMAP_THRESHOLD: fixed at its initial value
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
print(json.dumps({"faults_per_step": sorted(faults[4:])[len(faults[4:]) // 2], "faults": faults, "rows": rows}))
"""


def faults_per_step(keep: bool) -> tuple[float, str]:  # keep=False: the control
    """The median over 12 decode steps (kept: the heap grows by a second logits buffer once, at some early step), and
    what to show if it is not as expected: every step's faults and the engine's start-up log."""
    env = {**os.environ, "DEEPINFER_KEEP_HOST_MEMORY": "1" if keep else "0"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, "keep" if keep else "control"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["rows"] == [192] * 16, f"every step should run all 192 rows (37.7 MB of logits): {measured['rows']}"
    return measured["faults_per_step"], f"faults a step {measured['faults']}; log: {done.stderr[-1500:]}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_decode_steps_reuse_freed_memory_instead_of_faulting_fresh_pages():
    (kept, kept_why), (control, control_why) = faults_per_step(True), faults_per_step(False)
    assert control > 5000, f"the control should fault the 9,216 pages of each step's logits, got {control}: " \
        + control_why
    assert kept < 200, f"with freed memory kept, a decode step should fault next to nothing, got {kept}: {kept_why}"
