"""API fuzzing in CI: schemathesis with a fixed seed against the shared server's /openapi.json, every route, through
benchmarks/fuzz.py (the long run is the same script with --max-time). Zero failed checks, zero 5xx, no failed
engine step, and afterwards the server is healthy, logged no unhandled error and holds no KV block."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

FUZZ = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "fuzz.py")
SEED = 20261130


def test_fixed_seed_fuzz_of_every_route(tiny_server, tenant_keys, tmp_path):
    out = tmp_path / "fuzz.json"
    run = subprocess.run([sys.executable, FUZZ, "--url", tiny_server.url, "--api-key", tenant_keys["acme"],
                          "--seed", str(SEED), "--max-examples", "12", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    summary = json.loads(out.read_text()) if out.exists() else {}
    assert run.returncode == 0 and summary, run.stdout[-5000:] + run.stderr[-3000:]
    assert summary["failures"] == summary["errors"] == summary["server_5xx"] == summary["engine_step_failures"] == 0
    assert summary["cases"] >= 500 and summary["healthy_after"], summary
    assert summary["server_4xx_by_status"].get("400", 0) >= 100, summary  # the fuzzer did reach the validation
    deadline = time.monotonic() + 30
    while (samples := tiny_server.metrics())["vllm:kv_cache_usage_perc"] > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert samples["vllm:kv_cache_usage_perc"] == 0 and samples["vllm:num_requests_running"] == 0, samples
    log = tiny_server.log()
    assert "unhandled error" not in log and "Traceback" not in log, log[-5000:]
    print(f"\nfuzz: {summary['cases']} cases in {summary['seconds']} s, 0 failures; "
          f"schema-valid but refused: {summary['schema_valid_but_refused']}")
