"""ourobatch.ray: data-parallel scale-out on Ray (the optional `ray` extra: ``pip install ourobatch[ray]``).

``EnginePool(config, num_replicas)`` runs one Engine per Ray actor (one GPU each) and offers the Engine
API over them; ``EngineActor`` is the actor. See docs/scaling.md. Ray is imported on first use of those
names, so ``import ourobatch`` (and this package's ReplicaDiedError) never needs it.

Concurrency here is asyncio, where the rest of ourobatch uses anyio (docs/scaling.md, "Why ourobatch/ray/
is written against asyncio"): Ray's ObjectRefs and streaming generators are awaited as asyncio futures, so
the pool runs on an asyncio loop whatever it is written in; an async actor's methods are separate
coroutines on Ray's own loop, so the Engine's host task outlives the call that starts it (an asyncio task
the actor holds); and the pool starts a request's task from plain calls (``stream()``) and finalizers,
which anyio allows only inside a task group the caller would have to enter. Every task still has an owner
(``EnginePool._tasks``, a replica's monitor), which ``aclose()`` awaits, and every wait is bounded.
"""

from .errors import ReplicaDiedError

_LAZY = {"EnginePool": "ourobatch.ray.pool", "EngineActor": "ourobatch.ray.actor"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        from ourobatch._extras import require

        require("ray", "ray", f"ourobatch.ray.{name}")  # MissingExtraError naming the pip install
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ourobatch.ray' has no attribute {name!r}")


__all__ = ["EngineActor", "EnginePool", "ReplicaDiedError"]
