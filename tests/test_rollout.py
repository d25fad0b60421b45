"""ourobatch.rollout.Collector against a real (tiny) async Engine on the CPU.

References are independent of the collector: the engine's own score() / a fresh SyncEngine on the
other weights, and plain accounting of the task indices the test itself fed in. No sleeps: the consumer
waits for observable progress with `until`."""

from __future__ import annotations

import random

import anyio
import pytest
from safetensors.torch import load_file

from ourobatch import Engine, EngineClosedError, EngineConfig, SamplingParams, SyncEngine
from ourobatch.rollout import Collector, keep_varied_rewards
from ourobatch.testing import make_tiny_checkpoint

from .helpers import GatedExecutor, until

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]


def make_ckpts(root):
    """Three tiny checkpoints (no EOS) under root: the policy and two weight updates."""
    return (make_tiny_checkpoint(root / "a", seed=21, eos_token_id=None),
            make_tiny_checkpoint(root / "b", seed=22, eos_token_id=None),
            make_tiny_checkpoint(root / "c", seed=23, eos_token_id=None))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return make_ckpts(tmp_path_factory.mktemp("rollout"))


def config(path, B=1, dtype="float32", **kw) -> EngineConfig:
    base = dict(model=str(path), dtype=dtype, deep_interval=B, block_size=4, num_kv_blocks=256,
                max_model_len=48, max_num_seqs=12)
    base.update(kw)
    return EngineConfig(**base)


def tensors(path):
    return list(load_file(str(path / "model.safetensors")).items())


def params(max_tokens=8, temperature=1.0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)


def tasks(num: int) -> list[dict]:
    return [{"prompt_token_ids": [1 + i % 29, 2 + i % 7, 3], "id": i} for i in range(num)]


def parity_reward(task, sample) -> float:
    return float(sample.token_ids[0] % 2)


async def collect(engine, tasks_, updates=(), *, rng=None, **kw):
    """Run a collector to the end; after each batch push the next weights of `updates` (cycled)."""
    batches = []
    async with Collector(engine, tasks_, **kw) as collector:
        async for batch in collector:
            batches.append(batch)
            if updates:
                if rng is not None and rng.random() < 0.5:  # let generation run on a bit first
                    seen = engine.stats()["tokens_generated"]
                    await until(lambda: engine.stats()["tokens_generated"] > seen
                                or not collector.stats()["samples_in_flight"])
                await collector.update_weights(updates[len(batches) % len(updates)])
        stats = collector.stats()
        failed = list(collector.failed)
    return batches, stats, failed


def check_batches(batches, n: int, G: int) -> list[int]:
    """Every group complete (n finished samples); the task indices yielded, in order."""
    yielded = []
    for b in batches:
        assert 0 < len(b.groups) <= G
        for g in b.groups:
            assert len(g.samples) == n and sorted(s.index for s in g.samples) == list(range(n))
            assert all(s.finish_reason in ("stop", "length") and s.token_ids for s in g.samples)
            yielded.append(g.task_index)
    return yielded


async def test_every_task_is_yielded_exactly_once_with_updates_carries_and_staleness(ckpts):
    a, b, _ = ckpts
    async with Engine(config(a)) as engine:
        batches, stats, _ = await collect(engine, tasks(20), [tensors(b), tensors(a)], n=3, params=params(),
                                          reward=parity_reward, groups_per_batch=4, max_staleness=1,
                                          oversample=2)
        assert engine.stats()["kv_blocks_used"] == 0
    yielded = check_batches(batches, 3, 4)
    assert sorted(yielded) == list(range(20))  # none lost, none twice (stale ones regenerated)
    assert stats["groups_yielded"] == 20 and stats["updates"] == len(batches)
    assert max(stats["staleness_histogram"]) <= 1


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("eta,policy", [(0, "continue"), (1, "continue"), (2, "recompute"), (1, "abort")])
async def test_the_staleness_bound_holds_on_every_token_under_random_update_timings(ckpts, seed, eta, policy):
    a, b, c = ckpts
    rng = random.Random(seed)
    async with Engine(config(a, B=rng.choice([1, 4]))) as engine:
        batches, stats, _ = await collect(engine, tasks(14), [tensors(b), tensors(c), tensors(a)], rng=rng, n=2,
                                          params=params(rng.randint(4, 12)), groups_per_batch=3,
                                          max_staleness=eta, on_update=policy, oversample=rng.randint(0, 2))
    assert sorted(check_batches(batches, 2, 3)) == list(range(14))
    ordinal = {}  # version -> updates before it, from what each batch says was current
    for i, batch in enumerate(batches):
        ordinal.setdefault(batch.weight_version, i)
        for s in batch.samples:
            assert ordinal[batch.weight_version] - ordinal[s.oldest_version] <= eta
            if eta == 0 or policy == "abort":
                assert not s.is_mixed  # on-policy, or restarted from scratch after the update
    assert max(stats["staleness_histogram"]) <= eta


