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
arms it, and the router uses it again (health.py; the request path is dispatch.py). Every wait a caller can be
stuck in is bounded: no ready replica
within ``ready_timeout_s`` is a ReplicaDiedError, a control call past ``control_timeout_s`` a TimeoutError.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Iterable, Mapping, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tqdm.auto import tqdm

from ourobatch.config import EngineConfig, batch_arguments, resolve_config
from scheduler.errors import EngineClosedError
from ourobatch.log import get_logger
from ourobatch.outputs import RequestOutput
from scheduler.params import RequestOutputKind

from .actor import EngineActor
from .control import Control
from .dispatch import Dispatch
from .errors import ReplicaDiedError
from .flight import Flight, PoolStream
from .health import ReplicaHealth
from .replica import Replica, ReplicaState, await_ref, cause_of
from .routing import Router
from .stats import pool_stats

log = get_logger()

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _check_pool_options(*, max_retries: Any, max_restarts: Any, max_concurrency: Any, num_cpus_per_replica: Any,
                        num_gpus_per_replica: Any, retry_aborted: Any) -> None:
    """EnginePool's Ray options, refused at construction naming the field (Ray would take some, e.g. a negative
    GPU count, and then never place the replica)."""
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def is_number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if not isinstance(retry_aborted, bool):
        raise TypeError(f"retry_aborted must be True or False, got {retry_aborted!r}")
    checks = (("max_retries", max_retries, is_int(max_retries) and max_retries >= 0, "an int >= 0"),
              ("max_restarts", max_restarts, is_int(max_restarts) and max_restarts >= -1,
               "an int >= -1 (-1: without limit)"),
              ("max_concurrency", max_concurrency, is_int(max_concurrency) and max_concurrency >= 1, "an int >= 1"),
              ("num_cpus_per_replica", num_cpus_per_replica, is_number(num_cpus_per_replica)
               and num_cpus_per_replica > 0, "a number > 0"),
              ("num_gpus_per_replica", num_gpus_per_replica, num_gpus_per_replica is None
               or (is_number(num_gpus_per_replica) and num_gpus_per_replica >= 0), "None or a number >= 0"))
    for name, value, ok, allowed in checks:
        if not ok:
            raise ValueError(f"{name} must be {allowed}, got {value!r}")


class EnginePool(Dispatch, ReplicaHealth):
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
        _check_pool_options(max_retries=max_retries, max_restarts=max_restarts, max_concurrency=max_concurrency,
                            num_cpus_per_replica=num_cpus_per_replica, num_gpus_per_replica=num_gpus_per_replica,
                            retry_aborted=retry_aborted)
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

    @property
    def is_closed(self) -> bool:
        """Whether calls now raise EngineClosedError (not started, closing or closed)."""
        return not self._started or self._loop is None or self._closing

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
            t.add_done_callback(lambda t: t.cancelled() or bar.update(1))
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
        """Engine.pause(...) on every replica (a replica that restarts meanwhile comes back paused). Mode
        "abort" ends every request the pool has live, also those between replicas after a death."""
        mode = args[0] if args else kwargs.get("mode", "abort")
        return _combine(await self._aborting("pause", mode == "abort", *args, **kwargs))

    async def resume(self, *args: Any, **kwargs: Any) -> Any:
        """Engine.resume(...) on every replica (e.g. recompute_kv=True)."""
        return _combine(await self._broadcast("resume", *args, **kwargs))

    async def abort_all(self) -> list[RequestOutput]:
        """Engine.abort_all on every replica: their live requests end now; the partial outputs, all together."""
        return [out for outs in await self._aborting("abort_all", True) for out in outs]

    async def _aborting(self, method: str, aborts: bool, *args: Any, **kwargs: Any) -> list[Any]:
        """A broadcast that ends the live requests (`aborts`): their aborts are remembered first (so a
        replica that dies meanwhile retries none of them) and sent to wherever they run after it."""
        self._check_open()
        flights = self._abort_live() if aborts else []
        try:
            return await self._broadcast(method, *args, **kwargs)
        finally:
            for flight in flights:
                self._abort(flight, None)

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
