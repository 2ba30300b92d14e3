"""Command-line engine options -> EngineConfig: the one mapping that `generate`, `serve` and later commands share."""
from __future__ import annotations

import argparse

from deepinfer.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF directory, .gguf file or a named model; default: bundled SmolLM2-135M-Instruct")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="dense compute dtype; default float32, and a GGUF model computes on its quantized blocks "
                        "unless a dtype is given (--dtype float32 is the exact dense path)")
    g.add_argument("--quantization", default=None, choices=["none", "gguf", "int8", "int4"],
                   help="gguf: compute on the file's quantized blocks (default for .gguf); int8 / int4: quantize "
                        "float weights at load; none: dense weights")
    g.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=_bytes, default=None, help="KV cache budget, e.g. 2GiB or 512MiB; default: a fifth of free RAM up to 4 GiB")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "fp8", "fp8_e4m3"],
                   help="auto: bfloat16 under quantized compute (half the bytes attention reads), else the compute "
                        "dtype; fp8 (= fp8_e4m3): float8 e4m3, a quarter of float32's bytes, outputs change (CPU)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap scheduling: plan the next step and process outputs while a step computes "
                        "(default: off; it measured slower on the CPU and on CUDA)")
    g.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="decode steps a decode (no drafts, no grammar) runs per engine step, without the "
                        "engine's work between them (default 1)")
    g.add_argument("--batch-invariant", action="store_true", default=None, help="same as DEEPINFER_BATCH_INVARIANT=1")
    g.add_argument("--num-threads", type=int, default=None)
    sp = parser.add_argument_group("speculative decoding")
    sp.add_argument("--speculative-method", default=None, choices=["ngram", "mtp"],
                    help="draft tokens with n-gram prompt lookup or the model's MTP layers; default: off")
    sp.add_argument("--num-speculative-tokens", type=int, default=None, help="drafts per step (default 3)")
    sp.add_argument("--speculative-draft", default=None, metavar="PATH", help="a trained MTP head (deepinfer train-mtp)")
    sp.add_argument("--speculative-ngram-lookup", action="store_true", default=None,
                    help="mtp: an n-gram lookup first; where the last 2+ tokens occurred before, its drafts that step")
    ep = parser.add_argument_group("expert parallelism (MoE models)")
    ep.add_argument("--expert-parallel-size", type=int, default=None, help="rank processes holding the experts")
    ep.add_argument("--num-redundant-experts", type=int, default=None, help="extra expert slots for hot experts")
    ep.add_argument("--eplb-interval", type=int, default=None, help="steps between expert rebalances")
    ep.add_argument("--moe-lb-window", type=int, default=None, help="steps moe_lb is measured over")
    ep.add_argument("--master-addr", default=None, help="torch.distributed rendezvous address (default 127.0.0.1)")
    ep.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free one)")
    ep.add_argument("--dist-backend", default=None, choices=["gloo", "nccl"])
    ep.add_argument("--dist-timeout", dest="dist_timeout_s", type=float, default=None,
                    help="seconds before a rank that does not answer fails the engine")
    kv = parser.add_argument_group("KV store (prefix blocks kept beyond the device cache, shared across restarts)")
    kv.add_argument("--kv-store", action="append", default=[], metavar="memory|disk|redis",
                    help="a tier; repeat or give a comma list (memory is always in front of disk)")
    kv.add_argument("--kv-store-path", default=None, help="directory of the disk tier (may be a shared mount)")
    kv.add_argument("--kv-store-url", default=None, help="redis tier, e.g. redis://127.0.0.1:6379/0")
    kv.add_argument("--kv-store-memory", type=_bytes, default=None, help="host-memory tier budget, e.g. 8GiB (default 1GiB)")
    kv.add_argument("--kv-store-disk-capacity", type=_bytes, default=None, help="disk tier capacity (default 16GiB)")
    kv.add_argument("--kv-ttl", action="append", default=[], type=_ttl, metavar="CLASS=SECONDS",
                    help="lifetime of blocks saved for a traffic class (defaults agent=259200, chatbot=604800)")
    kv.add_argument("--kv-ttl-class", default=None, choices=["agent", "chatbot"],
                    help="class of requests that name none (default chatbot)")
    pd = parser.add_argument_group("prefill/decode disaggregation (a router with --prefill and --decode in front)")
    pd.add_argument("--role", default=None, choices=["both", "prefill", "decode"],
                    help="both (default): whole requests; prefill: compute prompts and hand their KV over; decode: "
                         "take requests whose prompt another engine computed")
    pd.add_argument("--kv-handoff", default=None, choices=["direct", "store"],
                    help="prefill: hand the KV over directly from this process (zmq, the default) or through the KV "
                         "store (needs a tier the decode engines share: --kv-store disk on a shared path, or redis)")
    pd.add_argument("--kv-handoff-timeout", dest="kv_handoff_timeout_s", type=float, default=None,
                    help="seconds a prefill engine holds a hand-off and a decode engine waits for it before computing "
                         "the prompt itself (default 5)")
    pd.add_argument("--kv-handoff-host", default=None,
                    help="prefill, direct: the address decode engines reach this one at (default 127.0.0.1)")
    pd.add_argument("--kv-handoff-port", type=int, default=None, help="prefill, direct: its port (default: a free one)")


def engine_config_from_args(args: argparse.Namespace, **extra) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        draft=args.speculative_draft,
        ngram_lookup=args.speculative_ngram_lookup,
        expert_parallel_size=args.expert_parallel_size,
        num_redundant_experts=args.num_redundant_experts,
        eplb_interval=args.eplb_interval,
        moe_lb_window=args.moe_lb_window,
        master_addr=args.master_addr,
        master_port=args.master_port,
        dist_backend=args.dist_backend,
        dist_timeout_s=args.dist_timeout_s,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_chunked_prefill=not args.no_chunked_prefill,
        async_scheduling=args.async_scheduling,
        num_scheduler_steps=args.num_scheduler_steps,
        batch_invariant=args.batch_invariant,
        num_threads=args.num_threads,
        kv_store=",".join(args.kv_store),
        kv_store_path=args.kv_store_path,
        kv_store_url=args.kv_store_url,
        kv_store_memory=args.kv_store_memory,
        kv_store_disk_capacity=args.kv_store_disk_capacity,
        kv_ttl=dict(args.kv_ttl) or None,
        kv_ttl_class=args.kv_ttl_class,
        role=getattr(args, "role", None),
        kv_handoff=getattr(args, "kv_handoff", None),
        kv_handoff_timeout_s=getattr(args, "kv_handoff_timeout_s", None),
        kv_handoff_host=getattr(args, "kv_handoff_host", None),
        kv_handoff_port=getattr(args, "kv_handoff_port", None),
        **extra,
    )


def _bytes(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lower = text.strip().lower()
    for unit, scale in units.items():
        if lower.endswith(unit):
            return int(float(lower[: -len(unit)]) * scale)
    return int(float(lower))


def _ttl(text: str) -> tuple[str, float]:
    name, sep, seconds = text.partition("=")
    try:
        value = float(seconds)
    except ValueError:
        value = None
    if not sep or value is None:
        raise argparse.ArgumentTypeError(f"expected CLASS=SECONDS (e.g. agent=259200), got {text!r}")
    return name.strip(), value
