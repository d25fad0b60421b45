"""No read of memory nothing wrote reaches an output on the CPU path: the same requests on memory that holds
garbage (every torch.empty NaN, integers their largest value) give the same tokens and log-probs as on ordinary
memory, in every mode, with preemption (11 in the small pool's run), chunked prefill, prefix-cache hits, the
lookahead pipeline, parallel sampling and prompt log-probs, and across sleep (levels 1 and 2) / wake / reloaded
weights between request rounds (a sleep that kept the prefix cache would hit blocks of the reallocated pool: this
test fails then), for the shipped trained model and a tiny model with grouped queries; each run in a child process
(tests/uninitialized.py). The CUDA paths' version: tests/gpu/test_gpu_engines_in_one_process.py, which
found session 20's abort (a kernel weighted unwritten key slots by 0, and 0 x NaN = NaN)."""

from __future__ import annotations

import pytest

from tests.uninitialized import POINTER_CHASE, run_child


RUNS = [
    ("deferred", 1), ("deferred", 4), ("verify", 4),
    # a small pool (preemption, re-prefill), chunked prefill, the lookahead pipeline, parallel sampling and
    # prompt log-probs; prefix-cache hits throughout (a third of the prompts share 24 tokens)
    ("deferred", 4, {"num_kv_blocks": 40, "block_size": 4, "max_num_batched_tokens": 48}, {}),
    ("deferred", 3, {"async_scheduling": True, "max_num_batched_tokens": 32}, {"n": 2, "prompt_logprobs": 2}),
    ("verify", 3, {"max_num_batched_tokens": 32}, {"n": 2, "prompt_logprobs": 1}),
    ("deferred", 4, {"control": True}, {}),  # sleep 1 / wake, sleep 2 / wake / load_weights between request rounds
]


@pytest.mark.parametrize("model", [POINTER_CHASE, "gqa"], ids=["pointer_chase", "gqa"])
def test_outputs_on_garbage_memory_equal_the_outputs_on_ordinary_memory(model):
    garbage = run_child(model, RUNS, garbage=True, device="cpu")
    assert garbage == run_child(model, RUNS, garbage=False, device="cpu")
    assert all(c[1] for r in garbage for out in r["outputs"] for c in out[:-1])  # every completion has tokens
