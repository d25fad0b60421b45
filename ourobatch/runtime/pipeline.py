"""The stepping loop both engines run: plan, launch, read the result, update. Torch-free.

Theory of operation. Without async scheduling a step is ``schedule -> execute -> update``. With it,
``advance()`` keeps at most one step in flight ahead of the one being updated: plan k+1 while k runs
(``Scheduler.schedule_ahead``), launch k+1, read k's result (the only wait), update k; the host's
planning and updating then overlap the device's work. When k+1 may not be planned ahead (the rules in
lookahead.py) k is read and updated first and k+1 is planned after it, as without. ``drain()`` reads
and updates the step in flight: callers drain before anything that must see no step in flight (a
control call, ``EngineControl.poll()``, closing, handing back to the event loop), so "between steps"
means after the pipeline drained. An executor whose class has no ``launch`` (a test double, a wrapper)
runs each step when it is launched: the same loop, without the overlap.

Locking: ``lock`` guards the scheduler, which the async driver's event loop changes meanwhile (adds,
aborts). It is held to plan and to update, never to launch or to wait for a result.
"""

from __future__ import annotations

from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from scheduler.plan import PendingStep, StepPlan, StepResult


class _Core(Protocol):
    """What the pipeline drives (EngineCore)."""

    executor: Any
    scheduler: Any  # Scheduler: schedule_ahead()

    @property
    def has_unfinished(self) -> bool: ...

    def schedule(self) -> StepPlan: ...

    def update(self, plan: StepPlan, result: StepResult) -> list: ...


@dataclass
class _Launched:
    plan: StepPlan
    pending: PendingStep


class _Done:
    """A step that ran at launch (an executor without launch())."""

    def __init__(self, result: StepResult) -> None:
        self._result = result

    def result(self) -> StepResult:
        return self._result


def launch(executor: Any, plan: StepPlan) -> PendingStep:
    """executor.launch(plan) when its class has it, else a step run now."""
    if hasattr(type(executor), "launch"):
        return executor.launch(plan)
    return _Done(executor.execute(plan))


def _always() -> bool:
    return True


class StepPipeline:
    def __init__(self, core: _Core, lookahead: bool) -> None:
        self.core = core
        self.lookahead = lookahead  # async scheduling: plan and launch one step ahead
        self._flight: deque[_Launched] = deque()  # launched, not yet updated (at most 2, briefly)

    @property
    def in_flight(self) -> bool:
        return bool(self._flight)

    def advance(self, lock: AbstractContextManager = nullcontext(), may_step: Callable[[], bool] = _always,
                may_plan_ahead: Callable[[], bool] = _always) -> list | None:
        """Update one step (returns what update() returned) after launching the next one where allowed;
        [] when there was nothing to run, None when `may_step()` (checked under `lock` before a step is
        planned with none in flight) said no. `may_plan_ahead()` (under `lock`): may a step be planned
        while another runs (the async driver says no once the event loop must look)."""
        core = self.core
        if not self._flight:
            with lock:
                if not may_step():
                    return None
                plan = core.schedule()
            if plan.is_empty and not plan.released_request_ids:
                return []
            self._launch(plan)
        if self.lookahead:
            with lock:
                plan = core.scheduler.schedule_ahead(self._flight[0].plan) if may_plan_ahead() else None
            if plan is not None:
                self._launch(plan)
        updated = self._update_oldest(lock)
        if self._flight and not core.has_unfinished:  # only rows of requests that ended: read them now
            updated += self._update_oldest(lock)
        return updated

    def drain(self, lock: AbstractContextManager = nullcontext()) -> list:
        """Read and update every step in flight; returns what the updates returned."""
        updated: list = []
        while self._flight:
            updated += self._update_oldest(lock)
        return updated

    def _launch(self, plan: StepPlan) -> None:
        if self.lookahead:
            self._flight.append(_Launched(plan, launch(self.core.executor, plan)))
        else:  # the executor's own execute(), exactly as without a pipeline
            self._flight.append(_Launched(plan, _Done(self.core.executor.execute(plan))))

    def _update_oldest(self, lock: AbstractContextManager) -> list:
        step = self._flight[0]
        result = step.pending.result()  # the wait for the device, with no lock held
        self._flight.popleft()
        with lock:
            return self.core.update(step.plan, result)
