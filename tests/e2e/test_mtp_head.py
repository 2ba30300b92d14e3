"""An MTP draft head for a model that has none: `deepinfer train-mtp` trains one by self-distillation, the engine
drafts with it on the paged cache, and greedy output stays exactly that of plain decoding."""
import json
import os

import pytest
import torch
import transformers

from deepinfer import SamplingParams
from deepinfer.layers.context import forward_context
from deepinfer.layers.quantized import QuantizedLinear
from deepinfer.llm import LLM
from deepinfer.ops import cpu_ops
from deepinfer.spec.mtp import contiguous_context
from deepinfer.spec.train_mtp import TrainConfig, split_by_prompt, train

from ..models.hf_reference import mtp_caches, save_tiny

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_with_head(tmp_path_factory):
    # head dim 64: quantized, the MTP layer drafts through its decode stack
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                      tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny(transformers.LlamaForCausalLM, config, path, seed=5)
    cpu_ops.load()  # built before the timed run: a cold build (~1 min) would eat the training budget
    head = train(str(path), str(tmp_path_factory.mktemp("head")),
                 TrainConfig(num_prompts=24, gen_tokens=48, minutes=1.5, max_steps=200, threads=1,
                             draft_vocab=64))
    return str(path), head


def test_holdout_takes_whole_prompts_and_every_other_answer_trains():
    prompts = [[1], [2], [1], [3], [2], [1], [4], [5], [3], [4]]
    held, train_idx = split_by_prompt(prompts, 0.2)  # 2 answers wanted: prompt [1]'s three are held, whole
    assert held == [0, 2, 5] and train_idx == [1, 3, 4, 6, 7, 8, 9]
    held, train_idx = split_by_prompt(prompts, 0.4)  # 4 wanted: [1] then [2] (in order of first appearance)
    assert held == [0, 1, 2, 4, 5] and train_idx == [3, 6, 7, 8, 9]
    assert not {tuple(prompts[i]) for i in held} & {tuple(prompts[i]) for i in train_idx}


def test_train_mtp_writes_a_head_for_its_model(tiny_with_head):
    _, head = tiny_with_head
    meta = json.load(open(os.path.join(head, "mtp.json")))
    assert meta["hidden_size"] == 128 and meta["vocab_size"] == 128 and meta["num_hidden_layers"] == 2
    assert meta["train"]["steps"] == 200 and 0 <= meta["train"]["heldout_top1_agreement"] <= 1
    per_depth = meta["train"]["heldout_agreement_per_depth"]
    assert len(per_depth) == meta["train"]["depths"] == 2 and all(0 <= a <= 1 for a in per_depth)
    assert len(meta["draft_vocab"]) == 64 and meta["draft_vocab"] == sorted(set(meta["draft_vocab"]))


def test_the_corpus_stops_at_its_share_of_the_budget_with_greedy_and_sampled_answers_mixed(tiny_with_head, tmp_path,
                                                                                           monkeypatch, caplog):
    """A machine too slow for every answer in the budget trains on the chunks made by then (said in the log); each
    leading part of the order mixes greedy and sampled answers as the whole does."""
    import deepinfer.spec.train_mtp as train_mtp

    order = train_mtp.mixed_order(3072, 768)
    assert sorted(order) == list(range(3072))
    for size in (4, 512, 1024):
        assert abs(sum(i < 768 for i in order[:size]) - size // 4) <= 1
    path, _ = tiny_with_head
    monkeypatch.setattr(train_mtp, "CORPUS_CHUNK", 4)
    monkeypatch.setattr(train_mtp, "CORPUS_SHARE", 0.0)  # every chunk is past the share: one chunk is made
    head = train(path, str(tmp_path), TrainConfig(num_prompts=12, gen_tokens=8, minutes=1.5, max_steps=3, threads=1,
                                                  draft_vocab=64))
    meta = json.load(open(os.path.join(head, "mtp.json")))
    assert meta["train"]["sequences"] == 4 and meta["train"]["steps"] == 3
    assert "corpus: 4 of 12 answers" in caplog.text


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])  # quantized: the draft head's rows on the int8 kernel
def test_drafting_with_the_head_keeps_greedy_tokens(tiny_with_head, quantization):
    path, head = tiny_with_head
    prompts = [[5, 17, 99, 3, 120, 11, 42], list(range(1, 40)), [7]]
    plain = LLM(path, kv_cache_memory=8 << 20, quantization=quantization).generate(prompts, GREEDY, use_tqdm=False)
    spec = LLM(path, kv_cache_memory=8 << 20, speculative_method="mtp", draft=head, enable_mtp_varlen=False,
               quantization=quantization)
    layer, stacked, staged = spec.engine.executor.model.mtp.layers[0], [], []
    quantized = quantization is not None
    assert (layer.decode_stack is not None) == quantized
    # the head's layer as wide as the model's own layers: 4-bit under int4, 8-bit under int8
    assert {m.weight.packed.fmt.bits for m in layer.modules() if isinstance(m, QuantizedLinear)} == \
        ({4} if quantization == "int4" else {8} if quantized else set())
    if layer.decode_stack is not None:  # count the depths that ran through it, from the module or staged
        layer.decode_stack = Counted(layer.decode_stack, stacked, staged)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in plain]
    assert (sum(out is not None for out in stacked) > 0) == quantized
    assert (sum(out is not None for out in staged) > 0) == quantized
    assert spec.engine.stats().spec_decode.num_draft_tokens > 0
    draft_head = spec.engine.executor.model.mtp._draft_head
    assert isinstance(draft_head, tuple) == quantized  # (kernels, packed int8 rows) or float rows


