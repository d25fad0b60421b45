"""Tests of the float64 oracle's processed_logprobs (tests/oracle.py): temperature, top_k, top_p and min_p
on hand-computed distributions (ties and exact boundaries included), in the order the contract applies
them, and a random cross-check against a plain-Python restatement of that contract."""

from __future__ import annotations

import math
import random

import torch

from tests.oracle import processed_logprobs
from tests.oracle_helpers import NEG_INF


# --------------------------------------------------------------------------- #
# processed_logprobs
# --------------------------------------------------------------------------- #
def lsm(values):
    t = torch.tensor(values, dtype=torch.float64)
    return torch.log_softmax(t, 0)


def expect(kept: dict[int, float], V: int) -> torch.Tensor:
    out = torch.full((V,), NEG_INF, dtype=torch.float64)
    for i, val in kept.items():
        out[i] = val
    return out


def check(actual, expected):
    assert actual.dtype == torch.float64
    assert torch.equal(torch.isinf(actual), torch.isinf(expected)), (actual, expected)
    finite = torch.isfinite(expected)
    torch.testing.assert_close(actual[finite], expected[finite], rtol=1e-12, atol=1e-12)


LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0], dtype=torch.float64)
# Probabilities exactly [0.5, 0.3, 0.15, 0.05] in log space.
P4 = [0.5, 0.3, 0.15, 0.05]
LOGP4 = torch.tensor([math.log(p) for p in P4], dtype=torch.float64)


def test_no_filters_is_log_softmax():
    check(processed_logprobs(LOGITS, 1.0), lsm([2, 1, 0, -1]))
    for k in (0, -1, 4, 10):
        check(processed_logprobs(LOGITS, 1.0, top_k=k), lsm([2, 1, 0, -1]))
    check(processed_logprobs(LOGITS, 1.0, top_p=1.0, min_p=0.0), lsm([2, 1, 0, -1]))


def test_top_k():
    s = lsm([2, 1])
    check(processed_logprobs(LOGITS, 1.0, top_k=2), expect({0: s[0], 1: s[1]}, 4))
    check(processed_logprobs(LOGITS, 1.0, top_k=1), expect({0: 0.0}, 4))
    s = lsm([2, 1, 0])
    check(processed_logprobs(LOGITS, 1.0, top_k=3), expect({0: s[0], 1: s[1], 2: s[2]}, 4))
    # unsorted input
    shuffled = torch.tensor([0.0, 2.0, -1.0, 1.0], dtype=torch.float64)
    s = lsm([2, 1])
    check(processed_logprobs(shuffled, 1.0, top_k=2), expect({1: s[0], 3: s[1]}, 4))


def test_top_k_ties_at_boundary_are_kept():
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    s = lsm([2, 1, 1])
    check(processed_logprobs(logits, 1.0, top_k=2), expect({0: s[0], 1: s[1], 2: s[2]}, 4))
    ties = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    check(processed_logprobs(ties, 1.0, top_k=1), lsm([1, 1, 1, 1]))


def test_temperature_scaling():
    s = lsm([1.0, 0.5, 0.0, -0.5])
    check(processed_logprobs(LOGITS, 2.0), s)
    s = lsm([4.0, 2.0, 0.0, -2.0])
    check(processed_logprobs(LOGITS, 0.5), s)
    # temperature applied before top_k (does not change the kept set here) then renormalised
    s = lsm([4.0, 2.0])
    check(processed_logprobs(LOGITS, 0.5, top_k=2), expect({0: s[0], 1: s[1]}, 4))


def test_greedy_is_temperature_one():
    check(processed_logprobs(LOGITS, 0.0), lsm([2, 1, 0, -1]))
    check(processed_logprobs(LOGITS, 0.0), processed_logprobs(LOGITS, 1.0))
    s = lsm([2, 1])
    check(processed_logprobs(LOGITS, 0.0, top_k=2), expect({0: s[0], 1: s[1]}, 4))


