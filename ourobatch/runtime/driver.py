"""The anyio driver: a stepping thread runs EngineCore steps back to back; the event loop admits,
aborts and delivers outputs to per-request collectors. Torch-free.

Theory of operation. Steps run on one worker thread (``anyio.to_thread.run_sync`` behind a
CapacityLimiter of 1), which drives the EngineCore's StepPipeline (``schedule -> execute -> update``,
with async scheduling one step planned and launched ahead of the one being updated: pipeline.py)
without going back to the event loop between steps, as ``SyncEngine`` does: a step never waits for the
event loop to be scheduled, so the async path pays no thread hop per step. One lock guards the
EngineCore: the stepping thread holds it to plan and to update (never while a step runs or is read),
the event loop for ``add``, ``abort``, building outputs, statistics and the RL controls. An abort during
a step frees the request's blocks at once; the step's results for it are ignored, and a step planned
later writes those blocks only after every step launched before it (one device stream, in order).

After each ``update`` the stepping thread queues the requests it touched and writes a byte to a socket
pair; the event loop's delivery task wakes on it and sets the collectors' events (anyio objects are
only ever touched on the event loop). The stepping thread returns to the event loop when there is
nothing to do, when the engine is closing, when the control state (ourobatch/runtime/control.py: a pause, a
maintenance hold for a weight copy, sleep, wake or score) needs the loop's decision, or when a dropped
stream must be released; the loop then decides whether and when to step again. Control calls never
change the scheduler with a step in flight: state changes take effect at once, what they imply for the
scheduler is applied by ``EngineControl.poll()`` at the top of the loop, and executor calls run in
``between_steps``, on the worker thread behind the same limiter as the stepping thread. The stepping
thread drains its pipeline before it hands back, so neither ever sees a step in flight.

Delivery never blocks the engine: each request has one collector holding an Event; a step only sets
it. Consumers build their output from the request's state when they wake, so however slow a consumer
is, what it gets is coalesced (everything since its last read), like vLLM's per-request collector.
"""

from __future__ import annotations

import collections
import socket
import threading
import traceback
from typing import Any, Iterable, Mapping

import anyio

from scheduler.errors import EngineClosedError, EngineDeadError, fresh_error
from .engine_core import EngineCore, ParentRequest
from ourobatch.log import get_logger
from ourobatch.outputs import RequestOutput
from scheduler.params import RequestOutputKind, SamplingParams
from .control import EngineControl
from .cursor import OutputCursor
from .streams import Collector, RequestStream

log = get_logger()


