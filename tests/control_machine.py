"""The control-path state machine of issue 19, shared by the SyncEngine and async Engine tests.

Hypothesis interleaves generate / abort / pause (every mode) / resume / sleep (1, 2) / wake_up /
update_weights / load_weights / close with steps held in flight (a gate on the executor), every call
submitted without waiting for it (a future), so calls really do overlap steps and each other. With async
scheduling the gate also holds a step's result while the next step is already launched, and an abort or
a control call lands then. ``settle``
opens the gate, waits (bounded: a hang is a failure), restores what the machine itself stopped (weights,
sleep, pause) and checks:

- no engine death, no hang: every future resolves within its bound, with a result or a named refusal;
- every request ends exactly once, never with "error", within max_tokens;
- no step runs, and nothing is scored, while the weights are missing or asleep, and no weight copy,
  sleep or wake runs while a step is in flight (checked inside the executor, at the source);
- no completion mixes weight versions unless a pause("keep") took effect during its life. Counted at the
  source (EngineControl.pause returned, EngineCore.add called), not in the order the machine submitted
  the calls: SyncEngine's calls queue on its lock while a step is held, and threads take a released lock
  in any order, so a pause submitted before a generate may well take effect after it (a 100-example run
  of session 13 failed on exactly that: q2 submitted after the pause, added before it);
- 0 KV blocks in use once nothing is live.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any, Callable

from hypothesis import Phase
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from safetensors.torch import load_file

from ourobatch import (
    EngineBusyError,
    EngineClosedError,
    InconsistentWeightsError,
    OurobatchError,
    SamplingParams,
)
from scheduler.errors import EngineDeadError, InvalidTransition

from .helpers import GatedExecutor

BOUND_S = 30.0  # a call that takes longer is a hang
REFUSALS = (EngineBusyError, InconsistentWeightsError, EngineClosedError)  # named, expected refusals


class CheckingGate(GatedExecutor):
    """The gate, plus the invariants that only the executor can see. With async scheduling a step is in
    flight from its launch until its result is read (the engine launches the next step first), and the gate
    can also hold that read (``hold_results``): the next step is then launched and the one before unread."""

    def __init__(self, inner, control) -> None:
        super().__init__(inner)
        self.control = control
        self.in_flight = 0
        self.violations: list[str] = []
        self._mu = threading.Lock()
        self._results_held = False
        self.result_entered = threading.Event()  # set while a result is held

    def _check(self, plan) -> None:
        if not plan.is_empty and (self.control.missing or self.control.sleep_level):
            self.violations.append(f"step {plan.step_id} ran with weights missing or asleep")

    def execute(self, plan):
        with self._mu:
            self.in_flight += 1
        try:
            self._check(plan)
            return super().execute(plan)
        finally:
            with self._mu:
                self.in_flight -= 1

    def launch(self, plan):
        """The gate of execute(), then the inner launch; the step stays in flight until its result is read."""
        with self._mu:
            self.in_flight += 1
        try:
            self._check(plan)
            with self._cond:
                self.calls += 1
                while self._permits == 0:
                    self.held_plan = plan
                    self.entered.set()
                    assert self._cond.wait(timeout=60), "gate never opened"
                if self._permits is not None:
                    self._permits -= 1
            return _Tracked(self, self.inner.launch(plan))
        except BaseException:
            with self._mu:
                self.in_flight -= 1
            raise

    def hold_results(self) -> None:
        with self._cond:
            self._results_held = True
            self.result_entered.clear()

    def open(self) -> None:
        with self._cond:
            self._results_held = False
        super().open()

    def _read(self, pending):
        try:
            with self._cond:
                while self._results_held:
                    self.result_entered.set()
                    assert self._cond.wait(timeout=60), "gate never opened"
            return pending.result()
        finally:
            with self._mu:
                self.in_flight -= 1

    def _maintenance(self, name: str, *args: Any) -> Any:
        if self.in_flight:
            self.violations.append(f"{name} ran with a step in flight")
        return getattr(self.inner, name)(*args)

    def update_weights(self, named_tensors):
        return self._maintenance("update_weights", named_tensors)

    def sleep(self, level):
        return self._maintenance("sleep", level)

    def wake_up(self):
        return self._maintenance("wake_up")


class _Tracked:
    """A launched step whose result() goes through the gate once."""

    def __init__(self, gate: CheckingGate, pending) -> None:
        self.gate, self.pending, self._result = gate, pending, None

    def result(self):
        if self._result is None:
            self._result = self.gate._read(self.pending)
        return self._result


class ControlMachine(RuleBasedStateMachine):
    """Subclasses provide: start_engine(), submit(fn_name, *args) -> Future, control (EngineControl),
    stats(), close_engine(), and `generate_call`."""

    checkpoints: tuple = ()  # (a, b) set by the test module
    tally: dict[str, int] = {}  # the test module's count of examples torn down and settled (checks run)
    async_scheduling = False  # set by subclasses whose engine plans a step while the one before runs

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = self.checkpoints
        self.tensors = {p: load_file(str(p / "model.safetensors")) for p in (self.a, self.b)}
        self.requests: list[dict] = []  # {future, max_tokens, id}
        self.calls: list[tuple[str, concurrent.futures.Future]] = []
        self.closed = False
        self.n = 0
        self.start_engine()
        self.gate = CheckingGate(self.core.executor, self.core.control)
        self.core.executor = self.gate
        self.keeps_applied = 0  # pause("keep") calls the engine's control state took
        self.keeps_at_add: dict[str, int] = {}  # request id -> keeps_applied when the engine added it
        self._count_keeps_at_the_source()

    def _count_keeps_at_the_source(self) -> None:
        """Wrap EngineControl.pause and EngineCore.add on the instances: a keep is counted after it took
        effect and a request's count read before it exists, so a race between them only loosens the check."""
        control, core = self.core.control, self.core
        pause, add = control.pause, core.add

        def counted_pause(mode, *args, **kwargs):
            pause(mode, *args, **kwargs)
            if mode == "keep":
                self.keeps_applied += 1

        def recorded_add(prompt, params, request_id=None, *args, **kwargs):
            keeps = self.keeps_applied
            parent = add(prompt, params, request_id, *args, **kwargs)
            self.keeps_at_add[parent.request_id] = keeps
            return parent

        control.pause, core.add = counted_pause, recorded_add

    # ------------------------------------------------------------------ hooks for subclasses

    def start_engine(self) -> None:
        raise NotImplementedError

    def submit(self, method: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        raise NotImplementedError

    # ------------------------------------------------------------------ rules

    @rule(prompt=st.lists(st.integers(1, 30), min_size=1, max_size=6), max_tokens=st.integers(1, 14),
          n=st.sampled_from([1, 1, 2]))
    def generate(self, prompt, max_tokens, n):
        self.n += 1
        rid = f"q{self.n}"
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=self.n, n=n, ignore_eos=True)
        future = self.submit("generate", prompt, params, rid)
        self.requests.append(dict(future=future, max_tokens=max_tokens, id=rid))

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from([r["id"] for r in self.requests]))
        self._call("abort", rid)

    @rule(mode=st.sampled_from(["abort", "wait", "keep"]))
    def pause(self, mode):
        self._call("pause", mode)

    @rule(recompute=st.booleans())
    def resume(self, recompute):
        self._call("resume", recompute_kv=recompute)

    @rule(level=st.sampled_from([1, 2]))
    def sleep(self, level):
        self._call("sleep", level)

    @rule()
    def wake_up(self):
        self._call("wake_up")

    @rule(which=st.sampled_from(["a", "b"]), from_disk=st.booleans())
    def update_weights(self, which, from_disk):
        path = self.a if which == "a" else self.b
        if from_disk:
            self._call("load_weights", path)
        else:
            self._call("update_weights", list(self.tensors[path].items()))

    @rule(steps=st.integers(0, 3))
    def hold_steps(self, steps):
        self.gate.hold(steps)  # the next step after `steps` more stays in flight until settle

    @rule(ops=st.lists(st.sampled_from(["pause abort", "pause wait", "pause keep", "resume", "resume recompute",
                                        "sleep 1", "sleep 2", "wake_up", "update a", "update b", "abort"]),
                       min_size=2, max_size=5))
    def burst_with_a_step_in_flight(self, ops):
        """A request, its step held in flight (if the engine can step at all), then control calls back to
        back while it is held: the interleavings single rules reach only rarely."""
        self.generate([1, 2, 3], 12, 1)
        self.gate.hold(0)
        self.gate.entered.wait(timeout=2)  # no step comes while paused, asleep or without weights
        for op in ops:
            name, _, arg = op.partition(" ")
            if name == "pause":
                self.pause(arg)
            elif name == "resume":
                self.resume(arg == "recompute")
            elif name == "sleep":
                self.sleep(int(arg))
            elif name == "update":
                self.update_weights(arg, from_disk=False)
            elif name == "abort":
                self._call("abort", self.requests[-1]["id"])
            else:
                self.wake_up()

    @precondition(lambda self: self.async_scheduling)
    @rule(op=st.sampled_from(["abort", "pause abort", "pause keep", "sleep 1", "update a"]))
    def abort_with_its_next_step_launched(self, op):
        """A request whose step is in flight while its next step is already launched (the gate holds the
        first one's result), then an abort or a control call lands."""
        self.generate([4, 5, 6], 12, 1)
        self.gate.hold_results()
        self.gate.result_entered.wait(timeout=2)  # no step comes while paused, asleep or without weights
        name, _, arg = op.partition(" ")
        if name == "abort":
            self._call("abort", self.requests[-1]["id"])
        elif name == "pause":
            self.pause(arg)
        elif name == "sleep":
            self.sleep(int(arg))
        else:
            self.update_weights(arg, from_disk=False)

    @rule()
    def settle(self):
        self._settle()

    @precondition(lambda self: not self.closed)
    @rule()
    def close(self):
        self.closed = True
        self._call("close")

    def _call(self, method: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append((method, self.submit(method, *args, **kwargs)))

    # ------------------------------------------------------------------ settling and invariants

    def _settle(self) -> None:
        self.gate.open()
        for method, future in self.calls:
            self._outcome(method, future)
        self.calls = []
        if not self.closed:  # restore what the machine stopped, so every request can finish
            for method, args in (("wake_up", ()), ("load_weights", (self.a,)), ("resume", ())):
                state = self.control.state
                if method == "load_weights" and state not in ("asleep", "weights_missing"):
                    continue
                if method == "wake_up" and state != "asleep":
                    continue
                self._outcome(method, self.submit(method, *args))
        for r in self.requests:
            self._check_output(r)
        self.requests = []
        assert not self.gate.violations, self.gate.violations
        if not self.closed:
            stats = self.stats()
            assert stats["num_running"] == stats["num_waiting"] == 0
            assert stats["kv_blocks_used"] == 0, stats

    def _outcome(self, method: str, future: concurrent.futures.Future) -> Any:
        try:
            return future.result(timeout=BOUND_S)
        except concurrent.futures.TimeoutError:
            raise AssertionError(f"{method} did not return within {BOUND_S}s (a hang)") from None
        except (EngineDeadError, InvalidTransition) as exc:
            raise AssertionError(f"{method}: the engine died: {exc}") from exc
        except REFUSALS:
            return None
        except OurobatchError as exc:
            if method == "resume" and isinstance(exc, InconsistentWeightsError):
                return None
            raise

    def _check_output(self, r: dict) -> None:
        out = self._outcome("generate", r["future"])
        if out is None:
            return  # refused with a named error (closed, weights missing, SyncEngine paused)
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length", "abort"), (c.finish_reason, c.error)
            assert len(c.token_ids) <= r["max_tokens"]
            assert len(c.weight_versions) == len(c.token_ids) == len(c.logprobs)
            if c.finish_reason == "length":
                assert len(c.token_ids) == r["max_tokens"]
            if self.keeps_at_add.get(r["id"]) == self.keeps_applied:  # no keep took effect since its add
                assert len(set(c.weight_versions)) <= 1, (r["id"], c.weight_versions)

    @invariant()
    def executor_saw_no_violation(self):
        assert not self.gate.violations, self.gate.violations

    def teardown(self) -> None:
        tally = type(self).tally
        tally["teardowns"] = tally.get("teardowns", 0) + 1
        try:
            self._settle()
            tally["settled"] = tally.get("settled", 0) + 1
        finally:
            self.gate.open()
            self.close_engine()


def control_examples() -> int:
    """Examples per machine: CI's 6, or CONTROL_EXAMPLES (e.g. 200 for a long local run)."""
    return int(os.environ.get("CONTROL_EXAMPLES", 6))


def stateful_timeout() -> int:
    """Seconds a machine's test may run: 600 for CI's draws, and 30 per example past 20. An example takes
    ~3 s on two cores; a limit cut mid-example reads as a FlakyFailure at a step held at the gate (a
    150-example run under the flat 600 s did, session 13)."""
    return max(600, 30 * control_examples())


def stateful_settings() -> dict[str, Any]:
    """No shrinking: a failure depends on thread timing as well as on the drawn steps, so replays shrink
    slowly and flakily; the printed steps are the whole story."""
    return dict(max_examples=control_examples(), stateful_step_count=14, deadline=None,
                phases=(Phase.explicit, Phase.reuse, Phase.generate))


Caller = Callable[..., Any]
