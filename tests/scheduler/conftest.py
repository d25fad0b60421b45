from __future__ import annotations

import pytest

from ourobatch.scheduler import Scheduler, SchedulerConfig

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
