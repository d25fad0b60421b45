"""Issue 19: one regression test per control-path defect (items 1, 2, 4, 5, 7, 10, 12), each written to
fail on the code before the control state got one owner (ourobatch/runtime/control.py).

Interleavings are forced with hooks, never sleeps: GatedExecutor holds a step in flight on the worker
thread; SyncEngine tests run a control call from inside a step's hook, between two steps.
References are independent of the path under test: a plain engine run with the same seeds.
"""

from __future__ import annotations

import contextlib
import math
import threading

import anyio
import pytest

from ourobatch import (
    Engine,
    EngineAsleepError,
    EngineBusyError,
    EngineClosedError,
    EngineDeadError,
    InconsistentWeightsError,
    SamplingParams,
    SyncEngine,
)
from ourobatch.testing import make_tiny_checkpoint

from .helpers import GatedExecutor, until
from .test_rl_control import config, tensors_of  # the same float64 engine and checkpoint tensors

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ctl")
    return (make_tiny_checkpoint(root / "a", seed=3, eos_token_id=None),
            make_tiny_checkpoint(root / "b", seed=4, eos_token_id=None))


def sp(seed, max_tokens=12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)


def reference(ckpt, prompt, params, mode="deferred", B=4):
    with SyncEngine(config(ckpt, mode, B)) as llm:
        return llm.generate(prompt, params).outputs[0]


async def drain(stream):
    last = None
    async for out in stream:
        last = out
    return last.outputs[0]


# ---------------------------------------------------------------------- item 1: served from unloaded weights


@pytest.mark.asyncio
async def test_kept_requests_never_decode_from_weights_dropped_by_sleep_level_2(ckpts):
    a, _ = ckpts
    # full depth: a kept request recomputed after the reload continues exactly as if never stopped
    ref = reference(a, [1, 2, 3], sp(1, 16), B=1)
    async with Engine(config(a, B=1)) as engine:
        gate = GatedExecutor(engine.core.executor)
        engine.core.executor = gate
        gate.hold(4)
        kept = engine.stream([1, 2, 3], sp(1, 16))
        await gate.wait_entered()
        gate.open()
        await engine.pause("keep")
        queued = engine.stream([4, 5], sp(2, 6))  # queues while paused
        await engine.sleep(2)
        with pytest.raises(InconsistentWeightsError):
            await engine.generate([6], sp(3))  # weights are gone: refused, not queued
        await engine.wake_up()
        with pytest.raises(InconsistentWeightsError):
            await engine.resume()  # nothing may run on the zero-filled buffers wake_up allocated
        with pytest.raises(InconsistentWeightsError):
            await engine.score([1, 2], [3])
        steps = engine.stats()["engine_steps"]
        await anyio.lowlevel.checkpoint()
        assert engine.stats()["engine_steps"] == steps
        await engine.load_weights(a)
        await engine.resume()
        out, late = await drain(kept), await drain(queued)
    assert out.token_ids == ref.token_ids  # recomputed under the reloaded weights: exact
    assert all(abs(lp + math.log(256)) > 1e-6 for lp in out.logprobs)
    assert late.weight_versions == [1] * 6 and late.finish_reason == "length"


@pytest.mark.asyncio
async def test_an_idle_engine_refuses_work_while_its_weights_are_dropped(ckpts):
    a, _ = ckpts
    async with Engine(config(a)) as engine:
        await engine.sleep(2)
        with pytest.raises(InconsistentWeightsError):
            await engine.generate([1, 2], sp(0))
        await engine.wake_up()
        with pytest.raises(InconsistentWeightsError):
            await engine.generate([1, 2], sp(0))
        await engine.update_weights(tensors_of(a).items(), version=5)
        out = (await engine.generate([1, 2], sp(0))).outputs[0]
    assert out.weight_versions == [5] * 12 and out.token_ids == reference(a, [1, 2], sp(0)).token_ids


# ---------------------------------------------------------------------- item 2: preemption with a step in flight


@pytest.mark.asyncio
@pytest.mark.parametrize("mode,B", [("deferred", 4), ("verify", 3)])
async def test_resume_with_recompute_on_a_running_engine_never_preempts_mid_step(ckpts, mode, B):
    a, _ = ckpts
    ref = reference(a, [1, 2, 3], sp(7, 20), mode, B)
    async with Engine(config(a, mode, B)) as engine:
        gate = GatedExecutor(engine.core.executor)
        engine.core.executor = gate
        gate.hold(3)
        stream = engine.stream([1, 2, 3], sp(7, 20))
        await gate.wait_entered()  # a step is in flight
        await engine.resume(recompute_kv=True)  # not paused: nothing is kept, nothing to recompute
        gate.open()
        out = await drain(stream)
        assert engine.stats()["kv_blocks_used"] == 0
    assert out.token_ids == ref.token_ids and out.finish_reason == "length"


# ---------------------------------------------------------------------- item 4: pause() waits forever


class _Breaks:
    """An executor that breaks its contract (raises) on the step after `after` steps."""

    def __init__(self, inner, after: int) -> None:
        self.inner, self.left = inner, after

    def execute(self, plan):
        if self.left == 0:
            raise RuntimeError("executor bug")
        self.left -= 1
        return self.inner.execute(plan)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.asyncio
