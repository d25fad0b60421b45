"""benchmarks/ws_ouro64.py's kernel (Ouro's decode layer between two attentions at 64 rows: o, the sandwich norms,
SiLU x up, down, the next layer's qkv with RoPE and the key / value store) run on the CPU by tests/gluon_emulator.py
against a float64 reference written here from the model's description (engine/model.py's OuroDecoderLayer.run and
RotaryEmbedding: rotate-half RoPE), each launch kind on fresh random inputs. Where Triton is installed (CI has none).
Proxy fences are checked too; acquire / release ordering on the GPU only (benchmarks/ws_step64_probe.py)."""

from __future__ import annotations

import pytest
import torch

from tests.benchmark_scripts import load_benchmark

pytest.importorskip("triton.experimental.gluon")
emulator = pytest.importorskip("tests.gluon_emulator")
ouro64 = load_benchmark("ws_ouro64")

D, EPS, SLOTS, TOL = 128, 1e-6, 300, 2e-2


def rms(x, n):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * n


def rope(x, pos, inv_freq):
    # x: [rows, heads, D] float64; NeoX rotate-half, angles pos x inv_freq repeated over both halves
    ang = pos.double()[:, None] * inv_freq.double()[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin


class Layers:
    """Random stacked weights of `layers` layers (hidden hq x D, intermediate `inter`), a launch's inputs and outputs
    at `m` rows, and the kernel run on them."""

    def __init__(self, m: int, inter: int, layers: int, seed: int, hq: int = 4) -> None:
        g = torch.Generator().manual_seed(seed)
        self.hq = HQ = hq
        h = self.h = HQ * D
        self.m, self.inter, self.qkv = m, inter, 3 * h

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

        self.w = {"wq": randn(layers * self.qkv, h, scale=h**-0.5), "wo": randn(layers * h, h, scale=h**-0.5),
                  "wgu": randn(layers * 2 * inter, h, scale=h**-0.5), "wd": randn(layers * h, inter, scale=inter**-0.5),
                  "norms": (1 + 0.1 * torch.randn(4, layers, h, generator=g)).to(torch.bfloat16)}
        self.rows = {"h": randn(m, h), "h_out": torch.zeros(m, h, dtype=torch.bfloat16), "a": randn(m, h),
                     "q": torch.zeros(m, HQ * D, dtype=torch.bfloat16)}
        self.kv = (randn(SLOTS, HQ, D), randn(SLOTS, HQ, D))
        self.kv_before = tuple(t.clone() for t in self.kv)
        self.pos = torch.randint(0, 4000, (m,), generator=g)
        self.slots = torch.randperm(SLOTS, generator=g)[:m]
        self.inv_freq = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)

    def run(self, ctas: int, layer: int, has_mlp: bool, has_qkv: bool, s_down: int, seed: int = 0, slow: float = 0.0):
        sc = ouro64.Scratch(self.h, self.qkv, self.inter, 1, ctas, 4, s_down, "cpu")
        args, constexprs = ouro64.ouro64_args(self.w, sc, 0, layer, self.rows, self.kv,
                                              (self.pos, self.slots, self.inv_freq), EPS, has_mlp, has_qkv, 4, 4,
                                              s_down)
        emulator.emulate(ouro64.ws_ouro64_kernel, ctas, *args, seed=seed, check_global=True, slow=slow, USE_PDL=True,
                         **constexprs)
        return sc

    def weight(self, name: str, layer: int, rows: int) -> torch.Tensor:
        return self.w[name][layer * rows:(layer + 1) * rows].double()

    def mlp_reference(self, layer: int) -> dict:
        n = self.w["norms"].double()
        h, a = self.rows["h"].double(), self.rows["a"].double()
        o = a @ self.weight("wo", layer, self.h).T
        hm = h + rms(o, n[1, layer])
        x = rms(hm, n[2, layer])
        gu = x @ self.weight("wgu", layer, 2 * self.inter).T
        gate, up = gu[:, :self.inter], gu[:, self.inter:]
        act = gate * torch.sigmoid(gate) * up
        d = act @ self.weight("wd", layer, self.h).T
        return {"o": o, "hm": hm, "act": act, "d": d, "h_out": hm + rms(d, n[3, layer])}

    def qkv_reference(self, h: torch.Tensor, layer: int) -> dict:
        x = rms(h, self.w["norms"].double()[0, layer])
        HQ = self.hq
        qkv = (x @ self.weight("wq", layer, self.qkv).T).view(self.m, 3 * HQ, D)
        q, k, v = qkv[:, :HQ], qkv[:, HQ:2 * HQ], qkv[:, 2 * HQ:]
        return {"q": rope(q, self.pos, self.inv_freq), "k": rope(k, self.pos, self.inv_freq), "v": v}

    def qkv_errors(self, ref: dict) -> dict:
        got = {"q": self.rows["q"].view(self.m, self.hq, D), "k": self.kv[0][self.slots], "v": self.kv[1][self.slots]}
        return {name: rel(got[name], ref[name]) for name in got}

    def untouched_slots(self) -> bool:
        others = torch.ones(SLOTS, dtype=torch.bool)
        others[self.slots] = False
        return all(torch.equal(t[others], b[others]) for t, b in zip(self.kv, self.kv_before))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("m,hq,inter,seed", [(64, 4, 1024, 0), (37, 8, 2048, 1)])
