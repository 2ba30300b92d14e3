"""The offline API on the real model: sampling features end to end, and bad input."""
import json

import pytest

from deepinfer import SamplingParams
from deepinfer.llm import LLM


def test_stop_strings_are_never_emitted(smol):
    free = smol.generate("List three colors:", SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    text = free.outputs[0].text
    stop = text.strip()[3:6]  # something the model really produces
    out = smol.generate("List three colors:", SamplingParams(temperature=0, max_tokens=40, stop=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert stop not in out.outputs[0].text and text.startswith(out.outputs[0].text)
    kept = smol.generate("List three colors:", SamplingParams(temperature=0, max_tokens=40, stop=[stop],
                                                               include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.outputs[0].text.endswith(stop)


def test_stop_token_ids_max_tokens_and_ignore_eos(smol):
    ref = smol.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    ids = ref.outputs[0].token_ids
    out = smol.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[ids[2]]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ids[:3] and out.outputs[0].stop_reason == ids[2]
    assert ref.outputs[0].finish_reason == "length" and len(ids) == 8
    chat = smol.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    assert chat.outputs[0].finish_reason == "stop" and chat.outputs[0].token_ids[-1] == 2  # <|im_end|>
    forced = smol.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)[0]
    assert len(forced.outputs[0].token_ids) == 64 and forced.outputs[0].finish_reason == "length"


def test_min_tokens_suppresses_eos(smol):
    out = smol.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=40, min_tokens=30), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 30


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_samples(smol):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seq_seed=1234, n=3)
    a = smol.generate("Write a word:", params, use_tqdm=False)[0]
    b = smol.generate("Write a word:", params, use_tqdm=False)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1
    c = smol.generate("Write a word:", params.replace(seq_seed=99), use_tqdm=False)[0]
    assert [o.token_ids for o in c.outputs] != [o.token_ids for o in a.outputs]


def test_logprobs_and_prompt_logprobs(smol):
    out = smol.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 5
    for token, lp in zip(comp.token_ids, comp.logprobs):
        assert token in lp and len(lp) == 3 and lp[token] == max(lp.values())  # greedy = top-1
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    for token, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token in lp and all(v <= 0 for v in lp.values())


def test_penalties_change_a_repetitive_output(smol):
    prompt = "Repeat after me: la la la la la la la la"
    plain = smol.generate(prompt, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0].token_ids
    penal = smol.generate(prompt, SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.5, frequency_penalty=1.0), use_tqdm=False)[0].outputs[0].token_ids
    assert plain != penal and len(set(penal)) > len(set(plain))


def test_logit_bias_in_a_batch_moves_only_its_own_request(smol):
    """+100 on a token makes greedy decoding repeat it, -100 on the greedy answer's first token bans it; the
    unbiased requests beside them get the tokens they get alone; a token id past the vocabulary fails its request."""
    prompt, greedy = "The capital of France is", SamplingParams(temperature=0, max_tokens=6)
    alone = smol.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    token = smol.get_tokenizer()(" blue").input_ids[0]
    params = [greedy, greedy.replace(logit_bias={token: 100.0}), greedy.replace(logit_bias={alone[0]: -100.0}),
              greedy.replace(logit_bias={10**6: 1.0})]
    outs = smol.generate([prompt] * 4, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone
    assert outs[1].outputs[0].token_ids == [token] * 6
    assert outs[2].outputs[0].token_ids[0] != alone[0]
    assert "logit_bias token id 1000000 is outside the vocabulary" in outs[3].error


def test_allowed_token_ids_restrict_the_output_and_conflicts_are_refused(smol):
    tok = smol.get_tokenizer()
    allowed = [tok(w).input_ids[0] for w in (" yes", " no", " maybe")]
    out = smol.generate("Is the sky blue? Answer:", SamplingParams(temperature=0.8, seq_seed=1, max_tokens=8,
                                                                   allowed_token_ids=allowed), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8 and set(out.outputs[0].token_ids) <= set(allowed)
    eos = sorted(smol.engine.eos_token_ids)
    bad = smol.generate(["x", "y"], [SamplingParams(allowed_token_ids=[10**6]),
                                     SamplingParams(allowed_token_ids=eos, min_tokens=2)], use_tqdm=False)
    assert "allowed_token_ids token id 1000000 is outside the vocabulary" in bad[0].error
    assert "allows only stop tokens, which min_tokens holds back" in bad[1].error


def test_bad_words_never_appear_as_their_tokens(smol):
    prompt, greedy = "The capital of France is", SamplingParams(temperature=0, max_tokens=12)
    plain = smol.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    word = plain.text.split()[0]  # the answer's first word
    out = smol.generate(prompt, greedy.replace(bad_words=[word]), use_tqdm=False)[0]
    sequences = smol.engine.tokenizer(" " + word, add_special_tokens=False).input_ids, \
        smol.engine.tokenizer(word, add_special_tokens=False).input_ids
    ids = out.outputs[0].token_ids
    assert ids != plain.token_ids
    for seq in sequences:
        assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids)))


