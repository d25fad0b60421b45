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

Inputs are narrow: ``admit`` takes the waiting queue and the step's ChunkPlanner (which holds the KV
manager), ``preempt`` the request, the KV manager and the queue; ``make_room`` sees the scheduler only
through the ``Room`` protocol (the running requests, the blocks the step needs, preempting one).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from .block_manager import BlockManager
from .kv_manager import KVManager
from .prefill import ChunkPlanner
from .request import Request, RequestStatus, set_status

MAX_BYPASS = 32  # times a waiting request that does not fit may be passed by later ones
# statuses that hold KV and may be preempted (PREFILLING: a prefill under way between two of its chunks)
RUNNING = (RequestStatus.PREFILLING, RequestStatus.ALIGNING, RequestStatus.DECODING)


class Room(Protocol):
    """What make_room reads of the scheduler, and the one change it asks of it."""

    @property
    def num_running(self) -> int: ...  # requests holding KV (statuses in RUNNING)

    def running(self) -> list[Request]: ...  # those requests

    def blocks_needed(self) -> int: ...  # new blocks the coming step's writes need

    def preempt(self, r: Request) -> None: ...  # free r's KV and queue it again (preempt() below and more)


def admit(waiting: deque[Request], planner: ChunkPlanner, num_running: int, max_num_seqs: int,
          started_only: bool = False) -> None:
    """Admit `waiting` requests in order while `num_running` is below `max_num_seqs`; `planner` gives each
    its first prefill chunk (prompt + outputs from the first unshared block, as much as the step's token
    budget allows). `started_only`: only requests admitted before (preempted), as pause("wait") lets them
    finish."""
    kv = planner.kv
    blocked: list[Request] = []
    for r in list(waiting):
        if num_running >= max_num_seqs:
            break
        if started_only and r.num_preemptions == 0:
            continue
        adm = kv.plan_admission(r, planner.pending)
        if not kv.can_admit(adm, alone=num_running == 0):
            blocked.append(r)
            if r.num_bypassed >= MAX_BYPASS:
                break  # it has waited long enough: nobody else goes first
            continue
        start = len(adm.shared) * planner.block_size
        num_tokens = planner.chunk_size(len(adm.tokens) - start)
        if num_tokens == 0 and start < len(adm.tokens):
            break  # the step's token budget is spent
        for b in blocked:
            b.num_bypassed += 1
        waiting.remove(r)
        planner.begin(r, adm, num_tokens)
        num_running += 1


def make_room(blocks: BlockManager, room: Room) -> bool:
    """Preempt the newest running requests until the coming step's writes fit; True if any was."""
    if blocks.num_free >= room.num_running:
        return False  # fast path: each running request needs one block at most (a position, or a chunk's block)
    preempted = False
    while room.blocks_needed() > blocks.num_free:
        running = room.running()
        assert len(running) > 1, "a request alone always fits (add() rejects larger ones)"
        room.preempt(max(running, key=lambda r: r.arrival_index))
        preempted = True
    return preempted


def preempt(r: Request, kv: KVManager, waiting: deque[Request]) -> None:
    """Free `r`'s KV and queue it again with its outputs, ahead of every request that arrived after it;
    readmission prefills prompt + outputs. (The scheduler also takes it out of its cohort and releases its
    engine-side rows.)"""
    assert not r.num_pending, f"req {r.request_id}: preempted with a step in flight"
    set_status(r, RequestStatus.WAITING)
    kv.free(r)
    r.block_ids = ()
    r.draft_token_ids = []  # verify mode: only verified tokens survive
    r.num_deep_positions = 0
    r.num_preemptions += 1
    r.num_bypassed = 0
    index = next((i for i, w in enumerate(waiting) if w.arrival_index > r.arrival_index), len(waiting))
    waiting.insert(index, r)
