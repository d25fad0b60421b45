"""benchmarks/prefetch_kernels.py's warp-specialized GEMMs (gate_up + SiLU, qkv + RoPE + store, weights loaded
from launch) run on the CPU by tests/gluon_emulator.py (every CTA and partition a thread, TMA copies landing late and
out of order) against float64 references written here from the model's math, on fresh random inputs and several
shapes. Where Triton is installed (CI installs it)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")
emulator = pytest.importorskip("tests.gluon_emulator")

from tests.benchmark_scripts import load_benchmark  # noqa: E402

pk = load_benchmark("prefetch_kernels")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def bf(g: torch.Generator, *shape, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("rows,inter,k,bn,stages,prefetch", [(64, 128, 512, 64, 4, True), (37, 256, 384, 64, 8, False),
                                                              (9, 64, 768, 32, 4, True)])
def test_gate_up_silu_against_float64(rows, inter, k, bn, stages, prefetch):
    g = torch.Generator().manual_seed(rows * 7 + inter)
    x, w = bf(g, rows, k), bf(g, 2 * inter, k, scale=k ** -0.5)
    out = torch.full((rows, inter), float("nan"), dtype=torch.bfloat16)
    grid, args, constexprs = pk.gate_launch(x, w, out, bn=bn, stages=stages, x_stages=2, prefetch=prefetch)
    emulator.emulate(pk.pair_gemm_kernel, grid, *args, seed=rows, **constexprs)
    gate, up = x.double() @ w[:inter].double().T, x.double() @ w[inter:].double().T
    want = torch.nn.functional.silu(gate) * up
    assert rel(out, want) < 1e-2, rel(out, want)


def rope_ref(y: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    # y [rows, heads, D] float64; NeoX rotate-half with angles pos x inv_freq over both halves
    half = y.shape[-1] // 2
    ang = pos.double()[:, None] * inv_freq.double()[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    return y * cos + torch.cat([-y[..., half:], y[..., :half]], -1) * sin


@pytest.mark.parametrize("rows,hq,hkv,d,bd,prefetch", [(64, 2, 1, 32, 16, True), (21, 3, 3, 64, 16, False),
                                                        (5, 2, 2, 32, 16, True)])
def test_qkv_rope_store_against_float64(rows, hq, hkv, d, bd, prefetch):
    g = torch.Generator().manual_seed(rows * 11 + hq)
    k, slots_total = 640, 3 * rows + 5
    x, w = bf(g, rows, k), bf(g, (hq + 2 * hkv) * d, k, scale=k ** -0.5)
    pos = torch.randint(0, 4000, (rows,), generator=g, dtype=torch.int32)
    slots = torch.randperm(slots_total, generator=g)[:rows].to(torch.int32)
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    k_plane, v_plane = torch.zeros(slots_total, hkv, d, dtype=torch.bfloat16), torch.zeros(slots_total, hkv, d,
                                                                                             dtype=torch.bfloat16)
    q = torch.full((rows, hq, d), float("nan"), dtype=torch.bfloat16)
    grid, args, constexprs = pk.qkv_launch(x, w, q, (pos, slots, inv_freq, k_plane, v_plane), hq, hkv, bd=bd,
                                           stages=4, x_stages=2, prefetch=prefetch)
    emulator.emulate(pk.pair_gemm_kernel, grid, *args, seed=rows, **constexprs)
    y = (x.double() @ w.double().T).view(rows, hq + 2 * hkv, d)
    want_q, want_k = rope_ref(y[:, :hq], pos, inv_freq), rope_ref(y[:, hq:hq + hkv], pos, inv_freq)
    assert rel(q, want_q) < 1e-2, rel(q, want_q)
    assert rel(k_plane[slots.long()], want_k) < 1e-2
    assert rel(v_plane[slots.long()], y[:, hq + hkv:]) < 1e-2
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots.long()] = False
    assert not k_plane[untouched].any() and not v_plane[untouched].any()  # only the rows' slots written


@pytest.mark.parametrize("rows,n,k,splits,bn,stages,prefetch", [(64, 128, 1024, 4, 64, 4, True),
                                                                (23, 64, 768, 2, 32, 2, False),
                                                                (7, 192, 512, 1, 64, 3, True)])
def test_linear_partials_sum_to_float64(rows, n, k, splits, bn, stages, prefetch):
    g = torch.Generator().manual_seed(rows + n + splits)
    x, w = bf(g, rows, k), bf(g, n, k, scale=k ** -0.5)
    out = torch.full((splits, rows, n), float("nan"))
    grid, args, constexprs = pk.partials_launch(x, w, out, splits, bn=bn, stages=stages, x_stages=2,
                                                prefetch=prefetch)
    emulator.emulate(pk.partials_kernel, grid, *args, seed=rows, **constexprs)
    ks = k // splits
    for s in range(splits):  # each split's partial is its own K range's product
        want = x[:, s * ks:(s + 1) * ks].double() @ w[:, s * ks:(s + 1) * ks].double().T
        assert rel(out[s], want) < 1e-5, s


def test_bad_shapes_are_refused_with_the_field():
    x, w = torch.zeros(65, 128, dtype=torch.bfloat16), torch.zeros(256, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows <= 64"):
        pk.gate_launch(x, w, torch.empty(65, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="K=128 must split into splits=2"):
        pk.partials_launch(x[:8], w, torch.empty(2, 8, 256), 2)
    with pytest.raises(ValueError, match="stages and x_stages must be >= 2"):
        pk.partials_launch(x[:8], w, torch.empty(1, 8, 256), 1, stages=1)
    for stages, x_stages in ((3, 2), (2, 2), (4, 1)):  # odd, one K step of boxes (a deadlock), one activation box
        with pytest.raises(ValueError, match="stages must be even and >= 4"):
            pk.gate_launch(x[:8], w, torch.empty(8, 128, dtype=torch.bfloat16), stages=stages, x_stages=x_stages)
    with pytest.raises(TypeError, match="bfloat16"):
        pk.gate_launch(x[:8].float(), w, torch.empty(8, 128))


@pytest.mark.parametrize("kind,bn,half,stages", [(0, 64, 1, 8), (1, 16, 64, 12)])
def test_compiled_for_sm90_the_weight_loader_skips_the_wait_and_the_rings_fit(kind, bn, half, stages):
    # Ouro-1.4B's launches: with prefetch only the activation loader waits (one griddepcontrol.wait), without it
    # both; the rings fit an sm90 SM (gate_up one CTA an SM, qkv two)
    from triton.experimental.gluon import language as gl

    ws_chain = load_benchmark("ws_chain")
    w_layout = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.bfloat16)
    x_layout = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    signature = {"w_desc": f"tensordesc<bf16[{bn}, 128],{w_layout!r}>",
                 "x_desc": f"tensordesc<bf16[64, 128],{x_layout!r}>", "out_ptr": "*bf16", "pos_ptr": "*i32",
                 "slot_ptr": "*i32", "inv_freq_ptr": "*fp32", "k_ptr": "*bf16", "v_ptr": "*bf16", "stride_slot": "i32",
                 "stride_head": "i32", "M": "i32", "N": "i32"}
    got = {}
    for prefetch in (1, 0):
        constexprs = {"K": 2048, "HALF": half, "HQ": 16, "HKV": 16, "BN": bn, "KIND": kind, "STAGES": stages,
                      "X_STAGES": 4, "PREFETCH": prefetch, "USE_PDL": 1, "num_warps": 4}
        got[prefetch] = ws_chain.compile_sm90(pk.pair_gemm_kernel, signature, constexprs, ("out_ptr", "k_ptr", "v_ptr"))
    assert got[1]["gdc_wait"] == 1 and got[0]["gdc_wait"] == 2
    assert got[1]["wgmma"] == got[0]["wgmma"] > 0 and got[1]["tma_loads"] >= 2
    assert got[1]["shared"] <= (227 if kind == 0 else 113) * 1024


def test_compiled_for_sm90_the_partials_weight_loader_skips_the_wait():
    # down_proj's launch at Ouro-1.4B's shape (K 5,632 in 4 splits of 11 steps): one griddepcontrol.wait with the
    # weights from launch, two without; one CTA an SM
    from triton.experimental.gluon import language as gl

    ws_chain = load_benchmark("ws_chain")
    layout = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    box = f"tensordesc<bf16[64, 128],{layout!r}>"
    signature = {"w_desc": box, "x_desc": box, "out_ptr": "*fp32", "M": "i32", "N": "i32"}
    got = {prefetch: ws_chain.compile_sm90(pk.partials_kernel, signature,
                                           {"KS": 1408, "BN": 64, "STAGES": 8, "X_STAGES": 4, "PREFETCH": prefetch,
                                            "USE_PDL": 1, "num_warps": 4}, ("out_ptr",))
           for prefetch in (1, 0)}
    assert got[1]["gdc_wait"] == 1 and got[0]["gdc_wait"] == 2 and got[1]["wgmma"] > 0
    assert got[1]["shared"] <= 227 * 1024
