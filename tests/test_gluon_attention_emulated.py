"""The engine's Gluon decode attention kernel (engine/gluon_attention.py: the decode calls of more than 8 requests,
N = 64 among them) run on the CPU by tests/gluon_emulator.py against the float64 reference, as
tests/gpu/test_gpu_gluon_attention.py checks it on the H200: one pass, split-K partials (combined here in torch:
the combine kernel is Triton's, tested in its interpreter) and the persistent grid. Where Triton is installed (CI
has none); acquire / release ordering is the GPU test's (proxy fences are checked here)."""

from __future__ import annotations

import pytest
import torch

from engine.attention_dispatch import DecodeConfig

pytest.importorskip("triton.experimental.gluon")
emulator = pytest.importorskip("tests.gluon_emulator")
from tests.gpu.test_gpu_attention_kernels import TOL, Case  # noqa: E402

SMS = 4  # the persistent grid's SMs


def run(case: Case, config: DecodeConfig, sms: int = SMS) -> torch.Tensor:
    from engine import gluon_attention

    tables, ctx, starts, _, scale = case.args
    grid, args, constexprs, (part, lse, out) = gluon_attention.decode_attention_args(
        case.q, case.k, case.v, tables, ctx, starts, scale, config, sms)
    emulator.emulate(gluon_attention.decode_attention_kernel, grid, *args, USE_PDL=0, **constexprs)
    if config.splits > 1:  # the splits' base-2 log-sum-exps weight their partials
        weight = torch.exp2(lse - lse.amax(0))
        out = ((part * weight[..., None]).sum(0) / weight.sum(0)[..., None]).to(out.dtype)
    return out


@pytest.mark.parametrize("config", [DecodeConfig(32, 3, 1), DecodeConfig(16, 4, 3), DecodeConfig(32, 2, 1, True, 1)],
                         ids=["one_pass", "split3", "persistent"])
@pytest.mark.parametrize("heads,d", [(2, 128), (3, 64)])
def test_decode_kernel_matches_reference(config, heads, d):
    # contexts that end on, before and after page and slot boundaries; a split count past some requests' tiles
    ctx = [1, 15, 16, 17, 33, 70]
    case = Case(ctx, [1] * len(ctx), heads, heads, d, torch.bfloat16, seed=heads * d + config.splits, device="cpu")
    assert within_bf16(case, run(case, config))


def test_a_persistent_grid_on_other_sms_computes_the_same_bits():
    # benchmarks/attention_in_pool.py's @CTAS: 8 requests x 2 heads walked by 4, 2 or 3 CTAs (2: each CTA one head)
    ctx = [1, 15, 16, 17, 33, 70, 40, 9]
    case = Case(ctx, [1] * len(ctx), 2, 2, 128, torch.bfloat16, seed=5, device="cpu")
    outs = [run(case, DecodeConfig(32, 2, 1, True, 1), sms) for sms in (SMS, 2, 3)]
    assert within_bf16(case, outs[0]) and all(torch.equal(outs[0], out) for out in outs[1:])


def within_bf16(case: Case, out: torch.Tensor) -> bool:
    """Case.check's test (the GPU tests'), as a value: shape, dtype, no NaN, within bf16's tolerance of float64."""
    err = float((out.double() - case.ref).norm() / case.ref.norm())
    return (out.shape == case.ref.shape and out.dtype == torch.bfloat16 and bool(torch.isfinite(out).all())
            and err < TOL[torch.bfloat16])


def test_a_query_view_with_its_own_row_stride():
    # q a view into wider rows (row stride != heads x d): the kernel reads it through its strides, in place
    case = Case([3, 30, 17], [1, 1, 1], 2, 2, 128, torch.bfloat16, seed=13, device="cpu", strided_q=True)
    assert not case.q.is_contiguous()
    assert within_bf16(case, run(case, DecodeConfig(32, 3, 1)))


def test_slots_nobody_wrote_do_not_reach_the_output():
    # NaN in every slot no request reads (a last page's tail, the tables' padding blocks): masked, not weighted by 0
    case = Case([3, 16, 21], [1, 1, 1], 2, 2, 128, torch.bfloat16, seed=11, device="cpu")
    case.poison_unread()
    assert within_bf16(case, run(case, DecodeConfig(32, 3, 2)))


def test_the_rows_go_to_a_given_output():
    # `out` (engine/layers64.py: the layer launch's TMA-read rows): the kernel writes there, through its strides
    from engine import gluon_attention

    case = Case([3, 30, 17], [1, 1, 1], 2, 2, 128, torch.bfloat16, seed=17, device="cpu")
    tables, ctx, starts, _, scale = case.args
    rows = torch.full((8, 256), 7.0, dtype=torch.bfloat16)
    out = rows[:3].view(3, 2, 128)
    grid, args, constexprs, (_, _, got) = gluon_attention.decode_attention_args(
        case.q, case.k, case.v, tables, ctx, starts, scale, DecodeConfig(32, 3, 1), SMS, out)
    assert got is out
    emulator.emulate(gluon_attention.decode_attention_kernel, grid, *args, USE_PDL=0, **constexprs)
    assert within_bf16(case, out) and bool((rows[3:] == 7.0).all())
    for bad in (torch.empty(3, 2, 64, dtype=torch.bfloat16), torch.empty(3, 2, 128), rows[:3, ::2].view(3, 1, 128)):
        with pytest.raises(ValueError, match="out must be"):
            gluon_attention.decode_attention_args(case.q, case.k, case.v, tables, ctx, starts, scale,
                                                  DecodeConfig(32, 3, 1), SMS, bad)
