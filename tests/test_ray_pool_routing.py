"""The parts of ourobatch.ray that need no Ray cluster: the facade is pinned and imports Ray (and torch)
lazily, the Router sends a request to the replica with the least outstanding work (a shared prefix's home
while it stays within the slack), and the replicas' stats sum to the pool's. The pool on a local Ray
cluster: tests/test_ray_pool.py."""

from __future__ import annotations

import pytest

from ourobatch.ray.routing import Router
from ourobatch.ray.stats import sum_stats

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("ray")]  # one local Ray at a time


# ---------------------------------------------------------------------- routing (no Ray)

def test_ray_facade_is_pinned_and_imports_ray_lazily():
    import subprocess
    import sys

    import ourobatch.ray

    assert set(ourobatch.ray.__all__) == {"EngineActor", "EnginePool", "ReplicaDiedError"}
    code = ("import sys, ourobatch, ourobatch.ray; ourobatch.ray.ReplicaDiedError; "
            "assert 'ray' not in sys.modules and 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_router_least_outstanding_work_then_lowest_index():
    r = Router(3, block_size=4, affinity_tokens=0)
    assert r.choose([1, 2, 3, 4, 5], [10, 3, 3]) == 1
    assert r.choose([1], [None, 7, 2]) == 2
    assert r.choose([1], [None, None, None]) is None


def test_router_prefix_affinity_yields_to_balance():
    r = Router(2, block_size=4, affinity_tokens=8, affinity_slack_tokens=100)
    system = [9, 9, 9, 9, 8, 8, 8, 8]
    assert r.choose(system + [1], [0, 0]) == 0  # a new prefix lands on the least loaded replica
    assert r.choose(system + [2, 3], [50, 0]) == 0  # same first 8 tokens: same replica, within the slack
    assert r.choose(system + [4], [101, 0]) == 1  # too unbalanced: the least loaded one
    assert r.choose(system + [5], [60, 0]) == 0  # the prefix kept its home
    assert r.choose(system + [6], [None, 0]) == 1  # home down: it moves
    assert r.choose(system + [7], [0, 50]) == 1
    assert r.choose([9, 9, 9], [5, 0]) == 1  # no full block: no affinity
    with pytest.raises(ValueError, match="affinity_tokens"):
        Router(2, block_size=4, affinity_tokens=-1)


def test_summed_stats_add_counters_and_recompute_usage():
    total = sum_stats([{"tokens_generated": 3, "kv_blocks_used": 1, "kv_blocks_total": 4, "kv_usage": 0.25,
                        "step_in_flight": False, "max_model_len": 64, "attention_backend": "torch"},
                       {"tokens_generated": 5, "kv_blocks_used": 3, "kv_blocks_total": 4, "kv_usage": 0.75,
                        "step_in_flight": True, "max_model_len": 64, "attention_backend": "torch"}])
    assert total == {"tokens_generated": 8, "kv_blocks_used": 4, "kv_blocks_total": 8, "kv_usage": 0.5,
                     "step_in_flight": True, "max_model_len": 64, "attention_backend": "torch"}



def test_levels_and_sizes_every_replica_holds_are_not_summed():
    # two replicas asleep at level 1 are at level 1, not 2; 27 tensors missing on each are 27
    one = {"sleep_level": 1, "weights_missing": 27, "tokens_generated": 2}
    assert sum_stats([one, dict(one)]) == {"sleep_level": 1, "weights_missing": 27, "tokens_generated": 4}
    assert sum_stats([one, {**one, "sleep_level": 2}])["sleep_level"] == 2


@pytest.mark.parametrize("option, value, message", [
    ("num_cpus_per_replica", -1, "num_cpus_per_replica must be a number > 0, got -1"),
    ("num_cpus_per_replica", "1", "num_cpus_per_replica must be a number > 0"),
    ("num_gpus_per_replica", -1, "num_gpus_per_replica must be None or a number >= 0, got -1"),
    ("max_concurrency", 0, "max_concurrency must be an int >= 1, got 0"),
    ("max_restarts", -5, r"max_restarts must be an int >= -1 \(-1: without limit\), got -5"),
    ("max_retries", -1, "max_retries must be an int >= 0, got -1"),
    ("retry_aborted", "no", "retry_aborted must be True or False, got 'no'"),
])
def test_bad_pool_options_are_refused_at_construction_naming_the_field(tmp_path, option, value, message):
    # before start(): Ray would accept some (a negative GPU count) and then never place the replica
    from ourobatch import EngineConfig
    from ourobatch.ray import EnginePool
    from ourobatch.testing import make_tiny_checkpoint

    config = EngineConfig(model=str(make_tiny_checkpoint(tmp_path / "m")))
    with pytest.raises((TypeError, ValueError), match=message):
        EnginePool(config, **{option: value})
    with pytest.raises(TypeError, match=r"keyword arguments \['bogus'\]"):
        EnginePool(config, bogus=1)
