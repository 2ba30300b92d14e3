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
