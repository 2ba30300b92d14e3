"""GGUF files: the header parsed into metadata, tensors dequantized and renamed to Hugging Face names.

The header is parsed here rather than with gguf.GGUFReader, which builds a numpy view per vocabulary
string and so needs ~5 s (SmolLM2) to ~25 s (Gemma 3) just to open a file; dequantization is gguf's.
"""
from __future__ import annotations

import logging
import mmap
import re
import struct
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterator, Mapping

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from tqdm.auto import tqdm

from deepinfer.models.gguf_blocks import SUPPORTED, canonical
from deepinfer.ops.quant_linear import Canonical

logger = logging.getLogger("deepinfer")

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama", "gemma3")

# GGUFValueType -> struct format; 8 (string) and 9 (array) are read separately.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_TYPES = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"
}
_STRING, _ARRAY = 8, 9
# Larger string arrays (the vocabulary, the merges) are not decoded: only their length is kept.
_MAX_DECODED_STRINGS = 1024

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ARCH_LAYER_NAMES = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class StringArray:
    """A string array in the metadata that was skipped rather than decoded."""

    length: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first): the reverse of the dims GGUF stores
    qtype: QType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFQuantized:
    """A 2-d tensor kept in its GGUF blocks: raw [rows, bytes per row] (a view of the mapped file, or a copy with
    rows reordered). Layers that compute on quantized weights take it as is; every other loader dequantizes it."""

    name: str
    qtype: QType
    shape: tuple[int, int]
    raw: np.ndarray

    def dense(self) -> torch.Tensor:
        blocks = self.raw.reshape(gguf.quant_shape_to_byte_shape(self.shape, self.qtype))
        return torch.from_numpy(np.array(gguf.quants.dequantize(blocks, self.qtype), dtype=np.float32))

    def canonical(self) -> Canonical:
        return canonical(self.qtype, self.raw, self.shape)


@dataclass(frozen=True)
class GGUFFile:
    path: str
    metadata: Mapping[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, size: int) -> None:
        """Raises unless `size` more bytes follow the cursor (a header cut short, or a length no file could hold)."""
        if self.pos + size > len(self.buf):
            raise ValueError(f"GGUF file {self.path!r} is truncated or corrupt: {size} bytes wanted at byte "
                             f"{self.pos} of {len(self.buf)}")

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def skip_string(self) -> int:
        """Moves past a length-prefixed string; returns where its bytes start."""
        n = self.unpack("<Q")
        self.need(n)
        self.pos += n
        return self.pos - n

    def string(self) -> str:
        start = self.skip_string()
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"GGUF file {self.path!r} has unknown metadata value type {vtype} at byte {self.pos}")
        etype, n = self.unpack("<I"), self.unpack("<Q")
        if etype in _NUMPY_TYPES:
            dt = np.dtype(_NUMPY_TYPES[etype])
            self.need(n * dt.itemsize)
            values = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos).tolist()
            self.pos += n * dt.itemsize
            return values
        if etype == _STRING and n > _MAX_DECODED_STRINGS:
            for _ in range(n):
                self.skip_string()
            return StringArray(n)
        return [self.value(etype) for _ in range(n)]


def read_gguf(path: str) -> GGUFFile:
    """Parses the header of a GGUF (v2 or v3) file: its metadata and where each tensor lies."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{path!r} is not a GGUF file: it starts with {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r}")
        cur = _Cursor(buf, path)
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF file {path!r} has version {version}; supported versions are 2 and 3")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("<I"))
        raw_infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
            raw_infos.append((name, tuple(reversed(dims)), cur.unpack("<I"), cur.unpack("<Q")))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // alignment) * alignment
        file_size = len(buf)
    tensors = []
    for name, shape, raw_type, rel_offset in raw_infos:
        try:
            qtype = QType(raw_type)
        except ValueError:
            raise ValueError(f"tensor {name!r} in {path!r} has unknown GGML type {raw_type}") from None
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape, dtype=np.int64)) // block_size * type_size
        info = GGUFTensorInfo(name, shape, qtype, data_start + rel_offset, nbytes)
        if info.offset + nbytes > file_size:
            raise ValueError(f"tensor {name!r} in {path!r} ends past the end of the file ({file_size} bytes)")
        tensors.append(info)
    return GGUFFile(path, MappingProxyType(metadata), tuple(tensors))


def gguf_hf_config(f: GGUFFile) -> dict[str, Any]:
    """A Hugging Face config.json-style dict built from the metadata, as transformers builds it."""
    arch, md = f.architecture, f.metadata
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} of {f.path!r} is not supported; expected one of {SUPPORTED_ARCHITECTURES}"
        )

    def required(key: str) -> Any:
        if f"{arch}.{key}" not in md:
            raise ValueError(f"GGUF file {f.path!r} lacks the metadata key {arch + '.' + key!r}")
        return md[f"{arch}.{key}"]

    hidden, heads = required("embedding_length"), required("attention.head_count")
    head_dim = md.get(f"{arch}.attention.key_length", md.get(f"{arch}.rope.dimension_count", hidden // heads))
    tokens = md.get("tokenizer.ggml.tokens", [])
    vocab = md.get(f"{arch}.vocab_size", tokens.length if isinstance(tokens, StringArray) else len(tokens))
    if not vocab:
        raise ValueError(f"GGUF file {f.path!r} states no vocabulary size (no {arch}.vocab_size, no tokens)")
    names = {t.name for t in f.tensors}
    cfg: dict[str, Any] = {
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": md.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": required("context_length"),
        "rms_norm_eps": required("attention.layer_norm_rms_epsilon"),
        "rope_theta": float(md.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(f),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "attention_dropout": 0.0,
    }
    for key in ("bos", "eos", "unknown", "padding"):
        token_id = md.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            cfg[{"unknown": "unk", "padding": "pad"}.get(key, key) + "_token_id"] = int(token_id)
    if arch == "llama":
        cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", mlp_bias=False)
    else:
        # llama.cpp hard-codes these for Gemma 3 rather than storing them: every 6th layer is global,
        # local layers use RoPE base 10k, and there is no soft-capping.
        pattern = 6
        cfg.update(
            architectures=["Gemma3ForCausalLM"],
            model_type="gemma3_text",
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=head_dim,  # scores scale by 1/sqrt(head_dim), as llama.cpp does below 27B
            sliding_window=required("attention.sliding_window"),
            sliding_window_pattern=pattern,
            layer_types=sliding_layer_types(cfg["num_hidden_layers"], pattern),
            rope_local_base_freq=10000.0,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            use_bidirectional_attention=False,
        )
    return cfg


def sliding_layer_types(num_layers: int, pattern: int) -> list[str]:
    """Gemma 3's layer_types: every pattern-th layer attends globally, the others within the sliding window."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]


