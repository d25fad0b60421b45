"""The asyncio Engine on tiny checkpoints (pytest-asyncio, strict mode)."""

from __future__ import annotations

import asyncio

import anyio
import pytest
import pytest_asyncio

from ourobatch import (
    Engine,
    EngineClosedError,
    EngineConfig,
    EngineDeadError,
    RequestRejectedError,
    SamplingParams,
    SyncEngine,
)
from ourobatch.testing import FaultInjector, make_tiny_checkpoint
from tests.oracle import load_oracle, processed_logprobs, readout_position

from .helpers import GatedExecutor, blocks_in_use, until

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("async") / "m", seed=9, eos_token_id=None)


def config(ckpt, **kw) -> EngineConfig:
    base = dict(model=str(ckpt), dtype="float64", deep_interval=3, block_size=4, num_kv_blocks=128,
                max_model_len=256)
    base.update(kw)
    return EngineConfig(**base)


@pytest_asyncio.fixture
async def engine(ckpt):
    # pytest-asyncio runs fixture setup and teardown in different tasks: the host-task pattern
    # (serve() in a task of its own, aclose() from another) is exactly what such hosts use.
    eng = Engine(config(ckpt))
    host = asyncio.ensure_future(eng.serve())
    await eng.wait_ready()
    yield eng
    await eng.aclose()
    await host


def sp(max_tokens=10, seed=0, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True, **kw)


PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11, 12]]


async def test_concurrent_staggered_generate_equals_sync_and_oracle(ckpt, engine):
    params = [sp(12 + i, seed=100 + i, temperature=0.9) for i in range(len(PROMPTS))]
    results = [None] * len(PROMPTS)

    async def one(i):
        results[i] = await engine.generate(PROMPTS[i], params[i], request_id=f"s{i}")

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            steps = engine.stats()["engine_steps"]
            tg.start_soon(one, i)
            await until(lambda: engine.stats()["engine_steps"] >= steps + i % 3)  # staggered arrivals
    with SyncEngine(config(ckpt)) as llm:
        sync = llm.generate_batch(PROMPTS, params)
    oracle = load_oracle(ckpt)
    for a, s, prompt, p in zip(results, sync, PROMPTS, params):
        ca, cs = a.outputs[0], s.outputs[0]
        assert ca.token_ids == cs.token_ids and ca.readout_loops == cs.readout_loops
        assert ca.logprobs == pytest.approx(cs.logprobs, abs=1e-12)
        out = oracle.forward(prompt + ca.token_ids[:-1])
        for j, (tok, lp, loop) in enumerate(zip(ca.token_ids, ca.logprobs, ca.readout_loops), start=1):
            ref = processed_logprobs(out.logits[loop - 1, readout_position(len(prompt), j)], p.temperature)
            assert abs(lp - float(ref[tok])) < 1e-6
    assert blocks_in_use(engine) == 0


@pytest.mark.parametrize("kind", ["DELTA", "CUMULATIVE", "FINAL_ONLY"])
async def test_stream_kinds(engine, kind):
    final = await engine.generate([3, 1, 4], sp(11, seed=5, n=2))
    outs = [o async for o in engine.stream([3, 1, 4], sp(11, seed=5, n=2, output_kind=kind))]
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    for i in range(2):
        if kind == "DELTA":
            tokens = [t for o in outs for t in o.outputs[i].token_ids]
            logprobs = [lp for o in outs for lp in o.outputs[i].logprobs]
            loops = [lo for o in outs for lo in o.outputs[i].readout_loops]
            assert len(outs) > 1
        else:
            tokens, logprobs = outs[-1].outputs[i].token_ids, outs[-1].outputs[i].logprobs
            loops = outs[-1].outputs[i].readout_loops
        assert tokens == final.outputs[i].token_ids
        assert logprobs == pytest.approx(final.outputs[i].logprobs, abs=1e-12)
        assert loops == final.outputs[i].readout_loops
    if kind == "FINAL_ONLY":
        assert len(outs) == 1
    if kind == "CUMULATIVE":
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths) and len(outs) > 1


