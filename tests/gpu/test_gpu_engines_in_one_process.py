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

import pytest
import torch

from tests.uninitialized import POINTER_CHASE, run_child

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(900)]


@pytest.mark.parametrize("env", [{}, {"OUROBATCH_DECODE_ATTENTION": "triton"}], ids=["default", "triton_decode"])
def test_a_second_engine_in_the_process_starts_and_generates(env):
    run_child(POINTER_CHASE, [("deferred", 1), ("deferred", 4)], garbage=False, env=env)


@pytest.mark.parametrize("model", [POINTER_CHASE, "launch-shape"], ids=["pointer_chase", "launch_shape"])
def test_memory_nothing_wrote_never_reaches_an_output(model):
    # (the control run: sleep 1 / 2 free the pool, graphs and weights; wake rebuilds them on memory anew)
    runs = [("deferred", 1), ("deferred", 4), ("verify", 4)] + [("deferred", 4, {"control": True}, {})] * (
        model == POINTER_CHASE)
    assert run_child(model, runs, garbage=True) == run_child(model, runs, garbage=False)
