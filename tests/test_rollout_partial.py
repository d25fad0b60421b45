"""Partial rollouts (Collector(max_tokens_per_round=k)) against a real tiny async Engine on the CPU.

References: a fresh SyncEngine on the new weights continuing from the same prefix, the old engine's
score() of the first round, and the task indices the test fed in. No sleeps: progress is awaited with
`until`."""

from __future__ import annotations

import random

import anyio
import pytest

from ourobatch import Engine, SyncEngine
from ourobatch.rollout import Collector

from .helpers import until
from .test_rollout import check_batches, config, make_ckpts, params, tasks, tensors

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return make_ckpts(tmp_path_factory.mktemp("rollout_partial"))


async def run_slow_consumer(engine, tasks_, *, k: int, updates=(), wait_tokens: int = 0, **kw):
    """A consumer that lets the engine generate `wait_tokens` more tokens before asking for each next
    batch (so samples in flight have a round of >= k tokens at the hand-over), then pushes the next of
    `updates` (cycled) after each batch."""
    batches = []
    async with Collector(engine, tasks_, max_tokens_per_round=k, **kw) as collector:
        while True:
            seen = engine.stats()["tokens_generated"]
            await until(lambda: engine.stats()["tokens_generated"] >= seen + wait_tokens
                        or not collector.stats()["samples_in_flight"])
            try:
                batch = await collector.__anext__()
            except StopAsyncIteration:
                break
            batches.append(batch)
            if updates:
                await collector.update_weights(updates[len(batches) % len(updates)])
        stats = collector.stats()
    return batches, stats


@pytest.mark.parametrize("B", [1, 4])
async def test_a_paused_sample_continues_as_a_fresh_engine_on_the_new_weights_would(ckpts, B):
    a, b, _ = ckpts
    greedy = params(30, temperature=0.0)
    async with Engine(config(a, B=B, dtype="float64", max_model_len=64)) as engine:
        batches, stats = await run_slow_consumer(
            engine, tasks(6), k=4, updates=[tensors(b)], wait_tokens=12, n=1, params=greedy, groups_per_batch=1,
            max_staleness=None, max_samples_in_flight=2)
        assert engine.stats()["kv_blocks_used"] == 0
    assert sorted(check_batches(batches, 1, 1)) == list(range(6))
    paused = [s for batch in batches for s in batch.samples if s.num_rounds > 1]
    assert paused and stats["samples_paused"] >= len(paused)
    for s in paused:
        assert len(s.token_ids) == 30 and s.round_starts[0] == 0 and s.round_starts == sorted(set(s.round_starts))
        m = s.round_starts[1]
        assert m >= 4  # paused only after a round of max_tokens_per_round tokens
        assert set(s.weight_versions[:m]) == {s.weight_versions[0]} and s.weight_versions[m] > s.weight_versions[0]
    s = paused[0]
    m = s.round_starts[1]
    first = s.weight_versions[0]
    with SyncEngine(config(a if first == 0 else b, B=B, dtype="float64", max_model_len=64)) as old:
        replay = old.score(s.prompt_token_ids, s.token_ids[:m], s.readout_loops[:m], greedy)
    assert replay == pytest.approx(s.logprobs[:m], abs=1e-9)  # round one drawn under the old weights
    end = s.round_starts[2] if s.num_rounds > 2 else 30
    with SyncEngine(config(b, B=B, dtype="float64", max_model_len=64)) as fresh:  # every update pushes b
        out = fresh.generate(s.prompt_token_ids + s.token_ids[:m], params(end - m, temperature=0.0)).outputs[0]
    assert out.token_ids == s.token_ids[m:end]  # round two: prefix prefilled under the new weights
    assert out.logprobs == pytest.approx(s.logprobs[m:end], abs=1e-9)


async def test_paused_samples_continue_when_no_update_comes(ckpts):
    a, _, _ = ckpts
    async with Engine(config(a)) as engine:
        batches, stats = await run_slow_consumer(engine, tasks(8), k=3, wait_tokens=24, n=2, params=params(12),
                                                 groups_per_batch=1, max_staleness=None, max_samples_in_flight=4)
        assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["num_running"] == 0
    assert sorted(check_batches(batches, 2, 1)) == list(range(8))
    assert all(len(s.token_ids) == 12 for b in batches for s in b.samples)
    assert stats["samples_paused"] > 0 and stats["samples_paused_now"] == 0


@pytest.mark.parametrize("seed", range(3))
async def test_the_staleness_bound_and_every_task_hold_with_partial_rollouts(ckpts, seed):
    a, b, c = ckpts
    rng = random.Random(seed)
    eta = rng.choice([1, 2, None])
    async with Engine(config(a, B=rng.choice([1, 4]))) as engine:
        batches, stats = await run_slow_consumer(
            engine, tasks(12), k=rng.randint(2, 5), updates=[tensors(b), tensors(c), tensors(a)],
            wait_tokens=rng.randint(0, 12), n=2, params=params(rng.randint(6, 14)), groups_per_batch=2,
            max_staleness=eta, on_update=rng.choice(["continue", "recompute", "abort"]),
            oversample=rng.randint(0, 2))
        assert engine.stats()["kv_blocks_used"] == 0
    assert sorted(check_batches(batches, 2, 2)) == list(range(12))
    if eta is not None:
        assert max(stats["staleness_histogram"]) <= eta
    for s in (s for batch in batches for s in batch.samples):
        assert len(s.token_ids) == len(s.logprobs) == len(s.weight_versions) == len(s.readout_loops)


async def test_closing_with_paused_samples_frees_every_block(ckpts):
    a, _, _ = ckpts
    async with Engine(config(a)) as engine:
        async with Collector(engine, tasks(10), n=2, params=params(20), groups_per_batch=1, max_staleness=None,
                             max_samples_in_flight=4, max_tokens_per_round=2) as collector:
            await collector.__anext__()
            seen = engine.stats()["tokens_generated"]
            await until(lambda: engine.stats()["tokens_generated"] > seen + 16)  # groups 2 and 3 run on
            await collector.__anext__()  # this hand-over pauses the long samples in flight
            await until(lambda: collector.stats()["samples_paused_now"] > 0)
        await until(lambda: engine.stats()["num_running"] == engine.stats()["num_waiting"] == 0)
        assert engine.stats()["kv_blocks_used"] == 0


async def test_partial_rollout_options_name_the_rule(ckpts):
    a, _, _ = ckpts
    async with Engine(config(a)) as engine:
        with pytest.raises(ValueError, match="max_tokens_per_round needs max_staleness >= 1"):
            Collector(engine, tasks(2), n=2, params=params(), groups_per_batch=1, max_staleness=0,
                      max_tokens_per_round=4)
        for bad in (0, -3, 2.5, True):
            with pytest.raises(ValueError, match="max_tokens_per_round must be an int >= 1"):
                Collector(engine, tasks(2), n=2, params=params(), groups_per_batch=1, max_tokens_per_round=bad)
    await anyio.lowlevel.checkpoint()
