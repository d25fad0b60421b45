"""benchmarks/norm_chain_probe.py's kernels in Triton's interpreter (where Triton is installed; CI installs it) against
the layer's math in float64: the producer's y and row sums, then the add + norm carried into gate_up + SiLU and into
qkv + RoPE + the key / value store, the new residual included; the stacked way's producer (A1, A2; the residual
formed from the chain before's), gate_up and qkv; rows below the 64-row tile too."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark
from tests.interpreter import run_interpreted

INTERPRETED = """
import torch
from tests.benchmark_scripts import load_benchmark
probe = load_benchmark("norm_chain_probe")
g = torch.Generator().manual_seed(3)
def rms(v):
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + probe.EPS)
def err(got, want):
    return float((got.double() - want).norm() / want.norm())
for rows, k_in, hidden, inter, producer in [(64, 256, 256, 128, (16, 128)), (9, 384, 256, 64, (32, 128)),
                                           (33, 512, 256, 64, (16, 256))]:
    a, h = torch.randn(rows, k_in, generator=g), torch.randn(rows, hidden, generator=g)
    w_o = torch.randn(hidden, k_in, generator=g) / k_in ** 0.5
    wa, wb = 1 + 0.1 * torch.randn(hidden, generator=g), 1 + 0.1 * torch.randn(hidden, generator=g)
    y = a.double() @ w_o.double().T
    h_new = h.double() + rms(y) * wa.double()
    x = rms(h_new) * wb.double()
    p = probe.stats(a, w_o, h, wa, *producer)
    assert err(p["y"], y) < 1e-5
    w_gu = torch.randn(2 * inter, hidden, generator=g) / hidden ** 0.5
    gate, up = x @ w_gu[:inter].double().T, x @ w_gu[inter:].double().T
    out, h_out = probe.normed_gate(p, wa, wb, w_gu)
    assert err(out, gate / (1 + torch.exp(-gate)) * up) < 1e-5 and err(h_out, h_new) < 1e-5, "gate"
    s = probe.stacked_stats(a, w_o, h, wa, wb, *producer)
    assert err(s["y"], y) < 1e-5 and err(s["ab"][:rows], h.double() * wb.double()) < 1e-5, "A1"
    assert err(s["ab"][64:64 + rows], y * wa.double() * wb.double()) < 1e-5, "A2"
    assert err(probe.stacked_gate(s, w_gu), gate / (1 + torch.exp(-gate)) * up) < 1e-5, "stacked gate"
    nq, nkv, hd = 2, 1, 128
    w_qkv = torch.randn((nq + 2 * nkv) * hd, hidden, generator=g) / hidden ** 0.5
    pos = torch.randint(0, 500, (rows,), generator=g, dtype=torch.int32)
    slots = torch.randperm(80, generator=g)[:rows].to(torch.int32)
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    kp, vp = torch.zeros(80, nkv, hd), torch.zeros(80, nkv, hd)
    q, h_out = probe.normed_qkv(p, wa, wb, w_qkv, pos, slots, inv, kp, vp, nq, nkv, hd)
    qkv = (x @ w_qkv.double().T).view(rows, nq + 2 * nkv, hd)
    ang = pos.double()[:, None, None] * inv.double()[None, None, :]
    x1, x2 = qkv[..., :hd // 2], qkv[..., hd // 2:]
    rot = torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)
    assert err(q, rot[:, :nq]) < 1e-5 and err(h_out, h_new) < 1e-5, "q"
    assert err(kp[slots.long()], rot[:, nq:nq + nkv]) < 1e-5 and err(vp[slots.long()], qkv[:, nq + nkv:]) < 1e-5
    kp.zero_(), vp.zero_()
    q = probe.stacked_qkv(s, w_qkv, pos, slots, inv, kp, vp, nq, nkv, hd)
    assert err(q, rot[:, :nq]) < 1e-5, "stacked q"
    assert err(kp[slots.long()], rot[:, nq:nq + nkv]) < 1e-5 and err(vp[slots.long()], qkv[:, nq + nkv:]) < 1e-5
    # the next chain (down -> qkv): its producer first forms the residual h_new from the chain before's y and sums
    a2, w_down = torch.randn(rows, 512, generator=g), torch.randn(hidden, 512, generator=g) / 512 ** 0.5
    wc, wd = 1 + 0.1 * torch.randn(hidden, generator=g), 1 + 0.1 * torch.randn(hidden, generator=g)
    s2 = probe.stacked_stats(a2, w_down, h, wc, wd, *producer, prev={"y": s["y"], "stats": s["stats"], "wa": wa})
    assert err(s2["h"], h_new) < 1e-5, "the residual"
    x2 = rms(h_new + rms(a2.double() @ w_down.double().T) * wc.double()) * wd.double()
    qkv2 = (x2 @ w_qkv.double().T).view(rows, nq + 2 * nkv, hd)
    x1, x2 = qkv2[..., :hd // 2], qkv2[..., hd // 2:]
    rot2 = torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)
    assert err(probe.stacked_qkv(s2, w_qkv, pos, slots, inv, kp, vp, nq, nkv, hd), rot2[:, :nq]) < 1e-5, "q2"
