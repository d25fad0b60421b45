"""Async scheduling (scheduler/lookahead.py, ourobatch/runtime/pipeline.py, ModelExecutor.launch): a step planned
while the one before it runs changes nothing a request gets.

Torch-free part: hypothesis draws workloads (arrivals, aborts, eos and stop-id stops, max_tokens, n > 1,
shared prefixes with the prefix cache, chunked prefill, a pool small enough to preempt) and runs each with
async scheduling on and off over the fake executor (tests/lookahead_harness.py): the same plans of live
rows step after step (admissions, chunks, preemptions, cohort clocks), the same outputs, no block left.
Engine part: the float64 tiny model on the CPU, async_scheduling=True against False and against the dense
oracle (tests/oracle.py) replaying each token's readout loop; wasted rows are never reported.
"""

from __future__ import annotations

import dataclasses
import random
import zlib

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ourobatch import Engine, EngineConfig, SamplingParams, SyncEngine
from ourobatch.assembly import build_engine_core
from scheduler.config import SchedulerConfig
from ourobatch.runtime.engine_core import EngineCore
from scheduler.params import RequestOutputKind
from scheduler.plan import Phase
from ourobatch.testing import make_tiny_checkpoint
from tests.lookahead_harness import Event, run_async, run_sync
from tests.oracle import load_oracle, processed_logprobs
from tests.scheduler.fakes import STOP, FakeExecutor

pytestmark = pytest.mark.timeout(900)


# ---------------------------------------------------------------------------- torch-free: the fake executor

def fake_core(lookahead: bool, stop_at: dict[str, int], **overrides) -> EngineCore:
    fields = dict(num_kv_blocks=40, block_size=4, max_num_seqs=8, max_model_len=64, max_num_batched_tokens=64,
                  total_ut_steps=4, shallow_loops=2, deep_interval=4, mode="deferred", vocab_size=50,
                  eos_token_ids=frozenset({STOP}))
    fields.update(overrides)
    return EngineCore(SchedulerConfig(**fields), FakeExecutor(stop_at=dict(stop_at)), async_scheduling=lookahead)


def both(events: list[Event], stop_at: dict[str, int], **config):
    """The async run, then the synchronous one with each event where the async run met it."""
    lookahead = fake_core(True, stop_at, **config)
    rec_async, applied = run_async(lookahead, events)
    sync = fake_core(False, stop_at, **config)
    rec_sync = run_sync(sync, applied)
    return lookahead, rec_async, sync, rec_sync


def assert_equivalent(lookahead, rec_async, sync, rec_sync) -> None:
    assert rec_async.outputs() == rec_sync.outputs()
    assert len(rec_async.steps) == len(rec_sync.steps)
    for i, (a, b) in enumerate(zip(rec_async.steps, rec_sync.steps)):
        assert a == b, f"useful step {i}: async {a} != sync {b}"
    for core in (lookahead, sync):
        stats = core.stats()
        assert stats["kv_blocks_used"] == 0 and not core.scheduler.requests, stats
        assert core.scheduler.blocks.num_free == core.scheduler.blocks.num_blocks
        assert not core.pipeline.in_flight


@st.composite
def workloads(draw):
    config = dict(
        mode=draw(st.sampled_from(["deferred", "eager"])), deep_interval=draw(st.sampled_from([1, 2, 3, 4])),
        num_kv_blocks=draw(st.integers(7, 30)), max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.sampled_from([4, 8, 16, 64])),
        enable_prefix_caching=draw(st.booleans()), kv_allocation=draw(st.sampled_from(["lazy", "lazy", "reserve"])))
    events, stop_at, at = [], {}, 0
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6]]
    for i in range(draw(st.integers(1, 9))):
        at += draw(st.integers(0, 4))
        if i and draw(st.integers(0, 4)) == 0:
            events.append(Event(at, "abort", f"q{draw(st.integers(0, i - 1))}"))
            continue
        base = prefixes[draw(st.integers(0, 1))][:draw(st.integers(0, 8))]
        prompt = tuple(base + draw(st.lists(st.integers(1, 49), min_size=0 if base else 1, max_size=5)))
        n = draw(st.sampled_from([1, 1, 2]))
        params = SamplingParams(max_tokens=draw(st.integers(1, 16)), n=n, seed=i,
                                ignore_eos=draw(st.booleans()),
                                stop_token_ids=draw(st.sampled_from([[], [], [7]])))
        rid = f"q{i}"
        for c in ([rid] if n == 1 else [f"{rid}:{k}" for k in range(n)]):
            if draw(st.booleans()):
                stop_at[c] = draw(st.integers(1, 8))
        events.append(Event(at, "add", rid, prompt, params))
    return config, events, stop_at


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(workloads())
def test_plans_and_outputs_equal_with_and_without_async_scheduling(workload):
    config, events, stop_at = workload
    assert_equivalent(*both(events, stop_at, **config))


