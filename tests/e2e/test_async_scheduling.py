"""Overlap (asynchronous) scheduling against one step at a time: the same tokens, logprobs and finish reasons."""
from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.engine import Engine
from tests.sample.json_schemas import ORDER_SCHEMA, YES_NO_EBNF

PROMPTS = [
    "The quick brown fox",
    "Write a haiku about the sea.",
    "The quick brown fox jumps over the lazy dog. Then the fox",  # shares a prefix with the first: cache hits
    "List three prime numbers:",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "The capital of France is",
    "Count from one to ten: one, two,",
]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40),  # may end at EOS
        SamplingParams(temperature=0.9, seq_seed=7, max_tokens=30, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, seq_seed=11, max_tokens=33, n=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=48, stop=[","]),  # a stop string ends it mid-flight
        SamplingParams(temperature=0, max_tokens=17, logprobs=1, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=1.0, seq_seed=3, max_tokens=35, presence_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1),
    ]


def _summary(outputs):
    return [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def engines():
    """Two small-cache engines (preemptions happen), small token budget (prompts are chunked). The two modes batch
    rows differently and preempt at different steps; batch invariance makes a row's result independent of both (a
    recomputed position otherwise goes through prefill attention instead of decode attention: the same value to
    float rounding, which can move a seeded top-p draw)."""
    options = dict(kv_cache_memory=3 << 20, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=6, batch_invariant=True)
    built = {mode: LLM(async_scheduling=mode, **options) for mode in (True, False)}
    yield built
    for llm in built.values():
        llm.engine.close()


def test_the_flag_chooses_the_pipeline(engines):
    assert engines[True].engine.overlap_scheduling
    assert not engines[False].engine.overlap_scheduling


def test_default_is_off_and_on_when_asked():
    from deepinfer.config import EngineConfig
    from deepinfer.engine.overlap import overlap_blockers

    config = EngineConfig.from_kwargs(model=None)
    assert overlap_blockers(config, "cpu") and overlap_blockers(config, "cuda")  # measured slower on both
    assert not overlap_blockers(EngineConfig.from_kwargs(model=None, async_scheduling=True), "cpu")
    assert not overlap_blockers(EngineConfig.from_kwargs(model=None, async_scheduling=True,
                                                         speculative_method="ngram"), "cpu")  # where nothing drafts
    assert overlap_blockers(EngineConfig.from_kwargs(model=None, async_scheduling=True, kv_store="memory"), "cpu")
    fixed = overlap_blockers(EngineConfig.from_kwargs(model=None, async_scheduling=True, speculative_method="ngram",
                                                      enable_mtp_varlen=False), "cpu")  # the reproducible mode
    assert any("fixed draft lengths" in r for r in fixed)


def test_speculative_steps_overlap_where_nothing_is_drafted():
    """n-gram drafts with overlap on: eight requests of staggered lengths. A step is planned while the one before
    computes unless that one verifies drafts or the result before proposed some (a batch of 8 drafts nothing: its
    rows are not memory-bound; as it thins out drafts come, and are verified one step at a time). The same greedy
    tokens as one step at a time without drafts."""
    from tests.e2e.test_speculative import CODE, REPEAT
    prompts = [REPEAT, CODE, *PROMPTS[:6]]
    params = [SamplingParams(temperature=0, max_tokens=12 + 6 * i, ignore_eos=True) for i in range(len(prompts))]
    plain = LLM(kv_cache_memory=64 << 20, async_scheduling=False)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.engine.close()
    llm = LLM(kv_cache_memory=64 << 20, speculative_method="ngram", async_scheduling=True)
    engine = llm.engine
    assert engine.overlap_scheduling
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    accepted = engine.stats().spec_decode.num_accepted_tokens
    assert got == expected
    assert engine.overlapped_steps > 0 and accepted > 0, (engine.overlapped_steps, accepted)
    assert engine.kv.usage() == 0.0 and not engine.has_unfinished_requests()
    engine.close()


def test_same_outputs_with_chunked_prefill_prefix_cache_and_preemption(engines):
    results, preemptions = {}, {}
    for mode, llm in engines.items():
        before = llm.engine.scheduler.num_preemptions
        results[mode] = _summary(llm.generate(PROMPTS, _params(), use_tqdm=False))
        preemptions[mode] = llm.engine.scheduler.num_preemptions - before
        assert llm.engine.kv.usage() == 0.0  # every block came back
    assert results[True] == results[False]
    assert preemptions[True] > 0 and preemptions[False] > 0, preemptions
    assert any(c[1] == "stop" for r in results[True] for c in r)


def _run_with_aborts(engine: Engine) -> dict[str, list]:
    """Adds eight requests, aborts two after a few steps and one more later; the survivors' outputs."""
    params = _params()
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        engine.add_request(f"r{i}", prompt, p)
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = [(c.token_ids, c.finish_reason) for c in out.outputs]
        steps += 1
        if steps == 3:  # these ignore EOS: still running
            engine.abort_request("r2")
            engine.abort_request("r6")
        if steps == 9:
            engine.abort_request("r3")
    return finished


def test_same_outputs_when_requests_are_aborted_mid_stream(engines):
    runs = {mode: _run_with_aborts(llm.engine) for mode, llm in engines.items()}
    assert runs[True] == runs[False]
    assert {"r2", "r3", "r6"}.isdisjoint(runs[True]) and "r0" in runs[True]
    for llm in engines.values():
        assert llm.engine.kv.usage() == 0.0 and not llm.engine.scheduler.requests


def test_structured_output_overlaps_and_matches(engines):
    """Constrained requests overlap like the rest: a step planned while the one before computes gets the grammar
    masks of the requests whose token is in flight after its forward, and leaves unsampled a row whose grammar then
    appended tokens (JSON's keys and punctuation, jump-forward), ended or allows nothing. The same tokens, finish
    reasons and errors as one step at a time: greedy and seeded JSON, an EBNF, and a grammar that runs into a
    character no token spells after its first tokens, beside unconstrained requests."""
    def so(kind, schema):
        return {"schema_type": kind, "schema": schema}
    params = [SamplingParams(temperature=0, max_tokens=40, so_args=so("json", ORDER_SCHEMA)),
              SamplingParams(temperature=0.8, seq_seed=5, max_tokens=40, so_args=so("json", ORDER_SCHEMA)),
              SamplingParams(temperature=0, max_tokens=12, so_args=so("ebnf", YES_NO_EBNF)),
              SamplingParams(temperature=0, max_tokens=8, so_args=so("regex", "ab\U000b5603")),
              *_params()[:4]]
    runs, counts = {}, {}
    for mode, llm in engines.items():
        engine = llm.engine
        before = engine.late_mask_steps, engine.late_mask_voided
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        runs[mode] = [(o.error, _summary([o])) for o in outs]
        counts[mode] = (engine.late_mask_steps - before[0], engine.late_mask_voided - before[1])
        assert engine.kv.usage() == 0.0 and not engine.has_unfinished_requests()
    assert runs[True] == runs[False]
    assert counts[False] == (0, 0) and counts[True][0] > 0 and counts[True][1] > 0, counts  # it overlapped, and
    # voided rows after jump-forward
    errors = [error for error, _ in runs[True]]
    assert errors[3] is not None and "allows no token" in errors[3] and errors.count(None) == len(params) - 1
    assert runs[True][2][1][0][0][1] == "stop"  # the EBNF finished


def test_a_regex_constrained_request_matches_and_validates(engines):
    regex = SamplingParams(temperature=0, max_tokens=12, so_args={"schema_type": "regex", "schema": "[A-Z]{2}-[0-9]{3}"})
    params = [regex] + _params()[:3]
    results = {mode: _summary(llm.generate(PROMPTS[:4], params, use_tqdm=False)) for mode, llm in engines.items()}
    assert results[True] == results[False]
    text = engines[True].generate(PROMPTS[:1], [regex], use_tqdm=False)[0].outputs[0].text
    assert len(text) == 6 and text[2] == "-" and text[:2].isupper() and text[3:].isdigit()
