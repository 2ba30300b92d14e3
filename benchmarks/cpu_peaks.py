"""The vector units' peak on this core, for the quantized kernel's bound: how many 512-bit int8 dot products
(`vpdpbusd`), float FMAs and bfloat16 dot products (`vdpbf16ps`) one thread issues a second, and how many dot
products a second remain when each 8 of them come with the 4-bit tile's per-group float work (a convert, a multiply
and two FMAs per activation row and group of 32; quant_tile_avx512.h).

    python benchmarks/cpu_peaks.py            # needs gcc and an AVX-512 VNNI CPU; prints and writes JSON

Eight independent accumulator chains per instruction kind, in inline assembly (the compiler cannot drop or fuse
them); each loop runs ~0.3 s, best of --repeats. A GMAC/s figure counts 64 multiply-adds per `vpdpbusd` (16 lanes x
4 byte pairs) and 32 per `vdpbf16ps`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_json  # noqa: E402

# one line of the timed loop per kind: 8 chains on zmm0-7 (the tile mix adds its float work on zmm8-13)
_CHAINS = "".join(f'"{{op}} %%{{r}}30, %%{{r}}31, %%{{r}}{i}\\n"' for i in range(8))
_KINDS = {
    "vpdpbusd_zmm": (_CHAINS.format(op="vpdpbusd", r="zmm") * 2, 16, 64),
    "vpdpbusd_ymm": (_CHAINS.format(op="vpdpbusd", r="ymm") * 2, 16, 32),
    "vfmadd231ps_zmm": (_CHAINS.format(op="vfmadd231ps", r="zmm") * 2, 16, 0),
    "vdpbf16ps_zmm": (_CHAINS.format(op="vdpbf16ps", r="zmm") * 2, 16, 32),
    # the 4-bit tile's per-row, per-group work: 8 dot products, then cvt, mul, fma, fma (and the nibble and/shift
    # of the weights, shared by the tile's rows, counted once here)
    "tile_mix": (_CHAINS.format(op="vpdpbusd", r="zmm")
                 + '"vcvtdq2ps %%zmm30, %%zmm8\\n" "vmulps %%zmm30, %%zmm31, %%zmm9\\n"'
                 + '"vfmadd231ps %%zmm30, %%zmm31, %%zmm10\\n" "vfmadd231ps %%zmm30, %%zmm31, %%zmm11\\n"'
                 + '"vpandd %%zmm30, %%zmm31, %%zmm12\\n" "vpsrlw $4, %%zmm30, %%zmm13\\n"', 8, 64),
}
_SOURCE = r"""
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char** argv) {
  const long n = 20000000;
  double best = 1e30;
  for (int r = 0; r < REPEATS; ++r) {
    const double t = now();
    for (long i = 0; i < n; ++i)
      __asm__ volatile(BODY ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                       "xmm10", "xmm11", "xmm12", "xmm13");
    const double dt = now() - t;
    if (dt < best) best = dt;
  }
  printf("%.6f\n", (double)n * PER_LOOP / best / 1e9);
  return 0;
}
"""


def measure(kind: str, repeats: int, workdir: str) -> float:
    """Giga-instructions a second of the counted kind (dot products for tile_mix)."""
    body, per_loop, _ = _KINDS[kind]
    src = os.path.join(workdir, f"{kind}.c")
    exe = os.path.join(workdir, kind)
    with open(src, "w") as f:
        f.write(_SOURCE.replace("BODY", body).replace("PER_LOOP", str(per_loop)).replace("REPEATS", str(repeats)))
    subprocess.run(["gcc", "-O2", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-mavx512bf16", "-o", exe, src],
                   check=True)
    return float(subprocess.run([exe], check=True, capture_output=True, text=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu_peaks.json"))
    args = parser.parse_args()
    if shutil.which("gcc") is None:
        sys.exit("cpu_peaks: needs gcc")
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if "avx512_vnni" not in flags or "avx512_bf16" not in flags:
        sys.exit("cpu_peaks: needs AVX-512 VNNI and BF16 (this CPU lacks one)")
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for kind, (_, _, macs) in _KINDS.items():
            rate = measure(kind, args.repeats, workdir)
            results[kind] = {"g_per_s": rate, "gmac_per_s": rate * macs if macs else None}
            extra = f" = {rate * macs:.0f} GMAC/s" if macs else ""
            print(f"{kind:18s} {rate:6.2f} G/s one thread{extra}")
    zmm = results["vpdpbusd_zmm"]["g_per_s"]
    print(f"tile_mix / vpdpbusd_zmm: {results['tile_mix']['g_per_s'] / zmm:.3f} (8 / 11 = 0.727 if the mul and the "
          "two FMAs take the dot products' pipes)")
    write_json({"machine": machine_info(1), "results": results}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
