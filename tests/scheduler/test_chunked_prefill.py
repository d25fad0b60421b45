"""Chunked prefill in the sans-IO scheduler (scheduler/prefill.py), driven by the fake executor.

A step's budget, max_num_batched_tokens, counts its decode rows plus its prefill tokens. Decoding
requests are never stalled by a long prompt; prefills fill what is left in chunks that end on block
boundaries (except the last), so the prefix cache registers full blocks as they complete; only the last
chunk samples. Aborts, failures and preemptions between two chunks leak no block.
"""

from __future__ import annotations

import random

import pytest

from scheduler import Phase, RequestRejectedError, RequestStatus, SamplingParams

from .conftest import abort_all_and_release, check_block_refs, make_scheduler, update_checked
from .fakes import FakeExecutor
from .test_kv_memory import WriteChecker

T = 4


def params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=kw.pop("seed", 1), ignore_eos=kw.pop("ignore_eos", True), **kw)


def prefill_tokens(plan) -> int:
    return sum(len(p.token_ids) for p in plan.prefills)


def check_plan_budget(plan, budget: int, block_size: int) -> None:
    """Prefills take what the decode rows leave of the budget; the first one gets at least one block."""
    assert prefill_tokens(plan) <= max(budget - len(plan.shallow), block_size), plan


def check_chunks(plans, rid: str, block_size: int, total: int) -> list[tuple[int, int]]:
    """rid's prefill works, in order: contiguous, every one but the last ends on a block boundary and
    samples nothing; the last reaches `total` and samples from loop T. Returns (start, length) pairs."""
    works = [p for plan in plans for p in plan.prefills if p.request_id == rid]
    spans = [(w.start_position, len(w.token_ids)) for w in works]
    for (start, n), (nxt, _) in zip(spans, spans[1:]):
        assert start + n == nxt and (start + n) % block_size == 0 and n > 0, spans
    assert all(w.sample is None for w in works[:-1]) and works[-1].sample.loop == T
    assert spans[-1][0] + spans[-1][1] == total
    return spans


def run(sched, ex, arrivals, budget, on_plan=None, max_steps=5000):
    """Add arrivals[step] before each step; check the budget and the block references every step."""
    done, plans, step = {}, [], 0
    while step <= max(arrivals, default=0) or sched.has_unfinished:
        for rid, prompt, p in arrivals.get(step, []):
            sched.add(rid, prompt, p)
        before = {rid: r.status for rid, r in sched.requests.items()}
        feeding = {rid for rid, r in sched.requests.items()
                   if r.status == RequestStatus.DECODING and r.can_feed}
        plan = sched.schedule()
        plans.append(plan)
        check_plan_budget(plan, budget, sched.config.block_size)
        if on_plan:
            on_plan(plan, before, feeding)
        for u in sched.update(plan, ex.execute(plan)):
            if u.finished:
                assert u.request.request_id not in done
                done[u.request.request_id] = u.request
        check_block_refs(sched)
        step += 1
        assert step < max_steps, "did not finish"
    ex.execute(sched.schedule())  # the plan that releases the last requests' engine-side rows
    return done, plans


@pytest.mark.parametrize("mode,B", [("deferred", 1), ("deferred", 4), ("eager", 3), ("verify", 4)])
def test_a_long_prompt_never_stalls_decoding(mode, B):
    budget, bs = 16, 4
    results = {}
    for b in (budget, 4096):  # chunked, and the whole prompt in one step
        sched = make_scheduler(mode=mode, deep_interval=B, block_size=bs, max_num_batched_tokens=b)
        ex = FakeExecutor()
        arrivals = {0: [(f"d{i}", [1 + i, 2, 3], params(60, seed=i)) for i in range(4)],
                    3: [("long", [7 + i % 5 for i in range(70)], params(5))]}
        stalled = []

        def watch(plan, before, feeding):
            fed = {w.request_id for w in plan.shallow}
            if before.get("long") in (RequestStatus.WAITING, RequestStatus.PREFILLING):
                stalled.extend(feeding - fed)  # a decoding request that got no row while "long" prefilled

        done, plans = run(sched, ex, arrivals, b, watch)
        assert stalled == []
        assert sched.stats()["preemptions"] == 0 and sched.stats()["kv_blocks_used"] == 0
        spans = check_chunks(plans, "long", bs, 70)
        if b == budget:
            assert len(spans) >= 70 // budget + 1  # really chunked, 4 decode rows in every step
            assert sched.stats()["prefill_chunks"] == 4 + len(spans) and sched.stats()["prefills"] == 5
        else:
            assert spans == [(0, 70)]
        for rid, r in done.items():
            assert r.finish_reason == "length" and r.readout_loops[0] == T
            if mode != "verify":
                assert r.output_token_ids == [ex.token(rid, j) for j in range(1, r.params.max_tokens + 1)]
        results[b] = {rid: (r.output_token_ids, r.readout_loops) for rid, r in done.items()}
    assert results[budget] == results[4096]


