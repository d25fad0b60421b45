"""When may the async loop step? Pause / resume (vLLM's pause_generation modes) and maintenance holds.

Modes of ``pause(mode)``:
- ``"abort"``: every live request ends at once with finish_reason "abort" and its partial output (the
  driver aborts them before asking to pause); the loop pauses at its next iteration.
- ``"wait"``: nobody is admitted any more; running requests step until they finish; then paused.
- ``"keep"``: nobody is admitted; if deep work is pending (deferred mode mid-block, verify drafts) one
  more step runs as a forced boundary of every cohort, so every fed position has all its loops under
  the current weights; then paused with the running requests frozen, their KV kept.
While paused, new requests queue (WAITING). ``resume(recompute_kv=True)`` preempts the kept requests so
their KV is recomputed (prefill of prompt + outputs) under the new weights.

A *hold* (a weight copy, sleep or wake on the worker thread) also keeps the loop from stepping, paused
or not, so no step ever runs against weights or buffers being changed.

Torch-free, no awaits, no event-loop objects: the async driver calls ``must_wait()`` before it lets its
stepping thread run, with no step in flight (the thread hands back to the loop after any step while a
pause, a hold or sleep is pending); SyncEngine.pause() steps until it returns True.
"""

from __future__ import annotations

from typing import Callable

from .frontend import EngineCore
from .log import get_logger

PAUSE_MODES = ("abort", "wait", "keep")
log = get_logger()


class PauseControl:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.mode: str | None = None  # a pause in progress
        self.paused = False
        self.holds = 0  # maintenance on the worker thread (weights, sleep); also blocks steps
        self.asleep = False  # sleep() until wake_up(): nothing may step, paused or not
        self._flushed = False
        self._waiters: list[Callable[[], None]] = []  # called once paused (or when a resume cancels it)

    def request(self, mode: str, on_paused: Callable[[], None] | None = None) -> None:
        """Start pausing in `mode`; `on_paused` is called once the engine is paused."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        if self.paused:
            if on_paused is not None:
                on_paused()
            return
        if on_paused is not None:
            self._waiters.append(on_paused)
        if self.mode is None:
            self._flushed = False
            self.mode = mode
        if mode != "abort":
            self.core.scheduler.admission_paused = True

    def must_wait(self) -> bool:
        """At the top of a loop iteration: True if the loop must not step now (it waits for a wakeup)."""
        if self.mode is not None:
            scheduler = self.core.scheduler
            if self.mode == "wait" and scheduler.num_running:
                return self.holds > 0 or self.asleep  # keep stepping until the running ones finish
            if self.mode == "keep" and not self._flushed and scheduler.needs_flush():
                self._flushed = True
                scheduler.force_boundary()  # one more step: the flush
                return False
            self._become_paused()
        return self.paused or self.holds > 0 or self.asleep

    def _become_paused(self) -> None:
        log.info("engine_paused", mode=self.mode, kept=self.core.scheduler.num_running)
        self.paused, self.mode = True, None
        self.core.paused = True
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        waiters, self._waiters = self._waiters, []
        for wake in waiters:
            wake()

    def resume(self, recompute_kv: bool = False) -> None:
        if recompute_kv:
            num = self.core.scheduler.preempt_all()  # KV recomputed under the current weights on readmission
            log.info("kept_requests_recompute", requests=num)
        self.paused, self.mode = False, None
        self.core.paused = False
        self.core.scheduler.admission_paused = False
        self._wake_waiters()  # a pause still in progress is cancelled by the resume
        log.info("engine_resumed", recompute_kv=recompute_kv)
