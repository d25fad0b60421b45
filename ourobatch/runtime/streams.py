"""Output streams: OutputStream, the iterate-and-close protocol every stream shares (Engine.stream's
RequestStream here, the Ray pool's PoolStream), and RequestStream. Torch-free.

RequestStream reads outputs through its AsyncDriver (ourobatch/runtime/driver.py): ``_take`` builds a coalesced
output under the driver's lock (the collector's OutputCursor: cursor.py), ``_wait`` waits for the
collector's event, ``release`` aborts and forgets the request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ourobatch.outputs import RequestOutput

if TYPE_CHECKING:
    from .driver import AsyncDriver, _Collector


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

    def __init__(self, driver: "AsyncDriver", collector: "_Collector") -> None:
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
