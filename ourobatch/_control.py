"""The bookkeeping around a weight copy or a sleep that Engine and SyncEngine share.

Each engine runs the copy itself (the async one on its worker thread, holding the loop; the blocking one
under its lock); these functions check what must hold before and record what happened after.
"""

from __future__ import annotations

from typing import Any

from ourobatch.engine.loader import expected_shapes
from ourobatch.scheduler.errors import EngineBusyError, WeightUpdateError
from ourobatch.scheduler.frontend import EngineCore


def check_version(version: object) -> None:
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
        raise TypeError(f"version must be an int >= 0 or None, got {version!r}")


def check_weight_change(core: EngineCore, what: str, asleep: bool, version: object = None) -> None:
    """Raise before anything changes: a bad version, an engine asleep, requests running unpaused."""
    check_version(version)
    if asleep and what != "sleep":
        raise EngineBusyError(f"{what}: the engine is asleep; call wake_up() first")
    core.check_can_change_weights(what)


def copy_weights(core: EngineCore, named_tensors: Any, version: int | None) -> int:
    """Run the executor's copy (call where no step can run) and record it; returns the new version."""
    try:
        copied = core.executor.update_weights(named_tensors)
    except WeightUpdateError as exc:
        core.record_weight_update(list(exc.copied), failed=True, version=None)
        raise
    return core.record_weight_update(copied, failed=False, version=version)


def before_sleep(core: EngineCore, level: int) -> None:
    """Kept requests lose their KV (recomputed after wake_up); cached prefixes would read a stale pool."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    core.scheduler.preempt_all()
    core.reset_prefix_cache()


def after_sleep(core: EngineCore, level: int) -> None:
    if level == 2:  # the weights are gone: nothing is served until every tensor is loaded again
        core.mark_weights_missing(expected_shapes(core.executor.model_config))
