"""The ASGI app: one async Engine behind FastAPI routes. ``create_app`` only composes: the lifespan (the
engine starts and closes with the app), the middleware (``Gate``: the API key, 503 while draining, the
request counter; limits.BodyLimit: 413 past ``max_request_bytes``), the error handlers (errors.py: one
table from each named error to its status, always with OpenAI's JSON error body; a bad field is a 400
naming it) and one router per concern, each in the module that owns it:

    completions.py     OpenAI's /v1/completions (plain or SSE) and /v1/models
    chat.py            OpenAI's /v1/chat/completions
    generate.py        SGLang's token-in / token-out /generate
    tokenization.py    vLLM's /tokenize, /detokenize, /tokenizer_info
    control_routes.py  SGLang's control routes as slime and AReaL call them (/abort_request,
                       /pause_generation, /continue_generation, /update_weights_from_disk,
                       /get_weight_version, /flush_cache, /release_memory_occupation,
                       /resume_memory_occupation, /sleep, /wake_up, /get_model_info, /get_server_info)
    health.py          /health (503 while draining or once the engine is dead) and SGLang's /health_generate
    metrics.py         /metrics (Prometheus)

The routers read what they need from ``request.app.state`` (state.py lists it). While draining (SIGTERM)
new requests get 503. With ``api_key`` every route but ``/health`` needs ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import contextlib
import hmac
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive, Scope, Send

from ourobatch.config import EngineConfig
from ourobatch.text import Tokenizer

from . import chat, completions, control_routes, generate, health, metrics, tokenization
from .completions import Generation
from .errors import STATUS, error, http_error, table_error, validation_error
from .health import DEFAULT_HEALTH_CHECK_TIMEOUT
from .limits import DEFAULT_MAX_COMPLETIONS, DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from .metrics import ServerMetrics
from .state import ServedModel

OPEN_ROUTES = ("/health",)  # no api key needed
ALWAYS_ROUTES = ("/health", "/metrics")  # answered while draining
ROUTERS = (completions.router, chat.router, generate.router, tokenization.router, control_routes.router,
           health.router, metrics.router)


def create_app(config: EngineConfig, *, served_model_name: str | None = None, api_key: str | None = None,
               tokenizer: Tokenizer | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               health_check_timeout: float = DEFAULT_HEALTH_CHECK_TIMEOUT,
               max_completions_per_request: int = DEFAULT_MAX_COMPLETIONS,
               enable_prompt_tokens_details: bool = False) -> FastAPI:
    """The app for one engine built from `config` (started and closed with the app's lifespan). A request
    body over `max_request_bytes` is answered 413 without being parsed, a request for more than
    `max_completions_per_request` completions (prompts x n) 400; /health_generate answers 503 when its probe
    gets no engine step done within `health_check_timeout` seconds. `enable_prompt_tokens_details` adds
    OpenAI's usage.prompt_tokens_details.cached_tokens (the prompt tokens the prefix cache served), as vLLM's
    --enable-prompt-tokens-details does."""
    for name, value in (("max_request_bytes", max_request_bytes),
                        ("max_completions_per_request", max_completions_per_request)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if isinstance(health_check_timeout, bool) or not isinstance(health_check_timeout, (int, float)) or \
            not health_check_timeout > 0:
        raise ValueError(f"health_check_timeout must be a number of seconds > 0, got {health_check_timeout!r}")
    app = FastAPI(title="ourobatch", lifespan=_lifespan, docs_url=None, redoc_url=None)
    if not isinstance(enable_prompt_tokens_details, bool):
        raise TypeError(f"enable_prompt_tokens_details must be a bool, got {enable_prompt_tokens_details!r}")
    app.state.served = ServedModel.of(config, served_model_name, tokenizer, health_check_timeout,
                                      max_completions_per_request, enable_prompt_tokens_details)
    app.state.engine = None  # the lifespan's Engine while the app runs
    app.state.metrics = ServerMetrics()
    app.state.draining = False
    app.state.recompute_on_continue = False  # set by /pause_generation mode "retract"

    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(Gate, api_key=api_key, state=app.state, metrics=app.state.metrics)  # outermost: first

    app.add_exception_handler(RequestValidationError, validation_error)  # bad JSON, a bad field: 400
    app.add_exception_handler(StarletteHTTPException, http_error)  # unknown route 404, wrong method 405
    for cls in STATUS:  # every named error and bad input, by the one table (errors.py)
        app.add_exception_handler(cls, table_error)
    for router in ROUTERS:
        app.include_router(router)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The engine runs while the app does; the routes find it (and Generation over it) on app.state."""
    from ourobatch.async_engine import Engine

    served = app.state.served
    async with Engine(served.config) as engine:
        app.state.engine = engine
        app.state.gen = Generation(engine, served.tokenizer, served.name, served.config.max_model_len,
                                   served.max_completions, served.prompt_tokens_details)
        app.state.metrics.attach(engine)
        yield
        app.state.draining = True


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
