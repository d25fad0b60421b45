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
