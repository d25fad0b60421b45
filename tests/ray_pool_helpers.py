"""What the Ray pool's tests share (tests/test_ray_pool.py, tests/test_ray_pool_retry.py): the engine config of
each mode, the single engine whose outputs a pool's must equal (assert_same, join_deltas: log-probs to 1e-9),
and bounded waits on a pool's streams and replicas (a hang fails the test instead of CI)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import pytest

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.ray import EnginePool

LIMIT = 60  # seconds: every wait on the pool is bounded, so a hang fails the test instead of CI
# Tokens of a request a test needs still running after its first delta, when its pause / freeze / kill lands: long
# enough however busy the machine is (two test workers on two cores); 24-40 tokens once finished first.
MID_FLIGHT = 300

MODES = {"deferred4": dict(mode="deferred", deep_interval=4), "eager4": dict(mode="eager", deep_interval=4),
         "verify4": dict(mode="verify", deep_interval=4), "interval1": dict(deep_interval=1)}


def config(ckpt, mode: str, **kw) -> EngineConfig:
    return EngineConfig(model=str(ckpt), dtype="float64", block_size=4, num_kv_blocks=512, max_model_len=512,
                        **MODES[mode], **kw)


def sp(max_tokens=12, seed=0, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True, **kw)


APPROX = ("logprobs", "cumulative_logprob", "top_logprobs")  # float64 sums: equal to 1e-9, not bit for bit


def assert_same(got, want, ignore: tuple[str, ...] = ()) -> None:
    """Pool output == single-engine output in every CompletionOutput field but `ignore` (log-probs to 1e-9)."""
    assert (got.request_id, got.prompt_token_ids, got.finished) == (want.request_id, want.prompt_token_ids,
                                                                    want.finished)
    assert len(got.outputs) == len(want.outputs)
    for a, b in zip(got.outputs, want.outputs):
        for f in dataclasses.fields(b):
            if f.name in ignore:
                continue
            x, y = getattr(a, f.name), getattr(b, f.name)
            if f.name == "top_logprobs" and y is not None:
                assert [t.keys() for t in x] == [t.keys() for t in y]
                x, y = [v for t in x for v in t.values()], [v for t in y for v in t.values()]
            if f.name in APPROX and y is not None:
                assert x == pytest.approx(y, abs=1e-9), f.name
            else:
                assert x == y, f.name


def join_deltas(deltas):
    """The last DELTA output with each per-token field (token_ids, logprobs, readout_loops, ...) replaced by
    the concatenation of all the deltas' (so it should equal the cumulative output)."""
    joined = copy.deepcopy(deltas[-1])
    for c in joined.outputs:
        parts = [o.outputs[c.index] for o in deltas]
        for f in dataclasses.fields(c):
            if isinstance(getattr(c, f.name), list):
                setattr(c, f.name, [x for part in parts for x in getattr(part, f.name)])
    return joined


def reference(cfg: EngineConfig, prompts, params, request_ids):
    with SyncEngine(cfg) as llm:
        return llm.generate_batch(prompts, params, request_ids=request_ids)


async def freeze(pool: EnginePool, index: int) -> None:
    """Pause one replica with its requests kept (Engine.pause("keep")): they stay in flight."""
    await asyncio.wait_for(pool.actors[index].call.remote("pause", "keep"), LIMIT)


async def first_delta(stream):
    return await asyncio.wait_for(stream.__anext__(), LIMIT)


async def drain(stream) -> list:
    outs = []
    async for out in stream:
        outs.append(out)
    return outs


async def until_restarted(pool: EnginePool, index: int) -> None:
    """Wait until the pool has seen replica `index` die and come back (its monitor notices at once)."""
    restarts = pool.replicas[index].restarts
    while pool.replicas[index].restarts == restarts:
        await pool._changed.wait()
    await pool.wait_ready(LIMIT)
