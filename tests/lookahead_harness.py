"""One workload with async scheduling on and off: what each run planned and each request got
(tests/test_async_scheduling.py).

A workload is events (add a request, abort one) on a clock that both runs share: the number of *useful*
updates so far (updates of plans with at least one row of a request still live as planned; a row planned
ahead for a request that has ended is *wasted*). The run with async scheduling goes first and records, for
each event, whether a useful plan was already in flight when it happened; the synchronous run then applies
it at the same point: before planning the next step, or after planning it and before its update (as an
abort that lands while a step runs). With equivalent scheduling, both runs see the same sequence of useful
plans, with the same rows (positions, loops, samples, cohorts) of live requests in each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.errors import RequestRejectedError
from ourobatch.runtime.engine_core import EngineCore
from scheduler.plan import StepPlan


@dataclass
class Event:
    at: int  # useful updates before it
    kind: str  # "add" | "abort"
    request_id: str
    prompt: tuple[int, ...] = ()
    params: Any = None
    in_flight: bool = False  # recorded by the async run: a useful plan was in flight when it happened


@dataclass
class Record:
    """What one run saw: per useful plan, its live rows; per request, its outputs."""

    steps: list[list[tuple]] = field(default_factory=list)
    wasted: list[tuple] = field(default_factory=list)
    children: dict[str, list] = field(default_factory=dict)
    num_updates: int = 0

    def outputs(self) -> dict[str, list[tuple]]:
        """Per request, per completion: tokens, readout loops, finish reason, preemptions, weight versions."""
        return {rid: [(c.output_token_ids, c.readout_loops, c.finish_reason, c.num_preemptions, c.weight_versions)
                      for c in cs] for rid, cs in self.children.items()}

    def logprobs(self) -> dict[str, list[list[float]]]:
        return {rid: [c.logprobs for c in cs] for rid, cs in self.children.items()}


def _row(w) -> tuple:
    kind = type(w).__name__
    sample = None if w.sample is None else (w.sample.loop, w.sample.token_index)
    if kind == "PrefillWork":
        return (w.request_id, kind, w.start_position, len(w.token_ids), w.sample_from, sample)
    if kind == "ShallowWork":
        return (w.request_id, kind, w.position, w.last_loop, w.retain, sample)
    return (w.request_id, kind, w.start_position, w.num_rows, w.first_loop, w.cohort_id, sample)


def _live_rows(core: EngineCore, plan: StepPlan) -> tuple[list[tuple], list[tuple]]:
    planned = core.scheduler._planned.get(plan.step_id, {})
    live, wasted = [], []
    for w in (*plan.prefills, *plan.shallow, *plan.deep):
        r, epoch = planned[w.request_id]
        (live if not r.is_finished and r.num_preemptions == epoch else wasted).append(_row(w))
    return live, wasted


def _recording(core: EngineCore, rec: Record) -> None:
    """Wrap core.update: record each plan's live and wasted rows just before it is applied."""
    update = core.update

    def recorded(plan: StepPlan, result):
        live, wasted = _live_rows(core, plan)
        if live:
            rec.steps.append(sorted(live, key=repr))
        rec.wasted += wasted
        rec.num_updates += 1
        out = update(plan, result)
        check(core)
        return out

    core.update = recorded  # type: ignore[method-assign]


def check(core: EngineCore) -> None:
    """Blocks in use are exactly the live requests' blocks, each counted once per holder."""
    sched = core.scheduler
    holders: dict[int, int] = {}
    for r in sched.requests.values():
        for b in r.block_ids:
            holders[b] = holders.get(b, 0) + 1
    assert len(holders) == sched.blocks.num_used
    for b, n in holders.items():
        assert sched.blocks.ref_count(b) == n


def _apply(core: EngineCore, event: Event, rec: Record) -> None:
    if event.kind == "add":
        try:
            parent = core.add(event.prompt, event.params, request_id=event.request_id)
        except RequestRejectedError:  # (n > max_num_seqs, too long for the pool): both runs refuse it alike
            return
        rec.children[event.request_id] = parent.children
    else:
        core.abort(event.request_id)


def _useful_in_flight(core: EngineCore) -> bool:
    flight = core.pipeline._flight
    return bool(flight) and bool(_live_rows(core, flight[0].plan)[0])


def run_async(core: EngineCore, events: list[Event], max_steps: int = 5000) -> tuple[Record, list[Event]]:
    """Step with async scheduling; apply each event once `at` useful updates are done (or at once when the
    engine is idle). Returns the record and the events as applied, in order: each with the useful updates
    before it and whether a plan was in flight then that was useful when its update began (the events
    between two steps share that: an abort among them does not make the plan not have been planned)."""
    assert core.pipeline.lookahead
    rec = Record()
    _recording(core, rec)
    pending = sorted(events, key=lambda e: e.at)
    applied: list[Event] = []
    for _ in range(max_steps):
        in_flight = _useful_in_flight(core)
        while pending and (len(rec.steps) >= pending[0].at or not core.has_unfinished):
            event = pending.pop(0)
            applied.append(Event(len(rec.steps), event.kind, event.request_id, event.prompt, event.params, in_flight))
            _apply(core, event, rec)
        if not pending and not core.has_unfinished:
            break
        core.step()
    else:
        raise AssertionError("the async run did not finish")
    core.drain()
    return rec, applied


def run_sync(core: EngineCore, events: list[Event], max_steps: int = 5000) -> Record:
    """The synchronous reference: schedule, execute, update by hand, each event (run_async's applied list)
    where run_async met it."""
    assert not core.pipeline.lookahead
    rec = Record()
    _recording(core, rec)
    pending = list(events)  # in the order the async run applied them
    for _ in range(max_steps):
        while pending and pending[0].at == len(rec.steps) and not pending[0].in_flight:
            _apply(core, pending.pop(0), rec)
        if not pending and not core.has_unfinished:
            break
        plan = core.schedule()
        if any(_live_rows(core, plan)[0]):
            while pending and pending[0].at == len(rec.steps) and pending[0].in_flight:
                _apply(core, pending.pop(0), rec)
        if plan.is_empty and not plan.released_request_ids:
            assert core.has_unfinished, f"idle before {pending[:1]}: the async run applied it earlier"
            continue
        core.update(plan, core.executor.execute(plan))
    else:
        raise AssertionError("the sync run did not finish")
    assert not pending, pending
    return rec
