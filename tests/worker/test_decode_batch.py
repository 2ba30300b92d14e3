"""The decode batch kept from step to step (worker/decode_batch.py) against build_inputs: on every step it moves the
batch on, its inputs equal what build_inputs makes from the same plan, field for field; and a run gives the same
tokens and logprobs with it and without it. Requests join, finish, are preempted and chunked, on a plain Llama and
on a Gemma 3 with sliding-window layers (two groups of block tables)."""
import pytest
import torch
import transformers

from deepinfer import SamplingParams
from deepinfer.llm import LLM
from deepinfer.worker.decode_batch import DecodeBatch
from deepinfer.worker.inputs import build_inputs

from ..models.hf_reference import save_tiny

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BASE = dict(vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
MODELS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "gemma3-window": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                      dict(head_dim=64, num_hidden_layers=3, sliding_window=24, query_pre_attn_scalar=64,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}
PROMPTS = [[5, 17, 99, 3, 250, 11, 42], list(range(1, 40)), [7], list(range(100, 150)), list(range(200, 221)),
           [9, 9, 9, 9], list(range(300, 333)), [1, 2]]
# different lengths: requests finish at different steps and waiting ones join the batch
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (40, 23, 57, 31, 9, 64,
                                                                                            17, 45)]


@pytest.fixture(scope="module", params=sorted(MODELS))
def llm(request, tmp_path_factory):
    config_cls, model_cls, extra = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    save_tiny(model_cls, config_cls(**{**BASE, **extra}), path)
    # a small cache (preemptions), a small token budget (prompts chunked beside decodes), at most 5 at a time
    return LLM(str(path), quantization="int8", kv_cache_memory=200 << 10, block_size=16, max_num_batched_tokens=24,
               max_num_seqs=5)


def runner_of(llm: LLM):
    return llm.engine.executor.runner


def generate(llm: LLM):
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def assert_same_inputs(moved, built) -> None:
    assert torch.equal(moved.input_ids, built.input_ids) and torch.equal(moved.positions, built.positions)
    assert [vars(r) for r in moved.requests] == [vars(r) for r in built.requests]
    assert len(moved.group_metadata) == len(built.group_metadata)
    for a, b in zip(moved.group_metadata, built.group_metadata):
        assert (a.num_decodes, a.block_size, a.decode_buckets, a.prefills) == \
               (b.num_decodes, b.block_size, b.decode_buckets, b.prefills)
        for name in ("slot_mapping", "decode_block_tables", "decode_context_lens"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), name


def test_each_moved_step_equals_what_build_inputs_makes(llm, monkeypatch):
    runner = runner_of(llm)
    assert runner.decode_batch is not None
    counts = {"moved": 0, "built": 0}
    advance = DecodeBatch.advance

    def checked(self, plan, requests):
        moved = advance(self, plan, requests)
        if moved is None:
            counts["built"] += bool(plan.num_tokens)
            return None
        counts["moved"] += 1
        built = build_inputs(plan, {rid: requests[rid].token_ids for rid in plan.num_tokens},
                             {rid: requests[rid].block_ids for rid in plan.num_tokens}, runner.layout,
                             runner.block_size, runner.device)
        assert_same_inputs(moved, built)
        return moved

    monkeypatch.setattr(DecodeBatch, "advance", checked)
    preempted = llm.engine.scheduler.num_preemptions
    generate(llm)
    # most steps are the batch's next decode step; joins, finishes, chunks and preemptions are built anew
    assert counts["moved"] > 40 and counts["built"] > 10, counts
    assert llm.engine.scheduler.num_preemptions > preempted, "the workload should preempt"


def test_same_tokens_and_logprobs_with_and_without_it(llm):
    runner = runner_of(llm)
    held = runner.decode_batch
    try:
        runner.decode_batch = None
        without = generate(llm)
    finally:
        runner.decode_batch = held
    assert generate(llm) == without


def test_a_step_handed_a_batch_never_changes_afterwards(llm, monkeypatch):
    """The arrays a step got stay as they were while later steps move the batch on (a changed table is a new
    array), so anything a step still holds does not move under it."""
    kept = []
    advance = DecodeBatch.advance

    def keeping(self, plan, requests):
        moved = advance(self, plan, requests)
        if moved is not None:
            kept.append((moved, [(m.slot_mapping.clone(), m.decode_block_tables.clone(), m.decode_context_lens.clone())
                                 for m in moved.group_metadata], moved.positions.clone(), moved.input_ids.clone()))
        return moved

    monkeypatch.setattr(DecodeBatch, "advance", keeping)
    generate(llm)
    assert len(kept) > 40
    for moved, metadata, positions, ids in kept:
        assert torch.equal(moved.positions, positions) and torch.equal(moved.input_ids, ids)
        for m, (slots, tables, lens) in zip(moved.group_metadata, metadata):
            assert torch.equal(m.slot_mapping, slots) and torch.equal(m.decode_block_tables, tables)
            assert torch.equal(m.decode_context_lens, lens)
