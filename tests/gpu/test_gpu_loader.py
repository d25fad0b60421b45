"""The checkpoint load onto CUDA (engine/weight_stream.py through engine/loader.py): pinned staging buffers,
reads split over threads, copies queued on the device, converted there. The reference is safetensors'
own reader on the CPU, converted on the CPU: every tensor must be equal."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import weight_stream
from engine.config import OuroConfig
from engine.loader import LoadTimings, load_state_dict
from ourobatch import CheckpointError, EngineClosedError
from ourobatch.testing import make_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    shape = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=1000)
    return {stored: make_tiny_checkpoint(root / str(stored), dtype=stored, num_shards=2, seed=5, **shape)
            for stored in (torch.bfloat16, torch.float32)}


@pytest.mark.parametrize("stage_bytes,depth", [(None, None), (1 << 20, 2), (3000, 1), (3000, 5)])
@pytest.mark.parametrize("stored,dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                          (torch.bfloat16, torch.float32)])
def test_cuda_load_equals_safetensors_on_the_cpu(checkpoints, monkeypatch, stage_bytes, depth, stored, dtype):
    if stage_bytes is not None:  # small buffers: tensors in pieces, several chunks in flight or one
        monkeypatch.setattr(weight_stream, "STAGE_BYTES", stage_bytes)
        monkeypatch.setattr(weight_stream, "READ_AHEAD", depth)
    ckpt = checkpoints[stored]
    on_disk = {k: v for f in ckpt.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    timings = LoadTimings()
    state = load_state_dict(ckpt, OuroConfig.from_checkpoint(ckpt), dtype, "cuda", timings=timings)
    assert set(state) == set(on_disk) and timings.num_tensors == len(on_disk)
    for name, t in on_disk.items():
        got = state[name]
        assert got.device.type == "cuda" and got.dtype == dtype
        assert torch.equal(got.cpu(), t.to(dtype)), name


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_weight_is_named_on_cuda(tmp_path, value):
    """The one-call check (torch._foreach_norm, L1, on the device) must see each kind of non-finite value."""
    ckpt = make_tiny_checkpoint(tmp_path / "nan", dtype=torch.bfloat16, seed=1)
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"].view(-1)[7] = value
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"up_proj\.weight has 1 non-finite value\(s\) \(NaN or inf\)$"):
        load_state_dict(ckpt, OuroConfig.from_checkpoint(ckpt), torch.bfloat16, "cuda")


def test_a_load_stopped_half_way_raises_and_the_next_load_is_whole(checkpoints, monkeypatch):
    monkeypatch.setattr(weight_stream, "STAGE_BYTES", 1 << 16)
    ckpt = checkpoints[torch.bfloat16]
    polls = []

    def stop() -> bool:
        polls.append(1)
        return len(polls) > 5

    with pytest.raises(EngineClosedError):
        load_state_dict(ckpt, OuroConfig.from_checkpoint(ckpt), torch.bfloat16, "cuda", should_stop=stop)
    torch.cuda.synchronize()
    state = load_state_dict(ckpt, OuroConfig.from_checkpoint(ckpt), torch.bfloat16, "cuda")  # and loads again
    on_disk = {k: v for f in ckpt.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert set(state) == set(on_disk) and all(torch.equal(state[k].cpu(), v) for k, v in on_disk.items())
