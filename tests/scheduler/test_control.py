"""ourobatch/runtime/control.py: the control state machine, torch-free, against the rules of issue 19 written
out by hand (docs/state_machine.md's control table), and the scheduler's last guard: a step's results
apply only to the request incarnations, in the state, that its plan ran."""

from __future__ import annotations

import pytest

from ourobatch.runtime.control import STATES, TABLE, EngineControl, Run
from scheduler.errors import (
    EngineAsleepError,
    EngineBusyError,
    EngineClosedError,
    EngineDeadError,
    InconsistentWeightsError,
)
from scheduler.params import SamplingParams
from scheduler.request import RequestStatus

from .conftest import make_scheduler, run_step
from .fakes import FakeExecutor

NAMES = ("w1", "w2")


def params(n=12, **kw):
    return SamplingParams(max_tokens=n, temperature=1.0, seed=1, ignore_eos=True, **kw)


def control_in(state: str, running: bool = False) -> EngineControl:
    """A control in `state`, reached only through its own calls; `running`: one request decoding."""
    sched = make_scheduler()
    ctl = EngineControl(sched, lambda: NAMES)
    if running:
        sched.add("r", [1, 2, 3], params())
        ex = FakeExecutor()
        run_step(sched, ex)
    if state in ("paused", "pausing"):
        ctl.pause("keep")
        if state == "paused":
            ctl.poll()  # the flush step is not needed: nothing is mid-block after one prefill
    elif state == "asleep":
        ctl.pause("keep")
        ctl.poll()
        ctl.fell_asleep(1)
    elif state == "weights_missing":
        ctl.weights_copied(["w1"], failed=True, version=None)
    elif state == "closed":
        ctl.close()
    elif state == "dead":
        ctl.close(EngineDeadError("boom"))
    assert ctl.state == state
    return ctl


# What the issue asks, call by call (an exception: refused with it; "ok" / "noop").
EXPECTED = {
    "dead": dict(add=EngineDeadError, update=EngineDeadError, resume=EngineDeadError, score=EngineDeadError),
    "closed": dict(add=EngineClosedError, update=EngineClosedError, pause=EngineClosedError),
    "asleep": dict(add_sync=EngineAsleepError, update=EngineAsleepError, score=EngineAsleepError, resume="ok",
                   wake_up="ok", add="ok"),
    "weights_missing": dict(add=InconsistentWeightsError, add_sync=InconsistentWeightsError,
                            resume=InconsistentWeightsError, score=InconsistentWeightsError, update="ok",
                            wake_up="noop"),
    "paused": dict(add="ok", add_sync=EngineBusyError, update="ok", sleep="ok", resume="ok", score="ok"),
    "running": dict(add="ok", add_sync="ok", resume="noop", wake_up="noop", score="ok"),
}


@pytest.mark.parametrize("state", list(EXPECTED))
def test_each_call_in_each_state_does_what_the_issue_asks(state):
    for op, want in EXPECTED[state].items():
        ctl = control_in(state)
        if isinstance(want, type):
            with pytest.raises(want):
                ctl.check(op)
        else:
            assert ctl.check(op) == want, (state, op)


def test_the_table_covers_every_call_in_every_state():
    assert all(len(row) == len(STATES) for row in TABLE.values())


@pytest.mark.parametrize("state", ["running", "pausing"])
def test_weights_and_sleep_change_only_with_nothing_running_unless_paused(state):
    for op in ("update", "sleep"):
        with pytest.raises(EngineBusyError, match="paused or idle"):
            control_in(state, running=True).check(op, 1)
        assert control_in(state).check(op, 1) == "ok"  # idle
    assert control_in("paused", running=True).check("update") == "ok"


def test_sleep_at_another_level_while_asleep_is_refused_and_the_same_level_is_a_noop():
    ctl = control_in("asleep")
    assert ctl.check("sleep", 1) == "noop"
    with pytest.raises(EngineAsleepError, match="wake_up"):
        ctl.check("sleep", 2)


def test_sleep_level_2_leaves_weights_missing_until_every_tensor_is_loaded():
    ctl = control_in("paused")
    ctl.fell_asleep(2)
    ctl.woke_up()
    assert ctl.state == "weights_missing" and not ctl.may_step
    assert ctl.weights_copied(["w1"], failed=False, version=None) == 0 and ctl.state == "weights_missing"
    assert ctl.weights_copied(["w2"], failed=False, version=9) == 9 and ctl.state == "paused"
    assert ctl.scheduler.weight_version == 9


def test_waiters_are_released_once_paused_on_a_cancelling_resume_and_on_close():
    for end in ("poll", "resume", "close", "die"):
        ctl = control_in("running", running=True)
        ctl.scheduler.add("q", [4], params())  # waiting
        woken = []
        ctl.pause("wait", lambda: woken.append(1))
        ctl.poll()
        assert woken == []  # "wait" with a request running: still pausing
        if end == "poll":
            for rid in list(ctl.scheduler.requests):
                ctl.scheduler.abort(rid)
            ctl.poll()
        elif end == "resume":
            ctl.resume()
        else:
            ctl.close(EngineDeadError("x") if end == "die" else None)
        assert woken == [1], end


def test_a_stronger_pause_joins_one_in_progress():
    ctl = control_in("running", running=True)
    ctl.pause("wait")
    ctl.pause("keep")
    assert ctl.mode == "keep" and ctl.scheduler.admission == "none"
    ctl.pause("wait")  # weaker: joins "keep"
    assert ctl.mode == "keep"
    with pytest.raises(ValueError, match="pause mode must be one of"):
        ctl.pause("later")


def test_recompute_is_applied_between_steps_and_only_for_a_pause_that_kept_requests():
    ctl = control_in("running", running=True)
    assert ctl.resume(recompute_kv=True) == "noop"  # not paused: nothing kept, nothing preempted
    assert ctl.scheduler.num_running == 1 and ctl.poll()
    ctl.pause("keep")
    ctl.poll()
    assert ctl.run is Run.PAUSED
    ctl.resume(recompute_kv=True)
    assert ctl.scheduler.num_running == 1  # not yet: resume() may run with a step in flight
    assert ctl.poll() and ctl.scheduler.num_running == 0 and ctl.scheduler.counters.preemptions == 1


# ---------------------------------------------------------------------- the scheduler's last guard


@pytest.mark.parametrize("mode,B", [("deferred", 4), ("deferred", 1), ("verify", 3), ("eager", 3)])
def test_results_of_a_step_never_apply_to_a_request_preempted_while_it_ran(mode, B):
    sched = make_scheduler(mode=mode, deep_interval=B)
    ex = FakeExecutor()
    sched.add("r", [1, 2, 3], params(20))
    for _ in range(3):
        run_step(sched, ex)
    plan = sched.schedule()
    result = ex.execute(plan)
    request = sched.requests["r"]
    tokens_before = list(request.output_token_ids)
    sched.preempt_all()  # as a control call racing the step would have
    sched.update(plan, result)  # before the fix: InvalidTransition WAITING -> ...
    assert request.status == RequestStatus.WAITING and request.output_token_ids == tokens_before
    assert request.draft_token_ids == []
    while not request.is_finished:
        run_step(sched, ex)
    # every token the fake fabricated for its index, none twice, none from the dropped step
    assert request.output_token_ids == [ex.token("r", j) for j in range(1, 21)]
    assert sched.blocks.num_used == 0
