from deepinfer.config import SchedulerConfig
from deepinfer.core.kv_manager import KVCacheManager
from deepinfer.core.plan import StepResult
from deepinfer.core.request import Request
from deepinfer.core.scheduler import Scheduler
from deepinfer.sampling_params import SamplingParams

BS = 4


def make(num_blocks=64, budget=64, max_seqs=8, chunked=True, caching=True, max_len=1000):
    kv = KVCacheManager(num_blocks, BS, caching, "test-model")
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, enable_chunked_prefill=chunked)
    return Scheduler(cfg, kv, max_len)


def req(rid, n_prompt, max_tokens=4, first=0, **kw):
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens, **kw), 0, 0.0)


def run_step(s, token=7):
    plan = s.schedule()
    sampled = {}
    for rid, n in plan.num_tokens.items():
        r = s.requests[rid]
        if r.num_computed_tokens + n == r.num_tokens:
            sampled[rid] = [token]
    s.update(plan, StepResult(sampled=sampled))
    return plan


def test_budget_and_chunking():
    s = make(budget=10)
    s.add(req("a", 25))
    plans = [run_step(s) for _ in range(3)]
    assert [p.num_tokens["a"] for p in plans] == [10, 10, 5]
    assert s.requests["a"].output_token_ids == [7]


def test_prefill_and_decode_share_a_step():
    s = make(budget=16)
    s.add(req("a", 4))
    run_step(s)
    s.add(req("b", 30))
    plan = run_step(s)
    assert plan.num_tokens == {"a": 1, "b": 15}


def test_no_chunking_waits_for_whole_prompt():
    s = make(budget=16, chunked=False)
    s.add(req("a", 4, max_tokens=10))
    run_step(s)
    s.add(req("b", 16, first=100))
    plan = run_step(s)
    assert plan.num_tokens == {"a": 1}  # b needs 16 > 15 remaining budget
    plan = run_step(s)
    assert plan.num_tokens == {"a": 1}
    s.finish("a", "abort")
    plan = run_step(s)
    assert plan.num_tokens == {"b": 16}


def test_max_num_seqs_cap():
    s = make(max_seqs=2)
    for i in range(3):
        s.add(req(str(i), 4))
    plan = run_step(s)
    assert set(plan.num_tokens) == {"0", "1"}


def test_preempts_newest_and_everyone_finishes():
    s = make(num_blocks=6, budget=64, caching=False)
    for i in range(3):
        s.add(req(str(i), 7, max_tokens=6, first=100 * i))
    finished, preempted = set(), 0
    for _ in range(200):
        if not s.has_unfinished():
            break
        plan = run_step(s)
        preempted += len(plan.preempted_ids)
        assert s.kv.pool.num_free_blocks >= 0
    assert not s.has_unfinished()
    assert preempted > 0 and s.num_preemptions == preempted
    assert s.kv.pool.num_free_blocks == 6


def test_finished_requests_free_blocks_and_stop_conditions():
    s = make()
    s.add(req("a", 5, max_tokens=3))
    for _ in range(3):
        run_step(s)
    assert "a" not in s.requests and s.kv.pool.usage() == 0
    s.add(Request("e", [1, 2], SamplingParams(max_tokens=5), 0, 0.0, eos_token_ids=frozenset({7})))
    run_step(s)
    assert "e" not in s.requests
    plan = s.schedule()
    assert "e" in plan.finished_ids  # the worker is told to drop its state
    s.add(Request("m", [1, 2], SamplingParams(max_tokens=5, min_tokens=2), 0, 0.0, eos_token_ids=frozenset({7})))
    run_step(s)
    assert "m" in s.requests  # eos ignored before min_tokens


def test_prefix_cache_hit_skips_cached_blocks_but_computes_last_token():
    s = make()
    s.add(req("a", 12, max_tokens=1))
    run_step(s)
    assert "a" not in s.requests
    s.add(req("b", 12, max_tokens=1))
    plan = s.schedule()
    assert plan.num_tokens["b"] == 4  # blocks 0,1 cached; block 2 holds the last token, recomputed
    assert plan.new_requests[0].num_computed_tokens == 8
    s.add(req("c", 12, max_tokens=1, cache_salt="other"))
    plan = s.schedule()
    assert plan.num_tokens["c"] == 12  # another salt never hits


def test_max_model_len_stops():
    s = make(max_len=10)
    s.add(req("a", 8, max_tokens=100))
    for _ in range(5):
        run_step(s)
    assert "a" not in s.requests
