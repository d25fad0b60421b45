"""Issue 19's stateful test of the Ray pool: a hypothesis state machine drives a 2-replica EnginePool on
local Ray (tiny random float64 checkpoints on the CPU) through interleaved requests (generate, CUMULATIVE
and DELTA streams, greedy and seeded), aborts, pause ("abort" / "wait" / "keep"), resume, sleep(1),
sleep(2), wake_up, weight updates (tensors or a checkpoint folder) and replica kills, with
retry_aborted on and off; a last test closes the pool under load.

The model keeps, per control facet, the set of states the pool may be in (a broadcast refused by one
replica may have changed the other), and per request the events of its life (killed, updated, aborted,
...), which say what outcomes are legal. Checked: nothing hangs (every wait is bounded), every request
ends exactly once (one finished output, or a named error the model allows), no completion is longer than
max_tokens or repeats tokens (a greedy completion, and a seeded one that no kill or update touched, is a
prefix of a single engine's run on the weights it ran with), no completion mixes weight versions unless
an update came under pause("keep"), and every live replica holds 0 KV blocks once all have ended.

One pool serves every example (a pool starts in ~15 s on 2 cores); each example's teardown brings it
back to a known state (wake_up, pause, load the first checkpoint, resume) and checks the invariants.
Every pool call runs on one event loop, an anyio blocking portal's; rules are sync. A failing step is
also kept in world.failures, so a failure that hypothesis's replay of a timing-dependent example does not
reproduce still fails the test. The world and the requests' caller: tests/ray_pool_stateful_helpers.py; what
a request may end with: tests/test_ray_pool_model.py.
"""

from __future__ import annotations

import functools
import os
import time
from concurrent.futures import Future
from typing import Any

import pytest
import ray
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from ourobatch import SamplingParams
from scheduler.errors import (EngineAsleepError, EngineBusyError, EngineClosedError,
                                        InconsistentWeightsError)
from ourobatch.testing import make_tiny_checkpoint
from tests.ray_pool_stateful_helpers import LIMIT, REQUEST_LIMIT, World, assert_no_kv_held, consume
from tests.test_ray_pool_model import Record, check_error, check_outputs

pytestmark = [pytest.mark.timeout(400), pytest.mark.xdist_group("ray")]  # one local Ray at a time
MAX_TOKENS = 30
PROMPTS = ([3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [2, 7])
EXAMPLES = int(os.environ.get("OUROBATCH_POOL_EXAMPLES", 6))  # per retry mode; e.g. 50 explores longer
SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=12, deadline=None, database=None,
                    phases=(Phase.explicit, Phase.reuse, Phase.generate),  # a Ray run does not shrink well
                    suppress_health_check=list(HealthCheck))


# ---------------------------------------------------------------------- the machine

def recorded(step):
    """Keep a failing step's error and the steps so far in world.failures (see the module docstring)."""
    @functools.wraps(step)
    def run(self, *args: Any, **kwargs: Any) -> None:
        try:
            step(self, *args, **kwargs)
        except Exception as exc:
            self.world.failures.append(f"{type(exc).__name__}: {exc}\nsteps:\n  " + "\n  ".join(self.trace))
            raise
    return run


REQUEST = st.fixed_dictionaries({
    "prompt": st.sampled_from(PROMPTS), "max_tokens": st.integers(4, MAX_TOKENS), "n": st.sampled_from([1, 2]),
    "how": st.sampled_from(["generate", "cumulative", "delta"]), "greedy": st.booleans(),
    "logprobs": st.sampled_from([None, 2]), "seed": st.integers(0, 3)})