class SkippingFake(FakeExecutor):
    """The fake executor with ModelExecutor's rule for a step planned ahead: rows of requests that a phase of
    the step before failed are not run (they end in that step's update)."""

    failed: set = None  # type: ignore[assignment]

    def execute(self, plan):
        failed = (self.failed or set()) - set(plan.released_request_ids)
        keep = lambda works: tuple(w for w in works if w.request_id not in failed)  # noqa: E731
        plan = dataclasses.replace(plan, prefills=keep(plan.prefills), shallow=keep(plan.shallow), deep=keep(plan.deep))
        result = super().execute(plan)
        self.failed = {rid for f in result.failures for rid in f.request_ids}
        return result


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(workloads(), st.dictionaries(st.integers(0, 40), st.sampled_from(list(Phase)), max_size=4))
def test_failures_with_async_scheduling_end_each_request_once_and_leak_nothing(workload, failures):
    config, events, stop_at = workload
    core = fake_core(True, stop_at, **config)
    core.executor = SkippingFake(stop_at=dict(stop_at), fail=dict(failures))
    rec, _ = run_async(core, events)
    for children in rec.children.values():
        for r in children:
            assert r.is_finished and len(r.logprobs) == len(r.output_token_ids) <= r.params.max_tokens
            if r.finish_reason == "length":
                assert len(r.output_token_ids) == r.params.max_tokens
    assert core.stats()["kv_blocks_used"] == 0 and not core.scheduler.requests
    assert core.scheduler.blocks.num_free == core.scheduler.blocks.num_blocks


def test_a_stop_the_next_plan_could_not_know_costs_one_wasted_row_never_reported():
    """q0 stops on an eos at token 3 (only its value says so): the step planned ahead fed it once more."""
    events = [Event(0, "add", "q0", (1, 2, 3), SamplingParams(max_tokens=10)),
              Event(0, "add", "q1", (4, 5), SamplingParams(max_tokens=10, ignore_eos=True))]
    lookahead, rec_async, sync, rec_sync = both(events, {"q0": 3}, deep_interval=2)
    assert_equivalent(lookahead, rec_async, sync, rec_sync)
    q0 = rec_async.children["q0"][0]
    assert q0.finish_reason == "stop" and len(q0.output_token_ids) == 3 and q0.output_token_ids[-1] == STOP
    assert [r for r in rec_async.wasted if r[0] == "q0"] == [("q0", "ShallowWork", 5, 2, True, (2, 4))]
    assert rec_sync.wasted == []
    assert lookahead.stats()["lookahead_steps"] > 0


def test_length_stops_are_known_ahead_and_cost_nothing():
    events = [Event(0, "add", f"q{i}", (1, 2, 3 + i), SamplingParams(max_tokens=2 + i, ignore_eos=True))
              for i in range(4)]
    lookahead, rec_async, sync, rec_sync = both(events, {}, deep_interval=3)
    assert_equivalent(lookahead, rec_async, sync, rec_sync)
    assert rec_async.wasted == [] and lookahead.stats()["lookahead_drains"] == 0


