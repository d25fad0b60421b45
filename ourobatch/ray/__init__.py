"""ourobatch.ray: data-parallel scale-out on Ray (the optional `ray` extra: ``pip install ourobatch[ray]``).

``EnginePool(config, num_replicas)`` runs one Engine per Ray actor (one GPU each) and offers the Engine
API over them; ``EngineActor`` is the actor. See docs/scaling.md. Ray is imported on first use of those
names, so ``import ourobatch`` (and this package's ReplicaDiedError) never needs it.
"""

from ourobatch.scheduler.errors import ReplicaDiedError

_LAZY = {"EnginePool": "ourobatch.ray.pool", "EngineActor": "ourobatch.ray.actor"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        from ourobatch._extras import require

        require("ray", "ray", f"ourobatch.ray.{name}")  # MissingExtraError naming the pip install
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ourobatch.ray' has no attribute {name!r}")


__all__ = ["EngineActor", "EnginePool", "ReplicaDiedError"]
