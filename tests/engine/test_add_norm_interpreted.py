"""The add + norm kernels of the decode layer (engine/triton_fused.add_rms_norm2 and
engine/triton_gemm.add_rms_norm2_partials, which share one row tail) against float64 references written from
Ouro's layer math (h + rms(y) * w_branch, then rms of that * w_next; RMSNorm = x / sqrt(mean(x^2) + eps)), in
Triton's interpreter on the CPU (float32: the interpreter's bf16 is not the GPU's) on fresh random inputs.
The bf16 rounding steps are checked against torch on the H200 (tests/gpu/test_gpu.py, test_gpu_gemm.py)."""

from __future__ import annotations

from tests.interpreter import run_interpreted

INTERPRETED = """
import torch
from engine import triton_fused, triton_gemm

g = torch.Generator().manual_seed(0)
eps = 1e-6
rms = lambda t: t / torch.sqrt((t * t).mean(-1, keepdim=True) + eps)
err = lambda a, b: float((a.double() - b).abs().max() / b.abs().max())
for rows, n, splits in [(1, 48, 1), (3, 100, 2), (5, 256, 4)]:
    h = torch.randn(rows, n, generator=g)
    partials = torch.randn(splits, rows, n, generator=g)
    wa, wb = 1 + 0.3 * torch.randn(n, generator=g), 1 + 0.3 * torch.randn(n, generator=g)
    y = partials.double().sum(0)
    h_ref = h.double() + rms(y) * wa.double()
    x_ref = rms(h_ref) * wb.double()
    for name, (h_out, x_out) in [("add_rms_norm2", triton_fused.add_rms_norm2(h, partials.sum(0), wa, wb, eps)),
                                 ("partials", triton_gemm.add_rms_norm2_partials(h, partials, wa, wb, eps))]:
        assert err(h_out, h_ref) < 1e-5 and err(x_out, x_ref) < 1e-5, (name, rows, n, splits)
print("ok")
"""


def test_add_norm_kernels_match_float64_references_in_tritons_interpreter():
    run_interpreted(INTERPRETED)
