"""The scheduler half of disaggregation, without a model: a decode request with a remote prompt pulls exactly the blocks
its device cache lacks (the partial last one included), computes only its first output token's position once they
arrived, and recomputes from the first block that did not; a prefill request with hold_kv keeps its blocks until
released."""
from deepinfer.config import SchedulerConfig
from deepinfer.core.kv_manager import KVCacheManager
from deepinfer.core.plan import StepResult
from deepinfer.core.request import RemoteKV, Request, RequestStatus
from deepinfer.core.scheduler import Scheduler
from deepinfer.sampling_params import SamplingParams

BS = 4
PROMPT = list(range(100, 114))  # 14 tokens: three full blocks and a partial one


def make() -> Scheduler:
    kv = KVCacheManager(64, BS, True, "test-model")
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, 1000, async_loads=True, remote_kv=True)


def remote(rid: str, prompt=PROMPT) -> Request:
    request = Request(rid, list(prompt), SamplingParams(max_tokens=5), 0, 0.0)
    request.output_token_ids.append(7)  # the prefill engine's first token
    request.remote_kv = RemoteKV("direct", len(prompt), "tcp://127.0.0.1:1", "h-" + rid)
    return request


def test_a_remote_prompt_is_pulled_whole_then_only_the_next_position_is_computed():
    s = make()
    s.add(remote("a"))
    plan = s.schedule()
    pull = plan.kv_pulls["a"]
    assert pull.block_indices == [0, 1, 2, 3] and len(pull.block_ids) == 4 and not plan.num_tokens
    request = s.requests["a"]
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS and request.num_computed_tokens == 14
    s.update(plan, StepResult(kv_loads_done={"a": 4}))
    assert s.take_arrivals() == {"a": True} and request.remote_kv is None
    plan = s.schedule()
    assert plan.num_tokens == {"a": 1} and plan.sample_ids == ["a"]  # position 14, the first output token


def test_a_pull_that_breaks_recomputes_from_the_first_missing_block():
    s = make()
    s.add(remote("a"))
    plan = s.schedule()
    s.update(plan, StepResult(kv_loads_done={"a": 2}))  # blocks 0 and 1 arrived, 2 and 3 did not
    assert s.take_arrivals() == {"a": False}
    assert s.schedule().num_tokens == {"a": 15 - 2 * BS}


def test_blocks_in_the_device_cache_are_not_pulled():
    s = make()
    s.add(Request("local", PROMPT[:9], SamplingParams(max_tokens=1), 0, 0.0))  # caches blocks 0 and 1
    plan = s.schedule()
    s.update(plan, StepResult(sampled={"local": [1]}))
    s.add(remote("a"))
    assert s.schedule().kv_pulls["a"].block_indices == [2, 3]


def test_a_first_token_that_ends_the_request_finishes_it_at_once():
    s = make()
    request = remote("a")
    request.params = SamplingParams(max_tokens=1)
    s.add(request)
    assert request.is_finished and request.finish_reason == "length" and not s.has_unfinished()


def test_held_blocks_stay_until_released():
    s = make()
    request = Request("p", PROMPT, SamplingParams(max_tokens=1), 0, 0.0)
    request.hold_kv = True
    s.add(request)
    plan = s.schedule()
    s.update(plan, StepResult(sampled={"p": [7]}))
    assert request.is_finished and "p" in s.held and s.kv.usage() > 0
    s.release_held("p")
    assert not s.held and s.kv.usage() == 0
