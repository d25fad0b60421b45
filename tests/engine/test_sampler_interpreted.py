"""engine/triton_sampler's two kernels (per-chunk mass and race winner, then per-row combine) against the
torch sampler's own pieces (processed_logprobs, sampler.race's torch path: the float64 race), in Triton's interpreter
on the CPU (TRITON_INTERPRET=1, where Triton is installed): several vocab sizes (one chunk, a partial last
chunk, exact chunks), greedy and tempered rows, a row whose first chunks are all -inf. On the GPU:
tests/gpu/test_gpu.py::test_triton_sampler_equals_the_torch_sampler."""

from __future__ import annotations

from tests.interpreter import run_interpreted

INTERPRETED = """
import torch
from scheduler.params import SamplingParams
from engine.sampler import processed_logprobs, race
from engine.triton_sampler import sample_plain
for vocab, rows in ((97, 40), (5000, 13), (4096, 6)):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[0, : vocab // 2] = float("-inf")  # a row whose first chunk(s) have no mass
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0, 1.6][i % 4], seed=7919 * i + 2**40 * (i % 3))
              for i in range(rows)]
    cnt = torch.tensor([1 + i % 11 for i in range(rows)])
    temps = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params])
    seeds = torch.tensor([p.seed for p in params])
    greedy = torch.tensor([p.is_greedy for p in params])
    tokens, lps, finite = sample_plain(logits, temps, seeds, cnt, greedy)
    assert torch.equal(finite, torch.isfinite(logits).all(-1)), finite  # row 0's -inf: not finite
    ref_lp = processed_logprobs(logits, params)
    ref_tok = race(ref_lp, greedy, seeds, cnt)  # the torch race: counter uniforms, float64 keys
    assert torch.equal(tokens, ref_tok), (tokens, ref_tok)
    torch.testing.assert_close(lps, ref_lp.gather(1, ref_tok[:, None]).squeeze(1), atol=1e-5, rtol=0)
print("ok")
"""


def test_the_chunked_sampler_matches_the_torch_sampler_in_tritons_interpreter():
    run_interpreted(INTERPRETED)


# sampler.race on processed log-probs (top-k, top-p, min-p, min_tokens' masked stop set): the kernels at
# temperature 1 against the torch race, token for token (the keys are the same float64 numbers)
PROCESSED = """
import torch
from scheduler.params import SamplingParams
from engine.sampler import processed_logprobs, race
for vocab, rows in ((97, 24), (5000, 9)):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=g) * 3
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0, 1.3][i % 4], top_k=[0, 5, 40, 0][i % 4],
                             top_p=[1.0, 0.9, 0.5, 0.95][(i // 2) % 4], min_p=[0.0, 0.05][i % 2],
                             min_tokens=2, stop_token_ids=[3], seed=7919 * i + 2**40 * (i % 3)) for i in range(rows)]
    cnt = torch.tensor([1 + i % 4 for i in range(rows)])
    lp = processed_logprobs(logits, params, cnt.tolist())
    assert (lp == float("-inf")).any(1).all()  # every row lost tokens to a filter or the stop mask
    seeds = torch.tensor([p.seed for p in params])
    greedy = torch.tensor([p.is_greedy for p in params])
    got = race(lp, greedy, seeds, cnt, triton_kernel=True)
    want = race(lp, greedy, seeds, cnt)
    assert torch.equal(got, want), (got, want)
    assert torch.isfinite(lp.gather(1, got[:, None])).all()  # never an excluded token
print("ok")
"""


def test_the_kernels_race_processed_rows_as_the_torch_sampler_does():
    run_interpreted(PROCESSED)


# NaN logits (weights that overflowed): the kernels never draw a NaN, so every id stays inside the vocabulary
# (the last chunk's lanes past it hold -inf keys, which a NaN compared against could otherwise lose to); a row of
# NaN draws id 0; a row with any NaN reports a NaN log-prob (the engine's non-finite check fails it); the kernels'
# finite flags (the engine's check on the fast path) are False for rows with a NaN or an inf, True otherwise
NAN = """
import torch
from engine.triton_sampler import sample_plain
for vocab in (97, 5000):
    g = torch.Generator().manual_seed(vocab)
    rows = 8
    logits = torch.randn(rows, vocab, generator=g) * 3
    nan = torch.rand(rows, vocab, generator=g) < 0.5
    nan[0] = True
    nan[1] = True
    nan[1, -1] = False  # one finite logit, the last
    nan[7] = False
    logits[nan] = float("nan")
    temps = torch.tensor([1.0, 0.7] * 4)
    greedy = torch.tensor([i % 3 == 0 for i in range(rows)])
    logits[7, vocab // 3] = float("inf")  # the finite row but for one +inf
    _, _, finite = sample_plain(logits, temps, torch.arange(rows) + 5, torch.ones(rows, dtype=torch.int64), greedy)
    assert not finite.any(), finite
    logits[7, vocab // 3] = 0.0
    tokens, lps, finite = sample_plain(logits, temps, torch.arange(rows) + 5, torch.ones(rows, dtype=torch.int64),
                                       greedy)
    assert finite.tolist() == [False] * 7 + [True], finite  # the lanes past the vocabulary (-inf) do not count
    assert tokens[0] == 0 and tokens[1] == vocab - 1, tokens
    assert not nan[torch.arange(1, rows), tokens[1:]].any(), tokens
    assert torch.isnan(lps[:7]).all() and torch.isfinite(lps[7]), lps
print("ok")
"""


def test_nan_logits_never_win_in_tritons_interpreter():
    run_interpreted(NAN)
