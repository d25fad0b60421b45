"""Which HTTP status each error gets, in one table, and the error body every route answers with.

``STATUS`` maps an exception class to (status, OpenAI error type); ``status_of`` resolves an exception
by its class's MRO, so a subclass (EngineAsleepError) gets its own row when it has one and its
parent's otherwise: ourobatch.ray's ReplicaDiedError is an EngineDeadError's 503 without this module
importing ourobatch.ray (or Ray). Every route goes through ``error_response``: the app registers
``table_error`` as the handler of each class here (and ``validation_error`` for a body FastAPI cannot
parse), and the SSE producers (streaming.py) turn an error raised after the headers into ``sse_error``,
one ``data: {"error": ...}`` event, before ending the stream cleanly.

    400 BadRequestError          bad input: ValueError / TypeError, RequestRejectedError,
                                 WeightUpdateError, CheckpointError (the body's param: field_of)
    409 ConflictError            EngineBusyError: the engine's state forbids the call now (an update while
                                 requests run unpaused)
    503 ServiceUnavailableError  EngineClosedError, EngineDeadError (+ ReplicaDiedError), EngineAsleepError,
                                 InconsistentWeightsError: not ready, closed, dead, asleep, weights missing
    500 InternalServerError      InvalidTransition or any other OurobatchError: a bug, still with the body
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from scheduler.errors import (
    CheckpointError,
    EngineAsleepError,
    EngineBusyError,
    EngineClosedError,
    EngineDeadError,
    InconsistentWeightsError,
    InvalidTransition,
    OurobatchError,
    RequestRejectedError,
    WeightUpdateError,
)
from ourobatch.log import get_logger

log = get_logger("ourobatch.server")

BAD_REQUEST = (400, "BadRequestError")
UNAVAILABLE = (503, "ServiceUnavailableError")
INTERNAL = (500, "InternalServerError")


class BadRequest(ValueError):
    """A 400 with the request field that caused it (``field``: the error body's ``param``)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


STATUS: dict[type[BaseException], tuple[int, str]] = {
    ValueError: BAD_REQUEST,
    TypeError: BAD_REQUEST,
    RequestRejectedError: BAD_REQUEST,
    WeightUpdateError: BAD_REQUEST,
    CheckpointError: BAD_REQUEST,
    EngineBusyError: (409, "ConflictError"),
    EngineAsleepError: UNAVAILABLE,
    EngineClosedError: UNAVAILABLE,
    EngineDeadError: UNAVAILABLE,
    InconsistentWeightsError: UNAVAILABLE,
    InvalidTransition: INTERNAL,
    OurobatchError: INTERNAL,
}


def status_of(exc: BaseException) -> tuple[int, str]:
    """(status, type) of the nearest class in `exc`'s MRO that the table names; 500 otherwise."""
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return INTERNAL


def first_error(exc: BaseException) -> Exception | None:
    """The error a task group's ExceptionGroup wraps (its first leaf); None for a group holding a
    cancellation or another BaseException, which must propagate as it is."""
    while isinstance(exc, ExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, Exception) and not isinstance(exc, BaseExceptionGroup) else None


def error_body(status: int, message: str, param: str | None = None, kind: str = "BadRequestError") -> dict[str, Any]:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error(status: int, message: str, param: str | None = None, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse(error_body(status, message, param, kind), status_code=status)


def field_of(exc: BaseException) -> str | None:
    """The request field a bad-input error names (the error body's ``param``), read as data: the error's
    ``field`` attribute, which BadRequest and every SamplingParams check set (scheduler.params.field_error
    puts one on a plain ValueError / TypeError, check_new_request on its two); else None."""
    field = getattr(exc, "field", None)  # optional: only errors that know their field carry it
    return field if isinstance(field, str) else None


def _describe(exc: BaseException) -> tuple[int, dict[str, Any]]:
    status, kind = status_of(exc)
    # a named engine error keeps its class in the message (clients tell InconsistentWeightsError from
    # EngineDeadError by it); plain bad input reads as its own message
    message = f"{type(exc).__name__}: {exc}" if isinstance(exc, OurobatchError) else str(exc)
    if status >= 500:
        log.warning("http_error", status=status, error=f"{type(exc).__name__}: {exc}")
    return status, error_body(status, message, field_of(exc), kind)


def error_response(exc: BaseException) -> JSONResponse:
    """The JSON error response for `exc`, by the table."""
    status, body = _describe(exc)
    return JSONResponse(body, status_code=status)


def sse_error(exc: BaseException) -> bytes:
    """`exc` as one server-sent event, for a stream whose 200 headers are already out."""
    return f"data: {json.dumps(_describe(exc)[1])}\n\n".encode()


def _loc(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) if parts else "body"


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """Bad JSON, a field of the wrong type, an unknown field: a 400 naming the (first) field."""
    problems = exc.errors()
    first = problems[0] if problems else {"loc": ("body",), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", "body")
    message = "; ".join(f"{_loc(p['loc'])}: {p['msg']}" for p in problems[:5])
    return error(400, message, _loc(first["loc"]))


async def table_error(request: Request, exc: Exception) -> JSONResponse:
    """The handler of every class in STATUS."""
    return error_response(exc)


HTTP_KINDS = {404: "NotFoundError", 405: "MethodNotAllowedError"}


async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Starlette's own refusals (an unknown route: 404, a route's other method: 405) in OpenAI's body."""
    message = f"{request.method} {request.url.path}: {exc.detail}"
    response = error(exc.status_code, message, None, HTTP_KINDS.get(exc.status_code, "HTTPError"))
    response.headers.update(exc.headers or {})  # 405's Allow
    return response
