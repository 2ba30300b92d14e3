"""Tiny random DeepSeek-V3 (MLA, grouped sigmoid MoE with shared experts, YaRN, MTP): deepinfer vs transformers.

Tolerance: logits within atol 1e-4 in float32. Decode runs MLA in the weight-absorbed form over the latent
cache and prefill in the expanded form, transformers always expanded: same math, different summation order
(observed differences are ~2e-6). Routing must pick the same experts, so weights are widened (save_tiny),
norms and the score-correction bias perturbed, which keeps router scores far from ties.
"""
import json
import os
import re
import shutil

import pytest
import torch
import transformers
from safetensors.torch import save_file

from deepinfer.layers.context import forward_context
from deepinfer.layers.moe import TopKRouter
from deepinfer.llm import LLM
from deepinfer.models.loader import iter_weights, load_model_files
from deepinfer.spec.mtp import contiguous_context
from deepinfer.worker.model_builder import build_model
from deepinfer.worker.runner import kv_bytes_per_block

from .hf_reference import hf_greedy, mtp_caches, ours_greedy, record_logits, save_tiny

STEPS = 16
ATOL = 1e-4
PROMPTS = [[5, 17, 99, 3, 250, 11, 42], list(range(1, 40)), [7]]

BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=256,
)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1)
VARIANTS = {
    # q LoRA, interleaved RoPE, mscale != mscale_all_dim (both the cos/sin factor and the softmax scale move), sharded
    "q-lora": (dict(q_lora_rank=48, rope_interleave=True, rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.8}), "60KB"),
    "no-q-lora": (dict(q_lora_rank=None, rope_interleave=False, rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}), None),
}
KV_ENTRY = BASE["kv_lora_rank"] + BASE["qk_rope_head_dim"]


def save_deepseek(config, path, shard):
    hf = save_tiny(transformers.DeepseekV3ForCausalLM, config, path, shard=shard)
    _perturb(hf.named_parameters(), hf.named_buffers())
    hf.save_pretrained(path, max_shard_size=shard) if shard else hf.save_pretrained(path)
    return hf


def _perturb(params, buffers, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(params) + list(buffers):
            if name.endswith("e_score_correction_bias"):  # non-zero, so selection and weighting differ
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith("norm.weight"):
                p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.2)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matmuls: a second intra-op thread only adds synchronisation, which costs seconds on a busy host.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    extra, shard = VARIANTS[request.param]
    config = transformers.DeepseekV3Config(**{**BASE, **extra})
    path = tmp_path_factory.mktemp(request.param)
    hf = save_deepseek(config, path, shard)
    return hf, str(path)


@pytest.fixture(scope="module")
def expected(pair):
    """transformers' greedy tokens and teacher-forced logits for each prompt."""
    return [hf_greedy(pair[0], p, STEPS) for p in PROMPTS]


def _restore(llm):
    model = llm.engine.executor.runner.model
    model.compute_logits = type(model).compute_logits.__get__(model)


def test_logits_and_greedy_tokens_match_transformers(pair, expected):
    _, path = pair
    llm = LLM(path, kv_cache_memory=4 << 20, block_size=16, num_threads=1)
    for prompt, (theirs, hf_logits) in zip(PROMPTS, expected):
        seen = record_logits(llm)
        (ours,) = ours_greedy(llm, [prompt], STEPS)
        _restore(llm)
        assert ours == theirs
        torch.testing.assert_close(torch.cat(seen), hf_logits, atol=ATOL, rtol=0)


def test_chunked_prefill_and_mixed_batches_agree(pair, expected):
    tokens = [t for t, _ in expected]
    for options in (dict(max_num_batched_tokens=8, block_size=4), dict(enable_prefix_caching=False)):
        llm = LLM(pair[1], kv_cache_memory=4 << 20, num_threads=1, **options)
        assert ours_greedy(llm, PROMPTS, STEPS) == tokens
        assert ours_greedy(llm, PROMPTS, STEPS) == tokens  # with prefix caching: prefill reads cached latents


def test_kv_cache_stores_only_latent_and_rope_key(pair):
    _, path = pair
    llm = LLM(path, kv_cache_memory=1 << 20, num_threads=1)
    specs = llm.engine.executor.runner.model.kv_cache_specs()
    layers = BASE["num_hidden_layers"]
    assert kv_bytes_per_block(specs, 1, torch.float32) == KV_ENTRY * 4 * layers
    assert kv_bytes_per_block(specs, 1, torch.bfloat16) == KV_ENTRY * 2 * layers
    for k_cache, v_cache in llm.engine.executor.runner.kv_caches:
        assert tuple(k_cache.shape[1:]) == (1, KV_ENTRY) and v_cache.numel() == 0


