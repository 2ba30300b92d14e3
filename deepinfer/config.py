"""Engine configuration: frozen dataclasses resolved once; DEEPINFER_* env vars are read only here."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # None: the bundled default model (SmolLM2-135M-Instruct GGUF)
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the model's own context length
    device: str = "cpu"
    tokenizer: str | None = None  # None: from the model directory or the GGUF metadata

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: a fraction of free memory
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    max_waiting_requests: int | None = None  # the server answers 503 past this

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    batch_invariant: bool = False
    enable_mtp_varlen: bool = True
    num_threads: int | None = None  # torch intra-op threads; None: torch's default

    @classmethod
    def from_kwargs(cls, env: Mapping[str, str] | None = None, **kwargs: Any) -> EngineConfig:
        """Builds the config from flat keyword arguments (the LLM / CLI surface) and the environment."""
        env = os.environ if env is None else env
        parts: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}}
        owners = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
        top: dict[str, Any] = {}
        top_names = {f.name for f in fields(cls)} - set(owners)
        for key, value in kwargs.items():
            if value is None:
                continue
            owner = next((name for name, klass in owners.items() if key in {f.name for f in fields(klass)}), None)
            if owner is not None:
                parts[owner][key] = value
            elif key in top_names:
                top[key] = value
            else:
                raise ValueError(f"unknown engine option {key!r}")
        if "batch_invariant" not in top:
            top["batch_invariant"] = _env_flag(env, "DEEPINFER_BATCH_INVARIANT", False)
        if "enable_mtp_varlen" not in top:
            top["enable_mtp_varlen"] = _env_flag(env, "DEEPINFER_ENABLE_MTP_VARLEN", True)
        return cls(
            model=ModelConfig(**parts["model"]),
            cache=CacheConfig(**parts["cache"]),
            scheduler=SchedulerConfig(**parts["scheduler"]),
            **top,
        )


def _env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
