"""The asyncio Engine on tiny checkpoints (pytest-asyncio, strict mode) when requests or the engine end early:
a request cancelled or aborted in every scheduler state (a step held in flight on the worker) ends at once
with its blocks freed while everyone else finishes; an injected fault ends exactly the requests of the failed
call; an unrecoverable error fails every pending caller with EngineDeadError; calls before start and after
close, serve() in a host task closed from another; and a soak of thousands of short requests with random
aborts. Generation and streaming: tests/test_async_engine.py."""

from __future__ import annotations

import asyncio
import gc
import traceback
import weakref

import anyio
import pytest

from ourobatch import Engine, EngineClosedError, EngineDeadError, SyncEngine
from ourobatch.testing import FaultInjector
from tests.async_engine_helpers import config, make_ckpt, sp

from .helpers import GatedExecutor, blocks_in_use, until

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_ckpt(tmp_path_factory.mktemp("async_faults"))


async def hold_the_victim_in(status: str, engine: Engine, gate: GatedExecutor) -> list:
    """Hold the engine's steps so that the victim, added next, is held in `status`, starting the other request
    that status needs (WAITING: one running with max_num_seqs=1; ALIGNING: one mid-block): their tasks."""
    others = []
    if status == "WAITING":  # max_num_seqs=1 and a running request keep the victim waiting
        gate.hold(0)
        others.append(asyncio.ensure_future(engine.generate([1], sp(30, seed=1), request_id="o")))
        await gate.wait_entered()
    elif status == "ALIGNING":  # another request mid-block keeps the victim aligning
        gate.hold(2)  # o: prefill, k=1 pass; k=2 is held
        others.append(asyncio.ensure_future(engine.generate([9], sp(30, seed=4), request_id="o")))
        await gate.wait_entered()
    else:
        # PREFILLING: hold the first step; DECODING: prefill and k=1 pass, k=2 held;
        # BOUNDARY: prefill and k=1..3 pass, k=4 (the boundary) held.
        gate.hold({"PREFILLING": 0, "DECODING": 2, "BOUNDARY": 4}[status])
    return others


@pytest.mark.parametrize("status", ["WAITING", "PREFILLING", "ALIGNING", "DECODING", "BOUNDARY"])
@pytest.mark.parametrize("how", ["cancel_scope", "wait_for", "abort"])
async def test_cancel_or_abort_at_every_state(ckpt, status, how):
    """Hold the engine with the victim in `status` (a step held in flight on the worker), then cancel or
    abort it: it ends at once with its blocks freed, and everyone else finishes."""
    B = 4
    cfg = config(ckpt, deep_interval=B, num_kv_blocks=40, max_num_seqs=1 if status == "WAITING" else 8)
    async with Engine(cfg) as engine:
        core = engine.core
        gate = GatedExecutor(core.executor)
        core.executor = gate
        result = {}

        async def victim():
            result["out"] = await engine.generate([1, 2, 3], sp(40, seed=2), request_id="v")

        async with anyio.create_task_group() as tg:
            others = await hold_the_victim_in(status, engine, gate)
            if how == "wait_for":
                task = asyncio.ensure_future(asyncio.wait_for(victim(), timeout=60))
            else:
                tg.start_soon(victim)
            await until(lambda: "v" in core.scheduler.requests)
            if status == "ALIGNING":
                gate.allow(2)  # k=2 finishes, k=3 runs with v's prefill; k=4 is held, v aligning
            if status != "WAITING":
                await gate.wait_entered()
            assert core.scheduler.requests["v"].status.name == ("DECODING" if status == "BOUNDARY" else status)
            if status == "BOUNDARY":
                assert [d.request_id for d in gate.held_plan.deep] == ["v"]
            assert engine.stats()["step_in_flight"] == (status != "WAITING" or True)
            if how == "cancel_scope":
                tg.cancel_scope.cancel()
            elif how == "abort":
                assert await engine.abort("v") is True
            else:
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
        # the request is gone at once, while the held step is still in flight
        assert "v" not in core.scheduler.requests
        live = sum(len(r.block_ids) for r in core.scheduler.requests.values())
        assert blocks_in_use(engine) == live
        gate.open()
        if how == "abort":
            assert result["out"].outputs[0].finish_reason == "abort"
        for other in others:
            assert (await other).outputs[0].finish_reason == "length"
        # its unread retained rows are dropped by the next step
        await until(lambda: not core.has_unfinished and "v" not in gate.inner.retained)
        assert blocks_in_use(engine) == 0
        assert engine.stats()["finished_abort"] == 1


