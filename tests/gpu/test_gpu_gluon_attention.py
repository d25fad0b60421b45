"""The Gluon decode attention kernel (engine/gluon_attention.py) against the float64 torch reference.

CUDA on Hopper only (TMA, warp specialization, griddepcontrol); Triton's interpreter cannot run Gluon.
tests/engine/test_gluon_attention_compile.py compiles it for sm90 without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention_dispatch import DecodeConfig

from .test_gpu_attention_kernels import Case


def _hopper() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return False
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Gluon")]


def _run(case: Case, config: DecodeConfig) -> torch.Tensor:
    from engine.gluon_attention import launch_decode_attention

    tables, ctx, starts, max_rows, scale = case.args
    assert max_rows <= 1
    return launch_decode_attention(case.q, case.k, case.v, tables, ctx, starts, scale, config)


CONFIGS = [DecodeConfig(32, 6, 1), DecodeConfig(64, 3, 2), DecodeConfig(16, 12, 5), DecodeConfig(32, 3, 16)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,d", [(16, 128), (4, 64), (2, 256)])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"n{c.block_n}s{c.stages}k{c.splits}")
def test_decode_kernel_matches_reference(dtype, heads, d, config):
    # contexts that end on, before and after page and slot boundaries; a split count past some requests'
    # tiles (empty shares write (0, -inf) partials)
    ctx = [1, 15, 16, 17, 33, 100, 640, 1000]
    case = Case(ctx, [1] * len(ctx), heads, heads, d, dtype, seed=heads * d + config.splits)
    case.check(_run(case, config))


@pytest.mark.parametrize("config", CONFIGS[:2], ids=lambda c: f"n{c.block_n}s{c.stages}k{c.splits}")
def test_requests_without_a_row_write_nothing(config):
    # a bucket's padding: requests of no new row; their output rows do not exist, the others are right
    case = Case([50, 70, 90], [1, 0, 1], 16, 16, 128, torch.bfloat16, seed=11)
    case.check(_run(case, config))


@pytest.mark.parametrize("config", [DecodeConfig(32, 6, ctas_per_sm=1), DecodeConfig(32, 3, ctas_per_sm=2),
                                    DecodeConfig(64, 3, ctas_per_sm=1, early=False)],
                         ids=lambda c: f"n{c.block_n}s{c.stages}p{c.ctas_per_sm}{'' if c.early else 'late'}")
def test_persistent_ctas_walk_many_pairs(config):
    # 40 requests x 16 heads = 640 pairs, several per CTA: the ring runs on across pairs; some requests
    # have no row (a bucket's padding) and some contexts end inside a slot
    g = torch.Generator().manual_seed(config.stages)
    ctx = [int(c) for c in torch.randint(1, 700, (40,), generator=g)]
    rows = [0 if i % 7 == 3 else 1 for i in range(40)]
    case = Case(ctx, rows, 16, 16, 128, torch.bfloat16, seed=config.block_n)
    case.check(_run(case, config))


@pytest.mark.parametrize("sms", [128, 16, 3])
def test_a_persistent_grid_on_other_sms_computes_the_same_bits(sms):
    # benchmarks/attention_in_pool.py's @CTAS: the same pairs walked by another CTA count (128: each CTA one head of
    # 8 requests at N = 64) run the same math per pair, so the output is the device grid's to the bit
    from engine.gluon_attention import launch_decode_attention

    g = torch.Generator().manual_seed(sms)
    ctx = [int(c) for c in torch.randint(1, 700, (64,), generator=g)]
    case = Case(ctx, [1] * 64, 16, 16, 128, torch.bfloat16, seed=sms)
    tables, lens, starts, _, scale = case.args
    config = DecodeConfig(32, 12, ctas_per_sm=1)
    out = launch_decode_attention(case.q, case.k, case.v, tables, lens, starts, scale, config, sms=sms)
    case.check(out)
    assert torch.equal(out, _run(case, config))


def test_dispatch_routes_decode_calls_only(monkeypatch):
    # OUROBATCH_DECODE_ATTENTION=gluon: one-row calls take the Gluon kernel (bit-identical to calling it),
    # calls of more rows keep the Triton kernel
    from engine import triton_attention
    from engine.attention_dispatch import decode_config

    monkeypatch.setenv(triton_attention.DECODE_ENV, "gluon")
    monkeypatch.setattr(triton_attention, "_GLUON", {})
    one = Case([300, 20, 129, 7], [1] * 4, 16, 16, 128, torch.bfloat16, seed=3)
    auto = decode_config(4, 16, triton_attention.num_sms(one.q.device))
    assert torch.equal(triton_attention.triton_paged_attention(one.q, one.k, one.v, *one.args), _run(one, auto))
    four = Case([300, 20], [4, 4], 16, 16, 128, torch.bfloat16, seed=4)
    out = triton_attention.triton_paged_attention(four.q, four.k, four.v, *four.args)
    config = triton_attention.default_config(four.q, four.k, 2, 4)
    ref = triton_attention.launch_paged_attention(four.q, four.k, four.v, *four.args, config)
    assert torch.equal(out, ref)
    monkeypatch.setenv(triton_attention.DECODE_ENV, "neither")
    monkeypatch.setattr(triton_attention, "_GLUON", {})
    with pytest.raises(ValueError, match="OUROBATCH_DECODE_ATTENTION must be gluon or triton"):
        triton_attention.gluon_decode(one.q.device)


@pytest.mark.parametrize("config", CONFIGS + [DecodeConfig(32, 3, ctas_per_sm=2)],
                         ids=lambda c: f"n{c.block_n}s{c.stages}k{c.splits}p{c.ctas_per_sm}")
def test_slots_nothing_wrote_do_not_reach_the_output(config):
    # Session 20's abort: a second engine in one process got its pool on memory the first one freed, and the
    # slots past a context in its last tile (TMA loads whole tiles) held NaN bit patterns; the kernel weighted
    # them by 0, and 0 x NaN poisoned the output, the logits, and a draw outside the vocabulary ended the process
    # in a device-side assert. NaN in every slot no request reads must leave the output as it was.
    ctx = [1, 15, 16, 17, 33, 100, 640, 1000]
    case = Case(ctx, [1] * len(ctx), 16, 16, 128, torch.bfloat16, seed=config.block_n + config.splits)
    clean = _run(case, config)
    case.poison_unread()
    poisoned = _run(case, config)
    case.check(poisoned)
    assert torch.equal(poisoned, clean)
