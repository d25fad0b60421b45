"""GPU: prompt log-probs (SamplingParams.prompt_logprobs) on CUDA against a CPU float64 engine on the same
shipped model, in float32 and bf16, raw and processed, with a prefill chunked into several steps and a
decode batch running beside it (CUDA graphs on). `pytest -m gpu tests/gpu/test_gpu_prompt_logprobs.py`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ourobatch import EngineConfig, SamplingParams, SyncEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODEL = Path(__file__).resolve().parents[2] / "models" / "pointer-chase"
TOL = {"float32": 2e-4, "bfloat16": 0.15}  # bf16 weights and activations against float64


def prompts(count: int) -> list[list[int]]:
    lines = (MODEL / "heldout_tasks.jsonl").read_text().splitlines()[:count]
    return [json.loads(line)["prompt_token_ids"] for line in lines]


def prompt_logprobs(device: str, dtype: str, mode: str, batched_tokens: int = 8192) -> list[list[float]]:
    config = EngineConfig(model=str(MODEL), device=device, dtype=dtype, logprobs_mode=mode, max_model_len=64,
                          max_num_seqs=64, max_num_batched_tokens=batched_tokens)
    params = SamplingParams(max_tokens=4, temperature=0.7, seed=3, prompt_logprobs=2)
    with SyncEngine(config) as llm:
        outs = llm.generate_batch(prompts(48), params)
    result = []
    for out, p in zip(outs, prompts(48)):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
        result.append([d[tok].logprob for d, tok in zip(out.prompt_logprobs[1:], p[1:])])
    return result


@pytest.mark.parametrize("mode", ["raw", "processed"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_prompt_logprobs_equal_a_float64_cpu_engine(dtype, mode):
    want = prompt_logprobs("cpu", "float64", mode)
    got = prompt_logprobs("cuda", dtype, mode, 64)  # 64 tokens a step: most prompts span two prefill chunks
    diff = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w) if b > -1e30)
    assert diff < TOL[dtype], diff
