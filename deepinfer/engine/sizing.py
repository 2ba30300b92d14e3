"""Start-up arithmetic: the KV budget, how long one sequence can get, and the seeds of a request's n samples."""
from __future__ import annotations

import torch

from deepinfer.core.kv_layout import KVLayout


def default_kv_cache_memory(device: str = "cpu") -> int:
    """On a CPU, a fifth of the available RAM, between 256 MiB and 4 GiB; on a GPU, 80% of its free memory once
    the weights are loaded (as vLLM's gpu_memory_utilization leaves headroom for activations)."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free * 0.8)
    available = 4 << 30
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    return max(256 << 20, min(4 << 30, available // 5))


def mix_seed(seed: int, index: int) -> int:
    # splitmix64 finalizer: distinct, reproducible seeds for the n samples of one seeded request
    z = (seed + 0x9E3779B97F4A7C15 * (index + 1)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def max_tokens_fitting(layout: KVLayout, num_blocks: int, block_size: int, max_chunk: int) -> int:
    """The longest single sequence the pool holds (sliding groups only keep their window plus one chunk)."""
    low, high = 0, num_blocks * block_size
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if layout.blocks_for(mid, block_size, max_chunk) <= num_blocks else (low, mid - 1)
    return low
