"""The seed's three structured-output examples run as scripts and print what they should: their format always, and
the exact text greedy decoding gives on the bundled model (recorded on an AVX-512 machine)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

pytestmark = pytest.mark.slow


def run(name: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_regex_example():
    out = run("structured_regex.py")
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", out)
    assert out == "AY-123"


def test_json_schema_example():
    out = run("structured_json.py")
    order = json.loads(out)
    assert set(order) == {"colour", "quantity"} and order["colour"] in ("red", "green", "blue")
    assert 1 <= order["quantity"] <= 10
    assert out == '{"colour": "red", "quantity": 1}'


def test_ebnf_example():
    out = run("structured_ebnf.py")
    assert out in ("yes", "no")
    assert out == "no"  # a 135M model, quantized: the grammar guarantees the form, not the truth


def test_sweep_script_writes_jsonl_and_a_plot(tmp_path):
    out = tmp_path / "sweep.jsonl"
    done = subprocess.run(["bash", str(EXAMPLES / "sweep" / "run_sweep.sh"), "--batch-sizes", "2,4", "--prompt-len",
                           "16", "--output-len", "6", "--out", str(out), "--engine-option", "kv_cache_memory=67108864"],
                          capture_output=True, text=True, timeout=600,
                          env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    points = [json.loads(line) for line in out.read_text().splitlines()]
    assert [p["batch"] for p in points] == [2, 4]
    for p in points:
        assert p["total_tok_s"] > 0 and p["per_user_tok_s"] > 0 and p["itl_p99_ms"] >= p["itl_p50_ms"] >= 0
        assert set(p["step_ms"]) >= {"schedule", "prepare", "forward", "sample", "update", "output"}
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
