"""EnginePool(retry_aborted=...) on a local CPU Ray cluster: what a caller gets when its replica dies
(issue 19, items 3 and 6).

- A retried completion equals a single engine's, whatever output kind the caller reads (CUMULATIVE
  outputs were once appended to the stitched completion, which grew to ~400 tokens for max_tokens=30).
- An abort the caller made is remembered: a replica that dies before the abort lands does not bring the
  aborted completion back; it ends with finish_reason "abort" and its partial output.

To make "the abort did not land" certain, the replica's process is stopped (SIGSTOP) before the abort and
killed (SIGKILL) after it: a stopped process reads nothing, so the abort is lost with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import pytest
import pytest_asyncio
import ray
import torch

from ourobatch.ray import EnginePool, ReplicaDiedError
from ourobatch.testing import make_tiny_checkpoint
from tests.ray_pool_helpers import (LIMIT, MID_FLIGHT, assert_same, config, drain, first_delta, freeze, join_deltas,
                                    reference, sp, until_restarted)

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("ray")]  # one local Ray at a time
PROMPT = [20, 19, 18, 17, 16]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ray_retry") / "m", seed=5, eos_token_id=None)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(ckpt):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the replicas run: the references' arithmetic is theirs
    pool = EnginePool(config(ckpt, "interval1"), num_replicas=2, ready_timeout_s=LIMIT, control_timeout_s=LIMIT)
    try:
        await asyncio.wait_for(pool.start(), 2 * LIMIT)
        yield pool
    finally:
        torch.set_num_threads(threads)
        await asyncio.wait_for(pool.aclose(), LIMIT)
        ray.shutdown()


@pytest_asyncio.fixture(loop_scope="module")
async def fresh(pool):
    """The module's pool with both replicas ready and retry_aborted off again after the test."""
    await pool.wait_ready(LIMIT)
    try:
        yield pool
    finally:
        pool.retry_aborted = False
        await pool.wait_ready(LIMIT)


def pid_of(pool: EnginePool, index: int) -> int:
    return pool.stats()["replicas"][index]["pid"]


async def kill_mid_flight(pool: EnginePool, request_id: str) -> None:
    """Freeze the request's replica (pause "keep": provably mid-flight), then kill it."""
    index = pool.replica_of(request_id)
    await freeze(pool, index)
    ray.kill(pool.actors[index], no_restart=False)


async def until(condition) -> None:
    """Poll the pool's own state (no Ray call) until `condition()` holds, at most LIMIT seconds."""
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(poll(), LIMIT)


def assert_no_longer_than(outs, max_tokens: int) -> None:
    for out in outs:
        for c in out.outputs:
            assert len(c.token_ids) <= max_tokens and len(c.logprobs) == len(c.token_ids) == len(c.readout_loops)


# ---------------------------------------------------------------------- item 3: stitching across a retry

@pytest.mark.asyncio(loop_scope="module")
async def test_retried_cumulative_stream_equals_one_engine(fresh, ckpt):
    pool = fresh
    pool.retry_aborted = True
    greedy = sp(MID_FLIGHT, seed=5, temperature=0.0, n=2, logprobs=2)  # CUMULATIVE, the default kind
    stream = pool.stream(PROMPT, greedy, request_id="cum")
    outs = [await first_delta(stream)]
    await kill_mid_flight(pool, "cum")
    outs += await asyncio.wait_for(drain(stream), LIMIT)
    (want,) = reference(config(ckpt, "interval1"), [PROMPT], [greedy], ["cum"])
    assert_no_longer_than(outs, MID_FLIGHT)
    for a, b in zip(outs, outs[1:]):  # each cumulative output extends the one before
        assert all(y.token_ids[:len(x.token_ids)] == x.token_ids for x, y in zip(a.outputs, b.outputs))
    assert_same(outs[-1], want)  # token for token, log-probs, top log-probs, readout loops, finish_reason
    assert pool.stats()["requests_retried"] >= 1


