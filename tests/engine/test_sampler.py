"""The sampler against the oracle's processed_logprobs, and its counter-based randomness."""

from __future__ import annotations

import math
import random

import pytest
import torch
from scipy.stats import chi2

from ourobatch import SamplingParams
from engine.sampler import counter_uniforms, processed_logprobs, race, sample
from tests.oracle import processed_logprobs as oracle_logprobs

CASES = [
    dict(temperature=1.0),
    dict(temperature=0.0),
    dict(temperature=0.5, top_k=3),
    dict(temperature=1.5, top_p=0.7),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.9, top_k=6, top_p=0.8, min_p=0.02),
    dict(temperature=2.0, top_k=-1, top_p=0.95),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_processed_logprobs_match_the_oracle(case, dtype):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(16, 40, generator=g, dtype=torch.float64) * 3
    params = [SamplingParams(**case)] * 16
    got = processed_logprobs(logits.to(dtype), params)
    for i in range(16):
        ref = oracle_logprobs(logits[i].to(dtype).double(), case["temperature"], case.get("top_k", 0),
                              case.get("top_p", 1.0), case.get("min_p", 0.0))
        assert torch.equal(torch.isinf(got[i]), torch.isinf(ref))
        finite = torch.isfinite(ref)
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(got[i][finite].double(), ref[finite], atol=tol, rtol=0)


def test_mixed_params_in_one_batch_match_per_row_processing():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(CASES), 25, generator=g, dtype=torch.float64)
    params = [SamplingParams(**c) for c in CASES]
    together = processed_logprobs(logits, params)
    for i, p in enumerate(params):
        alone = processed_logprobs(logits[i:i + 1], [p])[0]
        assert torch.equal(together[i], alone)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3], CASES[5]])
def test_empirical_law_matches_the_processed_distribution(case):
    """Chi-square goodness of fit over many seeds at significance 1e-3 (deterministic seeds)."""
    V, draws = 12, 6000
    logits = torch.tensor([1.2, 0.3, -0.5, 2.0, 0.0, 0.7, -1.0, 1.5, 0.1, -0.2, 0.9, 0.4], dtype=torch.float64)
    probs = oracle_logprobs(logits, case["temperature"], case.get("top_k", 0), case.get("top_p", 1.0),
                            case.get("min_p", 0.0)).exp()
    params = [SamplingParams(seed=seed, **case) for seed in range(draws)]
    out = sample(logits.expand(draws, V), params, [1] * draws)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=V).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token outside the support"
    expected = probs[support] * draws
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    assert stat < chi2.ppf(1 - 1e-3, int(support.sum()) - 1)
    # and the same test rejects a wrong law (it is able to fail)
    wrong = torch.softmax(logits, -1)[support] * draws if case != CASES[0] else torch.full_like(expected, draws / V)
    wrong_stat = float(((counts[support] - wrong) ** 2 / wrong).sum())
    assert wrong_stat > chi2.ppf(1 - 1e-3, int(support.sum()) - 1)


def test_draws_depend_only_on_seed_counter_and_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 30, generator=g, dtype=torch.float64)
    params = [SamplingParams(seed=1000 + i % 7) for i in range(64)]
    counters = [1 + i % 5 for i in range(64)]
    full = sample(logits, params, counters)
    perm = list(range(64))
    random.Random(1).shuffle(perm)
    shuffled = sample(logits[perm], [params[i] for i in perm], [counters[i] for i in perm])
    assert [full.token_ids[i] for i in perm] == shuffled.token_ids
    single = [sample(logits[i:i + 1], [params[i]], [counters[i]]).token_ids[0] for i in range(0, 64, 9)]
    assert single == full.token_ids[::9]
    # rows with the same logits and seed but another counter draw differently somewhere
    same = logits[0].expand(200, 30)
    a = sample(same, [SamplingParams(seed=5)] * 200, list(range(200))).token_ids
    assert len(set(a)) > 5


