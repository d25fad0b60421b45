"""The Collector over a 2-replica EnginePool on a local CPU Ray: the same guarantees as on one Engine
(tests/test_rollout.py): every task yielded once, complete groups, the staleness bound on every token,
updates fanned out to both replicas, and 0 KV blocks on every replica at the end."""

from __future__ import annotations

import pytest
import ray
from safetensors.torch import load_file

from ourobatch import EngineConfig, SamplingParams
from ourobatch.ray import EnginePool
from ourobatch.rollout import Collector
from ourobatch.testing import make_tiny_checkpoint

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300), pytest.mark.xdist_group("ray")]  # one Ray at a time


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_pool")
    return (make_tiny_checkpoint(root / "a", seed=31, eos_token_id=None),
            make_tiny_checkpoint(root / "b", seed=32, eos_token_id=None))


@pytest.mark.parametrize("policy", ["continue"])
async def test_the_collector_runs_the_same_over_a_two_replica_pool(ckpts, policy):
    a, b = ckpts
    updates = [list(load_file(str(p / "model.safetensors")).items()) for p in (b, a)]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        config = EngineConfig(model=str(a), dtype="float32", block_size=4, num_kv_blocks=128, max_model_len=48,
                              max_num_seqs=6)
        async with EnginePool(config, num_replicas=2) as pool:
            tasks = [[1 + i % 29, 2, 3] for i in range(12)]
            batches = []
            async with Collector(pool, tasks, n=2, params=SamplingParams(max_tokens=8, ignore_eos=True),
                                 groups_per_batch=3, max_staleness=1, on_update=policy,
                                 reward=lambda task, s: float(len(s.token_ids))) as collector:
                async for batch in collector:
                    batches.append(batch)
                    await collector.update_weights(updates[len(batches) % 2])
                stats = collector.stats()
            per_replica = pool.stats()
        yielded = [g.task_index for bt in batches for g in bt.groups]
        assert sorted(yielded) == list(range(12))
        assert all(len(g.samples) == 2 and all(s.reward == 8.0 for s in g.samples)
                   for bt in batches for g in bt.groups)
        assert max(stats["staleness_histogram"]) <= 1 and stats["updates"] == len(batches)
        assert per_replica["weight_version"] == len(batches) and per_replica["kv_blocks_used"] == 0
    finally:
        ray.shutdown()
