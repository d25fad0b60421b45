"""engine/triton_norm_gemm.py's kernels in Triton's interpreter (where Triton is installed; CI has none) against the
layer's math in float64: the producer's y and row sums, then the add + norm carried into gate_up + SiLU and into
qkv + RoPE + the key / value store, the new residual included; three producer tiles, rows below the 64-row tile too,
one consumer program writing every block of the new residual. `carries`' rule and the producer's refusals on the
host. The kernels on the GPU: tests/gpu/test_gpu_norm_gemm.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.gemm_dispatch import GemmConfig, carry_fits, gemm_config
from engine.pending_norm import carries
from tests.interpreter import run_interpreted

INTERPRETED = """
from dataclasses import replace
import torch
from engine import triton_norm_gemm as tn
from engine.gemm_dispatch import gemm_config
EPS = 1e-6
g = torch.Generator().manual_seed(3)
def rms(v):
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS)
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
    cfg = replace(gemm_config(64), carry_block_n=producer[0], carry_block_k=producer[1], carry_stages=3)
    p = tn.linear_stats(a, w_o, h, wa, wb, EPS, cfg)
    assert err(p.y, y) < 1e-5
    w_gu = torch.randn(2 * inter, hidden, generator=g) / hidden ** 0.5
    gate, up = x @ w_gu[:inter].double().T, x @ w_gu[inter:].double().T
    out, h_out = tn.gate_up_silu_normed(p, w_gu, cfg)
    assert err(out, gate / (1 + torch.exp(-gate)) * up) < 1e-5 and err(h_out, h_new) < 1e-5, "gate"
    nq, nkv, hd = 2, 1, 128
    w_qkv = torch.randn((nq + 2 * nkv) * hd, hidden, generator=g) / hidden ** 0.5
    pos = torch.randint(0, 500, (rows,), generator=g, dtype=torch.int32)
    slots = torch.randperm(80, generator=g)[:rows].to(torch.int32)
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    kp, vp = torch.zeros(80, nkv, hd), torch.zeros(80, nkv, hd)
    q, h_out = tn.qkv_rope_store_normed(p, w_qkv, pos, slots, inv, kp, vp, nq, nkv, hd, cfg)
    qkv = (x @ w_qkv.double().T).view(rows, nq + 2 * nkv, hd)
    ang = pos.double()[:, None, None] * inv.double()[None, None, :]
    x1, x2 = qkv[..., :hd // 2], qkv[..., hd // 2:]
    rot = torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)
    assert err(q, rot[:, :nq]) < 1e-5 and err(h_out, h_new) < 1e-5, "q"
    assert err(kp[slots.long()], rot[:, nq:nq + nkv]) < 1e-5 and err(vp[slots.long()], qkv[:, nq + nkv:]) < 1e-5
print("ok")
"""


def test_the_carried_add_norm_matches_the_layer_in_float64_in_tritons_interpreter():
    run_interpreted(INTERPRETED)


def test_the_producer_refuses_shapes_its_tiles_do_not_divide_and_rows_past_one_tile():
    tn = pytest.importorskip("engine.triton_norm_gemm")
    cfg = gemm_config(64)
    w, ones = torch.zeros(64, 200), torch.ones(64)
    with pytest.raises(ValueError, match="K=200 by carry_block_k=128"):
        tn.linear_stats(torch.zeros(8, 200), w, torch.zeros(8, 64), ones, ones, 1e-6, cfg)
    with pytest.raises(ValueError, match="rows=65 be 1-64"):
        tn.linear_stats(torch.zeros(65, 256), torch.zeros(64, 256), torch.zeros(65, 64), ones, ones, 1e-6, cfg)


def test_carries_only_where_the_config_asks_for_one_row_tile_its_tiles_divide():
    on = replace(GemmConfig(), carry_norm=True)
    assert carry_fits(on, 64, (2048, 5632)) and carry_fits(on, 1, (2048, 2048))
    assert not carry_fits(GemmConfig(), 64, (2048, 2048))  # off in the config
    assert not carry_fits(None, 64, (2048, 2048))  # the cuBLAS path
    assert not carry_fits(on, 65, (2048, 2048)) and not carry_fits(on, 0, (2048, 2048))  # not one row tile
    assert not carry_fits(on, 64, (2040, 2048)) and not carry_fits(on, 64, (2048, 2000))  # tiles do not divide
    assert carry_fits(replace(on, carry_block_k=256), 64, (2048, 5632))
    assert not carry_fits(replace(on, carry_block_k=256), 64, (2048, 5760))
    assert not carries(on, torch.zeros(8, 2048), torch.zeros(2048, 2048))  # a CPU call: no TMA to read with
