"""Shared test doubles for the async engine: a gate that holds engine steps on the worker thread."""

from __future__ import annotations

import threading

import anyio


class GatedExecutor:
    """Wraps an executor. ``hold(after=n)`` lets n more steps run, then holds the next one in flight
    (execute() blocks on the worker thread) until ``allow(k)`` or ``open()``."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self._cond = threading.Condition()
        self._permits: int | None = None  # None: unlimited
        self.entered = threading.Event()  # set while a step is held at the gate
        self.held_plan = None
        self.calls = 0

    def hold(self, after: int = 0) -> None:
        with self._cond:
            self._permits = after
            self.entered.clear()

    def close(self) -> None:
        self.hold(0)

    def allow(self, steps: int) -> None:
        with self._cond:
            self._permits = (self._permits or 0) + steps
            self.entered.clear()
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._permits = None
            self._cond.notify_all()

    async def wait_entered(self) -> None:
        """Wait (off the event loop) until a step is held at the gate; fail loudly instead of hanging."""
        assert await anyio.to_thread.run_sync(self.entered.wait, 30), "no step reached the gate"

    def execute(self, plan):
        with self._cond:
            self.calls += 1
            while self._permits == 0:
                self.held_plan = plan
                self.entered.set()
                assert self._cond.wait(timeout=60), "gate never opened"
            if self._permits is not None:
                self._permits -= 1
        return self.inner.execute(plan)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @classmethod
    def install(cls, engine, hold: int | None = None) -> "GatedExecutor":
        """Put a gate in front of `engine`'s executor (holding the step after `hold` more, if given)."""
        gate = cls(engine.core.executor)
        engine.core.executor = gate
        if hold is not None:
            gate.hold(hold)
        return gate


async def until(predicate, limit: int = 200_000) -> None:
    """Yield to the event loop (and the worker thread) until predicate() holds. No fixed sleeps."""
    for _ in range(limit):
        if predicate():
            return
        await anyio.lowlevel.checkpoint()
        await anyio.to_thread.run_sync(lambda: None)  # let the worker thread make progress
    raise AssertionError("condition never held")


def blocks_in_use(engine) -> int:
    return engine.stats()["kv_blocks_used"]
