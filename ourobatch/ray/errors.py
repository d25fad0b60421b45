"""The pool's own error: ReplicaDiedError (a subclass of the engine's EngineDeadError, scheduler/errors.py).

    EngineDeadError (scheduler.errors)  the engine hit an unrecoverable error
    └── ReplicaDiedError                a pool replica (Ray actor) died with the request in flight

Ray-free, so ``from ourobatch.ray import ReplicaDiedError`` works without the `ray` extra, and whoever
maps EngineDeadError (the HTTP server's 503: ourobatch/server/errors.py) maps this too, by its MRO.
"""

from __future__ import annotations

from scheduler.errors import EngineDeadError


class ReplicaDiedError(EngineDeadError):
    """Raised by ourobatch.ray.EnginePool to the requests in flight on a replica that died (not retried),
    and when no replica is ready within ready_timeout_s."""
