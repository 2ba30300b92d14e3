"""Overlap scheduling in the scheduler: a plan made while the previous one computes (core/scheduler._apply_ahead)."""
from deepinfer.core.plan import StepResult
from deepinfer.core.request import RequestStatus

from tests.core.test_scheduler import make, req


def _sampled(plan, token):
    return StepResult(sampled={rid: [token] for rid in plan.sample_ids})


def test_next_plan_computes_the_placeholder_and_update_fills_it():
    s = make(budget=64)
    s.add(req("a", 6, max_tokens=5))
    first = s.schedule()
    second = s.schedule()  # `first` still computing
    assert first.num_tokens == {"a": 6} and first.sample_ids == ["a"]
    a = s.requests["a"]
    # the prompt counts as computed, the token `first` samples is a placeholder that `second` computes
    assert second.num_tokens == {"a": 1} and second.sample_ids == ["a"]
    assert second.cached_requests[0].num_computed_tokens == 6 and a.num_placeholders == 1
    s.update(first, _sampled(first, 11))
    assert a.output_token_ids == [11] and a.num_placeholders == 0 and a.num_computed_tokens == 6
    third = s.schedule()  # counts `second` ahead
    assert third.num_tokens == {"a": 1} and a.num_computed_tokens == 7 and a.num_placeholders == 1
    s.update(second, _sampled(second, 12))
    assert a.output_token_ids == [11, 12] and a.num_placeholders == 0
    s.update(third, _sampled(third, 13))  # nothing planned after it: applied the ordinary way
    assert a.output_token_ids == [11, 12, 13] and a.num_computed_tokens == 8


def test_a_request_whose_last_token_is_in_flight_is_not_planned_again():
    s = make()
    s.add(req("a", 4, max_tokens=2))
    first = s.schedule()
    second = s.schedule()
    assert second.num_tokens == {"a": 1}  # samples the second, last token
    third = s.schedule()  # before either result: nothing left to plan for "a"
    assert "a" not in third.num_tokens
    s.update(first, _sampled(first, 1))
    s.update(second, _sampled(second, 2))
    assert s.requests.get("a") is None and s.kv.usage() == 0.0


def test_a_stop_in_flight_ends_the_request_and_the_next_result_is_ignored():
    s = make()
    s.add(req("a", 4, max_tokens=10, stop_token_ids=[99]))
    first = s.schedule()
    second = s.schedule()
    s.update(first, _sampled(first, 99))
    assert s.requests.get("a") is None and s.kv.usage() == 0.0
    assert s.update(second, _sampled(second, 5)) == []


def test_preempted_while_its_step_computes_keeps_the_sampled_token():
    s = make(num_blocks=4, budget=64)  # 16 slots: two prompts of 8 fill them; their next tokens need a fifth block
    s.add(req("a", 8, max_tokens=8))
    s.add(req("b", 8, max_tokens=8))
    first = s.schedule()
    assert set(first.sample_ids) == {"a", "b"}
    second = s.schedule()  # both now need a third block each: the newest is preempted
    assert second.preempted_ids == ["b"]
    b = s.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_placeholders == 0 and b.num_computed_tokens == 0
    s.update(first, _sampled(first, 42))
    assert b.output_token_ids == [42] and s.requests["a"].output_token_ids == [42]
    s.update(second, _sampled(second, 43))
    assert s.requests["a"].output_token_ids == [42, 43] and b.output_token_ids == [42]


def test_a_voided_sample_holds_no_placeholder_and_appended_tokens_are_planned_at_once():
    """A grammar's jump-forward while the request's next step is in flight: that step's row samples nothing
    (void_sample), and the plan after it computes the appended tokens, planned before that step's result."""
    s = make(budget=64)
    s.add(req("a", 6, max_tokens=10))
    first = s.schedule()
    second = s.schedule()  # computes the token `first` samples
    s.update(first, _sampled(first, 11))
    a = s.requests["a"]
    assert s.append_tokens("a", [21, 22]) == 2  # forced after 11
    s.void_sample(second.step, "a")
    third = s.schedule()  # `second` still computing: its token 11 counts as computed, its sample does not exist
    assert a.num_placeholders == 0 and third.num_tokens == {"a": 2} and third.sample_ids == ["a"]
    assert third.cached_requests[0].num_computed_tokens == 7
    s.update(second, StepResult())  # the row sampled nothing
    assert a.output_token_ids == [11, 21, 22] and a.num_placeholders == 0 and a.num_computed_tokens == 7
    s.update(third, _sampled(third, 12))
    assert a.output_token_ids == [11, 21, 22, 12] and a.num_computed_tokens == 9 and a.num_placeholders == 0
