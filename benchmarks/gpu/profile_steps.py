"""Where a decode step's time goes on a GPU (or CPU): torch.profiler over 10 steady decode steps at batch 1 and 64;
prints wall time, GPU-busy time, kernel launches and host syncs per step, and the top ops.

    python benchmarks/gpu/profile_steps.py /tmp/smol-rand cuda bfloat16
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from deepinfer import LLM, SamplingParams


def main():
    path, device, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
    t = time.perf_counter()
    llm = LLM(path, device=device, dtype=dtype, max_num_seqs=64, async_scheduling=False)  # default KV sizing
    eng = llm.engine
    print(f"start-up {time.perf_counter() - t:.1f} s, {eng.stats().num_blocks} KV blocks (default sizing)")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    for batch in (1, 64):
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        for i in range(batch):
            eng.add_request(f"{batch}-{i}", list(range(1000 + i, 1128 + i)), params)
        for _ in range(10):
            eng.step()
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        sync()
        t = time.perf_counter()
        for _ in range(10):
            eng.step()
        sync()
        wall = (time.perf_counter() - t) / 10
        with profile(activities=acts) as prof:
            for _ in range(10):
                eng.step()
            sync()
        ka = prof.key_averages()
        launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        syncs = {e.key: e.count for e in ka if "Synchronize" in e.key or "Memcpy" in e.key}
        gpu_us = sum(e.self_device_time_total for e in ka if e.device_type.name == "CUDA") / 10 if device.startswith("cuda") else 0
        print(f"== batch {batch}: step {1e3 * wall:.2f} ms wall, GPU busy {gpu_us / 1e3:.2f} ms/step, launches/step {launches / 10:.0f}, syncs/memcpys per 10 steps {syncs}")
        print(ka.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48))
        if device.startswith("cuda"):
            print(ka.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=48))
        while eng.has_unfinished_requests():
            eng.step()


if __name__ == "__main__":
    main()
