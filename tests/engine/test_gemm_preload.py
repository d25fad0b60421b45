"""The skinny GEMMs with their first weight blocks loaded before the PDL wait (GemmConfig.preload,
engine/triton_gemm.py) against float64 references written from the math (x @ w.T summed over the K splits;
silu(x @ gate.T) * (x @ up.T); q / k / v with RoPE), in Triton's interpreter on the CPU (where Triton is
installed) on fresh random inputs: preload 0, 1 and 2 over shapes whose splits are shorter than two blocks,
or whose K is not a multiple of the block, so a preloaded block past a split's end or past K must count as
zero. The order of the loads around the wait is checked in the sm90 PTX (tests/engine/test_pdl_ptx.py)."""

from __future__ import annotations

import pytest

from engine.gemm_dispatch import GemmConfig
from tests.interpreter import run_interpreted


def test_preload_is_0_1_or_2():
    for preload in (0, 1, 2):
        assert GemmConfig(preload=preload).preload == preload
    for bad in (-1, 3, 1.5):
        with pytest.raises(ValueError, match="GemmConfig.preload must be 0, 1 or 2"):
            GemmConfig(preload=bad)
    for bad in (-1, 2, 0.5):
        with pytest.raises(ValueError, match="GemmConfig.preload_qkv must be 0 or 1"):
            GemmConfig(preload_qkv=bad)


INTERPRETED = """
import math
import torch
from engine import triton_gemm
from engine.gemm_dispatch import GemmConfig

g = torch.Generator().manual_seed(0)
err = lambda a, b: float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-9))
# (rows, K, N, splits, block_k): one block per split (a preloaded 2nd block is past the split), K not a
# multiple of the block (a preloaded block past K), several blocks per split
for rows, K, N, splits, block_k in [(3, 64, 48, 4, 16), (9, 100, 40, 2, 32), (20, 256, 64, 2, 32), (1, 48, 16, 1, 64)]:
    x = torch.randn(rows, K, generator=g)
    w = torch.randn(N, K, generator=g) / math.sqrt(K)
    ref = x.double() @ w.double().T
    for preload in (0, 1, 2):
        cfg = GemmConfig(block_n=16, block_k=block_k, preload=preload)
        got = triton_gemm.linear_partials(x, w, splits, cfg).sum(0)
        assert err(got, ref) < 1e-5, (rows, K, splits, preload, err(got, ref))
    w2 = torch.randn(2 * N, K, generator=g) / math.sqrt(K)
    gate, up = x.double() @ w2[:N].double().T, x.double() @ w2[N:].double().T
    ref = gate / (1 + torch.exp(-gate)) * up
    for preload in (0, 1, 2):  # 2 is clamped to 1 for gate_up
        got = triton_gemm.gate_up_silu(x, w2, GemmConfig(block_n_gate=16, block_k=block_k, preload=preload))
        assert err(got, ref) < 1e-5, (rows, K, preload, err(got, ref))

def rope(t, pos, inv_freq):
    half = t.shape[-1] // 2
    angle = pos.double()[:, None, None] * inv_freq.double()[None, None, :]
    x1, x2 = t[..., :half].double(), t[..., half:].double()
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], -1)

for Hq, Hkv, d, hidden, rows, block_k in [(4, 2, 32, 96, 5, 64), (2, 1, 32, 40, 7, 32)]:
    x = torch.randn(rows, hidden, generator=g)
    w = torch.randn((Hq + 2 * Hkv) * d, hidden, generator=g) / hidden ** 0.5
    pos = torch.randint(0, 4000, (rows,), generator=g)
    slots = torch.randperm(3 * rows, generator=g)[:rows]
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    qkv = x.double() @ w.double().T
    q_ref = rope(qkv[:, :Hq * d].view(rows, Hq, d), pos, inv_freq)
    k_ref = rope(qkv[:, Hq * d:(Hq + Hkv) * d].view(rows, Hkv, d), pos, inv_freq)
    v_ref = qkv[:, (Hq + Hkv) * d:].view(rows, Hkv, d)
    for preload in (0, 1):
        k_plane, v_plane = torch.zeros(3 * rows, Hkv, d), torch.zeros(3 * rows, Hkv, d)
        cfg = GemmConfig(block_d_qkv=16, block_k_qkv=block_k, preload_qkv=preload)
        q = triton_gemm.qkv_rope_store(x, w, pos, slots, inv_freq, k_plane, v_plane, Hq, Hkv, d, cfg)
        # RoPE's fp32 angles at positions up to 4000 cost ~5e-5 of q and k (the same at preload 0)
        assert err(q, q_ref) < 2e-4 and err(k_plane[slots], k_ref) < 2e-4 and err(v_plane[slots], v_ref) < 1e-5
print("ok")
"""


def test_preloaded_blocks_match_float64_references_in_tritons_interpreter():
    run_interpreted(INTERPRETED)
