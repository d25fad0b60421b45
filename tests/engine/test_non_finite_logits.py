"""Non-finite logits at run time (weights or activations that turn NaN/inf after a finite load): the step
fails the requests it was sampling or verifying with finish_reason "error" and an error naming the
non-finite logits; no NaN log-prob (or top log-prob) is ever emitted, and nothing leaks."""

from __future__ import annotations

import math

import pytest
import torch

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.assembly import build_engine_core

PARAMS = [SamplingParams(max_tokens=14, temperature=t, seed=5 + i, logprobs=2, ignore_eos=True)
          for i, t in enumerate([1.0, 0.0, 0.8])]


def config(ckpt, mode: str, B: int) -> EngineConfig:
    return EngineConfig(model=str(ckpt), dtype="float32", mode=mode, deep_interval=B, block_size=4,
                        num_kv_blocks=256)


def poison_lm_head(executor) -> None:
    executor.model.lm_head.weight[7, 0] = float("nan")  # every readout's logit of token 7


def poison_retained_rows(executor) -> None:
    assert any(kept.count > 0 for kept in executor.retained.values())  # the next deep call reads them
    executor.retained_rows.fill_(float("nan"))


@pytest.mark.parametrize("mode,B,poison", [
    ("deferred", 1, poison_lm_head),        # prefill / shallow readouts (the sample phase)
    ("deferred", 3, poison_retained_rows),  # a deep call's boundary readout (the sample phase)
    ("verify", 3, poison_lm_head),          # the drafts' loop-s readouts
    ("verify", 3, poison_retained_rows),    # the acceptance test over loop s and loop T (the deep phase)
])
def test_non_finite_logits_end_requests_with_error_and_never_emit_nan(checkpoints, mode, B, poison):
    core = build_engine_core(config(checkpoints["kv1-L2-T4"], mode, B))
    requests = [core.add(p, sp).children[0] for p, sp in zip([[1, 2, 3], [4], [5, 6]], PARAMS)]
    for _ in range(5):  # some verified tokens first, then rows retained since the last boundary
        core.step()
    assert all(r.output_token_ids for r in requests) and not any(r.finish_reason for r in requests)
    poison(core.executor)
    steps = 0
    while core.has_unfinished:
        core.step()
        steps += 1
        assert steps < 100
    for r in requests:
        assert r.finish_reason == "error", (r.request_id, r.finish_reason, len(r.output_token_ids))
        assert "non-finite logits" in r.error and r.request_id in r.error
        assert all(math.isfinite(lp) for lp in r.logprobs)
        assert all(not math.isnan(v) for top in r.top_logprobs for v in top.values())
        assert len(r.logprobs) == len(r.output_token_ids) == len(r.top_logprobs)
    assert core.stats()["kv_blocks_used"] == 0


def test_a_nan_weight_set_after_loading_fails_generate_and_the_engine_keeps_serving(checkpoints):
    with SyncEngine(config(checkpoints["kv1-L2-T4"], "deferred", 2)) as llm:
        weight = llm.core.executor.model.model.layers[0].mlp.down_proj.weight
        kept = weight[0, 0].item()
        weight[0, 0] = float("nan")
        out = llm.generate([1, 2, 3], PARAMS[0]).outputs[0]
        assert out.finish_reason == "error" and "non-finite logits" in out.error
        assert out.token_ids == [] and out.logprobs == []
        weight[0, 0] = kept
        again = llm.generate([1, 2, 3], PARAMS[0]).outputs[0]
        assert again.finish_reason == "length" and all(math.isfinite(lp) for lp in again.logprobs)
        assert torch.isfinite(torch.tensor(again.logprobs)).all()
