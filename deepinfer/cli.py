"""Command line: deepinfer generate | serve | router."""
from __future__ import annotations

import argparse
import logging
import sys

from deepinfer.args import add_engine_args, engine_config_from_args
from deepinfer.router.args import add_data_parallel_args, add_router_args, check_data_parallel_args
from deepinfer.sampling_params import SamplingParams


def cmd_generate(args: argparse.Namespace) -> int:
    from deepinfer.engine.engine import Engine

    engine = Engine(engine_config_from_args(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        seq_seed=args.seed, stop=args.stop or None, output_kind="delta",
    )
    prompt = engine.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():  # deltas: the text each step adds
            sys.stdout.write(out.outputs[0].text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    check_data_parallel_args(args)
    if args.ray:
        from deepinfer.router.ray_launch import run_on_ray

        return run_on_ray(args)
    if args.data_parallel_size != 1:
        from deepinfer.router.launch import run_data_parallel

        return run_data_parallel(args)
    from deepinfer.server.serve import run_server

    return run_server(args)


def cmd_router(args: argparse.Namespace) -> int:
    from deepinfer.router.serve import run_router

    return run_router(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="LLM inference engine and OpenAI-compatible server")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text for one prompt and stream it to stdout")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.set_defaults(func=cmd_generate)

    add_train_mtp(sub)
    try:
        from deepinfer.server.serve import add_serve_args
    except ImportError:
        add_serve_args = None
    if add_serve_args is not None:
        serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
        add_engine_args(serve)
        add_serve_args(serve)
        add_data_parallel_args(serve)
        serve.set_defaults(func=cmd_serve)
        router = sub.add_parser("router", help="route OpenAI requests over running replicas (cache- and load-aware)")
        add_router_args(router)
        router.set_defaults(func=cmd_router)
    return parser


def cmd_train_mtp(args: argparse.Namespace) -> int:
    from deepinfer.spec.train_mtp import TrainConfig, train

    config = TrainConfig(num_prompts=args.num_prompts, gen_tokens=args.gen_tokens, minutes=args.minutes,
                         max_steps=args.max_steps, threads=args.num_threads, seed=args.seed, depths=args.depths)
    directory = train(args.model, args.out, config)
    print(directory)
    return 0


def add_train_mtp(sub) -> None:
    train = sub.add_parser("train-mtp", help="train an MTP draft head for a model by self-distillation")
    train.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    train.add_argument("--out", default=None, help="directory to write (default: ~/.cache/deepinfer/mtp/<model>)")
    train.add_argument("--minutes", type=float, default=28.0, help="wall-clock budget (default %(default)s)")
    train.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (default: the budget)")
    train.add_argument("--num-prompts", type=int, default=3072,
                       help="self-generated training answers (default %(default)s)")
    train.add_argument("--depths", type=int, default=2, help="draft depths trained (default %(default)s)")
    train.add_argument("--gen-tokens", type=int, default=192, help="tokens per answer")
    train.add_argument("--num-threads", type=int, default=None)
    train.add_argument("--seed", type=int, default=0)
    train.set_defaults(func=cmd_train_mtp)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
