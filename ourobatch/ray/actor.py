"""EngineActor: a Ray async actor hosting one Engine (one GPU, or a CPU replica for tests).

The actor uses the Engine's host-task pattern: ``ready()`` starts ``engine.serve()`` in a task of the
actor's event loop and waits for ``wait_ready()``; ``shutdown()`` closes it. Ray reruns ``__init__`` when
it restarts the actor (``max_restarts``), so the next ``ready()`` loads the model again.

An actor made with ``armed=False`` (the pool's) refuses requests until ``arm()``: after a restart the
pool first replays the weight updates and the pause / sleep state the replica missed, and only then
arms it, so no request ever runs on a replica with stale weights.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, AsyncIterator, Sequence

import ray

from ourobatch.async_engine import Engine
from ourobatch.config import EngineConfig
from scheduler.errors import EngineClosedError
from ourobatch.log import get_logger
from ourobatch.outputs import RequestOutput

log = get_logger()

# Engine methods the pool broadcasts by name (EngineActor.call). Each is an async method of Engine and of
# EnginePool (tests/test_ray_pool.py checks it), so they are called as they are, never looked up first.
BROADCAST_METHODS = ("update_weights", "load_weights", "pause", "resume", "abort_all", "sleep", "wake_up",
                     "reset_prefix_cache")


class ReplicaNotArmedError(RuntimeError):
    """A request reached a replica that is (re)starting: it never ran there, so the pool routes it again."""


class _EngineActor:
    """One Engine in a Ray actor. Every method is a coroutine on the actor's event loop."""

    def __init__(self, config: EngineConfig, replica_index: int = 0, armed: bool = True) -> None:
        self.config = config
        self.replica_index = replica_index
        self._armed = armed
        self._engine: Engine | None = None
        self._host: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle

    async def ready(self) -> dict[str, Any]:
        """Start the engine (first call) and wait until the model is loaded; where the replica runs."""
        if self._engine is None:
            self._engine = Engine(self.config)
            self._host = asyncio.ensure_future(self._engine.serve())
        await self._engine.wait_ready()
        context = ray.get_runtime_context()
        return {"replica": self.replica_index, "pid": os.getpid(), "node_id": context.get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "restarted": context.was_current_actor_reconstructed}

    async def arm(self) -> None:
        """Accept requests from now on (the pool calls this once the replica has caught up)."""
        self._armed = True

    async def watch(self) -> str:
        """Return when the engine stops (its error, or "closed"); the pool keeps one call pending per
        replica, so an engine that dies or an actor that is killed is noticed at once."""
        await self.ready()
        assert self._host is not None
        try:
            await asyncio.shield(self._host)  # serve() returns when the engine stops, dead or closed
            self._serving_or_loaded().stats()  # raises why it stopped (EngineDeadError, EngineClosedError)
        except Exception as exc:  # noqa: BLE001 - reported to the pool, which restarts the actor
            return f"{type(exc).__name__}: {exc}"
        return "stopped"

    async def shutdown(self) -> None:
        """Close the engine: live requests end with finish_reason 'abort', the device memory is freed."""
        self._armed = False
        if self._engine is not None:
            await self._engine.aclose()
        if self._host is not None:
            await asyncio.gather(self._host, return_exceptions=True)

    def _serving(self) -> Engine:
        if not self._armed or self._engine is None:
            raise ReplicaNotArmedError(f"replica {self.replica_index} is not serving yet")
        return self._engine

    # ------------------------------------------------------------------ requests

    async def generate(self, prompt_token_ids: Sequence[int], params: Any = None,
                       request_id: str | None = None) -> RequestOutput:
        return await self._serving().generate(prompt_token_ids, params, request_id)

    async def stream(self, prompt_token_ids: Sequence[int], params: Any = None,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Call with ``.options(num_returns="streaming")``: one object per output. Cancelling the Ray
        generator (or the pool's abort) aborts the request."""
        async with self._serving().stream(prompt_token_ids, params, request_id) as outputs:
            async for out in outputs:
                yield out

    async def abort(self, request_id: str) -> bool:
        if self._engine is None:
            return False
        try:
            return await self._engine.abort(request_id)
        except EngineClosedError:
            return False

    async def stats(self) -> dict[str, Any]:
        return self._serving_or_loaded().stats()

    def _serving_or_loaded(self) -> Engine:
        if self._engine is None:
            raise ReplicaNotArmedError(f"replica {self.replica_index} has not started")
        return self._engine

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Await Engine.<method>(*args, **kwargs) (one of BROADCAST_METHODS) and return its result."""
        if method not in BROADCAST_METHODS:
            raise ValueError(f"method must be one of {BROADCAST_METHODS}, got {method!r}")
        result = await getattr(self._serving_or_loaded(), method)(*args, **kwargs)
        log.info("replica_call", replica=self.replica_index, method=method)
        return result


# max_task_retries=0: a request in flight when the actor dies fails (the pool decides what to do);
# Ray itself never re-runs a generation.
EngineActor = ray.remote(max_task_retries=0)(_EngineActor)