def test_drafting_and_upkeep_rows_in_one_staged_call_keep_greedy_tokens(tiny_with_head, monkeypatch):
    """Requests that draft and requests that do not in the same decode step: the staged call runs the drafting rows
    through the whole layer and the others' rows for K and V only, each request's drafts from its own last row. The
    drafts are those of the module path (token equality alone could not tell: verification is lossless), so every
    draft is accepted or rejected as there."""
    import deepinfer.worker.mtp as worker_mtp
    import deepinfer.worker.runner as runner

    path, head = tiny_with_head
    prompts = [[5, 17, 99, 3, 120, 11, 42], list(range(1, 40)), [7], [9, 8, 7, 6]]
    plain = LLM(path, kv_cache_memory=8 << 20, quantization="int8").generate(prompts, GREEDY, use_tqdm=False)
    steps = iter(range(10**6))

    def every_other(spec, varlen, states, **_):  # each step, every other sequence drafts (which ones alternates)
        step = next(steps)
        return [2 if (i + step) % 2 else 0 for i in range(len(states))]
    monkeypatch.setattr(runner, "plan_draft_lengths", every_other)
    monkeypatch.setattr(runner, "drafts_can_pay", lambda *_: True)  # whatever this CPU's cost model says at 4
    staged_path = worker_mtp._staged
    monkeypatch.setattr(worker_mtp, "_staged", lambda *args: False)
    module_path = LLM(path, kv_cache_memory=8 << 20, speculative_method="mtp", draft=head, quantization="int8")
    module_out = module_path.generate(prompts, GREEDY, use_tqdm=False)
    monkeypatch.setattr(worker_mtp, "_staged", staged_path)
    steps = iter(range(10**6))
    spec = LLM(path, kv_cache_memory=8 << 20, speculative_method="mtp", draft=head, quantization="int8")
    layer, stacked, staged = spec.engine.executor.model.mtp.layers[0], [], []
    layer.decode_stack = Counted(layer.decode_stack, stacked, staged)
    rows: list[tuple[int, int]] = []
    staged_rows = layer.decode_stack.staged_rows
    layer.decode_stack.staged_rows = lambda *args: rows.append((args[1].shape[0], args[-1])) or staged_rows(*args)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in plain]
    assert any(0 < full < total for total, full in rows)  # drafting and upkeep rows in one call
    assert [o.outputs[0].token_ids for o in module_out] == [o.outputs[0].token_ids for o in plain]
    staged_stats, module_stats = spec.engine.stats().spec_decode, module_path.engine.stats().spec_decode
    assert staged_stats.num_accepted_tokens > 0 and staged_stats == module_stats
    index = layer.cache_index  # the MTP layer's cache: the same bits in every slot (the same schedule wrote both)
    caches = [llm.engine.executor.runner.kv_caches[index] for llm in (spec, module_path)]
    for got, want in zip(*caches):
        assert got.abs().sum() > 0 and torch.equal(got, want)


class Counted:
    """A layer's decode stack that records what each of its two entries returned."""

    def __init__(self, stack, stacked: list, staged: list) -> None:
        self.stack, self.stacked, self.staged, self.input_stage = stack, stacked, staged, stack.input_stage

    def __call__(self, x, positions):
        self.stacked.append(self.stack(x, positions))
        return self.stacked[-1]

    def staged_rows(self, *args):
        self.staged.append(self.stack.staged_rows(*args))
        return self.staged[-1]


