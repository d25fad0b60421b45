"""EngineControl: the one owner of an engine's control state (pause, sleep, weights, life) and its rules.

Theory of operation. Three facets make the state:

- ``run``: RUNNING -> PAUSING(mode) -> PAUSED -> RUNNING (``pause`` / ``resume``; vLLM's modes);
- ``residency``: AWAKE, ASLEEP(level) (``sleep`` / ``wake_up``) and, orthogonal to it, the set of
  *missing* tensors (dropped by sleep level 2, or copied by a weight update that failed part-way);
- ``life``: OPEN -> CLOSED or DEAD (terminal).

``state`` summarises them in precedence order (dead, closed, asleep, weights_missing, paused, pausing,
running), and ``TABLE`` says what each control call does in each summary state: allowed (and what it
changes), a no-op, or refused with a named error. ``check(op)`` applies the table; it is the only place
a call is refused, for both engines, the server and the pool (docs/state_machine.md draws the table).

Serialization with the stepping thread. Nothing here ever preempts, forces a boundary or changes the
weights with a step in flight. Calls that only change *state* (pause, resume, close) take effect at
once; what they imply for the scheduler (the "keep" flush, the recompute of kept requests, becoming
paused) is applied by ``poll()``, which the driver calls at the top of every loop iteration with no step
in flight (the async driver from its event loop, SyncEngine under its lock, before each step). Calls
that touch the executor (a weight copy, sleep, wake, score) run where no step can run, between steps
(``hold()`` tells the stepping thread to hand back), and re-``check`` there.

Torch-free, no awaits, no threads: the drivers own the lock and the thread; this class owns the rules.
Waiters (``pause()``'s callers) are callbacks, released once paused, on a resume that cancels the
pause, and on close or death, so nobody waits on a transition that can no longer happen.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Callable, Iterable

from scheduler.errors import (
    EngineAsleepError,
    EngineBusyError,
    EngineClosedError,
    EngineDeadError,
    InconsistentWeightsError,
)
from ourobatch.log import get_logger

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler

log = get_logger()

PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_LEVELS = (1, 2)
_STRENGTH = {"wait": 0, "keep": 1, "abort": 2}  # a second pause while pausing joins the stronger mode


class Run(enum.Enum):
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"


class Life(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"
    DEAD = "dead"


# The summary states, in precedence order (the first that holds is the state).
STATES = ("dead", "closed", "asleep", "weights_missing", "paused", "pausing", "running")

# What each call does in each state. "ok": allowed; "noop": returns at once, changes nothing; "busy":
# allowed only with no request running (idle), else EngineBusyError; an exception class: refused with it.
# Columns follow STATES. Rows: the calls (add_sync is SyncEngine.generate, which steps on the caller's
# thread and so must not start on an engine that cannot step; add is the async Engine's, which queues).
_O, _N, _B = "ok", "noop", "busy"
_D, _C, _A, _W = EngineDeadError, EngineClosedError, EngineAsleepError, InconsistentWeightsError
TABLE: dict[str, tuple] = {
    #               dead closed asleep weights_missing paused pausing running
    "add":         (_D, _C, "ok_l1", _W, _O, _O, _O),
    "add_sync":    (_D, _C, _A, _W, EngineBusyError, EngineBusyError, _O),
    "pause":       (_D, _C, _O, _O, _O, _O, _O),
    "resume":      (_D, _C, _O, _W, _O, _O, _N),
    "update":      (_D, _C, _A, _O, _O, _B, _B),
    "sleep":       (_D, _C, "same_level", _O, _O, _B, _B),
    "wake_up":     (_D, _C, _O, _N, _N, _N, _N),
    "score":       (_D, _C, _A, _W, _O, _O, _O),
    "abort":       (_D, _C, _O, _O, _O, _O, _O),
    "step":        (False, False, False, False, False, True, True),  # may the loop plan a step?
}


class EngineControl:
    """The control state machine of one engine. Not thread-safe: callers hold the engine's lock."""

    def __init__(self, scheduler: "Scheduler", tensor_names: Callable[[], Iterable[str]] = tuple) -> None:
        self.scheduler = scheduler
        self._tensor_names = tensor_names  # every tensor of the checkpoint (what sleep level 2 drops)
        self.run = Run.RUNNING
        self.mode: str | None = None  # while PAUSING
        self.sleep_level = 0  # 0 awake, else the level
        self.missing: set[str] = set()  # tensors not loaded: dropped by sleep(2) or half-updated
        self.missing_reason = ""
        self.life = Life.OPEN
        self.death: BaseException | None = None  # the error of a dead (or closed) engine
        self.weight_version = 0
        self.holds = 0  # executor maintenance between steps (a copy, sleep, wake, score): no step starts
        self._flushed = False
        self._recompute = False  # resume(recompute_kv=True): preempt the kept requests at the next poll
        self._waiters: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ the table

    @property
    def state(self) -> str:
        if self.life is Life.DEAD:
            return "dead"
        if self.life is Life.CLOSED:
            return "closed"
        if self.sleep_level:
            return "asleep"
        if self.missing:
            return "weights_missing"
        return self.run.value

    def check(self, op: str, level: int | None = None) -> str:
        """Apply TABLE to `op` now: raise its refusal, or return "ok" / "noop"."""
        state = self.state
        rule = TABLE[op][STATES.index(state)]
        if isinstance(rule, type):
            raise rule(self._refusal(op, state))
        if rule == _B:  # requests preempted for room count: they resume with the tokens they have
            num = self.scheduler.num_running + self.scheduler.num_started_waiting
            if num and self.run is not Run.PAUSED:
                raise EngineBusyError(f"{_NAMES[op]} needs the engine paused or idle: {num} request(s) are "
                                      f"running; call pause() first (mode 'abort', 'wait' or 'keep')")
            return _O
        if rule == "ok_l1":  # asleep: queue at level 1 (weights kept); level 2 dropped them
            if self.sleep_level == 2:
                raise InconsistentWeightsError(self._refusal(op, "weights_missing"))
            return _O
        if rule == "same_level":
            if level == self.sleep_level:
                return _N
            raise EngineAsleepError(f"sleep({level}): the engine is already asleep at level "
                                    f"{self.sleep_level}; call wake_up() first to change the level")
        return rule

    def _refusal(self, op: str, state: str) -> str:
        what = _NAMES[op]
        if state in ("dead", "closed"):
            return f"{what}: the engine is {state}" + (f" ({self.death})" if self.death is not None else "")
        if state == "asleep":
            return f"{what}: the engine is asleep (level {self.sleep_level}); call wake_up() first"
        if state == "weights_missing":
            return (f"{what}: {len(self.missing)} tensor(s) are not loaded ({self.missing_reason}): the model "
                    f"serves nothing until update_weights / load_weights covers them")
        return (f"{what}: the engine is {state} and this call steps on the calling thread, so it could never "
                f"finish; call resume() first (or use the async Engine, whose requests queue while paused)")

    @property
    def may_step(self) -> bool:
        """May the loop plan a step now (no pause reached, awake, weights loaded, no maintenance)?"""
        return TABLE["step"][STATES.index(self.state)] and self.holds == 0

    @property
    def needs_loop(self) -> bool:
        """Something the loop must decide on between steps (the stepping thread hands back)."""
        return self.run is not Run.RUNNING or self._recompute or not self.may_step  # may_step covers holds

    # ------------------------------------------------------------------ pause / resume

    def pause(self, mode: str, on_paused: Callable[[], None] | None = None) -> None:
        """Start pausing in `mode` (the caller aborts live requests first for "abort"); `on_paused` is
        called once paused, or when a resume, close or death makes that moot."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.check("pause")
        self._check_pause_can_finish(mode)
        if self.run is Run.PAUSED:
            if on_paused is not None:
                on_paused()
            return
        if on_paused is not None:
            self._waiters.append(on_paused)
        if self.run is Run.RUNNING or _STRENGTH[mode] > _STRENGTH[self.mode or "wait"]:
            if self.run is Run.RUNNING:
                self._flushed = False
            self.run, self.mode = Run.PAUSING, mode
        # "wait" still readmits requests it preempted for room (they must finish under these weights)
        self.scheduler.admission = "started" if self.mode == "wait" else "none"
        log.info("engine_pausing", mode=self.mode)

    def resume(self, recompute_kv: bool = False) -> str:
        """Resume (a pause in progress is cancelled); "noop" on a running engine."""
        if self.check("resume") == _N:
            return _N
        self._recompute = self._recompute or (recompute_kv and self.run is Run.PAUSED)
        self.run, self.mode = Run.RUNNING, None
        self.scheduler.admission = "all"
        self._release_waiters()
        log.info("engine_resumed", recompute_kv=recompute_kv)
        return _O

    def poll(self) -> bool:
        """With no step in flight: apply what the state implies for the scheduler; True if the loop may step."""
        sched = self.scheduler
        if self._recompute and self.may_step:
            self._recompute = False
            log.info("kept_requests_recompute", requests=sched.preempt_all())
        if self.run is Run.PAUSING:
            steppable = self.state == "pausing"  # not asleep, weights loaded
            if self.mode == "wait" and (sched.num_running or sched.num_started_waiting):
                return self.may_step  # step until every admitted request has finished (or wait for wake_up)
            if self.mode == "keep" and steppable and not self._flushed and sched.needs_flush():
                self._flushed = True
                sched.force_boundary()  # one more step: the flush
                return self.may_step
            self.run, self.mode = Run.PAUSED, None
            log.info("engine_paused", kept=sched.num_running, queued=len(sched.waiting))
            self._release_waiters()
        return self.may_step

    def _check_pause_can_finish(self, mode: str) -> None:
        """pause("wait") needs steps; refuse it where none can run and admitted requests would wait forever."""
        if mode == "wait" and self.state in ("asleep", "weights_missing") and (
                self.scheduler.num_running or self.scheduler.num_started_waiting):
            error = EngineAsleepError if self.state == "asleep" else InconsistentWeightsError
            raise error(f"pause('wait'): {self._refusal('pause', self.state).split(': ', 1)[1]}; admitted "
                        f"requests cannot finish (use 'keep' or 'abort', or wake_up / load weights first)")

    # ------------------------------------------------------------------ sleep / weights

    def fell_asleep(self, level: int) -> None:
        """The executor has slept: record it (level 2 dropped every tensor)."""
        self.sleep_level = level
        if level == 2:
            self.missing |= set(self._tensor_names())
            self.missing_reason = "sleep(level=2) dropped the weights"

    def woke_up(self) -> None:
        self.sleep_level = 0

    def weights_copied(self, copied: Iterable[str], failed: bool, version: int | None) -> int:
        """After a copy: a failure leaves the copied tensors missing (half-updated); a success removes them,
        and once nothing is missing bumps the version. Any change drops the prefix cache (its KV came
        from the old weights). Returns the version new tokens get."""
        copied = set(copied)
        if copied:
            self.scheduler.reset_prefix_cache()
        if failed:
            if copied:
                self.missing |= copied
                self.missing_reason = "a weight update failed part-way: the model is half-updated"
            return self.weight_version
        self.missing -= copied
        if self.missing:
            log.warning("weights_still_missing", missing=sorted(self.missing)[:5], num=len(self.missing))
            return self.weight_version
        self.weight_version = self.weight_version + 1 if version is None else version
        self.scheduler.weight_version = self.weight_version
        log.info("weights_updated", version=self.weight_version, tensors=len(copied))
        return self.weight_version

    # ------------------------------------------------------------------ the end

    def close(self, error: BaseException | None = None) -> None:
        """Closed (error None or EngineClosedError) or dead (EngineDeadError): terminal; waiters released."""
        if self.life is not Life.OPEN:
            return
        self.life = Life.DEAD if isinstance(error, EngineDeadError) else Life.CLOSED
        self.death = error
        self._release_waiters()

    def _release_waiters(self) -> None:
        waiters, self._waiters = self._waiters, []
        for wake in waiters:
            wake()

    def snapshot(self) -> dict[str, object]:
        """For stats(): the state and its facets."""
        return {"control_state": self.state, "is_paused": self.run is Run.PAUSED,
                "is_sleeping": self.sleep_level > 0, "sleep_level": self.sleep_level,
                "weights_missing": len(self.missing), "weight_version": self.weight_version}


_NAMES = {"add": "generate", "add_sync": "generate", "pause": "pause", "resume": "resume",
          "update": "update_weights", "sleep": "sleep", "wake_up": "wake_up", "score": "score", "abort": "abort",
          "step": "step"}
