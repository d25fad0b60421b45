"""Issue 10 items 2, 3, 5, 7, 8: engine lifecycle, memory release, error shapes, finalizers, ids, logging."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref

import anyio
import pytest

from ourobatch import (CheckpointError, Engine, EngineClosedError, EngineConfig, EngineDeadError, SamplingParams,
                       SyncEngine)
from engine import loader
from ourobatch.testing import make_tiny_checkpoint

from .helpers import GatedExecutor, until


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("life") / "m", seed=4, eos_token_id=None)


def config(ckpt, **kw) -> EngineConfig:
    base = dict(model=str(ckpt), dtype="float64", mode="deferred", deep_interval=2, block_size=4,
                num_kv_blocks=64, max_model_len=128)
    base.update(kw)
    return EngineConfig(**base)


def sp(max_tokens=6, seed=0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True)


# ---------------------------------------------------------------- 2: aclose() while serve() is loading

class _GatedReader:
    """The loader's StagedReader, whose tensors are handed out one at a time: the first waits (the loader thread
    held at tensor 1) until the test releases it."""

    def __init__(self, real):
        self.real = real
        self.entered = threading.Event()
        self.release = threading.Event()
        self.tensors_read = 0

    def __call__(self, *args, **kwargs):
        gate, reader = self, self.real(*args, **kwargs)

        class Wrapped:
            def __enter__(self):
                reader.__enter__()
                return self

            def __exit__(self, *exc):
                return reader.__exit__(*exc)

            @property
            def read_s(self):
                return reader.read_s

            def read_file(self, file, spans):
                for item in reader.read_file(file, spans):
                    gate.entered.set()
                    assert gate.release.wait(30), "the test never released the loader"
                    gate.tensors_read += 1
                    yield item

        return Wrapped()


@pytest.mark.asyncio
async def test_aclose_while_serve_is_loading_stops_the_load_promptly(ckpt, monkeypatch):
    gate = _GatedReader(loader.StagedReader)
    monkeypatch.setattr(loader, "StagedReader", gate)
    engine = Engine(config(ckpt))
    served = []

    async def host():
        await engine.serve()
        served.append("returned")

    with anyio.fail_after(30):  # before the fix aclose() waited forever
        async with anyio.create_task_group() as tg:
            tg.start_soon(host)
            assert await anyio.to_thread.run_sync(gate.entered.wait, 30)  # the loader holds tensor 1

            async def closer():
                await engine.aclose()

            tg.start_soon(closer)
            await until(lambda: engine._cancel_startup.is_set())
            gate.release.set()
    assert served == ["returned"]
    num_tensors = len(loader.expected_shapes(loader.OuroConfig.from_checkpoint(ckpt)))
    assert gate.tensors_read <= 2 < num_tensors  # stopped at the next tensor, not after the whole load
    with pytest.raises(EngineClosedError):
        await engine.generate([1], sp())
    with pytest.raises(EngineClosedError):
        await engine.wait_ready()


# ---------------------------------------------------------------- 3: closing frees the weights and the pool

def _refs(executor):
    return weakref.ref(executor.model), weakref.ref(executor.pool.k), weakref.ref(executor.retained_rows)


@pytest.mark.asyncio
async def test_async_engine_frees_model_and_pool_when_it_closes(ckpt):
    gc.collect()
    gc.disable()  # freed by close() itself, not by some later automatic collection
    try:
        async with Engine(config(ckpt)) as engine:
            refs = _refs(engine.core.executor)
            await engine.generate([1, 2], sp())
            async with engine.stream([3], sp(20)) as stream:
                async for _ in stream:
                    break
        assert [r() for r in refs] == [None, None, None]
        assert engine is not None  # the Engine object itself is still referenced by the caller
    finally:
        gc.enable()


@pytest.mark.asyncio
async def test_a_dead_engine_frees_its_model_too(ckpt):
    class Broken:
        def __init__(self, inner):
            self.inner = inner

        def execute(self, plan):
            raise RuntimeError("device lost")

        def close(self):
            self.inner.close()

    async with Engine(config(ckpt)) as engine:
        refs = _refs(engine.core.executor)
        engine.core.executor = Broken(engine.core.executor)
        with pytest.raises(EngineDeadError):
            await engine.generate([1], sp())
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_sync_engine_frees_model_and_pool_on_close(ckpt):
    llm = SyncEngine(config(ckpt))
    refs = _refs(llm.core.executor)
    llm.generate([1, 2], sp())
    llm.close()
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    with pytest.raises(EngineClosedError):
        llm.generate([1], sp())


# ---------------------------------------------------------------- 5: plain errors, never ExceptionGroup

@pytest.mark.asyncio
async def test_async_with_a_bad_checkpoint_raises_checkpoint_error_itself(tmp_path):
    bad = make_tiny_checkpoint(tmp_path / "bad")
    (bad / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):  # not ExceptionGroup[CheckpointError]
        async with Engine(config(bad)):
            pass


@pytest.mark.asyncio
async def test_generate_batch_raises_engine_dead_error_itself(ckpt):
    class Broken:
        def execute(self, plan):
            raise RuntimeError("device lost")

    async with Engine(config(ckpt)) as engine:
        engine.core.executor = Broken()
        with pytest.raises(EngineDeadError, match="device lost"):  # not ExceptionGroup([EngineDeadError] * 4)
            await engine.generate_batch([[1], [2], [3], [4]], sp())


@pytest.mark.asyncio
async def test_an_error_in_the_async_with_body_comes_out_as_itself(ckpt):
    with pytest.raises(KeyError):
        async with Engine(config(ckpt)):
            raise KeyError("mine")


# ---------------------------------------------------------------- 7: a stream collected mid-schedule

@pytest.mark.asyncio
async def test_a_stream_collected_inside_the_scheduler_aborts_between_steps(ckpt):
    async with Engine(config(ckpt, max_num_seqs=4)) as engine:
        core = engine.core
        gate = GatedExecutor(core.executor)
        core.executor = gate
        gate.close()
        keep = [engine.stream([1, 2], sp(8, seed=i)) for i in range(2)]
        await gate.wait_entered()  # step 0 (both prefills) held
        victim = engine.stream([5, 6, 7], sp(8, seed=9))  # WAITING: admitted by the next schedule()
        victim.cycle = victim  # only the cyclic collector can free it
        victim_id = victim.request_id
        del victim
        blocks = core.scheduler.blocks
        real_allocate = blocks.allocate

        def allocate_with_gc(n):  # the cyclic GC runs in the middle of admission
            gc.collect()
            return real_allocate(n)

        blocks.allocate = allocate_with_gc
        gate.open()
        outs = []
        for stream in keep:
            async for out in stream:
                outs.append(out)
        assert engine.driver.is_running, "the engine died"
        assert core.stats()["finished_abort"] == 1 and victim_id not in core.parents
        await until(lambda: engine.stats()["kv_blocks_used"] == 0)
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8


# ---------------------------------------------------------------- the stepping thread and cancellation

@pytest.mark.asyncio
async def test_cancelling_the_host_task_stops_after_the_step_in_flight(ckpt):
    # steps run back to back on the stepping thread; cancelling the task that runs serve() must stop them
    # after the step in flight, not once every request has run to its end (120 tokens here)
    engine = Engine(config(ckpt, max_model_len=256))
    async with anyio.create_task_group() as tg:
        await tg.start(engine.serve)
        stream = engine.stream([1, 2, 3], sp(120))
        await stream.__anext__()
        await until(lambda: engine.driver.num_steps >= 3)
        driver = engine.driver
        tg.cancel_scope.cancel()
    steps_at_cancel = driver.num_steps
    assert steps_at_cancel < 20, steps_at_cancel  # the request would take 120 steps to finish
    out = stream._collector.parent.output()
    assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < 20
    with pytest.raises(EngineClosedError):
        engine.stream([1], sp(2))


# ---------------------------------------------------------------- 8: ids and logging

@pytest.mark.asyncio
async def test_automatic_ids_never_collide_with_a_callers_ids(ckpt):
    async with Engine(config(ckpt)) as engine:
        gate = GatedExecutor(engine.core.executor)
        engine.core.executor = gate
        gate.close()
        mine = [engine.stream([1], sp(), request_id=f"req-{i}") for i in range(3)]
        auto = [engine.stream([2], sp()) for _ in range(3)]  # before the fix: "req-0 is already in use"
        assert len({s.request_id for s in mine + auto}) == 6
        gate.open()
        for s in mine + auto:
            async for _ in s:
                pass


def test_library_logs_nothing_to_a_host_that_configured_nothing(tmp_path):
    # A host with no logging setup: before the fix, Python's last-resort handler printed the library's
    # warnings (a failing step) to stderr. docs/architecture.md: "silent unless the host enables it".
    script = f"""
from ourobatch import SyncEngine, EngineConfig, SamplingParams
from ourobatch.testing import FaultInjector, make_tiny_checkpoint
ckpt = make_tiny_checkpoint({str(tmp_path / 'm')!r})
with SyncEngine(EngineConfig(model=str(ckpt), num_kv_blocks=32)) as llm:
    llm.core.executor.fault_hook = FaultInjector("prefill")
    out = llm.generate([1, 2], SamplingParams(max_tokens=3))
    assert out.outputs[0].finish_reason == "error", out
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    assert "step_phase_failed" not in proc.stderr and proc.stderr.strip() == ""
