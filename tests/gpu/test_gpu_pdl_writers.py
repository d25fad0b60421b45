"""What the kernel before the decode attention writes, the attention reads: with PDL the attention's programs start
while that kernel (qkv + RoPE + store, in the engine) still runs, and must take its query and the new row's key and
value only after the wait. A slow kernel launched with PDL writes them, in a CUDA graph replayed with fresh values
each time; the output is checked against the float64 reference on those values. For the Gluon decode kernel (its
loader streams the history before the wait) and the Triton paged kernel, also with LaunchConfig.meta_early (the
lengths and first block ids loaded before the wait)."""

from __future__ import annotations

import pytest
import torch

from engine.attention_dispatch import DecodeConfig, LaunchConfig

from .test_gpu_attention_kernels import Case, capture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CONFIGS = [DecodeConfig(32, 6, 1), DecodeConfig(64, 3, 2), DecodeConfig(32, 6, 1, early=False),
           LaunchConfig(16, 1, 4), LaunchConfig(16, 1, 4, meta_early=True), LaunchConfig(32, 2, 2, meta_early=True),
           LaunchConfig(64, 2, 3, splits=4, meta_early=True)]


def _label(c) -> str:
    if isinstance(c, DecodeConfig):
        return f"gluon-n{c.block_n}s{c.stages}k{c.splits}{'' if c.early else 'late'}"
    from engine.attention_dispatch import launch_label

    return "triton-" + launch_label(c).replace("/", "-")


def _run(case: Case, config) -> torch.Tensor:
    if isinstance(config, LaunchConfig):
        return case.run(config)
    from engine.gluon_attention import launch_decode_attention

    tables, ctx, starts, _, scale = case.args
    return launch_decode_attention(case.q, case.k, case.v, tables, ctx, starts, scale, config)


def _slow_store():
    import triton
    import triton.language as tl

    @triton.jit
    def slow_store(src_q, src_k, src_v, q_ptr, k_ptr, v_ptr, slot_ptr, row_elems, spin, USE_PDL: tl.constexpr,
                   BLOCK: tl.constexpr):
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        seq = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < row_elems
        q = tl.load(src_q + seq * row_elems + offs, mask=mask).to(tl.float32)
        k = tl.load(src_k + seq * row_elems + offs, mask=mask).to(tl.float32)
        v = tl.load(src_v + seq * row_elems + offs, mask=mask).to(tl.float32)
        for _ in range(spin):  # a few microseconds of work before the stores, exact (x * 1 + 0)
            k = k * 1.0 + 0.0 * tl.sin(k)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        tl.store(q_ptr + seq * row_elems + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(k_ptr + slot * row_elems + offs, k.to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + slot * row_elems + offs, v.to(v_ptr.dtype.element_ty), mask=mask)

    return slow_store


@pytest.mark.parametrize("config", CONFIGS, ids=_label)
def test_what_the_kernel_before_writes_is_what_attention_reads(config):
    from engine import pdl

    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("PDL is off on this device")
    if isinstance(config, DecodeConfig) and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the Gluon decode kernel needs Hopper")
    import triton

    slow_store = _slow_store()
    ctx = [40, 200, 17, 640, 1]
    case = Case(ctx, [1] * len(ctx), 16, 16, 128, torch.bfloat16, seed=21)
    blocks, page, heads, d = case.k.shape
    last = [c - 1 for c in ctx]
    slots = torch.tensor([case.block_ids[i][p // page] * page + p % page for i, p in enumerate(last)],
                         dtype=torch.int32, device="cuda")
    src_q, src_k, src_v = (torch.empty(len(ctx), heads * d, dtype=torch.bfloat16, device="cuda") for _ in range(3))

    def step() -> torch.Tensor:
        slow_store[(len(ctx),)](src_q, src_k, src_v, case.q, case.k, case.v, slots, heads * d, 300,
                                BLOCK=triton.next_power_of_2(heads * d), **pdl.launch_kwargs(case.q.device))
        return _run(case, config)

    graph, out = capture(step)
    g = torch.Generator(device="cuda").manual_seed(5)
    before = out.clone()
    for _ in range(5):
        for src in (src_q, src_k, src_v):
            src.copy_(torch.randn(src.shape, generator=g, device="cuda") * 4)
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.equal(out, before)  # each replay's output is of its own fresh values
        before = out.clone()
        case.q_ref = src_q.view(len(ctx), heads, d).double().cpu()
        for i, p in enumerate(last):  # the reference's pool, with the new rows
            block, off = case.block_ids[i][p // page], p % page
            case.pool.k[0, 0, block, off] = src_k[i].view(heads, d).double().cpu()
            case.pool.v[0, 0, block, off] = src_v[i].view(heads, d).double().cpu()
        case.check(out, case.reference(ctx))
