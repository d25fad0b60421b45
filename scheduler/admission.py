"""Who runs next, and who makes room? Admission of waiting requests and preemption by recompute.

Each ``Scheduler.schedule()`` first calls ``make_room``: the coming step's shallow writes (one position
per decoding request) must fit in the free blocks; if they do not, the newest running requests (by
arrival) are preempted until they do. A preempted request frees its blocks, drops its retained rows
and unverified drafts, and waits again *with the tokens it produced*; when readmitted its prompt +
outputs are prefilled through all loops and its next token is read from loop T (preemption inserts a
boundary, recorded in readout_loops). The oldest running request is never preempted while another
runs, and a request alone always fits (``add`` rejects larger ones), so the oldest always progresses.

Then, if nobody was preempted in this step, ``admit`` takes waiting requests in order (preempted ones
sit before every request that arrived after them) while ``max_num_seqs``, the prefill token budget
and the pool allow. Fairness: a request that does not fit yet is bypassed by later ones that do (no
head-of-line blocking), but at most MAX_BYPASS times; then admission stops at it until it fits (no
starvation: running requests only ever finish or get preempted, so its room comes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .kv_manager import PendingPrefills
from .plan import PrefillWork, SampleSpec
from .request import Request, RequestStatus, set_status

if TYPE_CHECKING:
    from .core import Scheduler

MAX_BYPASS = 32  # times a waiting request that does not fit may be passed by later ones


def admit(sched: "Scheduler") -> list[PrefillWork]:
    """Admit waiting requests; returns their prefills (prompt + outputs from the first unshared block)."""
    cfg = sched.config
    prefills: list[PrefillWork] = []
    pending = PendingPrefills()  # what this plan's prefills compute (the n samples of a request share it)
    budget = cfg.max_num_batched_tokens
    num_running = len(sched.requests) - len(sched.waiting)
    blocked: list[Request] = []
    for r in list(sched.waiting):
        if num_running >= cfg.max_num_seqs:
            break
        adm = sched.kv.plan_admission(r, pending)
        if not sched.kv.can_admit(adm, alone=num_running == 0):
            blocked.append(r)
            if r.num_bypassed >= MAX_BYPASS:
                break  # it has waited long enough: nobody else goes first
            continue
        num_compute = len(adm.tokens) - len(adm.shared) * cfg.block_size
        if prefills and num_compute > budget:
            break
        for b in blocked:
            b.num_bypassed += 1
        sched.waiting.remove(r)
        start = sched.kv.admit(r, adm, pending)
        set_status(r, RequestStatus.PREFILLING)
        k = r.num_output_tokens  # > 0 after a preemption: prompt + outputs are prefilled again
        r.num_outputs_at_prefill = k
        prefills.append(PrefillWork(r.request_id, adm.tokens[start:], start, r.block_ids,
                                    SampleSpec(cfg.total_ut_steps, k + 1, r.params), adm.sample_from))
        c = sched.counters
        c["prefill_tokens_requested"] += len(adm.tokens)
        c["prefix_cache_hits"] += start
        if k:
            c["recomputed_tokens"] += len(adm.tokens) - start
        budget -= num_compute
        num_running += 1
    return prefills


def feed_position(mode: str, r: Request) -> int | None:
    """The position a decoding `r` writes in its next shallow step (None: verify drafts wait)."""
    k = r.num_output_tokens
    if mode == "verify":
        drafts = r.draft_token_ids
        k += len(drafts)
        if k >= r.params.max_tokens or (drafts and drafts[-1] in r.stop_token_ids):
            return None
    return r.num_prompt_tokens + k - 1


def blocks_needed(sched: "Scheduler") -> int:
    """New blocks the coming step's shallow writes need (the cohort rule of Scheduler.schedule())."""
    need = 0
    for cohort in sched.cohorts.values():
        members = [sched.requests[rid] for rid in cohort.member_ids]
        decoding = any(r.status == RequestStatus.DECODING for r in members)
        starts = not decoding or cohort.phase == 0  # aligning members start decoding this step
        for r in members:
            if r.status == RequestStatus.DECODING or (starts and r.status == RequestStatus.ALIGNING):
                position = feed_position(sched.config.mode, r)
                if position is not None:
                    need += sched.kv.blocks_to_write(r, position)
    return need


def make_room(sched: "Scheduler") -> bool:
    """Preempt the newest running requests until the coming step's writes fit; True if any was."""
    if sched.blocks.num_free >= sched.num_running:
        return False  # fast path: a step writes one position per running request, so one block at most each
    preempted = False
    while blocks_needed(sched) > sched.blocks.num_free:
        running = [r for r in sched.requests.values()
                   if r.status in (RequestStatus.ALIGNING, RequestStatus.DECODING)]
        assert len(running) > 1, "a request alone always fits (add() rejects larger ones)"
        preempt(sched, max(running, key=lambda r: r.arrival_index))
        preempted = True
    return preempted


def preempt(sched: "Scheduler", r: Request) -> None:
    """Free `r`'s KV and queue it again with its outputs; readmission prefills prompt + outputs."""
    set_status(r, RequestStatus.WAITING)
    sched.leave_cohort(r)
    sched.kv.free(r)
    r.block_ids = ()
    r.draft_token_ids = []  # verify mode: only verified tokens survive
    r.num_deep_positions = 0
    r.num_preemptions += 1
    r.num_bypassed = 0
    sched.counters["preemptions"] += 1
    sched.release(r.request_id)  # the engine drops its retained rows and table row
    index = next((i for i, w in enumerate(sched.waiting) if w.arrival_index > r.arrival_index),
                 len(sched.waiting))
    sched.waiting.insert(index, r)  # ahead of every request that arrived after it
