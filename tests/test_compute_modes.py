"""How the model file, dtype, quantization and device resolve to what the engine computes in."""
import pytest

from deepinfer.config import Compute, ModelConfig, resolve_compute


@pytest.mark.parametrize("options,fmt,cuda,want", [
    ({}, "gguf", False, Compute("float32", "gguf", "cpu", "bfloat16")),  # on its blocks by default, bfloat16 KV
    ({"dtype": "float32"}, "gguf", False, Compute("float32", None, "cpu")),  # the exact dense path
    ({"dtype": "bfloat16"}, "gguf", False, Compute("bfloat16", None, "cpu")),
    ({"quantization": "none"}, "gguf", False, Compute("float32", None, "cpu")),
    ({}, "safetensors", False, Compute("float32", None, "cpu")),
    ({"quantization": "int8"}, "safetensors", False, Compute("float32", "int8", "cpu", "bfloat16")),
    ({"quantization": "int4"}, "gguf", False, Compute("float32", "int4", "cpu", "bfloat16")),
    ({}, "gguf", True, Compute("float32", None, "cuda")),  # auto picks CUDA; the quantized kernels are CPU code
    ({"device": "cpu"}, "gguf", True, Compute("float32", "gguf", "cpu", "bfloat16")),
    ({"device": "cuda:1", "dtype": "bfloat16"}, "safetensors", True, Compute("bfloat16", None, "cuda:1")),
])
def test_resolution(options, fmt, cuda, want):
    assert resolve_compute(ModelConfig(**options), fmt, cuda) == want


@pytest.mark.parametrize("options,kv,want", [
    ({}, "float32", None),  # asked for: the compute dtype, so no separate KV dtype
    ({"dtype": "float32"}, "bfloat16", "bfloat16"),
    ({"dtype": "bfloat16"}, "auto", None),
])
def test_kv_cache_dtype(options, kv, want):
    compute = resolve_compute(ModelConfig(**options), "gguf", False, kv)
    assert compute.kv_dtype == want and compute.cache_dtype == (want or compute.dtype)


@pytest.mark.parametrize("options,fmt,cuda,message", [
    ({"quantization": "gguf"}, "safetensors", False, "needs a .gguf model"),
    ({"device": "cuda"}, "gguf", False, "torch sees no CUDA device"),
    ({"quantization": "int8"}, "safetensors", True, "runs on the CPU only"),
])
def test_impossible_combinations_are_refused(options, fmt, cuda, message):
    with pytest.raises(ValueError, match=message):
        resolve_compute(ModelConfig(**options), fmt, cuda)


@pytest.mark.parametrize("options,message", [
    ({"device": "tpu"}, "device must be one of"),
    ({"quantization": "int8", "dtype": "bfloat16"}, "computes activations in float32"),
    ({"quantization": "q2"}, "quantization must be one of"),
])
def test_bad_options_fail_at_config_time(options, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**options)


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, "2"])
def test_a_thread_count_that_is_not_a_positive_integer_is_refused(threads):
    """Before this check -1 reached torch.set_num_threads (a bare RuntimeError) and 0 silently meant the default."""
    from deepinfer.config import EngineConfig

    with pytest.raises(ValueError, match=f"num_threads must be an integer >= 1.*got {threads!r}"):
        EngineConfig.from_kwargs(model=None, num_threads=threads)
    assert EngineConfig.from_kwargs(model=None, num_threads=2).num_threads == 2
