"""engine/gluon_layers64.py's launch (Ouro's decode layer between two attention calls at up to 64 rows: o, the
sandwich norms, SiLU x up, down, the next layer's qkv with RoPE and the key / value store) and engine/layers64.py's
loop pass of them, run on the CPU by tests/gluon_emulator.py against float64: a reference written here from the
model's description (engine/model.py's OuroDecoderLayer.run, RotaryEmbedding's rotate-half RoPE) for each launch
kind, and the engine model's own float64 pass for a whole loop. Where Triton is installed (CI installs it). Proxy fences
are checked too; acquire / release ordering on the GPU only (tests/gpu/test_gpu_gluon_layers64.py)."""

from __future__ import annotations

import pytest
import torch

from tests.benchmark_scripts import load_benchmark

pytest.importorskip("triton.experimental.gluon")
emulator = pytest.importorskip("tests.gluon_emulator")
from engine import gluon_layers64, layers64  # noqa: E402
from engine.layer_stack import LayerStack  # noqa: E402

D, EPS, SLOTS, TOL, CTAS = 128, 1e-6, 300, 2e-2, 8


def rms(x, n):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * n


def rope(x, pos, inv_freq):
    # x: [rows, heads, D] float64; NeoX rotate-half, angles pos x inv_freq repeated over both halves
    ang = pos.double()[:, None] * inv_freq.double()[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


class Layers:
    """A LayerStack of random weights (`layers` layers, hidden hq x D, intermediate `inter`), a launch's rows and
    KV planes at `m` rows, and one launch run on them (K ranges of 128 columns: 4 and inter / 128 splits)."""

    def __init__(self, m: int, inter: int, layers: int, seed: int, hq: int = 4) -> None:
        g = torch.Generator().manual_seed(seed)
        self.hq, self.h, self.m, self.inter = hq, hq * D, m, inter
        h, self.qkv = self.h, 3 * self.h

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

        norms = (1 + 0.1 * torch.randn(4, layers, h, generator=g)).to(torch.bfloat16)
        self.inv_freq = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
        self.stack = LayerStack(randn(layers * self.qkv, h, scale=h**-0.5), randn(layers * h, h, scale=h**-0.5),
                                randn(layers * 2 * inter, h, scale=h**-0.5),
                                randn(layers * h, inter, scale=inter**-0.5),
                                norms, randn(h), self.inv_freq, layers)
        self.rows = {"h": randn(m, h), "h_out": torch.zeros(m, h, dtype=torch.bfloat16),
                     "q": torch.zeros(m, hq * D, dtype=torch.bfloat16)}
        self.a = randn(m, h)
        self.kv = (randn(SLOTS, hq, D), randn(SLOTS, hq, D))
        self.kv_before = tuple(t.clone() for t in self.kv)
        self.pos = torch.randint(0, 4000, (m,), generator=g)
        self.slots = torch.randperm(SLOTS, generator=g)[:m]

    def run(self, layer: int, has_mlp: bool, has_qkv: bool, seed: int = 0, slow: float = 0.0,
            arrive_lag: tuple[int, float] | None = None):
        sc = layers64.Scratch64(self.stack, CTAS, k_range=self.h // 4)
        sc.a[:self.m] = self.a
        args, kwargs = layers64.layer_args(self.stack, sc, 0, layer, self.rows, self.kv,
                                           (self.pos, self.slots, self.inv_freq), EPS, has_mlp, has_qkv)
        emulator.emulate(gluon_layers64.layers64_kernel, CTAS, *args, seed=seed, check_global=True, slow=slow,
                         arrive_lag=arrive_lag, USE_PDL=True, **kwargs)
        return sc

    def weight(self, name: str, layer: int, rows: int) -> torch.Tensor:
        return getattr(self.stack, name)[layer * rows:(layer + 1) * rows].double()

    def norm(self, k: int, layer: int) -> torch.Tensor:
        return self.stack.norms[k][layer].double()

    def mlp_reference(self, layer: int) -> dict:
        h, a = self.rows["h"].double(), self.a.double()
        o = a @ self.weight("wo", layer, self.h).T
        hm = h + rms(o, self.norm(1, layer))
        x = rms(hm, self.norm(2, layer))
        gu = x @ self.weight("wgu", layer, 2 * self.inter).T
        gate, up = gu[:, :self.inter], gu[:, self.inter:]
        act = gate * torch.sigmoid(gate) * up
        d = act @ self.weight("wd", layer, self.h).T
        return {"o": o, "hm": hm, "act": act, "d": d, "h_out": hm + rms(d, self.norm(3, layer))}

    def qkv_reference(self, h: torch.Tensor, layer: int) -> dict:
        hq = self.hq
        qkv = (rms(h, self.norm(0, layer)) @ self.weight("wq", layer, self.qkv).T).view(self.m, 3 * hq, D)
        q, k, v = qkv[:, :hq], qkv[:, hq:2 * hq], qkv[:, 2 * hq:]
        return {"q": rope(q, self.pos, self.inv_freq), "k": rope(k, self.pos, self.inv_freq), "v": v}

    def qkv_errors(self, ref: dict) -> dict:
        got = {"q": self.rows["q"].view(self.m, self.hq, D), "k": self.kv[0][self.slots], "v": self.kv[1][self.slots]}
        return {name: rel(got[name], ref[name]) for name in got}

    def untouched_slots(self) -> bool:
        others = torch.ones(SLOTS, dtype=torch.bool)
        others[self.slots] = False
        return all(torch.equal(t[others], b[others]) for t, b in zip(self.kv, self.kv_before))


@pytest.mark.parametrize("m,hq,inter,seed", [(64, 4, 1024, 0), (37, 8, 2048, 1)])
def test_a_layer_between_two_attentions_matches_float64(m, hq, inter, seed):
    # the MLP of layer 0 and the qkv of layer 1 on 8 CTAs (2 groups: a head's halves in different groups, so the
    # qkv sums wait for their partner; half of the CTAs lagging), K a CTA in 1 or 2 chunks of 128
    lay = Layers(m, inter, 2, seed, hq)
    sc = lay.run(0, True, True, seed, slow=0.005)
    ref = lay.mlp_reference(0)
    got = {"o": sc.o[:m], "hm": sc.hm[:m], "act": sc.act[:m], "d": sc.d[:m], "h_out": lay.rows["h_out"]}
    errors = {name: rel(got[name], ref[name]) for name in got}
    errors.update(lay.qkv_errors(lay.qkv_reference(ref["h_out"], 1)))
    assert max(errors.values()) < TOL, errors
    assert lay.untouched_slots()


def test_the_stager_signals_a_phase_only_after_its_row_sums_are_stored():
    # the stager (partition 2) sleeping after each of its chunk signals: the group sums of the gate_up and qkv phases
    # read every K range's row sums of squares, so a stager that stored them after its last signal (as it once did:
    # a flake under load) lets a group sum a scale from rows not yet written
    lay = Layers(64, 1024, 2, 4)
    sc = lay.run(0, True, True, arrive_lag=(2, 0.3))
    ref = lay.mlp_reference(0)
    got = {"o": sc.o[:64], "hm": sc.hm[:64], "act": sc.act[:64], "d": sc.d[:64], "h_out": lay.rows["h_out"]}
    errors = {name: rel(got[name], ref[name]) for name in got}
    errors.update(lay.qkv_errors(lay.qkv_reference(ref["h_out"], 1)))
    assert max(errors.values()) < TOL, errors


def test_a_passs_first_launch_is_the_first_layers_qkv():
    lay = Layers(50, 1024, 2, 7)
    h_out = lay.rows["h_out"].clone()
    lay.run(-1, False, True)
    errors = lay.qkv_errors(lay.qkv_reference(lay.rows["h"].double(), 0))
    assert max(errors.values()) < TOL, errors
    assert torch.equal(lay.rows["h_out"], h_out) and lay.untouched_slots()  # no residual to add: h_out untouched


def test_a_passs_last_launch_ends_at_down():
    lay = Layers(64, 1024, 2, 9)
    q = lay.rows["q"].clone()
    sc = lay.run(1, True, False)
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
        lay.run(0, True, True, seed=seed, slow=slow)
        outs.append((lay.rows["h_out"].clone(), lay.rows["q"].clone(), lay.kv[0].clone()))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_a_loop_pass_of_launches_matches_the_models_float64_pass():
    # layers64.pass_launches: layer 0's qkv, then per layer the engine's decode attention and a layer launch; the
    # readout's add + norm (Triton's kernel on the GPU) in torch here: against the model's float64 torch path over
    # the same pool, the readout and every layer's new keys and values; 9 requests of 40 positions, scattered pages
    from engine import layer_stack
    from engine.attention_dispatch import DecodeConfig

    probe = load_benchmark("ws_step64_probe")
    # the engine's model at hidden 512 (4 heads of 128), intermediate 1024, 2 layers: the same random weights twice
    fast, ref_model = (probe.engine_model(2, "cpu", 4, 1024, dtype, "torch", seed=4)
                       for dtype in (torch.bfloat16, torch.float64))
    pool, meta = probe.decode_batch(fast.config, 9, 40, 0.0, seed=3, device="cpu")
    ref_pool = probe.decode_batch(fast.config, 9, 40, 0.0, seed=3, device="cpu")[0]
    ref_pool.k, ref_pool.v = pool.k.double(), pool.v.double()
    stack = layer_stack.stack_layers(fast)
    sc = layers64.Scratch64(stack, CTAS, k_range=128)
    h = torch.randn(9, 512, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    launches, _ = layers64.pass_launches(stack, sc, h, pool, 1, meta, EPS, CTAS, DecodeConfig(32, 3, 1))
    for i, (kernel, grid, args, kwargs) in enumerate(launches):
        pdl = {"USE_PDL": True} if kernel is gluon_layers64.layers64_kernel else {"USE_PDL": 0}
        emulator.emulate(kernel, grid, *args, seed=i, check_global=True, **kwargs, **pdl)
    hm, d, n3, final = (t.detach().double() for t in layers64.readout_inputs(stack, sc, 9))
    readout = rms(hm + rms(d, n3), final)
    with torch.no_grad():
        expected = ref_model.run_loops(h.double(), meta, ref_pool, 1, 1)[-1]
    assert rel(readout, expected) < TOL, rel(readout, expected)
    for layer in range(2):
        for got, want in zip(pool.plane(1, layer), ref_pool.plane(1, layer)):
            assert rel(got[meta.slots], want[meta.slots]) < TOL, layer


def test_every_launch_kind_compiles_for_sm90_at_ouro_1_4b():
    # o 32 + gate_up 64 + down 32 + qkv 32 wgmma (4 chunks x 8 a box); one PDL wait; within the H200's shared memory
    for (mlp, qkv), wgmma in {(True, True): 160, (False, True): 32, (True, False): 128}.items():
        built = compile_for_sm90(mlp, qkv)
        assert built["wgmma"] == wgmma and built["gdc_wait"] == 1 and built["shared"] <= 232448, (mlp, qkv, built)


def compile_for_sm90(has_mlp: bool, has_qkv: bool) -> dict:
    """layers64_kernel compiled for sm90 at Ouro-1.4B's shape without a GPU (benchmarks/ws_chain.compile_sm90)."""
    from triton.experimental.gluon import language as gl

    h, inter, heads, layers = 2048, 5632, 16, 24
    layout = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    box = f"tensordesc<bf16[64, 128],{layout!r}>"
    signature = {name: box for name in ("wo", "wgu", "wd", "wq", "a_desc", "act_desc")}
    pointers = ("h_ptr", "h_out_ptr", "hm_ptr", "o_ptr", "d_ptr", "act_ptr", "n_ptr", "q_ptr", "k_ptr", "v_ptr")
    signature.update({name: "*bf16" for name in pointers})
    floats = ("osq_ptr", "dsq_ptr", "inv_freq_ptr", "part_ptr", "rowsq_ptr")
    signature.update({name: "*fp32" for name in floats})
    signature.update(pos_ptr="*i64", slot_ptr="*i64", cnt_ptr="*i32", gcnt_ptr="*i32", layer="i32", M="i32",
                     eps="fp32")
    constexprs = dict(H=h, QKV=3 * h, INTER=inter, HQ=heads, HKV=heads, D=D, LAYERS=layers, PW=max(3 * h, 2 * inter),
                      S_IN=4, S_DOWN=11, STAGES=8, HAS_MLP=has_mlp, HAS_QKV=has_qkv, USE_PDL=True, num_warps=4)
    aligned = tuple(n for n in (*pointers, *floats) if n != "inv_freq_ptr")
    return load_benchmark("ws_chain").compile_sm90(gluon_layers64.layers64_kernel, dict(signature), constexprs,
                                                   aligned)
