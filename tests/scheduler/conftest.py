from __future__ import annotations

import pytest

from scheduler import RequestStatus, Scheduler, SchedulerConfig

from .fakes import STOP, FakeExecutor


def make_scheduler(**overrides) -> Scheduler:
    fields = dict(num_kv_blocks=256, block_size=4, max_num_seqs=64, max_model_len=512,
                  max_num_batched_tokens=4096, total_ut_steps=4, shallow_loops=2, deep_interval=4,
                  mode="deferred", vocab_size=50, eos_token_ids=frozenset({STOP}))
    fields.update(overrides)
    return Scheduler(SchedulerConfig(**fields))


def run_step(sched: Scheduler, ex: FakeExecutor):
    plan = sched.schedule()
    return plan, sched.update(plan, ex.execute(plan))


@pytest.fixture
def fake() -> FakeExecutor:
    return FakeExecutor()


def check_block_refs(sched: Scheduler) -> None:
    """Blocks in use are exactly the live requests' blocks, each counted once per holder; a request holds
    a block at most once; waiting requests hold none."""
    holders: dict[int, int] = {}
    for r in sched.requests.values():
        assert len(set(r.block_ids)) == len(r.block_ids), f"{r.request_id} holds a block twice"
        if r.status.name == "WAITING":
            assert r.block_ids == (), f"waiting {r.request_id} holds blocks"
        for b in r.block_ids:
            holders[b] = holders.get(b, 0) + 1
    assert len(holders) == sched.blocks.num_used
    for b, n in holders.items():
        assert sched.blocks.ref_count(b) == n, f"block {b}: {sched.blocks.ref_count(b)} refs, {n} holders"


def check_cohort_clocks(sched, B, mode):
    """All decoding members of a cohort share its clock: each fed exactly `phase` tokens since its last
    boundary (a verify-mode member waiting on unverified drafts may have fed fewer)."""
    for cohort in sched.cohorts.values():
        for m in cohort.member_ids:
            r = sched.requests[m]
            if r.status != RequestStatus.DECODING:
                continue
            k = r.num_output_tokens + len(r.draft_token_ids)
            since = r.num_prompt_tokens + k - 1 - r.num_deep_positions  # fed since the deep frontier
            j = r.num_output_tokens - r.num_outputs_at_prefill  # a (re)prefill starts the request's blocks
            if mode == "eager":
                assert since == 0 and (j - 1) % B == cohort.phase
            elif mode == "verify":
                assert since <= cohort.phase and len(r.draft_token_ids) <= cohort.phase
            else:
                assert since == cohort.phase == (j - 1) % B


def update_checked(sched: Scheduler, plan, result, ended: dict[str, str], B: int, mode: str) -> None:
    """Apply a step's result, record who ended how (a request ends once; an abort during the step is its
    end), then check block references and cohort clocks."""
    for u in sched.update(plan, result):
        if u.finished:
            rid = u.request.request_id
            assert rid not in ended or ended[rid] == "abort" and u.request.finish_reason == "abort"
            ended[rid] = u.request.finish_reason
    check_block_refs(sched)
    check_cohort_clocks(sched, B, mode)


def abort_all_and_release(sched: Scheduler, ex: FakeExecutor) -> None:
    """Abort whatever is live: every block comes back; one more plan hands the releases to the executor."""
    for rid in list(sched.requests):
        sched.abort(rid)
    assert sched.blocks.num_used == 0
    ex.execute(sched.schedule())
