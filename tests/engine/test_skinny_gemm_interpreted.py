"""engine/triton_gemm's split-K partials (o_proj, down_proj) and gate_up + SiLU against float64 references
written from the math (x @ w.T summed over the K splits; silu(x @ gate.T) * (x @ up.T)), in Triton's
interpreter on the CPU (TRITON_INTERPRET=1, where Triton is installed) on fresh random inputs. The shapes
cover a split of one block, a K that is not a multiple of the block (the last block is masked) and several
blocks per split, each with pointer loads and with TMA descriptors (the interpreter emulates their loads).
qkv + RoPE + store: tests/engine/test_qkv_rope_store.py; on the GPU: tests/gpu/test_gpu_gemm.py."""

from __future__ import annotations

from tests.interpreter import run_interpreted

INTERPRETED = """
import math
import torch
from engine import triton_gemm
from engine.gemm_dispatch import GemmConfig

g = torch.Generator().manual_seed(0)
err = lambda a, b: float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-9))
# (rows, K, N, splits, block_k)
# (rows, K, N, splits, block_k); every shape with pointer loads and with TMA loads (GemmConfig.tma: 1 the
# weights, 2 the activations too; zeros past the matrices, where the pointer loads mask)
for rows, K, N, splits, block_k in [(3, 64, 48, 4, 16), (9, 100, 40, 2, 32), (20, 256, 64, 2, 32), (1, 48, 16, 1, 64)]:
    for tma in (0, 1, 2):
        x = torch.randn(rows, K, generator=g)
        w = torch.randn(N, K, generator=g) / math.sqrt(K)
        got = triton_gemm.linear_partials(x, w, splits, GemmConfig(block_n=16, block_k=block_k, tma=tma))
        assert got.shape == (splits, rows, N)
        assert err(got.sum(0), x.double() @ w.double().T) < 1e-5, (rows, K, splits, tma)
        w2 = torch.randn(2 * N, K, generator=g) / math.sqrt(K)
        gate, up = x.double() @ w2[:N].double().T, x.double() @ w2[N:].double().T
        got = triton_gemm.gate_up_silu(x, w2, GemmConfig(block_n_gate=16, block_k=block_k, tma=tma))
        assert err(got, gate / (1 + torch.exp(-gate)) * up) < 1e-5, (rows, K, tma)
        # gate_up's own K step (block_k_gate), beside a different one for the partials
        got = triton_gemm.gate_up_silu(x, w2, GemmConfig(block_n_gate=16, block_k=64, block_k_gate=block_k, tma=tma))
        assert err(got, gate / (1 + torch.exp(-gate)) * up) < 1e-5, (rows, K, tma, "block_k_gate")
print("ok")
"""


def test_skinny_gemms_match_float64_references_in_tritons_interpreter():
    run_interpreted(INTERPRETED)
