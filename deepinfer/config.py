"""Engine configuration: frozen dataclasses resolved once; DEEPINFER_* env vars are read only here."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from deepinfer.kvstore.base import KINDS, KVStoreConfig
from deepinfer.sampling_params import TTL_CLASSES

DTYPES = ("float32", "bfloat16", "float16")
FP8_NAMES = ("fp8", "fp8_e4m3")  # kv_cache_dtype names of float8 e4m3 (vLLM's)
QUANTIZATIONS = ("none", "gguf", "int8", "int4")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # None: the bundled default model (SmolLM2-135M-Instruct GGUF)
    dtype: str | None = None  # None: float32, and for a GGUF file its quantized compute (see `compute`)
    # "gguf": compute on the file's quantized blocks; "int8" / "int4": quantize float weights at load; "none": dense
    quantization: str | None = None  # None: "gguf" for a GGUF file unless a dtype is given, else "none"
    max_model_len: int | None = None  # None: the model's own context length
    device: str = "auto"  # "auto": CUDA when torch sees a GPU, else the CPU
    tokenizer: str | None = None  # None: from the model directory or the GGUF metadata

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {DEVICES} (or cuda:N), got {self.device!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization not in (None, "none") and self.dtype not in (None, "float32"):
            raise ValueError(f"quantization={self.quantization!r} computes activations in float32; "
                             f"dtype={self.dtype!r} cannot be combined with it")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class Compute:
    """What the model computes in, resolved once the model file is known."""

    dtype: str  # activations and dense weights
    quantization: str | None  # None: dense weights in dtype
    device: str = "cpu"
    kv_dtype: str | None = None  # the KV cache; None: dtype

    @property
    def cache_dtype(self) -> str:
        return self.kv_dtype or self.dtype

    @property
    def name(self) -> str:
        return self.dtype if self.quantization is None else f"{self.dtype}+{self.quantization}"


def resolve_compute(mc: ModelConfig, file_format: str, cuda_available: bool = False,
                    kv_cache_dtype: str = "auto") -> Compute:
    """GGUF files compute on their quantized blocks unless a dtype or quantization="none" asks for dense weights
    (`dtype="float32"` is the exact path every transformers comparison uses); other files compute densely. The
    quantized kernels are CPU code: on CUDA a GGUF model computes on its dequantized weights. The KV cache is kept
    in bfloat16 under quantized compute (as llama.cpp keeps it in float16: half the bytes attention reads) and in
    the compute dtype otherwise, unless kv_cache_dtype names one."""
    compute = _resolve_weights(mc, file_format, cuda_available)
    if kv_cache_dtype == "auto":
        kv = "bfloat16" if compute.quantization is not None else None
    elif kv_cache_dtype in FP8_NAMES:
        if compute.device != "cpu":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is built and checked on the CPU only; on "
                             f"{compute.device} use 'auto', 'float32' or 'bfloat16'")
        kv = "fp8_e4m3"
    else:
        kv = None if kv_cache_dtype == compute.dtype else kv_cache_dtype
    return dataclasses.replace(compute, kv_dtype=kv)


def _resolve_weights(mc: ModelConfig, file_format: str, cuda_available: bool) -> Compute:
    device = ("cuda" if cuda_available else "cpu") if mc.device == "auto" else mc.device
    if device.startswith("cuda") and not cuda_available:
        raise ValueError(f"device={mc.device!r} but torch sees no CUDA device")
    q = mc.quantization
    if device != "cpu" and q not in (None, "none"):
        raise ValueError(f"quantization={q!r} runs on the CPU only; on {device} use quantization='none'")
    if device != "cpu":
        return Compute(mc.dtype or "float32", None, device)
    if q == "gguf" and file_format != "gguf":
        raise ValueError(f"quantization='gguf' needs a .gguf model; this one is {file_format} "
                         f"(use int8 or int4 to quantize its weights at load)")
    if q is None:
        q = "gguf" if file_format == "gguf" and mc.dtype is None else "none"
    return Compute(mc.dtype or "float32", None if q == "none" else q, device)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: a fraction of free memory
    enable_prefix_caching: bool = True
    # sliding-window hybrids: "compact" caches each sequence's last swa_keep_tokens positions of sliding-window KV
    # (a hit may replay a bounded tail); "full" caches all of it. swa_keep_tokens None: derived from the window.
    swa_prefix_mode: str = "compact"
    swa_keep_tokens: int | None = None
    # "auto": bfloat16 under quantized compute, else the compute dtype (config.resolve_compute); or float32 /
    # bfloat16 / fp8 (float8 e4m3, as vLLM's --kv-cache-dtype fp8 without scales: values past 448 saturate)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", *FP8_NAMES):
            raise ValueError(f"kv_cache_dtype must be 'auto', 'float32', 'bfloat16' or 'fp8' (= 'fp8_e4m3'), got "
                             f"{self.kv_cache_dtype!r}")
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
    # KV store lookups and loads in the background: the step never waits for the store (core/kv_loading.py)
    async_kv_loads: bool = True
    # overlap scheduling: plan step N+1 and process step N's outputs while step N+1 computes (engine/overlap.py);
    # KV store / hand-off / expert-parallel engines run one step at a time, and so do steps with drafts (a grammar
    # mask waits, in the worker, for the token in flight). None: off; on the CPU the engine thread's work slows the
    # forward beside it (every core computes), on CUDA it measured slower (doc/inference_deployment_qa.md).
    async_scheduling: bool | None = None
    # sequences that may wait at once; the server answers 503 + Retry-After past it. None: derived from the KV
    # capacity (engine/client.default_max_waiting). The offline LLM never refuses work.
    max_waiting_requests: int | None = None
    # decode steps a decode (no drafts, no grammar) runs in one engine step (vLLM's --num-scheduler-steps): the
    # extra steps go straight from the sampler to the next forward, without the engine's scheduling and output work
    # in between (worker/multi_step.py). Tokens are the same; outputs and new arrivals wait for the whole run.
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.num_scheduler_steps, bool) or not isinstance(self.num_scheduler_steps, int) \
                or self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be an integer >= 1, got {self.num_scheduler_steps!r}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass(frozen=True)
class ParallelConfig:
    """Expert parallelism: `expert_parallel_size` worker processes joined by torch.distributed, each holding the
    routed experts of its slots (worker/ep_executor.py); 1: the model runs in the engine's process."""

    expert_parallel_size: int = 1
    num_redundant_experts: int = 0  # slots per MoE layer beyond one per expert: replicas of hot experts (EPLB)
    eplb_interval: int | None = None  # steps between placement updates from the measured loads; None: never
    moe_lb_window: int = 100  # steps over which moe_lb (EngineStats.moe_load) is measured
    master_addr: str = "127.0.0.1"  # where the engine hosts the ranks' rendezvous store
    master_port: int | None = None  # None: a free port
    dist_backend: str | None = None  # "gloo" | "nccl"; None: gloo on a CPU, nccl on CUDA
    dist_timeout_s: float = 300.0  # a collective, or a step the engine waits for, that takes longer fails

    def __post_init__(self) -> None:
        ep = self.expert_parallel_size
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise ValueError(f"expert_parallel_size must be an integer >= 1, got {ep!r}")
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if self.eplb_interval is not None and self.eplb_interval < 1:
            raise ValueError(f"eplb_interval must be >= 1 step (or None: no rebalancing), got {self.eplb_interval}")
        if ep == 1 and (self.num_redundant_experts or self.eplb_interval is not None):
            raise ValueError("num_redundant_experts and eplb_interval need expert_parallel_size > 1 (one process "
                             "holds every expert once)")
        if self.moe_lb_window < 1:
            raise ValueError(f"moe_lb_window must be >= 1 step, got {self.moe_lb_window}")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in [1, 65535] (or None: a free port), got {self.master_port}")
        if self.dist_backend not in (None, "gloo", "nccl"):
            raise ValueError(f"dist_backend must be 'gloo' or 'nccl' (or None: by device), got {self.dist_backend!r}")
        if not self.dist_timeout_s > 0:
            raise ValueError(f"dist_timeout_s must be > 0 seconds, got {self.dist_timeout_s}")


