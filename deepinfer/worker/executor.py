"""The seam between the engine and the worker side: the engine builds and drives workers only through an Executor.

Today one in-process ModelRunner sits behind it. Expert-parallel ranks, disaggregated roles and Ray actors are
other executors with the same three calls; the scheduler never knows which one runs its plans.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from deepinfer.config import EngineConfig
from deepinfer.core.kv_layout import KVCacheSpec, KVLayout
from deepinfer.core.plan import StepPlan, StepResult
from deepinfer.models.loader import ModelFiles, iter_weights
from deepinfer.ops import cpu_attention
from deepinfer.worker.kv_transfer import KVBlockTransfer
from deepinfer.worker.model_builder import TORCH_DTYPES, build_model
from deepinfer.worker.runner import ModelRunner

if TYPE_CHECKING:
    from deepinfer.kvstore.connector import KVStoreConnector

logger = logging.getLogger("deepinfer")


class Executor(ABC):
    """Lifecycle: construct (loads the weights) -> kv_cache_specs() -> initialize_cache(...) once -> execute(plan)
    per step -> shutdown(). `execute` returns plain data; an executor never reads the scheduler's state."""

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


class InProcessExecutor(Executor):
    """One ModelRunner in the engine's own process and thread."""

    def __init__(self, config: EngineConfig, files: ModelFiles, max_model_len: int) -> None:
        self.config = config
        mc = config.model
        self.dtype = TORCH_DTYPES[mc.dtype]
        self.model = build_model(files.hf_config, iter_weights(files, self.dtype), mc.dtype, mc.device,
                                 max_model_len, batch_invariant=config.batch_invariant)
        self.runner: ModelRunner | None = None

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return self.model.kv_cache_specs()

    def initialize_cache(self, num_blocks: int, layout: KVLayout, kv_store: KVStoreConnector | None) -> None:
        if self.runner is not None:
            raise RuntimeError("initialize_cache was already called")
        mc, cc = self.config.model, self.config.cache
        kernels = None
        if self.config.cpu_kernels and mc.device == "cpu" and self.dtype == torch.float32:
            kernels = cpu_attention.load()  # built once per machine (about a minute), then cached by torch
        self.runner = ModelRunner(self.model, num_blocks, cc.block_size, self.dtype, mc.device,
                                  self.config.batch_invariant, layout, kernels)
        if kv_store is not None:
            self.runner.kv_transfer = KVBlockTransfer(kv_store.store, kv_store.saver, self.runner.slot_caches,
                                                      num_blocks, cc.block_size)

    def execute(self, plan: StepPlan) -> StepResult:
        if self.runner is None:
            raise RuntimeError("execute before initialize_cache")
        return self.runner.execute(plan)