class PoolMachine(RuleBasedStateMachine):
    world: World  # set by the test before it runs the machine
    retry: bool

    def __init__(self) -> None:
        super().__init__()
        self.pool = self.world.pool
        self.trace: list[str] = []  # the steps, for a failure's message
        self.records: list[Record] = []
        self.paused: set[str | None] = {None}  # the pause modes the pool may be in (None: running)
        self.asleep: set[int] = {0}  # sleep levels it may be at
        self.missing: set[bool] = {False}  # awake with weights missing (after sleep(2) + wake_up)
        self.maybe_inconsistent = False  # a refused update may have changed some replicas
        self.refused_updates = 0  # since the last update that succeeded: each may have used up its version
        self.version = self.world.call(self.pool.stats)["weight_version"]
        self.kills = 0

    @initialize(specs=st.lists(REQUEST, min_size=1, max_size=3))
    @recorded
    def start_example(self, specs) -> None:
        self.pool.retry_aborted = self.retry
        for spec in specs:  # traffic from the first step on
            self.submit(spec)

    def live(self) -> list[Record]:
        return [r for r in self.records if r.live]

    def mark(self, *events: str) -> None:
        for rec in self.live():
            rec.events.update(events)

    def unnoticed_kills(self) -> bool:
        """A replica killed in this example is still ready in the pool's eyes (its death not seen yet)."""
        seen = self.world.call(lambda: [(r.state.name, r.restarts) for r in self.pool.replicas])
        world = self.world
        world.killed = {i: restarts for i, restarts in world.killed.items() if seen[i] == ("READY", restarts)}
        return bool(world.killed)

    def allows(self, exc: BaseException, level: int = 0) -> bool:
        """May a replica be in a state that refuses a control call with `exc`?"""
        if isinstance(exc, EngineAsleepError):  # asleep (at another level than `level`)
            return bool(self.asleep - {0, level})
        if isinstance(exc, EngineBusyError):  # requests running unpaused
            return None in self.paused
        return isinstance(exc, InconsistentWeightsError) and (True in self.missing or self.maybe_inconsistent)

    def submit(self, spec: dict) -> None:
        kind = {"generate": "CUMULATIVE", "cumulative": "CUMULATIVE", "delta": "DELTA"}[spec["how"]]
        params = SamplingParams(max_tokens=spec["max_tokens"], n=spec["n"], seed=spec["seed"],
                                temperature=0.0 if spec["greedy"] else 1.0, logprobs=spec["logprobs"],
                                ignore_eos=True, output_kind=kind)
        rec = Record(f"r{next(self.world.ids)}", list(spec["prompt"]), params, spec["how"], Future())
        if True in self.missing or 2 in self.asleep or self.maybe_inconsistent:
            rec.events.add("maybe_refused")
        if self.unnoticed_kills():  # it may be sent to a killed replica the pool still thinks ready
            rec.events.add("killed")
        if (self.missing == {True} or self.asleep == {2}) and not self.maybe_inconsistent:
            rec.events.add("surely_refused")  # no replica holds the weights, a restarted one neither
        rec.future = self.world.portal.start_task_soon(consume, self.pool, rec)
        self.records.append(rec)
        self.trace.append(f"{rec.rid} = {rec.how}({rec.prompt}, {rec.params})")

    @precondition(lambda self: len(self.records) < 10)  # never on timing: hypothesis replays examples
    @rule(specs=st.lists(REQUEST, min_size=1, max_size=3))
    @recorded
    def generate(self, specs) -> None:
        for spec in specs:
            self.submit(spec)

    @precondition(lambda self: self.records)
    @rule(data=st.data())
    @recorded
    def abort(self, data) -> None:
        rec = data.draw(st.sampled_from(self.records))  # maybe finished already: abort says False
        index = data.draw(st.sampled_from([None, *range(rec.params.n)])) if rec.params.n > 1 else None
        target = rec.rid if index is None else f"{rec.rid}:{index}"
        self.trace.append(f"abort({target!r})")
        if self.world.call(self.pool.abort, target):
            rec.aborted |= set(range(rec.params.n)) if index is None else {index}

    @rule(mode=st.sampled_from(["abort", "wait", "keep"]))
    @recorded
    def pause(self, mode) -> None:
        self.trace.append(f"pause({mode!r})")
        if mode == "abort":  # before the call: what it ends is no longer live after it
            self.mark("pause_abort")
        try:
            self.world.call(self.pool.pause, mode)  # returns once paused, never hangs
        except (EngineAsleepError, InconsistentWeightsError) as exc:  # "wait" with nothing able to step
            assert mode == "wait" and self.allows(exc), f"pause({mode!r}) refused: {exc}"
            self.paused.add(mode)  # the replicas that could step paused
            return
        self.paused = {mode} | (self.paused & {"keep"}) - {None}  # kept requests stay kept until resume

    @rule()
    @recorded
    def resume(self) -> None:
        self.trace.append("resume()")
        try:
            self.world.call(self.pool.resume)
            self.paused = {None}
        except InconsistentWeightsError as exc:
            assert self.allows(exc), f"resume refused with the weights loaded: {exc}"
            self.paused.add(None)  # replicas with their weights resumed

    @rule(level=st.sampled_from([1, 2]))
    @recorded
    def sleep(self, level) -> None:
        self.trace.append(f"sleep({level})")
        if level == 2:  # before the call (as every mark): a request it affects may end during it
            self.mark("maybe_refused")
        try:
            self.world.call(self.pool.sleep, level)
            self.asleep = {level}
        except EngineBusyError as exc:  # or its EngineAsleepError
            assert self.allows(exc, level), f"sleep({level}) refused: {exc}"
            self.asleep.add(level)  # the other replica may have slept

    @rule()
    @recorded
    def wake_up(self) -> None:
        self.trace.append("wake_up()")
        self.world.call(self.pool.wake_up)
        if 2 in self.asleep:
            self.missing = {True} if self.asleep == {2} else self.missing | {True}
        self.asleep = {0}

    @rule(ckpt=st.sampled_from(["a", "b"]), as_tensors=st.booleans())
    @recorded
    def update_weights(self, ckpt, as_tensors) -> None:
        world = self.world
        self.trace.append(f"update_weights({ckpt!r}, as_tensors={as_tensors})")
        # maybe_refused: if one replica refuses, the pool refuses new placements (retries) until a full load
        self.mark("updated", "maybe_refused", *(("keep_update",) if "keep" in self.paused else ()))
        try:
            if as_tensors:
                version = world.call(self.pool.update_weights, world.tensors[ckpt])
            else:
                version = world.call(self.pool.load_weights, str(world.ckpts[ckpt]))
        except (EngineBusyError, InconsistentWeightsError) as exc:  # EngineAsleepError is an EngineBusyError
            assert self.allows(exc), f"update refused: {exc}"
            self.refused_updates += 1  # the other replica may have taken its version (then the next is skipped)
            world.ambiguous.update(range(self.version + 1, self.version + 1 + self.refused_updates))
            self.maybe_inconsistent = True
            return
        assert self.version + 1 <= version <= self.version + 1 + self.refused_updates
        world.ckpt_of[version] = ckpt
        self.version, self.missing, self.maybe_inconsistent = version, {False}, False
        self.refused_updates = 0

    @precondition(lambda self: self.kills < 2)
    @rule(index=st.integers(0, 1))
    @recorded
    def kill_replica(self, index) -> None:
        """Kill a replica: the one serving the oldest live request, if any (a kill that finds requests in
        flight is the interesting one), else replica `index`."""
        self.kills += 1  # an attempt: the precondition must not depend on timing
        placed = [self.pool.replica_of(r.rid) for r in self.live()]
        index = next((i for i in placed if i is not None), index)
        seen = self.world.call(lambda: [(r.state.name, r.restarts) for r in self.pool.replicas])
        if seen[index][0] != "READY":
            return
        self.trace.append(f"kill_replica({index})")
        self.world.killed[index] = seen[index][1]
        for rec in self.live():
            if rec.aborted != set(range(rec.params.n)):
                rec.events.add("killed")
        ray.kill(self.pool.actors[index], no_restart=False)

    @recorded
    def teardown(self) -> None:
        """Back to running on checkpoint a, every request ended and checked, no KV held anywhere."""
        self.normalize()
        self.check_every_request()

    def normalize(self) -> None:
        """Wake, pause ("wait", or "keep" where weights may be missing: "wait" could not finish), load
        checkpoint a, resume: each must succeed."""
        world = self.world
        mode = "keep" if True in self.missing or 2 in self.asleep else "wait"
        self.trace.append(f"teardown: wake_up(), pause({mode!r}), load_weights('a'), resume()")
        world.call(self.pool.wake_up)
        world.call(self.pool.pause, mode)
        self.paused = {mode} | (self.paused & {"keep"}) - {None}
        self.mark("updated", *(("keep_update",) if "keep" in self.paused else ()))
        self.version = world.call(self.pool.load_weights, str(world.ckpts["a"]))
        world.ckpt_of[self.version] = "a"
        world.call(self.pool.resume)

    def check_every_request(self) -> None:
        world = self.world
        deadline = time.monotonic() + REQUEST_LIMIT + LIMIT
        for rec in self.records:
            try:
                outs = rec.future.result(timeout=max(1.0, deadline - time.monotonic()))
            except TimeoutError as exc:
                raise AssertionError(f"{rec.rid} hung ({sorted(rec.events)})") from exc
            except Exception as exc:  # noqa: BLE001 - checked against what the model allows
                check_error(rec, exc, self.retry)
                continue
            check_outputs(world, rec, outs, self.retry)
        assert_no_kv_held(world)