@pytest.mark.asyncio(loop_scope="module")
async def test_retried_generate_with_default_params_equals_one_engine(fresh, ckpt):
    pool = fresh
    pool.retry_aborted = True
    params = sp(30, seed=6, temperature=0.0)
    for index in (0, 1):
        await freeze(pool, index)  # the request waits on its replica (admission paused) with no tokens yet
    task = asyncio.ensure_future(pool.generate(PROMPT, params, request_id="gen"))
    await until(lambda: pool.replica_of("gen") is not None)  # a few event-loop turns: _add, placement
    index = pool.replica_of("gen")
    ray.kill(pool.actors[index], no_restart=False)
    await asyncio.wait_for(pool.actors[1 - index].call.remote("resume"), LIMIT)  # where the retry runs
    got = await asyncio.wait_for(task, LIMIT)
    (want,) = reference(config(ckpt, "interval1"), [PROMPT], [params], ["gen"])
    assert_same(got, want)


@pytest.mark.asyncio(loop_scope="module")
async def test_retried_delta_stream_joins_to_one_engine(fresh, ckpt):
    pool = fresh
    pool.retry_aborted = True
    params = sp(MID_FLIGHT, seed=7, temperature=0.0, output_kind="DELTA")
    stream = pool.stream(PROMPT, params, request_id="delta")
    outs = [await first_delta(stream)]
    await kill_mid_flight(pool, "delta")
    outs += await asyncio.wait_for(drain(stream), LIMIT)
    (want,) = reference(config(ckpt, "interval1"), [PROMPT], [params], ["delta"])
    assert_same(join_deltas(outs), want)


# ---------------------------------------------------------------------- item 6: aborts are remembered

async def abort_then_die(pool: EnginePool, request_id: str) -> None:
    """Abort `request_id` while its replica's process is stopped, then kill the process: the abort never
    reaches the engine. The replica is frozen first (pause "keep"), so the request is mid-flight."""
    index = pool.replica_of(request_id.split(":")[0])
    await freeze(pool, index)
    pid = pid_of(pool, index)
    os.kill(pid, signal.SIGSTOP)
    try:
        assert await pool.abort(request_id)
    finally:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("retry", [True, False])
async def test_abort_lost_with_its_replica_still_ends_the_request(fresh, ckpt, retry):
    pool = fresh
    pool.retry_aborted = retry
    params = sp(MID_FLIGHT, seed=8, temperature=0.0, output_kind="DELTA")
    stream = pool.stream(PROMPT, params, request_id=f"ab{retry}")
    outs = [await first_delta(stream)]
    await abort_then_die(pool, f"ab{retry}")
    outs += await asyncio.wait_for(drain(stream), LIMIT)  # no ReplicaDiedError: the caller had aborted
    final = join_deltas(outs)
    (want,) = reference(config(ckpt, "interval1"), [PROMPT], [params], ["x"])
    (c,), (w,) = final.outputs, want.outputs
    assert c.finish_reason == "abort" and final.finished
    assert 1 <= len(c.token_ids) < MID_FLIGHT and c.token_ids == w.token_ids[:len(c.token_ids)]  # its partial output
    assert not await pool.abort(f"ab{retry}")


@pytest.mark.asyncio(loop_scope="module")
async def test_abort_of_one_completion_is_remembered_the_other_is_retried(fresh, ckpt):
    pool = fresh
    pool.retry_aborted = True
    params = sp(MID_FLIGHT, seed=9, temperature=0.0, n=2, output_kind="DELTA")
    stream = pool.stream(PROMPT, params, request_id="half")
    outs = [await first_delta(stream)]
    await abort_then_die(pool, "half:1")
    outs += await asyncio.wait_for(drain(stream), LIMIT)
    final = join_deltas(outs)
    (want,) = reference(config(ckpt, "interval1"), [PROMPT], [params], ["half"])
    kept, aborted = final.outputs
    assert (kept.finish_reason, aborted.finish_reason) == ("length", "abort")
    assert_same(dataclasses.replace(final, outputs=[kept]), dataclasses.replace(want, outputs=want.outputs[:1]))
    assert (aborted.token_ids == want.outputs[1].token_ids[:len(aborted.token_ids)]
            and len(aborted.token_ids) < MID_FLIGHT)