def test_decode_rows_beyond_the_budget_still_leave_one_block_per_step():
    budget, bs = 8, 4
    sched, ex = make_scheduler(block_size=bs, max_num_batched_tokens=budget, deep_interval=1), FakeExecutor()
    chunks = []

    def watch(plan, before, feeding):
        if before.get("long") in (RequestStatus.WAITING, RequestStatus.PREFILLING):
            assert feeding <= {w.request_id for w in plan.shallow}
            assert len(plan.shallow) > budget  # the decode rows alone exceed the budget
            chunks.extend(len(p.token_ids) for p in plan.prefills if p.request_id == "long")

    arrivals = {0: [(f"d{i}", [1, 2], params(50, seed=i)) for i in range(12)],
                12: [("long", list(range(1, 41)), params(3))]}
    done, plans = run(sched, ex, arrivals, budget, watch)
    assert chunks == [bs] * 10  # one block per step: the documented minimum
    check_chunks(plans, "long", bs, 40)
    assert done["long"].num_output_tokens == 3


@pytest.mark.parametrize("mode,B", [("deferred", 1), ("deferred", 4), ("verify", 2)])
def test_the_cap_while_decoding_bounds_prefills_only_beside_decode_rows(mode, B):
    """max_prefill_tokens_while_decoding: with requests decoding a step prefills at most the cap (whole
    blocks, the last chunk excepted, as always); with none decoding the budget alone bounds it; outputs are
    those of the uncapped run."""
    bs, cap, budget = 4, 8, 64
    results = {}
    for c in (cap, None):
        sched = make_scheduler(mode=mode, deep_interval=B, block_size=bs, max_num_batched_tokens=budget,
                               max_prefill_tokens_while_decoding=c)
        ex = FakeExecutor()
        arrivals = {0: [("first", [1 + i % 40 for i in range(50)], params(30))],  # alone: the whole budget
                    4: [(f"late{i}", [5 + i] * (20 + 7 * i), params(6, seed=i)) for i in range(3)]}
        sizes = []  # (decode rows, prompt tokens) of every step that prefilled

        def watch(plan, before, feeding):
            if plan.prefills:
                sizes.append((len(plan.shallow), prefill_tokens(plan)))

        done, plans = run(sched, ex, arrivals, budget, watch)
        for rid, n in [("first", 50)] + [(f"late{i}", 20 + 7 * i) for i in range(3)]:
            check_chunks(plans, rid, bs, n)
        assert sizes[0] == (0, 50)  # nobody decoding: one chunk of 50 under the budget of 64
        beside = [tokens for rows, tokens in sizes if rows > 0]
        assert beside and (max(beside) <= cap if c else max(beside) > cap)
        assert sched.stats()["kv_blocks_used"] == 0
        results[c] = {rid: (r.output_token_ids, r.readout_loops) for rid, r in done.items()}
    assert results[cap] == results[None]


def test_the_cap_while_decoding_is_checked():
    with pytest.raises(ValueError, match=r"max_prefill_tokens_while_decoding must be None or >= block_size \(4\)"):
        make_scheduler(block_size=4, max_prefill_tokens_while_decoding=2)
    with pytest.raises(TypeError, match="max_prefill_tokens_while_decoding must be an int"):
        make_scheduler(max_prefill_tokens_while_decoding=8.0)