def test_a_block_the_step_in_flight_frees_is_taken_before_a_cached_prefix_is_evicted():
    """q2 leaves the prefix 1 2 3 4 cached; step 13 ends q0, q4 and q5 by length. The step after needs a block for
    q1 and q3 where the free list holds one: planned ahead, it would evict q2's prefix, which q6 then misses (its
    prefill from position 0); after step 13's update the freed blocks serve it (found by hypothesis)."""
    def params(seed: int, max_tokens: int) -> SamplingParams:
        return SamplingParams(seed=seed, max_tokens=max_tokens)

    events = [Event(3, "add", "q0", (1,), params(0, 14)), Event(5, "add", "q1", (9, 8, 7, 6, 1), params(1, 9)),
              Event(5, "add", "q2", (1, 2, 3, 4), params(2, 1)), Event(9, "add", "q3", (1, 2, 1), params(3, 3)),
              Event(11, "add", "q4", (1,), params(4, 2)), Event(11, "add", "q5", (1,), params(5, 2)),
              Event(14, "add", "q6", (1, 2, 3, 4, 5), params(6, 1))]
    lookahead, rec_async, sync, rec_sync = both(events, {}, deep_interval=3, num_kv_blocks=12, max_num_seqs=5,
                                                max_num_batched_tokens=8, enable_prefix_caching=True)
    assert_equivalent(lookahead, rec_async, sync, rec_sync)
    q6 = [row for step in rec_async.steps for row in step if row[0] == "q6" and row[1] == "PrefillWork"]
    assert q6 == [("q6", "PrefillWork", 4, 1, None, (4, 1))]  # the cached block: only the 5th token computed
    assert lookahead.scheduler.drain_reasons["evict"] >= 1


def test_verify_mode_refuses_async_scheduling():
    with pytest.raises(ValueError, match="verify"):
        fake_core(True, {}, mode="verify")
    with pytest.raises(ValueError, match="EngineConfig.async_scheduling"):
        EngineConfig(model="m", mode="verify", deep_interval=4, async_scheduling=True)
    with pytest.raises(TypeError, match="EngineConfig.async_scheduling"):
        EngineConfig(model="m", async_scheduling="yes")


# ---------------------------------------------------------------------------- the engine: float64 and the oracle

SHAPES = {
    "kv1-L2-T4": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                      total_ut_steps=4),
    "kv2-L2-T5": dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                      total_ut_steps=5, vocab_size=37),
}
EOS = 5
TOL = 1e-6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_sched")
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        path = make_tiny_checkpoint(root / name, seed=40 + i, eos_token_id=EOS, **shape)
        out[name] = (path, load_oracle(path))
    return out


def engine_core(path, lookahead: bool, **overrides) -> EngineCore:
    fields = dict(model=str(path), dtype="float64", block_size=4, max_model_len=64, max_num_seqs=8,
                  num_kv_blocks=64, async_scheduling=lookahead)
    fields.update(overrides)
    return build_engine_core(EngineConfig(**fields))


