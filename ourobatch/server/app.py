"""The ASGI app: one async Engine behind FastAPI routes.

- OpenAI: ``/v1/completions`` (plain or SSE), ``/v1/models``;
- token-in/token-out: ``/generate`` (SGLang's request and response shapes);
- control: ``/abort_request``, ``/pause_generation``, ``/continue_generation``,
  ``/update_weights_from_disk``, ``/get_weight_version``, ``/flush_cache``, ``/sleep``, ``/wake_up``.
  Each calls the Engine method of the same job (``pause``, ``resume``, ``load_weights``,
  ``reset_prefix_cache``, ``sleep``, ``wake_up``) when the engine has it, and answers 501 otherwise;
- ``/health`` (503 while draining or once the engine is dead) and ``/metrics`` (Prometheus).

The engine runs for the app's lifespan. Bad JSON or a bad field is a 400 whose message and ``param``
name the field; an engine error gets the status errors.STATUS gives its class (409 busy, 503 closed /
dead / asleep / weights missing), always with the JSON error body; while draining (SIGTERM) new requests
get 503. A body over ``max_request_bytes`` is a 413 (limits.py). With ``api_key`` every route but
``/health`` needs ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import contextlib
import hmac
import inspect
import time
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Message, Receive, Scope, Send

from ourobatch.config import EngineConfig
from ourobatch.scheduler.errors import EngineClosedError, OurobatchError
from ourobatch.text import Tokenizer

from .completions import Generation
from .errors import STATUS, BadRequest, NotImplementedRoute, error, error_response
from .limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from .metrics import ServerMetrics
from .protocol import (
    AbortRequest,
    CompletionRequest,
    GenerateRequest,
    PauseRequest,
    SleepRequest,
    UpdateWeightsFromDiskRequest,
)

OPEN_ROUTES = ("/health",)  # no api key needed
ALWAYS_ROUTES = ("/health", "/metrics")  # answered while draining


def _field(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) if parts else "body"


def create_app(config: EngineConfig, *, served_model_name: str | None = None, api_key: str | None = None,
               tokenizer: Tokenizer | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The app for one engine built from `config` (started and closed with the app's lifespan). A request
    body over `max_request_bytes` is answered 413 without being parsed."""
    from ourobatch.async_engine import Engine

    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be an int >= 1, got {max_request_bytes!r}")
    model_name = served_model_name or str(config.model)
    metrics = ServerMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with Engine(config) as engine:
            app.state.engine = engine
            app.state.gen = Generation(engine, tokenizer, model_name, config.max_model_len)
            metrics.attach(engine)
            yield
            app.state.draining = True

    app = FastAPI(title="ourobatch", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.draining = False
    app.state.metrics = metrics
    app.state.started = int(time.time())

    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(Gate, api_key=api_key, state=app.state, metrics=metrics)  # outermost: before the body

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = exc.errors()
        first = problems[0] if problems else {"loc": ("body",), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", "body")
        message = "; ".join(f"{_field(p['loc'])}: {p['msg']}" for p in problems[:5])
        return error(400, message, _field(first["loc"]))

    async def by_table(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    for cls in STATUS:  # every named error and bad input, by the one table (errors.py)
        app.add_exception_handler(cls, by_table)

    # ------------------------------------------------------------------ generation

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await app.state.gen.completions(request, body)

    @app.post("/generate")
    async def generate(request: Request, body: GenerateRequest) -> Response:
        return await app.state.gen.generate(request, body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        max_len = app.state.engine.stats().get("max_model_len", config.max_model_len)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": app.state.started,
                                            "owned_by": "ourobatch", "root": str(config.model),
                                            "max_model_len": max_len}]}

    # ------------------------------------------------------------------ health and metrics

    @app.get("/health")
    async def health() -> Response:
        engine = getattr(app.state, "engine", None)
        if app.state.draining:
            return error(503, "the server is shutting down", kind="ServiceUnavailableError")
        try:
            if engine is None:
                raise EngineClosedError("the engine is not started")
            engine.stats()
        except OurobatchError as exc:
            return error(503, f"{type(exc).__name__}: {exc}", kind="ServiceUnavailableError")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ control

    async def call(name: str, route: str, *args: Any, **kwargs: Any) -> Any:
        method = getattr(app.state.engine, name, None)
        if method is None:
            raise NotImplementedRoute(f"{route} needs Engine.{name}(), which this version of ourobatch does not "
                                      f"have yet")
        result = method(*args, **kwargs)
        return await result if inspect.isawaitable(result) else result

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest) -> dict[str, Any]:
        engine = app.state.engine
        if body.abort_all == (body.rid is not None):
            raise BadRequest("give exactly one of rid (a request id) or abort_all=true", "rid")
        if body.abort_all:
            if hasattr(engine, "abort_all"):
                aborted = await call("abort_all", "/abort_request")  # the aborted requests' outputs
                return {"success": True, "aborted": len(aborted) if isinstance(aborted, list) else aborted}
            ids = list(engine.core.parents)
            return {"success": True, "aborted": sum([await engine.abort(rid) for rid in ids])}
        return {"success": await engine.abort(body.rid), "aborted": None}

    @app.post("/pause_generation")
    async def pause_generation(body: PauseRequest | None = None) -> dict[str, Any]:
        await call("pause", "/pause_generation", mode=(body or PauseRequest()).mode)
        return {"success": True}

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, Any]:
        await call("resume", "/continue_generation")
        return {"success": True}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> dict[str, Any]:
        if body.load_format not in (None, "auto"):
            raise BadRequest(f"load_format={body.load_format!r}: only an HF safetensors folder ('auto') loads",
                             "load_format")
        if body.abort_all_requests:  # the body is checked whole first: a bad one aborts nothing
            from ourobatch.engine.loader import checkpoint_files

            await anyio.to_thread.run_sync(checkpoint_files, Path(body.model_path))  # CheckpointError: 400
            await abort_request(AbortRequest(abort_all=True))
        version = await call("load_weights", "/update_weights_from_disk", body.model_path,
                             version=body.weight_version)
        return {"success": True, "message": f"loaded {body.model_path}",
                "weight_version": version if version is not None else app.state.engine.stats()["weight_version"]}

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": app.state.engine.stats()["weight_version"]}

    @app.post("/flush_cache")
    async def flush_cache() -> dict[str, Any]:
        await call("reset_prefix_cache", "/flush_cache")
        return {"success": True}

    @app.post("/sleep")
    async def sleep(body: SleepRequest | None = None) -> dict[str, Any]:
        await call("sleep", "/sleep", level=(body or SleepRequest()).level)
        return {"success": True}

    @app.post("/wake_up")
    async def wake_up() -> dict[str, Any]:
        await call("wake_up", "/wake_up")
        return {"success": True}

    return app


class Gate:
    """ASGI middleware (pure, so disconnects reach the routes untouched): the API key, 503 while
    draining, and the per-route request counter."""

    def __init__(self, app: Any, *, api_key: str | None, state: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None
        self.state = state
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        reject = None
        if self.expected is not None and path not in OPEN_ROUTES:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                reject = error(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                               kind="AuthenticationError")
        if reject is None and self.state.draining and path not in ALWAYS_ROUTES:
            reject = error(503, "the server is shutting down", kind="ServiceUnavailableError")
        if reject is not None:
            self.metrics.http_requests.labels("rejected", str(reject.status_code)).inc()
            await reject(scope, receive, send)
            return
        status = [0]

        async def send_and_count(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_count)
        finally:
            route = getattr(scope.get("route"), "path", "other")
            self.metrics.http_requests.labels(route, str(status[0] or 500)).inc()
