"""The engine's decode attention with o_proj (and its add + norm) folded in (engine/gluon_attention_o.py: on by
default where attention_dispatch.o_fold_applies) run on the CPU by tests/gluon_emulator.py against float64, as
tests/gpu/test_gpu_gluon_attention_o.py checks it on the H200: o itself (the default fold, whose add + norm is a
Triton kernel after the launch) and the folded add + norm + norm, with both stagers, and the grid barrier's count
across launches. Where Triton is installed (CI installs it); acquire / release ordering is the GPU test's (proxy
fences are checked here)."""

from __future__ import annotations

import pytest
import torch

from engine.attention_dispatch import DecodeConfig, o_fold_applies, parse_fold

pytest.importorskip("triton.experimental.gluon")
emulator = pytest.importorskip("tests.gluon_emulator")
from tests.gpu.test_gpu_attention_kernels import Case  # noqa: E402

EPS = 1e-6
HEADS, D, HIDDEN = 2, 128, 256  # a small shape the fold serves: 16 CTAs (8 requests x 2 heads), 16 output tiles


def rms(x: torch.Tensor) -> torch.Tensor:
    return x / (x.pow(2).mean(-1, keepdim=True) + EPS).sqrt()


def run(case: Case, fold_text: str, seed: int, barrier: torch.Tensor | None = None):
    from engine import gluon_attention_o

    g = torch.Generator().manual_seed(seed)
    rows = case.q.shape[0]
    wo = (torch.randn(HIDDEN, HEADS * D, generator=g) / (HEADS * D) ** 0.5).to(torch.bfloat16)
    h = torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16)
    wa, wb = ((1 + 0.2 * torch.randn(HIDDEN, generator=g)).to(torch.bfloat16) for _ in range(2))
    barrier = torch.zeros(2, dtype=torch.int32) if barrier is None else barrier
    tables, ctx, starts, _, scale = case.args
    config, fold = DecodeConfig(32, 4), parse_fold(fold_text)
    assert o_fold_applies(config, len(case.rows), rows, HEADS, D, HIDDEN, 132)
    grid, args, constexprs, (o, h_out, x_out) = gluon_attention_o.decode_attention_o_args(
        case.q, case.k, case.v, tables, ctx, starts, scale, config, wo, barrier, h, wa, wb, EPS, fold)
    emulator.emulate(gluon_attention_o.decode_attention_o_kernel, grid, *args, USE_PDL=0, **constexprs)
    o_ref = case.ref.reshape(rows, -1) @ wo.double().T
    h_ref = h.double() + rms(o_ref) * wa.double()
    return o, o_ref, (h_out, x_out) if fold.norm else None, (h_ref, rms(h_ref) * wb.double())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("fold", ["1", "1:cta", "2", "2:cta"])
def test_the_fold_matches_float64(fold):
    case = Case([1, 15, 16, 17, 33, 70, 5, 40], [1] * 8, HEADS, HEADS, D, torch.bfloat16, seed=3, device="cpu")
    o, o_ref, normed, refs = run(case, fold, seed=4)
    if normed is None:  # the default fold: o in float32, its add + norm a Triton kernel after the launch
        assert rel(o, o_ref) < 1.5e-2, rel(o, o_ref)
    else:
        for got, ref in zip(normed, refs):
            assert got.dtype == torch.bfloat16 and rel(got, ref) < 1.5e-2, rel(got, ref)


def test_requests_without_a_row_and_the_barrier_across_launches():
    # a bucket's padding: 8 requests, two without a new row; the grid barrier's count is left at zero and its
    # generation moves once a pass, launch after launch
    case = Case([50, 70, 90, 3, 5, 60, 16, 17], [1, 0, 1, 1, 0, 1, 1, 1], HEADS, HEADS, D, torch.bfloat16, seed=5,
                device="cpu")
    barrier = torch.zeros(2, dtype=torch.int32)
    for launch in range(3):
        _, _, normed, refs = run(case, "2", seed=6, barrier=barrier)
        for got, ref in zip(normed, refs):
            assert rel(got, ref) < 1.5e-2
    assert barrier.tolist() == [0, 2 * 3]  # two passes (o, then the add + norm) a launch
