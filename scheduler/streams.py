"""RequestStream: the async iterator over one request's outputs that Engine.stream() returns. Torch-free.

It reads outputs through its AsyncDriver (scheduler/driver.py): ``_take`` builds a coalesced output under
the driver's lock, ``_wait`` waits for the collector's event, ``release`` aborts and forgets the request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .outputs import RequestOutput

if TYPE_CHECKING:
    from .driver import AsyncDriver, _Collector


class RequestStream:
    """Async iterator over one request's outputs. Closing it early (``aclose()``, leaving
    ``async with``, cancellation, or dropping the last reference after ``break``) aborts the request.
    Raises EngineDeadError if the engine dies while the request runs."""

    def __init__(self, driver: "AsyncDriver", collector: "_Collector") -> None:
        self._driver = driver
        self._collector = collector
        self._closed = False

    @property
    def request_id(self) -> str:
        return self._collector.parent.request_id

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        collector, driver = self._collector, self._driver
        if self._closed:
            raise StopAsyncIteration
        try:
            while True:
                driver._raise_if_dead(collector)
                if collector.pending():
                    out = driver._take(collector)
                    if collector.sent_final:
                        self._close()
                    if out is not None:
                        return out
                    if self._closed:
                        raise StopAsyncIteration
                    continue
                await driver._wait(collector)
        except BaseException:
            self._close()
            raise

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._driver.release(self._collector)

    async def aclose(self) -> None:
        self._close()

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._close()

    def __del__(self) -> None:
        # Never abort synchronously here: a finalizer runs wherever the cyclic GC happens to run,
        # possibly in the middle of Scheduler.schedule(). The loop aborts the request between steps.
        if not getattr(self, "_closed", True):
            self._closed = True
            self._driver.defer_release(self._collector)