def test_min_p():
    # p = [0.5, 0.3, 0.15, 0.05]; min_p=0.2 -> threshold 0.1 -> drop 0.05
    out = processed_logprobs(LOGP4, 1.0, min_p=0.2)
    check(out, expect({i: math.log(P4[i] / 0.95) for i in range(3)}, 4))
    # min_p=0.5 -> threshold 0.25 -> keep 0.5 and 0.3
    out = processed_logprobs(LOGP4, 1.0, min_p=0.5)
    check(out, expect({0: math.log(0.5 / 0.8), 1: math.log(0.3 / 0.8)}, 4))
    # min_p=1 keeps only the argmax
    check(processed_logprobs(LOGP4, 1.0, min_p=1.0), expect({0: 0.0}, 4))
    # tiny min_p keeps all
    check(processed_logprobs(LOGP4, 1.0, min_p=1e-3), LOGP4)


def test_min_p_after_temperature():
    # temperature 0.5 squares the probabilities: ~[0.25, 0.09, 0.0225, 0.0025] (unnormalised)
    # min_p=0.2 -> threshold 0.05 of max 0.25 -> keep tokens 0, 1 only (0.0225 < 0.05).
    # At temperature 1 the same min_p would keep three tokens.
    out = processed_logprobs(LOGP4, 0.5, min_p=0.2)
    sq = [0.25, 0.09]
    check(out, expect({0: math.log(sq[0] / sum(sq)), 1: math.log(sq[1] / sum(sq))}, 4))


def test_top_p():
    # sorted p = [0.5, 0.3, 0.15, 0.05]; mass before = [0, 0.5, 0.8, 0.95]
    cases = {0.7: 2, 0.85: 3, 0.99: 4, 0.4: 1, 1e-9: 1, 0.5001: 2, 0.79: 2, 0.81: 3}
    for top_p, n in cases.items():
        kept = {i: math.log(P4[i] / sum(P4[:n])) for i in range(n)}
        check(processed_logprobs(LOGP4, 1.0, top_p=top_p), expect(kept, 4))


def test_exact_boundaries():
    two = torch.tensor([0.0, 0.0], dtype=torch.float64)  # p = [0.5, 0.5] exactly
    # top_p: the second-ranked token has mass-before 0.5, which is not < 0.5 -> excluded
    out = processed_logprobs(two, 1.0, top_p=0.5)
    assert torch.isfinite(out).sum() == 1 and out.max() == 0.0
    # ... but it is kept for any top_p above 0.5
    check(processed_logprobs(two, 1.0, top_p=0.5000001), lsm([0, 0]))
    four = torch.zeros(4, dtype=torch.float64)  # p = 0.25 each; mass before 0, .25, .5, .75
    assert torch.isfinite(processed_logprobs(four, 1.0, top_p=0.5)).sum() == 2
    assert torch.isfinite(processed_logprobs(four, 1.0, top_p=0.75)).sum() == 3
    # min_p: p == min_p * max(p) is NOT excluded (only strictly smaller is)
    check(processed_logprobs(two, 1.0, min_p=1.0), lsm([0, 0]))
    check(processed_logprobs(four, 1.0, min_p=1.0), lsm([0, 0, 0, 0]))


def test_top_p_unsorted_input():
    perm = [2, 0, 3, 1]  # position i holds P4[perm[i]] -> [0.15, 0.5, 0.05, 0.3]
    logits = LOGP4[perm]
    out = processed_logprobs(logits, 1.0, top_p=0.7)  # keep 0.5 (idx 1) and 0.3 (idx 3)
    check(out, expect({1: math.log(0.5 / 0.8), 3: math.log(0.3 / 0.8)}, 4))


def test_top_p_renormalises_after_top_k():
    # after top_k=3: p' = [0.5, 0.3, 0.15] / 0.95 = [0.526, 0.316, 0.158]; mass before [0, 0.526, 0.842]
    # top_p=0.82 keeps 2 (it would keep 3 if p were not renormalised: 0.8 < 0.82)
    out = processed_logprobs(LOGP4, 1.0, top_k=3, top_p=0.82)
    check(out, expect({0: math.log(0.5 / 0.8), 1: math.log(0.3 / 0.8)}, 4))
    out = processed_logprobs(LOGP4, 1.0, top_k=3, top_p=0.86)
    check(out, expect({i: math.log(P4[i] / 0.95) for i in range(3)}, 4))


