"""GPU: the engine's log-probs against the learner's replay (ourobatch.training.readout_logprobs) on the
shipped trained model, in bf16 with and without head_dtype="float32", and in float32 (which also checks
the Triton sampler's raw path: temperature != 1 computes the raw log-prob after the kernel).

Reports mean / p99 / max |engine - replay| per configuration, and the same against a float64 replay of the
same bf16 weights (the exact value); writes them to $OUT/gpu_logprobs.json when OUT is set.
`pytest -m gpu tests/gpu/test_gpu_logprobs.py -s` (benchmarks/gpu_suite.sh runs the GPU suite)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from engine.loader import load_model
from ourobatch.training import readout_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODEL = Path(__file__).resolve().parents[2] / "models" / "pointer-chase"
NUM_PROMPTS = 256
RESULTS: dict[str, dict[str, float]] = {}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    lines = (MODEL / "heldout_tasks.jsonl").read_text().splitlines()[:NUM_PROMPTS]
    return [json.loads(line)["prompt_token_ids"] for line in lines]


def summary(d: torch.Tensor) -> dict[str, float]:
    d = d.double()
    return {"mean": d.mean().item(), "p99": d.quantile(0.99).item(), "max": d.max().item(), "tokens": d.numel()}


def rollouts(prompts, dtype: str, head: str, mode: str, B: int, temperature: float):
    config = EngineConfig(model=str(MODEL), device="cuda", dtype=dtype, head_dtype=head, logprobs_mode="raw",
                          mode=mode, deep_interval=B, shallow_loops=3, max_model_len=64, max_num_seqs=NUM_PROMPTS)
    with SyncEngine(config) as llm:
        outs = llm.generate_batch(prompts, SamplingParams(max_tokens=6, temperature=temperature, seed=7))
    return [o.outputs[0] for o in outs]


def differences(model, prompts, outs, head_dtype) -> torch.Tensor:
    lp = readout_logprobs(model, [p + c.token_ids for p, c in zip(prompts, outs)], [c.readout_loops for c in outs],
                          prompt_len=[len(p) for p in prompts], head_dtype=head_dtype).double().cpu()
    return torch.cat([(lp[i, :len(c.logprobs)] - torch.tensor(c.logprobs, dtype=torch.float64)).abs()
                      for i, c in enumerate(outs)])


@pytest.mark.parametrize("mode,B", [("deferred", 1), ("deferred", 4), ("verify", 4)])
@pytest.mark.parametrize("head", ["auto", "float32"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_engine_against_the_replay(prompts, mode, B, head, temperature):
    outs = rollouts(prompts, "bfloat16", head, mode, B, temperature)
    head_dtype = torch.float32 if head == "float32" else None
    with torch.no_grad():
        bf16 = load_model(MODEL, torch.bfloat16, "cuda")
        same = summary(differences(bf16, prompts, outs, head_dtype))  # the learner runs the same bf16 model
        exact = load_model(MODEL, torch.float64, "cuda")
        for p_exact, p_bf16 in zip(exact.parameters(), bf16.parameters()):
            p_exact.copy_(p_bf16.double())  # float64 copies of the very bf16 weights: the exact value
        truth = summary(differences(exact, prompts, outs, None))
    key = f"bf16 {mode} B={B} head={head} T={temperature}"
    RESULTS[key] = {**{f"vs_bf16_replay_{k}": v for k, v in same.items()},
                    **{f"vs_fp64_{k}": v for k, v in truth.items()}}
    print(f"\n{key}: vs bf16 replay {same}\n{' ' * len(key)}  vs fp64 {truth}")
    _write()
    assert same["mean"] < 0.05 and truth["mean"] < 0.05


@pytest.mark.parametrize("mode,B", [("deferred", 1), ("deferred", 4)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_float32_engine_matches_the_replay(prompts, mode, B, temperature):
    """float32 on CUDA (Triton attention and sampler, CUDA graphs): engine and replay differ by float32
    rounding only; temperature 0.7 exercises the raw log-prob computed after the Triton kernel."""
    outs = rollouts(prompts, "float32", "auto", mode, B, temperature)
    with torch.no_grad():
        d = summary(differences(load_model(MODEL, torch.float32, "cuda"), prompts, outs, None))
    RESULTS[f"fp32 {mode} B={B} T={temperature}"] = d
    print(f"\nfp32 {mode} B={B} T={temperature}: {d}")
    _write()
    assert d["max"] < 1e-3, d


def _write() -> None:
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_logprobs.json").write_text(json.dumps(RESULTS, indent=1))
