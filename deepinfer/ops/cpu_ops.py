"""deepinfer's compiled CPU ops, one extension module built from csrc/ (quantized-weight linear layers, the fused
per-layer glue, paged attention, the decode stack that runs them all without returning to Python): g++ -O3 for
this machine's instruction set through torch's cpp_extension, cached by torch.

`load()` builds for the CPU it runs on (-march=native: AVX-512 VNNI, AVX2 with or without AVX-VNNI, or portable
C++, chosen by what the CPU has); `load(isa)` forces a lower target, which tests use to check every path here.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
from types import ModuleType

import torch

logger = logging.getLogger("deepinfer")

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
# the slowest source first: ninja starts them in this order, so it does not compile alone at the end
SOURCES = ("bindings.cpp", "quant_linear.cpp", "attention.cpp", "decode_stack.cpp", "layer_ops.cpp", "sampling.cpp",
           "head_argmax.cpp", "dense_linear.cpp", "split_head.cpp", "amx_linear.cpp",
           "amx_attention.cpp", "bounded_argmax.cpp")
ISA_FLAGS = {
    "native": ["-march=native"],
    "avx2-vnni": ["-march=native", "-mno-avx512f", "-mavxvnni"],
    "avx2": ["-march=native", "-mno-avx512f", "-mno-avxvnni"],
    "generic": ["-march=x86-64"],
}


def last_level_cache_bytes() -> int | None:
    """The size of the CPU's last-level cache as sysfs reports it for CPU 0 (None where it cannot be read)."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    best = None
    try:
        for index in sorted(os.listdir(root)):
            if not index.startswith("index"):
                continue
            with open(os.path.join(root, index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(root, index, "size")) as f:
                raw = f.read().strip().upper()
            size = int(raw[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}[raw[-1]] if raw[-1] in "KMG" else int(raw)
            if best is None or level >= best[0]:
                best = (level, size)
    except (OSError, ValueError, KeyError):
        return None
    return None if best is None else best[1]


def cpu_isa_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _use_own_ninja() -> None:
    """torch runs `ninja` from PATH. Put the ninja installed with this interpreter (a dependency) first, as an
    activated venv would: without it a process whose PATH lacks the venv (`make test`, a script run with a bare
    PATH) finds no ninja or another version, and ninja versions that differ rebuild each other's cache."""
    bin_dir = os.path.dirname(sys.executable)
    own = shutil.which("ninja", path=bin_dir)
    if own and shutil.which("ninja") != own:
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def build(name: str, flags: list[str], csrc: str | None = None) -> ModuleType:
    """The ops compiled from csrc/ (or another copy of it, an older commit's that a benchmark compares) as extension
    `name` with these compiler flags besides -O3, no FMA contraction and OpenMP (an instruction set, or -D variants
    a benchmark compares); raises where they cannot be built."""
    from torch.utils.cpp_extension import load as load_extension

    _use_own_ninja()
    sources = [os.path.join(csrc or _CSRC, s) for s in SOURCES]
    if csrc is not None:  # an older copy builds the sources it has (a build without split_head.cpp lacks its ops)
        sources = [s for s in sources if os.path.exists(s)]
    return load_extension(name=name, sources=sources,
                          extra_cflags=["-O3", *flags, "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"],
                          verbose=False)


def native_equals(isa: str, cpu_flags: set[str]) -> bool:
    """Whether `isa`'s flags only switch off what this CPU lacks, so they compile what -march=native does: AVX2 on a
    CPU without AVX-512 and AVX-VNNI, AVX2 with AVX-VNNI on one that has AVX-VNNI but not AVX-512."""
    if "avx512f" in cpu_flags or not {"avx2", "fma", "f16c"} <= cpu_flags:
        return False
    return (isa == "avx2" and "avx_vnni" not in cpu_flags) or (isa == "avx2-vnni" and "avx_vnni" in cpu_flags)


def lower_builds(cpu_flags: set[str]) -> list[str]:
    """The builds below native that a CPU with these flags can run (the tests compare each with native): portable
    C++ always, AVX2 where it has AVX2, FMA and F16C, AVX2 with AVX-VNNI where it has that too."""
    builds = ["generic"]
    if {"avx2", "fma", "f16c"} <= cpu_flags:
        builds.append("avx2")
        if "avx_vnni" in cpu_flags:
            builds.append("avx2-vnni")
    return builds


@functools.lru_cache(maxsize=None)
def load(isa: str = "native") -> ModuleType | None:
    """The compiled ops for `isa` (see ISA_FLAGS), built on first use; None if they cannot be built here (callers
    then use torch ops: dequantized float32 weights for quantized layers)."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"isa must be one of {sorted(ISA_FLAGS)}, got {isa!r}")
    if isa != "native" and native_equals(isa, cpu_isa_flags()):
        return load("native")  # the same flags on this CPU: the same code, so one build (~50 s on 2 cores) less
    tag = torch.backends.cpu.get_cpu_capability().lower() + ("" if isa == "native" else "_" + isa.replace("-", ""))
    try:
        return build(f"deepinfer_cpu_ops_{tag}", ISA_FLAGS[isa])
    except Exception as exc:  # no compiler, no ninja, no headers: torch ops still work
        logger.warning("compiled CPU ops unavailable (%s: %s); using torch ops and dequantized float32 weights",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
