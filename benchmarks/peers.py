"""The peers users would pick instead of deepinfer, as benchmark runners (see common.py for the contract):

- llama.cpp's own tools (`--llama-bin DIR`): llama-batched-bench for decode at each concurrency (prompts and
  outputs of the requested lengths, all sequences at once) and llama-bench for prompt processing (pp) and batch-1
  generation (tg). They report speeds, not tokens, so greedy agreement is not checked for them.
- llama-cpp-python (optional): one request after another (`Llama.generate`); it has no multi-sequence API.
- vLLM (`--vllm-python`): a worker subprocess under another interpreter, using vLLM's offline `LLM` API, in float32
  or bfloat16.

This file is also the vLLM worker (`python peers.py vllm-worker ...`), run by the vLLM venv's python, where neither
deepinfer nor this venv's packages exist: heavy imports stay inside functions.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Sequence

from common import BenchRequest, EngineUnavailable, Runner, RunResult, _check_lengths


class ToolCrashed(RuntimeError):
    """A llama.cpp tool killed by a signal (SIGSEGV, SIGILL), not one that reported an error."""


class LlamaToolsRunner(Runner):
    """llama.cpp's llama-batched-bench for one concurrency per call: every request must share one prompt length
    and one output length. decode_s: its T_TG (the generation phase, all sequences together)."""

    name = "llama.cpp"

    def __init__(self, bin_dir: str | None, model_path: str, threads: int) -> None:
        if not bin_dir:
            raise EngineUnavailable("no --llama-bin given (a directory with llama-bench and llama-batched-bench)")
        self.batched = os.path.join(bin_dir, "llama-batched-bench")
        self.bench = os.path.join(bin_dir, "llama-bench")
        for tool in (self.batched, self.bench):
            if not os.access(tool, os.X_OK):
                raise EngineUnavailable(f"{tool} is not an executable")
        if not model_path.endswith(".gguf"):
            raise EngineUnavailable(f"llama.cpp needs a .gguf model, got {model_path!r}")
        self.model, self.threads = model_path, threads
        self.no_repack = ""  # why the tools run without weight repacking, once a repacked run crashed (_tool)

    def warmup(self, requests: Sequence[BenchRequest]) -> None:
        self._batched(8, 2, 1)  # each tool run warms itself up; this one finds out whether repacking crashes

    def run(self, requests: Sequence[BenchRequest], progress: bool = True) -> RunResult:
        prompts = {len(r.prompt_token_ids) for r in requests}
        outputs = {r.output_len for r in requests}
        if len(prompts) != 1 or len(outputs) != 1:
            raise ValueError("llama-batched-bench needs one prompt length and one output length (use --batch-sizes)")
        (pp,), (tg,), n = prompts, outputs, len(requests)
        row = self._batched(pp, tg, n)
        return RunResult(self.name, n, n * pp, n * tg, row["t"], row["t_tg"],
                         {"llama_batched_bench": row, "repack": not self.no_repack}, decode_tokens=n * tg)

    def _batched(self, pp: int, tg: int, n: int) -> dict[str, Any]:
        ctx = max(2048, n * (pp + tg) + 16)
        out = self._tool([self.batched, "-m", self.model, "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(pp),
                          "-ntg", str(tg), "-npl", str(n), "-t", str(self.threads), "--output-format", "jsonl"],
                         ["-nr"])
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")][-1]

    @property
    def mode(self) -> str:
        base = "llama-batched-bench (all sequences at once) and llama-bench"
        return f"{base}; {self.no_repack}" if self.no_repack else base

    def prompt_and_generation(self, prompt_len: int, gen_len: int, repetitions: int = 3) -> dict[str, Any]:
        """llama-bench's pp (one prompt of prompt_len tokens) and tg (gen_len tokens at batch 1), tokens/s."""
        rows = json.loads(self._tool([self.bench, "-m", self.model, "-t", str(self.threads), "-p", str(prompt_len),
                                      "-n", str(gen_len), "-r", str(repetitions), "-o", "json"], ["--repack", "0"],
                                     timeout=1800))
        pp = next(r for r in rows if r["n_prompt"] and not r["n_gen"])
        tg = next(r for r in rows if r["n_gen"] and not r["n_prompt"])
        return {"pp_tok_s": pp["avg_ts"], "pp_stddev": pp["stddev_ts"], "tg_tok_s": tg["avg_ts"],
                "tg_stddev": tg["stddev_ts"], "model_bytes": pp["model_size"], "build": pp["build_commit"],
                "repack": not self.no_repack}

    def _tool(self, command: list[str], without_repacking: list[str], timeout: int = 3600) -> str:
        """A tool's stdout. llama.cpp repacks weights for the CPU's extra kernels (AMX where the CPU has it); the
        build vendored in llama-cpp-python 0.3.36 dies by SIGSEGV on prompts on an AMX Xeon with repacked weights.
        A tool killed by a signal runs again with `without_repacking`, as users could, and so does every tool after
        it; the mode says so."""
        out = self._exec(command + (without_repacking if self.no_repack else []), timeout)
        if out.returncode < 0 and not self.no_repack:
            self.no_repack = (f"llama.cpp without weight repacking ({' '.join(without_repacking)}): with it, "
                              f"{os.path.basename(command[0])} died ({signal.Signals(-out.returncode).name})")
            out = self._exec(command + without_repacking, timeout)
        if out.returncode < 0:
            raise ToolCrashed(f"{os.path.basename(command[0])}: {signal.Signals(-out.returncode).name}")
        if out.returncode != 0:
            raise RuntimeError(f"{os.path.basename(command[0])} failed: {out.stderr.strip().splitlines()[-1:]}")
        return out.stdout

    @staticmethod
    def _exec(command: list[str], timeout: int) -> subprocess.CompletedProcess:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


