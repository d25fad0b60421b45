"""Is the server up? ``GET /health`` and SGLang's ``GET /health_generate``.

- /health generates nothing: 200 ``{"status": "ok"}`` while the engine answers stats(); 503 while
  draining, before the engine started, and once it is closed or dead.
- /health_generate: one greedy token from prompt [0], answered 200 when it finishes or when any engine
  step completes meanwhile (a busy engine is healthy, as SGLang counts any output), 503 at once when the
  engine cannot step (paused, asleep, weights missing, closed, dead, draining), and 503 after
  ``health_check_timeout`` seconds otherwise: never a hang.
"""

from __future__ import annotations

import uuid
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from scheduler.errors import EngineClosedError, OurobatchError
from scheduler.params import SamplingParams

from .errors import error, first_error

DEFAULT_HEALTH_CHECK_TIMEOUT = 20.0  # seconds; SGLang's SGLANG_HEALTH_CHECK_TIMEOUT default
PROGRESS_POLL_S = 0.1  # how often /health_generate looks for a finished engine step
UNTIL = {"paused": "nothing is generated until /continue_generation",
         "pausing": "nothing new is generated until /continue_generation",
         "asleep": "nothing is generated until /resume_memory_occupation (or /wake_up)",
         "weights_missing": "nothing is generated until /update_weights_from_disk loads every tensor"}

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    state = request.app.state
    engine = state.engine  # None until the lifespan started it
    if state.draining:
        return error(503, "the server is shutting down", kind="ServiceUnavailableError")
    try:
        if engine is None:
            raise EngineClosedError("the engine is not started")
        engine.stats()
    except OurobatchError as exc:
        return error(503, f"{type(exc).__name__}: {exc}", kind="ServiceUnavailableError")
    return JSONResponse({"status": "ok"})


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    state = request.app.state
    why = await _unhealthy(state, state.served.health_check_timeout)
    if why is not None:
        return error(503, why, kind="ServiceUnavailableError")
    return JSONResponse({"status": "ok"})


async def _unhealthy(state: Any, timeout: float) -> str | None:
    """Why the engine cannot generate now (None: it can): at once where no step can run, else after a probe."""
    if state.draining:
        return "the server is shutting down"
    engine = state.engine
    try:
        if engine is None:
            raise EngineClosedError("the engine is not started")
        control = engine.stats()["control_state"]
    except OurobatchError as exc:
        return f"{type(exc).__name__}: {exc}"
    if control != "running":  # a probe would only queue
        return f"the engine is {control}: {UNTIL.get(control, 'it serves nothing')}"
    return await _probe(engine, timeout)


async def _probe(engine: Any, timeout: float) -> str | None:
    """One greedy token from [0]; healthy as soon as it finishes or any engine step completes meanwhile."""
    steps = engine.stats()["engine_steps"]  # steps completed (the async driver's count, after each update)
    outcome: dict[str, Any] = {}

    async def generate(scope: anyio.CancelScope) -> None:
        try:
            out = await engine.generate([0], SamplingParams(max_tokens=1, temperature=0.0),
                                        request_id=f"HEALTH_CHECK_{uuid.uuid4().hex}")
            outcome["finish"] = out.outputs[0].finish_reason
        except OurobatchError as exc:
            outcome["error"] = f"{type(exc).__name__}: {exc}"
        scope.cancel()

    async def watch(scope: anyio.CancelScope) -> None:
        while engine.stats()["engine_steps"] == steps:
            await anyio.sleep(PROGRESS_POLL_S)
        outcome["progress"] = True
        scope.cancel()

    with anyio.move_on_after(timeout):
        try:
            async with anyio.create_task_group() as tg:  # leaving it cancels the probe: the request is aborted
                tg.start_soon(generate, tg.cancel_scope)
                tg.start_soon(watch, tg.cancel_scope)
        except Exception as exc:  # noqa: BLE001 - stats() of an engine that died meanwhile
            cause = first_error(exc) or exc
            return f"{type(cause).__name__}: {cause}"
    if outcome.get("progress") or outcome.get("finish") in ("stop", "length"):
        return None
    if "error" in outcome:
        return outcome["error"]
    if "finish" in outcome:
        return f"the health probe ended with finish_reason {outcome['finish']!r} before any step completed"
    return f"no engine step completed within {timeout:g} s (health_check_timeout)"
