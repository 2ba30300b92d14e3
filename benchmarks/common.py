"""Shared benchmark helpers: seeded token-id workloads, machine info, JSON output, and engine runners.

Every runner takes the same requests (prompt token ids plus an exact output length) and generates exactly that
many tokens per request, greedy, with EOS ignored, so engines do identical work:

- deepinfer: the offline `LLM` API, every request submitted at once (the engine batches continuously).
- transformers: `generate` on static batches with left padding; a batch runs to its longest output.
The peers users would pick instead (llama.cpp, vLLM) are in peers.py. Heavy imports stay inside functions: the
vLLM worker (peers.py, run by another venv's python) imports this file where deepinfer is not installed.
"""
from __future__ import annotations

import importlib.util
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class RunResult:
    engine: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int  # requested and checked as generated; transformers' padding-waste tokens are not counted
    wall_s: float
    # Seconds after every request had its first token (decode only); how each runner measures it is in its docstring.
    decode_s: float | None = None
    details: dict[str, Any] = field(default_factory=dict)
    token_ids: list[list[int]] = field(default_factory=list, repr=False)  # each request's counted output tokens
    # tokens decode_s covers, where a tool reports its own split (llama-batched-bench); None: output minus requests
    decode_tokens: int | None = None

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    @property
    def decode_tok_s(self) -> float | None:
        # Each request's first token comes out of its prefill, so decode produced output_len - 1 per request.
        if not self.decode_s:
            return None
        tokens = self.decode_tokens if self.decode_tokens is not None else self.output_tokens - self.num_requests
        return tokens / self.decode_s

    def to_dict(self) -> dict[str, Any]:
        row = {**asdict(self), "output_tok_s": self.output_tok_s, "total_tok_s": self.total_tok_s,
               "decode_tok_s": self.decode_tok_s}
        del row["token_ids"]
        return row


def greedy_agreement(ours: RunResult, reference: RunResult) -> dict[str, float] | None:
    """How far two runs' greedy outputs agree: a fast engine that computes something else shows up here.
    Float32 engines on the same weights should agree almost everywhere (a near-tie can flip and then diverge);
    engines on quantized weights drift sooner. None when a run reports no tokens (llama.cpp's own tools)."""
    if not ours.token_ids or not reference.token_ids:
        return None
    pairs = list(zip(ours.token_ids, reference.token_ids))
    if not pairs or len(ours.token_ids) != len(reference.token_ids):
        raise ValueError(f"cannot compare {len(ours.token_ids)} outputs with {len(reference.token_ids)}")
    return {"identical_requests": sum(x == y for x, y in pairs) / len(pairs),
            "matched_prefix_tokens": matched_prefix_share(ours.token_ids, reference.token_ids)}


def matched_prefix_share(ours: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> float:
    """Output tokens before each request's first difference from the reference, as a share of the reference's."""
    matched = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
               for x, y in zip(ours, reference)]
    total = sum(len(y) for y in reference)
    return sum(matched) / total if total else 1.0


class EngineUnavailable(Exception):
    """The engine cannot run here (not installed, no interpreter); the benchmark skips it and says why."""


# ---- workloads -------------------------------------------------------------------------------------------------

def ordinary_token_ids(tokenizer: Any) -> list[int]:
    """The vocabulary minus special and added tokens, so random prompts hold no control tokens."""
    excluded = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return [i for i in range(len(tokenizer)) if i not in excluded]


def random_requests(count: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
                    token_ids: Sequence[int], seed: int) -> list[BenchRequest]:
    """`count` requests with lengths uniform in the inclusive ranges and prompt tokens uniform over token_ids.

    Prompts are token ids, not text, so every engine sees identical input without re-tokenizing.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    for name, (low, high) in (("prompt_lens", prompt_lens), ("output_lens", output_lens)):
        if not 1 <= low <= high:
            raise ValueError(f"{name} must be a range 1 <= low <= high, got {(low, high)}")
    if not token_ids:
        raise ValueError("token_ids is empty")
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        prompt = [rng.choice(token_ids) for _ in range(rng.randint(*prompt_lens))]
        requests.append(BenchRequest(prompt, rng.randint(*output_lens)))
    return requests


def take_turns(engines: dict[str, Any], prompts: list, params: Any, rounds: int
               ) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """Each round runs every engine once on the same requests, the order reversed every other round, so each
    round's runs are back to back: (seconds per engine per round, each engine's last output token ids)."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            start = time.perf_counter()
            outs = engines[name].generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - start)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
    return times, tokens


