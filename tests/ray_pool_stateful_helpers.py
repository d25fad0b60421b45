"""The world of the Ray pool's state machine (tests/test_ray_pool_stateful.py): what its module shares across
examples (Ray's blocking portal, the 2-replica pool, the single-engine references on each checkpoint, the
weight versions installed), the caller that reads one request's outputs, and the check that every live
replica holds no KV once all requests have ended. Every pool call is bounded: a hang fails the test."""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import anyio
import anyio.from_thread
from safetensors.torch import load_file

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.ray import EnginePool
from tests.test_ray_pool_model import Record

LIMIT = 60  # seconds for one pool call; a hang fails the test
REQUEST_LIMIT = 150  # seconds a request may live (it may wait out a pause for the rest of an example)


def config(path) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float64", deep_interval=1, block_size=4, num_kv_blocks=128,
                        max_model_len=48, max_num_seqs=16)


class World:
    """What the module shares across examples: Ray, the portal, the pool, the reference engines."""

    def __init__(self, ckpts: dict[str, Any]) -> None:
        self.ckpts = ckpts
        self.tensors = {k: sorted(load_file(str(p / "model.safetensors")).items()) for k, p in ckpts.items()}
        self.refs = {k: SyncEngine(config(p)) for k, p in ckpts.items()}
        self._cache: dict[Any, Any] = {}
        self.portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self.portal_cm.__enter__()
        self.pool = EnginePool(config(ckpts["a"]), num_replicas=2, ready_timeout_s=LIMIT, control_timeout_s=LIMIT)
        self.call(self.pool.start, limit=3 * LIMIT)
        self.ckpt_of = {0: "a"}  # weight version -> checkpoint
        self.ambiguous: set[int] = set()  # versions a refused update may have installed on some replica
        self.ids = itertools.count()  # request ids, unique across examples (a failed one may leave some live)
        self.failures: list[str] = []
        self.killed: dict[int, int] = {}  # replica -> its restarts when killed, until the pool notices

    def call(self, fn, *args: Any, limit: float = LIMIT) -> Any:
        async def bounded() -> Any:
            with anyio.fail_after(limit):
                result = fn(*args)
                return await result if hasattr(result, "__await__") else result
        return self.portal.call(bounded)

    def reference(self, ckpt: str, prompt: list[int], params: SamplingParams):
        key = (ckpt, tuple(prompt), repr(dataclasses.replace(params, output_kind="FINAL_ONLY")))
        if key not in self._cache:
            self._cache[key] = self.refs[ckpt].generate(prompt, params)
        return self._cache[key]

    def close(self) -> None:
        try:
            self.call(self.pool.aclose)
        finally:
            self.portal_cm.__exit__(None, None, None)
            for llm in self.refs.values():
                llm.close()


async def consume(pool: EnginePool, rec: Record) -> list:
    """The caller: generate's one output, or every output of a stream."""
    with anyio.fail_after(REQUEST_LIMIT):
        if rec.how == "generate":
            return [await pool.generate(rec.prompt, rec.params, request_id=rec.rid)]
        outs = []
        async with pool.stream(rec.prompt, rec.params, request_id=rec.rid) as stream:
            async for out in stream:
                outs.append(out)
        return outs


def assert_no_kv_held(world: World) -> None:
    """Once every request has ended, every live replica frees its blocks (an abort in transit lands soon)."""
    deadline = time.monotonic() + LIMIT
    while True:
        replicas = [r for r in world.call(world.pool.stats)["replicas"] if r["state"] == "ready"]
        held = [(r["replica"], r.get("kv_blocks_used"), r.get("num_running"), r.get("num_waiting"))
                for r in replicas]
        if all(h[1:] == (0, 0, 0) for h in held):
            return
        assert time.monotonic() < deadline, f"KV blocks / requests still held: {held}"
        time.sleep(0.1)

