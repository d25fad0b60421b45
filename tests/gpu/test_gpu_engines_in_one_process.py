"""GPU: engines started one after another in one process (an RL loop's pattern), and an engine on memory that
holds garbage, on the shipped trained model, each in a child process: an abort fails one test with the child's
stderr (a device-side assert's message is lost under pytest's capture) instead of ending the whole GPU suite.

Session 20 found test_gpu_logprobs.py's second engine killing the process with SIGABRT in its warm-up requests.
Session 21 found why (docs/benchmarks.md, session 21): the second engine's KV pool came from memory the process
had freed, and the Gluon decode kernel weighted the slots past a context in its last tile by 0 instead of masking
them, so a NaN bit pattern there (0 x NaN = NaN) made the row's logits NaN; the Triton sampler could then draw an
id outside the vocabulary, and the top-k path's gather of it was a device-side assert. The "garbage" case makes
every fresh allocation hold NaN (torch.utils.deterministic.fill_uninitialized_memory), which aborted on the first
engine before the fix; the Triton decode kernel's case is the control."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
import torch
from pathlib import Path
from ourobatch import EngineConfig, SamplingParams, SyncEngine

model, intervals, garbage = Path(sys.argv[1]), [int(b) for b in sys.argv[2].split(",")], sys.argv[3] == "1"
if garbage:  # every torch.empty holds NaN (integers: their largest value): memory nothing wrote
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
prompts = [[1 + (i * 7 + j) % 400 for j in range(8 + i % 5)] for i in range(256)]
params = [SamplingParams(max_tokens=6, temperature=1.0, seed=7 + i, ignore_eos=True, top_k=[0, 20][i % 2],
                         logprobs=i % 3) for i in range(256)]
for B in intervals:
    config = EngineConfig(model=str(model), device="cuda", dtype="bfloat16", logprobs_mode="raw", mode="deferred",
                          deep_interval=B, shallow_loops=3, max_model_len=64, max_num_seqs=256)
    with SyncEngine(config) as llm:
        outs = llm.generate_batch(prompts, params)
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 6 for o in outs), B
    print("engine", B, "ok", flush=True)
"""


@pytest.mark.parametrize("intervals,garbage,env", [
    ("1,4", False, {}),
    ("1,4", False, {"OUROBATCH_DECODE_ATTENTION": "triton"}),
    ("4", True, {}),
    ("1", True, {}),
], ids=["two_engines", "two_engines_triton_decode", "garbage_B4", "garbage_B1"])
def test_engines_start_and_generate_whatever_their_memory_held(intervals, garbage, env):
    args = [sys.executable, "-c", SCRIPT, str(ROOT / "models" / "pointer-chase"), intervals, "1" if garbage else "0"]
    run = subprocess.run(args, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}\nstdout:\n{run.stdout[-2000:]}\nstderr:\n{run.stderr[-6000:]}"
    assert run.stdout.count(" ok") == len(intervals.split(","))
