"""OpenAI's logit_bias: validated at construction, added to a row's logits before penalties and masks (vLLM's
order), per row, leaving logprobs raw. vLLM's allowed_token_ids: only those tokens sampled, min_tokens still
holding back the stop tokens among them. vLLM's bad words: a sequence's last token banned where the output ends with
the tokens before it."""
from __future__ import annotations

import pytest
import torch

from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.request_state import Tokens, WorkerRequest
from tests.sample.test_sampler import row, sampler

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])


@pytest.mark.parametrize("bias,error", [
    ([(1, 2.0)], "must be a dict"),
    ({-1: 1.0}, "keys must be token ids"),
    ({True: 1.0}, "keys must be token ids"),
    ({"3": 1.0}, "keys must be token ids"),
    ({3: 100.5}, r"logit_bias\[3\] must be a number in \[-100, 100\]"),
    ({3: float("nan")}, r"logit_bias\[3\]"),
    ({3: "1"}, r"logit_bias\[3\]"),
])
def test_bad_biases_are_refused_naming_the_entry(bias, error):
    with pytest.raises(ValueError, match=error):
        SamplingParams(logit_bias=bias)


def test_bias_moves_greedy_and_sampled_rows_and_only_its_own_row():
    greedy = SamplingParams(temperature=0, logit_bias={3: 100.0})
    banned = SamplingParams(temperature=0, logit_bias={0: -100.0, 1: -0.6})
    out = sampler(LOGITS.repeat(3, 1), [row(greedy), row(SamplingParams(temperature=0)), row(banned)])
    assert out.token_ids == [3, 0, 2]  # 1.0 - 0.6 falls below token 2's 0.5
    # sampled: +100 on one token leaves the others e^-100 of the weight; seeds cannot draw them
    forced = SamplingParams(temperature=1.0, seq_seed=1, logit_bias={4: 100.0})
    assert set(sampler(LOGITS.repeat(32, 1), [row(forced, seed=s) for s in range(32)]).token_ids) == {4}


def test_bias_comes_before_penalties_and_logprobs_stay_raw():
    # repetition penalty 2 on token 1 (in the prompt): vLLM's order (bias, then penalty) gives (1.0 + 3.0) / 2 = 2.0
    # against token 0's 2.0, a tie the lower id wins; penalty first would give 1.0 / 2 + 3.0 = 3.5 (token 1)
    params = SamplingParams(temperature=0, logit_bias={1: 3.0}, repetition_penalty=2.0, logprobs=1)
    out = sampler(LOGITS, [row(params, prompt=[1])])
    assert out.token_ids == [0]
    raw = torch.log_softmax(LOGITS[0], dim=-1)
    assert out.logprobs[0][0] == pytest.approx(raw[0].item())


def test_a_biased_greedy_request_is_not_an_argmax_row():
    """The worker answers plain greedy rows with the LM head's argmax in the kernel (no logits): a bias must not take
    that path."""
    state = WorkerRequest(Tokens([1, 2], 2), [], SamplingParams(temperature=0, logit_bias={5: 1.0}), 0, frozenset())
    assert not state.argmax_only


@pytest.mark.parametrize("allowed,error", [
    ([], "non-empty list"), ((1, 2), "non-empty list"), ([1, -2], "non-empty list"), ([True], "non-empty list"),
])
def test_bad_allowed_lists_are_refused(allowed, error):
    with pytest.raises(ValueError, match=f"allowed_token_ids must be a {error}"):
        SamplingParams(allowed_token_ids=allowed)
    with pytest.raises(ValueError, match="cannot be combined with so_args"):
        SamplingParams(allowed_token_ids=[1], so_args={"schema_type": "regex", "schema": "a"})


def test_only_allowed_tokens_are_sampled_and_min_tokens_still_holds_back_stops():
    greedy = SamplingParams(temperature=0, allowed_token_ids=[2, 4])
    out = sampler(LOGITS.repeat(2, 1), [row(greedy), row(SamplingParams(temperature=0))])
    assert out.token_ids == [2, 0]  # 0.5 beats 0.0; the unrestricted row keeps its argmax
    sampled = SamplingParams(temperature=5.0, seq_seed=3, allowed_token_ids=[1, 3, 4], min_tokens=2)
    tokens = sampler(LOGITS.repeat(64, 1), [row(sampled, seed=s, eos=[4]) for s in range(64)]).token_ids
    assert set(tokens) == {1, 3}  # 4 is the EOS, held back before two tokens
    state = WorkerRequest(Tokens([1, 2], 2), [], SamplingParams(temperature=0, allowed_token_ids=[5]), 0, frozenset())
    assert not state.argmax_only


def test_a_bad_words_last_token_is_banned_only_after_the_tokens_before_it():
    params = SamplingParams(temperature=0, bad_words_token_ids=[[0], [3, 1]])
    rows = [row(params), row(params, output=[3]), row(params, output=[1, 3]), row(params, output=[3, 2])]
    assert sampler(LOGITS.repeat(4, 1), rows).token_ids == [1, 2, 2, 1]  # 0 always; 1 right after a 3
    # a ban that would leave nothing to draw yields (never a failed step): allowed [1], 1 banned after a 3
    only = SamplingParams(temperature=0, allowed_token_ids=[1], bad_words_token_ids=[[3, 1]])
    assert sampler(LOGITS, [row(only, output=[3])]).token_ids == [1]
    with pytest.raises(ValueError, match="bad_words must be a list of words"):
        SamplingParams(bad_words=["ok", "  "])
    with pytest.raises(ValueError, match="bad_words_token_ids must be a list of non-empty token id lists"):
        SamplingParams(bad_words_token_ids=[[1], []])
