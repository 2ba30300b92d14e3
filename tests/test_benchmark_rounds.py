"""benchmarks/throughput.py --rounds: engines take turns, each round on new prompts, tables keep the median round
and ratios are the median of each round's own ratio (benchmarks/rounds.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture()
def rounds(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import rounds as module

    return module


def _result(engine, tok_s, requests=1):
    from common import RunResult

    return RunResult(engine, requests, 8 * requests, 100, 100 / tok_s, None)


def test_rotation_moves_every_engine_through_every_place(rounds):
    names = ["a", "b", "c"]
    orders = [rounds.rotation(names, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert all(sorted(order) == names for order in orders)
    assert rounds.rotation([], 4) == []


def test_median_round_and_median_of_each_rounds_ratio(rounds):
    per_round = [[(1, _result("deepinfer", 100.0)), (1, _result("peer", 50.0))],
                 [(1, _result("deepinfer", 60.0)), (1, _result("peer", 40.0))],   # a slow spell for both
                 [(1, _result("deepinfer", 90.0)), (1, _result("peer", 60.0))]]
    picked = {r.engine: r for _, r in rounds.median_results(per_round)}
    assert picked["deepinfer"].output_tok_s == pytest.approx(90.0)
    assert picked["peer"].output_tok_s == pytest.approx(50.0)
    assert picked["deepinfer"].details["rounds_output_tok_s"] == pytest.approx([100.0, 60.0, 90.0])
    ratios = rounds.round_ratios(per_round, 1, "deepinfer", "peer")
    assert ratios == pytest.approx([2.0, 1.5, 1.5])
    # a round where the peer did not run at that point has no ratio
    assert rounds.round_ratios(per_round + [[(1, _result("deepinfer", 10.0))]], 1, "deepinfer", "peer") == ratios


def test_even_rounds_take_the_lower_middle_and_extras_take_medians(rounds):
    per_round = [[(4, _result("x", v, 4))] for v in (30.0, 10.0, 20.0, 40.0)]
    ((concurrency, picked),) = rounds.median_results(per_round)
    assert concurrency == 4 and picked.output_tok_s == pytest.approx(20.0)
    merged = rounds.median_extras([{"pp_tok_s": 3.0, "weight_bytes": 7}, {"pp_tok_s": 1.0, "weight_bytes": 7},
                                   {"pp_tok_s": 2.0, "tg_tok_s": 5.0, "weight_bytes": 7}])
    assert merged["pp_tok_s"] == 2.0 and merged["rounds_pp_tok_s"] == [3.0, 1.0, 2.0]
    assert merged["tg_tok_s"] == 5.0 and merged["weight_bytes"] == 7
    assert rounds.median_extras([]) == {}


def test_throughput_rounds_end_to_end(tmp_path):
    out = tmp_path / "speed.json"
    command = [sys.executable, str(BENCH / "throughput.py"), "--engines", "deepinfer,transformers", "--batch-sizes",
               "1,2", "--batch-prompt-len", "8", "--max-output", "3", "--prefill-len", "16", "--rounds", "2",
               "--threads", "2", "--no-progress", "--out", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "MPLBACKEND": "Agg"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "round 2 of 2" in run.stdout
    payload = json.loads(out.read_text())
    rows = [r for r in payload["results"] if r["engine"] == "deepinfer"]
    assert sorted(r["concurrency"] for r in rows) == [1, 2]
    for row in rows:
        each = row["details"]["rounds_output_tok_s"]
        assert len(each) == 2 and row["output_tok_s"] == pytest.approx(min(each))  # the lower middle of two
        assert 0 <= row["greedy_agreement_vs_transformers"]["matched_prefix_tokens"] <= 1
    for row in (r for r in payload["results"] if r["engine"] == "transformers"):  # itself, on the same round's prompts
        assert row["greedy_agreement_vs_transformers"]["matched_prefix_tokens"] == 1
    point = payload["versus_best_peer"]["2"]
    assert point["best_peer"] == "transformers" and len(point["rounds_ratio"]) == 2
    assert min(point["rounds_ratio"]) <= point["ratio"] <= max(point["rounds_ratio"])
    assert len(payload["engines"]["deepinfer"]["rounds_pp_tok_s"]) == 2
    assert len(payload["versus_best_peer"]["prompt_processing"]["rounds_ratio"]) == 2


def test_each_round_plans_new_prompts(rounds):
    import throughput

    args = throughput.parse_args(["--batch-sizes", "1,4", "--batch-prompt-len", "40", "--max-output", "3"])
    ids = list(range(100, 5000))
    first, again, second = (throughput.plan_requests(args, ids, r) for r in (0, 0, 1))
    assert [c for c, _ in first] == [c for c, _ in second] == [1, 4]
    assert first == again  # the same round, the same prompts: every engine gets the same requests
    prompts = [{tuple(r.prompt_token_ids) for r in requests} for _, requests in first + second]
    assert not prompts[0] & prompts[2] and not prompts[1] & prompts[3]  # no prompt repeats in the next round
    assert all(len(r.prompt_token_ids) == 40 and r.output_len == 3 for _, requests in second for r in requests)


def test_rounds_need_batch_sizes():
    run = subprocess.run([sys.executable, str(BENCH / "throughput.py"), "--rounds", "3"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "--rounds needs --batch-sizes" in run.stderr