def test_top_k_counts_only_tokens_not_excluded_by_min_p():
    # min_p=0.9 leaves only token 0, top_k=3 cannot bring others back
    check(processed_logprobs(LOGP4, 1.0, top_k=3, min_p=0.9), expect({0: 0.0}, 4))


def test_all_filters_together():
    V = 6
    probs = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
    logits = torch.tensor([math.log(p) for p in probs], dtype=torch.float64)
    # min_p=0.125 -> threshold 0.05 -> drop 0.04; top_k=4 -> [0.4,.25,.15,.1] (sum .9)
    # p' = [0.444, 0.278, 0.167, 0.111]; mass before = [0, .444, .722, .889]; top_p=0.75 -> keep 3
    out = processed_logprobs(logits, 1.0, top_k=4, top_p=0.75, min_p=0.125)
    check(out, expect({i: math.log(probs[i] / 0.8) for i in range(3)}, V))


def _python_reference(logits, temperature, top_k, top_p, min_p):
    """Plain-Python restatement of the contract (no torch), for random cross-checks."""
    z = [x / temperature if temperature > 0 else x for x in logits]
    V = len(z)
    kept = set(range(V))

    def softmax(idx):
        m = max(z[i] for i in idx)
        e = {i: math.exp(z[i] - m) for i in idx}
        tot = sum(e.values())
        return {i: e[i] / tot for i in idx}

    if min_p > 0:
        p = softmax(range(V))
        pmax = max(p.values())
        kept = {i for i in kept if not p[i] < min_p * pmax}
    if 0 < top_k < V:
        vals = sorted((z[i] for i in kept), reverse=True)
        if len(vals) > top_k:
            kth = vals[top_k - 1]
            kept = {i for i in kept if z[i] >= kth}
    if top_p < 1:
        p = softmax(kept)
        order = sorted(kept, key=lambda i: -p[i])
        new, before = set(), 0.0
        for i in order:
            if before < top_p:
                new.add(i)
            before += p[i]
        kept = new
    p = softmax(kept)
    return [math.log(p[i]) if i in kept else NEG_INF for i in range(V)]


def test_random_cross_check_and_normalisation():
    rng = random.Random(1234)
    for trial in range(300):
        V = rng.choice([2, 5, 31])
        logits = torch.tensor([rng.gauss(0, 2) for _ in range(V)], dtype=torch.float64)
        temperature = rng.choice([0.0, 0.3, 0.7, 1.0, 1.5])
        top_k = rng.choice([0, -1, 1, 2, 5, 40])
        top_p = rng.choice([1.0, 0.95, 0.5, 0.1])
        min_p = rng.choice([0.0, 0.05, 0.3])
        out = processed_logprobs(logits, temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        assert out.shape == (V,)
        assert out.dtype == torch.float64
        assert torch.isfinite(out).any()
        torch.testing.assert_close(torch.logsumexp(out, 0), torch.tensor(0.0, dtype=torch.float64), atol=1e-12, rtol=0)
        # the argmax is always kept; kept tokens form a top set by logit
        assert torch.isfinite(out[logits.argmax()])
        kept = torch.isfinite(out)
        if (~kept).any():
            assert logits[kept].min() >= logits[~kept].max()
        ref = torch.tensor(_python_reference(logits.tolist(), temperature, top_k, top_p, min_p), dtype=torch.float64)
        check(out, ref)


def test_float32_input_gives_float64_output():
    out = processed_logprobs(LOGITS.float(), 1.0, top_k=2)
    assert out.dtype == torch.float64
    s = lsm([2, 1])
    check(out, expect({0: s[0], 1: s[1]}, 4))


def test_does_not_mutate_input():
    logits = LOGITS.clone()
    processed_logprobs(logits, 0.5, top_k=2, top_p=0.5, min_p=0.1)
    assert torch.equal(logits, LOGITS)
