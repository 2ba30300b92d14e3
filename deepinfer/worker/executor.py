"""The seam between the engine and the worker side: the engine builds and drives workers only through an Executor.

Today one in-process ModelRunner sits behind it. Expert-parallel ranks, disaggregated roles and Ray actors are
other executors with the same three calls; the scheduler never knows which one runs its plans.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from deepinfer.config import Compute, EngineConfig
from deepinfer.core.kv_layout import KVCacheSpec, KVLayout
from deepinfer.core.plan import StepPlan, StepResult
from deepinfer.layers.moe import MoEStep, moe_step
from deepinfer.layers.quantized import QuantizedLinear, bound_head
from deepinfer.models.loader import ModelFiles, iter_weights
from deepinfer.ops import cpu_attention, cpu_ops
from deepinfer.ops.cpu_ops import last_level_cache_bytes
from deepinfer.ops.quant_linear import BOUNDED_ARGMAX_ROWS, PackedWeight, SplitWeight, splittable
from deepinfer.ops.wide_linear import available as amx_available
from deepinfer.spec.mtp_head import load_head
from deepinfer.transforms.quantize import finalize_quantized, prepare_quantized
from deepinfer.worker.host_memory import keep_freed_memory
from deepinfer.worker.kv_transfer import KVBlockTransfer
from deepinfer.worker.model_builder import TORCH_DTYPES, build_model, compute_layers
from deepinfer.worker.runner import ModelRunner

if TYPE_CHECKING:
    from deepinfer.kvstore.connector import KVStoreConnector

logger = logging.getLogger("deepinfer")


class Executor(ABC):
    """Lifecycle: construct (loads the weights) -> kv_cache_specs() -> initialize_cache(...) once -> execute(plan)
    per step -> shutdown(). `execute` returns plain data; an executor never reads the scheduler's state."""

    amx_prefill = False  # prompt rows compute in bfloat16 on AMX tiles (their KV differs from the blocks' in bits)

    @abstractmethod
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """What one token stores per attention layer: the engine sizes the block pool from it."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int, layout: KVLayout, kv_store: KVStoreConnector | None) -> None:
        """Allocates num_blocks blocks of KV cache laid out as `layout`; attaches the KV store's worker half."""

    @abstractmethod
    def execute(self, plan: StepPlan) -> StepResult:
        """Runs one step's plan: the diff of requests, the forward, sampling, KV store loads and saves."""

    def shutdown(self) -> None:
        """Releases the workers; the executor is not used afterwards."""


def split_head_bytes(config: EngineConfig, ops) -> int | None:
    """The smallest 8-bit LM head build_model puts in split planes (None: none; off unless asked for, since sampled
    steps pay for the unpacking where the memory is fast). Auto (config.split_head None): only where every step has
    one row (one sequence at a time, no drafts to verify: 3+ rows lose, doc/inference_deployment_qa.md) and only
    heads over twice the last-level cache (one that fits reads from cache and only pays for the unpacking), and only
    on AVX-512: with AVX2 alone the unpacking costs more than the bytes save (Gemma 3's one-user decode on a 2-core
    Zen 3: 1.09x greedy, 0.77x sampled; benchmarks/split_head.py)."""
    if ops is None or config.split_head is False:
        return None
    if config.split_head:
        return 0
    if config.scheduler.max_num_seqs != 1 or config.spec.enabled or not ops.isa().startswith("avx512"):
        return None
    return 2 * (last_level_cache_bytes() or 32 << 20)


def split_head_report(config: EngineConfig, model, ops) -> str:
    """For the start-up log: whether the head went in split planes, and why."""
    packed = getattr(getattr(getattr(model, "lm_head", None), "weight", None), "packed", None)
    slow = "without AVX-512 the unpacking costs more than the bytes save (1.09x greedy, 0.77x sampled on AVX2)"
    if isinstance(packed, SplitWeight):
        how = "DEEPINFER_SPLIT_HEAD=1" if config.split_head else "auto: one sequence at a time, the head over 2x the L3"
        return (f"yes ({how}): greedy steps of up to {packed.max_rows} rows read 5/8 of it"
                + ("" if ops.isa().startswith("avx512") else f"; but {slow}"))
    if config.split_head is False:
        return "no (off by default; DEEPINFER_SPLIT_HEAD=1 or auto for one-user greedy decoding)"
    if packed is None or not splittable(packed):
        return "no (not an 8-bit symmetric head)"
    if config.split_head is None and (config.scheduler.max_num_seqs != 1 or config.spec.enabled):
        return "no (auto: only with max_num_seqs 1 and no speculative decoding; DEEPINFER_SPLIT_HEAD=1 forces it)"
    if config.split_head is None and not ops.isa().startswith("avx512"):
        return f"no (auto: AVX-512 only; {slow})"
    return "no (auto: the head fits in twice the last-level cache)"


