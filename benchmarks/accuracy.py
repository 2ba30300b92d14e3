"""Accuracy of each compute mode against the exact float32 path, measured, never assumed.

For each mode (float32, the GGUF's own quantized blocks with a bfloat16 or float32 KV cache, int8, int4, bfloat16)
on one model:
- perplexity on a fixed text (benchmarks/data/perplexity_text.md, cut into windows of --window tokens, each
  scored from its own start);
- teacher-forced agreement: on float32's greedy continuations of --num-prompts seeded prompts, the share of
  positions where the mode's top-1 token is float32's token;
- free-running agreement: the share of output tokens before the first divergence from float32's greedy output.

    python benchmarks/accuracy.py                              # bundled SmolLM2, every mode
    python benchmarks/accuracy.py --model gemma3-270m --modes float32,gguf,int8
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (default_output_path, machine_info, matched_prefix_share, ordinary_token_ids,  # noqa: E402
                    random_requests, write_json)

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "perplexity_text.md")
MODES = {
    "float32": {"dtype": "float32"},
    "gguf": {"quantization": "gguf", "amx_prefill": False},  # with its default bfloat16 KV cache
    # prompt rows in bfloat16 on AMX tiles (CPUs with AMX-BF16 only), decode rows on the blocks
    "gguf-amx-prefill": {"quantization": "gguf", "amx_prefill": True},
    "gguf-kv-float32": {"quantization": "gguf", "kv_cache_dtype": "float32"},
    "gguf-kv-fp8": {"quantization": "gguf", "kv_cache_dtype": "fp8"},
    # 64-token prompt chunks: every later chunk of the perplexity text reads its context from the KV cache
    "gguf-chunked": {"quantization": "gguf", "max_num_batched_tokens": 64},
    "gguf-kv-float32-chunked": {"quantization": "gguf", "kv_cache_dtype": "float32", "max_num_batched_tokens": 64},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "bfloat16": {"dtype": "bfloat16"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file, HF directory or named model; default: bundled SmolLM2")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list from {','.join(MODES)}")
    parser.add_argument("--window", type=int, default=512, help="perplexity window, tokens (default %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts for greedy agreement (default %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (default %(default)s)")
    parser.add_argument("--gen-len", type=int, default=64, help="greedy tokens per prompt (default %(default)s)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=None, help="JSON path; default benchmarks/results/accuracy-<timestamp>.json")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or "float32" not in args.modes:
        parser.error(f"--modes must name some of {list(MODES)} and include float32 (the reference), got {args.modes}")
    return args


def perplexity(llm, windows: list[list[int]]) -> float:
    from deepinfer import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    total, count = 0.0, 0
    for out in llm.generate(windows, [params] * len(windows), use_tqdm=False):
        ids = out.prompt_token_ids
        for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
            total += entry[ids[position]]
            count += 1
    return math.exp(-total / count)


def greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def teacher_forced(llm, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    from deepinfer import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    seqs = [p + c for p, c in zip(prompts, continuations)]
    agree = total = 0
    for prompt, seq, out in zip(prompts, seqs, llm.generate(seqs, [params] * len(seqs), use_tqdm=False)):
        for i in range(len(prompt), len(seq)):
            top = max(out.prompt_logprobs[i].items(), key=lambda kv: kv[1])[0]
            agree += top == seq[i]
            total += 1
    return agree / total


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from deepinfer import LLM

    torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    reference: dict[str, Any] = {}
    for mode in ["float32"] + [m for m in args.modes if m != "float32"]:
        start = time.perf_counter()
        try:
            llm = LLM(args.model, num_threads=args.threads, kv_cache_memory=512 << 20, **MODES[mode])
        except ValueError as e:
            print(f"{mode}: skipped ({e})")
            rows.append({"mode": mode, "skipped": str(e)})
            continue
        tok = llm.get_tokenizer()
        if not reference:
            ids = tok(open(TEXT).read()).input_ids
            windows = [ids[i : i + args.window] for i in range(0, len(ids) - args.window + 1, args.window)]
            prompts = [r.prompt_token_ids for r in random_requests(
                args.num_prompts, (args.prompt_len, args.prompt_len), (1, 1), ordinary_token_ids(tok), 0)]
            reference = {"windows": windows, "prompts": prompts, "greedy": greedy(llm, prompts, args.gen_len)}
        row = {"mode": mode, "compute": llm.engine.compute.name, "perplexity": perplexity(llm, reference["windows"])}
        if mode != "float32":
            row["teacher_forced_top1"] = teacher_forced(llm, reference["prompts"], reference["greedy"])
            row["free_running_prefix"] = matched_prefix_share(greedy(llm, reference["prompts"], args.gen_len),
                                                      reference["greedy"])
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        print(f"{mode:<10} {row['compute']:<16} ppl {row['perplexity']:8.3f}  "
              f"top-1 {100 * row.get('teacher_forced_top1', 1):5.1f}%  prefix {100 * row.get('free_running_prefix', 1):5.1f}%",
              flush=True)
        del llm
    tokens = sum(len(w) for w in reference.get("windows", []))
    out = args.out or default_output_path("accuracy")
    write_json({"benchmark": "accuracy", "model": args.model or "bundled SmolLM2", "text": os.path.basename(TEXT),
                "text_tokens": tokens, "args": vars(args), "machine": machine_info(args.threads), "results": rows}, out)
    print(f"perplexity over {tokens} tokens in windows of {args.window}; wrote {out}")


if __name__ == "__main__":
    main()