def engine_workload(seed: int, vocab: int, num: int = 7, aborts: int = 1) -> list[Event]:
    """Arrivals over the first steps, shared prefixes, eos and stop-id stops, n = 2, every sampling path
    (greedy, temperature, top-k / top-p, top log-probs), and aborts at random steps."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab) for _ in range(8)]
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.9),
             dict(temperature=1.0, logprobs=2), dict(temperature=1.0, n=2), dict(temperature=1.0, ignore_eos=True),
             dict(temperature=1.0, stop_token_ids=[rng.randrange(1, vocab)])]
    events, at = [], 0
    for i in range(num):
        at += rng.randint(0, 3)
        prompt = prefix[:rng.choice([0, 4, 8])] + [rng.randrange(1, vocab) for _ in range(rng.randint(1, 6))]
        params = SamplingParams(max_tokens=rng.randint(1, 18), seed=100 + i, **kinds[i % len(kinds)])
        events.append(Event(at, "add", f"q{i}", tuple(prompt), params))
    for _ in range(aborts):
        events.append(Event(rng.randint(1, at + 8), "abort", f"q{rng.randrange(num)}"))
    return sorted(events, key=lambda e: e.at)


def release_everything(core: EngineCore) -> None:
    """Run the release-only steps still due, then check that nothing is held: no block, no retained row,
    no block-table row."""
    while core.scheduler.has_pending_releases:
        core.step()
    core.drain()
    assert core.stats()["kv_blocks_used"] == 0
    assert core.scheduler.blocks.num_free == core.scheduler.blocks.num_blocks
    assert core.executor.retained == {} and core.executor.tables.row_of == {}


def check_replay(oracle, r) -> None:
    """Each token and processed log-prob equals the oracle's at the token's own readout loop."""
    P, toks, p = r.num_prompt_tokens, r.output_token_ids, r.params
    if not toks:
        return
    out = oracle.forward(list(r.prompt_token_ids) + toks[:-1])
    for j, (tok, lp, loop) in enumerate(zip(toks, r.logprobs, r.readout_loops), start=1):
        row = out.logits[loop - 1, P + j - 2]
        ref = processed_logprobs(row, p.temperature, p.top_k, p.top_p, p.min_p)
        if p.is_greedy:
            assert tok == int(row.argmax()), f"{r.request_id} token {j}"
        assert abs(lp - float(ref[tok])) < TOL, f"{r.request_id} token {j}: {lp} vs {float(ref[tok])}"


def run_engines(path, events, **config):
    lookahead = engine_core(path, True, **config)
    rec_async, applied = run_async(lookahead, events)
    sync = engine_core(path, False, **config)
    rec_sync = run_sync(sync, applied)
    return lookahead, rec_async, sync, rec_sync


def assert_same_outputs(rec_async, rec_sync) -> None:
    assert rec_async.outputs() == rec_sync.outputs()
    for rid, per_completion in rec_async.logprobs().items():  # equal up to float64 rounding of other batches
        for a, b in zip(per_completion, rec_sync.logprobs()[rid]):
            assert len(a) == len(b) and all(abs(x - y) < 1e-12 for x, y in zip(a, b)), rid


CASES = [  # (mode, B, extra config)
    ("deferred", 1, {}),
    ("deferred", 2, {}),
    ("deferred", 4, {}),
    ("eager", 4, {}),
    ("deferred", 2, dict(max_num_batched_tokens=8)),  # chunked prefill
    ("deferred", 4, dict(num_kv_blocks=12, max_num_seqs=6)),  # preemption (a tiny pool)
    ("deferred", 1, dict(num_kv_blocks=12, max_num_seqs=6, enable_prefix_caching=False)),
]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mode,B,extra", CASES, ids=[f"{m}-B{b}-{'-'.join(e) or 'base'}" for m, b, e in CASES])
def test_engine_outputs_equal_without_async_scheduling_and_the_oracle(models, shape, mode, B, extra):
    path, oracle = models[shape]
    events = engine_workload(zlib.crc32(f"{shape}/{mode}/{B}/{sorted(extra.items())}".encode()), oracle.vocab_size,
                             num=9 if "num_kv_blocks" in extra else 7)
    lookahead, rec_async, sync, rec_sync = run_engines(path, events, mode=mode, deep_interval=B, **extra)
    assert rec_async.steps == rec_sync.steps  # the same rows of live requests, step by step
    assert_same_outputs(rec_async, rec_sync)
    for children in rec_async.children.values():
        for r in children:
            assert r.finish_reason in ("stop", "length", "abort"), r.error
            assert len(r.logprobs) == len(r.output_token_ids) == len(r.readout_loops) == len(r.weight_versions)
            check_replay(oracle, r)
    for core in (lookahead, sync):
        release_everything(core)
    assert lookahead.stats()["lookahead_steps"] > 0
    if "num_kv_blocks" in extra:
        assert lookahead.stats()["preemptions"] > 0


def test_a_wasted_row_is_never_reported(models):
    """Requests stopping on eos with steps planned ahead: the row fed after the eos was planned (wasted),
    yet every completion ends at its eos, and a stream of deltas carries exactly the final tokens."""
    path, oracle = models["kv1-L2-T4"]
    events = [Event(0, "add", f"q{i}", (1 + i, 2, 3), SamplingParams(max_tokens=30, temperature=1.0, seed=i))
              for i in range(8)]
    lookahead, rec_async, sync, rec_sync = run_engines(path, events, deep_interval=2)
    assert_same_outputs(rec_async, rec_sync)
    stopped = [r for (r,) in rec_async.children.values() if r.finish_reason == "stop"]
    assert stopped, "no request stopped on eos: pick other seeds"
    wasted = {w[0] for w in rec_async.wasted}
    for r in stopped:
        assert r.output_token_ids[-1] == EOS and EOS not in r.output_token_ids[:-1]
        assert r.request_id in wasted  # its next row had been planned before the eos was known
        check_replay(oracle, r)
    release_everything(lookahead)


def test_both_engines_with_async_scheduling_give_the_synchronous_engines_outputs(models):
    """Through the public API: SyncEngine and the async Engine (its stepping thread's pipeline) with
    async_scheduling=True against SyncEngine without; a DELTA stream carries exactly the final tokens."""
    path, oracle = models["kv2-L2-T5"]
    rng = random.Random(3)
    prompts = [[rng.randrange(1, oracle.vocab_size) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    params = [SamplingParams(max_tokens=rng.randint(4, 20), temperature=1.0, seed=i, n=1 + (i == 2),
                             logprobs=2 if i == 3 else None) for i in range(6)]
    config = dict(model=str(path), dtype="float64", block_size=4, max_model_len=64, deep_interval=3,
                  num_kv_blocks=64, max_num_seqs=8)

    def summary(outs):
        return [[(c.token_ids, c.readout_loops, c.finish_reason, c.top_logprobs is None) for c in o.outputs]
                for o in outs]

    with SyncEngine(EngineConfig(**config, async_scheduling=False)) as llm:
        expected = llm.generate_batch(prompts, params)
    with SyncEngine(EngineConfig(**config, async_scheduling=True)) as llm:
        got = llm.generate_batch(prompts, params)
        assert llm.stats()["lookahead_steps"] > 0 and llm.stats()["kv_blocks_used"] == 0
    assert summary(got) == summary(expected)

    async def run_async_engine():
        async with Engine(EngineConfig(**config, async_scheduling=True)) as engine:
            outs = await engine.generate_batch(prompts, params)
            streamed: list[int] = []
            async for delta in engine.stream(prompts[0], dataclasses.replace(
                    params[0], output_kind=RequestOutputKind.DELTA)):
                streamed += delta.outputs[0].token_ids
            final = await engine.generate(prompts[0], params[0])
            return outs, streamed, final, engine.stats()

    outs, streamed, final, stats = anyio.run(run_async_engine)
    assert summary(outs) == summary(expected)
    assert streamed == final.outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert stats["lookahead_steps"] > 0
    for o, e in zip(outs, expected):
        for c, ce in zip(o.outputs, e.outputs):
            assert all(abs(x - y) < 1e-12 for x, y in zip(c.logprobs, ce.logprobs))
            check_replay_output(oracle, o.prompt_token_ids, c)


def check_replay_output(oracle, prompt, c) -> None:
    """check_replay for a CompletionOutput (sampling params of these tests: temperature 1, no filters)."""
    toks = c.token_ids
    out = oracle.forward(list(prompt) + toks[:-1])
    for j, (tok, lp, loop) in enumerate(zip(toks, c.logprobs, c.readout_loops), start=1):
        ref = processed_logprobs(out.logits[loop - 1, len(prompt) + j - 2], 1.0)
        assert abs(lp - float(ref[tok])) < TOL, f"token {j}"


def test_a_step_with_nothing_to_run_leaves_nothing_behind():
    """An empty plan (nothing to run) is never updated: it must not count as a step in flight later."""
    core = fake_core(True, {})
    assert core.step() == [] and not core.pipeline.in_flight
    core.add((1, 2, 3), SamplingParams(max_tokens=6, ignore_eos=True), request_id="q0")
    while core.has_unfinished:
        core.step()
    assert core.stats()["lookahead_steps"] > 0 and core.stats()["kv_blocks_used"] == 0


class FailDeepBesidePrefill(SkippingFake):
    """Fails the deep call of the first step that also finishes a prefill."""

    done = False

    def execute(self, plan):
        if not self.done and plan.deep and any(p.sample is not None for p in plan.prefills):
            self.fail[plan.step_id], self.done = Phase.DEEP, True
        return super().execute(plan)


@pytest.mark.parametrize("lookahead", [True, False])
def test_a_deep_call_failing_beside_a_prefill_does_not_take_the_prefilled_request(lookahead):
    """The cohort of a failed deep call closes: its members end with "error", the request whose prefill ran in
    the same step is not one of them (it joins a new cohort), with async scheduling too (rule deep_and_prefill)."""
    core = fake_core(lookahead, {}, deep_interval=2)
    core.executor = FailDeepBesidePrefill()
    q0 = core.add((1, 2, 3), SamplingParams(max_tokens=12, ignore_eos=True), request_id="q0").children[0]
    q1 = None
    # add q1 when the next step planned is q0's boundary (token 3, B = 2): with a step in flight, one earlier
    while core.has_unfinished or q1 is None:
        if q1 is None and q0.num_output_tokens == (1 if lookahead else 2):
            q1 = core.add((4, 5, 6, 7), SamplingParams(max_tokens=5, ignore_eos=True), request_id="q1").children[0]
        core.step()
    core.drain()
    assert core.executor.done
    assert q0.finish_reason == "error" and "deep failed" in q0.error
    assert q1.finish_reason == "length" and len(q1.output_token_ids) == 5
    assert core.stats()["kv_blocks_used"] == 0
