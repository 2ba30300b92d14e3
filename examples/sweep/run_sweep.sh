#!/usr/bin/env bash
# Decode-batch sweep: one JSON line per batch size and a Pareto plot (total tokens/s against tokens/s per user).
# Usage: examples/sweep/run_sweep.sh [--batch-sizes 8,16,...] [--prompt-len N] [--output-len N] [--model M]
#        [--engine-option KEY=VALUE ...] [--url http://host:port/v1]   (any flag of benchmarks/sweep.py)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
exec "$python" "$root/benchmarks/sweep.py" --batch-sizes 8,16,32,64,128,256 --prompt-len 128 --output-len 128 "$@"