async def test_verify_mode_streams_only_verified_tokens(ckpt):
    async with Engine(config(ckpt, mode="verify", deep_interval=4)) as engine:
        params = sp(14, seed=3, temperature=1.0, output_kind="CUMULATIVE")
        seen = []
        async with engine.stream([5, 6], params) as stream:
            async for out in stream:
                seen.append(list(out.outputs[0].token_ids))
        final = seen[-1]
        for earlier in seen:  # a rollback never retracts a token already streamed
            assert final[:len(earlier)] == earlier
        assert len(seen) < 14  # tokens arrive a verified block at a time
        c = (await engine.generate([5, 6], sp(14, seed=3, temperature=1.0))).outputs[0]
        assert c.token_ids == final and c.readout_loops == [4] * 14
        assert c.num_drafted >= c.num_accepted and engine.stats()["drafted_tokens"] >= c.num_drafted


async def test_slow_consumer_gets_coalesced_outputs_and_never_stalls_the_engine(engine):
    stream = engine.stream([2, 2], sp(30, seed=1, output_kind="DELTA"))
    first = await stream.__anext__()
    other = await engine.generate([5], sp(40, seed=2))  # the engine runs on while the stream is not read
    assert other.finished
    rest = [o async for o in stream]
    tokens = first.outputs[0].token_ids + [t for o in rest for t in o.outputs[0].token_ids]
    assert len(tokens) == 30 and len(rest) == 1 and rest[0].finished  # all 29 later tokens in one delta


async def test_generate_callers_wake_once_when_done_not_on_every_step(engine):
    # 8 concurrent generate() calls of 25 tokens: a caller that waits for the end must not be woken on each
    # of the ~25 steps (with 64 callers that cost ~1 ms of event-loop time per step on the H200's host)
    driver, wakes = engine.driver, []
    real_wait = driver._wait

    async def counting_wait(collector):
        await real_wait(collector)
        wakes.append(collector.parent.request_id)

    driver._wait = counting_wait
    try:
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(engine.generate, [3, i + 1], sp(25, seed=i))
    finally:
        del driver._wait
    steps = engine.stats()["engine_steps"]
    assert steps >= 25 and len(wakes) == 8  # one wake per caller: its request ended


async def test_steps_run_back_to_back_without_returning_to_the_event_loop(engine):
    # the stepping thread goes back to the event loop only when the loop must decide something (idle, pause,
    # hold, close, a dropped stream): not once per step, which cost a thread hop per step
    driver, entries = engine.driver, []
    real = driver._step_until_needed

    def counting():
        entries.append(driver.num_steps)
        real()

    driver._step_until_needed = counting
    try:
        before = driver.num_steps
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(engine.generate, [5, i + 2], sp(30, seed=i))
        steps = driver.num_steps - before
    finally:
        del driver._step_until_needed
    assert steps >= 30 and len(entries) <= 3, (steps, entries)


async def test_closing_a_stream_early_aborts_and_frees(engine):
    async with engine.stream([1, 2], sp(60, seed=3)) as stream:
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 4:
                break
    assert blocks_in_use(engine) == 0
    assert engine.stats()["finished_abort"] == 1
    # dropping the iterator after `break` (no explicit close) aborts too: its finalizer queues the abort,
    # which the loop applies before its next step
    steps = engine.stats()["engine_steps"]
    async for out in engine.stream([1, 2], sp(60, seed=3)):
        break
    await until(lambda: engine.stats()["finished_abort"] == 2)
    assert blocks_in_use(engine) == 0 and engine.stats()["engine_steps"] <= steps + 8


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
        others = []
        result = {}

        async def victim():
            result["out"] = await engine.generate([1, 2, 3], sp(40, seed=2), request_id="v")

        async with anyio.create_task_group() as tg:
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


