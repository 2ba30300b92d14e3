"""The KV store's model identity is bound to the weights' bytes: two fine-tunes with the same file names and sizes
differ, two copies of one model agree, and the digest is read once per file (cached by path, size, mtime and ctime)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deepinfer.kvstore import identity
from deepinfer.kvstore.identity import file_digest, model_identity, weights_digest

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8}


def _model(path: Path, bump: float = 0.0, shards: int = 1) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    for i in range(shards):
        weights = {f"layer{i}.weight": torch.arange(64, dtype=torch.float32).reshape(8, 8)}
        weights[f"layer{i}.weight"][3, 5] += bump  # one weight, one element
        name = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(weights, path / name)
    return path


@pytest.fixture(autouse=True)
def fresh_memo(monkeypatch, tmp_path):
    monkeypatch.setattr(identity, "_memo", {})
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))


def test_two_models_differing_in_one_weight_have_different_identities(tmp_path):
    base, tuned = _model(tmp_path / "a" / "model"), _model(tmp_path / "b" / "model", bump=1.0)
    assert os.listdir(base) == os.listdir(tuned)
    assert [os.path.getsize(base / n) for n in sorted(os.listdir(base))] == \
        [os.path.getsize(tuned / n) for n in sorted(os.listdir(tuned))]  # names and sizes alike: the old identity
    a = model_identity(str(base), CONFIG, "float32", False)
    b = model_identity(str(tuned), CONFIG, "float32", False)
    assert a != b


def test_copies_share_an_identity_and_dtype_or_mode_split_it(tmp_path):
    original = _model(tmp_path / "original", shards=2)
    copy = Path(shutil.copytree(original, tmp_path / "elsewhere" / "renamed"))
    key = model_identity(str(original), CONFIG, "float32", False)
    assert model_identity(str(copy), CONFIG, "float32", False) == key
    assert len({key, model_identity(str(original), CONFIG, "bfloat16", False),
                model_identity(str(original), CONFIG, "float32", True),
                model_identity(str(original), {**CONFIG, "hidden_size": 9}, "float32", False)}) == 4


def test_shards_may_not_swap_places(tmp_path):
    model = _model(tmp_path / "m", shards=2)
    before = weights_digest(str(model))
    first, second = model / "model-00001-of-00002.safetensors", model / "model-00002-of-00002.safetensors"
    tmp = model / "swap"
    first.rename(tmp), second.rename(first), tmp.rename(second)
    assert weights_digest(str(model)) != before


def test_a_single_gguf_file_is_identified_by_its_bytes_not_its_name(tmp_path):
    one = tmp_path / "one.gguf"
    one.write_bytes(b"GGUF" + bytes(1000))
    two = tmp_path / "other-name.gguf"
    two.write_bytes(b"GGUF" + bytes(1000))
    assert weights_digest(str(one)) == weights_digest(str(two))
    two.write_bytes(b"GGUF" + bytes(999) + b"\x01")
    assert weights_digest(str(one)) != weights_digest(str(two))


def test_the_digest_is_read_once_and_survives_a_restart(tmp_path, monkeypatch):
    model = _model(tmp_path / "m")
    weights = str(model / "model.safetensors")
    digest = file_digest(weights)
    reads = []
    real_open = open

    def counting_open(path, *args, **kwargs):
        if os.path.realpath(str(path)) == os.path.realpath(weights):
            reads.append(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    assert file_digest(weights) == digest  # the in-process memo
    monkeypatch.setattr(identity, "_memo", {})
    assert file_digest(weights) == digest  # the record under DEEPINFER_CACHE_DIR: a restart does not re-read
    assert reads == []
    records = list((tmp_path / "cache" / "weight-digests").glob("*.json"))
    assert len(records) == 1 and digest in records[0].read_text()


def test_an_edited_file_is_read_again_even_with_its_mtime_restored(tmp_path):
    model = _model(tmp_path / "m")
    weights = model / "model.safetensors"
    before = file_digest(str(weights))
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # ctime still moves
    assert file_digest(str(weights)) != before


def test_a_read_only_cache_directory_costs_only_a_re_read(tmp_path, monkeypatch):
    model = _model(tmp_path / "m")
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(blocker / "cache"))
    assert len(weights_digest(str(model))) == 32


def test_a_path_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no weight files"):
        weights_digest(str(tmp_path))
    with pytest.raises(ValueError, match="neither a file nor a directory"):
        weights_digest(str(tmp_path / "missing"))
