"""Which decode rows run this step? Each cohort's fed members, their shallow rows, and boundary deep calls.

Every decoding member of a cohort the step feeds (cohort.members_fed) gets one shallow row; the step that
completes the cohort's block (its boundary, or a forced one: pause "keep") also carries the deep work.
Deferred mode feeds generated token k at P + k - 1 through loops 1..s, keeps the row, samples from loop
s between boundaries and, at a boundary, runs loops s+1..T over every retained row and samples from
loop T. Eager mode (and B = 1) feeds through all T loops at once and keeps no row. Verify mode's rows
are planned in verify_plan.py. A row's blocks are taken here, as its position is written (make_room
left room for them). With async scheduling a row may feed a token the step in flight samples
(``ShallowWork.token_id`` None: the engine reads it on the device).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .cohort import Cohorts
from .config import SchedulerConfig
from .kv_manager import KVManager
from .plan import DeepWork, SampleSpec, ShallowWork
from .request import Request
from .verify_plan import plan_verify


@dataclass
class DecodeRows:
    """The decode part of one step's plan."""

    shallow: list[ShallowWork] = field(default_factory=list)
    deep: list[DeepWork] = field(default_factory=list)
    num_boundaries: int = 0  # cohorts whose boundary this step is


def plan_decodes(config: SchedulerConfig, cohorts: Cohorts, requests: Mapping[str, Request], kv: KVManager,
                 force_boundary: bool) -> DecodeRows:
    """Every fed request's rows; each cohort's clock moves on (aligning members starting a block start
    decoding). `force_boundary`: this step is every cohort's boundary."""
    rows = DecodeRows()
    verify = config.mode == "verify"
    plan_row = plan_verify if verify else plan_deferred
    bs = config.block_size
    for cohort, fed in cohorts.begin_step(requests):
        boundary = cohort.is_boundary_step() or force_boundary
        for r in fed:
            # every fed request writes its feed position (not verify's with drafts to the end); a new block
            # when the position starts one (kv.blocks_to_write, written out); make_room left room for it
            if (not verify or r.can_feed) and r.feed_position // bs >= len(r.block_ids):
                kv.grow(r, kv.blocks_to_write(r, r.feed_position))
            plan_row(config, r, cohort.cohort_id, boundary, rows.shallow, rows.deep)
        rows.num_boundaries += boundary
        cohort.end_step(boundary)
    return rows


def plan_deferred(config: SchedulerConfig, r: Request, cohort_id: int, boundary: bool,
                  shallow: list[ShallowWork], deep: list[DeepWork]) -> None:
    """Deferred and eager mode: feed the newest output; at a boundary sample from loop T."""
    T, s = config.total_ut_steps, config.shallow_loops
    pending = r.num_pending
    outputs = r.output_token_ids
    pos = len(r.prompt_token_ids) + len(outputs) + pending - 1  # feed_position: token k = num_generated goes here
    nxt = len(outputs) + pending + 1
    token = None if pending else outputs[-1]  # None: sampled by the step in flight
    if config.deep_interval == 1 or config.mode == "eager":  # B=1: full depth in one call, no retained rows
        loop = T if boundary else s
        shallow.append(ShallowWork(r.request_id, token, pos, r.block_ids, T, False, SampleSpec(loop, nxt, r.params)))
    elif boundary:
        shallow.append(ShallowWork(r.request_id, token, pos, r.block_ids, s, True, None))
        start = r.num_deep_positions
        deep.append(DeepWork(r.request_id, cohort_id, start, pos + 1 - start, r.block_ids, s + 1,
                             SampleSpec(T, nxt, r.params)))
    else:
        shallow.append(ShallowWork(r.request_id, token, pos, r.block_ids, s, True, SampleSpec(s, nxt, r.params)))
