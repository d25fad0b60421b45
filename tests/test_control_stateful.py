"""Issue 19's stateful test on SyncEngine and the async Engine, each also with async scheduling (a step
planned and launched while the one before it runs; tests/control_machine.py says what it interleaves
and checks), and the async Engine in eager mode (verify, deferred and eager: every mode's step shapes).
Tiny random checkpoints, float32 on the CPU, a KV pool small enough that requests are preempted for room."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import anyio.from_thread
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from ourobatch import Engine, EngineConfig, SyncEngine
from ourobatch.testing import make_tiny_checkpoint

from .control_machine import ControlMachine, stateful_settings, stateful_timeout

pytestmark = pytest.mark.timeout(stateful_timeout())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("stateful")
    return (make_tiny_checkpoint(root / "a", seed=11, eos_token_id=None),
            make_tiny_checkpoint(root / "b", seed=12, eos_token_id=None))


def engine_config(path, mode: str, B: int, async_scheduling: bool = False) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", mode=mode, deep_interval=B, block_size=4,
                        num_kv_blocks=16, max_model_len=32, max_num_seqs=8, async_scheduling=async_scheduling)


class SyncMachine(ControlMachine):
    mode, B = "verify", 3

    def start_engine(self) -> None:
        self.llm = SyncEngine(engine_config(self.a, self.mode, self.B, self.async_scheduling))
        self.core = self.llm.core
        self.control = self.core.control
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=48)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        llm = self.llm
        if method == "generate":
            prompt, params, rid = args
            return self.pool.submit(llm.generate, prompt, params, request_id=rid)
        if method == "abort":  # SyncEngine has no abort(id): its callers abort everything
            return self.pool.submit(llm.abort_all)
        return self.pool.submit(getattr(llm, method), *args, **kwargs)

    def stats(self) -> dict:
        return self.llm.stats()

    def close_engine(self) -> None:
        self.llm.close()
        self.pool.shutdown(wait=True, cancel_futures=True)


class AsyncMachine(ControlMachine):
    mode, B = "deferred", 4

    def start_engine(self) -> None:
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        self.engine = Engine(engine_config(self.a, self.mode, self.B, self.async_scheduling))
        self._serving = self.portal.start_task_soon(self.engine.serve)
        self.portal.call(self.engine.wait_ready)
        self.core = self.engine.core
        self.control = self.core.control

    async def _run(self, method: str, args: tuple, kwargs: dict) -> Any:
        engine = self.engine
        if method == "generate":
            prompt, params, rid = args
            return await engine.generate(prompt, params, rid)
        if method == "close":
            return await engine.aclose()
        return await getattr(engine, method)(*args, **kwargs)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        return self.portal.start_task_soon(self._run, method, args, kwargs)

    def stats(self) -> dict:
        return self.portal.call(self.engine.stats)

    def close_engine(self) -> None:
        try:
            self.portal.call(self.engine.aclose)
            self._serving.result(timeout=60)
        finally:
            self._portal_cm.__exit__(None, None, None)


class AsyncSchedulingSyncMachine(SyncMachine):
    mode, B, async_scheduling = "deferred", 3, True  # verify mode plans nothing ahead


class AsyncSchedulingMachine(AsyncMachine):
    mode, B, async_scheduling = "deferred", 4, True


class EagerMachine(AsyncMachine):
    mode, B = "eager", 3  # deep loops run with every token; a pause("keep") flushes as deferred does


SETTINGS = settings(**stateful_settings(), suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("machine", [SyncMachine, AsyncMachine, AsyncSchedulingSyncMachine, AsyncSchedulingMachine,
                                     EagerMachine],
                         ids=["SyncEngine", "Engine", "SyncEngine-async-scheduling", "Engine-async-scheduling",
                              "Engine-eager"])
def test_control_calls_interleaved_with_steps_in_flight(checkpoints, machine):
    machine.checkpoints, machine.tally = checkpoints, {}
    run_state_machine_as_test(machine, settings=SETTINGS)
    # the machine's checks (tests/control_machine.py) ran to the end of every example it tore down
    assert machine.tally["settled"] == machine.tally["teardowns"] >= 1, machine.tally