def test_full_blocks_enter_the_prefix_cache_as_each_chunk_completes():
    bs = 4
    sched, ex = make_scheduler(block_size=bs, max_num_batched_tokens=8), FakeExecutor()
    prompt = list(range(1, 31))  # 30 tokens: 7 full blocks and 2 tokens
    first = sched.add("a", prompt, params(4))
    cached = []
    for _ in range(3):
        plan = sched.schedule()
        sched.update(plan, ex.execute(plan))
        cached.append(sched.blocks.num_cached)
    assert cached == [2, 4, 6] and first.status == RequestStatus.PREFILLING and first.num_deep_positions == 24
    sched.abort("a")  # its registered blocks stay in the cache, evictable
    assert sched.blocks.num_used == 0
    sched.add("b", prompt, params(4))
    plan = sched.schedule()
    assert [(p.request_id, p.start_position, len(p.token_ids)) for p in plan.prefills] == [("b", 24, 6)]
    sched.update(plan, ex.execute(plan))
    assert sched.stats()["prefix_cache_hits"] == 24 and sched.blocks.num_cached == 7


@pytest.mark.parametrize("in_flight", [False, True])
def test_abort_between_or_during_chunks_frees_every_block(in_flight):
    sched, ex = make_scheduler(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8), FakeExecutor()
    sched.add("x", list(range(1, 41)), params(5))
    plan = sched.schedule()
    sched.update(plan, ex.execute(plan))
    plan = sched.schedule()  # the second chunk
    assert sched.requests["x"].status == RequestStatus.PREFILLING and len(sched.requests["x"].block_ids) == 4
    if in_flight:
        result = ex.execute(plan)
        sched.abort("x")
        assert sched.update(plan, result) == []  # its results are ignored
    else:
        sched.update(plan, ex.execute(plan))
        sched.abort("x")
    assert sched.blocks.num_used == 0 and sched.prefills.under_way.keys() <= {"x"}
    assert sched.schedule().released_request_ids == ("x",) and not sched.prefills.under_way
    sched.reset_prefix_cache()
    assert sched.blocks.num_free == sched.blocks.num_blocks == 64


def test_a_reused_id_starts_its_own_prefill():
    sched, ex = make_scheduler(block_size=4, max_num_batched_tokens=8), FakeExecutor()
    old = sched.add("x", list(range(1, 41)), params(5))
    plan = sched.schedule()
    result = ex.execute(plan)
    sched.abort("x")  # while its first chunk is in flight
    new = sched.add("x", [5, 6, 7], params(2))
    assert sched.update(plan, result) == [] and new.status == RequestStatus.WAITING
    done, plans = run(sched, ex, {}, 8)
    assert [(p.start_position, p.token_ids) for plan in plans for p in plan.prefills] == [(0, (5, 6, 7))]
    assert done["x"] is new and new.output_token_ids == [ex.token("x", 1), ex.token("x", 2)]
    assert old.finish_reason == "abort" and sched.blocks.num_used == 0