def test_float8_kv_cache_is_refused_for_latent_attention(pair):
    with pytest.raises(ValueError, match="latent attention"):  # MLA computes in its cache's dtype
        LLM(pair[1], kv_cache_memory=1 << 20, num_threads=1, kv_cache_dtype="fp8")


def test_expert_counts_sum_to_tokens_times_top_k(pair):
    _, path = pair
    llm = LLM(path, kv_cache_memory=4 << 20, enable_prefix_caching=False, num_threads=1)
    executor, steps = llm.engine.executor, []
    execute = executor.execute

    def recording(plan):  # each step's routing counts travel on StepResult.expert_counts (the EPLB input)
        result = execute(plan)
        steps.append((plan.total_tokens, result.expert_counts))
        return result

    executor.execute = recording
    ours_greedy(llm, PROMPTS, 4)
    assert sum(tokens for tokens, _ in steps) == sum(len(p) + 4 - 1 for p in PROMPTS)
    for tokens, counts in steps:
        assert len(counts) == BASE["num_hidden_layers"] - BASE["first_k_dense_replace"]
        for layer in counts:
            assert len(layer) == BASE["n_routed_experts"]
            assert sum(layer) == tokens * BASE["num_experts_per_tok"]


def test_grouped_router_selects_within_best_groups():
    torch.manual_seed(0)
    router = TopKRouter(16, 8, 2, scoring_func="sigmoid", n_group=4, topk_group=1, correction_bias=True)
    router.weight.data.normal_()
    router.e_score_correction_bias.data.normal_(0, 0.1)
    weights, ids = router(torch.randn(32, 16))
    assert (ids // 2).eq(ids[:, :1] // 2).all()  # one group of two experts: both picks come from it
    torch.testing.assert_close(weights.sum(-1), torch.full((32,), 1.0))


def _mtp_checkpoint(hf, src: str, dst: str) -> transformers.modeling_layers.MtpModel:
    """Copies a checkpoint and adds one MTP layer (random, from transformers' MtpModel) under DeepSeek's names."""
    from transformers.modeling_layers import MtpModel

    shutil.copytree(src, dst)
    torch.manual_seed(3)
    mtp = MtpModel(hf, 1).eval()
    own = [(n, p) for n, p in mtp.named_parameters() if n.startswith("layers.")]
    with torch.no_grad():
        for _, p in own:
            if p.dim() > 1:
                p.normal_(0, 0.08)
    _perturb(own, [(n, b) for n, b in mtp.named_buffers() if n.startswith("layers.")], seed=4)
    prefix = f"model.layers.{hf.config.num_hidden_layers}."
    tensors = {prefix + "embed_tokens.weight": hf.model.embed_tokens.weight, prefix + "shared_head.head.weight": hf.lm_head.weight}
    for name, t in mtp.state_dict().items():
        if not name.startswith("layers.0."):
            continue
        rest = name[len("layers.0."):].replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        if rest.endswith("experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                tensors[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate[e]
                tensors[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up[e]
        elif rest.endswith("experts.down_proj"):
            for e, down in enumerate(t):
                tensors[f"{prefix}mlp.experts.{e}.down_proj.weight"] = down
        else:
            tensors[prefix + rest] = t
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, os.path.join(dst, "mtp.safetensors"))
    index = os.path.join(dst, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            meta = json.load(f)
        meta["weight_map"].update({k: "mtp.safetensors" for k in tensors})
        with open(index, "w") as f:
            json.dump(meta, f)
    return mtp


def _load(path: str, drop: str | None = None, extra: tuple[str, torch.Tensor] | None = None):
    files = load_model_files(path)
    weights = [w for w in iter_weights(files, torch.float32) if w[0] != drop] + ([extra] if extra else [])
    return build_model(files.hf_config, weights, "float32", "cpu", 256)


@pytest.fixture(scope="module")
def mtp_pair(pair, tmp_path_factory):
    hf, path = pair
    dst = str(tmp_path_factory.mktemp("mtp") / "model")
    return hf, _mtp_checkpoint(hf, path, dst), dst


def test_mtp_layer_loads_and_drafts_like_transformers(mtp_pair):
    hf, hf_mtp, path = mtp_pair
    model = _load(path)
    assert model.mtp is not None and len(model.mtp.layers) == 1
    prompt = PROMPTS[1]
    (next_token,), _ = hf_greedy(hf, prompt, 1)
    ids, tokens = torch.tensor(prompt), torch.tensor(prompt[1:] + [next_token])
    positions = torch.arange(len(prompt))
    with torch.no_grad():
        hf_hidden = hf(ids[None], output_hidden_states=True).hidden_states[-1][0]  # after the final norm
        # transformers feeds token t_{i+1} at position i + 1; RoPE is relative, so either convention gives the same
        hf_draft = hf_mtp._project_to_logits(hf_mtp.forward_layer(0, hf_hidden[None], positions[None] + 1, None, input_ids=tokens[None]))[0]
        with torch.inference_mode():
            specs = [(s.num_kv_heads, s.head_dim, s.v_head_dim) for s in model.kv_cache_specs()]
            with forward_context(contiguous_context(positions, specs, torch.float32)):
                hidden = model(ids, positions)
            logits, draft_hidden = model.draft_logits(hidden, tokens, positions + 1)
            drafts = model.mtp.propose(hidden, tokens, positions + 1, 2, model.model.embed_tokens, model.compute_logits)
    torch.testing.assert_close(hidden, hf_hidden, atol=ATOL, rtol=0)
    assert logits.shape == (len(prompt), BASE["vocab_size"]) and draft_hidden.shape == hidden.shape
    torch.testing.assert_close(logits, hf_draft.float(), atol=ATOL, rtol=0)
    assert drafts[0] == int(hf_draft[-1].argmax()) and len(drafts) == 2


def test_mtp_write_kv_caches_what_the_whole_layer_caches(mtp_pair):
    # rows whose draft nobody asks for get only the MLA latent and RoPE key (no attention, no MoE)
    (k_full, v_full), (k_only, v_only) = mtp_caches(_load(mtp_pair[2]).mtp.layer(0))
    assert k_full.abs().sum() > 0 and torch.equal(k_full, k_only) and torch.equal(v_full, v_only)


def test_checkpoint_without_mtp_tensors_runs_without_mtp(pair):
    _, path = pair
    assert _load(path).mtp is None  # transformers saves num_nextn_predict_layers=1 but no MTP tensors


@pytest.mark.parametrize("dropped", [
    "model.layers.3.eh_proj.weight", "model.layers.3.shared_head.norm.weight", "model.layers.3.mlp.experts.5.up_proj.weight",
    "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.2.self_attn.kv_b_proj.weight",
    "model.layers.0.mlp.up_proj.weight",  # one shard of a fused Linear, named as the checkpoint names it
])
def test_missing_tensor_is_named(mtp_pair, dropped):
    _, _, path = mtp_pair
    with pytest.raises(ValueError, match="missing tensors: " + re.escape(dropped) + "$"):
        _load(path, drop=dropped)


def test_tensor_beyond_the_mtp_layers_is_unexpected(mtp_pair):
    _, _, path = mtp_pair
    with pytest.raises(ValueError, match=re.escape("unexpected tensor 'model.layers.4.enorm.weight'")):
        _load(path, extra=("model.layers.4.enorm.weight", torch.ones(BASE["hidden_size"])))


def test_mtp_speculation_keeps_greedy_tokens(mtp_pair, expected):
    """The checkpoint's MTP layer drafts on the paged cache (one extra attention layer); verification keeps the
    tokens of plain greedy decoding, alone and batched, with drafts deeper than its one layer (recursive use)."""
    _, _, path = mtp_pair
    tokens = [t for t, _ in expected]
    llm = LLM(path, kv_cache_memory=4 << 20, num_threads=1, speculative_method="mtp", num_speculative_tokens=3,
              enable_mtp_varlen=False)
    assert len(llm.engine.executor.runner.model.kv_cache_specs()) == BASE["num_hidden_layers"] + 1
    assert ours_greedy(llm, PROMPTS, STEPS) == tokens
    assert ours_greedy(llm, PROMPTS[:1], STEPS) == tokens[:1]
    stats = llm.engine.stats().spec_decode
    assert stats.num_draft_tokens > 0 and stats.drafted_per_position[2] > 0


def test_mtp_speculation_needs_mtp_layers(pair):
    with pytest.raises(ValueError, match="needs MTP layers"):
        LLM(pair[1], kv_cache_memory=4 << 20, num_threads=1, speculative_method="mtp")