def test_different_seeds_differ_and_uniforms_are_uniform():
    seeds = torch.arange(4000, dtype=torch.int64) * 7919 + 3
    u = counter_uniforms(seeds, torch.ones(4000, dtype=torch.int64), 16)
    assert u.min() > 0 and u.max() < 1
    assert abs(float(u.mean()) - 0.5) < 0.01
    hist = torch.histc(u.float(), bins=10, min=0, max=1)
    stat = float(((hist - 6400) ** 2 / 6400).sum())
    assert stat < chi2.ppf(1 - 1e-3, 9)
    # large seeds use their high 32 bits too
    hi = counter_uniforms(torch.tensor([5, 5 + 2**40]), torch.tensor([1, 1]), 8)
    assert not torch.equal(hi[0], hi[1])


def test_greedy_is_argmax_and_reports_temperature_one_logprob():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9]], dtype=torch.float64)
    out = sample(logits, [SamplingParams(temperature=0.0, seed=1)], [1])
    assert out.token_ids == [1]
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]), abs=1e-12)


def test_top_logprobs_hold_the_k_best_plus_the_sampled_token():
    logits = torch.tensor([[0.0, 5.0, 4.0, -3.0, 1.0]], dtype=torch.float64)
    for seed in range(40):
        out = sample(logits, [SamplingParams(seed=seed, logprobs=2)], [1])
        top = dict(out.top_logprobs[0])
        assert {1, 2} <= set(top) and set(top) <= {1, 2, out.token_ids[0]}
        lp = torch.log_softmax(logits[0], -1)
        for tok, val in top.items():
            assert val == pytest.approx(float(lp[tok]), abs=1e-12)


# ------------------------------------------------------------------ ties (one rule: the lower token id first)


