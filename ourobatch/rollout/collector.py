"""Collector: continuous RL collection on an Engine or an EnginePool (docs/rollout.md).

Theory of operation. The collector owns one task group (started by ``async with``) holding a feeder
and one task per sample in flight. The feeder takes the next task (tasks.py: requeued ones first) and
starts its group (runs.py: a GroupRun, n engine requests of one sample each, seeds derived from the
task) whenever the Budget (budget.py) allows: enough free *sample* slots and the staleness bound. Each
sample task awaits its generate(), then its reward (a sync reward runs on a worker thread), and the
group is complete when all n are; the keep_group filter then drops it or queues it as ready (ready.py).
The consumer's ``async for`` hands over the oldest ready groups, groups_per_batch at a time, after
dropping (and regenerating) any group whose oldest token is more than max_staleness updates behind; so
the engine keeps generating while the consumer trains. ``update_weights`` pauses the engine ("keep"),
applies the on_update policy to the samples in flight, copies, and resumes (updates.py). What differs
between an Engine and an EnginePool is read through engine_view.py only.

Nothing is lost silently: every task ends yielded, filtered (counted), failed (``collector.failed``),
or is requeued (stale, surplus aborted) and generated again. Closing or cancelling aborts what runs.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, AsyncIterator, Callable, Iterable

import anyio
from tqdm.auto import tqdm

from ourobatch.runtime.engine_core import child_seed
from ourobatch.log import get_logger
from scheduler.errors import EngineClosedError, EngineDeadError, fresh_error
from scheduler.params import SamplingParams

from . import options
from .budget import Budget
from .engine_view import EngineView
from .ledger import Ledger
from .partial import Pauser, Rounds, run_round
from .ready import ReadyGroups
from .runs import GroupRun
from .tasks import TaskSource
from .types import Batch, Group, Sample, prompt_of
from .updates import push_weights

log = get_logger()


# the engine's own end: every later request would fail the same way, so it stops the collector (the
# consumer's next batch raises it) instead of failing one group after another. A pool's ReplicaDiedError is
# an EngineDeadError too, but the pool runs on: EngineView.stopped asks the engine itself.
ENGINE_STOPPED = (EngineClosedError, EngineDeadError)


class Collector:
    """``async with Collector(engine, tasks, n=8, params=..., reward=fn, groups_per_batch=32) as c:
    async for batch in c: ...; await c.update_weights(...)`` (docs/rollout.md)."""

    def __init__(self, engine: Any, tasks: Iterable[Any] | AsyncIterator[Any], *, n: int,
                 params: SamplingParams | dict | None, groups_per_batch: int,
                 reward: Callable[[Any, Sample], Any] | None = None, max_staleness: int | None = 1,
                 on_update: str = "continue", keep_group: Callable[[Group], bool] | None = None,
                 oversample: int = 0, surplus: str = "carry", max_samples_in_flight: int | None = None,
                 on_reward_error: str = "drop", max_tokens_per_round: int | None = None, seed: int = 0,
                 progress: bool = False, occupancy_interval_s: float = 0.25) -> None:
        self.engine = engine
        self._view = EngineView(engine)  # what differs between an Engine and an EnginePool
        self.n, self.groups_per_batch = options.positive("n", n), options.positive("groups_per_batch", groups_per_batch)
        self.params = options.sample_params(params)
        self.on_update = options.choice("on_update", on_update, options.ON_UPDATE)
        self.surplus = options.choice("surplus", surplus, options.SURPLUS)
        self.on_reward_error = options.choice("on_reward_error", on_reward_error, options.ON_REWARD_ERROR)
        options.non_negative_or_none("max_staleness", max_staleness, " or None (no bound)")
        if options.non_negative_or_none("oversample", oversample, " (extra groups in flight)") is None:
            raise ValueError("oversample must be an int >= 0 (extra groups in flight), got None")
        self.max_tokens_per_round = options.rounds(max_tokens_per_round, max_staleness)
        self.reward, self.keep_group, self.seed = reward, keep_group, seed
        slots = self._view.max_num_seqs + n if max_samples_in_flight is None else max_samples_in_flight
        if slots < n:
            raise ValueError(f"max_samples_in_flight must be >= n ({n}), got {slots}")
        self.budget = Budget(n, groups_per_batch, max_staleness, oversample, slots)
        self._tasks = TaskSource(tasks)
        self._runs: dict[int, GroupRun] = {}
        self._ready = ReadyGroups()
        self._seq = 0
        self._batches = 0
        self._changed = anyio.Event()
        self._update_lock = anyio.Lock()
        self._update_done = anyio.Event()
        self._update_done.set()
        self._inner: Any = None
        self._stopped = anyio.Event()
        self._closing = False
        self._error: BaseException | None = None
        self._pauser = Pauser(engine, self.max_tokens_per_round)
        self.failed: list[tuple[Any, BaseException]] = []  # (task, error) of groups that failed
        self.ledger = Ledger()
        self.counters, self.staleness_histogram = self.ledger.counters, self.ledger.staleness_histogram
        self.occupancy = self.ledger.occupancy
        self._occupancy_interval_s = occupancy_interval_s
        self._bar = tqdm(total=self._tasks.total, desc="collect", unit="group", disable=not progress)
        self._prefix = f"rollout-{id(self):x}"

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "Collector":
        stats = await self._view.stats()
        self.budget.start_at(stats["weight_version"])
        self._tasks.open()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        await self._tg.start(self._run)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        with anyio.CancelScope(shield=True):  # leaving the block always aborts what is in flight
            await self.aclose()
        await self._tg.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Abort every sample in flight (their KV is freed at once) and stop; iteration then ends."""
        self._closing = True
        if self._inner is not None:
            self._inner.cancel_scope.cancel()
            await self._stopped.wait()
        self._bar.close()
        self._notify()

    async def _run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            async with anyio.create_task_group() as inner:
                self._inner = inner
                inner.start_soon(self._feed)
                inner.start_soon(self._monitor)
                task_status.started()
        finally:
            self._stopped.set()

    # ------------------------------------------------------------------ the feeder

    def _notify(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    async def _feed(self) -> None:
        try:
            while True:
                started = False
                while (not self._closing and self._error is None and self._tasks.has_tasks()
                       and self.budget.can_start_group()):
                    item = await self._tasks.next()
                    if item is not None:
                        self._start(*item)
                        started = True
                if started or self._tasks.exhausted:  # only a change wakes the consumer (no ping-pong)
                    self._notify()
                await self._changed.wait()
        except Exception as exc:  # noqa: BLE001 - the task iterable failed: the consumer gets it
            self._fail(exc)

    def _start(self, task_index: int, task: Any) -> None:
        run = GroupRun(self._seq, task, task_index, prompt_of(task), [None] * self.n, attempts=[0] * self.n)
        self._seq += 1
        self._runs[run.seq] = run
        b = self.budget
        b.groups_in_flight += 1
        b.samples_in_flight += self.n
        self.counters["groups_started"] += 1
        self.counters["samples_started"] += self.n
        for i in range(self.n):
            self._inner.start_soon(self._sample, run, i)

    def _fail(self, exc: BaseException) -> None:
        self._error = self._error or exc
        self._notify()

    # ------------------------------------------------------------------ one sample

    async def _sample(self, run: GroupRun, i: int) -> None:
        seed = self.params.seed if self.params.seed is not None else self.seed
        params = self.params.with_seed(child_seed(child_seed(seed, run.task_index + 1), i))
        try:
            while not run.aborted and run.error is None:
                if self.max_tokens_per_round is not None:
                    run.rounds.setdefault(i, Rounds())
                c = await self._attempt(run, i, params)
                if c.finish_reason == "abort" and i in run.restart:  # on_update="abort": from scratch
                    run.restart.discard(i)
                    run.paused.discard(i)
                    run.rounds.pop(i, None)
                    run.attempts[i] += 1
                    self.counters["samples_restarted"] += 1
                    await self._update_done.wait()
                    continue
                if c.finish_reason == "abort" and i in run.paused:  # partial rollout: after the update
                    self.counters["samples_paused"] += 1
                    await self._pauser.wait(run, i, self.budget, self._notify)
                    continue
                if c.finish_reason not in ("stop", "length"):
                    if not run.aborted:
                        raise RuntimeError(f"sample {i} ended with finish_reason {c.finish_reason!r}: {c.error}")
                    break
                sample = run.sample_of(i, c)
                sample.reward = await self._reward(run.task, sample)
                run.samples[i] = sample
                break
        except ENGINE_STOPPED as exc:
            if self._view.stopped():  # no later group could run either: the consumer gets it
                self._fail(exc)
            await self._fail_run(run, exc)  # else one pool replica died: this group alone fails
        except Exception as exc:  # noqa: BLE001 - the group fails, never the collector
            await self._fail_run(run, exc)
        finally:
            self.budget.samples_in_flight -= 1
            self._notify()
        if all(s is not None for s in run.samples) or (run.error is not None and not run.live):
            self._complete(run)

    async def _attempt(self, run: GroupRun, i: int, params: SamplingParams) -> Any:
        """One engine request of sample i (a whole sample, or its current round); its last output."""
        rounds = run.rounds.get(i)
        rid = f"{self._prefix}-{run.seq}-{i}-{run.attempts[i]}"
        run.live[i] = rid = rid if rounds is None else f"{rid}-r{len(rounds.round_starts) - 1}"
        try:
            if rounds is None:
                return (await self.engine.generate(run.prompt, params, rid)).outputs[0]
            c = await run_round(self.engine, *rounds.request(run.prompt, params), rid, rounds)
            if c is None:
                raise RuntimeError(f"sample {i}'s stream ended without an output")
            return c
        finally:
            run.live.pop(i, None)

    async def _reward(self, task: Any, sample: Sample) -> float | None:
        if self.reward is None:
            return None
        if inspect.iscoroutinefunction(self.reward):
            return await self.reward(task, sample)
        value = await anyio.to_thread.run_sync(self.reward, task, sample)
        return await value if inspect.isawaitable(value) else value

    async def _fail_run(self, run: GroupRun, exc: BaseException) -> None:
        if run.error is None and not run.aborted:
            run.error = exc
            self._pauser.wake([run])  # its paused samples end too
            for rid in list(run.live.values()):  # the group is lost: stop its other samples now
                await self.engine.abort(rid)

    def _complete(self, run: GroupRun) -> None:
        if self._runs.pop(run.seq, None) is None or run.aborted:
            return  # completed already, or counted as aborted surplus
        self.budget.groups_in_flight -= 1
        if run.error is not None:
            self.counters["groups_failed"] += 1
            self.failed.append((run.task, run.error))
            log.warning("rollout_group_failed", task_index=run.task_index,
                        error=f"{type(run.error).__name__}: {run.error}")
            if self.on_reward_error == "raise":
                self._fail(run.error)
            return
        group = Group(run.task, run.task_index, [s for s in run.samples if s is not None])
        try:
            keep = self.keep_group is None or self.keep_group(group)
        except Exception as exc:  # noqa: BLE001 - a failing filter fails its group
            self.counters["groups_failed"] += 1
            self.failed.append((run.task, exc))
            if self.on_reward_error == "raise":
                self._fail(exc)
            return
        if not keep:
            self.counters["groups_filtered"] += 1
            return
        self._ready.add(run.seq, group)
        self.budget.groups_ready += 1

    # ------------------------------------------------------------------ the consumer

    def __aiter__(self) -> "Collector":
        return self

    async def __anext__(self) -> Batch:
        while True:
            if self._error is not None:
                raise fresh_error(self._error)  # a copy: each raise would grow the stored one's traceback
            if self._closing:
                raise StopAsyncIteration
            batch = await self._take_batch()
            if batch is not None:
                return batch
            b = self.budget
            if not self._tasks.has_tasks() and not b.groups_in_flight and not self._ready:
                raise StopAsyncIteration
            if not b.groups_in_flight and not self._ready and self._tasks.has_tasks() and not b.can_start_group():
                b.open_one_batch()  # no update is coming for work that was never started
                self._notify()  # the feeder may start it
            if self._pauser.num_paused and not b.samples_in_flight:
                self._pauser.wake(self._runs.values())  # only paused samples left: no update while we wait
            await self._changed.wait()

    def _drop_stale(self) -> None:
        stale = self._ready.pop_stale(self.budget.is_stale)
        for group in stale:  # regenerated under the current weights
            self.counters["groups_stale"] += 1
            self._tasks.requeue(group.task_index, group.task)
            self.budget.groups_ready -= 1
        if stale:
            self._notify()  # the feeder regenerates them

    async def _take_batch(self) -> Batch | None:
        self._drop_stale()
        G = self.groups_per_batch
        done_generating = not self._tasks.has_tasks() and not self.budget.groups_in_flight
        if len(self._ready) < G and not (done_generating and self._ready):
            return None
        groups, newest_seq = self._ready.take(G)
        b = self.budget
        b.groups_ready -= len(groups)
        b.groups_yielded += len(groups)
        batch = Batch(self._batches, groups, b.current_version)
        self._batches += 1
        self.ledger.account(batch, b)
        self._bar.update(len(groups))
        await self._handle_surplus(newest_seq)
        await self._pauser.pause_long_samples(self._runs.values())
        self._notify()
        return batch

    async def _handle_surplus(self, newest_seq: int) -> None:
        """Groups in flight that started before the batch's newest group are its stragglers."""
        stragglers = [run for run in self._runs.values() if run.seq < newest_seq]
        if self.surplus == "carry":
            self.counters["groups_carried"] += len(stragglers) + len(self._ready)
            return
        self.counters["groups_carried"] += len(self._ready)
        for run in stragglers:
            run.aborted = True
            self._pauser.wake([run])
            self._runs.pop(run.seq, None)
            self.budget.groups_in_flight -= 1
            self.counters["groups_aborted"] += 1
            self._tasks.requeue(run.task_index, run.task)
            for rid in list(run.live.values()):
                await self.engine.abort(rid)

    # ------------------------------------------------------------------ weight updates

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], *, version: int | None = None) -> int:
        """Push new weights into the engine without stopping collection for longer than the copy; the
        samples in flight follow on_update. Returns the new weight version."""
        return await self._update(lambda: self.engine.update_weights(named_tensors, version=version))

    async def load_weights(self, path: Any, *, version: int | None = None) -> int:
        """update_weights from a Hugging Face checkpoint folder."""
        return await self._update(lambda: self.engine.load_weights(path, version=version))

    async def _update(self, push: Callable[[], Any]) -> int:
        async with self._update_lock:
            self._update_done = anyio.Event()
            try:
                version = await push_weights(self.engine, self.on_update, list(self._runs.values()), push)
            finally:
                self._update_done.set()  # samples restarted by on_update="abort" go again
            self.budget.updated(version)
            self._pauser.wake(self._runs.values())  # partial rollouts continue under the new weights
            self.counters["updates"] += 1
            log.info("rollout_weights_updated", version=version, policy=self.on_update,
                     groups_in_flight=self.budget.groups_in_flight)
            self._notify()
            return version

    # ------------------------------------------------------------------ stats

    async def _monitor(self) -> None:
        start = time.perf_counter()
        while self._error is None:
            try:
                running = self._view.num_running()
            except ENGINE_STOPPED as exc:  # the engine closed or died under the collector
                self._fail(exc)
                return
            self.occupancy.append((time.perf_counter() - start, self.budget.samples_in_flight, running))
            await anyio.sleep(self._occupancy_interval_s)

    def stats(self) -> dict[str, Any]:
        """Counters, the staleness histogram of consumed tokens, versions in flight, occupancy means."""
        return self.ledger.stats(self.budget, self._runs.values(), self._pauser.num_paused)