@pytest.mark.parametrize("phase", ["prefill", "shallow", "deep"])
async def test_fault_injection_ends_exactly_the_right_requests(ckpt, phase):
    B = 3
    async with Engine(config(ckpt, deep_interval=B)) as engine:
        core = engine.core
        if phase == "prefill":  # b's prefill (step 2) fails; the a's were prefilled in step 0
            core.executor.fault_hook = FaultInjector("prefill", when=lambda ids: "b" in ids)
        else:  # the first shallow call (step 1) or the first deep call (step 3, the a's boundary)
            core.executor.fault_hook = FaultInjector(phase, calls={0})
        gate = GatedExecutor(core.executor)
        core.executor = gate
        gate.hold(1)
        first = [asyncio.ensure_future(engine.generate([1, i], sp(10, seed=i), request_id=f"a{i}"))
                 for i in range(3)]
        await gate.wait_entered()  # step 1 held: the a's are prefilled and decoding
        tasks = dict(zip(["a0", "a1", "a2"], first))
        if phase == "prefill":
            tasks["b"] = asyncio.ensure_future(engine.generate([2, 2], sp(10, seed=7), request_id="b"))
            await until(lambda: "b" in core.scheduler.requests)
        gate.open()
        victims = {"b"} if phase == "prefill" else {"a0", "a1", "a2"}
        outs = {rid: await t for rid, t in tasks.items()}
        with SyncEngine(config(ckpt, deep_interval=B)) as llm:
            for rid, out in outs.items():
                c = out.outputs[0]
                if rid in victims:
                    assert c.finish_reason == "error" and f"{phase} failed" in c.error
                    assert "injected" in c.error
                else:  # survivors are exactly what an undisturbed engine produces
                    i = int(rid[1])
                    assert c.token_ids == llm.generate([1, i], sp(10, seed=i)).outputs[0].token_ids
            # new requests after the failure run normally (in a new cohort after a deep failure)
            after = await engine.generate([1, 0], sp(10, seed=0))
            assert after.outputs[0].token_ids == llm.generate([1, 0], sp(10, seed=0)).outputs[0].token_ids
        assert blocks_in_use(engine) == 0
        assert engine.stats()["finished_error"] == len(victims)
        assert core.executor.fault_hook.num_raised == 1


async def test_unrecoverable_error_fails_pending_callers_with_engine_dead(ckpt):
    class Broken:
        def execute(self, plan):
            raise RuntimeError("device lost")

    async with Engine(config(ckpt)) as engine:
        gate = GatedExecutor(engine.core.executor)
        engine.core.executor = gate
        gate.close()
        pending = [asyncio.ensure_future(engine.generate([1], sp(5, seed=i))) for i in range(3)]
        stream = engine.stream([2], sp(5, seed=9))
        await gate.wait_entered()
        gate.inner = Broken()
        gate.open()
        for task in pending:
            with pytest.raises(EngineDeadError, match="device lost"):
                await task
        with pytest.raises(EngineDeadError):
            await stream.__anext__()
        with pytest.raises(EngineDeadError):
            await engine.generate([1], sp(3))