def tie_heavy_rows(rows: int, seed: int, V: int = 24) -> tuple[torch.Tensor, list[SamplingParams]]:
    """Logits quantized to 2-4 distinct values (many exact ties), with varied processing params."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    levels = torch.randint(2, 5, (rows, 1), generator=g)
    logits = (torch.rand(rows, V, generator=g, dtype=torch.float64) * levels).floor() * 0.75
    params = [SamplingParams(temperature=rng.choice([0.0, 0.6, 1.0, 1.7]), seed=rng.randrange(2**40),
                             top_p=rng.choice([0.13, 0.37, 0.55, 0.71, 0.93, 1.0]),
                             top_k=rng.choice([0, 0, 3, 7]), min_p=rng.choice([0.0, 0.0, 0.3]),
                             logprobs=rng.choice([0, 2, 5]))
              for _ in range(rows)]
    return logits, params


def ranked_by_id_on_ties(lp: torch.Tensor, k: int) -> list[int]:
    finite = [(-float(v), i) for i, v in enumerate(lp.tolist())]
    return [i for _, i in sorted(finite)[:k]]


def test_tied_tokens_follow_the_oracle_rule():
    """top-p keeps the tied tokens the oracle keeps (ties rank the lower id first): an unstable sort kept
    an arbitrary subset (hundreds of these rows differed)."""
    logits, params = tie_heavy_rows(6000, seed=11)
    got = processed_logprobs(logits, params)
    differ = 0
    for i, p in enumerate(params):
        ref = oracle_logprobs(logits[i], p.temperature, p.top_k, p.top_p, p.min_p)
        same_support = torch.equal(torch.isinf(got[i]), torch.isinf(ref))
        finite = torch.isfinite(ref)
        differ += not (same_support and torch.allclose(got[i][finite], ref[finite], atol=1e-12, rtol=0))
    assert differ == 0, f"{differ} of {len(params)} tie-heavy rows differ from the oracle"


def test_ties_pick_the_lowest_token_id_for_greedy_and_top_logprobs():
    logits, params = tie_heavy_rows(500, seed=12)
    out = sample(logits, params, [1] * len(params))
    lp = processed_logprobs(logits, params)
    for i, p in enumerate(params):
        if p.is_greedy:
            assert out.token_ids[i] == ranked_by_id_on_ties(lp[i], 1)[0]
        if p.num_top_logprobs:
            best = ranked_by_id_on_ties(lp[i], p.num_top_logprobs)
            top = dict(out.top_logprobs[i])
            assert list(top)[:len(best)] == best  # the k best in rank order, then the sampled token
            assert set(top) == set(best) | {out.token_ids[i]}
            assert all(v == float(lp[i, t]) for t, v in top.items())


def test_tied_rows_draw_the_same_alone_and_in_a_batch_of_64():
    logits, params = tie_heavy_rows(64, seed=13)
    together = sample(logits, params, list(range(1, 65)))
    for i in range(64):
        alone = sample(logits[i:i + 1], [params[i]], [i + 1])
        assert alone.token_ids[0] == together.token_ids[i]
        assert alone.logprobs[0] == together.logprobs[i]
        assert alone.top_logprobs[0] == together.top_logprobs[i]


def test_top_k_threshold_is_the_same_from_topk_and_from_a_full_sort(monkeypatch):
    """processed_logprobs takes top-k's k-th value from torch.topk up to TOPK_MAX, from a sort past it: the
    same kept set either way, ties at the k-th value all kept (values quantized so ties are common)."""
    from engine import sampler

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(12, 300, generator=g) * 4).round() / 2  # many equal values
    params = [SamplingParams(temperature=1.0, top_k=k, seed=i) for i, k in enumerate([1, 2, 5, 17, 64, 299] * 2)]
    via_topk = sampler.processed_logprobs(logits, params)
    monkeypatch.setattr(sampler, "TOPK_MAX", 0)
    via_sort = sampler.processed_logprobs(logits, params)
    assert torch.equal(via_topk, via_sort)
    for i, (row, p) in enumerate(zip(logits, params)):  # the kept set: every value >= the k-th largest, ties too
        kth = row.sort(descending=True).values[p.top_k - 1]
        assert torch.equal(via_topk[i] > float("-inf"), row >= kth)



def test_nan_logits_draw_ids_inside_the_vocabulary_and_report_nan():
    # NaN logits (weights that overflowed) must leave every drawn id inside the vocabulary: the step gathers the
    # drawn ids' log-probs on the device, where an id outside it is a device-side assert that ends the process
    # before the non-finite check can fail the request. The race never draws a NaN key (a row of NaN draws
    # id 0), and a row with any NaN logit reports a NaN log-prob, which that check turns into the row's error.
    g = torch.Generator().manual_seed(3)
    vocab = 300
    for trial in range(20):
        logits = torch.randn(6, vocab, generator=g) * 3
        nan = torch.rand(6, vocab, generator=g) < 0.3
        nan[0] = True  # a row of NaN only
        nan[1, logits[1].argmax()] = True  # the row's best logit is NaN
        nan[5] = False  # a finite row beside them
        logits[nan] = float("nan")
        params = [SamplingParams(temperature=[0.0, 1.0, 0.7][i % 3], top_k=[0, 50][i % 2], seed=trial * 10 + i,
                                 logprobs=i % 2) for i in range(6)]
        out = sample(logits, params, [1 + i for i in range(6)])
        assert all(0 <= tok < vocab for tok in out.token_ids), (trial, out.token_ids)
        assert [math.isnan(lp) for lp in out.logprobs] == [True] * 5 + [False], (trial, out.logprobs)
        lp = torch.randn(6, vocab, generator=g, dtype=torch.float64).masked_fill(nan, float("nan"))
        greedy = torch.tensor([i % 2 == 0 for i in range(6)])
        drawn = race(lp, greedy, torch.arange(6) + trial, torch.ones(6, dtype=torch.int64))
        assert drawn[0] == 0 and not nan[torch.arange(1, 6), drawn[1:]].any(), (trial, drawn)
