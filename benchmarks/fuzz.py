"""API fuzzing: schemathesis against the server's own OpenAPI document (/openapi.json), every route.

Passes when no check fails: no 5xx, every status and content type documented, every response (errors included) in
its documented schema, every schema-invalid request refused with a 4xx, the API key enforced. Schema-valid requests
that the server still refuses (a constraint no static schema can state: a prompt longer than the context, a grammar
that does not compile) are counted and shown, not failed; --strict fails on them too.

    python benchmarks/fuzz.py --max-time 600                 # starts a server on the tiny model, fuzzes 10 minutes
    python benchmarks/fuzz.py --url http://127.0.0.1:8000 --api-key KEY --seed 1 --max-examples 25

The CI run (tests/reliability/test_fuzz.py) is the second form with a fixed seed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STRICT_CHECKS = "all"
EXCLUDED = "positive_data_acceptance"  # reported from the run's valid rates instead (see the docstring)
# The server a fuzz run starts: the tiny model, a short context and a small queue, so that any valid request is cheap.
SERVER_ARGS = ("--max-model-len", "128", "--kv-cache-memory", "32MiB", "--num-threads", "1",
               "--max-waiting-requests", "64")


def run_schemathesis(url: str, api_key: str | None, seed: int, max_examples: int | None, max_time: float | None,
                     strict: bool, report_path: str, workers: int = 1) -> dict:
    """Runs the schemathesis CLI; returns its JSON run report."""
    cmd = [sys.executable, "-c", "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
           "run", f"{url}/openapi.json", "--checks", STRICT_CHECKS, "--seed", str(seed), "--generation-database",
           "none", "--request-timeout", "60", "--no-color", "--workers", str(workers), "--report", "json",
           "--report-json-path", report_path, "--suppress-health-check", "too_slow",
           "--max-response-time", "120"]  # the largest valid request (64 sequences x 127 tokens) on a busy CPU
    if not strict:
        cmd += ["--exclude-checks", EXCLUDED]
    if api_key:
        cmd += ["-H", f"Authorization: Bearer {api_key}"]
    if max_examples:
        cmd += ["--max-examples", str(max_examples)]
    if max_time:
        cmd += ["--max-time", str(int(max_time))]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if not os.path.exists(report_path):
        raise RuntimeError(f"schemathesis wrote no report (exit {run.returncode}):\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    with open(report_path) as f:
        report = json.load(f)
    report["output"] = run.stdout
    return report


def server_errors(url: str) -> tuple[dict[str, float], float]:
    """deepinfer:http_errors by status, and the engine steps that failed, from /metrics (counted since start-up).

    A failed step is a server error even when every response began 200: a stream then ends in an error event."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.findall(r'^deepinfer:http_errors_total\{status="(\d+)"\} ([0-9.e+]+)$', text, re.M)
    steps = re.findall(r'^deepinfer:engine_step_failures_total\{[^}]*\} ([0-9.e+]+)$', text, re.M)
    return {status: float(value) for status, value in found}, sum(float(v) for v in steps)


def summarize(report: dict, errors: dict[str, float], step_failures: float) -> dict:
    rejected = {op: sum(phase.get("rejected", 0) for phase in rates.values())
                for op, rates in report.get("valid_rates", {}).items()}
    failures = [{"operation": f.get("operation") or f.get("label"), "title": f.get("title"), "code": f.get("code")}
                for f in report.get("failures", [])]
    return {
        "seed": report["seed"], "seconds": round(report["running_time"], 1),
        "cases": report["test_cases"]["generated"], "failures": len(report.get("failures", [])),
        "errors": len(report.get("errors", [])), "failure_list": failures,
        "server_5xx": sum(v for k, v in errors.items() if k.startswith("5")),
        "engine_step_failures": step_failures,
        "server_4xx_by_status": {k: v for k, v in sorted(errors.items()) if k.startswith("4")},
        "schema_valid_but_refused": rejected,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one on the tiny model)")
    parser.add_argument("--model", default=None, help="model for the started server (default: the tiny model)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-examples", type=int, default=None, help="cases per operation and phase")
    parser.add_argument("--max-time", type=float, default=None, help="seconds; fuzzing repeats until spent")
    parser.add_argument("--strict", action="store_true", help="also fail on schema-valid requests refused")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the summary here")
    args = parser.parse_args(argv)

    with ExitStack() as stack:
        url, api_key = args.url, args.api_key
        if url is None:
            from tests.reliability.tiny import make_tiny_model
            from tests.server.conftest import running_server

            model = args.model or make_tiny_model(stack.enter_context(tempfile.TemporaryDirectory()))
            api_key = api_key or "fuzz-key"
            server = stack.enter_context(running_server("--model", model, *SERVER_ARGS, "--api-key", api_key))
            url = server.url
        started = time.monotonic()
        report_path = (args.json + ".schemathesis.json" if args.json
                       else os.path.join(stack.enter_context(tempfile.TemporaryDirectory()), "report.json"))
        report = run_schemathesis(url, api_key, args.seed, args.max_examples, args.max_time, args.strict, report_path,
                                  args.workers)
        summary = summarize(report, *server_errors(url))
        summary["healthy_after"] = httpx.get(f"{url}/health", timeout=30).status_code == 200
        summary["wall_seconds"] = round(time.monotonic() - started, 1)
    failures_at = report["output"].find("=== FAILURES ===")
    print(report["output"][failures_at:] if failures_at >= 0 else report["output"][-2500:])
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json + ".log", "w") as f:
            f.write(report["output"])
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    ok = (summary["failures"] == summary["errors"] == summary["server_5xx"] == summary["engine_step_failures"] == 0
          and summary["healthy_after"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
