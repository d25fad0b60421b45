"""Issue 11 in the sans-IO scheduler: lazy KV, preemption by recompute, shared prefixes, fair admission."""

from __future__ import annotations

import random

import pytest

from scheduler import RequestStatus, SamplingParams
from scheduler.admission import MAX_BYPASS

from .conftest import check_block_refs, make_scheduler, run_step
from .fakes import FakeExecutor


def params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=kw.pop("seed", 1), ignore_eos=kw.pop("ignore_eos", True), **kw)


class WriteChecker(FakeExecutor):
    """The fake executor, plus: a block is written only while its request holds it alone, or by the one
    prefill that computes it (siblings admitted in the same step share it from that prefill on)."""

    sched = None

    def execute(self, plan):
        bs = self.sched.config.block_size
        writes = [(p.request_id, p.block_ids, range(p.start_position, p.start_position + len(p.token_ids)))
                  for p in plan.prefills]
        writes += [(w.request_id, w.block_ids, range(w.position, w.position + 1)) for w in plan.shallow]
        for rid, block_ids, positions in writes:
            computing = {b for _, b in self.sched.requests[rid].pending_block_keys}
            for pos in positions:
                block = block_ids[pos // bs]
                if block not in computing:
                    assert self.sched.blocks.ref_count(block) == 1, f"{rid} writes {pos} into shared block {block}"
        return super().execute(plan)


def drive(sched, ex, arrivals, max_steps=20_000, on_step=None):
    """arrivals: step -> list of (rid, prompt, params). Returns finished requests by id."""
    done, step = {}, 0
    while step <= max(arrivals, default=0) or sched.has_unfinished:
        for rid, prompt, p in arrivals.get(step, []):
            sched.add(rid, prompt, p)
        plan = sched.schedule()
        for u in sched.update(plan, ex.execute(plan)):
            if u.finished:
                assert u.request.request_id not in done
                done[u.request.request_id] = u.request
        check_block_refs(sched)
        if on_step:
            on_step(sched)
        step += 1
        assert step < max_steps, "did not finish"
    ex.execute(sched.schedule())  # the plan that releases the last requests' engine-side rows
    return done


def test_lazy_allocation_runs_far_more_requests_at_once_than_reserving():
    peaks = {}
    for allocation in ("reserve", "lazy"):
        sched = make_scheduler(num_kv_blocks=40, block_size=4, max_num_seqs=64, kv_allocation=allocation)
        ex = FakeExecutor(stop_at={f"r{i}": 5 for i in range(30)})  # max_tokens 40, but each stops at 5
        peak = []
        done = drive(sched, ex, {0: [(f"r{i}", [1 + i % 9, 2, 3], params(40, ignore_eos=False)) for i in range(30)]},
                     on_step=lambda s: peak.append(s.stats()["num_running"]))
        assert all(r.num_output_tokens == 5 and r.finish_reason == "stop" for r in done.values())
        peaks[allocation] = max(peak)
    assert peaks["reserve"] == 40 // 11  # ceil((3 + 40 - 1) / 4) = 11 blocks each
    assert peaks["lazy"] >= 5 * peaks["reserve"]


@pytest.mark.parametrize("mode,B", [("deferred", 1), ("deferred", 4), ("eager", 3), ("verify", 4)])
def test_preemption_loses_and_resamples_nothing(mode, B):
    sched = make_scheduler(num_kv_blocks=24, block_size=4, mode=mode, deep_interval=B, kv_watermark=0.0)
    ex = WriteChecker()
    ex.sched = sched
    arrivals = {}
    for i in range(8):
        arrivals.setdefault(i % 5, []).append((f"r{i}", [1 + i, 2, 3, 4, 5][: 2 + i % 4], params(30 + i)))
    preempted_oldest = []
    done = drive(sched, ex, arrivals,
                 on_step=lambda s: preempted_oldest.append(s.requests.get("r0") and s.requests["r0"].num_preemptions))
    stats = sched.stats()
    assert stats["preemptions"] > 0 and stats["recomputed_tokens"] > 0
    for rid, r in done.items():
        # the fake's token depends only on (request, j): a lost or re-sampled token would show
        if mode != "verify":
            assert r.output_token_ids == [ex.token(rid, j) for j in range(1, r.params.max_tokens + 1)], rid
        assert r.num_output_tokens == r.params.max_tokens and r.finish_reason == "length"
        T = 4
        # every (re)prefill reads loop T: token 1 and the token after each readmission
        assert r.readout_loops[0] == T
    assert not any(preempted_oldest), "the oldest request was preempted"
    assert stats["kv_blocks_used"] == 0 and ex.retained == {}


def test_a_large_request_does_not_block_small_ones_nor_starve():
    sched = make_scheduler(num_kv_blocks=30, block_size=4, max_num_seqs=64, kv_watermark=0.0)
    ex = FakeExecutor()
    arrivals = {0: [(f"s{i}", [10 + i] * 20, params(60, seed=i)) for i in range(4)]}  # 5 blocks each
    arrivals[1] = [("big", [9] * 43, params(10))]  # 43-token prompt: 11 blocks, 10 are free
    arrivals[2] = [(f"t{i}", [3, i], params(4)) for i in range(MAX_BYPASS + 10)]
    admitted_at = {}

    def watch(s):
        for r in s.requests.values():
            if r.status != RequestStatus.WAITING and r.request_id not in admitted_at:
                admitted_at[r.request_id] = s.stats()["steps"]

    done = drive(sched, ex, arrivals, on_step=watch)
    assert done["big"].num_output_tokens == 10
    small_first = [rid for rid in admitted_at if rid.startswith("t") and admitted_at[rid] < admitted_at["big"]]
    assert 0 < len(small_first) <= MAX_BYPASS  # later small requests passed it, but at most MAX_BYPASS of them


def test_n_samples_and_repeated_prompts_share_their_full_prompt_blocks():
    sched = make_scheduler(num_kv_blocks=64, block_size=4, max_num_seqs=64)
    ex = WriteChecker()
    ex.sched = sched
    prompt = list(range(1, 15))  # 14 tokens: 3 full blocks, the last (partial) one private
    arrivals = {0: [(f"a{i}", prompt, params(6, seed=i)) for i in range(4)],
                3: [("b", prompt, params(6))], 4: [("c", prompt[:9] + [7, 7], params(6))]}
    first_plan_prefills = []
    done = drive(sched, ex, arrivals, on_step=lambda s: None)
    for p in ex.plans[0].prefills:
        first_plan_prefills.append((p.request_id, p.start_position))
    assert first_plan_prefills == [("a0", 0), ("a1", 12), ("a2", 12), ("a3", 12)]  # prefilled once
    starts = {p.request_id: p.start_position for plan in ex.plans for p in plan.prefills}
    assert starts["b"] == 12 and starts["c"] == 8  # the cache: 3 and 2 full blocks
    stats = sched.stats()
    assert stats["prefix_cache_hits"] == 3 * 12 + 12 + 8
    assert stats["prefill_tokens_requested"] == 5 * 14 + 11
    assert stats["prefill_tokens_computed"] == stats["prefill_tokens_requested"] - stats["prefix_cache_hits"]
    assert all(r.num_output_tokens == 6 for r in done.values())
    assert stats["kv_blocks_used"] == 0 and stats["prefix_cache_blocks"] > 0
    assert sched.reset_prefix_cache() == stats["prefix_cache_blocks"]
    assert sched.stats()["prefix_cache_blocks"] == 0 and sched.blocks.num_free == 64


def test_without_prefix_caching_only_same_step_samples_share():
    sched = make_scheduler(num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    ex = FakeExecutor()
    prompt = list(range(1, 10))
    drive(sched, ex, {0: [(f"a{i}", prompt, params(3, seed=i)) for i in range(3)], 2: [("b", prompt, params(3))]})
    starts = {p.request_id: p.start_position for plan in ex.plans for p in plan.prefills}
    assert starts == {"a0": 0, "a1": 8, "a2": 8, "b": 0}
    assert sched.stats()["prefix_cache_blocks"] == 0


def test_soak_with_sharing_preemption_and_aborts_leaks_nothing():
    rng = random.Random(7)
    for trial in range(6):
        mode = ["deferred", "eager", "verify"][trial % 3]
        sched = make_scheduler(num_kv_blocks=rng.randint(14, 40), block_size=4, mode=mode,
                               deep_interval=rng.choice([1, 2, 4]), max_num_seqs=rng.randint(2, 16))
        ex = WriteChecker(stop_at={f"q{i}": rng.randint(2, 20) for i in range(200)})
        ex.sched = sched
        prompts = [[rng.randrange(1, 50) for _ in range(rng.randint(1, 12))] for _ in range(6)]
        added = 0
        for step in range(400):
            if added < 120 and rng.random() < 0.6:
                sched.add(f"q{added}", rng.choice(prompts), params(rng.randint(1, 30), ignore_eos=False,
                                                                    seed=added))
                added += 1
            if sched.requests and rng.random() < 0.05:
                sched.abort(rng.choice(sorted(sched.requests)))
            plan = sched.schedule()
            sched.update(plan, ex.execute(plan))
            check_block_refs(sched)
        while sched.has_unfinished:
            plan = sched.schedule()
            sched.update(plan, ex.execute(plan))
            check_block_refs(sched)
        stats = sched.stats()
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
        assert stats["prefix_cache_hits"] > 0
        sched.reset_prefix_cache()
        assert sched.stats()["prefix_cache_blocks"] == 0 and sched.blocks.num_free == sched.blocks.num_blocks


def test_samples_of_a_block_aligned_prompt_fork_from_one_prefill():
    sched = make_scheduler(num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    ex = WriteChecker()
    ex.sched = sched
    prompt = list(range(1, 13))  # 12 tokens: exactly 3 blocks
    done = drive(sched, ex, {0: [(f"a{i}", prompt, params(5, seed=i)) for i in range(4)]})
    (plan,) = [p for p in ex.plans if p.prefills]
    assert [(p.request_id, p.start_position, len(p.token_ids), p.sample_from) for p in plan.prefills] == [
        ("a0", 0, 12, None), ("a1", 12, 0, "a0"), ("a2", 12, 0, "a0"), ("a3", 12, 0, "a0")]
    stats = sched.stats()
    assert stats["prefill_tokens_computed"] == 12 and stats["prefix_cache_hits"] == 36
    assert all(r.num_output_tokens == 5 for r in done.values()) and stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("caching", [True, False])
def test_num_cached_tokens_counts_the_prefix_caches_blocks_not_a_same_step_share(fake, caching):
    # two requests with one 13-token prompt admitted in one step: the second shares the first's three full blocks
    # as they are prefilled (prefix_cache_hits counts them: KV shared), but the prefix cache served neither. A
    # third request after both finished finds the blocks in the cache (only with caching on)
    sched = make_scheduler(enable_prefix_caching=caching)
    prompt = [random.Random(3).randrange(1, 50) for _ in range(13)]
    done = drive(sched, fake, {0: [("a", prompt, params(2)), ("b", prompt, params(2))]})
    assert [done[r].num_cached_tokens for r in "ab"] == [0, 0]
    assert sched.stats()["prefix_cache_hits"] == 12
    done = drive(sched, fake, {0: [("c", prompt, params(2))]})
    assert done["c"].num_cached_tokens == (12 if caching else 0)
    assert sched.stats()["prefix_cache_hits"] == (24 if caching else 12)


def test_a_readmission_after_a_preemption_between_prefill_chunks_counts_as_recomputed(fake):
    # 4 tokens a step: the 24-token prompt takes 6 chunks; preempted after 3 of them (no output yet), its
    # readmission prefills all 24 again, and those are the recomputed tokens
    sched = make_scheduler(max_num_batched_tokens=4, enable_prefix_caching=False)
    sched.add("b", list(range(1, 25)), params(1))
    for _ in range(3):
        run_step(sched, fake)
    r = sched.requests["b"]
    assert r.status == RequestStatus.PREFILLING and r.num_output_tokens == 0
    sched.preempt(r)
    done = drive(sched, fake, {})
    stats = sched.stats()
    assert done["b"].num_preemptions == 1 and stats["preemptions"] == 1
    assert stats["recomputed_tokens"] == 24
    assert stats["prefill_tokens_computed"] == 12 + 24  # three chunks, then the whole prompt again


def test_an_abort_for_a_stop_string_counts_as_a_stop(fake):
    # the front ends (LLM, the server) cut stop strings themselves and end the completion in the engine: it is a
    # stop (their finish_reason), not an abort, in the counters /metrics reads
    sched = make_scheduler()
    sched.add("s", [1, 2, 3], params(20))
    sched.add("a", [4, 5, 6], params(20))
    run_step(sched, fake)
    sched.abort("s", stop_string=True)
    sched.abort("a")
    stats = sched.stats()
    assert (stats["finished_stop"], stats["finished_abort"]) == (1, 1)
    assert not sched.requests and sched.blocks.num_used == 0
