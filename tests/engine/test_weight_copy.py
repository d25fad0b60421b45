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


def _on_disk(ckpt):
    from safetensors.torch import load_file
    return {k: v for f in ckpt.glob("*.safetensors") for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("tied,shards", [(False, 1), (False, 3), (True, 1), (True, 2)])
def test_checkpoint_tensors_stream_every_tensor_as_stored(tmp_path, tied, shards):
    from engine.config import OuroConfig
    from engine.weights import checkpoint_tensors
    ckpt = make_tiny_checkpoint(tmp_path / "c", dtype=torch.bfloat16, tie_word_embeddings=tied, num_shards=shards)
    on_disk = _on_disk(ckpt)
    got = dict(checkpoint_tensors(ckpt, OuroConfig.from_checkpoint(ckpt)))
    if tied:
        assert "lm_head.weight" not in on_disk
        on_disk["lm_head.weight"] = on_disk["model.embed_tokens.weight"]
    assert set(got) == set(on_disk)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], v) for k, v in on_disk.items())


def test_load_weights_through_the_stream_equals_the_checkpoint_and_a_bad_shard_is_named(tmp_path, model):
    import json
    from engine.config import OuroConfig
    from engine.weights import checkpoint_tensors
    ckpt = make_tiny_checkpoint(tmp_path / "c", seed=9, num_shards=2)
    config = OuroConfig.from_checkpoint(ckpt)
    copied = copy_named_tensors(model, checkpoint_tensors(ckpt, config))
    state = model.state_dict()
    assert set(copied) == set(_on_disk(ckpt))
    assert all(torch.equal(state[k], v.float()) for k, v in _on_disk(ckpt).items())
    index = ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    shard = data["weight_map"]["model.norm.weight"]
    other = next(s for s in set(data["weight_map"].values()) if s != shard)
    data["weight_map"]["model.norm.weight"] = other  # the index points at a shard that lacks it
    index.write_text(json.dumps(data))
    with pytest.raises(WeightUpdateError, match=r"CheckpointError: .*tensor model\.norm\.weight listed in the index "
                                                r"is not in the file"):
        copy_named_tensors(model, checkpoint_tensors(ckpt, config))
