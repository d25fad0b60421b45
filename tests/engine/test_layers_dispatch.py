"""The loop-pass launch's rule and sizes (engine/layers_dispatch.py) and the stacked weights it reads
(engine/layer_stack.py), on the CPU: the modules' parameters become views of the stacks, so the reference path's
outputs do not change and in-place weight updates reach the stacks."""

from __future__ import annotations

import pytest
import torch

from engine import layer_stack
from engine import layers_dispatch as ld
from engine.loader import load_model
from engine.weights import copy_named_tensors
from ourobatch.testing import make_tiny_checkpoint


def test_the_rule_takes_ouro_shapes_only():
    assert ld.shape_fits(2048, 5632, 16, 16, 128, 16, 132)  # Ouro-1.4B on an H200
    assert ld.shape_fits(1024, 2816, 8, 8, 128, 16, 132)
    assert not ld.shape_fits(2048, 5632, 16, 4, 128, 16, 132)  # GQA
    assert not ld.shape_fits(1024, 2816, 16, 16, 64, 16, 132)  # head_dim 64
    assert not ld.shape_fits(2048, 5632, 16, 16, 128, 32, 132)  # 32-position pages
    assert not ld.shape_fits(2048, 5632, 16, 16, 128, 16, 100)  # 8 x 16 items or 128 residual shares > SMs
    assert not ld.shape_fits(2048, 5600, 16, 16, 128, 16, 132)  # intermediate not in 256-column chunks
    assert not ld.shape_fits(4096, 11008, 32, 32, 128, 16, 132)  # 32 heads x 8 requests > SMs
    # the intermediate rows' chunks (5632 / 256, 2816 / 256) outnumber a norm's: 2 x 8 of rows + 2 of weights
    assert ld.staged_chunks(2048, 5632) == 22 and ld.staged_chunks(1024, 2816) == 11
    assert ld.staged_chunks(2048, 2048) == 18 and ld.staged_chunks(1024, 1024) == 9
    assert ld.smem_bytes(2048, 5632) <= ld.HOPPER_SMEM_PER_CTA


def test_calls_and_the_switch():
    assert ld.call_fits(1, 1, False, False) and ld.call_fits(8, 1, False, False)
    assert not ld.call_fits(0, 1, False, False) and not ld.call_fits(9, 1, False, False)
    assert not ld.call_fits(4, 4, False, False) and not ld.call_fits(4, 1, True, False)
    assert not ld.call_fits(4, 1, False, True)  # a tiled (prefill-graph) call
    assert ld.parse_switch("") and ld.parse_switch("1") and not ld.parse_switch(" 0 ")
    with pytest.raises(ValueError, match="OUROBATCH_DECODE_LAYERS must be 1 .* or 0"):
        ld.parse_switch("yes")


def test_no_stack_off_a_cuda_bf16_model(tmp_path):
    model = load_model(make_tiny_checkpoint(tmp_path / "m", seed=1), torch.float32, "cpu")
    model.fuse_projections()
    assert model.layer_stack is None and not layer_stack.wanted(model)


def test_stacked_parameters_are_views_and_updates_reach_the_stacks(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "m", seed=2, dtype=torch.float64)
    model = load_model(ckpt, torch.float64, "cpu")
    model.fuse_projections()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    before = [r.clone() for r in model.dense_loops(ids)]
    stack = layer_stack.stack_layers(model)
    after = model.dense_loops(ids)
    for a, b in zip(before, after):  # the same values, now read through the stacks' views
        assert torch.equal(a, b)
    cfg, L = model.config, model.config.num_hidden_layers
    qkv = stack.qkv_width
    for i, layer in enumerate(model.model.layers):
        assert layer.self_attn.qkv_weight.data_ptr() == stack.wq[i * qkv].data_ptr()
        assert layer.mlp.down_proj.weight.data_ptr() == stack.wd[i * cfg.hidden_size].data_ptr()
        assert layer.post_attention_layernorm_2.weight.data_ptr() == stack.norms[3][i].data_ptr()
    new = torch.randn(cfg.intermediate_size, cfg.hidden_size, dtype=torch.float64)
    name = f"model.layers.{L - 1}.mlp.up_proj.weight"
    copy_named_tensors(model, [(name, new)])
    up = stack.wgu[(L - 1) * 2 * cfg.intermediate_size + cfg.intermediate_size:L * 2 * cfg.intermediate_size]
    assert torch.equal(up, new)
    n2 = torch.randn(cfg.hidden_size, dtype=torch.float64)
    copy_named_tensors(model, [("model.layers.0.input_layernorm_2.weight", n2)])
    assert torch.equal(stack.norms[1][0], n2)
    assert stack.inv_freq.shape == (cfg.head_dim // 2,) and stack.counters.dtype == torch.int32


def test_only_calls_whose_row_r_is_request_rs_go_to_the_launch():
    from types import SimpleNamespace

    stack = SimpleNamespace(wq=torch.zeros(1, dtype=torch.bfloat16))
    pool = SimpleNamespace(k=torch.zeros(1, dtype=torch.bfloat16), block_size=16)
    h = torch.zeros(3, 8, dtype=torch.bfloat16)

    def meta(seqs, max_rows=1, prefill=False):
        return SimpleNamespace(context_lens=torch.ones(seqs), max_rows=max_rows, prefill=prefill, tiles=None)

    assert layer_stack.layers_run(stack, h, meta(3), pool)
    assert not layer_stack.layers_run(None, h, meta(3), pool)
    assert not layer_stack.layers_run(stack, h, meta(4), pool)  # a request without a row
    assert not layer_stack.layers_run(stack, h, meta(3, max_rows=2), pool)
    assert not layer_stack.layers_run(stack, h.float(), meta(3), pool)
    assert not layer_stack.layers_run(stack, h, meta(3), SimpleNamespace(k=pool.k, block_size=32))
    assert not layer_stack.layers_run(stack, h, meta(3), SimpleNamespace(k=None, block_size=16))  # asleep