async def test_filters_and_aborted_surplus_lose_no_task(ckpts):
    a, _, _ = ckpts
    async with Engine(config(a)) as engine:
        batches, stats, failed = await collect(engine, tasks(16), n=3, params=params(), reward=parity_reward,
                                               groups_per_batch=3, keep_group=keep_varied_rewards, oversample=3,
                                               surplus="abort", max_staleness=None)
        assert engine.stats()["kv_blocks_used"] == 0
    yielded = check_batches(batches, 3, 3)
    assert len(set(yielded)) == len(yielded) and not failed
    assert all(len(set(g.rewards)) > 1 for b in batches for g in b.groups)
    assert len(yielded) + stats["groups_filtered"] == 16  # aborted surplus was regenerated, not lost
    assert stats["groups_started"] == 16 + stats["groups_aborted"]


async def straddling_sample(engine, new_tensors, max_tokens: int, **kw):
    """A sample the update lands in the middle of, deterministically: the gate lets the first group's
    max_tokens steps and 4 of the second's run, holds the next step in flight, the update is asked for,
    then the gate opens (the held step finishes under the old weights, then the engine pauses)."""
    gate = GatedExecutor(engine.core.executor)
    engine.core.executor = gate
    gate.hold(max_tokens + 4)
    batches = []
    async with Collector(engine, tasks(3), n=1, groups_per_batch=1, max_samples_in_flight=1, max_staleness=1,
                         **kw) as collector:
        async for batch in collector:
            batches.append(batch)
            if batch.index == 0:
                await gate.wait_entered()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(collector.update_weights, new_tensors)
                    await until(lambda: engine.core.control.run.value != "running")
                    gate.open()
    mixed = [s for b in batches for s in b.samples if s.is_mixed]
    assert len(mixed) == 1, [s.weight_versions for b in batches for s in b.samples]
    return mixed[0]


async def test_continue_records_the_update_per_token_and_reports_the_drawn_logprobs(ckpts):
    a, b, _ = ckpts
    async with Engine(config(a, dtype="float64", max_num_seqs=4)) as engine:
        s = await straddling_sample(engine, tensors(b), 24, params=params(24))
    k = s.weight_versions.index(1)
    assert 3 <= k < 24 and s.weight_versions == [0] * k + [1] * (24 - k)  # one switch, where it landed
    with SyncEngine(config(a, dtype="float64")) as old:
        replay = old.score(s.prompt_token_ids, s.token_ids[:k], s.readout_loops[:k], params(24))
    assert replay == pytest.approx(s.logprobs[:k], abs=1e-9)  # drawn under the old weights, as reported
    with SyncEngine(config(b, dtype="float64")) as new:
        dense = new.score(s.prompt_token_ids, s.token_ids, s.readout_loops, params(24))
    # after the update the tokens attended to KV the old weights computed: a dense replay on the new
    # weights differs (docs/semantics.md), the price of PipelineRL-style in-flight updates
    assert max(abs(x - y) for x, y in zip(dense[k:], s.logprobs[k:])) > 1e-6


async def test_recompute_continues_as_a_fresh_engine_on_the_new_weights_would(ckpts):
    a, b, _ = ckpts
    greedy = params(20, temperature=0.0)
    async with Engine(config(a, dtype="float64", max_num_seqs=4)) as engine:
        s = await straddling_sample(engine, tensors(b), 20, params=greedy, on_update="recompute")
    k = s.weight_versions.index(1)
    with SyncEngine(config(b, dtype="float64")) as fresh:
        out = fresh.generate(s.prompt_token_ids + s.token_ids[:k], params(20 - k, temperature=0.0)).outputs[0]
    assert out.token_ids == s.token_ids[k:]
    assert out.logprobs == pytest.approx(s.logprobs[k:], abs=1e-9)


