"""Running a route's producer under structured concurrency, with the client's disconnect as a cancel.

A producer is ``async def produce(send)`` that sends items (bytes for a stream, anything for a plain
response) and returns. ``EventStream`` is an ASGI response that runs it in a task group beside a
listener for ``http.disconnect``: a client that goes away cancels the producer, and the producer's
engine streams abort their requests on the way out (their KV is freed at once). ``collect`` does the
same for a non-streaming route and returns what was sent, or None if the client left first.

Errors: ``collect`` raises the producer's error itself, not the task groups' ExceptionGroup around it, so
the app's handlers (errors.py) answer it with its status. ``EventStream`` has sent its 200 by then: an
error from the producer becomes one error event (errors.sse_error) and ``data: [DONE]``, and the stream
ends cleanly, the connection kept.
"""

from __future__ import annotations

import math
from typing import Any, Awaitable, Callable

import anyio
from anyio.streams.memory import MemoryObjectSendStream
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .errors import first_error, sse_error

Producer = Callable[[MemoryObjectSendStream], Awaitable[None]]
BUFFER = 64  # chunks waiting for a slow client; past it the producer waits (the engine never does)


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


async def _run(produce: Producer, send_stream: MemoryObjectSendStream) -> None:
    async with send_stream:
        await produce(send_stream)


async def _run_stream(produce: Producer, send_stream: MemoryObjectSendStream) -> None:
    async with send_stream:
        try:
            await produce(send_stream)
        except Exception as exc:  # an ExceptionGroup too (not one holding a cancellation: that propagates)
            cause = first_error(exc) or exc
            await send_stream.send(sse_error(cause))
            await send_stream.send(b"data: [DONE]\n\n")


class EventStream(Response):
    """A text/event-stream response fed by a producer of already-framed bytes."""

    media_type = "text/event-stream"

    def __init__(self, produce: Producer, headers: dict[str, str] | None = None) -> None:
        # not Response.__init__: that would set content-length: 0 for the empty body
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", **(headers or {})})
        self.produce = produce

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        send_stream, receive_stream = anyio.create_memory_object_stream[bytes](BUFFER)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
            tg.start_soon(_run_stream, self.produce, send_stream)
            async with receive_stream:
                async for chunk in receive_stream:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            tg.cancel_scope.cancel()


async def collect(request: Request, produce: Producer) -> list[Any] | None:
    """Run a producer to the end and return everything it sent; None if the client disconnected first."""
    send_stream, receive_stream = anyio.create_memory_object_stream[Any](math.inf)
    items: list[Any] = []
    finished = False
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_on_disconnect, request.receive, tg.cancel_scope)
            await _run(produce, send_stream)
            async with receive_stream:
                items = [item async for item in receive_stream]
            finished = True
            tg.cancel_scope.cancel()
    except Exception as exc:
        cause = first_error(exc)
        if cause is None or cause is exc:
            raise
        raise cause from None
    return items if finished else None
