"""ourobatch.ray on a local CPU Ray cluster: a 2-replica EnginePool gives a single engine's outputs in every
mode, survives a killed replica (named error or retry, restart, catch-up), and fans weight updates out.

One ray.init for the module and one pool at a time (`pools` keeps the last one open for the next test):
a pool's startup (two worker processes importing torch) is most of this file's time. The parts that need no
cluster (the facade, the router, summed stats): tests/test_ray_pool_routing.py; helpers: tests/ray_pool_helpers.py.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import pytest_asyncio
import ray
import torch

from ourobatch import Engine, SyncEngine
from ourobatch.ray import EnginePool, ReplicaDiedError
from scheduler.errors import EngineBusyError, EngineDeadError, RequestRejectedError
from ourobatch.testing import make_tiny_checkpoint
from tests.ray_pool_helpers import (LIMIT, MID_FLIGHT, MODES, assert_same, config, drain, first_delta, freeze,
                                    join_deltas, reference, sp, until_restarted)

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("ray")]  # one local Ray at a time


# ---------------------------------------------------------------------- the pool's broadcast methods (no Ray)

def test_every_broadcast_method_is_an_async_method_of_the_engine_and_the_pool():
    """EngineActor.call awaits Engine.<method> by name and EnginePool offers the same call: neither looks
    the method up first, so both classes must have every one, as a coroutine function."""
    import inspect

    from ourobatch.ray.actor import BROADCAST_METHODS

    for name in BROADCAST_METHODS:
        assert inspect.iscoroutinefunction(getattr(Engine, name, None)), f"Engine.{name}"
        assert inspect.iscoroutinefunction(getattr(EnginePool, name, None)), f"EnginePool.{name}"


# ---------------------------------------------------------------------- the pool on Ray

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ray") / "m", seed=5, eos_token_id=None)


class Pools:
    """One open pool at a time, keyed by mode: consecutive tests of a mode share it."""

    def __init__(self, ckpt) -> None:
        self.ckpt, self.mode, self.pool = ckpt, None, None

    async def get(self, mode: str) -> EnginePool:
        if self.mode != mode:
            await self.close()
            self.pool = EnginePool(config(self.ckpt, mode), num_replicas=2, ready_timeout_s=LIMIT,
                                   control_timeout_s=LIMIT)
            await asyncio.wait_for(self.pool.start(), 2 * LIMIT)
            self.mode = mode
        return self.pool

    async def close(self) -> None:
        if self.pool is not None:
            await asyncio.wait_for(self.pool.aclose(), LIMIT)
        self.pool = self.mode = None


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pools(ckpt):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    # The replicas run one torch thread each (Ray's default for a 1-CPU actor); so do the references here,
    # which keeps them fast on a busy 2-core machine and makes their arithmetic the replicas' own.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    holder = Pools(ckpt)
    try:
        yield holder
    finally:
        torch.set_num_threads(threads)
        await holder.close()
        ray.shutdown()


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10, 11], [12, 13], [14, 15, 16, 17, 18], [19]]


def mixed_params():
    return [sp(14, seed=11, temperature=0.9), sp(10, seed=12, n=3, temperature=1.0, logprobs=2),
            sp(9, seed=13, temperature=0.0), sp(16, seed=14, n=2, top_k=5), sp(7, seed=15, min_p=0.1)]


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("mode", list(MODES))
async def test_pool_outputs_equal_a_single_engine(pools, ckpt, mode):
    pool = await pools.get(mode)
    params, ids = mixed_params(), [f"g{i}" for i in range(len(PROMPTS))]
    unseeded_params = {"max_tokens": 6, "ignore_eos": True}
    with SyncEngine(config(ckpt, mode)) as llm:  # the references: one engine, same requests
        want_unseeded = llm.generate_batch(PROMPTS[:3], unseeded_params, request_ids=["u0", "u1", "u2"])
        want = llm.generate_batch(PROMPTS, params, request_ids=ids)
    # Unseeded requests get the seeds a fresh Engine would give them, in add order.
    unseeded = await asyncio.wait_for(pool.generate_batch(PROMPTS[:3], unseeded_params,
                                                          request_ids=["u0", "u1", "u2"]), LIMIT)
    for got, w in zip(unseeded, want_unseeded):
        assert_same(got, w)
    got = await asyncio.wait_for(asyncio.gather(*(pool.generate(p, q, request_id=i)
                                                  for p, q, i in zip(PROMPTS, params, ids))), LIMIT)
    for g, w in zip(got, want):
        assert_same(g, w)

    async def read(i: int, kind: str):
        outs = []
        async with pool.stream(PROMPTS[i], dataclasses.replace(params[i], output_kind=kind), request_id=ids[i]) as s:
            async for out in s:
                outs.append(out)
        return outs

    deltas, cumulative = await asyncio.wait_for(asyncio.gather(read(1, "DELTA"), read(3, "CUMULATIVE")), LIMIT)
    assert_same(join_deltas(deltas), want[1])
    assert_same(cumulative[-1], want[3])
    assert cumulative[-1].finished and all(not o.finished for o in cumulative[:-1])
    stats = pool.stats()
    assert [r["requests_routed"] > 0 for r in stats["replicas"]] == [True, True]  # both replicas served
    assert stats["num_replicas_ready"] == 2 and stats["requests_added"] == sum(
        r["requests_added"] for r in stats["replicas"])
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["tokens_generated"] > 0


@pytest.mark.asyncio(loop_scope="module")
async def test_pool_outputs_carry_prompt_logprobs_as_a_single_engine_does(pools, ckpt):
    pool = await pools.get("interval1")
    params = sp(4, seed=3, prompt_logprobs=2, n=2)
    with SyncEngine(config(ckpt, "interval1")) as llm:
        want = llm.generate(PROMPTS[1], params).prompt_logprobs
    got = await asyncio.wait_for(pool.generate(PROMPTS[1], params), LIMIT)
    assert want is not None and want[0] is None and len(want) == len(PROMPTS[1])
    assert [None if d is None else list(d) for d in got.prompt_logprobs] == [
        None if d is None else list(d) for d in want]
    assert [d[k].logprob for d in got.prompt_logprobs[1:] for k in d] == pytest.approx(
        [d[k].logprob for d in want[1:] for k in d], abs=1e-9)
    async with pool.stream(PROMPTS[1], dataclasses.replace(params, output_kind="DELTA")) as s:
        carried = [out.prompt_logprobs is not None async for out in s]
    assert sum(carried) == 1  # a DELTA stream carries them once


@pytest.mark.asyncio(loop_scope="module")
async def test_killed_replica_fails_its_requests_others_complete_and_it_comes_back(pools, ckpt):
    pool = await pools.get("interval1")
    cfg = config(ckpt, "interval1")
    # Both replicas idle: the first request goes to replica 0, the next one to the less loaded replica 1.
    doomed = pool.stream([21, 22, 23, 24, 25], sp(MID_FLIGHT, seed=1, output_kind="DELTA"), request_id="doomed")
    await first_delta(doomed)
    other = pool.stream([26, 27, 28, 29, 30], sp(30, seed=2), request_id="other")
    await first_delta(other)
    assert (pool.replica_of("doomed"), pool.replica_of("other")) == (0, 1)
    before = pool.stats()
    await freeze(pool, 0)  # "doomed" is provably mid-flight when its replica dies
    ray.kill(pool.actors[0], no_restart=False)
    with pytest.raises(ReplicaDiedError, match="replica 0 died") as err:
        await asyncio.wait_for(drain(doomed), LIMIT)
    assert isinstance(err.value, EngineDeadError)  # code that handles a dead Engine handles this too
    (want,) = reference(cfg, [[26, 27, 28, 29, 30]], [sp(30, seed=2)], ["other"])
    assert_same((await asyncio.wait_for(drain(other), LIMIT))[-1], want)

    await pool.wait_ready(LIMIT)  # Ray restarted the actor; the pool re-armed it
    stats = pool.stats()
    assert [r["restarts"] - b["restarts"] for r, b in zip(stats["replicas"], before["replicas"])] == [1, 0]
    assert stats["requests_failed_replica_died"] == before["requests_failed_replica_died"] + 1
    routed = stats["replicas"][0]["requests_routed"]
    prompts, params = [[3, 1, 4, 1], [5, 9, 2, 6]], [sp(20, seed=3), sp(20, seed=4)]
    got = await asyncio.wait_for(pool.generate_batch(prompts, params, request_ids=["a", "b"]), LIMIT)
    for g, w in zip(got, reference(cfg, prompts, params, ["a", "b"])):
        assert_same(g, w)
    assert pool.stats()["replicas"][0]["requests_routed"] == routed + 1  # the restarted replica serves again


@pytest.mark.asyncio(loop_scope="module")
async def test_retry_aborted_continues_killed_requests_on_another_replica(pools, ckpt):
    pool = await pools.get("interval1")
    cfg = config(ckpt, "interval1")
    pool.retry_aborted = True  # for requests added from now on
    try:
        prompt = [20, 19, 18, 17, 16]
        greedy = sp(MID_FLIGHT, seed=5, temperature=0.0, n=2, output_kind="DELTA")
        doomed = pool.stream(prompt, greedy, request_id="greedy")
        first = await first_delta(doomed)
        sampled = pool.stream([15, 14, 13, 12, 11], sp(30, seed=6, output_kind="DELTA"), request_id="sampled")
        await first_delta(sampled)
        assert (pool.replica_of("greedy"), pool.replica_of("sampled")) == (0, 1)
        stats0 = pool.stats()
        await freeze(pool, 0)
        ray.kill(pool.actors[0], no_restart=False)
        outs = await asyncio.wait_for(drain(doomed), LIMIT)
        await asyncio.wait_for(drain(sampled), LIMIT)
    finally:
        pool.retry_aborted = False
    (want,) = reference(cfg, [prompt], [greedy], ["greedy"])
    # Greedy at full depth: continuing from prompt + the tokens already produced gives the same completion,
    # stitched in every field (tokens, log-probs, readout loops, weight versions, counters, seeds).
    assert_same(join_deltas([first] + outs), want)
    assert pool.stats()["requests_retried"] == stats0["requests_retried"] + 1
    await pool.wait_ready(LIMIT)
    assert pool.stats()["replicas"][0]["restarts"] == stats0["replicas"][0]["restarts"] + 1


@pytest.mark.asyncio(loop_scope="module")
async def test_abort_and_broadcast_reset_prefix_cache(pools):
    pool = await pools.get("interval1")
    stream = pool.stream([2, 7, 1, 8], sp(MID_FLIGHT, seed=7, n=2, output_kind="DELTA"), request_id="ab")
    await first_delta(stream)
    index = pool.replica_of("ab")
    await freeze(pool, index)  # so the aborts find it running
    assert await pool.abort("ab:1") and not await pool.abort("ab:2") and not await pool.abort("nope")
    assert await pool.abort("ab")
    final = (await asyncio.wait_for(drain(stream), LIMIT))[-1]
    assert [c.finish_reason for c in final.outputs] == ["abort", "abort"]
    await asyncio.wait_for(pool.actors[index].call.remote("resume"), LIMIT)
    assert pool.stats()["prefix_cache_blocks"] > 0
    assert await asyncio.wait_for(pool.reset_prefix_cache(), LIMIT) > 0  # summed over the replicas
    assert pool.stats()["prefix_cache_blocks"] == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_bad_input_raises_the_engines_errors_and_no_replica_goes_down(pools):
    pool = await pools.get("interval1")
    failed = pool.stats()["requests_failed_replica_died"]
    with pytest.raises(RequestRejectedError, match="exceeds max_model_len=512"):
        pool.stream([1] * 500, sp(100))  # at the call, like Engine.stream
    with pytest.raises(RequestRejectedError, match="n=300 exceeds max_num_seqs=256"):
        await pool.generate([1], sp(3, n=300))
    with pytest.raises(ValueError, match="unknown SamplingParams field"):
        await pool.generate([1], {"max_token": 3})
    with pytest.raises(ValueError, match="outside the vocabulary"):  # only the replica knows: its own error
        await asyncio.wait_for(pool.generate([99], sp(3)), LIMIT)
    stats = pool.stats()
    assert stats["num_replicas_ready"] == 2 and stats["requests_failed_replica_died"] == failed


@pytest.mark.asyncio(loop_scope="module")
async def test_pause_sleep_wake_up_resume_and_abort_all_broadcast(pools, ckpt):
    pool = await pools.get("interval1")
    prompts, params = [[4, 6, 8, 10], [5, 7, 9, 11]], [sp(MID_FLIGHT, seed=21), sp(MID_FLIGHT, seed=22, n=2)]
    streams = [pool.stream(p, q, request_id=f"k{i}") for i, (p, q) in enumerate(zip(prompts, params))]
    await asyncio.wait_for(asyncio.gather(*(first_delta(s) for s in streams)), LIMIT)
    assert {pool.replica_of("k0"), pool.replica_of("k1")} == {0, 1}
    await asyncio.wait_for(pool.pause("keep"), LIMIT)
    stats = pool.stats()
    assert pool.is_paused and [r["is_paused"] for r in stats["replicas"]] == [True, True]
    assert stats["num_running"] == 3  # kept: frozen with their KV
    await asyncio.wait_for(pool.sleep(1), LIMIT)
    assert pool.is_sleeping and [r["is_sleeping"] for r in pool.stats()["replicas"]] == [True, True]
    await asyncio.wait_for(pool.wake_up(), LIMIT)
    await asyncio.wait_for(pool.resume(), LIMIT)
    assert not pool.is_paused and not pool.is_sleeping
    finals = [(await asyncio.wait_for(drain(s), LIMIT))[-1] for s in streams]
    for got, want in zip(finals, reference(config(ckpt, "interval1"), prompts, params, ["k0", "k1"])):
        # kept requests lost their KV to sleep and were recomputed (one preemption each): same outputs
        assert_same(got, want, ignore=("num_preemptions",))
        assert [c.num_preemptions for c in got.outputs] == [1] * len(got.outputs)
    # abort_all: every replica's live requests end now; their partial outputs come back, all replicas' together
    streams = [pool.stream(p, sp(MID_FLIGHT, seed=23), request_id=f"z{i}") for i, p in enumerate(prompts)]
    await asyncio.wait_for(asyncio.gather(*(first_delta(s) for s in streams)), LIMIT)
    await asyncio.wait_for(pool.pause("keep"), LIMIT)
    aborted = await asyncio.wait_for(pool.abort_all(), LIMIT)
    await asyncio.wait_for(pool.resume(), LIMIT)
    assert sorted(o.request_id for o in aborted) == ["z0", "z1"]
    for s in streams:
        assert (await asyncio.wait_for(drain(s), LIMIT))[-1].outputs[0].finish_reason == "abort"


@pytest.mark.asyncio(loop_scope="module")
async def test_a_sleep_one_replica_refuses_leaves_no_replica_asleep(pools):
    # one replica is busy (refuses sleep, as an engine with running requests does), the other idle: the idle
    # one must not stay asleep while the pool records it awake (its next request would never run)
    pool = await pools.get("interval1")
    stream = pool.stream([4, 6, 8, 10], sp(MID_FLIGHT, seed=31), request_id="busy")
    await asyncio.wait_for(first_delta(stream), LIMIT)
    with pytest.raises(EngineBusyError):
        await asyncio.wait_for(pool.sleep(1), LIMIT)
    assert not pool.is_sleeping and [r["is_sleeping"] for r in pool.stats()["replicas"]] == [False, False]
    out = await asyncio.wait_for(pool.generate([7, 7, 7], sp(4, seed=32)), LIMIT)  # either replica serves it
    assert out.outputs[0].finish_reason == "length"
    assert await asyncio.wait_for(pool.abort("busy"), LIMIT)
    await asyncio.wait_for(drain(stream), LIMIT)


def needs_engine_method(name: str):
    return pytest.mark.skipif(not callable(getattr(Engine, name, None)),
                              reason=f"Engine.{name} does not exist yet (the RL-contract work adds it)")


@needs_engine_method("update_weights")
@needs_engine_method("load_weights")
@pytest.mark.asyncio(loop_scope="module")
async def test_weight_updates_fan_out_and_a_restarted_replica_catches_up(pools, ckpt, tmp_path):
    from safetensors.torch import load_file

    pool = await pools.get("interval1")
    new = make_tiny_checkpoint(tmp_path / "new", seed=6, eos_token_id=None)
    prompts, params, ids = [[6, 2, 8, 3], [1, 8, 5, 3]], [sp(15, seed=8), sp(15, seed=9, n=2)], ["w0", "w1"]

    async def check(model, version: int) -> None:
        """Both replicas serve (one request each) what a fresh engine on `model` gives."""
        routed = [r["requests_routed"] for r in pool.stats()["replicas"]]
        got = await asyncio.wait_for(pool.generate_batch(prompts, params, request_ids=ids), LIMIT)
        for g, w in zip(got, reference(config(model, "interval1"), prompts, params, ids)):
            assert_same(g, w, ignore=("weight_version", "weight_versions"))  # a fresh engine is at version 0
            assert {c.weight_version for c in g.outputs} == {version}
            assert all(c.weight_versions == [version] * len(c.token_ids) for c in g.outputs)
        assert [r["requests_routed"] for r in pool.stats()["replicas"]] == [routed[0] + 1, routed[1] + 1]

    tensors = sorted(load_file(str(new / "model.safetensors")).items())
    assert await asyncio.wait_for(pool.update_weights(tensors), LIMIT) == 1
    assert [r["weight_version"] for r in pool.stats()["replicas"]] == [1, 1]
    await check(new, 1)
    # A replica that restarts loads the old checkpoint; the pool replays the update before it serves.
    ray.kill(pool.actors[1], no_restart=False)
    await asyncio.wait_for(until_restarted(pool, 1), 2 * LIMIT)
    assert [r["weight_version"] for r in pool.stats()["replicas"]] == [1, 1]
    await check(new, 1)
    assert await asyncio.wait_for(pool.load_weights(ckpt, version=7), LIMIT) == 7
    await check(ckpt, 7)


@pytest.mark.asyncio(loop_scope="module")
async def test_rollout_benchmark_runs_its_workload_through_a_pool(pools, tmp_path):
    """benchmarks/rollout.py --replicas 2: streams, per-completion aborts and stats through the pool."""
    import json

    from tests.benchmark_scripts import load_benchmark

    await pools.close()  # the benchmark's pool needs the cluster's 2 CPUs
    rollout = load_benchmark("rollout")
    argv = ["--device", "cpu", "--dtype", "float32", "--tiny", "--prompts", "3", "--n", "2", "--prompt-len", "6",
            "--max-tokens", "12", "--median", "5", "--configs", "interval1", "--allocations", "lazy",
            "--replicas", "2", "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "ckpt")]
    assert await asyncio.wait_for(asyncio.to_thread(rollout.main, argv), 4 * LIMIT) == 0
    (row,) = json.loads((tmp_path / "out" / "rollout.json").read_text())["rows"]
    args = type("A", (), dict(prompts=3, n=2, prompt_len=6, sigma=0.9, max_tokens=12))
    _, lengths = rollout.workload(args, vocab=97, seed=0, median=5)
    assert row["tokens"] == sum(map(sum, lengths))  # every sample stopped at its drawn length


@pytest.mark.asyncio(loop_scope="module")
async def test_ray_pool_example(pools, capsys):
    import ast
    import importlib.util
    from pathlib import Path

    await pools.close()
    path = Path(__file__).resolve().parents[1] / "examples" / "ray_pool.py"
    spec = importlib.util.spec_from_file_location("ourobatch_example_ray_pool", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    await asyncio.wait_for(example.main(), 2 * LIMIT)  # on this module's Ray (the script inits its own)
    out = capsys.readouterr().out
    assert out.count("prompt [") == 8
    # a DELTA stream's consumer gets everything since its last read, so a consumer that lags (a loaded
    # machine) gets fewer, larger deltas: count the streamed tokens, not the deltas
    deltas = [ast.literal_eval(line.split("stream delta:", 1)[1].strip()) for line in out.splitlines()
              if line.startswith("stream delta:")]
    assert 1 <= len(deltas) <= 8 and sum(len(d) for d in deltas) == 8 and all(deltas)
    assert "pool: 2/2 replicas ready, tokens_generated=200 (replica 0: " in out