def test_a_layer_between_two_attentions_matches_float64(m, hq, inter, seed):
    # the MLP of layer 0 and the qkv of layer 1 on 8 CTAs (2 groups: a head's halves in different groups, so the
    # qkv sums wait for their partner), K a CTA in 1 or 2 chunks of 128
    lay = Layers(m, inter, 2, seed, hq)
    sc = lay.run(8, 0, True, True, 8, seed, slow=0.005)
    ref = lay.mlp_reference(0)
    got = {"o": sc.o[:m], "hm": sc.hm[:m], "act": sc.act[:m], "d": sc.d[:m], "h_out": lay.rows["h_out"]}
    errors = {name: rel(got[name], ref[name]) for name in got}
    errors.update(lay.qkv_errors(lay.qkv_reference(ref["h_out"], 1)))
    assert max(errors.values()) < TOL, errors
    assert lay.untouched_slots()


def test_a_passs_first_launch_is_the_first_layers_qkv():
    lay = Layers(50, 1024, 2, 7)
    h_out = lay.rows["h_out"].clone()
    lay.run(8, -1, False, True, 8)
    errors = lay.qkv_errors(lay.qkv_reference(lay.rows["h"].double(), 0))
    assert max(errors.values()) < TOL, errors
    assert torch.equal(lay.rows["h_out"], h_out) and lay.untouched_slots()  # no residual to add: h_out untouched


def test_a_passs_last_launch_ends_at_down():
    lay = Layers(64, 1024, 2, 9)
    q = lay.rows["q"].clone()
    sc = lay.run(8, 1, True, False, 8)
    ref = lay.mlp_reference(1)
    errors = {name: rel(getattr(sc, name)[:64], ref[name]) for name in ("o", "hm", "act", "d")}
    assert max(errors.values()) < TOL, errors
    assert torch.equal(lay.rows["q"], q) and all(torch.equal(t, b) for t, b in zip(lay.kv, lay.kv_before))


def test_the_result_does_not_depend_on_the_ctas_timing():
    # another TMA order, and half of the CTAs lagging (a group reading its partner's partials before they are
    # stored would read the last phase's)
    outs = []
    for seed, slow in ((1, 0.0), (2, 0.01)):
        lay = Layers(64, 1024, 2, 3)
        lay.run(8, 0, True, True, 8, seed=seed, slow=slow)
        outs.append((lay.rows["h_out"].clone(), lay.rows["q"].clone(), lay.kv[0].clone()))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_shapes_the_kernel_cannot_run_name_the_field():
    for args, field in [((512, 1024, 4, 4, 64, 8, 4, 4, 8), "head_dim must be 128"),
                        ((512, 1024, 2, 2, 128, 8, 4, 4, 8), "num_attention_heads x head_dim"),
                        ((512, 1024, 4, 4, 128, 8, 4, 4, 4), "s_in .* and s_down"),
                        ((512, 1024, 4, 4, 128, 6, 4, 4, 8), "multiple of"),
                        ((512, 1024, 4, 4, 128, 8, 13, 4, 8), "stages must")]:
        with pytest.raises(ValueError, match=field):
            ouro64.check_shapes(*args)


