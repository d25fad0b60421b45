"""Async scheduling: plan step k+1 while step k runs, and the rules for when that is not allowed.

Theory of operation. ``Scheduler.schedule_ahead(in_flight)`` plans the next step before the result of
the step in flight is known. First ``apply_pending`` applies what that step is certain to do, which
``update`` later confirms (its assignments are idempotent): every request it samples gets one pending
token (``Request.num_pending``: counted in its feed position and token index, fed on the device, filled
in by ``append_output``), the deep frontier moves as its prefill chunks, eager rows and deep calls fill
it, and a request whose last prefill chunk runs joins the open cohort while still PREFILLING (it starts
decoding in the plan if its block starts). A request whose pending token reaches max_tokens is ending
(``Request.is_ending``): the plan feeds it nothing. The boundary clock already advances in schedule(),
so a cohort needs nothing more.

What only the value of a token (eos, stop ids), a failure or a verify verdict reveals stays unknown. A
request that stops on its pending token has had one row planned in the step ahead: a wasted row, whose
sample update() discards (never appended, never reported; its blocks were freed by the update that
stopped it, and every later write to them is queued after the step that holds the row). For every other
request the plan must be the one the synchronous engine makes after update(): the same admissions,
chunks, preemptions and cohort clocks, so tokens, log-probs and the rows each loop sees do not change.
So the step is planned ahead only when the unknowns cannot change it; otherwise (``drain_reason``) the
caller waits for the step in flight, updates, and plans synchronously. The rules, in one place:

- ``verify``: verify mode (how many drafts are accepted is unknown; the config refuses async scheduling);
- ``forced_boundary``: a pause("keep") flush is pending (control work runs with nothing in flight);
- ``prompt_logprobs``: the step in flight scores prompt log-probs (its next chunk starts where they end);
- ``deep_and_prefill``: the step in flight runs a deep call and finishes a prefill (if the deep call
  fails, its cohort closes, and the prefilled request must not be a member of it);
- ``admission``: requests wait for admission while a request of the step in flight may end (a pending
  token at max_tokens, or a stop set: the room and seats it frees) or that step registers prefix blocks;
- ``chunk``: a prefill is under way while a request of the step in flight may end (its next chunk's
  budget and room depend on who ends);
- ``clock``: a cohort mid-block has aligning members and every decoding member may stop (its clock
  would reset and they would start now);
- ``preempt``: the step would have to preempt;
- ``evict``: a request of the step in flight may end and the step's new blocks would take a cached prefix
  block (more than the free list holds): the update could free blocks that make the eviction needless, and
  which prefixes stay cached decides later admissions' hits.

Aborts are not rules: an abort ends the request at once (its rows in steps already planned are wasted,
as a stopped request's), and "between two steps" means, with a step in flight, after the last update.
Failures reported by the step in flight end their requests in update(); rows planned ahead for them are
wasted (the engine skips the rows of requests whose phase failed in the step before).
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from .cohort import Cohorts, is_decoding
from .plan import StepPlan
from .request import Request, RequestStatus

REASONS = ("verify", "forced_boundary", "prompt_logprobs", "deep_and_prefill", "admission", "chunk", "clock",
           "preempt", "evict")


def plan_reason(plan: StepPlan) -> str | None:
    """The rules that the plan in flight alone decides (checked before anything is applied)."""
    if any(p.prompt_logprobs is not None for p in plan.prefills):
        return "prompt_logprobs"
    if plan.deep and any(p.sample is not None for p in plan.prefills):
        return "deep_and_prefill"
    return None


def apply_pending(plan: StepPlan, live: Callable[[str], Request | None], cohorts: Cohorts, total_ut_steps: int
                  ) -> list[Request]:
    """Apply what the step `plan` (in flight) certainly does; returns the requests it samples. `live(id)`:
    the incarnation the plan ran, if it still runs."""
    sampled = []
    for p in plan.prefills:
        r = live(p.request_id)
        if r is not None:
            r.num_deep_positions = p.start_position + len(p.token_ids)
            if p.sample is not None:
                r.num_pending += 1
                sampled.append(r)
                if not r.is_ending and not cohorts.is_member(r):  # a last chunk: it joins the open cohort now,
                    cohorts.join(r)                                # as update() would
    for w in plan.shallow:
        eager = w.last_loop == total_ut_steps
        r = live(w.request_id) if eager or w.sample is not None else None
        if r is not None:
            if eager:
                r.num_deep_positions = w.position + 1
            if w.sample is not None:
                r.num_pending += 1
                sampled.append(r)
    for d in plan.deep:
        r = live(d.request_id)
        if r is not None:
            r.num_deep_positions = d.start_position + d.num_rows
            if d.sample is not None:
                r.num_pending += 1
                sampled.append(r)
    return sampled


def drain_reason(plan: StepPlan, sampled: list[Request], waiting: Iterable[Request], admission: str,
                 prefill_under_way: bool, prefix_caching: bool, cohorts: Cohorts,
                 requests: Mapping[str, Request], must_preempt: Callable[[], bool],
                 must_evict: Callable[[], bool]) -> str | None:
    """Why the next step may not be planned before the update of `plan` (the module docstring's rules,
    after apply_pending), or None. `sampled`: the requests `plan` samples; `admission`: who may be admitted
    ("all", "started", "none"); `must_evict()`: the next step's new blocks outnumber the free list's."""
    # may the update of `plan` end one of them (a stop set, or the pending token at max_tokens: is_ending)?
    ends = any(r.stop_token_ids or (r.num_pending and len(r.output_token_ids) + r.num_pending >= r.params.max_tokens)
               for r in sampled)
    if admission != "none" and any(admission == "all" or r.num_preemptions for r in waiting):
        if ends or (prefix_caching and any(p.token_ids for p in plan.prefills)):
            return "admission"
    if ends and (prefill_under_way or _clock_may_reset(cohorts, requests)):
        return "chunk" if prefill_under_way else "clock"
    if must_preempt():
        return "preempt"
    if ends and must_evict():
        return "evict"
    return None


def _clock_may_reset(cohorts: Cohorts, requests: Mapping[str, Request]) -> bool:
    """A cohort mid-block with aligning members whose decoding members may all stop on their pending token."""
    for cohort in cohorts.values():
        if cohort.phase == 0:
            continue
        members = [requests[rid] for rid in cohort.member_ids]
        if not any(r.status in (RequestStatus.ALIGNING, RequestStatus.PREFILLING) for r in members):
            continue
        decoding = [r for r in members if is_decoding(r)]
        if decoding and all(r.stop_token_ids for r in decoding):
            return True
    return False
