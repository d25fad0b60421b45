"""GPU: engines started one after another in one process (an RL loop's pattern), and engines on memory that
holds garbage, each in a child process: an abort fails one test with the child's stderr (a device-side assert's
message is lost under pytest's capture) instead of ending the whole GPU suite.

Session 20 found test_gpu_logprobs.py's second engine killing the process with SIGABRT in its warm-up requests.
Session 21 found why (docs/benchmarks.md, session 21): the second engine's KV pool came from memory the process
had freed, and the Gluon decode kernel weighted the slots past a context in its last tile by 0 instead of masking
them, so a NaN bit pattern there (0 x NaN = NaN) made the row's logits NaN; the Triton sampler could then draw an
id outside the vocabulary, and the top-k path's gather of it was a device-side assert. `garbage` makes every fresh
allocation hold NaN (integers: their largest value; torch.utils.deterministic.fill_uninitialized_memory, which
needs deterministic algorithms, on in both runs compared), so any read of memory nothing wrote that reaches an
output changes it: the outputs must equal those of the same run on ordinary memory, token for token and log-prob
for log-prob. Two models: the shipped trained one (6 heads of 64: the Gluon decode kernel), and a random one of
the loop-pass launch's shape (8 heads of 128: the launch at <= 8 requests, the skinny GEMMs above), with
requests of different lengths so the batch shrinks through both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, sys, tempfile
import torch
from pathlib import Path
from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.testing import make_tiny_checkpoint

model, runs, garbage, device = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
torch.use_deterministic_algorithms(True, warn_only=True)
torch.utils.deterministic.fill_uninitialized_memory = garbage  # every torch.empty: NaN / the largest integer
if model == "launch-shape":  # the loop-pass launch's shape (tests/gpu/test_gpu_gluon_layers.py)
    model = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "m", seed=6, eos_token_id=None, hidden_size=1024,
                                 num_attention_heads=8, num_key_value_heads=8, head_dim=128, intermediate_size=2816,
                                 vocab_size=97)
n = 64
prompts = [[1 + (i * 7 + j) % 90 for j in range(8 + i % 5)] for i in range(n)]
params = [SamplingParams(max_tokens=3 + i % 11, temperature=1.0, seed=7 + i, ignore_eos=True, top_k=[0, 20][i % 2],
                         logprobs=i % 3) for i in range(n)]
for mode, B in runs:
    config = EngineConfig(model=str(model), device=device, dtype="bfloat16" if device == "cuda" else "float32",
                          logprobs_mode="raw", mode=mode, deep_interval=B, max_model_len=64, max_num_seqs=n)
    with SyncEngine(config) as llm:
        outs = llm.generate_batch(prompts, params)
    print(json.dumps({"run": [mode, B], "outputs": [[o.outputs[0].finish_reason, o.outputs[0].token_ids,
                                                    o.outputs[0].logprobs] for o in outs]}), flush=True)
"""


def run_child(model: str, runs: list, garbage: bool, env: dict | None = None, device: str = "cuda") -> list[dict]:
    args = [sys.executable, "-c", SCRIPT, model, json.dumps(runs), "1" if garbage else "0", device]
    run = subprocess.run(args, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"exit {run.returncode}\nstdout:\n{run.stdout[-2000:]}\nstderr:\n{run.stderr[-6000:]}"
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["run"] for r in results] == [list(r) for r in runs]
    for r in results:  # every request ran to its length: no non-finite logits anywhere
        assert all(reason == "length" for reason, _, _ in r["outputs"]), r["run"]
    return results


POINTER_CHASE = str(ROOT / "models" / "pointer-chase")


@pytest.mark.parametrize("env", [{}, {"OUROBATCH_DECODE_ATTENTION": "triton"}], ids=["default", "triton_decode"])
def test_a_second_engine_in_the_process_starts_and_generates(env):
    run_child(POINTER_CHASE, [("deferred", 1), ("deferred", 4)], garbage=False, env=env)


@pytest.mark.parametrize("model", [POINTER_CHASE, "launch-shape"], ids=["pointer_chase", "launch_shape"])
def test_memory_nothing_wrote_never_reaches_an_output(model):
    runs = [("deferred", 1), ("deferred", 4), ("verify", 4)]
    assert run_child(model, runs, garbage=True) == run_child(model, runs, garbage=False)