class LlamaCppRunner(Runner):
    """One request at a time through `Llama.generate` (greedy), stopped after output_len tokens; the context is
    reset first, so no prompt prefix is reused. decode_s: the sum over requests of first token to last token."""

    name = "llamacpp"
    mode = "sequential (Llama.generate, one request at a time)"

    def __init__(self, model_path: str, threads: int, n_ctx: int, n_batch: int) -> None:
        if importlib.util.find_spec("llama_cpp") is None:
            raise EngineUnavailable("llama-cpp-python is not installed (pip install llama-cpp-python)")
        if not model_path.endswith(".gguf"):
            raise EngineUnavailable(f"llama.cpp needs a .gguf model, got {model_path!r}")
        _probe_llamacpp(model_path)
        from llama_cpp import Llama

        self.n_ctx, self.n_batch = n_ctx, n_batch
        self.llm = Llama(model_path=model_path, n_ctx=n_ctx, n_batch=n_batch, n_threads=threads,
                         n_threads_batch=threads, seed=0, verbose=False)

    def run(self, requests: Sequence[BenchRequest], progress: bool = True) -> RunResult:
        from tqdm.auto import tqdm

        token_ids: list[list[int]] = []
        decode = 0.0
        start = time.perf_counter()
        for r in tqdm(requests, desc="llama.cpp", unit="req", disable=not progress):
            if len(r.prompt_token_ids) + r.output_len > self.n_ctx:
                raise ValueError(f"request needs {len(r.prompt_token_ids) + r.output_len} tokens, n_ctx is {self.n_ctx}")
            self.llm.reset()
            tokens: list[int] = []
            first = time.perf_counter()
            for token in self.llm.generate(r.prompt_token_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
                tokens.append(token)
                if len(tokens) == 1:
                    first = time.perf_counter()
                if len(tokens) == r.output_len:
                    break
            decode += time.perf_counter() - first
            token_ids.append(tokens)
        wall = time.perf_counter() - start
        _check_lengths(self.name, requests, [len(t) for t in token_ids])
        return RunResult(self.name, len(requests), sum(len(r.prompt_token_ids) for r in requests),
                         sum(r.output_len for r in requests), wall, decode,
                         {"n_ctx": self.n_ctx, "n_batch": self.n_batch}, token_ids)

    def close(self) -> None:
        if hasattr(self.llm, "close"):  # llama-cpp-python >= 0.2.60 frees its context explicitly
            self.llm.close()


_LLAMACPP_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
next(iter(llm.generate([100, 200, 300], temp=0.0)))
"""


def _probe_llamacpp(model_path: str) -> None:
    """Decodes one token in a child process first: a llama.cpp built for instructions this machine advertises but
    cannot run (AMX tiles in a VM) dies with SIGILL, which would take the whole benchmark down with it."""
    try:
        probe = subprocess.run([sys.executable, "-c", _LLAMACPP_PROBE, model_path], capture_output=True, text=True,
                               timeout=300)
    except subprocess.TimeoutExpired as e:
        raise EngineUnavailable("llama-cpp-python's probe (load the model, decode one token) took over 300 s") from e
    if probe.returncode != 0:
        code = probe.returncode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        last = (probe.stderr.strip().splitlines() or ["no error output"])[-1]
        hint = (" (an instruction this CPU cannot run; on a VM without AMX rebuild with CMAKE_ARGS=\"-DGGML_NATIVE=OFF "
                "-DGGML_AVX2=ON -DGGML_AVX512=ON ...\", which leaves AMX off)" if code == -signal.SIGILL else f": {last}")
        raise EngineUnavailable(f"llama-cpp-python failed a probe run, {how}{hint}")


class VllmRunner(Runner):
    """vLLM's offline API in a worker process started with another interpreter (vLLM is not in this venv).
    Prefix caching is off there, so the prefill-only pass does not warm the timed one. decode_s: the timed
    run's wall time minus a prefill-only pass (max_tokens=1) over the same prompts, when measure_decode is set."""

    name = "vllm"

    def __init__(self, python: str | None, model_path: str, threads: int, measure_decode: bool,
                 dtype: str = "float32") -> None:
        if not python:
            raise EngineUnavailable("no --vllm-python given (the python of a venv with vllm installed)")
        if not os.access(python, os.X_OK):
            raise EngineUnavailable(f"--vllm-python {python!r} is not an executable")
        probe = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or ["no error output"])[-1]
            raise EngineUnavailable(f"{python} cannot import vllm: {last}")
        self.version = probe.stdout.strip()
        self.measure_decode = measure_decode
        self.name = {"float32": "vllm", "bfloat16": "vllm-bf16"}.get(dtype, f"vllm-{dtype}")  # the --engines names
        self.mode = f"vLLM {self.version} {dtype}, offline LLM.generate in a subprocess, all requests at once"
        read_fd, write_fd = os.pipe()  # results travel on their own pipe: vLLM logs to stdout and stderr
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}"),
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "vllm-worker", model_path, str(threads),
                                      str(write_fd), dtype], stdin=subprocess.PIPE, text=True, pass_fds=(write_fd,),
                                     env=env, start_new_session=True)
        os.close(write_fd)  # the worker holds the only write end, so its death reads as EOF here
        self.results = os.fdopen(read_fd)
        self._reply()  # the worker says ready once the model is loaded
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: int) -> None:
        """Stop or continue the worker and its engine processes (their own process group). Stopped while other
        engines run: idle, vLLM's processes still took ~0.1 of a core in polls (measured at stop 62), ~5% of two."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def _reply(self) -> dict[str, Any]:
        line = self.results.readline()
        if not line:
            raise RuntimeError(f"the vLLM worker exited (code {self.proc.wait()}) before answering; see its log above")
        return json.loads(line)

    def run(self, requests: Sequence[BenchRequest], progress: bool = True) -> RunResult:
        command = {"requests": [[r.prompt_token_ids, r.output_len] for r in requests],
                   "measure_prefill": self.measure_decode, "progress": progress}
        self._signal(signal.SIGCONT)
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        self._signal(signal.SIGSTOP)
        _check_lengths(self.name, requests, [len(t) for t in reply["token_ids"]])
        wall, prefill = reply["wall_s"], reply["prefill_s"]
        decode = wall - prefill if prefill is not None and wall > prefill else None  # noise can invert a tiny run
        return RunResult(self.name, len(requests), sum(len(r.prompt_token_ids) for r in requests),
                         sum(r.output_len for r in requests), wall, decode,
                         {"vllm": self.version, "prefill_only_s": prefill},
                         [t[: r.output_len] for t, r in zip(reply["token_ids"], requests)])

    def close(self) -> None:
        if self.proc.poll() is None:
            self._signal(signal.SIGCONT)
            self.proc.stdin.close()  # EOF ends the worker's loop
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.results.close()


def _vllm_worker(model: str, threads: int, result_fd: int, dtype: str) -> None:
    """Runs under the vLLM venv's python: one JSON command a line on stdin, one JSON reply a line on result_fd."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(threads)
    # on the CPU backend gpu_memory_utilization is the share of host memory vLLM reserves (0.92 by default, more
    # than a machine running other engines has free); the KV cache itself is VLLM_CPU_KVCACHE_SPACE GiB
    llm = LLM(model=model, dtype=dtype, seed=0, skip_tokenizer_init=True, enable_prefix_caching=False,
              gpu_memory_utilization=0.3)
    with os.fdopen(result_fd, "w") as out:
        out.write(json.dumps({"ready": True}) + "\n")
        out.flush()
        for line in sys.stdin:
            command = json.loads(line)
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in command["requests"]]
            prefill_s = None
            if command["measure_prefill"]:
                one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
                start = time.perf_counter()
                llm.generate(prompts, one, use_tqdm=False)
                prefill_s = time.perf_counter() - start
            params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)
                      for _, n in command["requests"]]
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=command["progress"])
            wall = time.perf_counter() - start
            out.write(json.dumps({"wall_s": wall, "prefill_s": prefill_s,
                                  "token_ids": [list(o.outputs[0].token_ids) for o in outputs]}) + "\n")
            out.flush()


if __name__ == "__main__":
    if len(sys.argv) != 6 or sys.argv[1] != "vllm-worker":
        sys.exit("usage: python peers.py vllm-worker MODEL THREADS RESULT_FD DTYPE (started by VllmRunner)")
    _vllm_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