async def test_calls_after_close_raise_engine_closed(ckpt):
    engine = Engine(config(ckpt))
    with pytest.raises(EngineClosedError, match="not started"):
        await engine.generate([1], sp(2))
    async with engine:
        pass
    with pytest.raises(EngineClosedError, match="closed"):
        await engine.generate([1], sp(2))
    with pytest.raises(EngineClosedError):
        engine.stream([1], sp(2))


@pytest.mark.parametrize("how", ["closed", "dead"])
async def test_a_stopped_engine_raises_a_fresh_error_to_each_caller(ckpt, how):
    # An RL worker retrying in a loop: the stored error raised again would collect every caller's frames in
    # its traceback and keep their locals alive (issue: 200 retries held 200 MiB).
    class Broken:
        def execute(self, plan):
            raise RuntimeError("device lost")

    class Payload:  # a caller's local, which must die with its frame
        pass

    engine = Engine(config(ckpt))
    async with engine:
        if how == "dead":
            engine.core.executor = Broken()
            with pytest.raises(EngineDeadError):
                await engine.generate([1], sp(2))
    errors, payloads = [], []

    async def retry():
        payload = Payload()
        payloads.append(weakref.ref(payload))
        await engine.generate([1], sp(2))

    for _ in range(20):
        with pytest.raises((EngineClosedError, EngineDeadError)) as info:
            await retry()
        errors.append(info.value)
    assert len({id(e) for e in errors}) == len(errors)
    assert len({len(traceback.extract_tb(e.__traceback__)) for e in errors}) == 1  # no growth
    assert {type(e) for e in errors} == {EngineDeadError if how == "dead" else EngineClosedError}
    assert all(str(e) == str(errors[0]) for e in errors)
    del info, errors
    gc.collect()
    assert [r() for r in payloads] == [None] * 20


async def test_serve_in_a_host_task_and_aclose_from_another(ckpt):
    engine = Engine(config(ckpt))
    async with anyio.create_task_group() as tg:
        await tg.start(engine.serve)
        out = await engine.generate([1, 2], sp(6, seed=1))
        gate = GatedExecutor(engine.core.executor)
        engine.core.executor = gate
        gate.close()
        pending = asyncio.ensure_future(engine.generate([3], sp(50, seed=2)))
        await gate.wait_entered()

        async def closer():
            await engine.aclose()

        tg.start_soon(closer)
        gate.open()
    assert out.finished
    assert (await pending).outputs[0].finish_reason == "abort"  # live requests end on close
    with pytest.raises(RuntimeError, match="runs once"):
        await engine.serve()


async def test_soak_thousands_of_short_requests_with_random_aborts(ckpt):
    import random

    rng = random.Random(0)
    async with Engine(config(ckpt, num_kv_blocks=96, max_num_seqs=64, deep_interval=2)) as engine:
        finished = {}

        async def one(i):
            prompt = [rng.randrange(31) for _ in range(rng.randint(1, 4))]
            stream = engine.stream(prompt, sp(rng.randint(1, 6), seed=i, output_kind="DELTA"),
                                   request_id=f"soak{i}")
            async with stream:
                async for out in stream:
                    if rng.random() < 0.1:
                        break  # early close = abort
                    if out.finished:
                        finished[i] = out.outputs[0].finish_reason

        async with anyio.create_task_group() as tg:
            for i in range(2000):
                tg.start_soon(one, i)
                if i % 50 == 0:
                    await anyio.lowlevel.checkpoint()
            for _ in range(40):  # some aborts by id
                tg.start_soon(engine.abort, f"soak{rng.randrange(2000)}")
        stats = engine.stats()
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert stats["requests_added"] == 2000
        assert stats["finished_length"] + stats["finished_abort"] + stats["finished_stop"] == 2000
        # every consumer ended: with a final output, or by closing its stream early
        assert set(finished.values()) <= {"length", "abort"}
        assert sum(r == "length" for r in finished.values()) <= stats["finished_length"]
        await until(lambda: engine.core.executor.retained == {})  # the last releases run one step later