def test_chat_continues_the_final_assistant_message(smol):
    """vLLM's continue_final_message: the template leaves the last assistant message open (assistant prefill), so
    the model goes on with it instead of starting a new turn."""
    start = "The three primary colors are"
    conversation = [{"role": "user", "content": "Name the primary colors."}, {"role": "assistant", "content": start}]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    out = smol.chat(conversation, greedy, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    prompt = smol.get_tokenizer().decode(out.prompt_token_ids)
    assert prompt.endswith(start) and prompt.count("<|im_start|>assistant") == 1
    new_turn = smol.chat(conversation, greedy, use_tqdm=False)[0]
    assert smol.get_tokenizer().decode(new_turn.prompt_token_ids).count("<|im_start|>assistant") == 2
    with pytest.raises(ValueError, match="continue_final_message needs add_generation_prompt=False"):
        smol.chat(conversation[:1], greedy, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)


def test_truncate_prompt_tokens_keeps_the_prompts_end(smol):
    text = "Some words to drop at the start. The capital of France is"
    ids = smol.get_tokenizer()(text).input_ids
    tail = smol.get_tokenizer()(" The capital of France is").input_ids
    assert ids[-len(tail):] == tail
    greedy = SamplingParams(temperature=0, max_tokens=5)
    cut = smol.generate(text, greedy.replace(truncate_prompt_tokens=len(tail)), use_tqdm=False)[0]
    alone = smol.generate({"prompt_token_ids": tail}, greedy, use_tqdm=False)[0]
    assert cut.prompt_token_ids == tail and cut.prompt == " The capital of France is"
    assert cut.outputs[0].token_ids == alone.outputs[0].token_ids
    whole = smol.generate(text, greedy.replace(truncate_prompt_tokens=10**6), use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids and whole.prompt == text
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1"):
        SamplingParams(truncate_prompt_tokens=0)


def test_outputs_in_input_order_with_metrics(smol):
    prompts = ["a " * 50, "b", "c " * 10]
    outs = smol.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for o in outs:
        m = o.metrics
        assert m.arrival_time <= m.first_token_time <= m.finished_time


def test_bfloat16_runs():
    llm = LLM(dtype="bfloat16", kv_cache_memory=64 << 20, max_model_len=512)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("kwargs, needle", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop=5), "stop"),
    (dict(top_k=-3), "top_k"),
    (dict(logprobs=-1), "logprobs"),
])
def test_invalid_sampling_params_name_the_value(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_bad_requests_fail_alone_in_a_batch(smol):
    too_long = [5] * (smol.engine.max_model_len + 1)
    outs = smol.generate(["ok", too_long, [10**9], "fine"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 3
    assert "max_model_len" in outs[1].error and outs[1].outputs[0].finish_reason == "error"
    assert "vocabulary" in outs[2].error
    assert outs[3].error is None and outs[3].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        smol.engine.add_request("x", too_long, SamplingParams())


def test_unknown_model_path_and_architecture(tmp_path):
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NopeForCausalLM"], "model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="NopeForCausalLM"):
        LLM(str(tmp_path))


# ---- vLLM drop-in: prompt dicts, raise_on_error, skip_tokenizer_init ------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from tests.reliability.tiny import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")))


def test_text_and_tokens_prompt_dicts_as_vllm_takes_them(smol):
    from deepinfer.llm import TextPrompt, TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=4)
    ids = smol.get_tokenizer()("The capital of France is").input_ids
    plain = smol.generate(["The capital of France is", ids], params, use_tqdm=False)
    dicts = smol.generate([TextPrompt(prompt="The capital of France is"), TokensPrompt(prompt_token_ids=ids)], params,
                          use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[1].prompt_token_ids == ids
    single = smol.generate({"prompt_token_ids": ids}, params, use_tqdm=False)  # one dict is one prompt
    assert len(single) == 1 and single[0].outputs[0].token_ids == plain[1].outputs[0].token_ids
    bad = smol.generate([{"prompt": "x", "multi_modal_data": {}}], params, use_tqdm=False)[0]
    assert bad.outputs[0].finish_reason == "error" and "multi_modal_data" in bad.error


def test_raise_on_error_raises_as_vllm_does_and_runs_nothing(tiny):
    llm = LLM(tiny, kv_cache_memory=8 << 20, raise_on_error=True)
    too_long = [5] * (llm.engine.max_model_len + 1)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["fine", {"prompt_token_ids": too_long}, "also fine"], SamplingParams(max_tokens=2),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # the prompts queued before the bad one were aborted
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[10**9]], use_tqdm=False)
    out = llm.generate(["fine"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert out[0].error is None and len(out[0].outputs[0].token_ids) == 2


def test_skip_tokenizer_init_serves_token_ids_only(tiny):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [(i * 37) % 40000 + 100 for i in range(20)]
    with_text = LLM(tiny, kv_cache_memory=8 << 20).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    ids_only = LLM(tiny, kv_cache_memory=8 << 20, skip_tokenizer_init=True)
    out = ids_only.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == with_text.token_ids and with_text.text and out.text == ""
    refused = ids_only.generate(["text"], params, use_tqdm=False)[0]
    assert "token ids" in refused.error
    assert "stop strings" in ids_only.generate([prompt], params.replace(stop=["x"]), use_tqdm=False)[0].error
    with pytest.raises(ValueError, match="chat"):
        ids_only.chat([{"role": "user", "content": "hi"}])


def test_extreme_but_valid_sampling_values_never_fail_a_step(tiny):
    """Found by the API fuzzer: temperature 1e-300 (0 in float32) made the sampler return an id past the vocabulary,
    which failed the whole step and every request in it. Below 1e-5 a temperature is greedy now, as in vLLM."""
    llm = LLM(tiny, kv_cache_memory=8 << 20)
    greedy = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    for temperature in (5e-324, 1e-300, 1e-6):
        assert SamplingParams(temperature=temperature).greedy
        out = llm.generate(["hello"], SamplingParams(temperature=temperature, max_tokens=4), use_tqdm=False)[0]
        assert out.error is None and out.outputs[0].token_ids == greedy.token_ids
    for params in (SamplingParams(temperature=1e6, max_tokens=4), SamplingParams(repetition_penalty=0.01),
                   SamplingParams(repetition_penalty=100.0), SamplingParams(top_p=5e-324), SamplingParams(min_p=1.0)):
        assert llm.generate(["hello hello"], params, use_tqdm=False)[0].error is None
    for bad in (dict(repetition_penalty=1e-300), dict(repetition_penalty=1e300), dict(temperature=float("inf")),
                dict(temperature=1.7e308)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_logprobs_with_a_grammar_are_refused(tiny):
    """Found by the API fuzzer: tokens a grammar forces (jump-forward) carry no logprobs, so the logprobs came back
    shorter than the tokens and were paired with the wrong positions."""
    with pytest.raises(ValueError, match="logprobs=0 cannot be combined with so_args"):
        SamplingParams(logprobs=0, so_args={"schema_type": "regex", "schema": "hello world"})
    llm = LLM(tiny, kv_cache_memory=8 << 20)
    out = llm.generate([[100, 200]], SamplingParams(logprobs=2, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) and all(t in lp for t, lp in zip(out.token_ids, out.logprobs))