def small_model(dtype, layers: int = 2, seed: int = 4):
    """The engine's model at hidden 512 (4 heads of 128), intermediate 1024: random weights (norms near 1), fused."""
    from engine.config import OuroConfig
    from engine.model import OuroForCausalLM

    cfg = OuroConfig.from_dict(dict(model_type="ouro", vocab_size=64, hidden_size=512, intermediate_size=1024,
                                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                    head_dim=D, total_ut_steps=2))
    model = OuroForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    for t in model.parameters():
        t.data = (1 + 0.1 * torch.randn(t.shape, generator=g) if t.dim() == 1
                  else torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)
    model = model.to(dtype)
    model.fuse_projections()
    return model


def test_a_loop_pass_of_launches_matches_the_models_float64_pass():
    # launch 0 (layer 0's qkv), then per layer the engine's decode attention and a layer launch, the readout's
    # add + norm (in torch here: Triton's kernel): against the model's float64 torch path over the same pool, the
    # readout and every layer's new keys and values; 9 requests of 40 positions on scattered pages
    from engine import layer_stack
    from engine.attention_dispatch import DecodeConfig

    probe = load_benchmark("ws_step64_probe")
    pass_ = load_benchmark("ws_ouro64_pass")
    fast, ref_model = small_model(torch.bfloat16), small_model(torch.float64)
    ref_model.set_attention_backend("torch")
    pool, meta = probe.decode_batch(fast.config, 9, 40, 0.0, seed=3, device="cpu")
    ref_pool = probe.decode_batch(fast.config, 9, 40, 0.0, seed=3, device="cpu")[0]
    ref_pool.k, ref_pool.v = pool.k.double(), pool.v.double()
    stack = layer_stack.stack_layers(fast)
    run = pass_.Ouro64Pass(pass_.stacked_weights(stack), stack.final_norm, stack.inv_freq, pool, 1, meta, 8,
                           DecodeConfig(32, 3, 1), fast.config.rms_norm_eps, 4, 4, 8)
    h = torch.randn(9, 512, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    run.h.copy_(h)
    for i, (kernel, grid, args, kwargs) in enumerate(run.launches()):
        pdl = {"USE_PDL": True} if kernel is ouro64.ws_ouro64_kernel else {"USE_PDL": 0}
        emulator.emulate(kernel, grid, *args, seed=i, check_global=True, **kwargs, **pdl)
    hm, d, n3, final = (t.detach().double() for t in run.readout_inputs())
    readout = rms(hm + rms(d, n3), final)
    with torch.no_grad():
        expected = ref_model.run_loops(h.double(), meta, ref_pool, 1, 1)[-1]
    assert rel(readout, expected) < 2e-2, rel(readout, expected)
    slots = meta.slots
    for layer in range(2):
        for got, want in zip(pool.plane(1, layer), ref_pool.plane(1, layer)):
            assert rel(got[slots], want[slots]) < 2e-2, layer


def test_every_launch_kind_compiles_for_sm90_at_ouro_1_4b():
    # o 32 + gate_up 64 + down 32 + qkv 32 wgmma (4 chunks x 8 a box); one PDL wait; within the H200's shared memory
    for (mlp, qkv), wgmma in {(True, True): 160, (False, True): 32, (True, False): 128}.items():
        built = ouro64.compile_for_sm90(mlp, qkv)
        assert built["wgmma"] == wgmma and built["gdc_wait"] == 1 and built["shared"] <= 232448, (mlp, qkv, built)