def apply_bounded_head(config: EngineConfig, model, ops) -> str:
    """Gives the LM head its two-pass greedy argmax (layers/quantized.bound_head) where config.bounded_head asks for
    it; auto: where the compiled ops are AVX2 without VNNI (Gemma 3 on the Zen 3: the head 1.7x at 64 rows, a batch-64
    step 1.1x; with VNNI an 8-bit product costs what a 6-bit one does, doc/inference_deployment_qa.md). Returns the
    start-up log's line."""
    if config.bounded_head is False:
        return "no (DEEPINFER_BOUNDED_HEAD=0)"
    if ops is None:
        return "no (no compiled CPU ops)"
    if config.bounded_head is None and ops.isa() != "avx2":
        return f"no (auto: AVX2 without VNNI only; the {ops.isa()} build's 8-bit products cost what 6-bit ones do)"
    if not bound_head(getattr(model, "lm_head", None)):
        return "no (not an 8-bit symmetric head on the compiled blocks)"
    how = "DEEPINFER_BOUNDED_HEAD=1" if config.bounded_head else "auto: AVX2 without VNNI"
    return (f"yes ({how}): greedy steps of {BOUNDED_ARGMAX_ROWS}+ rows bound every output from the quants' top 6 "
            "bits and compute in full only the blocks that can hold the largest")


def amx_prefill_choice(config: EngineConfig, ops, compute: Compute) -> tuple[bool, str]:
    """Whether prompt rows compute in bfloat16 on AMX tiles (ops/wide_linear.py), and why, for the start-up log;
    raises where it was asked for (DEEPINFER_AMX_PREFILL=1) and cannot run."""
    why_not = None
    if compute.quantization is None:
        why_not = "the weights are dense, not quantized"
    elif ops is None:
        why_not = "no compiled CPU ops"
    elif not amx_available(ops):
        why_not = "this CPU has no AMX-BF16, or the OS did not grant AMX tile state"
    if why_not is not None:
        if config.amx_prefill:
            raise ValueError(f"amx_prefill (DEEPINFER_AMX_PREFILL=1) cannot run here: {why_not}")
        return False, f"no ({why_not})" if config.amx_prefill is None else "no (DEEPINFER_AMX_PREFILL=0)"
    if config.amx_prefill is False:
        return False, "no (DEEPINFER_AMX_PREFILL=0)"
    if config.amx_prefill is None and config.batch_invariant:
        return False, ("no (auto: off under batch invariance, whose bits must not depend on the CPU having AMX; "
                       "DEEPINFER_AMX_PREFILL=1 forces it)")
    how = "DEEPINFER_AMX_PREFILL=1" if config.amx_prefill else "auto: the CPU has AMX-BF16"
    return True, f"yes ({how}): prompt rows in bfloat16 on AMX tiles, decode rows on the quantized blocks"


def _head_mode(model) -> str:
    """How a trained MTP head is quantized for a quantized model: int4 where every one of the model's own decoder
    layers is at most 4-bit (the head's layer then reads as few bytes a step as one of them: on the bundled SmolLM2
    Q4_1, `propose` 0.38 -> 0.34 ms a step and the same acceptance, doc/inference_deployment_qa.md "Stop 53"), else
    int8."""
    bits = [m.weight.packed.fmt.bits for m in model.modules()
            if isinstance(m, QuantizedLinear) and not m.head and isinstance(m.weight.packed, PackedWeight)]
    return "int4" if bits and max(bits) <= 4 else "int8"


def _quantize_before_load(ops, mode: str, huge_pages: bool):
    """The quantization transform as load_head's hook: swaps before the weights load, packs after."""
    def prepare(mtp):
        summary = prepare_quantized(mtp, mode, ops)
        return lambda module: finalize_quantized(module, summary, huge_pages)
    return prepare


