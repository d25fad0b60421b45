"""benchmarks/ws_step64_probe.py's per-layer launches of benchmarks/ws_layer64.py's kernel, run on the CPU by
tests/gluon_emulator.py: layer by layer over layer_args' views (one launch a layer, as the probe launches them
between attention calls, with PDL's waits) they compute what one launch of every layer computes, to the bit.
Where Triton is installed (CI installs it). The probe's other arithmetic is checked without Triton's Gluon."""

from __future__ import annotations

import pytest
import torch

from tests.benchmark_scripts import load_benchmark

pytest.importorskip("triton.experimental.gluon")
emulator = pytest.importorskip("tests.gluon_emulator")
probe = load_benchmark("ws_step64_probe")
layer64 = load_benchmark("ws_layer64_probe")

H, INTER, CTAS, STAGES, S_IN, S_DOWN = 512, 1024, 8, 4, 4, 8


def slots(chain) -> dict[str, torch.Tensor]:
    return {name: getattr(chain, name).clone() for name in ("hm", "d", "qkv", "o", "act")}


@pytest.mark.parametrize("rows,seed", [(64, 0), (41, 3)])
def test_a_launch_a_layer_computes_what_one_launch_of_all_layers_does(rows, seed):
    chain = layer64.make_chain(rows, 3, "cpu", seed=seed, h=H, inter=INTER)
    chain.reference()  # the stages' reference (chain.stage_errors), so that both ways are also right
    args, constexprs = layer64.launch_args(chain, CTAS, STAGES, S_IN, S_DOWN)
    chain.reset()
    emulator.emulate(layer64.ws_layer64_kernel, CTAS, *args, seed=seed, check_global=True, **constexprs)
    whole = slots(chain)

    chain.reset()
    chain.cnt.zero_()
    scratch = probe.layer_scratch(chain, CTAS, S_IN, S_DOWN)
    for layer in range(chain.layers):  # o's input: the layer's own qkv slot, as in the one launch
        args, constexprs = probe.layer_args(chain, layer, chain.qkv[layer], scratch, STAGES, S_IN, S_DOWN)
        emulator.emulate(layer64.ws_layer64_kernel, CTAS, *args, seed=seed + layer, check_global=True, USE_PDL=True,
                         **constexprs)
    for name, t in slots(chain).items():
        assert torch.equal(t, whole[name]), name
    for layer in range(chain.layers):
        assert max(chain.stage_errors(layer).values()) < 2e-2, layer


def test_layer_args_refuse_what_the_kernel_cannot_read():
    chain = layer64.make_chain(64, 1, "cpu", h=H, inter=INTER)
    scratch = probe.layer_scratch(chain, CTAS, S_IN, S_DOWN)
    for bad in (torch.zeros(32, H, dtype=torch.bfloat16), torch.zeros(64, H // 2, dtype=torch.bfloat16),
                torch.zeros(64, 2 * H, dtype=torch.bfloat16)[:, ::2]):
        with pytest.raises(ValueError, match="o_in must be"):
            probe.layer_args(chain, 0, bad, scratch, STAGES, S_IN, S_DOWN)
    with pytest.raises(ValueError, match="multiple of"):
        probe.layer_args(chain, 0, chain.qkv[0], probe.layer_scratch(chain, 6, S_IN, S_DOWN), STAGES, S_IN, S_DOWN)


def test_the_floor_and_the_table_read_what_was_measured():
    from types import SimpleNamespace

    chain = SimpleNamespace(layers=24, rows=64, h=2048, weight_bytes=2_470_000_000)
    kv = 2 * 24 * 64 * 640 * 2048 * 2  # keys and values, bf16, every layer once
    assert probe.floor_ms(chain, 640, 4.3) == pytest.approx((2_470_000_000 + kv) / 4.3e9)
    result = {"rows": 64, "layers": 24, "floor_ms": 2.0, "ways": {"kernels": [3.1, 3.0], "ws": [2.5, 2.6]},
              "checks": {"kernels": {"finite": True}, "ws": {"finite": True}, "w": {"error": "TypeError: x"}}}
    lines = probe.table(result).splitlines()
    assert lines[2].startswith("| kernels | 3.100 / 3.000 | 1.500 |") and "| ws | 2.500 / 2.600 | 1.250 |" in lines[3]
    assert lines[4].startswith("| w | - | - |") and "TypeError" in lines[4]
    assert probe.parse_way("6:4:11") == (6, 4, 11)
    with pytest.raises(ValueError, match="stages:s_in:s_down"):
        probe.parse_way("6:4")
    with pytest.raises(ValueError, match="not among"):
        probe.check_ways(["ws", "fast"])


def test_the_engine_side_is_the_engines_model_on_a_pool_it_can_read():
    # on the CPU, 2 layers: the model at Ouro-1.4B's layer shapes, fused; the pool's pages scattered, every request
    # `context` positions with its newest the step's row; the torch path reads that pool and gives finite rows
    model = probe.engine_model(2, "cpu")
    cfg = model.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.head_dim) == (2048, 5632, 16, 128)
    assert model.model.layers[0].self_attn.qkv_weight.shape == (3 * 2048, 2048)
    pool, meta = probe.decode_batch(cfg, 5, 40, 0.0, device="cpu")
    assert meta.context_lens.tolist() == [40] * 5 and meta.positions.tolist() == [39] * 5
    pages = meta.block_tables[:, :3]
    assert len(set(pages.flatten().tolist())) == 15 and int(pages.max()) < pool.num_blocks
    assert meta.slots.tolist() == [int(pages[i, 2]) * 16 + 39 % 16 for i in range(5)]
    model.set_attention_backend("torch")
    h = torch.randn(5, 2048).to(torch.bfloat16)
    out = model.run_loops(h, meta, pool, 1, 1)[-1]
    assert out.shape == (5, 2048) and bool(torch.isfinite(out.float()).all())


def test_the_pdl_build_waits_once_and_keeps_its_wgmmas():
    plain, pdl = layer64.compile_for_sm90(8, 4, 11), layer64.compile_for_sm90(8, 4, 11, use_pdl=True)
    assert plain["gdc_wait"] == 0 and pdl["gdc_wait"] == 1, (plain, pdl)
    assert pdl["wgmma"] == plain["wgmma"] and pdl["shared"] == plain["shared"] <= 232448
