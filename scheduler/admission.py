"""Who runs next, and who makes room? Admission of waiting requests and preemption by recompute.

Each ``Scheduler.schedule()`` first calls ``make_room``: the coming step's shallow writes (one position
per decoding request) and one block for the next chunk of each prefill under way (prefill.py) must fit
in the free blocks; if they do not, the newest running requests (by arrival) are preempted until they
do. A preempted request frees its blocks, drops its retained rows and unverified drafts, and waits
again *with the tokens it produced*; when readmitted its prompt + outputs are prefilled through all
loops and its next token is read from loop T (preemption inserts a boundary, recorded in
readout_loops). A prefill under way that is preempted restarts (from the blocks the prefix cache kept).
The oldest running request is never preempted while another runs, and a request alone always fits
(``add`` rejects larger ones), so the oldest always progresses.

Then, if nobody was preempted in this step, ``admit`` takes waiting requests in order (preempted ones
sit before every request that arrived after them) while ``max_num_seqs``, the step's token budget and
the pool allow: the pool must hold the whole (re)prefill's blocks plus the watermark, though a chunked
prefill takes them chunk by chunk; the budget sizes its first chunk (prefill.py). Fairness: a request
that does not fit yet is bypassed by later ones that do (no head-of-line blocking), but at most
MAX_BYPASS times; then admission stops at it until it fits (no starvation: running requests only ever
finish or get preempted, so its room comes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .prefill import ChunkPlanner, next_chunk_blocks
from .request import Request, RequestStatus, set_status

if TYPE_CHECKING:
    from .core import Scheduler

MAX_BYPASS = 32  # times a waiting request that does not fit may be passed by later ones
# statuses that hold KV and may be preempted (PREFILLING: a prefill under way between two of its chunks)
RUNNING = (RequestStatus.PREFILLING, RequestStatus.ALIGNING, RequestStatus.DECODING)


def admit(sched: "Scheduler", planner: ChunkPlanner, started_only: bool = False) -> None:
    """Admit waiting requests in order; `planner` gives each its first prefill chunk (prompt + outputs from
    the first unshared block, as much as the step's token budget allows). `started_only`: only requests
    admitted before (preempted), as pause("wait") lets them finish."""
    cfg = sched.config
    num_running = sched.num_running
    blocked: list[Request] = []
    for r in list(sched.waiting):
        if num_running >= cfg.max_num_seqs:
            break
        if started_only and r.num_preemptions == 0:
            continue
        adm = sched.kv.plan_admission(r, planner.pending)
        if not sched.kv.can_admit(adm, alone=num_running == 0):
            blocked.append(r)
            if r.num_bypassed >= MAX_BYPASS:
                break  # it has waited long enough: nobody else goes first
            continue
        start = len(adm.shared) * cfg.block_size
        num_tokens = planner.chunk_size(len(adm.tokens) - start)
        if num_tokens == 0 and start < len(adm.tokens):
            break  # the step's token budget is spent
        for b in blocked:
            b.num_bypassed += 1
        sched.waiting.remove(r)
        if r.admission_version is None:  # CompletionOutput.weight_version: the weights it started with
            r.admission_version = sched.weight_version
        planner.begin(r, adm, num_tokens)
        num_running += 1


def blocks_needed(sched: "Scheduler") -> int:
    """New blocks the coming step's shallow writes need (who is fed: cohort.members_fed, schedule()'s rule),
    plus one block for the next chunk of each prefill under way (prefill.py)."""
    need = sum(sched.kv.blocks_to_write(r, r.feed_position) for r in sched.cohorts.feeding(sched.requests)
               if r.can_feed)
    return need + next_chunk_blocks(sched)


def make_room(sched: "Scheduler") -> bool:
    """Preempt the newest running requests until the coming step's writes fit; True if any was."""
    if sched.blocks.num_free >= sched.num_running:
        return False  # fast path: each running request needs one block at most (a position, or a chunk's block)
    preempted = False
    while blocks_needed(sched) > sched.blocks.num_free:
        running = [r for r in sched.requests.values() if r.status in RUNNING]
        assert len(running) > 1, "a request alone always fits (add() rejects larger ones)"
        preempt(sched, max(running, key=lambda r: r.arrival_index))
        preempted = True
    return preempted


def preempt(sched: "Scheduler", r: Request) -> None:
    """Free `r`'s KV and queue it again with its outputs; readmission prefills prompt + outputs."""
    set_status(r, RequestStatus.WAITING)
    sched.cohorts.leave(r)
    sched.kv.free(r)
    r.block_ids = ()
    r.draft_token_ids = []  # verify mode: only verified tokens survive
    r.num_deep_positions = 0
    r.num_preemptions += 1
    r.num_bypassed = 0
    sched.counters.preemptions += 1
    sched.release(r.request_id)  # the engine drops its retained rows and table row
    index = next((i for i, w in enumerate(sched.waiting) if w.arrival_index > r.arrival_index),
                 len(sched.waiting))
    sched.waiting.insert(index, r)  # ahead of every request that arrived after it