def test_the_staged_stack_computes_what_the_layer_computes(tiny_with_head):
    """One compiled call with the layer's input stage: the same bits as the module path's input projection followed
    by the stack, the module path's cache, and its output up to the attention kernel's rounding (the module path
    takes these rows as a prefill); rows past full_rows cache the same K and V and return nothing."""
    path, head = tiny_with_head
    layer = LLM(path, kv_cache_memory=8 << 20, speculative_method="mtp", draft=head,
                quantization="int8").engine.executor.model.mtp.layers[0]
    stack = layer.decode_stack
    assert stack.input_stage is not None
    rows = 7
    torch.manual_seed(1)
    positions, size = torch.arange(rows), layer.enorm.weight.shape[0]
    embeds, hidden = torch.randn(rows, size), torch.randn(rows, size)
    ctx = contiguous_context(positions, {layer.cache_index: layer.cache_shape}, torch.float32)
    with torch.inference_mode(), forward_context(ctx):  # the module path (a prefill: each row sees those before it)
        expected = layer(positions, embeds, hidden)
        x = layer._input(embeds, hidden)
    one_block = torch.zeros(rows, 1, dtype=torch.int64)
    scratch = contiguous_context(positions, {layer.cache_index: layer.cache_shape}, torch.float32).kv_caches
    with torch.inference_mode():  # the stack without its input stage, on the module path's input
        plain = stack._compiled(scratch, None).forward(x, positions, [positions], [one_block], [positions + 1], rows)
    torch.testing.assert_close(plain, expected, rtol=0, atol=1e-5)
    for full in (rows, 3, 0):
        caches = contiguous_context(positions, {layer.cache_index: layer.cache_shape}, torch.float32).kv_caches
        with torch.inference_mode():  # one block of `rows` slots, slot = position
            out = stack.staged_rows(caches, embeds, hidden, positions, positions, one_block, positions + 1, rows, full)
        assert out.shape == (full, size) and torch.equal(out, plain[:full])
        for got, want in zip(caches[layer.cache_index], ctx.kv_caches[layer.cache_index]):
            assert torch.equal(got, want)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_write_kv_caches_what_the_whole_layer_caches(tiny_with_head, quantization):
    path, head = tiny_with_head
    llm = LLM(path, kv_cache_memory=8 << 20, speculative_method="mtp", draft=head, quantization=quantization)
    (k_full, v_full), (k_only, v_only) = mtp_caches(llm.engine.executor.model.mtp.layers[0])
    assert k_full.abs().sum() > 0 and torch.equal(k_full, k_only) and torch.equal(v_full, v_only)


def test_mtp_under_overlap_scheduling_keeps_greedy_tokens(tiny_with_head):
    """Overlap scheduling with MTP: steps planned while the one before computes carry no drafts (the MTP layer still
    caches its K and V for their rows, on the compute thread), steps after a result with drafts verify them one at a
    time. Twelve requests of staggered lengths: the batch starts too big for drafts to pay and thins out."""
    path, head = tiny_with_head
    prompts = [[5, 17, 99, 3, 120, 11, 42], list(range(1, 40)), [7], [9, 9, 9, 9]] * 3
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    plain = LLM(path, kv_cache_memory=8 << 20, quantization="int8", async_scheduling=False)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(path, kv_cache_memory=8 << 20, speculative_method="mtp", draft=head, quantization="int8",
               async_scheduling=True)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == expected
    engine = spec.engine
    assert engine.overlapped_steps > 0 and engine.stats().spec_decode.num_draft_tokens > 0
    assert engine.kv.usage() == 0.0
    for llm in (plain, spec):
        llm.engine.close()