class InProcessExecutor(Executor):
    """One ModelRunner in the engine's own process and thread."""

    def __init__(self, config: EngineConfig, files: ModelFiles, max_model_len: int, compute: Compute) -> None:
        self.config = config
        self.device = compute.device
        self.dtype = TORCH_DTYPES[compute.dtype]
        self.kv_dtype = TORCH_DTYPES[compute.cache_dtype]
        ops = cpu_ops.load() if config.cpu_kernels and compute.device == "cpu" else None
        glue = ops is not None and self.dtype == torch.float32 and config.fused_ops
        logger.info("compiled CPU ops: %s", "off (DEEPINFER_CPU_KERNELS=0 or not a CPU)" if ops is None else
                    f"{ops.isa()}; quantized linear layers: {'yes' if compute.quantization else 'no'}; fused "
                    f"norm / activation / rotary / cache write: {'yes' if glue else 'no (DEEPINFER_FUSED_OPS=0 or dtype ' + compute.dtype + ')'}"
                    f"{' (one row each: batch invariant as they stand)' if glue and config.batch_invariant else ''}"
                    f"; decode attention prefetches into {ops.attention_prefetch()}")
        if compute.quantization is not None and ops is None:
            logger.info("quantized layers compute on dequantized float32 weights (no compiled ops)")
        self.amx_prefill, amx_why = amx_prefill_choice(config, ops, compute)
        logger.info("prompt rows on AMX tiles: %s", amx_why)
        weights = iter_weights(files, self.dtype, keep_quantized=compute.quantization == "gguf")
        self.model = build_model(files.hf_config, weights, compute.dtype, compute.device, max_model_len,
                                 batch_invariant=config.batch_invariant, quantization=compute.quantization,
                                 ops=ops, fused_glue=glue, huge_pages=config.huge_pages,
                                 split_head=split_head_bytes(config, ops), amx_prefill=self.amx_prefill)
        if ops is not None and compute.quantization is not None:
            logger.info("LM head in split planes: %s", split_head_report(config, self.model, ops))
            logger.info("LM head's argmax in two passes: %s", apply_bounded_head(config, self.model, ops))
        self.quantized = compute.quantization is not None
        self._prepare_mtp(files, ops, glue)
        self.runner: ModelRunner | None = None
        if compute.device == "cpu":  # once loaded: the loading's large temporaries were returned to the kernel
            logger.info("host memory: %s", keep_freed_memory() if config.keep_host_memory else
                        "glibc's defaults (DEEPINFER_KEEP_HOST_MEMORY=0)")

    def _prepare_mtp(self, files: ModelFiles, ops, glue: bool) -> None:
        """With MTP drafts: the checkpoint's MTP layers or a trained head (spec.draft), transformed like the model;
        otherwise no MTP layer is kept (it would hold KV for nothing)."""
        spec, model = self.config.spec, self.model
        if spec.speculative_method != "mtp":
            if getattr(model, "mtp", None) is not None:
                model.mtp = None
            return
        if spec.draft is not None:
            mode = _head_mode(model) if self.quantized and ops is not None else None  # else as the model computes
            prepare = _quantize_before_load(ops, mode, self.config.huge_pages) if mode else None
            meta = load_head(model, spec.draft, files.hf_config, prepare)
            logger.info("MTP head from %s (trained for %s), its layer %s", spec.draft, meta.base_model,
                        mode or "dense")
        if getattr(model, "mtp", None) is None:
            raise ValueError("speculative_method='mtp' needs MTP layers: this checkpoint has none; train a head with "
                             "`deepinfer train-mtp` and pass draft=PATH (--speculative-draft)")
        compute_layers(model.mtp, ops, self.config.batch_invariant, glue)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return self.model.kv_cache_specs()

    def initialize_cache(self, num_blocks: int, layout: KVLayout, kv_store: KVStoreConnector | None) -> None:
        if self.runner is not None:
            raise RuntimeError("initialize_cache was already called")
        cc = self.config.cache
        kernels = None
        if self.config.cpu_kernels and self.device == "cpu" and self.dtype == torch.float32:
            kernels = cpu_attention.load()  # built once per machine (about a minute), then cached by torch
        self.runner = ModelRunner(self.model, num_blocks, cc.block_size, self.kv_dtype, self.device,
                                  self.config.batch_invariant, layout, kernels, self.config.spec,
                                  self.config.enable_mtp_varlen)
        self.runner.prompt_rows_tiles = self.amx_prefill
        if kv_store is not None:
            self.runner.kv_transfer = KVBlockTransfer(kv_store.store, kv_store.saver, self.runner.slot_caches,
                                                      num_blocks, cc.block_size)
            self.runner.async_loads = self.config.scheduler.async_kv_loads

    def execute(self, plan: StepPlan) -> StepResult:
        if self.runner is None:
            raise RuntimeError("execute before initialize_cache")
        with moe_step(MoEStep()) as moe:  # MoE layers report their routing counts here (EPLB input)
            result = self.runner.execute(plan)
        result.expert_counts = moe.counts()
        return result

