"""Decode throughput of a small random DeepSeek-V3 (MLA + MoE) in deepinfer vs transformers, same weights.

Each run prefills a batch of random prompts, then times only the decode steps: deepinfer through its engine
loop (paged latent cache, absorbed MLA decode, grouped experts), transformers through a plain greedy loop on
its own KV cache. Throughput = batch x decode steps / seconds; the median of --repeats runs is reported.

    python benchmarks/deepseek_decode.py --batch-sizes 1 32 --decode-steps 32 --repeats 3 \
        --out benchmarks/results/deepseek_decode.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepinfer import SamplingParams  # noqa: E402
from deepinfer.llm import LLM  # noqa: E402
from tests.models.hf_reference import save_tiny_tokenizer  # noqa: E402


def small_config(args: argparse.Namespace):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, q_lora_rank=args.hidden // 2, kv_lora_rank=args.hidden // 4,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=args.experts, n_shared_experts=1,
        num_experts_per_tok=args.top_k, n_group=4, topk_group=2, first_k_dense_replace=1,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    )


def save_model(config, path: str, seed: int):
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.01)
    model.save_pretrained(path)
    save_tiny_tokenizer(path, config.vocab_size)
    return model


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen).tolist()


def deepinfer_decode(llm: LLM, prompts: list[list[int]], steps: int) -> float:
    """Seconds for `steps` decode steps of the whole batch, after its prefill."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
    started: set[str] = set()
    while len(started) < len(prompts):  # prefill (possibly over several steps) until every request has a token
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    begin = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - begin


def transformers_decode(model, prompts: list[list[int]], steps: int) -> float:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        begin = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=token, cache=out.cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - begin


def add_shape_args(parser: argparse.ArgumentParser, decode_steps: int) -> None:
    """The small DeepSeek-V3 shape (small_config) and the decode workload, shared with ep_decode.py."""
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--decode-steps", type=int, default=decode_steps)
    parser.add_argument("--repeats", type=int, default=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(parser, decode_steps=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/deepseek_decode.json")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config = small_config(args)
    with tempfile.TemporaryDirectory(prefix="deepseek-bench-") as path:
        hf = save_model(config, path, args.seed)
        llm = LLM(path, dtype="float32", num_threads=args.threads, enable_prefix_caching=False,
                  max_num_seqs=max(args.batch_sizes), kv_cache_memory=256 << 20,
                  max_num_batched_tokens=max(2048, max(args.batch_sizes) * args.prompt_len))
        runs = [(b, r) for b in args.batch_sizes for r in range(args.repeats + 1)]  # repeat 0 warms up
        seconds: dict[tuple[str, int], list[float]] = {}
        for batch, repeat in tqdm(runs, desc="decode runs", disable=args.no_progress):
            prompts = prompts_for(batch, args.prompt_len, args.vocab, args.seed + repeat)
            for name, run in (("deepinfer", lambda: deepinfer_decode(llm, prompts, args.decode_steps)),
                              ("transformers", lambda: transformers_decode(hf, prompts, args.decode_steps))):
                elapsed = run()
                if repeat:
                    seconds.setdefault((name, batch), []).append(elapsed)

    results: list[dict[str, Any]] = []
    print(f"{'batch':>5} {'deepinfer tok/s':>16} {'transformers tok/s':>19} {'ratio':>6}")
    for batch in args.batch_sizes:
        row: dict[str, Any] = {"batch": batch}
        for name in ("deepinfer", "transformers"):
            rates = [batch * args.decode_steps / s for s in seconds[(name, batch)]]
            row[name] = {"median_tok_s": statistics.median(rates), "runs_tok_s": rates}
        row["ratio"] = row["deepinfer"]["median_tok_s"] / row["transformers"]["median_tok_s"]
        results.append(row)
        print(f"{batch:>5} {row['deepinfer']['median_tok_s']:>16.1f} {row['transformers']['median_tok_s']:>19.1f} {row['ratio']:>6.2f}")

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "deepseek_decode", "args": vars(args), "torch": torch.__version__,
                   "config": config.to_diff_dict(), "results": results}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
