"""The Gluon decode attention kernel (engine/gluon_attention.py) against the float64 torch reference.

CUDA on Hopper only (TMA, warp specialization, griddepcontrol); Triton's interpreter cannot run Gluon.
tests/engine/test_gluon_attention_compile.py compiles it for sm90 without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention_dispatch import DecodeConfig

from .test_gpu_attention_kernels import Case, capture


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


@pytest.mark.parametrize("config", CONFIGS[:2] + [DecodeConfig(32, 6, 1, early=False)],
                         ids=lambda c: f"n{c.block_n}s{c.stages}k{c.splits}{'' if c.early else 'late'}")
def test_new_key_written_by_the_kernel_before_is_seen(config):
    # The loader streams the history before the PDL wait and waits only before the tile holding the new row.
    # A slow kernel before it (launched with PDL, as the qkv kernel is) writes that row's key and value: in a
    # CUDA graph, replayed with fresh values each time, attention must always see them.
    from engine import pdl

    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("PDL is off on this device")
    import triton
    import triton.language as tl

    @triton.jit
    def slow_store(src_k, src_v, k_ptr, v_ptr, slot_ptr, row_elems, spin, USE_PDL: tl.constexpr,
                   BLOCK: tl.constexpr):
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        seq = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < row_elems
        k = tl.load(src_k + seq * row_elems + offs, mask=mask).to(tl.float32)
        v = tl.load(src_v + seq * row_elems + offs, mask=mask).to(tl.float32)
        for _ in range(spin):  # a few microseconds of work before the store, exact (x * 1 + 0)
            k = k * 1.0 + 0.0 * tl.sin(k)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        tl.store(k_ptr + slot * row_elems + offs, k.to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + slot * row_elems + offs, v.to(v_ptr.dtype.element_ty), mask=mask)

    ctx = [40, 200, 17, 640, 1]
    case = Case(ctx, [1] * len(ctx), 16, 16, 128, torch.bfloat16, seed=21)
    tables, lens, starts, _, scale = case.args
    blocks, page, heads, d = case.k.shape
    last = [c - 1 for c in ctx]
    slots = torch.tensor([case.block_ids[i][p // page] * page + p % page for i, p in enumerate(last)],
                         dtype=torch.int32, device="cuda")
    src_k = torch.empty(len(ctx), heads * d, dtype=torch.bfloat16, device="cuda")
    src_v = torch.empty_like(src_k)

    def step() -> torch.Tensor:
        slow_store[(len(ctx),)](src_k, src_v, case.k, case.v, slots, heads * d, 300,
                                BLOCK=triton.next_power_of_2(heads * d), **pdl.launch_kwargs(case.q.device))
        return _run(case, config)

    graph, out = capture(step)
    g = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(5):
        src_k.copy_(torch.randn(src_k.shape, generator=g, device="cuda") * 4)
        src_v.copy_(torch.randn(src_v.shape, generator=g, device="cuda") * 4)
        graph.replay()
        torch.cuda.synchronize()
        for i, p in enumerate(last):  # the reference's pool, with the new rows
            block, off = case.block_ids[i][p // page], p % page
            case.pool.k[0, 0, block, off] = src_k[i].view(heads, d).double().cpu()
            case.pool.v[0, 0, block, off] = src_v[i].view(heads, d).double().cpu()
        case.check(out, case.reference(ctx))


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
