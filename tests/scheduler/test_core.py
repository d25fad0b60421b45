"""The sans-IO scheduler core driven by a fake executor (no torch)."""

from __future__ import annotations

import random

import pytest

from scheduler import Phase, RequestRejectedError, RequestStatus, SamplingParams

from .conftest import abort_all_and_release, make_scheduler, run_step, update_checked
from .fakes import STOP, FakeExecutor


def params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=kw.pop("seed", 1), **kw)


def drain(sched, ex, max_steps=10_000):
    finished = {}
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return finished
        _, updates = run_step(sched, ex)
        for u in updates:
            if u.finished:
                assert u.request.request_id not in finished, "a request ended twice"
                finished[u.request.request_id] = u.request
    raise AssertionError("did not finish")


@pytest.mark.parametrize("B", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("M", [1, 2, 5, 9, 17])
@pytest.mark.parametrize("N", [1, 3])
def test_aligned_requests_count_deep_calls_and_rows(N, M, B):
    sched, ex = make_scheduler(deep_interval=B), FakeExecutor()
    for i in range(N):
        sched.add(f"r{i}", [1, 2, 3], params(M, ignore_eos=True))
    done = drain(sched, ex)
    stats = sched.stats()
    # B = 1 runs every loop in the shallow call (one call per step, nothing retained): no deep calls
    deep_calls = (M - 1) // B if B > 1 else 0
    assert stats["deep_calls"] == deep_calls
    assert stats["deep_rows"] == N * B * deep_calls
    assert stats["shallow_rows"] == N * (M - 1)
    assert all(r.num_output_tokens == M and r.finish_reason == "length" for r in done.values())
    T, s = 4, 2
    for r in done.values():
        assert r.readout_loops == [T if j == 1 or (j - 1) % B == 0 else s for j in range(1, M + 1)]
    assert stats["kv_blocks_used"] == 0


def test_staggered_arrivals_join_the_cohort_clock():
    B = 4
    sched, ex = make_scheduler(deep_interval=B), FakeExecutor()
    arrivals = {0: ["a"], 1: ["b"], 3: ["c", "d"], 6: ["e"], 9: ["f"]}
    first_decode_step, prefill_step = {}, {}
    for step in range(60):
        for rid in arrivals.get(step, []):
            sched.add(rid, [5] * (step + 1), params(14, ignore_eos=True))
        plan, _ = run_step(sched, ex)
        for p in plan.prefills:
            prefill_step[p.request_id] = step
        for w in plan.shallow:
            first_decode_step.setdefault(w.request_id, step)
        # every deep call carries every decoding member, each with exactly B rows
        decoding = {w.request_id for w in plan.shallow}
        if plan.deep:
            assert {d.request_id for d in plan.deep} == decoding
            assert all(d.num_rows == B for d in plan.deep)
        if not sched.has_unfinished:
            break
    for rid, step in first_decode_step.items():
        assert 1 <= step - prefill_step[rid] <= B, (rid, step, prefill_step[rid])  # waits at most B-1 steps
    # all block starts are on one clock: first decode steps are congruent mod B
    assert len({s % B for s in first_decode_step.values()}) == 1
    assert sched.stats()["kv_blocks_used"] == 0


def test_stop_mid_block_discards_the_tail_and_shrinks_the_batch():
    B = 4
    sched, ex = make_scheduler(deep_interval=B), FakeExecutor(stop_at={"short": 3})
    sched.add("short", [1, 2], params(20))
    sched.add("long", [1, 2], params(9))
    plans = []
    while sched.has_unfinished:
        plans.append(run_step(sched, ex)[0])
    short_deep = [d for p in plans for d in p.deep if d.request_id == "short"]
    long_deep = [d for p in plans for d in p.deep if d.request_id == "long"]
    assert short_deep == []  # stopped at token 3, before its first boundary (step 4)
    assert len(long_deep) == (9 - 1) // B
    released = [p.released_request_ids for p in plans]
    stop_plan = next(i for i, p in enumerate(plans) if any(w.request_id == "short" and w.sample
                                                          and w.sample.token_index == 3 for w in p.shallow))
    assert "short" in released[stop_plan + 1]  # the engine drops its retained rows next step
    assert all(w.request_id != "short" for p in plans[stop_plan + 1:] for w in p.shallow)
    assert "short" not in ex.retained


def test_eager_mode_runs_every_token_full_depth_with_the_same_readout_schedule():
    B = 3
    sched, ex = make_scheduler(deep_interval=B, mode="eager"), FakeExecutor()
    sched.add("r", [1, 2, 3], params(10, ignore_eos=True))
    plans = []
    while sched.has_unfinished:
        plans.append(run_step(sched, ex)[0])
    assert all(not p.deep for p in plans)
    shallow = [w for p in plans for w in p.shallow]
    assert all(w.last_loop == 4 and not w.retain for w in shallow)
    assert [w.sample.loop for w in shallow] == [4 if (k + 1 - 1) % B == 0 else 2 for k in range(1, 10)]


@pytest.mark.parametrize("allocation", ["reserve", "lazy"])
def test_last_token_position_is_never_reserved_or_fed(allocation):
    bs = 4
    for P, M in [(3, 2), (4, 1), (2, 7), (5, 8)]:
        sched, ex = make_scheduler(block_size=bs, kv_allocation=allocation), FakeExecutor()
        r = sched.add("r", list(range(1, P + 1)), params(M, ignore_eos=True))
        run_step(sched, ex)
        # reserve: the whole need at admission; lazy: the prompt's blocks only
        assert len(r.block_ids) == -(-(P + M - 1 if allocation == "reserve" else P) // bs)
        most = len(r.block_ids)
        while sched.has_unfinished:
            run_step(sched, ex)
            most = max(most, len(r.block_ids))
        assert most == -(-(P + M - 1) // bs)  # lazy grows to exactly the positions written
        assert max(ex.fed["r"]) == P + M - 2


def test_max_num_seqs_and_fifo_backpressure():
    sched, ex = make_scheduler(num_kv_blocks=6, block_size=4, max_num_seqs=2, kv_allocation="reserve"), FakeExecutor()
    for i in range(5):
        sched.add(f"r{i}", [1, 2, 3, 4], params(5, ignore_eos=True))  # 8 positions = 2 blocks each
    plan, _ = run_step(sched, ex)
    assert [p.request_id for p in plan.prefills] == ["r0", "r1"]  # max_num_seqs
    sched2, ex2 = make_scheduler(num_kv_blocks=5, block_size=4, kv_allocation="reserve"), FakeExecutor()
    for i in range(4):  # distinct prompts: no shared blocks
        sched2.add(f"r{i}", [i + 1, 2, 3, 4], params(5, ignore_eos=True))
    plan, _ = run_step(sched2, ex2)
    assert [p.request_id for p in plan.prefills] == ["r0", "r1"]  # 5 blocks: two fit, the third waits
    assert sched2.stats()["num_waiting"] == 2
    order = []
    while sched2.has_unfinished:
        plan, _ = run_step(sched2, ex2)
        order += [p.request_id for p in plan.prefills]
    assert order == ["r2", "r3"]


def _request_in(status, sched, ex):
    """Drive a fresh request to `status`; return it and whether a plan is in flight."""
    r = sched.add("x", [1, 2, 3], params(30, ignore_eos=True))
    if status == RequestStatus.WAITING:
        return r, None
    plan = sched.schedule()
    if status == RequestStatus.PREFILLING:
        return r, plan
    sched.update(plan, ex.execute(plan))
    if status == RequestStatus.ALIGNING:
        return r, None
    plan = sched.schedule()
    return r, plan


@pytest.mark.parametrize("status", [RequestStatus.WAITING, RequestStatus.PREFILLING, RequestStatus.ALIGNING,
                                    RequestStatus.DECODING])
def test_abort_at_every_state_frees_everything(status):
    sched, ex = make_scheduler(deep_interval=1), FakeExecutor()
    r, in_flight = _request_in(status, sched, ex)
    assert r.status == status
    result = ex.execute(in_flight) if in_flight is not None else None
    u = sched.abort("x")
    assert u.finished and r.finish_reason == "abort"
    if in_flight is not None:  # the step finishes after the abort: its results are ignored
        assert sched.update(in_flight, result) == []
    assert sched.abort("x") is None  # a second abort is a no-op
    assert sched.stats()["kv_blocks_used"] == 0 and not sched.has_unfinished
    assert sched.stats()["finished_abort"] == 1
    plan = sched.schedule()
    assert plan.is_empty
    assert plan.released_request_ids == (() if status == RequestStatus.WAITING else ("x",))


def test_abort_in_flight_at_a_boundary():
    B = 2
    sched, ex = make_scheduler(deep_interval=B), FakeExecutor()
    sched.add("x", [1], params(30, ignore_eos=True))
    sched.add("y", [1], params(30, ignore_eos=True))
    run_step(sched, ex)  # prefill
    run_step(sched, ex)  # k = 1
    plan = sched.schedule()  # k = 2: boundary
    assert {d.request_id for d in plan.deep} == {"x", "y"}
    result = ex.execute(plan)
    sched.abort("x")
    updates = sched.update(plan, result)
    assert [u.request.request_id for u in updates] == ["y"]
    assert sched.requests["y"].num_deep_positions == 1 + 2
    assert sched.stats()["kv_blocks_used"] == len(sched.requests["y"].block_ids)


def test_deep_failure_closes_the_cohort_and_new_requests_keep_running():
    B = 2
    sched, ex = make_scheduler(deep_interval=B), FakeExecutor()
    for rid in ["a", "b", "c"]:
        sched.add(rid, [1, 2], params(10, ignore_eos=True))
    run_step(sched, ex)  # step 0 prefill
    sched.add("late", [3, 4], params(10, ignore_eos=True))
    run_step(sched, ex)  # step 1: k = 1 for a, b, c; late is prefilled (ALIGNING in cohort 0)
    sched.add("new", [3, 4], params(6, ignore_eos=True))
    ex.fail[2] = Phase.DEEP  # step 2 is the boundary of a, b, c; "new" is prefilled in this step
    plan, updates = run_step(sched, ex)
    assert plan.deep and {d.request_id for d in plan.deep} == {"a", "b", "c"}
    failed = {u.request.request_id: u.request for u in updates if u.finished}
    assert set(failed) == {"a", "b", "c", "late"}  # every member, the aligning one too
    assert all(r.finish_reason == "error" and "deep failed" in r.error for r in failed.values())
    done = drain(sched, ex)
    assert done["new"].finish_reason == "length" and done["new"].num_output_tokens == 6
    assert done["new"].cohort_id != failed["a"].cohort_id
    assert sched.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("phase", [Phase.PREFILL, Phase.SHALLOW])
def test_prefill_or_shallow_failure_ends_exactly_that_phase(phase):
    sched, ex = make_scheduler(deep_interval=4), FakeExecutor()
    sched.add("old", [1], params(10, ignore_eos=True))
    run_step(sched, ex)
    sched.add("new", [1], params(10, ignore_eos=True))
    ex.fail[1] = phase
    _, updates = run_step(sched, ex)
    failed = {u.request.request_id for u in updates if u.finished}
    assert failed == ({"new"} if phase == Phase.PREFILL else {"old"})
    done = drain(sched, ex)
    survivor = "old" if phase == Phase.PREFILL else "new"
    assert done[survivor].finish_reason == "length"
    assert sched.stats()["kv_blocks_used"] == 0


def test_stop_tokens_eos_and_ignore_eos():
    ex = FakeExecutor(stop_at={"eos": 2, "ign": 2})
    sched = make_scheduler()
    sched.add("eos", [1], params(10))
    sched.add("ign", [1], params(5, ignore_eos=True))
    stop_tok = ex.token("custom", 3)
    sched.add("custom", [1], params(10, stop_token_ids=[stop_tok]))
    done = drain(sched, ex)
    assert done["eos"].finish_reason == "stop" and done["eos"].output_token_ids[-1] == STOP
    assert done["eos"].num_output_tokens == 2
    assert done["ign"].finish_reason == "length" and STOP in done["ign"].output_token_ids
    assert done["custom"].finish_reason == "stop" and done["custom"].output_token_ids[-1] == stop_tok


@pytest.mark.parametrize("bad,exc,match", [
    (dict(prompt=[]), ValueError, "at least one token"),
    (dict(prompt=[1, 50]), ValueError, r"prompt_token_ids\[1\] = 50 is outside the vocabulary"),
    (dict(prompt=[1, -1]), ValueError, "outside the vocabulary"),
    (dict(prompt=[1, 2.0]), TypeError, r"prompt_token_ids\[1\] must be an int"),
    (dict(prompt="abc"), TypeError, "list of ints"),
    (dict(max_tokens=511), RequestRejectedError, "exceeds max_model_len=512"),
    (dict(max_tokens=200, prompt=[1] * 400), RequestRejectedError, "exceeds max_model_len"),
    (dict(stop=[99]), ValueError, "stop_token_ids holds 99"),
    (dict(rid=""), TypeError, "request_id"),
])
def test_bad_requests_are_rejected_and_change_nothing(bad, exc, match):
    sched = make_scheduler(num_kv_blocks=256, block_size=4, max_model_len=512)
    sched.add("ok", [1, 2], params(4))
    before = (sched.stats(), list(sched.requests))
    with pytest.raises(exc, match=match):
        sched.add(bad.get("rid", "new"), bad.get("prompt", [1, 2]),
                  params(bad.get("max_tokens", 4), stop_token_ids=bad.get("stop", ())))
    assert (sched.stats(), list(sched.requests)) == before


def test_request_that_can_never_fit_the_pool_is_rejected():
    sched = make_scheduler(num_kv_blocks=3, block_size=4, max_model_len=512)
    with pytest.raises(RequestRejectedError, match="needs 4 KV blocks .* has only 3"):
        sched.add("big", [1] * 10, params(7))  # 16 positions = 4 blocks
    sched.add("fits", [1] * 10, params(3))  # 12 positions = 3 blocks
    with pytest.raises(ValueError, match="already in use"):
        sched.add("fits", [1], params(3))


def test_seed_is_resolved_at_admission_and_kept():
    sched = make_scheduler()
    r = sched.add("a", [1], SamplingParams(max_tokens=3))
    assert r.params.seed is not None
    assert sched.add("b", [1], SamplingParams(max_tokens=3, seed=42)).params.seed == 42


def test_randomized_driver_keeps_every_invariant():
    """Random arrivals, aborts, stops and injected failures; invariants checked after every step."""
    rng = random.Random(1234)
    for trial in range(25):
        B = rng.choice([1, 2, 3, 4, 8])
        mode = rng.choice(["deferred", "eager", "verify"])
        sched = make_scheduler(deep_interval=B, mode=mode, num_kv_blocks=rng.randint(8, 40), block_size=4,
                               max_num_seqs=rng.randint(1, 8))
        ex = FakeExecutor(vocab_size=50)
        ended: dict[str, str] = {}
        added = 0
        for step in range(150):
            for _ in range(rng.randint(0, 2)):
                rid = f"t{trial}-{added}"
                added += 1
                if rng.random() < 0.2:
                    ex.stop_at[rid] = rng.randint(1, 6)
                try:
                    sched.add(rid, [1] * rng.randint(1, 9), params(rng.randint(1, 12), seed=added))
                except RequestRejectedError:
                    pass
            if sched.requests and rng.random() < 0.15:
                rid = rng.choice(list(sched.requests))
                u = sched.abort(rid)
                ended[rid] = "abort"
                assert u.finished
            if rng.random() < 0.05:
                ex.fail[sched._next_step] = rng.choice(list(Phase))
            plan = sched.schedule()
            result = ex.execute(plan)
            if sched.requests and rng.random() < 0.05:  # abort while the step is in flight
                rid = rng.choice(list(sched.requests))
                sched.abort(rid)
                ended[rid] = "abort"
            update_checked(sched, plan, result, ended, B, mode)
        abort_all_and_release(sched, ex)
        assert ex.retained == {}  # every retained row was consumed or released


def test_verify_counters_count_tested_drafts():
    """tested_drafts = accepted drafts + one per block whose test hit a rejection (later drafts are
    discarded untested); accepted / tested is the per-position acceptance probability."""
    sched = make_scheduler(deep_interval=4, mode="verify")
    ex = FakeExecutor(vocab_size=50)
    calls = []
    inner = ex.verify

    def recording_verify(d):
        v = inner(d)
        calls.append((len(d.draft_token_ids), v.num_accepted))
        return v

    ex.verify = recording_verify
    for i in range(6):
        sched.add(f"r{i}", [1, 2, 3], params(23, seed=i))
    while sched.requests:
        sched.update(plan := sched.schedule(), ex.execute(plan))
    c = sched.counters
    rejected_blocks = sum(acc < n for n, acc in calls)
    assert rejected_blocks > 0 and sum(acc == n for n, acc in calls) > 0  # both cases exercised
    assert c.accepted_tokens == sum(acc for _, acc in calls)
    assert c.tested_drafts == c.accepted_tokens + rejected_blocks
    assert c.drafted_tokens >= sum(n for n, _ in calls) >= c.tested_drafts


@pytest.mark.parametrize("pause_at", range(1, 12))
def test_a_flush_gives_eager_the_readout_schedule_of_deferred(pause_at):
    """pause("keep") flushes where needs_flush() says so (EngineControl.poll): the next step is every
    cohort's boundary. Eager runs the deep loops at once, so it has no deep work pending, yet it must flush
    where deferred does, or the two modes' readout loops (and so tokens) part after a pause mid-block."""
    B = 3
    loops, flushed = {}, {}
    for mode in ("deferred", "eager"):
        sched, ex = make_scheduler(deep_interval=B, mode=mode), FakeExecutor()
        sched.add("r", [1, 2, 3], params(14, ignore_eos=True))
        for step in range(40):  # step 0 is the prefill (token 1), step k samples token k + 1
            if step == pause_at:
                flushed[mode] = sched.needs_flush()
                if flushed[mode]:
                    sched.force_boundary()
            _, updates = run_step(sched, ex)
            done = [u.request for u in updates if u.finished]
            if done:
                loops[mode] = done[0].readout_loops
                break
    assert loops["eager"] == loops["deferred"] and flushed["eager"] == flushed["deferred"], (loops, flushed)
    natural = [4 if j == 1 or (j - 1) % B == 0 else 2 for j in range(1, 15)]
    assert flushed["eager"] == (natural[pause_at - 1] == 2)  # mid-block: the token before read loop s
    if flushed["eager"]:
        assert loops["eager"][pause_at] == 4  # the forced boundary's token reads loop T
    else:
        assert loops["eager"] == natural
