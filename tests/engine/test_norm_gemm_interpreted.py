"""triton_norm_gemm's deferred add + norm against float64 references written from the math (OURO.md: h' = h +
rms(y) * w_branch, x = rms(h') * w_next, y = a @ w.T), in Triton's interpreter on the CPU (TRITON_INTERPRET=1,
where Triton is installed): linear_stats' y (split-K through the tile counters, which it must leave at zero,
and unsplit), PendingNorm.resolve, and the two consumers that compute x as they read it, gate_up + SiLU and qkv
+ RoPE + K / V store, with the h' they write. In float64 the one approximation (sum h'^2 from the row sums)
is exact, so the bound is the kernels' fp32 accumulation. On the GPU: tests/gpu/test_gpu_gemm.py."""

from __future__ import annotations

from tests.interpreter import run_interpreted

INTERPRETED = """
import math, torch
from engine import triton_gemm, triton_fused
from engine.triton_norm_gemm import linear_stats, counters, PendingNorm
from engine.gemm_dispatch import GemmConfig
torch.manual_seed(0)
def rms(x, w, eps): return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w
err = lambda a, b: float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-9))
eps = 1e-6
count = counters(torch.device("cpu"))
for rows, K, N, splits, block_n, block_k in [(3, 64, 48, 4, 16, 16), (9, 100, 40, 2, 16, 32), (20, 256, 64, 1, 32, 32), (1, 48, 16, 3, 16, 16)]:
    a = torch.randn(rows, K, dtype=torch.float64); w = torch.randn(N, K, dtype=torch.float64) / math.sqrt(K)
    h = torch.randn(rows, N, dtype=torch.float64)
    wa, wb = 1 + 0.2 * torch.randn(N, dtype=torch.float64), 1 + 0.2 * torch.randn(N, dtype=torch.float64)
    cfg = GemmConfig(block_n=block_n, block_k=block_k, block_n_gate=16)
    p = linear_stats(a, w, h, wa, wb, eps, splits, cfg, count)
    y = a @ w.T
    assert err(p.y, y) < 1e-5, (rows, err(p.y, y))
    assert not count.any()
    h_ref = h + rms(y, wa, eps); x_ref = rms(h_ref, wb, eps)
    h2, x2 = p.resolve()
    assert err(x2, x_ref) < 1e-5 and err(h2, h_ref) < 1e-5
    I = 24
    wg = torch.randn(2 * I, N, dtype=torch.float64) / math.sqrt(N)
    m, h3 = triton_gemm.gate_up_silu_normed(p, wg, cfg)
    g, u = x_ref @ wg[:I].T, x_ref @ wg[I:].T
    assert err(h3, h_ref) < 1e-5, err(h3, h_ref)
    assert err(m, g / (1 + torch.exp(-g)) * u) < 1e-5, err(m, g / (1 + torch.exp(-g)) * u)
# qkv normed
from engine.gemm_dispatch import qkv_block_d
for rows, Hq, Hkv, d, hidden, splits in [(5, 4, 2, 32, 64, 2), (17, 2, 1, 32, 48, 1)]:
    a = torch.randn(rows, hidden, dtype=torch.float64); w = torch.randn(hidden, hidden, dtype=torch.float64) / hidden**0.5
    h = torch.randn(rows, hidden, dtype=torch.float64)
    wa, wb = 1 + 0.2 * torch.randn(hidden, dtype=torch.float64), 1 + 0.2 * torch.randn(hidden, dtype=torch.float64)
    cfg = GemmConfig(block_n=16, block_k=16, block_d_qkv=16, block_k_qkv=16)
    p = linear_stats(a, w, h, wa, wb, eps, splits, cfg, count)
    y = a @ w.T; h_ref = h + rms(y, wa, eps); x_ref = rms(h_ref, wb, eps)
    wq = torch.randn((Hq + 2 * Hkv) * d, hidden, dtype=torch.float64) / hidden**0.5
    n_slots = 3 * rows + 4
    pos = torch.randint(0, 500, (rows,)); slots = torch.randperm(n_slots)[:rows]
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    kr, vr, k2, v2 = (torch.zeros(n_slots, Hkv, d, dtype=torch.float64) for _ in range(4))
    qr = triton_fused.rope_store_kv(x_ref @ wq.T, pos, slots, inv, kr, vr, Hq, Hkv, d)
    q2, h2 = triton_gemm.qkv_rope_store_normed(p, wq, pos, slots, inv, k2, v2, Hq, Hkv, d, cfg)
    assert err(h2, h_ref) < 1e-5 and err(q2, qr) < 1e-5 and err(k2, kr) < 1e-5 and err(v2, vr) < 1e-5, (err(q2, qr), err(k2, kr))
print("ok")
"""


def test_deferred_norm_gemms_match_float64_references_in_tritons_interpreter():
    run_interpreted(INTERPRETED)
