"""Engine: the asyncio (anyio) facade. ``async with Engine(config) as engine: await engine.generate(...)``.

The engine's loop runs in a task it owns (see ourobatch.runtime.driver for the theory of operation):
``async with`` starts it in a task group entered and left by the same task; hosts that start and stop in
different tasks run ``await engine.serve()`` in a task of their own and call ``await engine.aclose()``.
"""

from __future__ import annotations

import enum
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import anyio
from anyio.abc import TaskGroup, TaskStatus
from tqdm.auto import tqdm

from ourobatch.runtime.driver import AsyncDriver
from ourobatch.runtime.streams import RequestStream
from scheduler.errors import EngineClosedError, EngineDeadError
from ourobatch.runtime.engine_core import EngineCore
from ourobatch.outputs import RequestOutput
from scheduler.params import RequestOutputKind, SamplingParams

from . import _control
from .assembly import build_engine_core
from .config import EngineConfig, batch_arguments, resolve_config

ParamsLike = SamplingParams | Mapping[str, Any] | None


class _State(enum.IntEnum):
    NEW = 0
    STARTING = 1
    CLOSING = 2  # aclose() during startup: the load stops at its next tensor
    RUNNING = 3
    CLOSED = 4


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
        self._cancel_startup = threading.Event()

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "Engine":
        # Load before entering the task group, so a startup error (a bad checkpoint) reaches the caller
        # as itself, not wrapped in an ExceptionGroup.
        if not await self._start():
            raise EngineClosedError("the engine was closed while starting")
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        task_group.start_soon(self._run)
        self._task_group = task_group
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        task_group, self._task_group = self._task_group, None
        assert task_group is not None
        with anyio.CancelScope(shield=True):  # leaving the block always closes (at most one step's wait)
            await self.aclose()
        # The loop task has ended: leave the group without the body's exception, so that exception
        # propagates as itself instead of inside an ExceptionGroup.
        await task_group.__aexit__(None, None, None)

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Load the model (on a worker thread) and run the engine until aclose(). Run it once.

        aclose() while the model is still loading stops the load at the next tensor and returns."""
        if await self._start():
            task_status.started()
            await self._run()

    async def _start(self) -> bool:
        """Build the engine core on a worker thread; False if aclose() stopped the startup."""
        if self._state != _State.NEW:
            raise RuntimeError("Engine.serve() runs once per engine; make a new Engine to serve again")
        self._state = _State.STARTING
        self._stopped = anyio.Event()
        ready = self._ensure_ready_event()
        cancel = self._cancel_startup
        try:
            # abandon_on_cancel: a cancelled host task does not wait for the load; `cancel` (set in the
            # finally) makes the worker stop at its next tensor and drop what it allocated.
            core = await anyio.to_thread.run_sync(build_engine_core, self.config, None, cancel.is_set,
                                                  abandon_on_cancel=True)
        except BaseException as exc:
            cancel.set()
            closed = isinstance(exc, EngineClosedError) and self._state == _State.CLOSING
            if not closed and isinstance(exc, Exception):  # a cancelled host task is not a startup error
                self._startup_error = exc
            self._state = _State.CLOSED
            ready.set()
            self._stopped.set()
            if closed:
                return False
            raise
        if self._state == _State.CLOSING:  # aclose() came after the last tensor was loaded
            core.close()
            self._state = _State.CLOSED
            ready.set()
            self._stopped.set()
            return False
        self._driver = AsyncDriver(core)
        self._state = _State.RUNNING
        ready.set()
        return True

    async def _run(self) -> None:
        driver, stopped = self._driver, self._stopped
        assert driver is not None and stopped is not None
        try:
            await driver.run()
        finally:
            if driver.is_running:  # the host task was cancelled
                driver.close()
                driver.stop(EngineClosedError("the engine was closed"))
            driver.release_resources()  # weights, KV pool and graphs go now, not when the Engine is dropped
            self._state = _State.CLOSED
            stopped.set()

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
        if self._state != _State.RUNNING:
            raise EngineClosedError("the engine was closed while starting")

    async def aclose(self) -> None:
        """Stop the engine: live requests end with finish_reason 'abort', the weights, KV pool and CUDA
        graphs are freed; later calls raise EngineClosedError. During startup it stops the load."""
        if self._state == _State.NEW:
            self._state = _State.CLOSED
            return
        if self._state == _State.STARTING:
            self._state = _State.CLOSING
            self._cancel_startup.set()
        if self._driver is not None:
            self._driver.close()
        if self._stopped is not None:
            await self._stopped.wait()

    @property
    def driver(self) -> AsyncDriver:
        if self._state == _State.RUNNING and self._driver is not None and self._driver.is_running:
            return self._driver
        if self._driver is not None and self._driver.error is not None:
            raise self._driver.stopped_error()
        if self._state in (_State.NEW, _State.STARTING, _State.CLOSING):
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
        collector = self.driver.add(prompt_token_ids, params, request_id, kind=RequestOutputKind.FINAL_ONLY)
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

    def check_request(self, prompt_token_ids: Sequence[int], params: ParamsLike = None,
                      request_id: str | None = None) -> None:
        """Raise what generate() / stream() would raise for this request now, queueing nothing (a front end
        checks every prompt of a request before it queues any, so a rejected one leaves no trace)."""
        self.driver.check(prompt_token_ids, params, request_id)

    async def abort(self, request_id: str, *, stop_string: bool = False) -> bool:
        """Abort a live request (finish_reason 'abort'); returns whether it was live. stop_string=True: the
        caller cut the completion at a stop string (it reports finish_reason 'stop' itself, as the server
        does): stats() and /metrics count it as finished by stop, not as aborted."""
        return self.driver.abort(request_id, stop_string)

    async def generate_batch(self, prompts: Sequence[Sequence[int]],
                             params: ParamsLike | Sequence[ParamsLike] = None, use_tqdm: bool = False,
                             request_ids: Sequence[str] | None = None) -> list[RequestOutput]:
        """Generate for many prompts concurrently; outputs in the order of `prompts`.

        All prompts are validated and queued first: if one is rejected, none runs and the error is raised.
        """
        driver = self.driver
        collectors = []
        # Under the driver's lock, so no step plans in between: every prompt is checked before any is queued (a
        # rejected batch queues nothing), and if an add still fails, the earlier ones are released before a step
        # could admit them (all or nothing).
        with driver.lock:
            arguments = list(batch_arguments(prompts, params, request_ids))
            driver.core.check_batch(arguments)
            try:
                for prompt, p, request_id in arguments:
                    collectors.append(driver.add(prompt, p, request_id, kind=RequestOutputKind.FINAL_ONLY))
            except BaseException:
                for c in collectors:
                    driver.release(c)
                raise
        results: list[RequestOutput | None] = [None] * len(collectors)
        errors: list[Exception] = []
        bar = tqdm(total=len(collectors), desc="generate", unit="req", disable=not use_tqdm)

        async def wait_one(i: int, tg: TaskGroup) -> None:
            try:
                results[i] = await driver.wait_final(collectors[i])
            except Exception as exc:  # EngineDeadError: every waiter gets it; raise it once, unwrapped
                errors.append(exc)
                tg.cancel_scope.cancel()
                return
            bar.update(1)

        try:
            async with anyio.create_task_group() as tg:
                for i in range(len(collectors)):
                    tg.start_soon(wait_one, i, tg)
        finally:
            bar.close()
            for c in collectors:  # on cancellation or error, every request not yet finished is aborted
                driver.release(c)
        if errors:
            raise errors[0]
        return [r for r in results if r is not None]

    # ------------------------------------------------------------------ the RL contract
    # Thin: the rules are EngineControl's (ourobatch/runtime/control.py, docs/state_machine.md); executor calls
    # run between steps on the worker thread (AsyncDriver.between_steps, ourobatch/_control.py).

    async def pause(self, mode: str = "abort") -> None:
        """Pause generation; returns once no step runs. Modes (vLLM's): "abort" ends every live request
        now with its partial output (finish_reason "abort"); "wait" admits nobody new and lets every
        admitted request finish (including ones preempted for KV room); "keep" admits nobody and freezes
        running requests with their KV (deferred deep work is flushed first: a forced boundary).
        Requests submitted while paused queue. Raises the engine's error if it closes or dies first."""
        await self.driver.pause(mode)

    async def resume(self, *, recompute_kv: bool = False) -> None:
        """Resume after pause() (cancels a pause in progress; a no-op on a running engine).
        recompute_kv=True re-prefills kept requests (prompt + outputs) so their KV is recomputed under the
        current weights instead of kept. InconsistentWeightsError while weights are missing."""
        self.driver.resume(recompute_kv)

    @property
    def is_paused(self) -> bool:
        return self.stats()["is_paused"]

    async def abort_all(self) -> list[RequestOutput]:
        """Abort every live request; returns their partial outputs (for resubmitting prompt + output later)."""
        return self.driver.abort_all()

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], *, version: int | None = None) -> int:
        """Copy (Hugging Face name, tensor) pairs into the engine's weights in place (a generator of buckets
        is fine; a subset is allowed; each name at most once), between steps. Only while paused or idle
        (EngineBusyError), awake (EngineAsleepError). Returns the new weight_version (default: previous +
        1) and drops the prefix cache. A bad tensor raises WeightUpdateError; if others were already
        copied, nothing runs and new requests get InconsistentWeightsError until an update covering them
        succeeds. A `version` must be above the current one (ValueError)."""
        driver = self.driver
        with driver.lock:
            _control.check_version(version, driver.control.weight_version)
            driver.control.check("update")  # refuse now, before the stepping thread hands back
        return await driver.between_steps(_control.update_weights, driver.core, driver.lock, named_tensors,
                                          version)

    async def load_weights(self, path: str | Path, *, version: int | None = None) -> int:
        """update_weights from a Hugging Face checkpoint folder (model.safetensors or shards + index)."""
        return await self.update_weights(_control.checkpoint_weights(self.driver.core, path), version=version)

    async def sleep(self, level: int = 1) -> None:
        """Give the GPU back: level 1 moves the weights to pinned CPU memory, level 2 drops them (wake_up()
        then needs update_weights / load_weights of every tensor before anything runs); both free the KV
        pool and the CUDA graphs. Only while paused or idle; kept requests lose their KV and are
        recomputed when they run again. A no-op at the level it sleeps at."""
        driver = self.driver
        _control.check_sleep_level(level)
        with driver.lock:
            driver.control.check("sleep", level)
        await driver.between_steps(_control.sleep, driver.core, driver.lock, level)

    async def wake_up(self) -> None:
        """Undo sleep(): weights (level 1), KV pool and buffers back on the device; graphs recapture lazily."""
        driver = self.driver
        await driver.between_steps(_control.wake_up, driver.core, driver.lock)

    @property
    def is_sleeping(self) -> bool:
        return self.stats()["is_sleeping"]

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prompt block (e.g. after changing weights); returns how many were dropped.
        Blocks that running requests hold stay theirs; nothing is dropped mid-step (the driver's lock keeps
        it between the stepping thread's schedule and update)."""
        driver = self.driver
        with driver.lock:
            return driver.core.reset_prefix_cache()

    async def score(self, prompt_token_ids: Sequence[int], completion_token_ids: Sequence[int],
                    readout_loops: Sequence[int] | None = None, params: ParamsLike = None) -> list[float]:
        """No-grad log-prob of each completion token under the engine's current weights, as the engine
        reports them (its logprobs_mode and head_dtype; `params` matter for "processed"): token j from
        loop readout_loops[j-1] (default: loop T, full depth). One dense forward on the engine's worker
        thread, never during a step (ourobatch.training.score); EngineAsleepError while asleep,
        InconsistentWeightsError while weights are missing."""
        driver = self.driver
        with driver.lock:
            driver.control.check("score")
        return await driver.between_steps(_control.score, driver.core, driver.lock, prompt_token_ids,
                                          completion_token_ids, readout_loops, params)

    def stats(self) -> dict[str, Any]:
        """Counters: deep_calls, deep_rows, boundaries, shallow_steps, prefill_tokens, kv_blocks_used, ..."""
        return self.driver.stats()


__all__ = ["Engine", "EngineClosedError", "EngineDeadError"]
