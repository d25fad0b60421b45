"""Output streams: OutputStream, the iterate-and-close protocol every stream shares (Engine.stream's
RequestStream here, the Ray pool's PoolStream), and the engine's side of it: a request's Collector and
the RequestStream over it. Torch-free.

RequestStream reads outputs through its AsyncDriver (ourobatch/runtime/driver.py; here only the Reader
protocol, so this module does not import the driver that imports it): ``_take`` builds a coalesced
output under the driver's lock (the collector's OutputCursor: cursor.py), ``_wait`` waits for the
collector's event, ``release`` aborts and forgets the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import anyio

from ourobatch.outputs import RequestOutput
from scheduler.params import RequestOutputKind

from .cursor import OutputCursor
from .engine_core import ParentRequest


@dataclass(eq=False)
class Collector:
    """One request's delivery state on the event loop: what its consumer was given and its wake-up."""

    parent: ParentRequest
    cursor: OutputCursor  # what the consumer has been given (its output kind: cursor.kind)
    event: anyio.Event
    killed: bool = False  # ended by the engine dying: the consumer gets EngineDeadError

    def notify(self) -> None:
        self.event.set()

    def on_step(self) -> None:
        """A step touched the request: wake the consumer, unless it waits only for the end (FINAL_ONLY:
        generate(), generate_batch()), so 64 waiting callers do not all wake on every step."""
        if self.cursor.kind != RequestOutputKind.FINAL_ONLY or self.parent.finished:
            self.event.set()

    def pending(self) -> bool:
        return self.cursor.pending(self.parent)


class Reader(Protocol):
    """What a RequestStream reads its collector through: the AsyncDriver."""

    def _raise_if_dead(self, collector: Collector) -> None: ...

    def _take(self, collector: Collector) -> RequestOutput | None: ...

    async def _wait(self, collector: Collector) -> None: ...

    def release(self, collector: Collector) -> None: ...

    def defer_release(self, collector: Collector) -> None: ...


class OutputStream:
    """Async iterator over one request's outputs. Closing it early (``aclose()``, leaving ``async with``,
    cancellation, or dropping the last reference after ``break``) releases (aborts) the request, once.

    Subclasses say where outputs come from: ``_ready`` (an output or an error is waiting; may raise),
    ``_take`` (the output, or None for nothing to deliver yet), ``_sent_final``, ``_wait``, and how the
    request is released: ``_release`` on the event loop, ``_release_later`` from a finalizer."""

    _closed = True  # until a subclass's __init__ has run: a half-built stream releases nothing

    def __aiter__(self) -> "OutputStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        try:
            while True:
                if self._ready():
                    out = self._take()
                    if self._sent_final():
                        self._close()
                    if out is not None:
                        return out
                    if self._closed:
                        raise StopAsyncIteration
                    continue
                await self._wait()
        except BaseException:
            self._close()
            raise

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._release()

    async def aclose(self) -> None:
        self._close()

    async def __aenter__(self) -> "OutputStream":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._close()

    def __del__(self) -> None:
        # Never release synchronously here: a finalizer runs wherever the cyclic GC happens to run,
        # possibly in the middle of Scheduler.schedule(). The owner releases it later, between steps.
        if not self._closed:
            self._closed = True
            self._release_later()

    def _ready(self) -> bool:
        raise NotImplementedError

    def _take(self) -> RequestOutput | None:
        raise NotImplementedError

    def _sent_final(self) -> bool:
        raise NotImplementedError

    async def _wait(self) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError

    def _release_later(self) -> None:
        raise NotImplementedError


class RequestStream(OutputStream):
    """Engine.stream()'s iterator (OutputStream). Raises EngineDeadError if the engine dies while the
    request runs."""

    def __init__(self, driver: Reader, collector: Collector) -> None:
        self._driver = driver
        self._collector = collector
        self._closed = False

    @property
    def request_id(self) -> str:
        return self._collector.parent.request_id

    def _ready(self) -> bool:
        self._driver._raise_if_dead(self._collector)
        return self._collector.pending()

    def _take(self) -> RequestOutput | None:
        return self._driver._take(self._collector)

    def _sent_final(self) -> bool:
        return self._collector.cursor.sent_final

    async def _wait(self) -> None:
        await self._driver._wait(self._collector)

    def _release(self) -> None:
        self._driver.release(self._collector)

    def _release_later(self) -> None:
        self._driver.defer_release(self._collector)
