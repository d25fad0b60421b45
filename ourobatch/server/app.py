"""The ASGI app: one async Engine behind FastAPI routes.

- OpenAI: ``/v1/completions`` (plain or SSE), ``/v1/models``;
- token-in/token-out: ``/generate`` (SGLang's request and response shapes); vLLM's ``/tokenize``,
  ``/detokenize`` and ``/tokenizer_info`` (tokenization.py);
- control (control_routes.py, SGLang's names as slime and AReaL call them): ``/abort_request``,
  ``/pause_generation``, ``/continue_generation``, ``/update_weights_from_disk``, ``/get_weight_version``,
  ``/flush_cache``, ``/release_memory_occupation``, ``/resume_memory_occupation``, ``/sleep``, ``/wake_up``,
  ``/health_generate``, ``/get_server_info``, ``/get_model_info``. Each calls the Engine method of the same
  job (``pause``, ``resume``, ``load_weights``, ``reset_prefix_cache``, ``sleep``, ``wake_up``) when the
  engine has it, and answers 501 otherwise;
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
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Message, Receive, Scope, Send

from ourobatch.config import EngineConfig
from ourobatch.scheduler.errors import EngineClosedError, OurobatchError
from ourobatch.text import Tokenizer

from .chat import mount_chat
from .completions import Generation
from .control_routes import DEFAULT_HEALTH_CHECK_TIMEOUT, control_router
from .errors import STATUS, error, error_response
from .limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from .metrics import ServerMetrics
from .protocol import CompletionRequest, GenerateRequest
from .tokenization import router as tokenization_router

OPEN_ROUTES = ("/health",)  # no api key needed
ALWAYS_ROUTES = ("/health", "/metrics")  # answered while draining


def _field(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) if parts else "body"


def create_app(config: EngineConfig, *, served_model_name: str | None = None, api_key: str | None = None,
               tokenizer: Tokenizer | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               health_check_timeout: float = DEFAULT_HEALTH_CHECK_TIMEOUT) -> FastAPI:
    """The app for one engine built from `config` (started and closed with the app's lifespan). A request
    body over `max_request_bytes` is answered 413 without being parsed; /health_generate answers 503 when
    its probe gets no engine step done within `health_check_timeout` seconds."""
    from ourobatch.async_engine import Engine

    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be an int >= 1, got {max_request_bytes!r}")
    if isinstance(health_check_timeout, bool) or not isinstance(health_check_timeout, (int, float)) or \
            not health_check_timeout > 0:
        raise ValueError(f"health_check_timeout must be a number of seconds > 0, got {health_check_timeout!r}")
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
    app.state.recompute_on_continue = False  # set by /pause_generation mode "retract"
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

    mount_chat(app)  # /v1/chat/completions (chat.py)
    app.include_router(tokenization_router)  # vLLM's /tokenize, /detokenize, /tokenizer_info (tokenization.py)

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

    # ------------------------------------------------------------------ control (control_routes.py)

    app.include_router(control_router(config, model_name, str(tokenizer.path) if tokenizer is not None and
                                      tokenizer.path is not None else None, health_check_timeout))

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