# ---------------------------------------------------------------------- the tests

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray_stateful")
    ckpts = {"a": make_tiny_checkpoint(root / "a", seed=11, eos_token_id=None),
             "b": make_tiny_checkpoint(root / "b", seed=12, eos_token_id=None)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the replicas' arithmetic (one thread each): references equal to 1e-9
    world = None
    try:
        world = World(ckpts)
        yield world
    finally:
        torch.set_num_threads(threads)
        if world is not None:
            world.close()
        ray.shutdown()


@pytest.mark.parametrize("retry", [True, False], ids=["retry_aborted", "no_retry"])
def test_pool_state_machine(world, retry):
    machine = type(f"PoolMachine_{retry}", (PoolMachine,), {"world": world, "retry": retry})
    try:
        run_state_machine_as_test(machine, settings=SETTINGS)
    finally:
        failures, world.failures = world.failures, []
    assert not failures, "\n\n".join(failures)


def test_close_under_load_ends_every_request_and_a_pending_pause(world):
    pool = world.pool
    hows = [("generate", "CUMULATIVE"), ("delta", "DELTA"), ("cumulative", "CUMULATIVE")]
    recs = [Record(f"c{i}", list(PROMPTS[i]), SamplingParams(max_tokens=MAX_TOKENS, seed=i, ignore_eos=True,
                                                              output_kind=kind), how, Future())
            for i, (how, kind) in enumerate(hows)]
    for rec in recs:
        rec.future = world.portal.start_task_soon(consume, pool, rec)
    pending = world.portal.start_task_soon(pool.pause, "wait")  # waits for the running requests: close first
    world.call(pool.aclose)
    for rec in recs:
        try:
            outs = rec.future.result(timeout=LIMIT)
            assert outs[-1].finished and all(c.finish_reason in ("abort", "length") for c in outs[-1].outputs)
        except EngineClosedError:
            pass
    try:
        pending.result(timeout=LIMIT)
    except EngineClosedError:
        pass
    for fn, args in ((pool.generate, ([1, 2], {"max_tokens": 2})), (pool.pause, ("wait",)), (pool.resume, ())):
        with pytest.raises(EngineClosedError):
            world.call(fn, *args)
    with pytest.raises(EngineClosedError):
        pool.stats()