def test_a_failed_chunk_fails_only_its_request_and_frees_its_blocks():
    sched, ex = make_scheduler(block_size=4, max_num_batched_tokens=8, deep_interval=1), FakeExecutor()
    sched.add("d", [1, 2], params(20))
    ex.fail[2] = Phase.PREFILL  # the second chunk of "long"
    done, plans = run(sched, ex, {1: [("long", list(range(1, 30)), params(3))]}, 8)
    assert done["long"].finish_reason == "error" and "prefill failed" in done["long"].error
    assert [len(p.token_ids) for plan in plans[:3] for p in plan.prefills if p.request_id == "long"] == [4, 4]
    assert done["d"].finish_reason == "length" and done["d"].num_output_tokens == 20
    assert sched.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_between_chunks_restarts_the_prefill_and_leaks_nothing(caching):
    bs = 4
    sched = make_scheduler(num_kv_blocks=20, block_size=bs, max_num_batched_tokens=8, kv_watermark=0.0,
                           enable_prefix_caching=caching, deep_interval=1)
    ex = WriteChecker()
    ex.sched = sched
    preempted_mid_prefill = []

    def watch(plan, before, feeding):
        r = sched.requests.get("long")
        if r is not None and before.get("long") == RequestStatus.PREFILLING and r.status == RequestStatus.WAITING:
            preempted_mid_prefill.append(r.num_preemptions)
        oldest = min((r for r in sched.requests.values() if r.status != RequestStatus.WAITING),
                     key=lambda r: r.arrival_index, default=None)
        assert oldest is None or oldest.num_preemptions == 0 or oldest.request_id == "long"

    # two older decoders grow to 8 blocks each; "long" (40 tokens = 10 blocks) is admitted while they are
    # small, and the pool runs dry before its last chunk
    arrivals = {0: [("d0", [1, 2, 3], params(30, seed=1)), ("d1", [4, 5, 6], params(30, seed=2))],
                14: [("long", [9] * 40, params(3))]}
    done, plans = run(sched, ex, arrivals, 8, watch)
    assert preempted_mid_prefill, "the prefill under way was never preempted"
    stats = sched.stats()
    assert stats["preemptions"] >= 1 and stats["kv_blocks_used"] == 0 and ex.retained == {}
    for rid, r in done.items():
        assert r.output_token_ids == [ex.token(rid, j) for j in range(1, r.params.max_tokens + 1)], rid
    starts = [p.start_position for plan in plans for p in plan.prefills if p.request_id == "long"]
    restarts = [b for a, b in zip(starts, starts[1:]) if b <= a]
    assert restarts and (all(s > 0 for s in restarts) if caching else restarts == [0] * len(restarts))


