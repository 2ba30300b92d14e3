"""Rounds of a side-by-side run (throughput.py --rounds): every engine runs every point once a round, the order
rotating each round, so drift in the machine's speed (memory bandwidth here swings 1.6-2x within minutes) falls on
every engine alike. Tables keep each point's median round; ratios are medians of each round's own ratio."""
from __future__ import annotations

import statistics
from typing import Any, Sequence

from common import RunResult

ROUND_SEED_STRIDE = 104_729  # each round's prompts are new, so no engine's prefix cache serves a later round


def rotation(names: Sequence[str], index: int) -> list[str]:
    """The order of round `index`: the engines rotated by one place a round."""
    if not names:
        return []
    shift = index % len(names)
    return [*names[shift:], *names[:shift]]


def median_results(per_round: Sequence[Sequence[tuple[int | None, RunResult]]]) -> list[tuple[int | None, RunResult]]:
    """One result per (engine, concurrency): the round with the median output tokens/s (the lower middle of an
    even count), its details holding every round's output and decode tokens/s."""
    runs: dict[tuple[str, int | None], list[RunResult]] = {}
    for results in per_round:
        for concurrency, result in results:
            runs.setdefault((result.engine, concurrency), []).append(result)
    picked = []
    for (_, concurrency), results in runs.items():
        ordered = sorted(results, key=lambda r: r.output_tok_s)
        middle = ordered[(len(ordered) - 1) // 2]
        if len(results) > 1:
            middle.details["rounds_output_tok_s"] = [r.output_tok_s for r in results]
            middle.details["rounds_decode_tok_s"] = [r.decode_tok_s for r in results]
        picked.append((concurrency, middle))
    return picked


def median_extras(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The last round's extras with prompt processing and batch-1 generation replaced by their medians (every
    round's values kept beside them)."""
    if not rounds:
        return {}
    merged = dict(rounds[-1])
    for key in ("pp_tok_s", "tg_tok_s"):
        values = [r[key] for r in rounds if r.get(key)]
        if values:
            merged[key] = statistics.median(values)
            if len(rounds) > 1:
                merged[f"rounds_{key}"] = values
    return merged


def round_ratios(per_round: Sequence[Sequence[tuple[int | None, RunResult]]], concurrency: int, engine: str,
                 peer: str) -> list[float]:
    """engine's output tokens/s over peer's at one concurrency, once per round where both ran."""
    ratios = []
    for results in per_round:
        mine = {r.engine: r.output_tok_s for c, r in results if c == concurrency}
        if mine.get(engine) and mine.get(peer):
            ratios.append(mine[engine] / mine[peer])
    return ratios
