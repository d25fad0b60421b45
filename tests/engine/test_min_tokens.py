"""min_tokens as vLLM defines it: the stop set (stop_token_ids plus eos unless ignore_eos) is masked out
of the distribution while fewer than min_tokens tokens exist, so it is never sampled; every log-prob is
checked against the float64 oracle with the same tokens banned, in every mode."""

from __future__ import annotations

import pytest
import torch

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from tests.oracle import load_oracle, processed_logprobs, readout_position

EOS = 0
STOPS = tuple(range(1, 16))  # with eos, half of the 31-token vocabulary ends a request
MIN = 6
TOL = 1e-6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from ourobatch.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("mt") / "m", seed=3, eos_token_id=EOS)


def _run(ckpt, params: list[SamplingParams], **engine_kw):
    config = EngineConfig(model=str(ckpt), dtype="float64", block_size=4, num_kv_blocks=128, **engine_kw)
    with SyncEngine(config) as llm:
        return [o.outputs[0] for o in llm.generate_batch([[17, 20, 25]] * len(params), params)]


def _params(min_tokens: int, ignore_eos: bool = False) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=12, temperature=t, seed=s, stop_token_ids=STOPS, min_tokens=min_tokens,
                           ignore_eos=ignore_eos, top_k=k)
            for t, s, k in ((0.0, 1, 0), (1.0, 2, 0), (1.3, 3, 8), (0.9, 4, 0), (1.0, 5, 0), (1.2, 6, 0))]


@pytest.mark.parametrize("engine_kw", [dict(deep_interval=1), dict(mode="deferred", deep_interval=3),
                                       dict(mode="verify", deep_interval=3)],
                         ids=["full", "deferred3", "verify3"])
def test_min_tokens_masks_the_stop_set_and_matches_the_oracle(ckpt, engine_kw):
    oracle = load_oracle(ckpt)
    outs = _run(ckpt, _params(MIN), **engine_kw)
    stop_set = frozenset(STOPS) | {EOS}
    for c, p in zip(outs, _params(MIN)):
        assert len(c.token_ids) >= MIN and not stop_set & set(c.token_ids[:MIN])
        P = 3
        fed = [17, 20, 25] + c.token_ids[:-1]
        out = oracle.forward(fed)
        for j, (tok, lp, loop) in enumerate(zip(c.token_ids, c.logprobs, c.readout_loops), start=1):
            banned = stop_set if j <= MIN else ()
            row = out.logits[loop - 1, readout_position(P, j)]
            ref = processed_logprobs(row, p.temperature, p.top_k, p.top_p, p.min_p, banned_token_ids=banned)
            if p.is_greedy:
                assert tok == int(ref.argmax()), f"token {j}"
            assert abs(lp - float(ref[tok])) < TOL, f"token {j}: {lp} vs {float(ref[tok])}"
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in stop_set and len(c.token_ids) > MIN


def test_without_min_tokens_these_requests_stop_early(ckpt):
    """The control: the stop set is likely enough that most requests end within MIN tokens without it."""
    outs = _run(ckpt, _params(0))
    assert sum(len(c.token_ids) <= MIN and c.finish_reason == "stop" for c in outs) >= 4


def test_ignore_eos_leaves_eos_unmasked(ckpt):
    oracle = load_oracle(ckpt)
    p = SamplingParams(max_tokens=4, temperature=1.0, seed=9, stop_token_ids=STOPS, min_tokens=3, ignore_eos=True)
    c = _run(ckpt, [p])[0]
    out = oracle.forward([17, 20, 25] + c.token_ids[:-1])
    for j, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs), start=1):
        ref = processed_logprobs(out.logits[-1, readout_position(3, j)], 1.0,
                                 banned_token_ids=STOPS if j <= 3 else ())
        assert torch.isfinite(ref[EOS]) and abs(lp - float(ref[tok])) < TOL


def test_min_tokens_bounds():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(TypeError, match="min_tokens"):
        SamplingParams(min_tokens=1.5)