def paired_ratios(slow: list[float], fast: list[float]) -> list[float]:
    """Sorted per-round ratios slow / fast of take_turns' times: each pair ran back to back, so its ratio cancels
    the machine's slow drift (+-15% within an hour here) that a ratio of medians keeps."""
    return sorted(a / b for a, b in zip(slow, fast))


def workload_summary(requests: Sequence[BenchRequest]) -> dict[str, int]:
    prompts = [len(r.prompt_token_ids) for r in requests]
    outputs = [r.output_len for r in requests]
    return {"num_requests": len(requests), "prompt_tokens": sum(prompts), "output_tokens": sum(outputs),
            "min_prompt": min(prompts), "max_prompt": max(prompts), "min_output": min(outputs), "max_output": max(outputs)}


# ---- machine info and output -----------------------------------------------------------------------------------

def machine_info(threads: int) -> dict[str, Any]:
    """What the numbers depend on. Load average is included because a shared machine skews them."""
    import torch

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "benchmark_threads": threads,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_CORETYPE") if k in os.environ},
    }
    for package in ("transformers", "deepinfer", "llama_cpp"):
        info[package] = _version(package)
    return info


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return platform.processor() or None


def _version(package: str) -> str | None:
    if importlib.util.find_spec(package) is None:
        return None
    try:
        from importlib.metadata import version

        return version({"llama_cpp": "llama-cpp-python"}.get(package, package))
    except Exception:  # an editable or vendored install without metadata
        return "unknown"


def median_seconds(fn: Callable[[], Any], repeats: int = 9) -> float:
    """The median wall time of `repeats` calls of fn, after one call not timed (warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def default_output_path(benchmark: str, suffix: str = ".json") -> str:
    return os.path.join(RESULTS_DIR, f"{benchmark}-{time.strftime('%Y%m%d-%H%M%S')}{suffix}")


def write_json(payload: dict[str, Any], path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    return path


def _check_lengths(engine: str, requests: Sequence[BenchRequest], generated: Sequence[int]) -> None:
    short = [(i, n, r.output_len) for i, (r, n) in enumerate(zip(requests, generated)) if n < r.output_len]
    if short:
        i, n, want = short[0]
        raise RuntimeError(f"{engine} generated {n} tokens for request {i}, expected {want} ({len(short)} short)")


# ---- runners ---------------------------------------------------------------------------------------------------

class Runner:
    """Generates each request's output_len tokens greedily, EOS ignored, from its prompt token ids."""

    name = "?"
    mode = "?"  # how requests reach the engine, for the report

    def run(self, requests: Sequence[BenchRequest], progress: bool = True) -> RunResult:
        raise NotImplementedError

    def warmup(self, requests: Sequence[BenchRequest]) -> None:
        self.run(requests, progress=False)

    def close(self) -> None:
        pass


