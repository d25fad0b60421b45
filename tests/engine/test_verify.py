"""Verify mode (lossless): greedy equals full depth, the sampled law equals full depth's, log-probs and
every KV plane equal the oracle's for the final accepted sequence after any number of rollbacks."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from scipy.stats import chi2

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.assembly import build_engine_core
from ourobatch.testing import FaultInjector, make_tiny_checkpoint
from tests.oracle import load_oracle, processed_logprobs, readout_position

from .conftest import SHAPES
from .test_generation_vs_oracle import run_staggered

SHAPE_LOOPS = [(shape, s) for shape, cfg in SHAPES.items() for s in (1, 2, 3) if s < cfg["total_ut_steps"]]


def engine(ckpt, **kw):
    cfg = dict(model=str(ckpt), dtype="float64", block_size=4, num_kv_blocks=512)
    cfg.update(kw)
    return SyncEngine(EngineConfig(**cfg))


@pytest.mark.parametrize("shape,s", SHAPE_LOOPS)
@pytest.mark.parametrize("B", [2, 3, 4, 8])
def test_greedy_verify_equals_interval_one(checkpoints, shape, s, B):
    ckpt = checkpoints[shape]
    rng = random.Random(hash((shape, s, B)) & 0xFFFF)
    V = SHAPES[shape].get("vocab_size", 31)
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 6))] for _ in range(4)]
    greedy = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    with engine(ckpt, mode="deferred", deep_interval=1) as full:
        ref = [o.outputs[0].token_ids for o in full.generate_batch(prompts, greedy)]
    # stop tokens that end requests mid-block: a token each reference output reaches at step 6..10
    stops = [r[rng.randint(5, 9)] for r in ref]
    stop_params = [SamplingParams(max_tokens=17, temperature=0.0, stop_token_ids=[t]) for t in stops]
    with engine(ckpt, mode="verify", deep_interval=B, shallow_loops=s) as llm:
        got = llm.generate_batch(prompts, greedy)
        stopped = llm.generate_batch(prompts, stop_params)
        stats = llm.stats()
    for g, r in zip(got, ref):
        assert g.outputs[0].token_ids == r
        assert g.outputs[0].readout_loops == [SHAPES[shape]["total_ut_steps"]] * 17
    for g, r, t in zip(stopped, ref, stops):
        assert g.outputs[0].finish_reason == "stop" and g.outputs[0].token_ids == r[:r.index(t) + 1]
    assert stats["drafted_tokens"] >= stats["accepted_tokens"] > 0 or stats["drafted_tokens"] > 0
    assert stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("shape", ["kv1-L2-T4", "kv2-L3-T4-hd16", "kv4-L2-T3"])
@pytest.mark.parametrize("B", [2, 4])
def test_sampled_verify_logprobs_and_planes_match_the_oracle(checkpoints, shape, B):
    ckpt = checkpoints[shape]
    oracle = load_oracle(ckpt)
    T = oracle.total_ut_steps
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
    params = [SamplingParams(max_tokens=16, temperature=t, seed=40 + i, top_k=k, ignore_eos=True)
              for i, (t, k) in enumerate([(1.0, 0), (0.7, 0), (1.3, 8), (0.0, 0)])]
    core = build_engine_core(EngineConfig(model=str(ckpt), dtype="float64", mode="verify", deep_interval=B,
                                          block_size=4, num_kv_blocks=512))
    requests = run_staggered(core, prompts, params, arrival_steps=[0, 0, 2, 3])
    assert core.stats()["rolled_back_positions"] > 0  # the test exercises rollbacks
    pool = core.executor.pool
    for r in requests:
        P, toks = r.num_prompt_tokens, r.output_token_ids
        assert r.readout_loops == [T] * len(toks)
        fed = list(r.prompt_token_ids) + toks[:-1]
        out = oracle.forward(fed)
        for j, (tok, lp) in enumerate(zip(toks, r.logprobs), start=1):
            p = r.params
            ref = processed_logprobs(out.logits[T - 1, readout_position(P, j)], p.temperature, p.top_k)
            assert torch.isfinite(ref[tok]) and abs(lp - float(ref[tok])) < 1e-6, j
        n = len(fed)  # every plane of every fed position, after all rollbacks
        assert r.num_deep_positions == n
        for loop in range(1, T + 1):
            for layer in range(oracle.num_layers):
                k, v = pool.read(loop, layer, r.block_ids, n)
                torch.testing.assert_close(k, out.keys[loop - 1, layer, :n], atol=1e-6, rtol=0)
                torch.testing.assert_close(v, out.values[loop - 1, layer, :n], atol=1e-6, rtol=0)
        assert r.num_drafted >= r.num_accepted


def oracle_top(ref: torch.Tensor, k: int, token: int) -> dict[int, float]:
    """The k best processed log-probs (ties: the lower id first), then the sampled token."""
    ranked = sorted(range(ref.shape[0]), key=lambda i: (-float(ref[i]), i))[:k]
    top = {i: float(ref[i]) for i in ranked}
    top[token] = float(ref[token])
    return top


@pytest.mark.parametrize("B,s", [(2, 2), (3, 1), (4, 2)])
def test_sampled_verify_top_logprobs_are_loop_T_top_k_at_every_token(checkpoints, B, s):
    """Every verified token (accepted draft, residual draw, token after the drafts) reports loop T's top-k
    plus itself, like every other token; verify used to report it for token 1 only (sizes [3, 0, 0, ...])."""
    ckpt = checkpoints["kv1-L2-T4"]
    oracle = load_oracle(ckpt)
    T = oracle.total_ut_steps
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    params = [SamplingParams(max_tokens=13, temperature=t, seed=70 + i, top_k=k, logprobs=n, ignore_eos=True)
              for i, (t, k, n) in enumerate([(1.0, 0, 3), (1.3, 8, 5), (0.8, 0, 1)])]
    core = build_engine_core(EngineConfig(model=str(ckpt), dtype="float64", mode="verify", deep_interval=B,
                                          shallow_loops=s, block_size=4, num_kv_blocks=512))
    requests = run_staggered(core, prompts, params, arrival_steps=[0, 1, 1])
    assert core.stats()["rolled_back_positions"] > 0 and core.stats()["accepted_tokens"] > 0
    for r in requests:
        P, toks, p = r.num_prompt_tokens, r.output_token_ids, r.params
        assert r.top_logprobs is not None and len(r.top_logprobs) == len(toks)
        out = oracle.forward(list(r.prompt_token_ids) + toks[:-1])
        for j, (tok, top) in enumerate(zip(toks, r.top_logprobs), start=1):
            ref = processed_logprobs(out.logits[T - 1, readout_position(P, j)], p.temperature, p.top_k)
            want = oracle_top(ref, p.logprobs, tok)
            assert list(top) == list(want), (r.request_id, j)
            assert all(abs(top[t] - want[t]) < 1e-6 for t in want), (r.request_id, j)


@pytest.mark.parametrize("B,s", [(2, 1), (4, 2), (8, 3)])
def test_greedy_verify_top_logprobs_equal_interval_one(checkpoints, B, s):
    ckpt = checkpoints["kv2-L3-T4-hd16"]
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [3, 3]]
    greedy = SamplingParams(max_tokens=15, temperature=0.0, logprobs=4, ignore_eos=True)
    with engine(ckpt, mode="deferred", deep_interval=1) as full:
        ref = [o.outputs[0] for o in full.generate_batch(prompts, greedy)]
    with engine(ckpt, mode="verify", deep_interval=B, shallow_loops=s) as llm:
        got = [o.outputs[0] for o in llm.generate_batch(prompts, greedy)]
    for g, r in zip(got, ref):
        assert g.token_ids == r.token_ids
        assert [list(t) for t in g.top_logprobs] == [list(t) for t in r.top_logprobs]
        for a, b in zip(g.top_logprobs, r.top_logprobs):
            assert all(abs(a[t] - b[t]) < 1e-9 for t in b)


def full_depth_law(oracle, prompt, n_tokens, V):
    """P(t_1..t_n) under full-depth sampling at temperature 1, by enumeration with the oracle."""
    T = oracle.total_ut_steps
    law = {}
    for seq in itertools.product(range(V), repeat=n_tokens):
        out = oracle.forward(prompt + list(seq[:-1]))
        lp = sum(float(torch.log_softmax(out.logits[T - 1, len(prompt) - 1 + i], -1)[t]) for i, t in enumerate(seq))
        law[seq] = float(torch.tensor(lp).exp())
    return law


def chi_square(counts: dict, law: dict, draws: int) -> tuple[float, int]:
    stat, cells = 0.0, 0
    other_obs = other_exp = 0.0
    for seq, p in law.items():
        e = p * draws
        if e < 5:  # pool sparse cells
            other_obs += counts.get(seq, 0)
            other_exp += e
            continue
        stat += (counts.get(seq, 0) - e) ** 2 / e
        cells += 1
    if other_exp > 0:
        stat += (other_obs - other_exp) ** 2 / other_exp
        cells += 1
    return stat, cells - 1


def test_verify_output_follows_full_depth_law_and_deferred_does_not(tmp_path):
    V, draws = 4, 4000
    ckpt = make_tiny_checkpoint(tmp_path / "v4", seed=11, vocab_size=V, eos_token_id=None)
    oracle = load_oracle(ckpt)
    prompt = [1, 2]
    law = full_depth_law(oracle, prompt, 3, V)
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=seed, ignore_eos=True) for seed in range(draws)]
    alpha = 1e-3
    stats = {}
    for mode in ("verify", "deferred"):
        with engine(ckpt, mode=mode, deep_interval=2, max_num_seqs=512, num_kv_blocks=1024) as llm:
            outs = llm.generate_batch([prompt] * draws, params)
        counts: dict = {}
        for o in outs:
            key = tuple(o.outputs[0].token_ids)
            counts[key] = counts.get(key, 0) + 1
        stats[mode] = chi_square(counts, law, draws)
    stat, dof = stats["verify"]
    assert stat < chi2.ppf(1 - alpha, dof), stats
    stat, dof = stats["deferred"]  # token 2 read from loop s: a different law, which the test detects
    assert stat > chi2.ppf(1 - alpha, dof), stats


def test_deep_failure_during_verify_closes_the_cohort_and_leaks_nothing(checkpoints):
    ckpt = checkpoints["kv1-L2-T4"]
    with engine(ckpt, mode="verify", deep_interval=3) as llm:
        llm.core.executor.fault_hook = FaultInjector("deep", calls={1})
        outs = llm.generate_batch([[1], [2, 3], [4]], SamplingParams(max_tokens=12, temperature=1.0, seed=3,
                                                                       ignore_eos=True))
        assert all(o.outputs[0].finish_reason == "error" for o in outs)
        assert llm.stats()["kv_blocks_used"] == 0
        after = llm.generate([1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        assert after.outputs[0].finish_reason == "length"
        assert llm.core.executor.retained == {}
