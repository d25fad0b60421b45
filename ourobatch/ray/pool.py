"""EnginePool: N Engine replicas on Ray, used like one Engine (docs/scaling.md).

Theory of operation. Each replica is an EngineActor placed in its own bundle of one placement group
(one GPU each on CUDA). A caller's request is a Flight; its engine requests (SubRequests) each run in a
task owned by the pool, which picks a replica (routing.Router: least outstanding tokens, prompt-prefix
affinity), calls the actor's streaming ``stream`` method and folds the outputs into the Flight, which
the caller's ``generate`` / ``stream`` / ``generate_batch`` reads. Admission and KV backpressure stay
per replica, in its Engine (its waiting queue and watermark); the router's load steers new requests
away from a backed-up replica.

Faults. One monitor task per replica keeps an ``actor.watch()`` call pending, so a killed actor or a
dead engine is seen at once. Its in-flight requests fail with ReplicaDiedError, or with
``retry_aborted=True`` continue on another replica from prompt + the tokens they already have. Ray
restarts the actor (``max_restarts``); the monitor waits for it, replays what it missed (control.py),
arms it, and the router uses it again. Every wait a caller can be stuck in is bounded: no ready replica
within ``ready_timeout_s`` is a ReplicaDiedError, a control call past ``control_timeout_s`` a TimeoutError.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any, Iterable, Mapping, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tqdm.auto import tqdm

from ourobatch.config import EngineConfig, batch_arguments, resolve_config
from ourobatch.scheduler.errors import (EngineClosedError, EngineDeadError, InconsistentWeightsError,
                                        ReplicaDiedError, RequestRejectedError)
from ourobatch.scheduler.frontend import request_seed
from ourobatch.scheduler.log import get_logger
from ourobatch.scheduler.outputs import RequestOutput
from ourobatch.scheduler.params import RequestOutputKind, SamplingParams

from .actor import EngineActor, ReplicaNotArmedError
from .control import Control
from .flight import Flight, PoolStream, SubRequest
from .replica import (Replica, ReplicaState, await_ref, cancel_generator, cause_of, is_actor_failure,
                      is_gone_for_good)
from .routing import Router
from .stats import pool_stats

log = get_logger()

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
RESTART_POLL_S = 0.2  # between ready() probes of a restarting actor


class EnginePool:
    """N Engine replicas as Ray actors behind the Engine API. Use it from one asyncio event loop."""

    def __init__(self, config: EngineConfig | None = None, num_replicas: int = 1, *, retry_aborted: bool = False,
                 max_retries: int = 3, num_gpus_per_replica: float | None = None, num_cpus_per_replica: float = 1,
                 max_restarts: int = -1, placement_strategy: str = "PACK", affinity_tokens: int | None = None,
                 affinity_slack_tokens: int = 8192, ready_timeout_s: float = 600.0,
                 control_timeout_s: float = 600.0, max_concurrency: int = 65536,
                 actor_options: Mapping[str, Any] | None = None, **config_fields: Any) -> None:
        self.config = resolve_config(config, config_fields)
        if placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {placement_strategy!r}")
        for name, value in (("ready_timeout_s", ready_timeout_s), ("control_timeout_s", control_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        on_cuda = self.config.device.startswith("cuda")
        self.num_gpus_per_replica = (1 if on_cuda else 0) if num_gpus_per_replica is None else num_gpus_per_replica
        if on_cuda and not self.num_gpus_per_replica:
            raise ValueError(f"num_gpus_per_replica must be > 0 for device={self.config.device!r}")
        self.num_cpus_per_replica = num_cpus_per_replica
        self.router = Router(num_replicas, self.config.block_size, affinity_tokens, affinity_slack_tokens)
        self.num_replicas = num_replicas
        self.retry_aborted = retry_aborted
        self.max_retries = max_retries
        self.max_restarts = max_restarts
        self.placement_strategy = placement_strategy
        self.ready_timeout_s = ready_timeout_s
        self.max_concurrency = max_concurrency
        self.actor_options = dict(actor_options or {})
        # Ray gives each actor its own GPU as CUDA_VISIBLE_DEVICES, so inside it the device is "cuda".
        self.replica_config = dataclasses.replace(self.config, device="cuda") if on_cuda else self.config
        self.control = Control(control_timeout_s, self._mark_down)
        self.replicas: list[Replica] = []
        self._placement_group: Any = None
        self._flights: dict[str, Flight] = {}
        self._tasks: set[asyncio.Task] = set()
        self._changed = asyncio.Event()  # replaced on every replica state change
        self._started = False
        self._closing = False
        self._num_unseeded = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self.counters = {"requests_retried": 0, "requests_failed_replica_died": 0}

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "EnginePool":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Place the replicas (one placement-group bundle each), load the model on every one, wait until all
        are ready (ready_timeout_s). A startup error (a bad checkpoint) is raised as itself."""
        if self._started:
            raise RuntimeError("EnginePool.start() runs once; make a new pool to start again")
        self._started = True
        self._loop = asyncio.get_running_loop()
        if not ray.is_initialized():
            ray.init()  # a local cluster; call ray.init(address="auto") first to join a running one
        bundle = {"CPU": self.num_cpus_per_replica}
        if self.num_gpus_per_replica:
            bundle["GPU"] = self.num_gpus_per_replica
        self._placement_group = placement_group([dict(bundle) for _ in range(self.num_replicas)],
                                                strategy=self.placement_strategy)
        try:
            await asyncio.wait_for(await_ref(self._placement_group.ready()), self.ready_timeout_s)
            for i in range(self.num_replicas):
                options = dict(num_cpus=self.num_cpus_per_replica, num_gpus=self.num_gpus_per_replica,
                               max_restarts=self.max_restarts, max_concurrency=self.max_concurrency,
                               scheduling_strategy=PlacementGroupSchedulingStrategy(
                                   self._placement_group, placement_group_bundle_index=i))
                actor = EngineActor.options(**{**options, **self.actor_options}).remote(self.replica_config, i, False)
                self.replicas.append(Replica(i, actor))
            infos = await asyncio.wait_for(asyncio.gather(*(await_ref(r.actor.ready.remote()) for r in self.replicas)),
                                           self.ready_timeout_s)
            await asyncio.gather(*(await_ref(r.actor.arm.remote()) for r in self.replicas))
        except asyncio.TimeoutError:
            await self.aclose()
            raise TimeoutError(f"the pool's {self.num_replicas} replicas ({bundle} each) were not ready within "
                               f"{self.ready_timeout_s}s (ready_timeout_s); the cluster has "
                               f"{ray.available_resources()} available") from None
        except BaseException as exc:
            await self.aclose()
            cause = cause_of(exc)
            if cause is exc:
                raise
            raise cause from None
        for r, info in zip(self.replicas, infos):
            r.info, r.state = info, ReplicaState.READY
            r.monitor = asyncio.ensure_future(self._monitor(r))
        log.info("pool_ready", replicas=self.num_replicas, nodes=len({i["node_id"] for i in infos}))

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until every replica that is not dead for good is ready (a restart has caught up)."""
        deadline = asyncio.get_running_loop().time() + (timeout_s or self.ready_timeout_s)
        while any(r.state in (ReplicaState.STARTING, ReplicaState.DOWN) for r in self.replicas):
            self._check_open()
            await self._wait_changed(deadline, "every replica to be ready")

    async def aclose(self) -> None:
        """Close every replica's engine (live requests end with finish_reason 'abort'), kill the actors,
        remove the placement group. Later calls raise EngineClosedError."""
        if self._closing:
            return
        self._closing = True
        self._notify()
        monitors = [r.monitor for r in self.replicas if r.monitor is not None]
        for m in monitors:
            m.cancel()
        await asyncio.gather(*monitors, return_exceptions=True)
        live = [r for r in self.replicas if r.state == ReplicaState.READY]
        if live:
            await asyncio.wait([asyncio.ensure_future(await_ref(r.actor.shutdown.remote())) for r in live],
                               timeout=self.control.timeout_s)
        for r in self.replicas:
            r.state = ReplicaState.CLOSED
            ray.kill(r.actor, no_restart=True)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.control.timeout_s)
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)
            self._placement_group = None

    def _check_open(self) -> None:
        if not self._started or self._loop is None:
            raise EngineClosedError("the pool is not started: use `async with EnginePool(...)` or `await start()`")
        if self._closing:
            raise EngineClosedError("the pool is closed")

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _wait_changed(self, deadline: float, what: str) -> None:
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(self._changed.wait(), max(remaining, 0))
        except asyncio.TimeoutError:
            raise ReplicaDiedError(f"gave up waiting for {what}: no change within ready_timeout_s="
                                   f"{self.ready_timeout_s}s ({self._states()})") from None

    def _states(self) -> str:
        return ", ".join(f"replica {r.index}: {r.state.name.lower()}" for r in self.replicas)

    # ------------------------------------------------------------------ replica health

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

    async def _responds(self, replica: Replica) -> bool:
        try:
            info = await asyncio.wait_for(await_ref(replica.actor.ready.remote()), 30)
        except asyncio.TimeoutError:
            ray.kill(replica.actor, no_restart=False)  # alive but stuck: restart it
            return False
        except Exception:  # noqa: BLE001 - any failure means it is not the process we armed
            return False
        return info.get("pid") == replica.info.get("pid")

    async def _restart(self, replica: Replica) -> bool:
        """Wait for Ray to restart the actor, catch it up and arm it; False if it will not come back."""
        deadline = asyncio.get_running_loop().time() + self.ready_timeout_s
        while not self._closing and asyncio.get_running_loop().time() < deadline:
            try:
                info = await asyncio.wait_for(await_ref(replica.actor.ready.remote()), self.ready_timeout_s)
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

    # ------------------------------------------------------------------ requests

    def _add(self, prompt_token_ids: Sequence[int], params: Any, request_id: str | None,
             kind: RequestOutputKind | None) -> Flight:
        """Check a request, give it a seed as an Engine would, and start placing it."""
        self._check_open()
        params = SamplingParams.coerce(params)
        if params.stop:
            raise ValueError(f"SamplingParams.stop={list(params.stop)!r}: stop strings need a tokenizer; use "
                             f"stop_token_ids with the pool")
        if params.n > self.config.max_num_seqs:
            raise RequestRejectedError(f"SamplingParams.n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__iter__"):
            raise TypeError(f"prompt_token_ids must be a list of ints, got {type(prompt_token_ids).__name__}")
        prompt = list(prompt_token_ids)
        if request_id is None:
            request_id = f"req-{uuid.uuid4().hex}"
        elif not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str or None, got {request_id!r}")
        if request_id in self._flights:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        if params.seed is None:  # the seed an Engine would give its i-th unseeded request
            params = params.with_seed(request_seed(self.config.seed, self._num_unseeded))
            self._num_unseeded += 1
        caller_kind = params.output_kind if kind is None else kind
        # The replica sends deltas (the pool rebuilds what the caller asked for), or one final output
        # when nobody needs progress (no stream, no retry).
        engine_kind = (RequestOutputKind.FINAL_ONLY if caller_kind == RequestOutputKind.FINAL_ONLY
                       and not self.retry_aborted else RequestOutputKind.DELTA)
        flight = Flight(request_id, prompt, params, caller_kind)
        flight.retry = self.retry_aborted
        self._flights[request_id] = flight
        self._start(SubRequest(flight, request_id, prompt, dataclasses.replace(params, output_kind=engine_kind),
                               list(range(params.n))))
        return flight

    def _start(self, sub: SubRequest) -> None:
        sub.flight.subs.append(sub)
        sub.task = asyncio.ensure_future(self._run(sub))
        self._tasks.add(sub.task)
        sub.task.add_done_callback(self._tasks.discard)

    async def _place(self, sub: SubRequest) -> Replica:
        deadline = asyncio.get_running_loop().time() + self.ready_timeout_s
        while True:
            if self._closing:
                raise EngineClosedError("the pool is closed")
            if self.control.inconsistent:
                raise InconsistentWeightsError(f"the pool's replicas hold different weights ({self.control.inconsistent}); "
                                               f"a complete update_weights / load_weights restores service")
            loads = [r.load if r.state == ReplicaState.READY else None for r in self.replicas]
            index = self.router.choose(sub.prompt_token_ids, loads)
            if index is not None:
                return self.replicas[index]
            if all(r.state >= ReplicaState.DEAD for r in self.replicas):
                raise ReplicaDiedError(f"every replica of the pool is dead ({self._states()})")
            await self._wait_changed(deadline, "a ready replica")

    async def _run(self, sub: SubRequest) -> None:
        """Run one engine request to its end: place it, stream it, and on a replica's death fail or retry."""
        flight = sub.flight
        try:
            while True:
                if sub.aborted >= set(sub.indexes):  # aborted before it reached a replica
                    return
                try:
                    replica = await self._place(sub)
                except (ReplicaDiedError, EngineClosedError, InconsistentWeightsError) as exc:
                    flight.fail(exc)
                    return
                outcome = await self._serve(replica, sub)
                if outcome != "unarmed":  # "unarmed": it never ran there (a restart): place it again
                    break
            if outcome == "died":
                if self._closing:
                    flight.finish_unplaced(sub.indexes, "abort")
                elif flight.retry and flight.num_retries < self.max_retries and not flight.abandoned:
                    self.counters["requests_retried"] += 1
                    log.info("request_retried", request_id=flight.request_id, failed_replica=replica.index)
                    for retry in flight.retry_subrequests(sub):
                        self._start(retry)
                else:
                    self.counters["requests_failed_replica_died"] += 1
                    flight.fail(ReplicaDiedError(
                        f"replica {replica.index} died with request {flight.request_id!r} in flight "
                        f"({replica.last_failure}); retry_aborted=True resubmits such requests to another replica"))
        finally:
            flight.subs.remove(sub)
            flight.event.set()

    async def _serve(self, replica: Replica, sub: SubRequest) -> str:
        """Stream `sub` from `replica` into its flight: "done", "unarmed" or "died"."""
        flight = sub.flight
        sub.replica = replica.index
        sub.charged = sub.remaining()
        replica.load += sub.charged
        replica.subs.add(sub)
        replica.requests_routed += 1
        try:
            sub.generator = replica.actor.stream.options(
                num_returns="streaming", _generator_backpressure_num_objects=2,  # deltas coalesce in the engine
            ).remote(sub.prompt_token_ids, sub.params, sub.engine_id)
            for engine_id in sub.pending_aborts():
                replica.actor.abort.remote(engine_id)
            async for ref in sub.generator:
                added = flight.merge(sub, await ref)
                paid = min(added, sub.charged)
                sub.charged -= paid
                replica.load -= paid
            return "done"
        except asyncio.CancelledError:
            cancel_generator(sub.generator)
            raise
        except Exception as exc:  # noqa: BLE001 - sorted below; nothing is lost silently
            cause = cause_of(exc)
            if isinstance(cause, ReplicaNotArmedError):
                return "unarmed"
            if is_actor_failure(exc) or isinstance(cause, EngineDeadError) or (
                    isinstance(cause, EngineClosedError) and not self._closing):
                cancel_generator(sub.generator)
                self._mark_down(replica, f"{type(cause).__name__}: {cause}")
                return "died"
            flight.fail(cause)  # the request itself was refused (RequestRejectedError, ValueError, ...)
            return "done"
        finally:
            replica.load -= sub.charged
            sub.charged = 0
            replica.subs.discard(sub)
            sub.generator = None

    async def _final(self, flight: Flight) -> RequestOutput:
        try:
            while not flight.finished:
                await flight.wait()
            if flight.error is not None:
                raise flight.error
            return flight.output()
        finally:
            self._release(flight)

    def _release(self, flight: Flight) -> None:
        """The caller is gone: abort what still runs, forget the flight."""
        if self._flights.get(flight.request_id) is flight:
            del self._flights[flight.request_id]
        if not flight.finished:
            flight.abandoned = True
            self._abort(flight, None)

    def _release_later(self, flight: Flight) -> None:
        """_release from a finalizer, which may run on any thread: do it on the pool's loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._release, flight)

    def _abort(self, flight: Flight, index: int | None) -> bool:
        """Abort completion `index` (None: all) of a flight on the replicas that run it."""
        targets = [i for i, c in enumerate(flight.completions)
                   if c.finish_reason is None and (index is None or i == index)]
        if not targets:
            return False
        for sub in list(flight.subs):
            ids = sub.abort_ids(targets)
            if not ids:
                continue
            if sub.replica is None or sub.generator is None:  # not on a replica yet: end it here
                sub.mark_aborted(targets)
                if all(flight.completions[i].finish_reason is not None for i in sub.indexes) and sub.task:
                    sub.task.cancel()
                continue
            actor = self.replicas[sub.replica].actor
            for engine_id in ids:
                actor.abort.remote(engine_id)
        return True

    # ------------------------------------------------------------------ the Engine API

    async def generate(self, prompt_token_ids: Sequence[int], params: Any = None,
                       request_id: str | None = None) -> RequestOutput:
        """Generate for one prompt on one replica; the finished output (Engine.generate's contract).
        Raises ReplicaDiedError if the replica dies first and retry_aborted is off."""
        return await self._final(self._add(prompt_token_ids, params, request_id, RequestOutputKind.FINAL_ONLY))

    def stream(self, prompt_token_ids: Sequence[int], params: Any = None,
               request_id: str | None = None) -> PoolStream:
        """Queue a request now; an async iterator of its outputs per SamplingParams.output_kind."""
        return PoolStream(self, self._add(prompt_token_ids, params, request_id, None))

    async def abort(self, request_id: str) -> bool:
        """Abort a live request, or ``"{request_id}:{i}"`` completion i of one; whether it was live."""
        flight, index = self._flights.get(request_id), None
        if flight is None and ":" in request_id:
            parent, _, tail = request_id.rpartition(":")
            flight = self._flights.get(parent)
            if flight is None or not tail.isdigit() or flight.params.n == 1 or int(tail) >= flight.params.n:
                return False
            index = int(tail)
        return flight is not None and self._abort(flight, index)

    async def generate_batch(self, prompts: Sequence[Sequence[int]], params: Any = None, use_tqdm: bool = False,
                             request_ids: Sequence[str] | None = None) -> list[RequestOutput]:
        """Generate for many prompts across the replicas; outputs in prompt order. The first error (a
        ReplicaDiedError without retry_aborted) aborts the rest and is raised once."""
        flights: list[Flight] = []
        try:
            for prompt, p, request_id in batch_arguments(prompts, params, request_ids):
                flights.append(self._add(prompt, p, request_id, RequestOutputKind.FINAL_ONLY))
        except BaseException:
            for f in flights:
                self._release(f)
            raise
        bar = tqdm(total=len(flights), desc="generate", unit="req", disable=not use_tqdm)
        tasks = [asyncio.ensure_future(self._final(f)) for f in flights]
        for t in tasks:
            t.add_done_callback(lambda _: bar.update(1))
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            return [t.result() for t in tasks]
        finally:
            bar.close()
            for t in tasks:
                t.cancel()
            for f in flights:
                self._release(f)

    def replica_of(self, request_id: str) -> int | None:
        """The replica a live request runs on (the first, for a retried n > 1 request); None if unknown."""
        flight = self._flights.get(request_id)
        placed = [s.replica for s in flight.subs if s.replica is not None] if flight else []
        return placed[0] if placed else None

    @property
    def actors(self) -> list[Any]:
        """The EngineActor handles, by replica index."""
        return [r.actor for r in self.replicas]

    def stats(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The replicas' Engine.stats() summed (counters add up, kv_usage is recomputed), with the pool's
        own counters and a ``replicas`` list of each replica's stats, state and load."""
        self._check_open()
        return pool_stats(self.replicas, self.counters, self.control.weight_version, timeout_s)

    # ------------------------------------------------------------------ broadcasts

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], *, version: int | None = None) -> int:
        """Engine.update_weights on every replica: the tensors go to Ray's object store once (on the CPU),
        every replica copies them; returns the version all replicas report."""
        self._check_open()
        items = [(name, t.detach().cpu() if hasattr(t, "detach") else t) for name, t in named_tensors]
        return await self.control.update(self.replicas, "update_weights", ray.put(items),
                                         frozenset(name for name, _ in items), version)

    async def load_weights(self, path: str, *, version: int | None = None) -> int:
        """Engine.load_weights(path) on every replica (the folder must be readable from every node)."""
        self._check_open()
        return await self.control.update(self.replicas, "load_weights", str(path), None, version)

    async def _broadcast(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        self._check_open()
        return await self.control.broadcast(self.replicas, method, *args, **kwargs)

    async def pause(self, *args: Any, **kwargs: Any) -> Any:
        """Engine.pause(...) on every replica (a replica that restarts meanwhile comes back paused)."""
        return _combine(await self._broadcast("pause", *args, **kwargs))

    async def resume(self) -> Any:
        return _combine(await self._broadcast("resume"))

    async def abort_all(self) -> list[RequestOutput]:
        """Engine.abort_all on every replica: their live requests end now; the partial outputs, all together."""
        return [out for outs in await self._broadcast("abort_all") for out in outs]

    async def sleep(self, *args: Any, **kwargs: Any) -> Any:
        return _combine(await self._broadcast("sleep", *args, **kwargs))

    async def wake_up(self) -> Any:
        return _combine(await self._broadcast("wake_up"))

    @property
    def is_paused(self) -> bool:
        """pause() was broadcast and resume() has not been since."""
        return self.control.paused

    @property
    def is_sleeping(self) -> bool:
        return self.control.asleep

    async def reset_prefix_cache(self) -> int:
        """Engine.reset_prefix_cache on every replica; the blocks dropped, summed."""
        return _combine(await self._broadcast("reset_prefix_cache"))


def _combine(results: list[Any]) -> Any:
    """One result for a broadcast: ints are summed (counts), all-None is None, anything else the list."""
    if all(r is None for r in results):
        return None
    if all(isinstance(r, int) and not isinstance(r, bool) for r in results):
        return sum(results)
    return results
