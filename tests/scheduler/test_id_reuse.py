"""Issue 10.1: an id aborted while its step is in flight may be reused at once; the step's results belong
to the incarnation that was planned, never to the new request holding the id.

docs/state_machine.md: "`abort()` may be called at any status, including while the request's step is
executing: the step's results for it are ignored by `update()`".
"""

from __future__ import annotations

from scheduler import Phase, RequestStatus, SamplingParams

from .conftest import make_scheduler, run_step
from .fakes import FakeExecutor


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=3, ignore_eos=True)


def drain(sched, ex):
    done = {}
    for _ in range(1000):
        if not sched.has_unfinished:
            return done
        _, updates = run_step(sched, ex)
        for u in updates:
            if u.finished:
                done[u.request.request_id] = u.request
    raise AssertionError("did not finish")


def test_reused_id_after_abort_of_an_in_flight_prefill_is_untouched_by_that_step():
    sched, ex = make_scheduler(deep_interval=4), FakeExecutor()
    old = sched.add("x", [1, 2, 3], params(1))
    plan = sched.schedule()  # x's prefill is in flight
    assert [p.request_id for p in plan.prefills] == ["x"]
    sched.abort("x")
    new = sched.add("x", [4, 5], params(1))  # a collector retrying the timed-out request
    updates = sched.update(plan, ex.execute(plan))  # before the fix: InvalidTransition WAITING -> LENGTH
    assert new.status == RequestStatus.WAITING and new.output_token_ids == []
    assert old.finish_reason == "abort" and old.output_token_ids == []
    assert all(u.request is not new for u in updates)
    done = drain(sched, ex)
    assert done["x"] is new and new.output_token_ids == [ex.token("x", 1)]
    assert sched.stats()["kv_blocks_used"] == 0


def test_reused_id_does_not_take_the_old_incarnations_sampled_token():
    sched, ex = make_scheduler(deep_interval=4), FakeExecutor()
    sched.add("x", [1, 2, 3], params(20))
    for _ in range(6):
        run_step(sched, ex)  # x is decoding
    plan = sched.schedule()
    assert any(w.request_id == "x" and w.sample is not None for w in plan.shallow)
    sched.abort("x")
    new = sched.add("x", [7, 8, 9, 10], params(5))
    sched.update(plan, ex.execute(plan))
    assert new.output_token_ids == []
    done = drain(sched, ex)
    assert done["x"] is new
    assert new.output_token_ids == [ex.token("x", j) for j in range(1, 6)]
    assert new.finish_reason == "length"


def test_a_failing_deep_call_of_the_old_incarnation_spares_the_new_one():
    B = 2
    sched, ex = make_scheduler(deep_interval=B), FakeExecutor()
    sched.add("x", [1, 2, 3], params(20))
    y = sched.add("y", [1, 2], params(20))
    plan = None
    for _ in range(20):
        plan = sched.schedule()
        if plan.deep:
            break
        sched.update(plan, ex.execute(plan))
    assert {d.request_id for d in plan.deep} == {"x", "y"}
    ex.fail[plan.step_id] = Phase.DEEP
    sched.abort("x")
    new = sched.add("x", [4], params(3))
    sched.update(plan, ex.execute(plan))
    assert new.status == RequestStatus.WAITING and new.error is None
    done = drain(sched, ex)
    assert y.finish_reason == "error"  # its cohort closed with the failed call
    assert done["x"] is new and new.finish_reason == "length"
    assert sched.stats()["kv_blocks_used"] == 0