ROLES = ("both", "prefill", "decode")
HANDOFF_PATHS = ("direct", "store")


@dataclass(frozen=True)
class DisaggConfig:
    """Prefill/decode disaggregation (disagg/): a prefill engine computes a prompt's KV and first token and hands the
    KV over; a decode engine admits the request with that token and waits for the KV. "both" serves whole requests.

    kv_handoff: how a prefill engine hands the KV over. "direct": it holds the blocks and serves them from a zmq socket
    at kv_handoff_host:kv_handoff_port (0: a free port) until the decode engine pulls them; "store": it saves the full
    blocks to its KV store (a tier the decode engine shares) before answering. kv_handoff_timeout_s bounds both the
    prefill's hold and the decode's wait; past it the decode engine computes the prompt itself."""

    role: str = "both"
    kv_handoff: str = "direct"
    kv_handoff_timeout_s: float = 5.0
    kv_handoff_host: str = "127.0.0.1"
    kv_handoff_port: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.kv_handoff not in HANDOFF_PATHS:
            raise ValueError(f"kv_handoff must be one of {HANDOFF_PATHS}, got {self.kv_handoff!r}")
        if isinstance(self.kv_handoff_timeout_s, bool) or not self.kv_handoff_timeout_s > 0:
            raise ValueError(f"kv_handoff_timeout_s must be > 0 seconds, got {self.kv_handoff_timeout_s!r}")
        if not 0 <= self.kv_handoff_port <= 65535:
            raise ValueError(f"kv_handoff_port must be in [0, 65535] (0: a free port), got {self.kv_handoff_port}")


