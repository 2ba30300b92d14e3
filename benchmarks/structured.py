"""Structured output cost: throughput with 0%, 50% and 100% of a batch constrained by a JSON schema, and the
per-step cost of the grammar work the engine does around each model step.

Every run submits the same batch of chat requests at once (greedy, --max-output tokens). Constrained requests
follow a schema for an array of at least 20 paint orders, which no request can finish within the budget, so
every request generates exactly --max-output tokens and the runs do the same amount of work; the difference is
the grammar: masks filled before each step, sampled tokens fed to the grammar after it, and tokens the grammar
forces appended without a model step (jump-forward). Prefix caching is off so runs do not warm each other.

The engine's grammar calls are timed in place: `masks` (fill each constrained row's bitmask and unpack it to a
bool row) and `accept` (advance the grammar, find jump-forward tokens); a step's mask cost is their sum.

    python benchmarks/structured.py                                   # 32 requests x 64 tokens, 0/50/100%
    python benchmarks/structured.py --num-requests 8 --max-output 16  # a quick look
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import default_output_path, machine_info, write_json  # noqa: E402

ORDER = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
    },
    "required": ["color", "quantity"],
}
SCHEMA = {"type": "array", "items": ORDER, "minItems": 20, "maxItems": 40}
COLORS = ("red", "green", "blue", "teal", "amber", "violet", "white", "black")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory; default: bundled SmolLM2")
    parser.add_argument("--num-requests", type=int, default=32, help="the batch: every request is submitted at once")
    parser.add_argument("--max-output", type=int, default=64, help="output tokens per request")
    parser.add_argument("--fractions", type=_fractions, default=[0.0, 0.5, 1.0],
                        help="comma list of constrained fractions in [0, 1]")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per fraction; the fastest is reported")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    parser.add_argument("--out", default=None, help="JSON path; default benchmarks/results/structured-<timestamp>.json")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    args = parser.parse_args(argv)
    for name in ("num_requests", "max_output", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def _fractions(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or not all(0 <= v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"fractions must be numbers in [0, 1], got {text!r}")
    return values


class GrammarTimer:
    """Wraps the engine's grammar calls (instance attributes shadow the methods) and its step."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] = {}
        structured = engine.structured
        for name in ("masks", "accept"):
            setattr(structured, name, self._timed(getattr(structured, name), name))
        self._step = engine.step
        engine.step = self._timed_step

    def _timed(self, fn, name: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            self._current[name] = self._current.get(name, 0.0) + time.perf_counter() - start
            if name == "masks":
                self._current["rows"] = len(result)
            return result
        return timed

    def _timed_step(self):
        self._current = {}
        start = time.perf_counter()
        outputs = self._step()
        self._current["step"] = time.perf_counter() - start
        self.steps.append(self._current)
        return outputs

    def reset(self) -> None:
        self.steps = []

    def summary(self) -> dict[str, Any]:
        masked = [s for s in self.steps if s.get("rows")]
        grammar_ms = [1e3 * (s.get("masks", 0.0) + s.get("accept", 0.0)) for s in masked]
        rows = sum(s["rows"] for s in masked)
        return {
            "steps": len(self.steps),
            "steps_with_masks": len(masked),
            "mean_step_ms": 1e3 * statistics.fmean(s["step"] for s in self.steps) if self.steps else None,
            "mean_masked_rows": rows / len(masked) if masked else 0,
            "mask_ms_per_step": _stats([1e3 * s.get("masks", 0.0) for s in masked]),
            "accept_ms_per_step": _stats([1e3 * s.get("accept", 0.0) for s in masked]),
            "grammar_ms_per_step": _stats(grammar_ms),
            "mask_us_per_row": 1e6 * sum(s.get("masks", 0.0) for s in masked) / rows if rows else None,
            "grammar_share_of_step": (sum(grammar_ms) / sum(1e3 * s["step"] for s in masked)) if masked else 0.0,
        }


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {"mean": statistics.fmean(ordered), "p50": ordered[len(ordered) // 2],
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], "max": ordered[-1]}


def workload(count: int, fraction: float, max_output: int):
    """Conversations and params; constrained requests are spread evenly through the batch."""
    from deepinfer import SamplingParams

    constrained = round(count * fraction)
    chosen = {int(i * count / constrained) for i in range(constrained)} if constrained else set()
    conversations, params = [], []
    for i in range(count):
        question = f"Order {i % 7 + 2} cans of {COLORS[i % len(COLORS)]} paint and more. Reply as JSON."
        conversations.append([{"role": "user", "content": question}])
        if i in chosen:
            params.append(SamplingParams(temperature=0, max_tokens=max_output,
                                         so_args={"schema_type": "json", "schema": SCHEMA}))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=max_output, ignore_eos=True))
    return conversations, params, len(chosen)