@pytest.mark.parametrize("end", ["close", "death"])
async def test_pause_returns_when_the_engine_closes_or_dies_meanwhile(ckpts, end):
    a, _ = ckpts
    engine = Engine(config(a))
    async with anyio.create_task_group() as tg:
        await tg.start(engine.serve)
        gate = GatedExecutor(engine.core.executor if end == "close" else _Breaks(engine.core.executor, 2))
        engine.core.executor = gate
        gate.hold(1)

        async def generate():
            with pytest.raises(EngineDeadError) if end == "death" else contextlib.nullcontext():
                await engine.generate([1, 2, 3], sp(0, 40))

        tg.start_soon(generate)
        await gate.wait_entered()
        outcome: list[BaseException | None] = []

        async def pauser():
            try:
                await engine.pause("wait")  # waits for the running request, which never finishes
                outcome.append(None)
            except (EngineClosedError, EngineDeadError) as exc:
                outcome.append(exc)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as inner:
                inner.start_soon(pauser)
                await anyio.lowlevel.checkpoint()
                if end == "close":
                    inner.start_soon(engine.aclose)
                gate.open()
        tg.cancel_scope.cancel()
    expected = EngineClosedError if end == "close" else EngineDeadError
    assert len(outcome) == 1 and isinstance(outcome[0], expected)


# ---------------------------------------------------------------------- items 5 and 12: SyncEngine waits forever


def _run_in_thread(fn):
    box: dict[str, object] = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def test_close_releases_generate_calls_waiting_on_a_pause(ckpts):
    a, _ = ckpts
    llm = SyncEngine(config(a))
    paused = threading.Event()
    core, step = llm.core, llm.core.step
    calls = [0]

    def step_then_pause():  # runs on the generating thread, between two steps, holding the lock
        out = step()
        calls[0] += 1
        if calls[0] == 3:
            llm.pause("keep")
            paused.set()
        return out

    core.step = step_then_pause
    t, box = _run_in_thread(lambda: llm.generate([1, 2, 3], sp(0, 40)))
    assert paused.wait(30)
    llm.close()  # takes the lock once the generating thread waits for a resume
    t.join(30)
    assert not t.is_alive(), "generate() still waits after close()"
    out = box["value"].outputs[0]
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 40


@pytest.mark.parametrize("control,error", [(lambda llm: llm.pause("keep"), EngineBusyError),
                                           (lambda llm: llm.pause("abort"), EngineBusyError),
                                           (lambda llm: llm.sleep(1), EngineAsleepError),
                                           (lambda llm: llm.sleep(2), EngineAsleepError)])
def test_sync_generate_on_a_stopped_engine_raises_instead_of_waiting_forever(ckpts, control, error):
    a, _ = ckpts
    llm = SyncEngine(config(a))
    control(llm)
    t, box = _run_in_thread(lambda: llm.generate([1, 2], sp(0)))
    t.join(30)
    assert not t.is_alive(), "generate() on the only thread waits forever"
    assert isinstance(box.get("error"), error), box
    assert "resume()" in str(box["error"]) or "wake_up()" in str(box["error"]) or "load" in str(box["error"])
    llm.close()


# ---------------------------------------------------------------------- item 7: "wait" ignores preempted requests


@pytest.mark.asyncio
async def test_pause_wait_finishes_requests_preempted_for_room_under_the_old_weights(ckpts):
    a, b = ckpts
    # 12 blocks of 4: three requests of 3 + 30 tokens cannot all grow, so the newest are preempted
    async with Engine(config(a, num_kv_blocks=12, max_model_len=40)) as engine:
        gate = GatedExecutor(engine.core.executor)
        engine.core.executor = gate
        gate.hold(0)
        streams = [engine.stream([1 + i, 2, 3], sp(i, 30)) for i in range(3)]
        sched = engine.core.scheduler
        while not (sched.counters.preemptions and sched.num_started_waiting):
            gate.allow(1)
            await until(lambda: gate.entered.is_set())
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.pause, "wait")
            gate.open()
        assert engine.stats()["num_waiting"] == 0 and engine.stats()["num_running"] == 0
        await engine.update_weights(tensors_of(b).items())
        await engine.resume()
        outs = [await drain(s) for s in streams]
    assert all(o.finish_reason == "length" and o.weight_versions == [0] * 30 for o in outs)
    assert any(o.num_preemptions for o in outs)


# ---------------------------------------------------------------------- item 10: weight_version at admission


@pytest.mark.asyncio
async def test_weight_version_is_the_version_a_request_was_admitted_under(ckpts):
    a, b = ckpts
    async with Engine(config(a)) as engine:
        await engine.pause("abort")
        async with anyio.create_task_group() as tg:
            results = []

            async def run():
                results.append(await engine.generate([1, 2], sp(0, 5)))

            tg.start_soon(run)
            await until(lambda: engine.stats()["num_waiting"] == 1)
            await engine.update_weights(tensors_of(b).items(), version=7)
            await engine.resume()
    c = results[0].outputs[0]
    assert c.weight_versions == [7] * 5 and c.weight_version == 7


@pytest.mark.asyncio
async def test_a_cancelled_pause_caller_leaves_the_pause_standing(ckpts):
    a, _ = ckpts
    async with Engine(config(a)) as engine:
        gate = GatedExecutor.install(engine, hold=2)
        running = engine.stream([1, 2, 3], sp(1, 8))
        await gate.wait_entered()  # a step is in flight: pause("wait") cannot complete yet
        with anyio.CancelScope() as scope:
            scope.cancel()  # the caller gives up at its first wait
            await engine.pause("wait")
        assert scope.cancelled_caught
        assert engine.stats()["control_state"] == "pausing"
        queued = engine.stream([4, 5], sp(2, 4))
        gate.open()
        out = await drain(running)  # "wait": the admitted request runs to its end
        assert out.finish_reason == "length"
        await until(lambda: engine.stats()["control_state"] == "paused")  # with nobody waiting on pause()
        assert engine.stats()["num_waiting"] == 1  # the new one is not admitted before resume()
        await engine.resume()
        assert (await drain(queued)).finish_reason == "length"