class AsyncDriver:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._collectors: dict[str, Collector] = {}
        self._wakeup = anyio.Event()
        self._limiter = anyio.CapacityLimiter(1)
        self._closing = False
        self._error: BaseException | None = None  # EngineDeadError / EngineClosedError once stopped
        self.step_in_flight = False
        self.num_steps = 0
        self._owner_thread = threading.get_ident()
        self._orphans: collections.deque[Collector] = collections.deque()  # released off-thread
        self.control: EngineControl = core.control
        self.lock = threading.RLock()  # guards the core: the stepping thread and the event loop
        self._touched: collections.deque[ParentRequest] = collections.deque()  # stepped, not yet delivered
        self._bell_rx, self._bell_tx = socket.socketpair()  # the stepping thread rings, the loop wakes
        self._bell_rx.setblocking(False)
        self._bell_tx.setblocking(False)

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Step until close() is called. Never raises for engine errors: callers get EngineDeadError."""
        error: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._deliver_forever)
            try:
                await self._loop()
            except Exception as exc:  # noqa: BLE001 - an engine bug or an executor breaking its contract
                error = exc
            finally:
                tg.cancel_scope.cancel()
        self._deliver()
        if error is None:
            self.stop(EngineClosedError("the engine was closed"))
            return
        log.error("engine_dead", error=f"{type(error).__name__}: {error}")
        dead = EngineDeadError(f"the engine stopped on an unrecoverable error: {type(error).__name__}: {error}")
        # keep the traceback's lines but not its frames' locals (they hold the model and the KV pool)
        traceback.clear_frames(error.__traceback__)
        dead.__cause__ = error
        self.stop(dead)

    async def _loop(self) -> None:
        while not self._closing:
            while self._orphans:  # streams dropped without closing: abort here, between steps
                self.release(self._orphans.popleft())
            with self.lock:
                # paused, asleep, weights missing, a hold, or nothing to do: wait for a wakeup
                wait = not self.control.poll() or self._idle()
            if wait:
                await self._wakeup.wait()
                self._wakeup = anyio.Event()
                continue
            self.step_in_flight = True
            try:
                await self._run_stepping_thread()
            finally:
                self.step_in_flight = False
            self._deliver()
            await anyio.lowlevel.checkpoint()  # let callers run

    async def _run_stepping_thread(self) -> None:
        """Steps on the worker thread until the loop must look. If the task running the loop is cancelled,
        the thread is told to stop after its step in flight, and the cancellation waits for that step
        only (never for every step up to idle)."""
        stopped = threading.Event()

        def steps() -> None:
            try:
                self._step_until_needed()
            finally:
                stopped.set()

        try:
            await anyio.to_thread.run_sync(steps, limiter=self._limiter, abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            self._closing = True  # read by the stepping thread after its step
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(stopped.wait)
            raise

    def _idle(self) -> bool:
        return not self.core.has_unfinished and not self.core.scheduler.has_pending_releases

    def _loop_must_look(self) -> bool:
        """Something only the event loop may decide on: stop stepping and return to it."""
        return self._closing or bool(self._orphans) or self.control.needs_loop or self._idle()

    def _step_until_needed(self) -> None:
        """On the worker thread: run steps back to back until the event loop must look; hand back with
        nothing in flight."""
        pipeline = self.core.pipeline
        try:
            while True:
                touched = pipeline.advance(self.lock, self._may_step, self._may_plan_ahead)
                if touched is None:  # a hold or a pause landed meanwhile
                    return
                self._updated(touched)
                with self.lock:
                    if self._loop_must_look():
                        return
        finally:
            if pipeline.in_flight:
                self._updated(pipeline.drain(self.lock))

    def _may_step(self) -> bool:
        return not self._closing and self.control.may_step

    def _may_plan_ahead(self) -> bool:
        return not self._loop_must_look()

    def _updated(self, touched: list[ParentRequest]) -> None:
        """A step was updated: queue what it touched and ring the event loop."""
        self.num_steps += 1
        self._touched.extend(touched)
        if touched:
            try:
                self._bell_tx.send(b"\0")
            except OSError:  # the buffer is full of rings the loop has not read yet: it will wake
                pass

    async def _deliver_forever(self) -> None:
        while True:
            await anyio.wait_readable(self._bell_rx)
            try:
                while self._bell_rx.recv(4096):
                    pass
            except OSError:  # drained (BlockingIOError)
                pass
            self._deliver()

    def _deliver(self) -> None:
        """Wake the collectors of the requests the stepping thread touched (on the event loop thread)."""
        collectors = self._collectors
        while self._touched:
            collector = collectors.get(self._touched.popleft().request_id)
            if collector is not None:
                collector.on_step()

    def close(self) -> None:
        """Ask the loop to stop after the step in flight (if any)."""
        self._closing = True
        self._wakeup.set()

    def stop(self, error: BaseException) -> None:
        """End the engine: an EngineDeadError fails every live request (its callers get the error); an
        EngineClosedError aborts them. Later calls raise `error`."""
        self._error = error
        with self.lock:
            self.control.close(error)  # pause() callers and every other waiter on a transition wake up
            if isinstance(error, EngineDeadError):
                for parent in self.core.fail_all(str(error)):
                    collector = self._collectors.get(parent.request_id)
                    if collector is not None:
                        collector.killed = True
            else:
                for request_id in list(self.core.parents):
                    self.core.abort(request_id)
        for collector in list(self._collectors.values()):
            collector.notify()

    def release_resources(self) -> None:
        """Free the executor's weights, KV pool and graphs. Call after stop(), with no step in flight."""
        assert self._error is not None and not self.step_in_flight
        if not self.core.is_closed:
            self.core.close()
        self._bell_rx.close()
        self._bell_tx.close()

    @property
    def is_running(self) -> bool:
        return self._error is None

    @property
    def error(self) -> BaseException | None:
        """Why the driver stopped (EngineDeadError or EngineClosedError); None while it runs."""
        return self._error

    def stopped_error(self) -> BaseException:
        """The error to raise to one caller once stopped: a copy of `error` (its type, message and cause).
        Raising the stored object again would grow its traceback with every caller's frames and keep their
        locals alive: an RL worker that retries in a loop would leak."""
        error = self._error
        assert error is not None
        return fresh_error(error)

    def _check_running(self) -> None:
        if self._error is not None:
            raise self.stopped_error()

    def _notify(self, request_id: str) -> None:
        collector = self._collectors.get(request_id)
        if collector is not None:
            collector.notify()

    # ------------------------------------------------------------------ requests

    def check(self, prompt_token_ids: Iterable[int], params: SamplingParams | Mapping[str, Any] | None,
              request_id: str | None = None) -> None:
        """Raise what add() would raise for this request now, queueing nothing."""
        self._check_running()
        with self.lock:
            self.core.check(prompt_token_ids, params, request_id)

    def add(self, prompt_token_ids: Iterable[int], params: SamplingParams | Mapping[str, Any] | None,
            request_id: str | None = None,
            kind: RequestOutputKind | None = None) -> Collector:
        """Validate and queue a request (raises, changing nothing, on bad input); wake the loop. `kind`
        overrides params.output_kind (FINAL_ONLY for callers that only await the end)."""
        self._check_running()
        with self.lock:
            parent = self.core.add(prompt_token_ids, params, request_id)  # checks the id and the state
        kind = kind if kind is not None else parent.params.output_kind
        collector = Collector(parent, OutputCursor(len(parent.children), kind), anyio.Event())
        self._collectors[parent.request_id] = collector
        self._wakeup.set()
        return collector

    def abort(self, request_id: str, stop_string: bool = False) -> bool:
        """Abort a live request; True if it was live. Synchronous, so it works while being cancelled.
        Call it on the event loop thread, never from a finalizer (see defer_release)."""
        with self.lock:  # a parent id, or "{id}:{index}" for one of n completions
            parent = self.core.abort(request_id, stop_string)
        if parent is not None:
            self._notify(parent.request_id)
            self._wakeup.set()  # the next plan releases its engine-side rows
        return parent is not None

    # ------------------------------------------------------------------ pause, resume, worker calls

    async def pause(self, mode: str = "abort") -> None:
        """Pause generation (ourobatch/runtime/control.py: 'abort', 'wait' or 'keep'); returns once paused, or
        raises the engine's error if it closes or dies first."""
        self._check_running()
        done = anyio.Event()
        with self.lock:
            self.control.pause(mode, done.set)  # validates the mode
        if mode == "abort":
            self.abort_all()
        self._wakeup.set()
        await done.wait()
        self._check_running()

    def resume(self, recompute_kv: bool = False) -> None:
        self._check_running()
        with self.lock:
            self.control.resume(recompute_kv)  # the recompute itself runs at the next poll, between steps
        self._wakeup.set()

    def abort_all(self) -> list[RequestOutput]:
        """Abort every live request; returns their partial outputs (tokens, log-probs, readout loops)."""
        outputs = []
        with self.lock:
            for request_id in list(self.core.parents):
                parent = self.core.parents[request_id]
                self.abort(request_id)
                outputs.append(parent.output())
        return outputs

    async def between_steps(self, fn: Any, *args: Any) -> Any:
        """Run fn(*args) on the worker thread with no step in flight and none starting meanwhile (a hold:
        the stepping thread hands back after its step; both share one limiter). fn takes the lock itself
        for what it changes in the core, so the event loop keeps admitting meanwhile."""
        self._check_running()
        with self.lock:
            self.control.holds += 1
        try:
            return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        finally:
            with self.lock:
                self.control.holds -= 1
            self._wakeup.set()

    def defer_release(self, collector: Collector) -> None:
        """release() from a finalizer: the garbage collector may run anywhere (inside schedule(), on
        another thread), so only queue the collector; the loop releases it between steps."""
        self._orphans.append(collector)  # deque.append is atomic

    def release(self, collector: Collector) -> None:
        """The consumer is gone: abort the request if it still runs, drop its collector."""
        if threading.get_ident() != self._owner_thread:
            self.defer_release(collector)
            return
        request_id = collector.parent.request_id
        if self._collectors.get(request_id) is collector:
            del self._collectors[request_id]
        if not collector.parent.finished:
            self.abort(request_id)

    def _raise_if_dead(self, collector: Collector) -> None:
        if collector.killed:
            raise self.stopped_error()

    async def wait_final(self, collector: Collector) -> RequestOutput:
        """The finished output; EngineDeadError if the engine died first."""
        try:
            while not collector.parent.finished:
                await self._wait(collector)
            self._raise_if_dead(collector)
            with self.lock:
                return collector.parent.output()
        finally:
            self.release(collector)

    def open_stream(self, collector: Collector) -> RequestStream:
        return RequestStream(self, collector)

    def _take(self, collector: Collector) -> RequestOutput | None:
        with self.lock:  # a consistent snapshot: the stepping thread appends under the same lock
            return collector.cursor.take(collector.parent)

    async def _wait(self, collector: Collector) -> None:
        if self._error is not None and not collector.parent.finished:
            raise self.stopped_error()
        await collector.event.wait()
        collector.event = anyio.Event()

    def stats(self) -> dict[str, Any]:
        with self.lock:
            stats = self.core.stats()
        stats["engine_steps"] = self.num_steps
        stats["num_streams"] = len(self._collectors)
        stats["step_in_flight"] = self.step_in_flight
        return stats