def _rope_scaling(f: GGUFFile) -> dict[str, Any] | None:
    md, arch = f.metadata, f.architecture
    if any(t.name == "rope_freqs.weight" for t in f.tensors):
        raise ValueError(f"GGUF file {f.path!r} scales RoPE with a rope_freqs tensor (Llama 3.1 style); not supported")
    kind = md.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise ValueError(f"GGUF file {f.path!r} has RoPE scaling type {kind!r}; only 'linear' is supported")
    return {"rope_type": "linear", "factor": float(md[f"{arch}.rope.scaling.factor"])}


def hf_tensor_name(arch: str, gguf_name: str) -> str:
    """GGUF tensor name -> Hugging Face name: blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight."""
    if m := _LAYER_TENSOR.fullmatch(gguf_name):
        layer, part, suffix = m.groups()
        hf_part = _LAYER_NAMES.get(part) or _ARCH_LAYER_NAMES.get(arch, {}).get(part)
        if hf_part is not None:
            return f"model.layers.{layer}.{hf_part}.{suffix}"
    elif (m := _GLOBAL_TENSOR.fullmatch(gguf_name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} of architecture {arch!r} has no known Hugging Face name")


def dequantize_tensor(buf: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor's values as float32 in its numpy shape; buf is the whole file as uint8."""
    raw = buf[info.offset : info.offset + info.nbytes]
    if info.qtype == QType.F32:
        return raw.view(np.float32).reshape(info.shape)
    try:
        blocks = raw.reshape(gguf.quant_shape_to_byte_shape(info.shape, info.qtype))
        return gguf.quants.dequantize(blocks, info.qtype)
    except NotImplementedError:
        message = f"tensor {info.name!r} has GGML type {info.qtype.name}, which gguf cannot dequantize"
        raise ValueError(message) from None


def iter_gguf_weights(f: GGUFFile, dtype: torch.dtype, keep_quantized: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor | GGUFQuantized]]:
    """Yields (Hugging Face name, tensor) in dtype, undoing the converter's edits to the weights. With
    keep_quantized, 2-d tensors of a type the quantized kernels compute on are yielded as GGUFQuantized."""
    cfg = gguf_hf_config(f)
    arch = f.architecture
    buf = np.memmap(f.path, dtype=np.uint8, mode="r")
    show = len(f.tensors) >= 50
    no_kernel: dict[str, int] = {}  # GGUF type -> 2-d tensors of it yielded as float32
    for info in tqdm(f.tensors, desc="Loading GGUF weights", disable=None if show else True, leave=False):
        name = hf_tensor_name(arch, info.name)
        rope_heads = None
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            rope_heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
        if keep_quantized and info.qtype in SUPPORTED and len(info.shape) == 2:
            raw = buf[info.offset : info.offset + info.nbytes].reshape(info.shape[0], -1)
            if rope_heads is not None:  # rows are independent: reorder them in their blocks
                raw = np.ascontiguousarray(_unpermute_rope_rows(raw, rope_heads))
            yield name, GGUFQuantized(name, info.qtype, info.shape, raw)
            continue
        if keep_quantized and len(info.shape) == 2:
            no_kernel[info.qtype.name] = no_kernel.get(info.qtype.name, 0) + 1
        w = dequantize_tensor(buf, info)
        if rope_heads is not None:
            w = _unpermute_rope_rows(w, rope_heads)
        elif arch == "gemma3" and "norm" in name:
            # convert_hf_to_gguf stores Gemma's RMSNorm weight w as w + 1 (it scales by 1 + w).
            w = w - 1
        yield name, torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)
    if no_kernel:
        logger.warning("GGUF matrices of types the quantized kernels do not read (%s) are dequantized, then rounded to "
                       "int8 per 32 values by the quantized layers (except layers listed as dense): not the file's "
                       "exact weights (--dtype float32 computes on them)",
                       ", ".join(f"{t}: {n} tensors" for t, n in sorted(no_kernel.items())))


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    # convert_hf_to_gguf reorders each head's rows from HF's halves layout (x[:d/2], x[d/2:]) to
    # interleaved pairs for llama.cpp's RoPE; this swaps them back.
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