print("ok")
"""


def test_the_norm_chain_probe_matches_the_layer_in_float64_in_tritons_interpreter():
    run_interpreted(INTERPRETED)


def test_the_producer_refuses_shapes_its_tiles_do_not_divide():
    probe = load_benchmark("norm_chain_probe")
    torch = pytest.importorskip("torch")
    a, w, h = torch.zeros(8, 200), torch.zeros(64, 200), torch.zeros(8, 64)
    with pytest.raises(ValueError, match="K=200 by block_k=128"):
        probe.stats(a, w, h, torch.ones(64))


def test_the_probe_refuses_unknown_chains_and_shallow_pipelines(capsys):
    probe = load_benchmark("norm_chain_probe")
    for argv, field in ((["--ops", "gate,down"], "--ops"), (["--stages", "1"], "--stages"),
                        (["--stages", "3,x"], "--stages")):
        with pytest.raises(SystemExit):
            probe.main(["--out", "/nonexistent", *argv])
        assert f"{field} must be a comma list" in capsys.readouterr().err


def test_the_table_marks_wrong_outputs_and_leaves_the_carried_ways_norm_empty():
    probe = load_benchmark("norm_chain_probe")
    base = {"stages": 3, "err": 2e-3, "chain_us": 27.7, "producer_us": 5.7, "consumer_us": 20.1}
    rows = [{**base, "op": "gate", "way": "today", "ok": True, "norm_us": 2.22},
            {**base, "op": "qkv", "way": "carried, producer 16x128", "ok": False, "norm_us": 0.0}]
    lines = probe.markdown(rows).splitlines()
    assert len(lines) == 4 and lines[0].count("|") == lines[2].count("|") == lines[3].count("|")
    assert lines[2].startswith("| o -> gate_up | today | 3 | 27.70 |") and "| 2.22 |" in lines[2]
    assert lines[3].startswith("| down -> qkv | carried, producer 16x128 | 3 | 27.70 WRONG |") and "| - |" in lines[3]


def test_the_stacked_consumer_compiles_for_sm90_with_wgmma_and_tma_in_the_cards_shared_memory():
    triton = pytest.importorskip("triton")  # where Triton is installed (CI installs it); no GPU needed
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from benchmarks import norm_chain_kernels as nk

    types = {"ab_desc": "tensordesc<bf16[128, 128]>", "w_desc": "tensordesc<bf16[64, 128]>", "stats_ptr": "*fp32",
             "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "n_tiles": "i32", "eps": "fp32"}
    constexprs = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "TILES": 128, "USE_PDL": True}
    signature = {**types, **{k: "constexpr" for k in constexprs}}
    attrs = {(list(signature).index(n),): [["tt.divisibility", 16]] for n in ("stats_ptr", "out_ptr", "N", "K")}
    compiled = triton.compile(ASTSource(nk.stacked_gate_kernel, signature=signature, constexprs=constexprs,
                                        attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=8, num_stages=3))
    ptx = compiled.asm["ptx"]
    assert compiled.metadata.shared <= 232_448, compiled.metadata.shared  # an H100's / H200's per-block limit
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "st.local" not in ptx
