"""Engine configuration: frozen dataclasses resolved once; DEEPINFER_* env vars are read only here."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from deepinfer.kvstore.base import KINDS, KVStoreConfig
from deepinfer.sampling_params import TTL_CLASSES

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
    # sliding-window hybrids: "compact" caches each sequence's last swa_keep_tokens positions of sliding-window KV
    # (a hit may replay a bounded tail); "full" caches all of it. swa_keep_tokens None: derived from the window.
    swa_prefix_mode: str = "compact"
    swa_keep_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.swa_prefix_mode not in ("compact", "full"):
            raise ValueError(f"swa_prefix_mode (DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE) must be 'compact' or 'full', "
                             f"got {self.swa_prefix_mode!r}")
        if self.swa_keep_tokens is not None and (isinstance(self.swa_keep_tokens, bool) or self.swa_keep_tokens < 1):
            raise ValueError(f"swa_keep_tokens (DEEPINFER_YOCO_PREFILL_KEEP_TOKENS) must be >= 1, got "
                             f"{self.swa_keep_tokens!r}")
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
    kv_store: KVStoreConfig = field(default_factory=KVStoreConfig)
    batch_invariant: bool = False
    enable_mtp_varlen: bool = True
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    cpu_kernels: bool = True  # the compiled CPU paged-decode kernel (DEEPINFER_CPU_KERNELS=0: torch ops only)

    @classmethod
    def from_kwargs(cls, env: Mapping[str, str] | None = None, **kwargs: Any) -> EngineConfig:
        """Builds the config from flat keyword arguments (the LLM / CLI surface) and the environment."""
        env = os.environ if env is None else env
        parts: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}}
        owners = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
        top: dict[str, Any] = {}
        top_names = {f.name for f in fields(cls)} - set(owners) - {"kv_store"}
        kv_store: dict[str, Any] = {}
        for key, value in kwargs.items():
            if value is None:
                continue
            if key == "kv_store" or key in _KV_STORE_OPTIONS:
                kv_store[key] = value
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
        if "swa_prefix_mode" not in parts["cache"] and env.get("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"):
            parts["cache"]["swa_prefix_mode"] = env["DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"].strip().lower()
        if "swa_keep_tokens" not in parts["cache"] and env.get("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"):
            raw = env["DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"]
            if not raw.strip().isdigit():
                raise ValueError(f"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS must be a positive integer, got {raw!r}")
            parts["cache"]["swa_keep_tokens"] = int(raw)
        if "cpu_kernels" not in top:
            top["cpu_kernels"] = _env_flag(env, "DEEPINFER_CPU_KERNELS", True)
        if "enable_mtp_varlen" not in top:
            top["enable_mtp_varlen"] = _env_flag(env, "DEEPINFER_ENABLE_MTP_VARLEN", True)
        return cls(
            model=ModelConfig(**parts["model"]),
            cache=CacheConfig(**parts["cache"]),
            scheduler=SchedulerConfig(**parts["scheduler"]),
            kv_store=_kv_store_config(kv_store),
            **top,
        )


# flat option -> KVStoreConfig field; `kv_store` names the tiers and `kv_ttl` maps a class to seconds
_KV_STORE_OPTIONS = {
    "kv_store_path": "disk_path",
    "kv_store_url": "redis_url",
    "kv_store_memory": "memory_bytes",
    "kv_store_disk_capacity": "disk_bytes",
    "kv_store_save_queue": "save_queue_size",
    "kv_ttl_class": "default_ttl_class",
    "kv_ttl": "ttl_classes",
}
_NEEDS_KIND = {"kv_store_path": "disk", "kv_store_url": "redis", "kv_store_memory": "memory",
               "kv_store_disk_capacity": "disk"}


def _kv_store_config(options: dict[str, Any]) -> KVStoreConfig:
    """kv_store: "memory", "memory,disk", a list of kinds, or a whole KVStoreConfig (then nothing else)."""
    kinds = options.pop("kv_store", ())
    if isinstance(kinds, KVStoreConfig):
        if options:
            raise ValueError(f"give either kv_store=KVStoreConfig(...) or the flat options, not both: {sorted(options)}")
        return kinds
    if isinstance(kinds, str):
        kinds = [k.strip() for k in kinds.split(",") if k.strip()]
    if not isinstance(kinds, (list, tuple)) or not all(isinstance(k, str) for k in kinds):
        raise ValueError(f"kv_store must be a comma-separated string or a list of {KINDS}, got {kinds!r}")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"kv_store kinds must be among {KINDS}, got {unknown}")
    for option, kind in _NEEDS_KIND.items():
        if option in options and kind not in kinds:
            raise ValueError(f"{option} is set but the {kind!r} tier is not enabled (kv_store={list(kinds)!r})")
    values = {_KV_STORE_OPTIONS[k]: v for k, v in options.items()}
    if "ttl_classes" in values:
        ttl = values["ttl_classes"]
        if not isinstance(ttl, Mapping) or not set(ttl) <= set(TTL_CLASSES):
            raise ValueError(f"kv_ttl must map classes among {TTL_CLASSES} to seconds, got {ttl!r}")
        values["ttl_classes"] = tuple({**dict(KVStoreConfig().ttl_classes), **ttl}.items())
    # fastest tier first: memory in front of disk in front of redis
    return KVStoreConfig(kinds=tuple(sorted(set(kinds), key=KINDS.index)), **values)


def _env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
