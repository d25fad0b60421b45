"""OuroForCausalLM.dense_loops (the no-cache path of training and the quality harness's KL) against the
float64 oracle: every loop's readout at every position, batched sequences, every shape, fused or not."""

from __future__ import annotations

import pytest
import torch

from engine.loader import load_model
from tests.oracle import load_oracle

from .conftest import SHAPES


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("fused", [False, True])
def test_dense_loops_match_the_oracle(checkpoints, shape, fused):
    model = load_model(str(checkpoints[shape]), torch.float64, "cpu")
    if fused:
        model.fuse_projections()
    oracle = load_oracle(checkpoints[shape])
    g = torch.Generator().manual_seed(len(shape))
    ids = torch.randint(0, model.config.vocab_size, (3, 11), generator=g)
    with torch.no_grad():
        readouts = model.dense_loops(ids)
    assert len(readouts) == model.config.total_ut_steps
    for row in range(ids.shape[0]):
        want = oracle.forward(ids[row].tolist()).hidden  # [T, S, H]
        got = torch.stack([h[row] for h in readouts])
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_dense_loops_is_differentiable(checkpoints):
    """Training backpropagates through it into every layer weight (the loader returns frozen weights)."""
    model = load_model(str(checkpoints["kv1-L2-T4"]), torch.float32, "cpu").requires_grad_(True)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    model.logits(model.dense_loops(ids)[-1]).logsumexp(-1).sum().backward()
    for name, p in model.model.layers.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