SPEC_METHODS = ("ngram", "mtp")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: a proposer drafts up to num_speculative_tokens tokens per sequence and step, the target
    model verifies them in the same step (sample/rejection.py). speculative_method None: off."""

    speculative_method: str | None = None  # "ngram" (prompt lookup, every model) or "mtp" (multi-token prediction)
    num_speculative_tokens: int = 3
    ngram_min: int = 1  # shortest suffix an n-gram draft matches
    ngram_max: int = 4  # longest
    draft: str | None = None  # mtp: a trained MTP head (deepinfer train-mtp) for a model whose checkpoint has none
    # mtp: an n-gram lookup first; a sequence whose last 2+ tokens occurred before takes the lookup's drafts that
    # step, MTP drafts the others (Arctic Inference's suffix lookup in front of its drafter)
    ngram_lookup: bool = False

    def __post_init__(self) -> None:
        if self.speculative_method is not None and self.speculative_method not in SPEC_METHODS:
            raise ValueError(f"speculative_method must be one of {SPEC_METHODS} or None, got {self.speculative_method!r}")
        if isinstance(self.num_speculative_tokens, bool) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.draft is not None and self.speculative_method != "mtp":
            raise ValueError("draft (an MTP head) needs speculative_method='mtp'")
        if self.ngram_lookup and self.speculative_method != "mtp":
            raise ValueError("ngram_lookup (an n-gram lookup in front of MTP) needs speculative_method='mtp'")

    @property
    def enabled(self) -> bool:
        return self.speculative_method is not None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_store: KVStoreConfig = field(default_factory=KVStoreConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    batch_invariant: bool = False
    enable_mtp_varlen: bool = True
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    cpu_kernels: bool = True  # the compiled CPU kernels and ops (DEEPINFER_CPU_KERNELS=0: torch ops only)
    fused_ops: bool = True  # norms, activations, rotary, cache writes through compiled ops (DEEPINFER_FUSED_OPS=0: off)
    # on the CPU, glibc's malloc keeps freed memory for the next step (worker/host_memory.py;
    # DEEPINFER_KEEP_HOST_MEMORY=0: glibc's defaults)
    keep_host_memory: bool = True
    # quantized weights in 2 MiB pages where the kernel grants them (ops/huge_pages.py; DEEPINFER_HUGE_PAGES=0: off)
    huge_pages: bool = True
    # an 8-bit LM head (Q8_0, int8) in split planes: greedy steps of 1-2 rows read 5/8 of it, sampled steps and
    # batches of 3+ rows cost more (ops/quant_linear.SplitWeight; DEEPINFER_SPLIT_HEAD=1). None (DEEPINFER_SPLIT_HEAD=
    # auto): on when one sequence runs at a time without speculative decoding and the head is over twice the L3
    split_head: bool | None = False
    # prompt tokens' linear layers in bfloat16 on AMX tiles, each quantized weight dequantized to bfloat16 tiles as
    # the kernel goes (no copy; ops/wide_linear.py); decode tokens stay on the blocks. None (DEEPINFER_AMX_PREFILL
    # =auto): on for quantized compute where the CPU has AMX-BF16, unless batch_invariant (whose bits must not depend
    # on the CPU); True where it cannot run is an error
    amx_prefill: bool | None = None
    # greedy steps of 4+ rows take an 8-bit LM head's argmax in two passes, exact: the quants' top 6 bits bound every
    # output, only blocks that can hold a row's largest are computed in full (layers/quantized.bound_head). None
    # (DEEPINFER_BOUNDED_HEAD=auto): where the compiled ops are AVX2 without VNNI, the one build where it pays
    bounded_head: bool | None = None

    def __post_init__(self) -> None:
        n = self.num_threads
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"num_threads must be an integer >= 1 (None: torch's default), got {n!r}")

    @classmethod
    def from_kwargs(cls, env: Mapping[str, str] | None = None, **kwargs: Any) -> EngineConfig:
        """Builds the config from flat keyword arguments (the LLM / CLI surface) and the environment."""
        env = os.environ if env is None else env
        parts: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}, "parallel": {}, "spec": {},
                                            "disagg": {}}
        owners = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig,
                  "spec": SpecConfig, "disagg": DisaggConfig}
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
        if "fused_ops" not in top:
            top["fused_ops"] = _env_flag(env, "DEEPINFER_FUSED_OPS", True)
        if "keep_host_memory" not in top:
            top["keep_host_memory"] = _env_flag(env, "DEEPINFER_KEEP_HOST_MEMORY", True)
        if "huge_pages" not in top:
            top["huge_pages"] = _env_flag(env, "DEEPINFER_HUGE_PAGES", True)
        if "split_head" not in top:
            top["split_head"] = _env_auto_flag(env, "DEEPINFER_SPLIT_HEAD", unset=False)
        if "amx_prefill" not in top:
            top["amx_prefill"] = _env_auto_flag(env, "DEEPINFER_AMX_PREFILL", unset=None)
        if "bounded_head" not in top:
            top["bounded_head"] = _env_auto_flag(env, "DEEPINFER_BOUNDED_HEAD", unset=None)
        if "enable_mtp_varlen" not in top:
            top["enable_mtp_varlen"] = _env_flag(env, "DEEPINFER_ENABLE_MTP_VARLEN", True)
        return cls(
            model=ModelConfig(**parts["model"]),
            cache=CacheConfig(**parts["cache"]),
            scheduler=SchedulerConfig(**parts["scheduler"]),
            parallel=ParallelConfig(**parts["parallel"]),
            spec=SpecConfig(**parts["spec"]),
            disagg=DisaggConfig(**parts["disagg"]),
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


def _env_auto_flag(env: Mapping[str, str], name: str, unset: bool | None) -> bool | None:
    """A 0 / 1 / auto switch: None for auto, `unset` when the variable is unset or empty."""
    raw = env.get(name, "").strip().lower()
    if raw == "auto":
        return None
    if raw == "":
        return unset
    try:
        return _env_flag(env, name, False)
    except ValueError:
        raise ValueError(f"{name} must be 0, 1 or auto, got {env[name]!r}") from None


def _env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
