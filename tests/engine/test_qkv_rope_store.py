"""engine/triton_gemm.qkv_rope_store (the qkv GEMM with RoPE and the K / V store in its epilogue) against a
plain-torch reference written from the model description (q, k, v = x W^T split by heads; RoPE rotates each
head's halves by position x inv_freq; k and v land at the rows' slots, nothing else in the planes moves), in
Triton's interpreter on the CPU (TRITON_INTERPRET=1, where Triton is installed) on fresh random inputs, and
the dispatch rule that decides where it runs (gemm_dispatch.qkv_block_d). On the GPU: tests/gpu/test_gpu_gemm.py."""

from __future__ import annotations

import pytest

from engine.gemm_dispatch import GemmConfig, qkv_block_d
from tests.interpreter import run_interpreted


@pytest.mark.parametrize("block_d,head_dim,expected", [
    (0, 128, 0), (64, 128, 64), (32, 128, 32), (128, 128, 64), (16, 32, 16), (16, 16, 0), (64, 8, 0),
    (24, 128, 0), (32, 96, 0), (16, 96, 16), (64, 127, 0)])
def test_where_the_fused_qkv_runs(block_d, head_dim, expected):
    """A power of two of at least 16 (tl.dot's tile) that splits the half head evenly, capped at the half;
    else 0: cuBLAS + the RoPE kernel. (96: half 48 is split by 16, not by 32.)"""
    assert qkv_block_d(GemmConfig(block_d_qkv=block_d), head_dim) == expected
    assert qkv_block_d(None, head_dim) == 0


INTERPRETED = """
import torch
from engine import triton_gemm
from engine.gemm_dispatch import GemmConfig
from tests.oracle import qkv_inputs_cpu, qkv_rope_reference

g = torch.Generator().manual_seed(0)
# tma (GemmConfig.tma): 0 pointer loads, 1 the weights through a TMA descriptor, 2 the activations too
for Hq, Hkv, d, hidden, rows, block_d, block_k, tma in [
        (4, 2, 32, 96, 5, 16, 64, 0), (2, 2, 64, 64, 17, 32, 128, 0), (4, 1, 32, 80, 70, 16, 32, 0),
        (2, 1, 64, 320, 9, 32, 256, 0), (4, 2, 32, 96, 5, 16, 64, 2), (4, 1, 32, 80, 70, 16, 32, 2),
        (2, 1, 64, 320, 9, 32, 256, 1)]:
    x, w, pos, slots, inv_freq, k_plane, v_plane = qkv_inputs_cpu(g, rows, Hq, Hkv, d, hidden)
    cfg = GemmConfig(block_d_qkv=block_d, block_k_qkv=block_k, tma=tma)
    q = triton_gemm.qkv_rope_store(x, w, pos, slots, inv_freq, k_plane, v_plane, Hq, Hkv, d, cfg)
    q_ref, k_ref, v_ref = qkv_rope_reference(x, w, pos, inv_freq, Hq, Hkv, d)
    err = lambda a, b: float((a.double() - b).abs().max())
    assert q.shape == (rows, Hq, d) and err(q, q_ref) < 1e-3, err(q, q_ref)
    assert err(k_plane[slots], k_ref) < 1e-3 and err(v_plane[slots], v_ref) < 1e-3
    rest = torch.ones(k_plane.shape[0], dtype=torch.bool)
    rest[slots] = False
    assert not k_plane[rest].any() and not v_plane[rest].any()  # no other slot written
print("ok")
"""


def test_the_kernel_matches_a_float64_reference_in_tritons_interpreter():
    run_interpreted(INTERPRETED)
