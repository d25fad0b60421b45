"""The sans-IO Scheduler: add / abort / schedule() -> StepPlan / update(plan, result) -> updates.

Theory of operation. Every engine step, each open cohort advances its decoding members by exactly one
shallow step (one token fed per request, loops 1..s). When that step completes a block of
``deep_interval`` steps (the cohort's boundary), the same plan also carries one DeepWork per member over
its retained rows, so one deep call holds every member's rows (decode_plan.py, cohort.py). KV blocks are taken
lazily, as positions
are written (kv_manager.py); when the coming step's writes do not fit, the newest requests are
preempted and later recomputed, and waiting requests are admitted in order while blocks and
``max_num_seqs`` allow (admission.py). Prefills fill what the decode rows leave of the step's token
budget, a long prompt in chunks over several steps (prefill.py); a last chunk samples the next token
from loop T, and the request joins the open cohort and waits (ALIGNING) for its next block start.
Verify mode's drafts and their acceptance are planned and applied in verify_plan.py. Termination frees
the request's blocks at once and lists it in the next plan's released ids, which drops its unread
retained rows in the engine: their deep loops never run. With async scheduling, ``schedule_ahead`` plans
the next step while one runs, or says it must wait for that step's update (lookahead.py).

No awaits, clocks or threads here: a driver (SyncEngine, or the async Engine) calls these methods.
``abort`` may be called while a plan is being executed; ``update`` then ignores that request's results.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from typing import Iterable

from . import admission, decode_plan, lookahead, prefill, validate, verify_plan
from .block_manager import BlockManager
from .kv_manager import KVManager
from .cohort import Cohorts
from .config import SchedulerConfig
from .counters import SchedulerCounters
from .params import MAX_SEED, SamplingParams
from .plan import Phase, StepPlan, StepResult
from .request import Request, RequestStatus, set_status
from .updates import RequestUpdate, StepUpdate

__all__ = ["RequestUpdate", "Scheduler"]


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config  # checked when it was built (scheduler/config.py: one check per rule)
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size)
        self.kv = KVManager(self.blocks, config.kv_allocation, config.enable_prefix_caching,
                            math.ceil(config.kv_watermark * config.num_kv_blocks))
        self.requests: dict[str, Request] = {}  # every live (not finished) request
        self.waiting: deque[Request] = deque()
        self.cohorts = Cohorts(config.deep_interval)
        self._released: list[str] = []
        self.counters = SchedulerCounters()
        self.prefills = prefill.Prefills(config, self.kv, self.counters)  # the prefills under way
        # step id -> the request incarnations its plan ran. update() matches results to these objects,
        # never to whatever request holds the id now: an id aborted mid-step may already be reused.
        self._planned: dict[int, dict[str, tuple[Request, int]]] = {}
        self.weight_version = 0  # recorded on every token (the front end bumps it on a weight update)
        # Who may be admitted (set by control.py): "all"; "started" (pause "wait": only requests preempted
        # for room, which must finish under these weights); "none" (pause "keep").
        self.admission = "all"
        self._force_boundary = False  # pause(mode="keep"): the next step is every cohort's boundary
        self.drain_reasons: Counter[str] = Counter()  # async scheduling: why steps were not planned ahead
        self._next_arrival = 0
        self._next_step = 0
        self._seed_rng = random.Random()

    # ------------------------------------------------------------------ requests in and out

    def check(self, prompt_token_ids: Iterable[int], params: SamplingParams) -> tuple[int, ...]:
        """Raise what add() raises for this prompt and params, changing nothing; -> the prompt as ints."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt = validate.check_prompt(prompt_token_ids, self.config.vocab_size)
        validate.check_fits(self.config, self.blocks, len(prompt), params)
        return prompt

    def add(self, request_id: str, prompt_token_ids: Iterable[int], params: SamplingParams) -> Request:
        """Validate and queue a request. Raises (and changes nothing) on bad input."""
        validate.check_ids_free([request_id], self.requests)
        prompt = self.check(prompt_token_ids, params)
        if params.seed is None:
            params = params.with_seed(self._seed_rng.randint(0, MAX_SEED))
        stop = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= self.config.eos_token_ids
        request = Request(request_id, prompt, params, stop, self._next_arrival)
        self._next_arrival += 1
        self.requests[request_id] = request
        self.waiting.append(request)
        self.counters.requests_added += 1
        return request

    def abort(self, request_id: str, stop_string: bool = False) -> RequestUpdate | None:
        """End a live request with finish_reason 'abort'. Unknown or finished ids are ignored. `stop_string`: a
        front end cut it at a stop string (its finish reason there is 'stop'): counted as finished by stop."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED,
                     counted=RequestStatus.FINISHED_STOPPED if stop_string else None)
        return RequestUpdate(request, 0, True)

    def fail_all(self, message: str) -> list[RequestUpdate]:
        """End every live request with 'error' (the engine is going down)."""
        updates = []
        for request in list(self.requests.values()):
            request.error = message
            self._finish(request, RequestStatus.FINISHED_ERROR)
            updates.append(RequestUpdate(request, 0, True))
        return updates

    # ------------------------------------------------------------------ planning

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def has_pending_releases(self) -> bool:
        """Requests ended since the last plan whose engine-side state the next plan will drop."""
        return bool(self._released)

    def schedule(self) -> StepPlan:
        """Plan one step: make room, every fed request's decode rows and boundary deep calls, then prefills
        (those under way, then admissions) in what the decode rows leave of the step's token budget."""
        plan, num_boundaries = self._plan()
        self._commit(plan, num_boundaries)
        return plan

    def schedule_ahead(self, in_flight: StepPlan) -> StepPlan | None:
        """Plan the next step while `in_flight` (planned, not yet updated) runs: as schedule() would after
        update(in_flight), with the tokens it samples pending (lookahead.py). None when that plan could
        differ or be empty: update(in_flight) first, then schedule()."""
        assert set(self._planned) <= {in_flight.step_id}, "schedule_ahead: one step at most may be in flight"
        if self.config.mode == "verify" or self._force_boundary:
            return self._drained("verify" if self.config.mode == "verify" else "forced_boundary")
        reason = lookahead.plan_reason(in_flight)
        if reason is not None:
            return self._drained(reason)
        step = StepUpdate(self._planned.get(in_flight.step_id, {}))
        sampled = lookahead.apply_pending(in_flight, step.live, self.cohorts, self.config.total_ut_steps)
        reason = lookahead.drain_reason(in_flight, sampled, self.waiting, self.admission, bool(self.prefills.live()),
                                        self.kv.enable_prefix_caching, self.cohorts, self.requests,
                                        self._must_preempt, self._must_evict)
        if reason is not None:
            return self._drained(reason)
        plan, num_boundaries = self._plan()
        if plan.is_empty and not plan.released_request_ids:
            return None  # nothing to run ahead (planning it changed nothing: no row, chunk or admission)
        self._commit(plan, num_boundaries)
        self.counters.lookahead_steps += 1
        return plan

    def _drained(self, reason: str) -> None:
        self.counters.lookahead_drains += 1
        self.drain_reasons[reason] += 1
        return None

    def _must_preempt(self) -> bool:
        return self._short_of(self.blocks.num_free)

    def _must_evict(self) -> bool:
        return self.blocks.num_evictable > 0 and self._short_of(self.blocks.num_uncached_free)

    def _short_of(self, free: int) -> bool:
        """Whether the coming step's new blocks outnumber `free` (each running request needs one at most, so
        blocks_needed() is only counted when fewer are free: make_room's fast path)."""
        return free < self.num_running and self.blocks_needed() > free

    def _plan(self) -> tuple[StepPlan, int]:
        preempted = admission.make_room(self.blocks, self)
        rows = decode_plan.plan_decodes(self.config, self.cohorts, self.requests, self.kv, self._force_boundary)
        self._force_boundary = False
        planner = self.prefills.plan_step(self.weight_version, num_decode_rows=len(rows.shallow))
        if not preempted and self.admission != "none":  # no admission in a step that had to preempt
            admission.admit(self.waiting, planner, self.num_running, self.config.max_num_seqs,
                            started_only=self.admission == "started")
        released, self._released = tuple(self._released), []
        plan = StepPlan(self._next_step, tuple(planner.works), tuple(rows.shallow), tuple(rows.deep), released)
        return plan, rows.num_boundaries

    def _commit(self, plan: StepPlan, num_boundaries: int) -> None:
        # each request with its incarnation *and* its preemption count: a result applies only to the
        # state it was planned in (a request preempted while the step ran ignores it, as an aborted one)
        requests = self.requests
        planned = {}
        for w in (*plan.prefills, *plan.shallow, *plan.deep):
            r = requests[w.request_id]
            planned[w.request_id] = (r, r.num_preemptions)
        if planned:  # (a plan with no rows may never be updated: nothing to match)
            self._planned[plan.step_id] = planned
        self._next_step += 1
        self.counters.count_plan(plan, num_boundaries)

    # ------------------------------------------------------------------ results

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestUpdate]:
        """Apply a step's result, in passes: failures, prefills and deep positions, verdicts, sampled tokens
        (append, stop, join a cohort). Ended requests are freed at once."""
        assert result.step_id == plan.step_id, f"result of step {result.step_id} for plan {plan.step_id}"
        step = StepUpdate(self._planned.pop(plan.step_id, {}))
        self._apply_failures(plan, result, step)
        self._apply_prefills(plan, result, step)
        self._advance_deep_positions(plan, step)
        self._apply_verified(plan, result, step)
        self._apply_sampled(plan, result, step)
        return list(step.updates.values())

    def _apply_failures(self, plan: StepPlan, result: StepResult, step: StepUpdate) -> None:
        """End every request a failing phase ran with 'error'; a failed deep call closes its cohorts."""
        for failure in result.failures:
            if failure.culprit_ids and all(step.live(rid) is None for rid in failure.culprit_ids):
                continue  # only rows of requests that had already ended were not finite (rows planned ahead)
            ids = {rid: step.live(rid) for rid in failure.request_ids}
            if failure.phase == Phase.DEEP:
                for d in plan.deep:
                    if d.request_id in ids:
                        # members of a closing cohort are the live requests that joined it (ids are unique
                        # among live requests, and a reused id cannot have joined before this update)
                        for member in self.cohorts.close(d.cohort_id):
                            ids.setdefault(member, self.requests.get(member))
            for rid, request in ids.items():
                step.failed.add(rid)
                if request is not None and not request.is_finished:
                    self._fail(step, request, f"{failure.phase.value} failed: {failure.message}")

    def _apply_prefills(self, plan: StepPlan, result: StepResult, step: StepUpdate) -> None:
        """Successful chunks: their positions hold every plane, their blocks enter the prefix cache, their
        prompt log-probs are recorded (a mismatched result ends the request)."""
        prompt_lps = {x.request_id: x for x in result.prompt_logprobs}
        for p in plan.prefills:
            r = step.usable(p.request_id)
            if r is not None:
                r.num_deep_positions = p.start_position + len(p.token_ids)
                self.kv.on_prefilled(r, r.num_deep_positions)
                error = prefill.record_prompt_logprobs(r, p, prompt_lps.get(p.request_id))
                if error is not None:
                    step.failed.add(p.request_id)
                    self._fail(step, r, error)

    def _advance_deep_positions(self, plan: StepPlan, step: StepUpdate) -> None:
        """Rows that ran through loop T: eager shallow rows and deferred deep calls (verify: _apply_verified)."""
        T = self.config.total_ut_steps
        for w in plan.shallow:
            r = step.usable(w.request_id) if w.last_loop == T else None
            if r is not None:
                r.num_deep_positions = w.position + 1
        for d in plan.deep:
            r = step.usable(d.request_id)
            if r is not None and not d.verify:
                r.num_deep_positions = d.start_position + d.num_rows

    def _apply_verified(self, plan: StepPlan, result: StepResult, step: StepUpdate) -> None:
        """Verify mode's verdicts: accepted drafts and the next token become outputs (verify_plan.py)."""
        verified = {v.request_id: v for v in result.verified}
        for d in plan.deep:
            r = step.usable(d.request_id)
            if not d.verify or r is None:
                continue
            v = verified.get(d.request_id)
            if v is None:
                r.error = "the executor returned no verification for this request"
                self._finish(r, RequestStatus.FINISHED_ERROR)
            else:
                status = verify_plan.apply_verify(r, d, v, self.weight_version, self.counters)
                if status is not None:
                    self._finish(r, status)
            step.updates[d.request_id] = RequestUpdate(r, 1, r.is_finished)

    def _apply_sampled(self, plan: StepPlan, result: StepResult, step: StepUpdate) -> None:
        """Sampled tokens: verify drafts are kept aside; others are outputs (stop, or a prefill's last chunk
        joins the open cohort). A planned sample the executor did not return ends the request."""
        sampled = {t.request_id: t for t in result.sampled}
        sampling = (*plan.prefills, *plan.shallow, *(d for d in plan.deep if not d.verify))
        verify, version, counters = self.config.mode == "verify", self.weight_version, self.counters
        for rid in [w.request_id for w in sampling if w.sample is not None]:
            r = step.usable(rid)
            if r is None:
                continue  # aborted while the step ran, or already failed
            tok = sampled.get(rid)
            if tok is None:  # an executor bug must not hang the request
                self._fail(step, r, "the executor returned no token for this request")
                continue
            if verify and r.status == RequestStatus.DECODING:
                r.draft_token_ids.append(tok.token_id)  # unverified: not an output until its boundary
                counters.drafted_tokens += 1
                continue
            r.append_output(tok.token_id, tok.logprob, tok.loop, version, tok.top_logprobs)
            counters.tokens_generated += 1
            finished = self._check_stop(r)
            if not finished and r.status == RequestStatus.PREFILLING:
                # Join the open cohort only once prefilled, so a deep call failing in this same step
                # (which closes its cohort) never takes a request that was not part of it (a step planned
                # ahead joined it already: lookahead.py never does so beside a deep call).
                set_status(r, RequestStatus.ALIGNING)
                if not self.cohorts.is_member(r):
                    self.cohorts.join(r)
            step.updates[rid] = RequestUpdate(r, 1, finished)

    def _fail(self, step: StepUpdate, r: Request, message: str) -> None:
        r.error = message
        self._finish(r, RequestStatus.FINISHED_ERROR)
        step.updates[r.request_id] = RequestUpdate(r, 0, True)

    def _check_stop(self, r: Request) -> bool:
        status = r.stop_status()
        if status is not None:
            self._finish(r, status)
        return status is not None

    def _finish(self, r: Request, status: RequestStatus, counted: RequestStatus | None = None) -> None:
        was_waiting = r.status == RequestStatus.WAITING
        set_status(r, status)
        del self.requests[r.request_id]
        self.counters.count_finish(counted or status)
        if was_waiting:
            self.waiting.remove(r)
            return
        self.kv.free(r)
        self.cohorts.leave(r)
        self._released.append(r.request_id)

    def release(self, request_id: str) -> None:
        """List `request_id` in the next plan's released ids: the engine drops its rows and table row."""
        self._released.append(request_id)

    # ------------------------------------------------------------------ RL control (pause, weights)

    @property
    def num_running(self) -> int:
        return len(self.requests) - len(self.waiting)

    @property
    def num_started_waiting(self) -> int:
        """Waiting requests that were admitted before (preempted for KV room or by a recompute)."""
        return sum(r.num_preemptions > 0 for r in self.waiting)

    def needs_flush(self) -> bool:
        """Deep work is pending: a decoding request has positions whose deep loops have not run. In eager
        mode, whose deep loops run at once, a decoding request mid-block (its newest token read from a
        loop below T) counts too: the flush's forced boundary then gives eager deferred's readout schedule."""
        eager, T = self.config.mode == "eager", self.config.total_ut_steps
        return any(r.status == RequestStatus.DECODING and (
            r.feed_position > r.num_deep_positions or eager and bool(r.readout_loops) and r.readout_loops[-1] < T)
            for r in self.requests.values())

    def force_boundary(self) -> None:
        """Make the next step every cohort's boundary (deep work flushed, next token from loop T), so no
        position's deep loops run later than its shallow ones (pause(mode="keep") before a weight update)."""
        self._force_boundary = True

    def running(self) -> list[Request]:
        """The requests holding KV: admitted, not finished (admission.RUNNING)."""
        return [r for r in self.requests.values() if r.status in admission.RUNNING]

    def blocks_needed(self) -> int:
        """New blocks the coming step writes: a position per request it feeds (cohort.members_fed), and a
        block for the next chunk of each prefill under way (make_room keeps them free)."""
        fed = self.cohorts.feeding(self.requests)
        need = sum(self.kv.blocks_to_write(r, r.feed_position) for r in fed if r.can_feed)
        return need + self.prefills.next_chunk_blocks()

    def preempt(self, r: Request) -> None:
        """Free `r`'s KV and queue it again with its outputs (admission.preempt); the engine drops its rows."""
        admission.preempt(r, self.kv, self.waiting)
        self.cohorts.leave(r)
        self.counters.preemptions += 1
        self.release(r.request_id)

    def preempt_all(self) -> int:
        """Preempt every running request (their KV is recomputed on readmission); returns how many."""
        running = sorted(self.running(), key=lambda r: r.arrival_index, reverse=True)
        for r in running:
            self.preempt(r)
        return len(running)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block (their KV is stale after a weight update); returns how many.
        Blocks that live requests hold stay theirs; prefills under way stop sharing theirs (prefill.py)."""
        return self.kv.reset_prefix_cache()

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict[str, int]:
        stats: dict = self.counters.as_dict()
        stats["num_waiting"] = len(self.waiting)
        stats["num_running"] = len(self.requests) - len(self.waiting)
        stats["num_cohorts"] = len(self.cohorts)
        stats["kv_blocks_used"] = self.blocks.num_used
        stats["kv_blocks_total"] = self.blocks.num_blocks
        stats["kv_blocks_held_by_live_requests"] = len({b for r in self.requests.values() for b in r.block_ids})
        stats["kv_usage"] = self.blocks.num_used / self.blocks.num_blocks
        stats["prefix_cache_blocks"] = self.blocks.num_cached
        return stats
