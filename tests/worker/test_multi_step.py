"""Multi-step decoding (num_scheduler_steps, worker/multi_step.py) against one decode step per engine step: the same
tokens (and logprobs) for every request, greedy and seeded sampling with penalties and min_tokens, on the compiled
decode stack (int8 blocks) and on the module path (float32), on a plain Llama and on a Gemma 3 with sliding-window
layers; with requests joining and finishing at different steps, max_tokens that are no multiple of the run, a small
cache that preempts, a row with logprobs beside plain greedy ones, the blocks the runs leave in the prefix cache, and
(on the bundled model) stop tokens inside a run. The KV cache is all free again afterwards."""
import pytest

from deepinfer import SamplingParams
from deepinfer.config import SchedulerConfig
from deepinfer.llm import LLM

from ..models.hf_reference import save_tiny
from .test_decode_batch import BASE, MODELS, PROMPTS  # a plain Llama and a Gemma 3 with sliding layers

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LENGTHS = (40, 23, 57, 31, 9, 64, 17, 45)


@pytest.fixture(scope="module", params=sorted(MODELS))
def tiny(request, tmp_path_factory):
    config_cls, model_cls, extra = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    save_tiny(model_cls, config_cls(**{**BASE, **extra}), path)
    return str(path)


def engine(path: str, steps: int, quantization: str | None, cache: int = 200 << 10, **options) -> LLM:
    # a small cache (preemptions), a small token budget (prompts chunked beside decodes), at most 5 at a time
    return LLM(path, quantization=quantization, dtype="float32", kv_cache_memory=cache, block_size=16,
               max_num_batched_tokens=24, max_num_seqs=5, num_scheduler_steps=steps, **options)


def tokens(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("quantization", ["int8", None], ids=["stack", "module-path"])
def test_same_tokens_as_one_step_at_a_time(tiny, quantization):
    one, multi = engine(tiny, 1, quantization), engine(tiny, 5, quantization)
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in LENGTHS]
    expected = tokens(one, greedy)
    assert tokens(multi, greedy) == expected
    assert multi.engine.step_times.steps < 0.6 * one.engine.step_times.steps  # the runs did run ahead
    # the blocks the runs filled and the prefix cache kept hold the real tokens' KV: continuing from them gives
    # what an engine without the cache gives (a cache large enough to keep them)
    # (prompt rows on AMX tiles off: there a prefix hit on generated blocks differs from computing them as prompt,
    # as the README says; the first part above runs with them wherever the CPU has AMX)
    roomy = engine(tiny, 5, quantization, 4 << 20, amx_prefill=False)
    cold = engine(tiny, 1, quantization, 4 << 20, enable_prefix_caching=False, amx_prefill=False)
    first = tokens(roomy, greedy)
    assert first == tokens(cold, greedy)
    continued = [p + out for p, out in zip(PROMPTS, first)]
    more = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    warm = roomy.generate(continued, more, use_tqdm=False)
    assert sum(o.num_cached_tokens > 0 for o in warm) >= len(PROMPTS) // 2
    assert [o.outputs[0].token_ids for o in warm] == \
           [o.outputs[0].token_ids for o in cold.generate(continued, more, use_tqdm=False)]
    # one request asks for logprobs: its steps take the sampler over every row instead of the head's argmax
    mixed = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2 if i == 3 else None)
             for i, n in enumerate(LENGTHS)]
    assert tokens(multi, mixed) == expected
    for llm in (one, multi):  # cached blocks are free (evictable) blocks
        assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks


def test_sampled_rows_same_tokens_and_logprobs_as_one_step_at_a_time(tiny):
    """Seeded sampling (top-k, top-p, min-p), penalties, logprobs and min_tokens: each extra step makes the step's
    one sampler call, a row's draw keyed by its position, so tokens and logprobs are the same bits; a grammar row
    (its next mask needs this token) keeps its batch to one step at a time."""
    one, multi = engine(tiny, 1, "int8"), engine(tiny, 5, "int8")
    kinds = [dict(top_k=20), dict(top_p=0.9, logprobs=3), dict(min_p=0.05, presence_penalty=0.5),
             dict(repetition_penalty=1.3, frequency_penalty=0.2, logprobs=1), dict(min_tokens=6), {}]
    params = [SamplingParams(temperature=0.9, seed=100 + i, max_tokens=n, **kinds[i % len(kinds)])
              for i, n in enumerate(LENGTHS)]

    def run(llm):
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    steps_before = multi.engine.step_times.steps
    assert run(multi) == run(one)
    assert multi.engine.step_times.steps - steps_before < 0.6 * one.engine.step_times.steps


def test_option_checked_and_ignored_where_tokens_are_needed_each_step(tiny, caplog):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        SchedulerConfig(num_scheduler_steps=0)
    llm = engine(tiny, 4, "int8", speculative_method="ngram")
    assert llm.engine.scheduler.multi_steps == 0
    assert "num_scheduler_steps=4 ignored" in caplog.text


def test_stops_inside_a_run_on_the_bundled_model():
    """Real text: each request stops at the first token of its answer that first appears at its 3rd position or
    later (inside a run of 5); the same tokens as one step at a time, the stop token last, and alone no forward
    past it."""
    prompts = ["Once upon a time, in a small village by the sea,", "The three primary colours are", "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0, max_tokens=48)
    one, multi = LLM(kv_cache_memory=32 << 20), LLM(kv_cache_memory=32 << 20, num_scheduler_steps=5)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, greedy, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in multi.generate(prompts, greedy, use_tqdm=False)] == expected
    firsts = [next(t for i, t in enumerate(out) if i >= 2 and t not in out[:i]) for out in expected]
    stops = [SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[t]) for t in firsts]
    got = [o.outputs[0].token_ids for o in multi.generate(prompts, stops, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in one.generate(prompts, stops, use_tqdm=False)]
    assert all(out[-1] == t and len(out) >= 3 for out, t in zip(got, firsts))
    # alone, a run ends at the row's stop token: no forward past it (as many as one step at a time runs)
    counts = []
    for llm in (one, multi):
        calls = [0]
        hook = llm.engine.executor.runner.model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        llm.generate(prompts[:1], stops[0], use_tqdm=False)
        hook.remove()
        counts.append(calls[0])
    assert counts[0] == counts[1]
