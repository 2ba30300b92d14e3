"""benchmarks/peers.py's llama.cpp runner: a llama-batched-bench that dies on repacked weights (the AMX Xeon case)
is run again without repacking, and the report says so; one that fails with an error is not retried."""
from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
ROW = {"pp": 16, "tg": 4, "pl": 2, "t": 0.5, "t_tg": 0.25}


def _tools(tmp_path: Path, batched_body: str) -> Path:
    """A bin directory whose llama-batched-bench runs `batched_body` (sh) and whose llama-bench is never called."""
    for name, body in (("llama-batched-bench", batched_body), ("llama-bench", "exit 1")):
        tool = tmp_path / name
        tool.write_text("#!/bin/sh\n" + body + "\n")
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return tmp_path


@pytest.fixture()
def peers(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import peers as module

    return module


def _requests(n: int):
    from common import BenchRequest

    return [BenchRequest(list(range(16)), 4) for _ in range(n)]


def test_a_crash_on_repacked_weights_reruns_without_repacking(peers, tmp_path):
    # dies by SIGSEGV unless -nr is among its arguments, as the vendored build did on an AMX Xeon
    body = f"""case " $* " in *" -nr "*) echo '{json.dumps(ROW)}' ;; *) kill -SEGV $$ ;; esac"""
    runner = peers.LlamaToolsRunner(str(_tools(tmp_path, body)), "m.gguf", 2)
    runner.warmup(_requests(1))
    assert "without weight repacking (-nr)" in runner.mode and "SIGSEGV" in runner.mode
    result = runner.run(_requests(2))
    assert result.details == {"llama_batched_bench": ROW, "repack": False}
    assert (result.wall_s, result.decode_s) == (0.5, 0.25)


def test_a_tool_that_works_keeps_repacking_and_an_error_is_not_retried(peers, tmp_path):
    runner = peers.LlamaToolsRunner(str(_tools(tmp_path, f"echo '{json.dumps(ROW)}'")), "m.gguf", 2)
    runner.warmup(_requests(1))
    assert runner.mode == "llama-batched-bench (all sequences at once) and llama-bench"
    assert runner.run(_requests(2)).details["repack"] is True
    failing = peers.LlamaToolsRunner(str(_tools(tmp_path, "echo 'bad model' >&2; exit 1")), "m.gguf", 2)
    with pytest.raises(RuntimeError, match="bad model") as error:
        failing.warmup(_requests(1))
    assert not isinstance(error.value, peers.ToolCrashed) and failing.no_repack == ""


def test_llama_bench_that_dies_reruns_without_repacking(peers, tmp_path):
    rows = [{"n_prompt": 64, "n_gen": 0, "avg_ts": 300.0, "stddev_ts": 1.0, "model_size": 9, "build_commit": "x"},
            {"n_prompt": 0, "n_gen": 8, "avg_ts": 90.0, "stddev_ts": 1.0, "model_size": 9, "build_commit": "x"}]
    tools = _tools(tmp_path, "exit 1")
    bench = tools / "llama-bench"  # dies unless called with --repack 0
    bench.write_text(f"""#!/bin/sh\ncase " $* " in *" --repack 0 "*) echo '{json.dumps(rows)}' ;; *) kill -SEGV $$ ;; esac\n""")
    runner = peers.LlamaToolsRunner(str(tools), "m.gguf", 2)
    got = runner.prompt_and_generation(64, 8)
    assert (got["pp_tok_s"], got["tg_tok_s"], got["repack"]) == (300.0, 90.0, False)
    assert "llama-bench died (SIGSEGV)" in runner.mode
