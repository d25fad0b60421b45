"""EngineView: what the collector reads of the engine it runs on, an Engine or an EnginePool.

The collector drives both through the calls they share (generate, stream, abort, pause, resume,
update_weights, load_weights; every stream is a scheduler.streams.OutputStream). Two things differ, and
this is the one place that tells the two apart: how many sequences run at once (an EnginePool runs
max_num_seqs on each of its num_replicas), and what stats() costs (an Engine's is an in-process read; an
EnginePool's asks every Ray actor and blocks the calling thread, so it runs on a worker thread and is not
polled for occupancy).
"""

from __future__ import annotations

import sys
from typing import Any

import anyio

from scheduler.errors import EngineClosedError, EngineDeadError


def is_pool(engine: Any) -> bool:
    """Whether `engine` is an ourobatch.ray.EnginePool. Told apart by its class, looked up where it lives:
    an EnginePool exists only once ourobatch.ray.pool is imported, so the check never imports Ray (the
    optional extra) or torch itself, and this package stays importable without either."""
    pool_module = sys.modules.get("ourobatch.ray.pool")
    return pool_module is not None and isinstance(engine, pool_module.EnginePool)


class EngineView:
    """The collector's reads of `engine` beyond the shared calls."""

    def __init__(self, engine: Any) -> None:
        self.is_pool = is_pool(engine)
        self._engine = engine
        replicas = engine.num_replicas if self.is_pool else 1
        self.max_num_seqs: int = engine.config.max_num_seqs * replicas  # sequences running at once, in all

    async def stats(self) -> dict[str, Any]:
        """The engine's stats(), without blocking the event loop."""
        if self.is_pool:
            return await anyio.to_thread.run_sync(self._engine.stats)
        return self._engine.stats()

    def num_running(self) -> int | None:
        """The engine's running requests now, for the occupancy log; None for a pool (its stats() is a
        round trip to every actor, too dear to poll)."""
        return None if self.is_pool else self._engine.stats()["num_running"]

    def stopped(self) -> bool:
        """Whether the engine itself has ended (closed, or dead), so that no later request can run. A pool
        with a dead replica has not: it runs on the others."""
        if self.is_pool:
            return bool(self._engine.is_closed)
        try:
            self._engine.stats()
        except (EngineClosedError, EngineDeadError):
            return True
        return False