@pytest.mark.asyncio(loop_scope="module")
async def test_without_retry_a_death_still_raises_replica_died(fresh):
    pool = fresh
    stream = pool.stream(PROMPT, sp(MID_FLIGHT, seed=10, output_kind="DELTA"), request_id="plain")
    await first_delta(stream)
    await kill_mid_flight(pool, "plain")
    with pytest.raises(ReplicaDiedError):
        await asyncio.wait_for(drain(stream), LIMIT)


# ---------------------------------------------------------------------- weights: a continuation never mixes them
# (last in the file: they change the pool's weights, which the tests above compare with version 0)

async def continue_after_update(pool: EnginePool, ckpt, tmp_path, request_id: str, pool_pause: str | None):
    """A greedy request loses its replica; the weights change before its continuation runs on the other
    replica (paused meanwhile: by the pool in `pool_pause` mode, else directly on the actor)."""
    from safetensors.torch import load_file

    pool.retry_aborted = True
    params = sp(MID_FLIGHT, seed=11, temperature=0.0, output_kind="DELTA")
    stream = pool.stream(PROMPT, params, request_id=request_id)
    outs = [await first_delta(stream)]
    index = pool.replica_of(request_id)
    if pool_pause is None:
        await freeze(pool, index)
        await asyncio.wait_for(pool.actors[1 - index].call.remote("pause", "wait"), LIMIT)
    else:
        await asyncio.wait_for(pool.pause(pool_pause), LIMIT)
    ray.kill(pool.actors[index], no_restart=False)
    await until(lambda: pool.replica_of(request_id) not in (None, index))  # its continuation is queued there
    new = make_tiny_checkpoint(tmp_path / "new", seed=6, eos_token_id=None)
    version = await asyncio.wait_for(pool.update_weights(sorted(load_file(str(new / "model.safetensors")).items())),
                                     LIMIT)
    if pool_pause is None:
        await asyncio.wait_for(pool.actors[1 - index].call.remote("resume"), LIMIT)
    else:
        await asyncio.wait_for(pool.resume(), LIMIT)
    outs += await asyncio.wait_for(drain(stream), LIMIT)
    (want,) = reference(config(ckpt, "interval1"), [PROMPT], [params], [request_id])
    return join_deltas(outs).outputs[0], want.outputs[0], version


@pytest.mark.asyncio(loop_scope="module")
async def test_continuation_after_a_weight_update_ends_aborted_on_the_old_weights(fresh, ckpt, tmp_path):
    got, want, version = await continue_after_update(fresh, ckpt, tmp_path, "mix", pool_pause=None)
    assert got.finish_reason == "abort" and 1 <= len(got.token_ids) < MID_FLIGHT
    assert got.token_ids == want.token_ids[:len(got.token_ids)]
    assert got.weight_versions == [version - 1] * len(got.token_ids)  # nothing from the new weights
    await asyncio.wait_for(fresh.load_weights(ckpt), LIMIT)


@pytest.mark.asyncio(loop_scope="module")
async def test_continuation_under_pause_keep_continues_on_the_new_weights(fresh, ckpt, tmp_path):
    got, want, version = await continue_after_update(fresh, ckpt, tmp_path, "keep", pool_pause="keep")
    assert got.finish_reason == "length" and len(got.token_ids) == MID_FLIGHT
    have = got.weight_versions.count(version - 1)
    assert have >= 1 and got.weight_versions == [version - 1] * have + [version] * (MID_FLIGHT - have)
    assert got.token_ids[:have] == want.token_ids[:have]
    await asyncio.wait_for(fresh.load_weights(ckpt), LIMIT)