def run_fraction(llm, timer: GrammarTimer, args: argparse.Namespace, fraction: float) -> dict[str, Any]:
    conversations, params, constrained = workload(args.num_requests, fraction, args.max_output)
    best = None
    for _ in range(args.repeats):
        timer.reset()
        jumped = llm.engine.structured.jump_forward_tokens
        start = time.perf_counter()
        outputs = llm.chat(conversations, params, use_tqdm=not args.no_progress)
        wall = time.perf_counter() - start
        failed = [o for o in outputs if o.error]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed; first: {failed[0].error}")
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        result = {
            "fraction": fraction, "constrained_requests": constrained, "num_requests": len(outputs),
            "output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
            "jump_forward_tokens": llm.engine.structured.jump_forward_tokens - jumped,
            "finish_reasons": dict(Counter(o.outputs[0].finish_reason for o in outputs)),
            **timer.summary(),
        }
        if best is None or result["wall_s"] < best["wall_s"]:
            best = result
    return best


def report(results: list[dict[str, Any]]) -> None:
    base = results[0]["output_tok_s"] if results and results[0]["fraction"] == 0 else None
    header = (f"{'constrained':>11}{'tokens':>8}{'wall s':>8}{'tok/s':>8}{'vs 0%':>7}{'steps':>7}{'jumped':>8}"
              f"{'rows':>6}{'mask ms':>9}{'accept ms':>10}{'us/row':>8}{'share':>7}")
    print(header, "-" * len(header), sep="\n")
    for r in results:
        mask, accept = r["mask_ms_per_step"], r["accept_ms_per_step"]
        ratio = f"{r['output_tok_s'] / base:.2f}" if base else "-"
        print(f"{r['fraction']:>10.0%} {r['output_tokens']:>8}{r['wall_s']:>8.1f}{r['output_tok_s']:>8.1f}{ratio:>7}"
              f"{r['steps']:>7}{r['jump_forward_tokens']:>8}{r['mean_masked_rows']:>6.1f}"
              f"{mask['mean'] if mask else 0:>9.2f}{accept['mean'] if accept else 0:>10.2f}"
              f"{r['mask_us_per_row'] or 0:>8.0f}{r['grammar_share_of_step']:>7.1%}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from deepinfer import LLM

    llm = LLM(args.model, dtype="float32", num_threads=args.threads, enable_prefix_caching=False,
              max_num_seqs=max(args.num_requests, 1))
    timer = GrammarTimer(llm.engine)
    # Warm-up: compiles the grammar (then cached) and touches every code path once.
    warm, warm_params, _ = workload(2, 0.5, 4)
    llm.chat(warm, warm_params, use_tqdm=False)
    results = []
    for fraction in args.fractions:
        print(f"== {fraction:.0%} constrained", flush=True)
        results.append(run_fraction(llm, timer, args, fraction))
    report(results)
    payload = {"benchmark": "structured", "args": dict(vars(args)), "schema": SCHEMA,
               "machine": machine_info(args.threads), "results": results}
    print("wrote", write_json(payload, args.out or default_output_path("structured")))


if __name__ == "__main__":
    main()
