"""Start-up time and resident memory of `LLM(...)`, each run in a fresh process (the KV cache's pages are reserved at
start-up and touched as blocks are used: ops/huge_pages.py, lazy_zeros), then after one short request; the medians
of --runs processes.

    python benchmarks/startup.py [--model PATH] [--kv-cache-memory BYTES] [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import default_output_path, machine_info, write_json  # noqa: E402

CHILD = r"""
import json, sys, time
options = json.loads(sys.argv[1])
start = time.perf_counter()
from deepinfer import LLM, SamplingParams
imported = time.perf_counter()
llm = LLM(**options)
built = time.perf_counter()
resident = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
at_start = resident()
out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
print(json.dumps({"import_s": imported - start, "llm_s": built - imported, "rss_start_bytes": at_start,
                  "rss_after_request_bytes": resident(), "tokens": out[0].outputs[0].token_ids}))
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF or Hugging Face folder (default: the bundled SmolLM2)")
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: the engine's own)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    options = {k: v for k, v in (("model", args.model), ("kv_cache_memory", args.kv_cache_memory)) if v is not None}
    runs = []
    for _ in range(args.runs):
        done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(options)], capture_output=True, text=True,
                              timeout=900)
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"LLM() {runs[-1]['llm_s']:.2f} s, resident {runs[-1]['rss_start_bytes'] / 2**20:.0f} MiB at start, "
              f"{runs[-1]['rss_after_request_bytes'] / 2**20:.0f} MiB after a request", flush=True)
    summary = {key: statistics.median(r[key] for r in runs)
               for key in ("import_s", "llm_s", "rss_start_bytes", "rss_after_request_bytes")}
    print(f"median: LLM() {summary['llm_s']:.2f} s, resident {summary['rss_start_bytes'] / 2**20:.0f} MiB at start")
    path = write_json({"benchmark": "startup", "options": options, "machine": machine_info(os.cpu_count() or 1),
                       "runs": runs, "median": summary}, args.out or default_output_path("startup"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
