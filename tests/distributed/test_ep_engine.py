"""Expert parallelism end to end: N rank processes give the tokens and logprobs of one process, bit for bit, on tiny
random DeepSeek-V3 and Qwen3-MoE (float32, the same batch, one thread everywhere), while expert weights move between
ranks mid-generation; a dead or stuck rank fails the next step with an error naming it, within seconds."""
import contextlib
import os
import signal
import time

import pytest
import transformers

from deepinfer import SamplingParams
from deepinfer.llm import LLM
from deepinfer.worker.ep_executor import EPExecutor

from ..models.hf_reference import save_tiny

PROMPTS = [[5, 17, 99, 3, 250, 11, 42], list(range(1, 40)), [7], [9, 9, 9, 9]]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
COMMON = dict(kv_cache_memory=4 << 20, block_size=16, num_threads=1)
SHARED = dict(vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=256)
CONFIGS = {
    "deepseek_v3": (transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config(
        **SHARED, intermediate_size=128, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5)),
    "qwen3_moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        **SHARED, intermediate_size=128, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request, tmp_path_factory):
    klass, config = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    save_tiny(klass, config, path)
    return str(path)


@pytest.fixture(scope="module")
def reference(model):
    outputs = LLM(model, **COMMON).generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.mark.parametrize("ranks,redundant", [(2, 2), (4, 4)])
def test_expert_parallel_gives_the_bits_of_one_process(model, reference, ranks, redundant):
    llm = LLM(model, expert_parallel_size=ranks, num_redundant_experts=redundant, eplb_interval=3, **COMMON)
    try:
        assert isinstance(llm.engine.executor, EPExecutor)
        first = llm.engine.executor.placement.slot_to_expert.copy()
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs] == reference
        load = llm.engine.stats().moe_load
        assert load.rebalances >= 1 and load.experts_moved >= 1  # weights moved between ranks mid-generation
        assert (llm.engine.executor.placement.slot_to_expert != first).any()
        assert load.window_steps == 12 and load.moe_lb >= 1.0 and load.moe_lb_worst >= load.moe_lb
        assert load.exchange_bytes_per_step > 0
    finally:
        llm.engine.close()


def _kill_and_step(llm: LLM, sig: int, error: str) -> float:
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    os.kill(llm.engine.executor.rank_pids[1], sig)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=error):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    elapsed = time.monotonic() - started
    with pytest.raises(RuntimeError, match="executor is down: expert-parallel rank"):  # and stays down, loudly
        llm.generate([[8]], SamplingParams(max_tokens=1), use_tqdm=False)
    return elapsed


def test_a_dead_rank_fails_the_next_step_naming_it(model):
    llm = LLM(model, expert_parallel_size=2, **COMMON)
    assert _kill_and_step(llm, signal.SIGKILL, r"expert-parallel rank 1 \(pid \d+\) died with exit code -9") < 5.0


def test_a_stuck_rank_fails_the_step_after_the_timeout(model):
    llm = LLM(model, expert_parallel_size=2, dist_timeout_s=3.0, **COMMON)
    pid = llm.engine.executor.rank_pids[1]
    try:
        assert _kill_and_step(llm, signal.SIGSTOP, r"expert-parallel ranks \[1\] did not answer step") < 3.0 + 3.0
    finally:
        with contextlib.suppress(ProcessLookupError):  # the executor kills it once SIGTERM goes unanswered
            os.kill(pid, signal.SIGKILL)


def test_slots_must_divide_over_ranks(model):
    with pytest.raises(ValueError, match="8 slots, not divisible by expert_parallel_size=3"):
        LLM(model, expert_parallel_size=3, **COMMON)


def test_kv_store_is_refused(model):
    with pytest.raises(ValueError, match="kv_store is not supported with expert_parallel_size > 1"):
        LLM(model, expert_parallel_size=2, kv_store="memory", **COMMON)