def test_the_ngram_lookup_in_front_of_mtp_keeps_greedy_tokens(tiny_with_head, monkeypatch):
    """speculative ngram_lookup: a sequence whose last tokens occurred before takes the lookup's drafts, the others
    MTP's; both kinds are verified, and the tokens are those of plain decoding."""
    from deepinfer.worker import runner

    path, head = tiny_with_head
    prompts = [[5, 17, 99, 3, 120, 11, 42], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [7], [9, 9, 9, 9]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(path, kv_cache_memory=8 << 20, quantization="int8")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    found, drafted = [], []
    lookup, mtp = runner.lookup_drafts, runner.mtp_drafts
    monkeypatch.setattr(runner, "lookup_drafts", lambda *a: found.append(lookup(*a)) or found[-1])
    monkeypatch.setattr(runner, "mtp_drafts", lambda *a: drafted.append(mtp(*a)) or drafted[-1])
    spec = LLM(path, kv_cache_memory=8 << 20, speculative_method="mtp", draft=head, quantization="int8",
               ngram_lookup=True, enable_mtp_varlen=False)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == expected
    assert sum(bool(d) for d in found) > 0 and sum(bool(d) for step in drafted for d in step.values()) > 0
    assert spec.engine.stats().spec_decode.num_accepted_tokens > 0 and spec.engine.kv.usage() == 0.0
    for llm in (plain, spec):
        llm.engine.close()


def test_the_lookup_in_front_of_mtp_keeps_seeded_bits_with_fixed_draft_lengths(tiny_with_head):
    """The reproducible mode (batch invariance, seq_seed, fixed draft lengths) with the lookup in front of MTP: a
    request alone and in a crowd of 8+ (where the varlen plan skips the lookup, worker/speculative.looks_up) draws
    the same tokens."""
    path, head = tiny_with_head
    llm = LLM(path, kv_cache_memory=16 << 20, quantization="int8", speculative_method="mtp", draft=head,
              ngram_lookup=True, enable_mtp_varlen=False, batch_invariant=True)
    prompts = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [5, 17, 99, 3, 120, 11, 42]]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seq_seed=i, max_tokens=20, logprobs=2) for i in range(2)]
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0] for p, sp in zip(prompts, params)]
    crowd = llm.generate(prompts + [[7], [9, 9, 9, 9], list(range(1, 40))] * 3, params + [GREEDY] * 9, use_tqdm=False)
    for a, c in zip(alone, crowd[:2]):
        assert list(a.token_ids) == list(c.outputs[0].token_ids) and a.logprobs == c.outputs[0].logprobs
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    llm.engine.close()


@pytest.mark.parametrize("varlen", [True, False])
def test_a_batch_too_big_for_any_draft_caches_no_mtp_kv_for_decode_rows(tiny_with_head, varlen):
    """varlen with 8+ sequences, where no draft can pay its row (worker/speculative.drafts_can_pay): nothing drafts
    and the MTP layer caches K/V for the prompt rows only. Once the batch is small again drafting resumes; with fixed
    draft lengths every row is cached. Greedy tokens are those of plain decoding throughout."""
    path, head = tiny_with_head
    prompts = [[5 + i, 17, 99, 3, 120, 11, 42, 8, 1 + i, 2] for i in range(10)]  # 10 tokens each
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 9 + \
        [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]  # the last one goes on alone
    plain = LLM(path, kv_cache_memory=8 << 20, quantization="int8")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(path, kv_cache_memory=8 << 20, quantization="int8", speculative_method="mtp", draft=head,
               enable_mtp_varlen=varlen)
    layer, written = spec.engine.executor.model.mtp.layers[0], set()
    write_kv, staged_rows = layer.write_kv, layer.decode_stack.staged_rows
    layer.write_kv = lambda positions, *a: written.update(positions.tolist()) or write_kv(positions, *a)
    layer.decode_stack.staged_rows = lambda *a: written.update(a[3].tolist()) or staged_rows(*a)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == expected
    # 0-8: prompt rows (9, a drafting prompt's last row, runs the whole layer); 10-14: the ten sequences' decode
    # rows (the nine stop at 6 tokens); 15 on: the last one alone
    assert set(range(9)) <= written and max(written) > 15
    assert bool(set(range(10, 15)) & written) == (not varlen)
    assert spec.engine.stats().spec_decode.num_draft_tokens > 0
    for llm in (plain, spec):
        llm.engine.close()


def test_a_head_for_another_model_is_refused(tiny_with_head):
    _, head = tiny_with_head
    with pytest.raises(ValueError, match="was trained for"):
        LLM(kv_cache_memory=8 << 20, speculative_method="mtp", draft=head)


def test_a_corrupt_head_is_refused_with_its_file_named(tiny_with_head, tmp_path):
    path, head = tiny_with_head
    broken = tmp_path / "head"
    broken.mkdir()
    (broken / "mtp.json").write_text(open(os.path.join(head, "mtp.json")).read())
    (broken / "mtp.safetensors").write_bytes(b"\xff" * 1000)  # a header length past the file's end
    with pytest.raises(ValueError, match="mtp.safetensors.*cannot be read"):
        LLM(path, kv_cache_memory=8 << 20, speculative_method="mtp", draft=str(broken))
    (broken / "mtp.safetensors").write_bytes(open(os.path.join(head, "mtp.safetensors"), "rb").read())
    (broken / "mtp.json").write_text("{not json")
    with pytest.raises(ValueError, match="mtp.json.*cannot be read"):
        LLM(path, kv_cache_memory=8 << 20, speculative_method="mtp", draft=str(broken))


def test_a_step_limit_below_one_is_refused():
    with pytest.raises(ValueError, match="max_steps must be at least 1"):
        TrainConfig(max_steps=0)
