"""Speculative decoding side by side: speculation off, n-gram drafts and MTP drafts (a trained head) on SmolLM2, on a
repetitive workload (rewrite a given text, code with repeated identifiers) and open-ended chat, at several batch
sizes; llama.cpp's own n-gram speculation (llama-server --spec-type ngram-simple) where --llama-bin is given.

Greedy, the same token ids for every mode: speculation is lossless, so every mode generates the same tokens and only
the time differs. EOS is ignored (every request --max-tokens long) unless --stop-at-eos: then each request ends
where the model ends its turn, as a user's does (a rewrite past its end is text the model makes up, not a copy).
Reports output tokens/s (each request's whole time, its prompt included), speedup over off, and at batch 1 also
decode-only tokens/s (from each request's first token to its last: the speed llama-server's own timings give, and
what speculation changes) with its speedup; acceptance per draft position.
Batch B > 1 is B concurrent sequences in steady state: --waves x B requests through B slots (max_num_seqs = B), a
finished sequence's slot refilled at once, as a server under load runs; --waves 1 is one closed batch, whose wall
time is its slowest sequence's (speculation that speeds only the others then shows as cost alone). The modes run
in one process, taking turns for --rounds rounds (the machine drifts 5-10% between runs); each figure is the median
round.

    python benchmarks/spec_decode.py                                  # batch 1, 8, 32; off / ngram / mtp
    python benchmarks/spec_decode.py --batch-sizes 1 --modes off,ngram,mtp+ngram --k 8 --stop-at-eos
    python benchmarks/spec_decode.py --llama-bin ~/llama.cpp/build/bin --batch-sizes 1
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import default_output_path, machine_info, write_json  # noqa: E402

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork, trimmed "
           "the wick, and polished the great lens until it shone. Ships passing in the night counted the flashes: "
           "three short, one long. In winter the storms came from the north and the waves broke over the rocks.")
REPETITIVE = [
    f"Rewrite the following text exactly, word for word:\n\n{PASSAGE}",
    f"Repeat this paragraph twice:\n\n{PASSAGE}",
    "Continue this code with a mul and a div function in the same style:\n\ndef add(first_value, second_value):\n"
    "    result_value = first_value + second_value\n    return result_value\n\ndef sub(first_value, second_value):\n"
    "    result_value = first_value - second_value\n    return result_value\n",
    "Fix the typo and print the whole list again: apple, banana, cherry, date, elderbery, fig, grape, honeydew, "
    "apple, banana, cherry, date, elderbery, fig, grape, honeydew",
]
CHAT = ["Why is the sky blue?", "Give me three tips for learning to cook.", "Write a short poem about autumn.",
        "What should I pack for a weekend hiking trip?"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--modes", default="off,ngram,mtp",
                        help="off, ngram, mtp, mtp+ngram (the n-gram lookup first, MTP where it finds no match)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--waves", type=int, default=4, help="batch B > 1: waves x B requests through B slots")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the modes taking turns; the median is kept")
    parser.add_argument("--ngram-min", type=int, default=None, help="shortest suffix an n-gram draft matches")
    parser.add_argument("--ngram-max", type=int, default=None, help="longest suffix an n-gram draft matches")
    parser.add_argument("--draft", default=None, help="MTP head directory (default: the train-mtp cache dir)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--llama-bin", default=None, help="llama.cpp binaries: adds llama-server off / ngram-simple")
    parser.add_argument("--stop-at-eos", action="store_true",
                        help="requests end at the model's end of turn, as a user's do (default: exactly "
                             "--max-tokens each, past it)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.modes = [m.strip() for m in args.modes.split(",")]
    return args


def workloads(tokenizer) -> dict[str, list[list[int]]]:
    def chat(text: str) -> list[int]:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        return list(tokenizer(rendered, add_special_tokens=False).input_ids)
    return {"repetitive": [chat(t) for t in REPETITIVE], "chat": [chat(t) for t in CHAT]}


def run_deepinfer(llm, prompts: list[list[int]], batch: int, max_tokens: int, waves: int = 1,
                  stop_at_eos: bool = False) -> dict[str, Any]:
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=not stop_at_eos)
    stats0, times0 = llm.engine.stats().spec_decode, llm.engine.step_times.copy()
    count = max(batch * waves, len(prompts)) if batch > 1 else len(prompts)
    requests = [prompts[i % len(prompts)] for i in range(count)]
    start = time.perf_counter()
    tokens = []
    decode_tokens, decode_s = 0, 0.0  # batch 1: after each request's first token (what llama-server times)
    if batch == 1:
        for p in requests:
            for o in llm.generate([p], params, use_tqdm=False):
                tokens.append(list(o.outputs[0].token_ids))
                m = o.metrics
                if m is not None and m.first_token_time is not None and m.last_token_time is not None:
                    decode_tokens += len(tokens[-1]) - 1
                    decode_s += m.last_token_time - m.first_token_time
    else:
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)]
    wall = time.perf_counter() - start
    spent = llm.engine.step_times.since(times0)  # where a step's time goes: engine phases, ms per step
    row = {"output_tokens": sum(map(len, tokens)), "wall_s": wall, "tok_s": sum(map(len, tokens)) / wall,
           "steps": spent.steps, "step_ms": {p: round(v, 4) for p, v in spent.per_step_ms().items()},
           "tokens": tokens, "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else None}
    stats = llm.engine.stats().spec_decode
    if stats is not None:
        drafted = stats.num_draft_tokens - (stats0.num_draft_tokens if stats0 else 0)
        accepted = stats.num_accepted_tokens - (stats0.num_accepted_tokens if stats0 else 0)
        per_pos = [a - (stats0.accepted_per_position[i] if stats0 and i < len(stats0.accepted_per_position) else 0)
                   for i, a in enumerate(stats.accepted_per_position)]
        drafted_pos = [d - (stats0.drafted_per_position[i] if stats0 and i < len(stats0.drafted_per_position) else 0)
                       for i, d in enumerate(stats.drafted_per_position)]
        row.update(drafted=drafted, accepted=accepted, acceptance=accepted / drafted if drafted else None,
                   acceptance_per_position=[a / d if d else None for a, d in zip(per_pos, drafted_pos)])
    return row


def run_llama_server(bin_dir: str, model: str, prompts: list[list[int]], max_tokens: int, threads: int,
                     spec: str, stop_at_eos: bool = False) -> dict[str, Any]:
    """One request after another (batch 1) through llama-server; generation speed from its own timings."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [os.path.join(bin_dir, "llama-server"), "-m", model, "-t", str(threads), "--port", str(port), "-c", "4096",
           "--host", "127.0.0.1", "-np", "1"] + ([] if spec == "none" else ["--spec-type", spec])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        tokens, seconds = 0, 0.0
        for p in prompts:
            body = json.dumps({"prompt": p, "n_predict": max_tokens, "temperature": 0, "ignore_eos": not stop_at_eos,
                               "cache_prompt": False}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
            out = json.loads(urllib.request.urlopen(req, timeout=600).read())
            tokens += out["timings"]["predicted_n"]
            seconds += out["timings"]["predicted_ms"] / 1e3
        # its own timings cover generation only (after the prompt): compare with deepinfer's decode_tok_s
        return {"output_tokens": tokens, "wall_s": seconds, "tok_s": tokens / seconds, "decode_tok_s": tokens / seconds}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from deepinfer import LLM
    from deepinfer.models.loader import resolve_model_path
    from deepinfer.spec.mtp_head import default_head_dir

    torch.set_num_threads(args.threads)
    model_path = resolve_model_path(args.model)
    draft = args.draft or default_head_dir(model_path)
    options = {"off": {}, "ngram": {"speculative_method": "ngram", "num_speculative_tokens": args.k,
                         "ngram_min": args.ngram_min, "ngram_max": args.ngram_max},
               "mtp": {"speculative_method": "mtp", "num_speculative_tokens": args.k, "draft": draft},
               # the n-gram lookup first, MTP where it finds no match of 2+ tokens
               "mtp+ngram": {"speculative_method": "mtp", "num_speculative_tokens": args.k, "draft": draft,
                             "ngram_lookup": True, "ngram_min": args.ngram_min, "ngram_max": args.ngram_max}}
    unknown = set(args.modes) - set(options)
    if unknown:
        sys.exit(f"unknown modes {sorted(unknown)}: choose from {sorted(options)}")
    results: list[dict[str, Any]] = []
    reference: dict[tuple[str, int], list] = {}
    modes = [m for m in args.modes if not m.startswith("mtp") or os.path.isdir(draft)]
    if len(modes) < len(args.modes):
        print(f"mtp: skipped (no head at {draft}; run deepinfer train-mtp)")
    for batch in args.batch_sizes:  # engines per batch size (max_num_seqs = B slots), the modes taking turns
        engines = {mode: LLM(args.model, num_threads=args.threads, max_num_seqs=batch, **options[mode])
                   for mode in modes}
        loads = workloads(next(iter(engines.values())).get_tokenizer())
        for llm in engines.values():
            run_deepinfer(llm, loads["chat"][:1], 1, 8)  # warm-up
        for name, prompts in loads.items():
            runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
            for _ in range(args.rounds):
                for mode, llm in engines.items():
                    runs[mode].append(run_deepinfer(llm, prompts, batch, args.max_tokens, args.waves,
                                                    args.stop_at_eos))
            for mode in modes:
                row = dict(sorted(runs[mode], key=lambda r: r["tok_s"])[len(runs[mode]) // 2])  # the median round
                row["tok_s_rounds"] = [r["tok_s"] for r in runs[mode]]
                tokens = row.pop("tokens")
                key = (name, batch)
                if mode == "off":
                    reference[key] = tokens
                row.update(engine="deepinfer", mode=mode, workload=name, batch=batch,
                           same_tokens_as_off=tokens == reference.get(key) if key in reference else None)
                results.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "acceptance_per_position"}), flush=True)
        del engines
    if args.llama_bin:
        loads = workloads(LLM(args.model, kv_cache_memory=16 << 20).get_tokenizer())
        for spec in ("none", "ngram-simple"):
            for name, prompts in loads.items():
                row = run_llama_server(args.llama_bin, model_path, prompts, args.max_tokens, args.threads, spec,
                                       args.stop_at_eos)
                row.update(engine="llama.cpp", mode=spec, workload=name, batch=1)
                results.append(row)
                print(json.dumps(row), flush=True)
    base = {(r["engine"], r["workload"], r["batch"]): r for r in results if r["mode"] in ("off", "none")}
    print(f"\n{'engine':<10}{'mode':<14}{'workload':<12}{'batch':>6}{'tok/s':>9}{'speedup':>9}{'decode':>9}"
          f"{'speedup':>9}{'accept':>8}  per position")
    for r in results:
        off = base.get((r["engine"], r["workload"], r["batch"]))
        r["speedup"] = r["tok_s"] / off["tok_s"] if off else None
        decode, off_decode = r.get("decode_tok_s"), off.get("decode_tok_s") if off else None
        r["decode_speedup"] = decode / off_decode if decode and off_decode else None
        per = " ".join(f"{a:.2f}" for a in r.get("acceptance_per_position") or [] if a is not None)
        print(f"{r['engine']:<10}{r['mode']:<14}{r['workload']:<12}{r['batch']:>6}{r['tok_s']:>9.1f}"
              f"{(r['speedup'] or 0):>8.2f}x{(decode or 0):>9.1f}{(r['decode_speedup'] or 0):>8.2f}x"
              f"{(r.get('acceptance') or 0):>8.2f}  {per}")
    out = args.out or default_output_path("spec_decode")
    write_json({"benchmark": "spec_decode", "args": vars(args), "machine": machine_info(args.threads),
                "results": results}, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