async def test_the_engine_keeps_generating_while_the_consumer_holds_a_batch(ckpts):
    a, _, _ = ckpts
    async with Engine(config(a)) as engine:
        # 4 sample slots: groups 2 and 3 can only start once 0 and 1 (batch 0) are done
        async with Collector(engine, tasks(12), n=2, params=params(12), groups_per_batch=2, max_staleness=1,
                             max_samples_in_flight=4) as collector:
            batch = await collector.__anext__()
            # the consumer is "training" on batch 0 and asks for nothing: batch 1 is generated meanwhile
            await until(lambda: collector.stats()["groups_ready"] == 2)
            assert batch.index == 0 and collector.stats()["groups_started"] == 4


@pytest.mark.parametrize("how", ["aclose", "cancel"])
async def test_closing_or_cancelling_the_consumer_aborts_what_runs_and_frees_every_block(ckpts, how):
    a, _, _ = ckpts
    async with Engine(config(a)) as engine:
        with anyio.CancelScope() as scope:
            async with Collector(engine, tasks(40), n=3, params=params(16), groups_per_batch=2,
                                 max_staleness=None) as collector:
                async for _ in collector:
                    await until(lambda: engine.stats()["num_running"] > 0)
                    if how == "cancel":
                        scope.cancel()
                        await anyio.lowlevel.checkpoint()
                    await collector.aclose()
        await until(lambda: engine.stats()["num_running"] == engine.stats()["num_waiting"] == 0)
        assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("on_error", ["drop", "raise"])
async def test_a_failing_reward_fails_its_group_never_the_engine(ckpts, on_error):
    a, _, _ = ckpts

    async def reward(task, sample):
        if task["id"] == 3:
            raise RuntimeError("reward model down")
        return 1.0

    async with Engine(config(a)) as engine:
        if on_error == "raise":
            with pytest.raises(RuntimeError, match="reward model down"):
                await collect(engine, tasks(6), n=2, params=params(), reward=reward, groups_per_batch=2,
                              on_reward_error="raise")
        else:
            batches, stats, failed = await collect(engine, tasks(6), n=2, params=params(), reward=reward,
                                                   groups_per_batch=2)
            assert sorted(check_batches(batches, 2, 2)) == [0, 1, 2, 4, 5]
            assert stats["groups_failed"] == 1 and failed[0][0]["id"] == 3
        assert (await engine.generate([1, 2], params())).outputs[0].finish_reason == "length"
        assert engine.stats()["kv_blocks_used"] == 0


async def test_bad_options_name_the_option_and_the_allowed_values(ckpts):
    a, _, _ = ckpts
    async with Engine(config(a)) as engine:
        for kw, match in [(dict(n=0), "n must be"), (dict(on_update="later"), "on_update must be one of"),
                          (dict(max_staleness=-1), "max_staleness"), (dict(surplus="keep"), "surplus must be"),
                          (dict(params=SamplingParams(n=2)), "Collector\\(n=")]:
            args = dict(n=2, params=params(), groups_per_batch=2) | kw
            with pytest.raises(ValueError, match=match):
                Collector(engine, tasks(2), **args)
        with pytest.raises(ValueError, match="prompt_token_ids"):
            await collect(engine, [{"prompt": "text"}], n=1, params=params(), groups_per_batch=1)


@pytest.mark.parametrize("monitor", [True, False])
async def test_an_engine_that_closes_under_the_collector_stops_it_with_that_error(ckpts, monitor):
    # Every later request would fail the same way: the consumer gets EngineClosedError itself (not wrapped in
    # task groups), and the collector stops starting groups instead of failing the rest of the tasks one by one.
    a, _, _ = ckpts
    engine = Engine(config(a))
    consumed = 0
    async with engine:
        with pytest.raises(EngineClosedError):
            async with Collector(engine, tasks(2000), n=2, params=params(16), groups_per_batch=2,
                                 occupancy_interval_s=0.01 if monitor else 1e6) as collector:
                async for _ in collector:
                    consumed += 1
                    await engine.aclose()  # batches complete before this may still be delivered
    assert consumed >= 1
    assert collector.stats()["groups_started"] < 100  # not the 2000 tasks burnt as failures