class DeepinferRunner(Runner):
    """decode_s: from the moment the last request got its first token to the last token (engine timestamps);
    meaningful when every request fits in one running batch (max_num_seqs)."""

    name = "deepinfer"
    mode = "continuous batching, all requests submitted at once"

    def __init__(self, model: str, threads: int, options: dict[str, Any], name: str = "deepinfer") -> None:
        from deepinfer import LLM

        self.name = name
        self.options = {"num_threads": threads, **options}
        self.llm = LLM(model, **self.options)
        amx = ", prompt rows on AMX tiles" if self.llm.engine.executor.amx_prefill else ""
        self.mode = f"{self.llm.engine.compute.name}{amx}, continuous batching, all requests submitted at once"

    def weight_bytes(self) -> int:
        """Bytes the model's weights hold: dense parameters plus packed quantized blocks (a tied table once)."""
        model = self.llm.engine.executor.runner.model
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        packed = {id(m.weight): m.weight.nbytes for m in model.modules()
                  if type(getattr(m, "weight", None)).__name__ == "QuantWeight"}
        return total + sum(packed.values())

    def run(self, requests: Sequence[BenchRequest], progress: bool = True) -> RunResult:
        from deepinfer import SamplingParams

        params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
        preemptions = self.llm.engine.stats().num_preemptions
        start = time.perf_counter()
        outputs = self.llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=progress)
        wall = time.perf_counter() - start
        failed = [o for o in outputs if o.error]
        if failed:
            raise RuntimeError(f"deepinfer failed {len(failed)} requests; first: {failed[0].error}")
        _check_lengths(self.name, requests, [len(o.outputs[0].token_ids) for o in outputs])
        first = max(o.metrics.first_token_time for o in outputs)
        last = max(o.metrics.last_token_time for o in outputs)
        return RunResult(self.name, len(requests), sum(len(r.prompt_token_ids) for r in requests),
                         sum(r.output_len for r in requests), wall, last - first,
                         {"cached_prompt_tokens": sum(o.num_cached_tokens for o in outputs),
                          "preemptions": self.llm.engine.stats().num_preemptions - preemptions},
                         [list(o.outputs[0].token_ids[: r.output_len]) for o, r in zip(outputs, requests)])


class TransformersRunner(Runner):
    """Static batches of batch_size in request order, left-padded; each batch generates its longest output
    (min_new_tokens = max_new_tokens keeps every row going past EOS) and only each request's own length counts.
    decode_s: per batch, from the first logits processor call (right after the prefill forward) to the end."""

    name = "transformers"

    def __init__(self, model_path: str, threads: int, batch_size: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from deepinfer.models.gguf_views import plain_gguf_views

        if batch_size < 1:
            raise ValueError(f"transformers batch size must be >= 1, got {batch_size}")
        torch.set_num_threads(threads)
        self.batch_size = batch_size
        self.mode = f"static batches of up to {batch_size} requests, left padding"
        directory, name = os.path.split(model_path)
        if not name.endswith(".gguf"):  # a Hugging Face directory
            directory, name = model_path, None
        with plain_gguf_views():
            self.model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
        eos = self.model.config.eos_token_id
        self.eos = eos[0] if isinstance(eos, list) else eos
        pad = self.model.config.pad_token_id
        self.pad = pad if pad is not None else (self.eos if self.eos is not None else 0)  # masked out either way

    def run(self, requests: Sequence[BenchRequest], progress: bool = True) -> RunResult:
        import torch
        from tqdm.auto import tqdm
        from transformers import GenerationConfig, LogitsProcessorList

        wall = decode = 0.0
        generated_total = 0
        token_ids: list[list[int]] = []
        with tqdm(total=len(requests), desc="transformers", unit="req", disable=not progress) as bar:
            for at in range(0, len(requests), self.batch_size):
                batch = requests[at : at + self.batch_size]
                width = max(len(r.prompt_token_ids) for r in batch)
                new = max(r.output_len for r in batch)
                ids = torch.tensor([[self.pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch])
                mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch])
                config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1,
                                          pad_token_id=self.pad, eos_token_id=self.eos)
                clock = _first_call_clock()
                start = time.perf_counter()
                with torch.inference_mode():
                    out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                              logits_processor=LogitsProcessorList([clock]))
                end = time.perf_counter()
                if out.shape[1] - width != new:
                    raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens per row, expected {new}")
                wall += end - start
                decode += end - clock.first
                generated_total += new * len(batch)
                token_ids += [row[width : width + r.output_len] for row, r in zip(out.tolist(), batch)]
                bar.update(len(batch))
        output_tokens = sum(r.output_len for r in requests)
        return RunResult(self.name, len(requests), sum(len(r.prompt_token_ids) for r in requests), output_tokens,
                         wall, decode, {"generated_tokens_with_padding_waste": generated_total}, token_ids)


def _first_call_clock():
    # The class is built here, not at import: LogitsProcessor needs transformers, absent in the vLLM worker.
    from transformers import LogitsProcessor

    class FirstCallClock(LogitsProcessor):
        """Records when generate first asks for logits processing: the prefill forward has just finished."""

        first: float | None = None

        def __call__(self, input_ids, scores):
            if self.first is None:
                self.first = time.perf_counter()
            return scores

    return FirstCallClock()
