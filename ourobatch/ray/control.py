"""Engine calls broadcast to every replica (weights, pause / resume, sleep / wake_up, prefix cache), and
what a restarted replica must catch up on before it serves again.

Every broadcast calls ``Engine.<method>`` by name on each ready replica (EngineActor.call) and holds one
lock, which a restarting replica also takes while it catches up, so a replica either took part in a
broadcast or replays it: never neither. The catch-up log holds the weight updates since the checkpoint
(each update's tensors are one object in Ray's object store, put there once and read by every replica;
an update whose tensor names later updates all overwrite is dropped from the log; a wake_up after
sleep(2), which leaves the weights missing until a full load, is an entry too, replayed as sleep(2) +
wake_up) and the pause and sleep state, so a restarted replica serves exactly what the others serve.

The pool answers from that record too where every replica's answer is certain (``refusal``,
``weights_missing``): a broadcast reaches only the ready replicas, and with none ready it would otherwise
succeed on nobody and change the record the way no replica would (sleep(1) while asleep at level 2 once
made restarted replicas sleep at level 1 with their checkpoint's weights, serving while the pool had none).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ourobatch.log import get_logger
from scheduler.errors import EngineAsleepError, InconsistentWeightsError

from .actor import BROADCAST_METHODS
from .replica import Replica, ReplicaState, await_ref, cause_of, is_actor_failure

log = get_logger()

VERSIONED = ("update_weights", "load_weights")
UNDO = {"pause": "resume", "sleep": "wake_up"}  # what puts a replica back after a broadcast others refused
DROP = "drop"  # a log entry: sleep(2) then wake_up, after which the weights are missing until a full load


@dataclass
class _LogEntry:
    method: str  # "update_weights" | "load_weights" | DROP
    payload: Any  # ObjectRef of the (name, tensor) list, or the checkpoint path (None for DROP)
    version: int
    names: frozenset[str] | None  # tensor names of an update (None: a checkpoint folder, names unknown)


class Control:
    """The pool's broadcasts and catch-up log. Runs on the pool's event loop."""

    def __init__(self, timeout_s: float, on_failure: Callable[[Replica, str], None]) -> None:
        self.lock = asyncio.Lock()
        self.timeout_s = timeout_s
        self.weight_version = 0
        self._version_tried = 0  # the version of an update some replicas took though it failed on others
        self._log: list[_LogEntry] = []
        self._paused: tuple[tuple, dict] | None = None  # pause()'s arguments while paused
        self._asleep: tuple[tuple, dict] | None = None  # sleep()'s arguments while asleep
        self._on_failure = on_failure
        self.inconsistent: str | None = None  # set when a broadcast changed weights on some replicas only
        self.keep_versions: set[int] = set()  # weight versions installed under pause("keep")

    @property
    def paused(self) -> bool:
        return self._paused is not None

    @property
    def pause_mode(self) -> str | None:
        """The mode of the pause in force (Engine.pause's default is "abort"); None when not paused."""
        if self._paused is None:
            return None
        args, kwargs = self._paused
        return args[0] if args else kwargs.get("mode", "abort")

    @property
    def sleep_level(self) -> int:
        """The level of the sleep in force (Engine.sleep's default is 1); 0 when awake."""
        if self._asleep is None:
            return 0
        args, kwargs = self._asleep
        return args[0] if args else kwargs.get("level", 1)

    @property
    def asleep(self) -> bool:
        return self._asleep is not None

    @property
    def weights_missing(self) -> bool:
        """No replica serves weights: asleep at level 2, or woken from it with no update since."""
        return self.sleep_level == 2 or self._woken_without_weights

    @property
    def _woken_without_weights(self) -> bool:
        return not self.asleep and bool(self._log) and self._log[-1].method == DROP

    def refusal(self, method: str, args: tuple, kwargs: dict) -> Exception | None:
        """The error every replica would refuse `method` with, by the engine's table
        (ourobatch/runtime/control.py) applied to the state this record holds; None where it would not."""
        level = self.sleep_level
        want = (args[0] if args else kwargs.get("level", 1)) if method == "sleep" else level
        if level and want != level:
            return EngineAsleepError(f"sleep({want}): the pool is already asleep at level {level}; call "
                                     f"wake_up() first to change the level")
        if method in VERSIONED and level:
            return EngineAsleepError(f"{method}: the pool is asleep (level {level}); call wake_up() first")
        if method == "resume" and self._woken_without_weights:
            return InconsistentWeightsError("resume: the pool's replicas hold no weights since sleep(2); "
                                            "update_weights / load_weights restores them")
        return None

    async def call(self, replica: Replica, method: str, *args: Any, **kwargs: Any) -> Any:
        """Engine.<method> on one replica, bounded by timeout_s; the actor's own exception is raised."""
        try:
            return await asyncio.wait_for(await_ref(replica.actor.call.remote(method, *args, **kwargs)),
                                          self.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"replica {replica.index}: Engine.{method} did not return within "
                               f"{self.timeout_s}s (control_timeout_s)") from None
        except Exception as exc:
            cause = cause_of(exc)
            if cause is exc:
                raise
            raise cause from None

    async def broadcast(self, replicas: Iterable[Replica], method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call Engine.<method> on every ready replica; returns their results (replica order).

        A replica that dies meanwhile is left out (it catches up when it is back); any other error is
        raised once every call has ended."""
        assert method in BROADCAST_METHODS, method  # the pool's own call sites name them
        async with self.lock:
            return await self._broadcast_locked(list(replicas), method, args, kwargs)

    async def _broadcast_locked(self, replicas: list[Replica], method: str, args: tuple, kwargs: dict) -> list[Any]:
        refused = self.refusal(method, args, kwargs)
        if refused is not None:
            raise refused
        targets = [r for r in replicas if r.state == ReplicaState.READY]
        outcomes = await asyncio.gather(*(self.call(r, method, *args, **kwargs) for r in targets),
                                        return_exceptions=True)
        results, errors = [], []
        for r, outcome in zip(targets, outcomes):
            if isinstance(outcome, BaseException) and is_actor_failure(outcome):
                self._on_failure(r, f"died during {method}: {outcome}")
            elif isinstance(outcome, BaseException):
                errors.append((r, outcome))
            else:
                results.append(outcome)
        if errors:
            if method in VERSIONED and results:  # some replicas took the new weights, some did not
                self.inconsistent = (f"{method} succeeded on {len(results)} replica(s) and failed on replica "
                                     f"{errors[0][0].index}: {errors[0][1]}")
                # those replicas hold its version now: the retry takes the next one (an engine refuses a
                # version it is at, since versions order the weights each token came from)
                self._version_tried = max(self._version_tried, kwargs["version"])
                log.error("pool_weights_inconsistent", reason=self.inconsistent)
            elif self._undoable(method, args, kwargs):
                await self._undo(method, targets)
            raise errors[0][1]
        if method in ("pause", "resume"):
            self._paused = (args, kwargs) if method == "pause" else None
        elif method in ("sleep", "wake_up"):
            if method == "wake_up" and self.sleep_level == 2:  # awake without weights: a restart must be too
                self._log.append(_LogEntry(DROP, None, self.weight_version, None))
            self._asleep = (args, kwargs) if method == "sleep" else None
        return results

    def _undoable(self, method: str, args: tuple, kwargs: dict) -> bool:
        """A pause of a running pool, or a sleep(1) of an awake one: what the replicas that took it can be
        put back from (a sleep(2) dropped their weights: it cannot)."""
        if method == "pause":
            return self._paused is None
        level = args[0] if args else kwargs.get("level", 1)
        return method == "sleep" and self._asleep is None and level == 1

    async def _undo(self, method: str, targets: list[Replica]) -> None:
        """After a pause or sleep(1) refused (or timed out) on some replicas, put every one back as it was
        (resume / wake_up: a no-op where it did not take), so the pool is in one state, the one it records,
        as an engine that refuses a call is unchanged. Best effort: a replica that fails here is logged."""
        inverse = UNDO[method]
        ready = [r for r in targets if r.state == ReplicaState.READY]
        outcomes = await asyncio.gather(*(self.call(r, inverse) for r in ready), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                log.error("pool_undo_failed", method=method, undo=inverse,
                          error=f"{type(outcome).__name__}: {outcome}")

    async def update(self, replicas: Iterable[Replica], method: str, payload: Any,
                     names: frozenset[str] | None, version: int | None) -> int:
        """update_weights / load_weights on every ready replica with one version; returns it."""
        assert method in VERSIONED, method
        async with self.lock:
            new_version = max(self.weight_version, self._version_tried) + 1 if version is None else version
            results = await self._broadcast_locked(list(replicas), method, (payload,), {"version": new_version})
            wrong = [v for v in results if v != new_version]
            if wrong:
                self.inconsistent = f"{method}: replicas report versions {sorted(set(results))}, not {new_version}"
                raise RuntimeError(self.inconsistent)
            self.inconsistent = None
            self.weight_version = new_version
            if self.pause_mode == "keep":  # kept requests continue under these weights by design
                self.keep_versions.add(new_version)
            self._record(_LogEntry(method, payload, new_version, names))
            return new_version

    def _record(self, entry: _LogEntry) -> None:
        covered: set[str] = set(entry.names or ())
        kept = [entry]
        for old in reversed(self._log):  # newest first: drop an update whose every tensor is overwritten later
            if old.names is not None and old.names <= covered:
                continue
            kept.append(old)
            covered |= old.names or set()
        self._log = kept[::-1]

    async def catch_up(self, replica: Replica) -> None:
        """Bring a restarted replica (fresh from its checkpoint) to the pool's weights and state. Call
        with the lock held."""
        for entry in self._log:
            if entry.method == DROP:  # the others woke from sleep(2): their weights are gone until a full load
                await self.call(replica, "sleep", 2)
                await self.call(replica, "wake_up")
                continue
            version = await self.call(replica, entry.method, entry.payload, version=entry.version)
            if version != entry.version:
                raise RuntimeError(f"replica {replica.index}: {entry.method} replay reports version {version}, "
                                   f"expected {entry.version}")
        if self._paused is not None:
            await self.call(replica, "pause", *self._paused[0], **self._paused[1])
        if self._asleep is not None:
            await self.call(replica, "sleep", *self._asleep[0], **self._asleep[1])
        if self._log:
            log.info("replica_caught_up", replica=replica.index, weight_version=self.weight_version,
                     updates=len(self._log))
