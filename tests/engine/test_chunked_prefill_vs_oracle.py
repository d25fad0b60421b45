"""Chunked prefill end to end in float64: a tiny token budget splits every prompt into many chunks (each
one after the first reads its history from the pool), and every output equals the unchunked run's and
the dense oracle's (tests/oracle.py): tokens, processed log-probs (1e-6), readout loops, and every
populated KV plane, in every mode, with n > 1 samples, prefix-cache hits and preemption."""

from __future__ import annotations

import random

import pytest

from ourobatch import EngineConfig, SamplingParams
from ourobatch.assembly import build_engine_core
from tests.oracle import load_oracle

from .test_generation_vs_oracle import check_against_oracle
from .test_preemption_vs_oracle import check_replay, run

TOL = 1e-6


def core_for(ckpt, **kw):
    base = dict(model=str(ckpt), dtype="float64", max_model_len=128, max_num_seqs=16)
    base.update(kw)
    return build_engine_core(EngineConfig(**base))


def workload(rng, V):
    """Prompts of 30-70 tokens: n = 3 samples of one, a repeat of it later (prefix-cache hit), and a
    prompt sharing the first 32 tokens of another."""
    a = [rng.randrange(V) for _ in range(45)]
    b = [rng.randrange(V) for _ in range(33)]
    c = [rng.randrange(V) for _ in range(68)]
    return [
        (a, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
        (b, SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)),
        (c, SamplingParams(max_tokens=9, temperature=1.1, top_k=6, top_p=0.9, seed=8, ignore_eos=True)),
        (a[:32] + [rng.randrange(V) for _ in range(20)],
         SamplingParams(max_tokens=10, temperature=0.8, seed=9, ignore_eos=True)),
        (b, SamplingParams(max_tokens=10, temperature=1.0, seed=10, ignore_eos=True)),
    ]


@pytest.mark.parametrize("mode,B,bs,budget,cap", [("deferred", 1, 4, 8, None), ("deferred", 4, 4, 8, None),
                                                  ("eager", 3, 8, 16, None), ("verify", 4, 4, 16, None),
                                                  ("deferred", 2, 8, 8, None), ("deferred", 1, 4, 64, 8),
                                                  ("verify", 2, 4, 64, 4)])
def test_chunked_prefill_equals_unchunked_and_the_oracle(checkpoints, mode, B, bs, budget, cap):
    """`cap`: the chunks come from max_prefill_tokens_while_decoding (a budget of 64 alone would not chunk)."""
    ckpt = checkpoints["kv1-L2-T4"]
    oracle = load_oracle(ckpt)
    work = workload(random.Random(f"{mode}{B}{bs}"), oracle.vocab_size)
    arrivals = [0, 0, 2, 6, 9]
    outs, stats = {}, {}
    for b in (budget, 8192):
        # a pool large enough that no block is reused, so finished requests' planes can be read back
        core = core_for(ckpt, mode=mode, deep_interval=B, shallow_loops=2, block_size=bs, num_kv_blocks=512,
                        max_num_batched_tokens=b, max_prefill_tokens_while_decoding=cap if b == budget else None)
        children = run(core, work, arrivals)
        outs[b] = [r for rid in sorted(children) for r in children[rid]]
        stats[b] = core.stats()
        for r in outs[b]:
            if mode == "verify":
                check_replay(oracle, r)
            else:
                check_against_oracle(core, oracle, [r], B, 2, mode)
        assert stats[b]["kv_blocks_used"] == 0 and stats[b]["prefix_cache_hits"] > 0
    assert stats[budget]["prefill_chunks"] > 2 * stats[budget]["prefills"]  # really chunked
    assert stats[8192]["prefill_chunks"] <= stats[8192]["prefills"]  # one chunk per prompt (forks: none)
    for chunked, whole in zip(outs[budget], outs[8192]):
        assert chunked.request_id == whole.request_id
        assert chunked.output_token_ids == whole.output_token_ids
        assert chunked.readout_loops == whole.readout_loops
        assert chunked.logprobs == pytest.approx(whole.logprobs, abs=TOL)


@pytest.mark.parametrize("mode,B", [("deferred", 4), ("verify", 2)])
def test_preempted_chunked_prefills_stay_exact(checkpoints, mode, B):
    ckpt = checkpoints["kv2-L2-T5"]
    oracle = load_oracle(ckpt)
    rng = random.Random(mode)
    V = oracle.vocab_size
    work = [([rng.randrange(V) for _ in range(rng.randint(20, 40))],
             SamplingParams(max_tokens=rng.randint(20, 28), temperature=1.0, seed=i, ignore_eos=True))
            for i in range(5)]
    # 20 blocks of 4: any request fits alone (<= 17 blocks), five at once do not
    core = core_for(ckpt, mode=mode, deep_interval=B, block_size=4, num_kv_blocks=20, max_num_batched_tokens=8,
                    kv_watermark=0.0)
    children = run(core, work, arrivals=[0, 1, 1, 3, 5])
    stats = core.stats()
    assert stats["preemptions"] > 0 and stats["prefill_chunks"] > 2 * stats["prefills"]
    for kids in children.values():
        for r in kids:
            check_replay(oracle, r)
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


def test_a_budget_below_one_block_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"EngineConfig\.max_num_batched_tokens must be >= block_size \(16\).*got 8"):
        EngineConfig(model=str(tmp_path), max_num_batched_tokens=8)
    with pytest.raises(TypeError, match=r"EngineConfig\.max_num_batched_tokens must be an int"):
        EngineConfig(model=str(tmp_path), max_num_batched_tokens=16.0)
    assert EngineConfig(model=str(tmp_path), block_size=4, max_num_batched_tokens=4).max_num_batched_tokens == 4
