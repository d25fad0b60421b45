"""GPU: prompt log-probs (SamplingParams.prompt_logprobs) on CUDA against a CPU float64 engine on the same
shipped model, in float32 and bf16, raw and processed, with a prefill chunked into several steps and a
decode batch running beside it (CUDA graphs on). `pytest -m gpu tests/gpu/test_gpu_prompt_logprobs.py`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ourobatch import EngineConfig, SamplingParams, SyncEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODEL = Path(__file__).resolve().parents[2] / "models" / "pointer-chase"
# max / mean |difference|. float32 is exact to rounding (H200: max 7.5e-6). bf16 is compared on the same
# bf16-rounded weights, so what is left is bf16 activations: a prompt token is mostly an unlikely one,
# whose log-prob moves with its logit's rounding (H200: mean 0.022 raw, 0.031 processed at T = 0.7, i.e.
# x 1/0.7; max 0.14 / 0.20), unlike the near-certain answers tests/gpu/test_gpu_logprobs.py compares
TOL = {"float32": (2e-4, 2e-5), "bfloat16": (0.5, 0.06)}


@pytest.fixture(scope="module")
def rounded(tmp_path_factory) -> Path:
    """The shipped model with its weights rounded to bf16 (stored as float32): the bf16 engine's own weights."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("bf16") / "pointer-chase"
    shutil.copytree(MODEL, out)
    tensors = load_file(str(out / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16).to(v.dtype) for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def prompts(count: int) -> list[list[int]]:
    lines = (MODEL / "heldout_tasks.jsonl").read_text().splitlines()[:count]
    return [json.loads(line)["prompt_token_ids"] for line in lines]


def prompt_logprobs(device: str, dtype: str, mode: str, batched_tokens: int = 8192,
                    model: Path = MODEL) -> list[list[float]]:
    config = EngineConfig(model=str(model), device=device, dtype=dtype, logprobs_mode=mode, max_model_len=64,
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
def test_cuda_prompt_logprobs_equal_a_float64_cpu_engine(dtype, mode, rounded):
    model = rounded if dtype == "bfloat16" else MODEL
    want = prompt_logprobs("cpu", "float64", mode, model=model)
    got = prompt_logprobs("cuda", dtype, mode, 64, model)  # 64 tokens a step: most prompts span two prefill chunks
    diffs = [abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w) if b > -1e30]
    worst, mean = max(diffs), sum(diffs) / len(diffs)
    print(f"{dtype} {mode}: max {worst:.3g} mean {mean:.3g} over {len(diffs)} prompt tokens")
    assert worst < TOL[dtype][0] and mean < TOL[dtype][1], (worst, mean)
