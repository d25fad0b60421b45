"""Engine: the asyncio (anyio) facade. ``async with Engine(config) as engine: await engine.generate(...)``.

The engine's loop runs in a task it owns (see ourobatch.scheduler.driver for the theory of operation):
``async with`` starts it in a task group entered and left by the same task; hosts that start and stop in
different tasks run ``await engine.serve()`` in a task of their own and call ``await engine.aclose()``.
"""

from __future__ import annotations

import enum
from typing import Any, Mapping, Sequence

import anyio
from anyio.abc import TaskGroup, TaskStatus
from tqdm.auto import tqdm

from ourobatch.scheduler.driver import AsyncDriver, RequestStream
from ourobatch.scheduler.errors import EngineClosedError, EngineDeadError
from ourobatch.scheduler.frontend import EngineCore
from ourobatch.scheduler.outputs import RequestOutput
from ourobatch.scheduler.params import RequestOutputKind, SamplingParams

from ._core import build_engine_core
from .config import EngineConfig, batch_arguments, resolve_config

ParamsLike = SamplingParams | Mapping[str, Any] | None


class _State(enum.IntEnum):
    NEW = 0
    STARTING = 1
    RUNNING = 2
    CLOSED = 3


class Engine:
    """The async engine. All methods must be called from the event loop the engine runs in."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.config = resolve_config(config, kwargs)
        self._state = _State.NEW
        self._driver: AsyncDriver | None = None
        self._task_group: TaskGroup | None = None
        self._stopped: anyio.Event | None = None
        self._ready: anyio.Event | None = None
        self._startup_error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "Engine":
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        try:
            await task_group.start(self.serve)
        except BaseException as exc:
            await task_group.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._task_group = task_group
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        await self.aclose()
        task_group, self._task_group = self._task_group, None
        assert task_group is not None
        return await task_group.__aexit__(*exc_info)

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Load the model (on a worker thread) and run the engine until aclose(). Run it once."""
        if self._state != _State.NEW:
            raise RuntimeError("Engine.serve() runs once per engine; make a new Engine to serve again")
        self._state = _State.STARTING
        self._stopped = anyio.Event()
        ready = self._ensure_ready_event()
        try:
            try:
                core = await anyio.to_thread.run_sync(build_engine_core, self.config)
            except BaseException as exc:
                self._startup_error = exc
                raise
            finally:
                ready.set()
            self._driver = AsyncDriver(core)
            self._state = _State.RUNNING
            task_status.started()
            await self._driver.run()
        finally:
            if self._driver is not None and self._driver.is_running:
                self._driver.close()
                self._driver.stop(EngineClosedError("the engine was closed"))  # cancelled host task
            self._state = _State.CLOSED
            self._stopped.set()

    def _ensure_ready_event(self) -> anyio.Event:
        if self._ready is None:
            self._ready = anyio.Event()
        return self._ready

    async def wait_ready(self) -> None:
        """Wait until serve() (running in another task) has loaded the model; re-raises a startup error."""
        if self._state == _State.CLOSED and self._startup_error is None:
            raise EngineClosedError("the engine is closed")
        await self._ensure_ready_event().wait()
        if self._startup_error is not None:
            raise EngineClosedError(f"the engine failed to start: {self._startup_error}") from self._startup_error

    async def aclose(self) -> None:
        """Stop the engine: live requests end with finish_reason 'abort'; later calls raise EngineClosedError."""
        if self._state == _State.NEW:
            self._state = _State.CLOSED
            return
        if self._driver is not None:
            self._driver.close()
        if self._stopped is not None:
            await self._stopped.wait()

    @property
    def driver(self) -> AsyncDriver:
        if self._state == _State.RUNNING and self._driver is not None and self._driver.is_running:
            return self._driver
        if self._driver is not None and self._driver.error is not None:
            raise self._driver.error
        if self._state in (_State.NEW, _State.STARTING):
            raise EngineClosedError("the engine is not started: use `async with Engine(...)` or `await serve()`")
        raise EngineClosedError("the engine is closed")

    @property
    def core(self) -> EngineCore:
        """The running EngineCore (for tests and tools: the executor, the scheduler)."""
        return self.driver.core

    # ------------------------------------------------------------------ requests

    async def generate(self, prompt_token_ids: Sequence[int], params: ParamsLike = None,
                       request_id: str | None = None) -> RequestOutput:
        """Generate for one prompt; return the finished output.

        A request that fails inside the engine returns normally with finish_reason "error" (the message is in
        CompletionOutput.error); EngineDeadError is raised only if the whole engine stops. Cancelling the
        caller aborts the request and frees its KV at once.
        """
        collector = self.driver.add(prompt_token_ids, params, request_id)
        return await self.driver.wait_final(collector)

    def stream(self, prompt_token_ids: Sequence[int], params: ParamsLike = None,
               request_id: str | None = None) -> RequestStream:
        """Queue a request now and return an async iterator of its outputs (SamplingParams.output_kind:
        CUMULATIVE, DELTA or FINAL_ONLY). Bad input raises here, before anything runs.

        Closing the iterator early (``aclose()``, ``async with engine.stream(...) as s``, cancelling the
        consumer, or dropping it after ``break``) aborts the request and frees its KV.
        """
        driver = self.driver
        return driver.open_stream(driver.add(prompt_token_ids, params, request_id))

    async def abort(self, request_id: str) -> bool:
        """Abort a live request (finish_reason 'abort'); returns whether it was live."""
        return self.driver.abort(request_id)

    async def generate_batch(self, prompts: Sequence[Sequence[int]],
                             params: ParamsLike | Sequence[ParamsLike] = None, use_tqdm: bool = False,
                             request_ids: Sequence[str] | None = None) -> list[RequestOutput]:
        """Generate for many prompts concurrently; outputs in the order of `prompts`.

        All prompts are validated and queued first: if one is rejected, none runs and the error is raised.
        """
        driver = self.driver
        collectors = []
        try:
            for prompt, p, request_id in batch_arguments(prompts, params, request_ids):
                collectors.append(driver.add(prompt, p, request_id, kind=RequestOutputKind.FINAL_ONLY))
        except BaseException:
            for c in collectors:
                driver.release(c)
            raise
        results: list[RequestOutput | None] = [None] * len(collectors)
        bar = tqdm(total=len(collectors), desc="generate", unit="req", disable=not use_tqdm)

        async def wait_one(i: int) -> None:
            results[i] = await driver.wait_final(collectors[i])
            bar.update(1)

        try:
            async with anyio.create_task_group() as tg:
                for i in range(len(collectors)):
                    tg.start_soon(wait_one, i)
        finally:
            bar.close()
            for c in collectors:  # on cancellation, every request not yet finished is aborted
                driver.release(c)
        return [r for r in results if r is not None]

    def stats(self) -> dict[str, Any]:
        """Counters: deep_calls, deep_rows, boundaries, shallow_steps, prefill_tokens, kv_blocks_used, ..."""
        return self.driver.stats()


__all__ = ["Engine", "EngineClosedError", "EngineDeadError"]