@pytest.mark.asyncio(loop_scope="module")
async def test_replica_restarted_after_sleep2_and_wake_up_is_missing_its_weights_too(fresh, ckpt):
    """After sleep(2) + wake_up no replica holds weights until a full load: one restarted meanwhile (from its
    checkpoint) must not serve them either, or requests routed there would run while the others refuse."""
    from scheduler.errors import InconsistentWeightsError

    pool = fresh
    await asyncio.wait_for(pool.sleep(2), LIMIT)
    await asyncio.wait_for(pool.wake_up(), LIMIT)
    ray.kill(pool.actors[0], no_restart=False)
    await asyncio.wait_for(until_restarted(pool, 0), 2 * LIMIT)
    for request_id in ("missing0", "missing1"):  # both idle: the first goes to replica 0, the restarted one
        with pytest.raises(InconsistentWeightsError):
            await asyncio.wait_for(pool.generate(PROMPT, sp(5, seed=12), request_id=request_id), LIMIT)
    version = await asyncio.wait_for(pool.load_weights(ckpt), LIMIT)
    got = await asyncio.wait_for(pool.generate_batch([PROMPT, PROMPT], sp(5, seed=12), request_ids=["w0", "w1"]),
                                 LIMIT)
    (want,) = reference(config(ckpt, "interval1"), [PROMPT], [sp(5, seed=12)], ["w0"])
    for g in got:
        assert g.outputs[0].token_ids == want.outputs[0].token_ids
        assert g.outputs[0].weight_versions == [version] * 5


@pytest.mark.asyncio(loop_scope="module")
async def test_with_no_replica_ready_the_pool_answers_as_its_replicas_would(fresh, ckpt):
    """Asleep at level 2 with both replicas restarting, a broadcast reaches nobody: the pool answers from its
    record as each replica would. sleep(1) and a weight update raise EngineAsleepError and change nothing,
    a request raises InconsistentWeightsError at once (it does not wait for a replica), and the replicas
    come back asleep at level 2, so after wake_up none serves until a full load. A sleep(1) that once
    succeeded on nobody made the restarted replicas sleep at level 1 with their checkpoint's weights
    (tests/test_ray_pool_stateful.py found it: a request queued there while the pool held no weights)."""
    from ourobatch.ray.replica import ReplicaState
    from scheduler.errors import EngineAsleepError, InconsistentWeightsError

    pool = fresh
    await asyncio.wait_for(pool.sleep(2), LIMIT)
    for index in (0, 1):
        ray.kill(pool.actors[index], no_restart=False)
    await until(lambda: all(r.state != ReplicaState.READY for r in pool.replicas))  # both seen down
    with pytest.raises(EngineAsleepError, match="asleep at level 2"):
        await asyncio.wait_for(pool.sleep(1), LIMIT)
    with pytest.raises(EngineAsleepError):
        await asyncio.wait_for(pool.load_weights(ckpt), LIMIT)
    with pytest.raises(InconsistentWeightsError):
        await asyncio.wait_for(pool.generate(PROMPT, sp(5, seed=12), request_id="asleep2"), LIMIT)
    await pool.wait_ready(2 * LIMIT)
    assert [r["control_state"] for r in pool.stats()["replicas"]] == ["asleep", "asleep"]  # caught up at level 2
    await asyncio.wait_for(pool.wake_up(), LIMIT)
    assert [r["control_state"] for r in pool.stats()["replicas"]] == ["weights_missing"] * 2
    for request_id in ("woken0", "woken1"):  # both idle: one to each replica, both restarted
        with pytest.raises(InconsistentWeightsError):
            await asyncio.wait_for(pool.generate(PROMPT, sp(5, seed=12), request_id=request_id), LIMIT)
    version = await asyncio.wait_for(pool.load_weights(ckpt), LIMIT)
    out = await asyncio.wait_for(pool.generate(PROMPT, sp(5, seed=12), request_id="loaded"), LIMIT)
    assert out.outputs[0].weight_versions == [version] * 5