@pytest.mark.parametrize("P", [30, 32])
def test_the_samples_of_a_long_prompt_share_its_blocks(P):
    bs, n = 4, 4
    sched = make_scheduler(block_size=bs, max_num_batched_tokens=8)
    ex = WriteChecker()
    ex.sched = sched
    prompt = [3 + i % 7 for i in range(P)]
    done, plans = run(sched, ex, {0: [(f"a{i}", prompt, params(6, seed=i)) for i in range(n)]}, 8)
    stats = sched.stats()
    # the full blocks are computed once; a sample computes the tokens after them, or forks (P % bs == 0)
    assert stats["prefill_tokens_computed"] == P + (n - 1) * (P % bs)
    assert stats["prefix_cache_hits"] == (n - 1) * (P // bs) * bs
    check_chunks(plans, "a0", bs, P)
    forks = [p for plan in plans for p in plan.prefills if p.sample_from is not None]
    assert len(forks) == (n - 1 if P % bs == 0 else 0)
    for rid, r in done.items():
        assert r.output_token_ids == [ex.token(rid, j) for j in range(1, 7)]
    assert stats["kv_blocks_used"] == 0


def test_a_prefix_cache_reset_stops_a_prefill_under_way_from_registering():
    sched, ex = make_scheduler(block_size=4, max_num_batched_tokens=8), FakeExecutor()
    sched.add("a", list(range(1, 30)), params(2))
    plan = sched.schedule()
    sched.update(plan, ex.execute(plan))
    assert sched.blocks.num_cached == 2
    assert sched.reset_prefix_cache() == 2  # a weight update: the chunks after it attend to stale KV
    done, _ = run(sched, ex, {}, 8)
    assert done["a"].num_output_tokens == 2 and sched.blocks.num_cached == 0


def test_preempt_all_takes_prefills_under_way_too():
    sched, ex = make_scheduler(block_size=4, max_num_batched_tokens=8), FakeExecutor()
    r = sched.add("a", list(range(1, 30)), params(3))
    plan = sched.schedule()
    sched.update(plan, ex.execute(plan))
    assert r.status == RequestStatus.PREFILLING
    assert sched.preempt_all() == 1  # sleep() and resume(recompute_kv=True): its KV does not survive
    assert r.status == RequestStatus.WAITING and r.block_ids == () and sched.blocks.num_used == 0
    done, _ = run(sched, ex, {}, 8)
    assert done["a"].output_token_ids == [ex.token("a", j) for j in range(1, 4)]


def test_a_budget_below_one_block_is_rejected():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens must be >= block_size \(8\).*got 7"):
        make_scheduler(block_size=8, max_num_batched_tokens=7)
    assert make_scheduler(block_size=8, max_num_batched_tokens=8).config.max_num_batched_tokens == 8


def test_randomized_chunking_keeps_every_invariant():
    rng = random.Random(99)
    for trial in range(20):
        B = rng.choice([1, 2, 4])
        mode = rng.choice(["deferred", "eager", "verify"])
        bs = rng.choice([2, 4])
        budget = rng.randint(bs, 20)
        sched = make_scheduler(deep_interval=B, mode=mode, num_kv_blocks=rng.randint(12, 40), block_size=bs,
                               max_num_seqs=rng.randint(1, 8), max_num_batched_tokens=budget,
                               enable_prefix_caching=rng.random() < 0.7)
        ex = WriteChecker(stop_at={f"t{trial}-{i}": rng.randint(1, 8) for i in range(0, 400, 3)})
        ex.sched = sched
        prompts = [[rng.randrange(1, 50) for _ in range(rng.randint(1, 30))] for _ in range(5)]
        ended: dict[str, str] = {}
        added = stalls = 0
        for step in range(200):
            if rng.random() < 0.5:
                rid = f"t{trial}-{added}"
                added += 1
                try:
                    sched.add(rid, rng.choice(prompts), params(rng.randint(1, 12), seed=added, ignore_eos=False))
                except RequestRejectedError:
                    pass
            if sched.requests and rng.random() < 0.08:
                rid = rng.choice(sorted(sched.requests))
                assert sched.abort(rid).finished
                ended[rid] = "abort"
            if rng.random() < 0.04:
                ex.fail[sched._next_step] = rng.choice(list(Phase))
            under_way = sorted((r for r in sched.requests.values() if r.status == RequestStatus.PREFILLING),
                               key=lambda r: r.arrival_index)
            plan = sched.schedule()
            check_plan_budget(plan, budget, bs)
            if under_way and under_way[0].status == RequestStatus.PREFILLING:  # not preempted in this step
                stalls += under_way[0].request_id not in {p.request_id for p in plan.prefills}
            result = ex.execute(plan)
            if sched.requests and rng.random() < 0.04:  # abort while the step is in flight
                rid = rng.choice(sorted(sched.requests))
                sched.abort(rid)
                ended[rid] = "abort"
            update_checked(sched, plan, result, ended, B, mode)
        abort_all_and_release(sched, ex)
        assert ex.retained == {} and not sched.prefills.under_way
        assert stalls == 0, "the oldest prefill under way got no chunk in a step"
        sched.reset_prefix_cache()
        assert sched.blocks.num_free == sched.blocks.num_blocks
    assert sched.stats()["prefill_chunks"] > sched.stats()["prefills"]


def test_blocks_computed_by_a_step_in_flight_across_a_reset_are_not_cached():
    # async scheduling: a chunk planned before reset_prefix_cache() lands after it. Its blocks were computed before
    # the reset (the KV a caller resets to drop), so a later request with the prompt must not be served them
    sched, ex = make_scheduler(num_kv_blocks=64, block_size=4, max_num_batched_tokens=64), FakeExecutor()
    prompt = list(range(1, 14))
    sched.add("x", prompt, params(2))
    plan = sched.schedule()
    result = ex.execute(plan)
    sched.reset_prefix_cache()  # with the step in flight
    sched.update(plan, result)
    while sched.has_unfinished:
        plan = sched.schedule()
        sched.update(plan, ex.execute(plan))
    assert sched.blocks.num_cached == 0
    hits = sched.stats()["prefix_cache_hits"]
    late = sched.add("y", prompt, params(2))
    plan = sched.schedule()
    assert [p.start_position for p in plan.prefills] == [0] and late.num_cached_tokens == 0
    sched.update(plan, ex.execute(plan))
    assert sched.stats()["prefix_cache_hits"] == hits
    # without a reset in between the same run caches them (the check above can fail)
    sched.add("z", prompt, params(2))
    plan = sched.schedule()
    assert [p.start_position for p in plan.prefills] == [12]
