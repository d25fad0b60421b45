"""A replica as the pool sees it (its actor handle, state and load), and how Ray's errors are read."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayTaskError


class ReplicaState(enum.IntEnum):
    STARTING = 0  # the actor is loading the model (first start)
    READY = 1  # armed: the router sends it requests
    DOWN = 2  # died or unresponsive: Ray restarts it; the pool replays the weights, then arms it again
    DEAD = 3  # gone for good (restarts exhausted, or no restart in time); never routed to again
    CLOSED = 4  # the pool closed it


@dataclass(eq=False)
class Replica:
    index: int
    actor: Any  # the EngineActor handle
    state: ReplicaState = ReplicaState.STARTING
    load: int = 0  # tokens its requests in flight may still generate (the router's measure)
    subs: set = field(default_factory=set)  # SubRequests in flight on it
    info: dict = field(default_factory=dict)  # what ready() reported: pid, node, GPUs
    restarts: int = 0
    requests_routed: int = 0
    last_failure: str = ""
    suspect: asyncio.Event = field(default_factory=asyncio.Event)  # a request saw it fail
    monitor: asyncio.Task | None = None


async def await_ref(ref: Any) -> Any:
    """Await a Ray ObjectRef inside asyncio.wait / wait_for."""
    return await ref


def cause_of(exc: BaseException) -> BaseException:
    """The exception raised inside the actor, for a RayTaskError; `exc` itself otherwise."""
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            return cause
    return exc


def is_actor_failure(exc: BaseException) -> bool:
    """The actor died, is restarting or cannot be reached (Ray's errors, not the engine's)."""
    return isinstance(exc, (RayActorError, GetTimeoutError)) and not isinstance(exc, RayTaskError)


def is_gone_for_good(exc: BaseException) -> bool:
    """ActorDiedError: no restart will come (killed with no_restart, or max_restarts used up)."""
    return isinstance(exc, ActorDiedError)


def cancel_generator(generator: Any) -> None:
    """Stop a Ray streaming generator on the actor (its engine request aborts); harmless when done."""
    try:
        ray.cancel(generator)
    except Exception:  # noqa: BLE001 - the actor may be gone already
        pass
