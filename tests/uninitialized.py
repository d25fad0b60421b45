"""Engines in a child process, optionally on memory that holds garbage (every fresh allocation NaN, integers their
largest value: torch.utils.deterministic.fill_uninitialized_memory, which needs deterministic algorithms, on in
every run so that runs compare): any read of memory nothing wrote that reaches an output changes it. An abort (a
device-side assert) fails the caller's test with the child's stderr instead of ending the test process.
tests/gpu/test_gpu_engines_in_one_process.py (CUDA) and tests/engine/test_uninitialized_memory.py (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import json, sys, tempfile
import torch
from pathlib import Path
from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.testing import make_tiny_checkpoint

model, runs, garbage, device = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
torch.use_deterministic_algorithms(True, warn_only=True)
torch.utils.deterministic.fill_uninitialized_memory = garbage  # every torch.empty: NaN / the largest integer
scratch = tempfile.TemporaryDirectory()  # removed when the child exits
if model == "launch-shape":  # the loop-pass launch's shape (tests/gpu/test_gpu_gluon_layers.py)
    model = make_tiny_checkpoint(Path(scratch.name) / "m", seed=6, eos_token_id=None, hidden_size=1024,
                                 num_attention_heads=8, num_key_value_heads=8, head_dim=128, intermediate_size=2816,
                                 vocab_size=97)
elif model == "gqa":  # a tiny model with grouped queries (CPU)
    model = make_tiny_checkpoint(Path(scratch.name) / "m", seed=3, eos_token_id=None, vocab_size=97,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64,
                                 intermediate_size=96)
n = 64
shared = [5 + j % 80 for j in range(24)]  # a prefix several prompts share (prefix-cache hits past its blocks)
prompts = [([] if i % 3 else shared) + [1 + (i * 7 + j) % 90 for j in range(8 + i % 5)] for i in range(n)]
def plain(prompt_logprobs):  # vLLM's [None | {token id: Logprob}] as JSON
    return None if prompt_logprobs is None else [
        None if d is None else sorted((k, v.logprob, v.rank) for k, v in d.items()) for d in prompt_logprobs]


for mode, B, overrides, extra in runs:  # extra: SamplingParams fields for every request (n, prompt_logprobs, ...)
    control = overrides.pop("control", False)  # the requests in three rounds, with sleep / wake between them
    params = [SamplingParams(**{"max_tokens": 3 + i % 11, "temperature": 1.0, "seed": 7 + i, "ignore_eos": True,
                                "top_k": [0, 20][i % 2], "logprobs": i % 3, **extra}) for i in range(n)]
    config = EngineConfig(**{"model": str(model), "device": device,
                             "dtype": "bfloat16" if device == "cuda" else "float32", "logprobs_mode": "raw",
                             "mode": mode, "deep_interval": B, "max_model_len": 64, "max_num_seqs": n, **overrides})
    with SyncEngine(config) as llm:
        if not control:
            outs = llm.generate_batch(prompts, params)
        else:  # a third of the requests, then sleep (1: weights to the CPU) and wake, a third, sleep (2: weights
            # dropped) and wake and load them again, the rest: pool, buffers and weights rebuilt on memory anew
            third = n // 3
            outs = llm.generate_batch(prompts[:third], params[:third])
            llm.sleep(1)
            llm.wake_up()
            outs += llm.generate_batch(prompts[third:2 * third], params[third:2 * third])
            llm.sleep(2)
            llm.wake_up()
            llm.load_weights(model)
            outs += llm.generate_batch(prompts[2 * third:], params[2 * third:])
    print(json.dumps({"run": [mode, B, {**overrides, **({"control": True} if control else {})}, extra], "outputs": [
        [[c.finish_reason, c.token_ids, c.logprobs] for c in o.outputs] + [plain(o.prompt_logprobs)] for o in outs]}),
        flush=True)
"""


def run_child(model: str, runs: list, garbage: bool, env: dict | None = None, device: str = "cuda") -> list[dict]:
    """Each run: (mode, deep_interval) or (mode, deep_interval, EngineConfig overrides, SamplingParams fields) over
    64 requests of 3-13 tokens; returns, per run, each request's completions (finish reason, tokens, log-probs)
    and its prompt log-probs, after checking that every completion ran to its length."""
    runs = [list(r) + [{}, {}][len(r) - 2:] for r in runs]
    args = [sys.executable, "-c", SCRIPT, model, json.dumps(runs), "1" if garbage else "0", device]
    run = subprocess.run(args, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"exit {run.returncode}\nstdout:\n{run.stdout[-2000:]}\nstderr:\n{run.stderr[-6000:]}"
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["run"] for r in results] == runs
    for r in results:  # every request ran to its length: no non-finite logits anywhere
        assert all(c[0] == "length" for out in r["outputs"] for c in out[:-1]), r["run"]
    return results


POINTER_CHASE = str(ROOT / "models" / "pointer-chase")
