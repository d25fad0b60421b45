"""The scheduler's counters (``Scheduler.stats()``; docs/api.md lists them): plain ints, torch-free.

Each counting rule that is more than one increment is a method here, so this file says what every
counter counts; ``as_dict()`` gives them in the order stats() reports them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .plan import StepPlan
from .request import RequestStatus


@dataclass
class SchedulerCounters:
    steps: int = 0  # planned steps
    prefills: int = 0  # prompts prefilled: last chunks (a fork samples from its sibling's last chunk)
    prefill_tokens: int = 0
    prefill_chunks: int = 0  # prefill work items that ran tokens through the model
    shallow_steps: int = 0  # steps with a shallow call
    shallow_rows: int = 0
    deep_calls: int = 0  # steps with a deep call
    deep_rows: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    tested_drafts: int = 0  # drafts the acceptance test reached: accepted ones + the first rejected one
    rolled_back_positions: int = 0
    boundaries: int = 0  # cohort boundaries planned
    tokens_generated: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0  # tokens prefilled again after a preemption (outputs included)
    prefix_cache_hits: int = 0  # prefill tokens whose KV was shared instead of computed
    prefill_tokens_requested: int = 0  # tokens of every (re)prefill
    prefill_tokens_computed: int = 0  # of those, the ones run through the model
    requests_added: int = 0
    finished_stop: int = 0
    finished_length: int = 0
    finished_abort: int = 0
    finished_error: int = 0
    lookahead_steps: int = 0  # async scheduling: steps planned while the step before them ran
    lookahead_drains: int = 0  # async scheduling: steps that had to wait for the update before them

    def count_plan(self, plan: StepPlan, num_boundaries: int) -> None:
        """A planned step: its prefill chunks, shallow rows, deep rows, and the cohort boundaries in it."""
        self.steps += 1
        self.boundaries += num_boundaries
        for p in plan.prefills:
            self.prefills += p.sample is not None  # only a (re)prefill's last chunk samples
            self.prefill_chunks += len(p.token_ids) > 0
            self.prefill_tokens += len(p.token_ids)
            self.prefill_tokens_computed += len(p.token_ids)
        if plan.shallow:
            self.shallow_steps += 1
            self.shallow_rows += len(plan.shallow)
        if plan.deep:
            self.deep_calls += 1
            self.deep_rows += sum(d.num_rows for d in plan.deep)

    def count_admission(self, num_tokens: int, num_shared: int, is_recompute: bool) -> None:
        """An admission whose (re)prefill has `num_tokens` tokens, the first `num_shared` of them shared."""
        self.prefill_tokens_requested += num_tokens
        self.prefix_cache_hits += num_shared
        if is_recompute:
            self.recomputed_tokens += num_tokens - num_shared

    def count_verify(self, num_drafts: int, num_accepted: int, num_rolled_back: int) -> None:
        """A verified block of drafts; the test stops at the first rejection (later drafts go untested)."""
        self.accepted_tokens += num_accepted
        self.tested_drafts += num_accepted + (num_accepted < num_drafts)
        self.rolled_back_positions += num_rolled_back

    def count_finish(self, status: RequestStatus) -> None:
        if status == RequestStatus.FINISHED_STOPPED:
            self.finished_stop += 1
        elif status == RequestStatus.FINISHED_LENGTH:
            self.finished_length += 1
        elif status == RequestStatus.FINISHED_ABORTED:
            self.finished_abort += 1
        else:
            assert status == RequestStatus.FINISHED_ERROR, status
            self.finished_error += 1

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)
