"""GGUF files in llama.cpp's lower-bit types (Q2_K, Q3_K, IQ4_NL, IQ4_XS) compute on their blocks, measured against
the exact float32 path on the same file (gguf's own dequantization: tests/models/test_loader.py checks that path
against transformers).

The model: the bundled SmolLM2's tokenizer, embedding and norms with 4 layers whose matrices are random blocks of
those types, as a Q3_K_M or IQ4_XS file of it would hold them: the down projections (K = 1,536, a multiple of the
K-types' 256) one type per layer, the rest (K = 576) IQ4_NL, llama.cpp's fallback for rows that 256 does not divide.
"""
import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from deepinfer import SamplingParams
from deepinfer.layers.quantized import QuantizedLinear
from deepinfer.llm import LLM
from deepinfer.models.loader import resolve_model_path

DOWN = (QType.Q2_K, QType.Q3_K, QType.IQ4_XS, QType.IQ4_NL)  # layer i's down projection
SCALES = {  # (byte offset of an fp16 scale field, its value): weights of magnitude ~0.01-0.03, as a trained model's
    QType.Q2_K: ((80, 4e-4), (82, 4e-4)), QType.Q3_K: ((108, 2e-4),), QType.IQ4_NL: ((0, 2e-4),),
    QType.IQ4_XS: ((0, 1e-5),),
}
FORMATS = {  # (bits, group, c, has a table) of the kernel's layout for each type (models/gguf_blocks.py)
    QType.Q2_K: (8, 16, 0, False), QType.Q3_K: (8, 32, -124, False), QType.IQ4_XS: (4, 32, -128, True),
    QType.IQ4_NL: (4, 32, -128, True),
}


def _random_blocks(qtype: QType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n * k // per, size), dtype=np.uint8)
    for offset, value in SCALES[qtype]:
        scale = (value * rng.uniform(0.5, 1.5, size=blocks.shape[0])).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


@pytest.fixture(scope="module")
def low_bit_file(tmp_path_factory):
    reader = gguf.GGUFReader(resolve_model_path(None))
    path = str(tmp_path_factory.mktemp("gguf") / "smollm2-low-bit.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        value = len(DOWN) if field.name == "llama.block_count" else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    rng = np.random.default_rng(0)
    for t in reader.tensors:
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else None
        if layer is not None and layer >= len(DOWN):
            continue
        if layer is None or len(t.shape) != 2:  # embedding (Q8_0, tied head) and norms as they are
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            continue
        k, n = (int(x) for x in t.shape)
        qtype = DOWN[layer] if t.name.endswith("ffn_down.weight") else QType.IQ4_NL
        writer.add_tensor(t.name, _random_blocks(qtype, n, k, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_low_bit_types_compute_on_their_blocks_near_float32(low_bit_file):
    quant = LLM(low_bit_file, kv_cache_memory=32 << 20)
    assert quant.engine.compute.name == "float32+gguf"
    model = quant.engine.executor.runner.model
    for i, layer in enumerate(model.model.layers):
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(module, QuantizedLinear)
        fmt = layer.mlp.down_proj.weight.packed.fmt
        assert (fmt.bits, fmt.group, fmt.c, fmt.table is not None) == FORMATS[DOWN[i]], DOWN[i].name
        assert layer.self_attn.qkv_proj.weight.packed.fmt.table is not None  # IQ4_NL, fused q|k|v
    assert not any(p.numel() > 1 << 20 for p in model.parameters())  # no dense copy of a matrix
    exact = LLM(low_bit_file, dtype="float32", kv_cache_memory=32 << 20)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Hello", "1, 2, 3,"]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    for q, e in zip(quant.generate(prompts, params, use_tqdm=False), exact.generate(prompts, params, use_tqdm=False)):
        ours, want = q.outputs[0].logprobs[0], e.outputs[0].logprobs[0]
        assert q.outputs[0].token_ids == e.outputs[0].token_ids
        assert len(ours.keys() & want.keys()) >= 18
        # the activations' rounding to int8 per 32 values (the kernels' one approximation): 0.06-0.14 here, and
        # 0.06-0.14 with Q4_0 blocks of the same magnitudes in their place; a misread block is off by whole units
        assert max(abs(lp - want[t]) for t, lp in ours.items() if t in want) < 0.25
