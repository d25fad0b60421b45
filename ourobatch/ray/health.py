"""How the pool keeps a replica alive: notice its death at once, wait for Ray's restart, catch it up, arm it.

One monitor task per replica keeps an ``actor.watch()`` call pending: a killed actor fails it, an engine
that dies inside a live actor returns it (the pool then kills the actor, so Ray restarts the process). A
request that sees its replica fail marks it down too; if watch has not noticed, a probe decides whether
the same process still serves (a passing error) or not.
"""

from __future__ import annotations

import asyncio

import ray

from ourobatch.log import get_logger

from .replica import Replica, ReplicaState, await_ref, cause_of, is_actor_failure, is_gone_for_good

log = get_logger()

RESTART_POLL_S = 0.2  # between ready() probes of a restarting actor
PROBE_TIMEOUT_S = 30.0  # a replica that does not answer ready() within this is killed and restarted


class ReplicaHealth:
    """EnginePool's replica monitors (a mixin: it uses the pool's replicas, control and notify)."""

    def _mark_down(self, replica: Replica, reason: str) -> None:
        """A request or a call saw the replica fail: stop routing to it; its monitor takes over."""
        if replica.state == ReplicaState.READY:
            replica.state = ReplicaState.DOWN
            replica.last_failure = reason
            log.warning("replica_down", replica=replica.index, reason=reason)
            self._notify()
        replica.suspect.set()

    async def _monitor(self, replica: Replica) -> None:
        """Owns the replica's life after startup: notice its death, wait for Ray's restart, catch it up."""
        while not self._closing:
            reason = await self._wait_for_failure(replica)
            self._mark_down(replica, reason)
            if not await self._restart(replica):
                replica.state = ReplicaState.DEAD
                log.error("replica_dead", replica=replica.index, reason=replica.last_failure)
                self._notify()
                return

    async def _wait_for_failure(self, replica: Replica) -> str:
        watch = asyncio.ensure_future(await_ref(replica.actor.watch.remote()))
        suspect: asyncio.Future | None = None
        try:
            while True:
                replica.suspect.clear()
                suspect = asyncio.ensure_future(replica.suspect.wait())
                await asyncio.wait([watch, suspect], return_when=asyncio.FIRST_COMPLETED)
                suspect.cancel()
                if watch.done():
                    if watch.exception() is not None:
                        return f"actor failed: {cause_of(watch.exception())}"
                    # the engine stopped inside a live actor (EngineDeadError): restart the whole process
                    ray.kill(replica.actor, no_restart=False)
                    return f"engine stopped: {watch.result()}"
                if not await self._responds(replica):  # a request saw a failure that watch has not
                    return replica.last_failure or "unresponsive"
                if replica.state == ReplicaState.DOWN:  # a passing error: the same process still serves
                    replica.state = ReplicaState.READY
                    self._notify()
        finally:
            watch.cancel()
            if suspect is not None:
                suspect.cancel()

    async def _responds(self, replica: Replica) -> bool:
        try:
            info = await asyncio.wait_for(await_ref(replica.actor.ready.remote()), PROBE_TIMEOUT_S)
        except asyncio.TimeoutError:
            ray.kill(replica.actor, no_restart=False)  # alive but stuck: restart it
            return False
        except Exception:  # noqa: BLE001 - any failure means it is not the process we armed
            return False
        return info.get("pid") == replica.info.get("pid")

    async def _restart(self, replica: Replica) -> bool:
        """Wait for Ray to restart the actor, catch it up and arm it; False if it will not come back."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ready_timeout_s
        while not self._closing and loop.time() < deadline:
            try:
                info = await asyncio.wait_for(await_ref(replica.actor.ready.remote()), deadline - loop.time())
                async with self.control.lock:
                    await self.control.catch_up(replica)
                    await await_ref(replica.actor.arm.remote())
                    replica.info, replica.state = info, ReplicaState.READY
                    replica.restarts += 1
            except Exception as exc:  # noqa: BLE001
                if is_gone_for_good(exc):
                    replica.last_failure = f"{exc}"
                    return False
                if not is_actor_failure(exc) and not isinstance(exc, asyncio.TimeoutError):
                    log.warning("replica_restart_failed", replica=replica.index, error=f"{cause_of(exc)}")
                    ray.kill(replica.actor, no_restart=False)  # e.g. the engine failed to start: try again
                await asyncio.sleep(RESTART_POLL_S)
                continue
            log.info("replica_restarted", replica=replica.index, restarts=replica.restarts, pid=info.get("pid"))
            self._notify()
            return True
        return False
