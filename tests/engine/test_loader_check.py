"""engine/loader.py's one-pass finiteness check (a queued aminmax per tensor, one read of all the flags) and
its time breakdown: every non-finite pattern is still caught and named, counted against numpy, and the
timings account for every tensor and byte of the checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import OuroConfig
from engine.loader import LoadTimings, finite_flags, load_model, load_state_dict
from ourobatch import CheckpointError
from ourobatch.testing import make_tiny_checkpoint


def _shard_of(ckpt, name):
    for file in sorted(ckpt.glob("*.safetensors")):
        if name in load_file(str(file)):
            return file
    raise AssertionError(name)


def _poke(ckpt, name, positions, values):
    file = _shard_of(ckpt, name)
    tensors = load_file(str(file))
    flat = tensors[name].view(-1)
    for i, v in zip(positions, values):
        flat[i if i >= 0 else flat.numel() + i] = v
    save_file(tensors, str(file), metadata={"format": "pt"})
    return file


@pytest.mark.parametrize("positions,values", [
    ([-1], [float("nan")]),  # the last value of the tensor
    ([0, -1], [float("inf"), float("-inf")]),  # both infinities: a sum would hide nothing, a max alone one
    ([5, 6, 7], [float("-inf"), float("nan"), float("inf")]),
    ([11], [float("-inf")]),
])
def test_every_non_finite_pattern_is_caught_and_counted(tmp_path, positions, values):
    ckpt = make_tiny_checkpoint(tmp_path / "ck", num_shards=3)
    name = "model.layers.1.mlp.down_proj.weight"
    file = _poke(ckpt, name, positions, values)
    stored = load_file(str(file))[name].numpy()
    expected = int((~np.isfinite(stored)).sum())
    with pytest.raises(CheckpointError) as info:
        load_model(ckpt, torch.float32)
    assert str(info.value) == f"{file}: tensor {name} has {expected} non-finite value(s) (NaN or inf)"


def test_the_first_bad_tensor_in_load_order_is_named_and_a_conversion_overflow_said_so(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ck")
    _poke(ckpt, "model.layers.0.mlp.up_proj.weight", [2], [1e6])  # finite as stored, inf in float16
    _poke(ckpt, "model.layers.1.self_attn.q_proj.weight", [0], [float("nan")])
    order = list(load_file(str(ckpt / "model.safetensors")))  # the loader reads a file's tensors in its order
    first = min(("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight"), key=order.index)
    with pytest.raises(CheckpointError, match=rf"tensor {first.replace('.', chr(92) + '.')} has 1 non-finite"):
        load_model(ckpt, torch.float16)
    with pytest.raises(CheckpointError, match=r"q_proj\.weight has 1 non-finite value\(s\) \(NaN or inf\)$"):
        load_model(ckpt, torch.float32)  # 1e6 is finite in float32: only the stored NaN is left
    _poke(ckpt, "model.layers.1.self_attn.q_proj.weight", [0], [0.5])
    with pytest.raises(CheckpointError, match=r"up_proj\.weight has 1 non-finite value\(s\) \(NaN or inf\) after "
                                              r"conversion from torch\.float32 to torch\.float16$"):
        load_model(ckpt, torch.float16)


@pytest.mark.parametrize("stored,dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                          (torch.float32, torch.bfloat16)])
def test_timings_account_for_every_tensor_and_byte(tmp_path, stored, dtype):
    ckpt = make_tiny_checkpoint(tmp_path / "ck", dtype=stored, num_shards=2)
    on_disk = {k: v for f in ckpt.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    timings = LoadTimings()
    state = load_state_dict(ckpt, OuroConfig.from_checkpoint(ckpt), dtype, "cpu", timings=timings)
    assert all(torch.equal(state[k], v.to(dtype)) for k, v in on_disk.items())  # the values, converted
    assert timings.num_tensors == len(on_disk) == len(state)
    assert timings.num_bytes == sum(v.numel() * v.element_size() for v in on_disk.values())
    phases = timings.init_s + timings.read_s + timings.to_device_s + timings.check_s
    assert 0 < phases <= timings.total_s
    fields = timings.fields()
    assert fields["weights_tensors"] == len(on_disk) and fields["weights_gb"] == round(timings.num_bytes / 1e9, 3)
    assert set(fields) >= {"weights_read_s", "weights_to_device_s", "weights_check_s", "weights_init_s"}


def test_tied_lm_head_is_the_embedding_and_counted_once(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "tied", tie_word_embeddings=True)
    timings = LoadTimings()
    model = load_model(ckpt, torch.float32, timings=timings)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert timings.num_tensors == len(load_file(str(ckpt / "model.safetensors")))


@pytest.mark.parametrize("stored,dtype,value",
                         [(torch.float32, torch.float32, 3e38), (torch.float16, torch.float16, 6e4)])
def test_finite_weights_whose_sum_overflows_load(tmp_path, stored, dtype, value):
    """The check sums |w| per tensor (in float32): weights near the dtype's largest value overflow that sum,
    which is no reason to refuse them."""
    ckpt = make_tiny_checkpoint(tmp_path / "ck", dtype=stored)
    name = "model.layers.0.mlp.down_proj.weight"
    file = _poke(ckpt, name, list(range(40)), [value] * 40)
    state = load_state_dict(ckpt, OuroConfig.from_checkpoint(ckpt), dtype, "cpu")
    assert torch.equal(state[name], load_file(str(file))[name].to(dtype))


@pytest.mark.parametrize("one_call", [True, False])  # CUDA's default (one _foreach_norm call), the CPU's
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_both_checks_flag_every_non_finite_kind_in_every_dtype(one_call, dtype):
    gen = torch.Generator().manual_seed(7)
    tensors, expected = [], []
    for bad in [None, float("nan"), float("inf"), float("-inf"), None]:
        t = torch.randn(300, generator=gen).to(dtype)
        if bad is not None:
            t[int(torch.randint(0, 300, (1,), generator=gen))] = bad
        tensors.append(t)
        expected.append(bad is None)
    assert finite_flags(tensors, one_call=one_call) == expected
