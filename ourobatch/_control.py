"""The control calls that touch the executor (weights, sleep, wake, score), shared by Engine and SyncEngine.

Each function must be called where no step can run: SyncEngine calls it holding its lock (steps run
under the same lock); the async Engine runs it on the worker thread through ``AsyncDriver.between_steps``
(the stepping thread has handed back and cannot start again until it returns). Each takes the engine's
lock only for the control state and the scheduler, never for the executor's part, so the event loop can
keep admitting and aborting while a large weight copy runs. The rules (which call is allowed in which
state) are EngineControl.check's (ourobatch/runtime/control.py), checked again here since the state may have
changed between the call and its turn.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Iterator, Sequence

from engine.loader import checkpoint_files
from engine.weights import checkpoint_tensors

from ourobatch.runtime.control import SLEEP_LEVELS
from scheduler.errors import WeightUpdateError
from ourobatch.runtime.engine_core import EngineCore

from .training import score_on_executor

Lock = AbstractContextManager  # the engine's (re-entrant) lock


def check_version(version: object, current: int | None = None) -> None:
    """`version`: None (the next one) or an int above `current`, the engine's weight_version: versions order
    the weights each token came from (staleness counts them), so a version is never given twice."""
    if version is None:
        return
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"version must be an int or None, got {version!r}")
    if version < 0 or (current is not None and version <= current):
        raise ValueError(f"version must be an int > the current weight_version ({current}) or None (the next "
                         f"one), got {version}: versions order the weights each token came from")


def check_sleep_level(level: object) -> None:
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")


def update_weights(core: EngineCore, lock: Lock, named_tensors: Any, version: int | None) -> int:
    """Copy (name, tensor) pairs into the executor's weights and record it; returns the new version."""
    with lock:
        check_version(version, core.control.weight_version)
        core.control.check("update")
    try:
        copied = core.executor.update_weights(named_tensors)
    except WeightUpdateError as exc:
        with lock:
            core.control.weights_copied(exc.copied, failed=True, version=None)
        raise
    with lock:
        return core.control.weights_copied(copied, failed=False, version=version)


def checkpoint_weights(core: EngineCore, path: str | Path) -> Iterator[tuple[str, Any]]:
    """load_weights' (name, tensor) pairs of a Hugging Face checkpoint folder, read tensor by tensor onto the
    executor's device; CheckpointError at once for a missing or unreadable folder."""
    checkpoint_files(Path(path))
    return checkpoint_tensors(path, core.executor.model_config, core.executor.device)


def sleep(core: EngineCore, lock: Lock, level: int) -> None:
    """Free the device. Kept requests lose their KV (recomputed when they run again); the prefix cache
    would read a freed pool, so it goes too."""
    check_sleep_level(level)
    with lock:
        if core.control.check("sleep", level) == "noop":
            return
        core.scheduler.preempt_all()
        core.reset_prefix_cache()
        core.control.fell_asleep(level)  # from here on nothing is scheduled or scored
    core.executor.sleep(level)


def wake_up(core: EngineCore, lock: Lock) -> None:
    with lock:
        if core.control.check("wake_up") == "noop":
            return
    core.executor.wake_up()
    with lock:
        core.control.woke_up()


def score(core: EngineCore, lock: Lock, prompt_token_ids: Sequence[int], completion_token_ids: Sequence[int],
          readout_loops: Sequence[int] | None, params: Any) -> list[float]:
    with lock:
        core.control.check("score")
    return score_on_executor(core.executor, prompt_token_ids, completion_token_ids, readout_loops, params)
