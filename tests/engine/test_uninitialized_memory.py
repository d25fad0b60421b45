"""No read of memory nothing wrote reaches an output on the CPU path: the same requests on memory that holds
garbage (every torch.empty NaN, integers their largest value) give the same tokens and log-probs as on ordinary
memory, in every mode, for the shipped trained model and a tiny model with grouped queries; each run in a child
process (tests/uninitialized.py). The CUDA paths' version: tests/gpu/test_gpu_engines_in_one_process.py, which
found session 20's abort (a kernel weighted unwritten key slots by 0, and 0 x NaN = NaN)."""

from __future__ import annotations

import pytest

from tests.uninitialized import POINTER_CHASE, run_child


@pytest.mark.parametrize("model", [POINTER_CHASE, "gqa"], ids=["pointer_chase", "gqa"])
def test_outputs_on_garbage_memory_equal_the_outputs_on_ordinary_memory(model):
    runs = [("deferred", 1), ("deferred", 4), ("verify", 4)]
    garbage = run_child(model, runs, garbage=True, device="cpu")
    assert garbage == run_child(model, runs, garbage=False, device="cpu")
    assert any(tokens for r in garbage for _, tokens, _ in r["outputs"])