async def test_the_event_loop_admits_and_streams_while_a_step_runs(engine):
    gate = GatedExecutor(engine.core.executor)
    engine.core.executor = gate
    gate.hold(2)
    task = asyncio.ensure_future(engine.generate([1], sp(20, seed=1)))
    await gate.wait_entered()  # a step is now held on the worker thread
    steps = engine.stats()["engine_steps"]
    assert engine.stats()["step_in_flight"]
    late = asyncio.ensure_future(engine.generate([2, 3], sp(5, seed=2), request_id="late"))
    await until(lambda: "late" in engine.core.scheduler.requests)  # admitted while the step runs
    assert await engine.abort("late") and (await late).outputs[0].finish_reason == "abort"
    assert engine.stats()["engine_steps"] == steps  # all of that happened during one step
    gate.open()
    assert (await task).outputs[0].finish_reason == "length"


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


@pytest.mark.parametrize("call,exc,match", [
    (lambda e: e.generate("hello", sp(3)), TypeError, "list of ints"),
    (lambda e: e.generate([1, 2], {"max_tokens": 3, "beam_width": 2}), ValueError, "unknown SamplingParams"),
    (lambda e: e.generate([1, 2], 7), TypeError, "params must be SamplingParams, a dict or None"),
    (lambda e: e.generate([1, 2], sp(3), request_id=5), TypeError, "request_id"),
    (lambda e: e.generate([99], sp(3)), ValueError, "outside the vocabulary"),
    (lambda e: e.generate([1], sp(300)), RequestRejectedError, "max_model_len"),
])
async def test_bad_input_gets_a_clear_error_and_the_engine_keeps_serving(engine, call, exc, match):
    with pytest.raises(exc, match=match):
        await call(engine)
    assert (await engine.generate([1], sp(3))).finished
    assert blocks_in_use(engine) == 0


async def test_duplicate_request_ids_are_rejected(engine):
    gate = GatedExecutor(engine.core.executor)
    engine.core.executor = gate
    gate.close()
    first = asyncio.ensure_future(engine.generate([1], sp(5), request_id="dup"))
    await until(lambda: "dup" in engine.core.scheduler.requests)
    with pytest.raises(ValueError, match="'dup' is already in use"):
        await engine.generate([1], sp(5), request_id="dup")
    gate.open()
    assert (await first).finished
    assert (await engine.generate([1], sp(5), request_id="dup")).finished  # free again once finished


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


async def test_generate_batch_with_progress_bar_and_n(engine, capsys):
    outs = await engine.generate_batch([[1], [2, 3], [4]], {"max_tokens": 6, "n": 2, "seed": 3, "ignore_eos": True},
                                       use_tqdm=True)
    assert [o.prompt_token_ids for o in outs] == [[1], [2, 3], [4]]
    assert all(len(o.outputs) == 2 and all(len(c.token_ids) == 6 for c in o.outputs) for o in outs)
    assert "generate" in capsys.readouterr().err
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await engine.generate_batch([[1], [500]], sp(3))
    assert engine.stats()["num_waiting"] == 0 and blocks_in_use(engine) == 0


async def test_boundary_events_are_logged_and_counted(engine):
    import structlog
    from structlog.testing import capture_logs

    try:
        with capture_logs() as logs:
            await engine.generate_batch([[1], [2]], sp(8, seed=1))
    finally:
        structlog.reset_defaults()
    events = [e["event"] for e in logs]
    assert events.count("deep_boundary") == (8 - 1) // 3
    assert {"request_added", "request_finished"} <= set(events)
    boundary = next(e for e in logs if e["event"] == "deep_boundary")
    assert boundary["rows"] == 2 * 3 and boundary["cohorts"] == [0]
    assert engine.stats()["boundaries"] == (8 - 1) // 3


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
