"""engine/weights.copy_named_tensors' finiteness check (an aminmax per tensor): one NaN, +inf or -inf anywhere in
a tensor of any float dtype is refused with WeightUpdateError naming it, before it is copied; large finite values
are copied."""

from __future__ import annotations

import pytest
import torch

from engine.loader import load_model
from engine.weights import copy_named_tensors
from ourobatch.testing import make_tiny_checkpoint
from scheduler.errors import WeightUpdateError

NAME = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("w") / "m"), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 777, -1])
def test_one_non_finite_value_is_refused_before_the_copy(model, dtype, value, where):
    before = model.state_dict()[NAME].clone()
    bad = torch.randn(before.shape).to(dtype)
    bad.view(-1)[where] = value
    with pytest.raises(WeightUpdateError, match=rf"tensor {NAME.replace('.', chr(92) + '.')} holds NaN or inf"):
        copy_named_tensors(model, [(NAME, bad)])
    assert torch.equal(model.state_dict()[NAME], before)


def test_large_finite_values_are_copied(model):
    big = torch.full(model.state_dict()[NAME].shape, torch.finfo(torch.float16).max, dtype=torch.float16)
    assert copy_named_tensors(model, [(NAME, big)]) == [NAME]
    assert torch.equal(model.state_dict()[NAME], big.float())
