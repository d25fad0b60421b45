"""Decode attention with o_proj and the add + norm + norm after it folded into its tail: one Gluon launch instead
of the attention kernel, the o_proj GEMM kernel and the add + norm kernel (Hopper, few requests).

At N = 8 the decode step ran 7 kernels per layer and loop, each ~3 us above its bytes (first loads, last wave,
the wait for the kernel before; docs/benchmarks.md, sessions 9-15). o_proj is the cheapest of them in bytes
(2048 x 2048 weights: 8 MB, 1.95 us at copy bandwidth), the add + norm has none, and each paid a whole
boundary. Here the decode kernel of gluon_attention.py (one CTA per (request, kv head): 128 CTAs at N = 8,
16 heads) gains a third partition, one warp that owns one 16-column tile of o_proj's output:

- at launch the o warp TMA-loads its tile's weights (16 rows x K, 64 KB at K = 2048) into shared memory:
  weights are no kernel's output, so this needs no wait and streams beside the keys and values;
- the attention partition (4 warps) writes its output row, then arrives at a grid barrier (an arrival count
  and a generation in global memory; the last CTA to arrive resets the count and bumps the generation, so
  every launch finds them as the last one left them). Past it, it copies every row of the attention output
  (rows x K, 32 KB) into shared memory, signalling each 256-column chunk as it lands;
- the o warp multiplies each chunk with its weights as it comes (mma.sync, the weight rows as the MMA's M,
  four independent accumulator chains) and writes its float32 tile of o;
- a second pass of the barrier, and CTA r (r < rows) runs triton_fused.add_norm2_store's math on row r:
  h + rms(o) w_branch, then its rms times w_next (the same roundings as the add + norm kernel).

A grid barrier needs every CTA resident at once: attention_dispatch.o_fold_applies allows it only where
the grid has no more CTAs than SMs and at least one CTA per output tile and per row. The barrier's two
counters belong to the model (OuroForCausalLM.o_barrier), one pair per engine, since launches on one stream
never overlap. Two such launches running at once on one GPU (two engines sharing it through MPS) could each hold
part of the SMs and wait for the other: OUROBATCH_DECODE_FOLD_O=0 is for that (docs/api.md).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from . import attention_dispatch
from .attention_dispatch import O_ROWS, DecodeConfig, FoldConfig
from .gluon_attention import _attend, _descriptor, _kv_loader, _pdl_kwargs
from .gluon_ring import grid_barrier

O_BLOCK_N = gl.constexpr(attention_dispatch.O_BLOCK_N)  # output columns of a tile (the MMA's M)
O_BLOCK_K = gl.constexpr(attention_dispatch.O_BLOCK_K)  # K of a weight box


@gluon.jit
def multiply_box(slot, xs, acc0, acc1, acc2, acc3, a_layout: gl.constexpr, b_layout: gl.constexpr,
                 BLOCK_K: gl.constexpr, CHAINS: gl.constexpr):
    """acc += slot @ xs.T for one weight box slot [16, BLOCK_K] and the staged rows' same K range xs
    [rows, BLOCK_K]; CHAINS 4: the box's four quarters go to four accumulators, so the MMAs form four
    independent chains instead of one chain of BLOCK_K / 16."""
    if CHAINS == 1:
        acc0 = mma_v2(slot.load(a_layout), xs.permute((1, 0)).load(b_layout), acc0)
    else:
        Q: gl.constexpr = BLOCK_K // 4
        a0 = slot.slice(0, Q, dim=1).load(a_layout)
        a1 = slot.slice(Q, Q, dim=1).load(a_layout)
        a2 = slot.slice(2 * Q, Q, dim=1).load(a_layout)
        a3 = slot.slice(3 * Q, Q, dim=1).load(a_layout)
        b0 = xs.slice(0, Q, dim=1).permute((1, 0)).load(b_layout)
        b1 = xs.slice(Q, Q, dim=1).permute((1, 0)).load(b_layout)
        b2 = xs.slice(2 * Q, Q, dim=1).permute((1, 0)).load(b_layout)
        b3 = xs.slice(3 * Q, Q, dim=1).permute((1, 0)).load(b_layout)
        acc0 = mma_v2(a0, b0, acc0)
        acc1 = mma_v2(a1, b1, acc1)
        acc2 = mma_v2(a2, b2, acc2)
        acc3 = mma_v2(a3, b3, acc3)
    return acc0, acc1, acc2, acc3


@gluon.jit
def stage_rows(x_ptr, xb, x_ready, first, rows, stride, K: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
               WARPS: gl.constexpr, SIGNAL: gl.constexpr):
    """`rows` rows of K columns (`stride` apart) into the shared buffer xb [BM, K], every BK-column chunk's
    copies in flight at once (cp.async, a commit group each); SIGNAL: chunk c signalled (x_ready[first + c]) as
    soon as it has landed (else the caller waits for chunk c's group itself)."""
    NKB: gl.constexpr = K // BK
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    rm = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    rk = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    for c in gl.static_range(NKB):
        async_copy.async_copy_global_to_shared(xb.slice(c * BK, BK, dim=1),
                                               x_ptr + rm[:, None] * stride + (c * BK + rk)[None, :],
                                               mask=(rm < rows)[:, None])
        async_copy.commit_group()
    if SIGNAL:
        for c in gl.static_range(NKB):
            async_copy.wait_group(NKB - 1 - c)
            gl.thread_barrier()
            mbarrier.arrive(x_ready.index(first + c), count=1)


@gluon.jit
def _add_norm_row(po_ptr, h_ptr, wa_ptr, wb_ptr, h_out_ptr, x_out_ptr, row, eps, HIDDEN: gl.constexpr,
                  BLOCK_H: gl.constexpr):
    # triton_fused.add_norm2_store on one row, the same roundings: h + rms(y) wa -> h_out, rms(h_out) wb -> x_out
    layout: gl.constexpr = gl.BlockedLayout([BLOCK_H // 128], [32], [4], [0])
    cols = gl.arange(0, BLOCK_H, layout=layout)
    mask = cols < HIDDEN
    base = row.to(gl.int64) * HIDDEN
    h = gl.load(h_ptr + base + cols, mask=mask, other=0.0)
    y = gl.load(po_ptr + base + cols, mask=mask, other=0.0).to(h.dtype).to(gl.float32)  # o in the model dtype
    ynorm = y * gl.rsqrt(gl.sum(y * y, axis=0) / HIDDEN + eps)
    wa = gl.load(wa_ptr + cols, mask=mask, other=0.0)
    branch = (ynorm.to(wa.dtype) * wa).to(gl.float32)
    h_new = (h.to(gl.float32) + branch).to(h.dtype)
    gl.store(h_out_ptr + base + cols, h_new, mask=mask)
    hf = h_new.to(gl.float32)
    hnorm = hf * gl.rsqrt(gl.sum(hf * hf, axis=0) / HIDDEN + eps)
    wb = gl.load(wb_ptr + cols, mask=mask, other=0.0)
    gl.store(x_out_ptr + base + cols, hnorm.to(wb.dtype) * wb, mask=mask)


@gluon.jit
def _attend_stage_norm(k_desc, v_desc, kring, vring, ready, empty, q_ptr, o_ptr, block_tables_ptr,
                       context_lens_ptr, query_start_ptr, stride_q_row, stride_q_head, stride_o_head, stride_bt,
                       qk_scale, kv_heads, bar_ptr, a_smem, a_ready, o_done, po_ptr, h_ptr, wa_ptr, wb_ptr,
                       h_out_ptr, x_out_ptr, rows, eps, PAGE: gl.constexpr, HEAD_DIM: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, USE_PDL: gl.constexpr, TILES: gl.constexpr,
                       K: gl.constexpr, BM: gl.constexpr, BLOCK_H: gl.constexpr, NORM: gl.constexpr,
                       STAGER: gl.constexpr):
    # the default partition: attention for its (request, head); once every CTA's row is written, the rows for
    # the o warp (STAGER 1; STAGER 0: only the go, a_ready[0], the o warp copies them); NORM: once every o tile
    # is written, the add + norm + norm of row `cta` (CTAs below `rows`)
    _attend(k_desc, v_desc, kring, vring, ready, empty, q_ptr, o_ptr, o_ptr, block_tables_ptr, context_lens_ptr,
            query_start_ptr, stride_q_row, stride_q_head, 0, K, stride_o_head, 0, 0, stride_bt, qk_scale,
            kv_heads, 1, PAGE, HEAD_DIM, BLOCK_N, STAGES, False, USE_PDL, False)
    cta = gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)
    programs = gl.num_programs(0) * gl.num_programs(1)
    grid_barrier(bar_ptr, programs)
    if STAGER:
        if cta < TILES:
            stage_rows(o_ptr, a_smem, a_ready, 0, rows, K, K, BM, O_BLOCK_K, 4, True)  # the rows: contiguous
    else:
        mbarrier.arrive(a_ready.index(0), count=1)
    if NORM:
        mbarrier.wait(o_done, 0)
        grid_barrier(bar_ptr, programs)  # the counters are reused: the first barrier's last CTA reset the count
        if cta < rows:
            _add_norm_row(po_ptr, h_ptr, wa_ptr, wb_ptr, h_out_ptr, x_out_ptr, cta, eps, TILES * O_BLOCK_N, BLOCK_H)


@gluon.jit
def _loader(k_desc, v_desc, kring, vring, ready, empty, q_ptr, o_ptr, block_tables_ptr, context_lens_ptr,
            query_start_ptr, stride_q_row, stride_q_head, stride_o_head, stride_bt, qk_scale, kv_heads,
            PAGE: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            USE_PDL: gl.constexpr, K: gl.constexpr):
    _kv_loader(k_desc, v_desc, kring, vring, ready, empty, q_ptr, o_ptr, o_ptr, block_tables_ptr, context_lens_ptr,
               query_start_ptr, stride_q_row, stride_q_head, 0, K, stride_o_head, 0, 0, stride_bt,
               qk_scale, kv_heads, 1, PAGE, HEAD_DIM, BLOCK_N, STAGES, False, USE_PDL, False)


@gluon.jit
def _o_project(wo_desc, wbuf, w_ready, a_smem, a_ready, o_done, o_ptr, po_ptr, rows, TILES: gl.constexpr,
               K: gl.constexpr, BM: gl.constexpr, STAGER: gl.constexpr):
    # the CTA's tile of o = a @ wo.T: its weights at launch, each chunk of the rows as it lands (STAGER 0: this
    # warp copies them once a_ready[0] says go); then o_done
    tile = gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)
    if tile < TILES:
        BN: gl.constexpr = O_BLOCK_N
        BK: gl.constexpr = O_BLOCK_K
        NKB: gl.constexpr = K // BK
        mbarrier.expect(w_ready, NKB * wo_desc.block_type.nbytes)
        for kb in gl.static_range(NKB):
            tma.async_copy_global_to_shared(wo_desc, [tile * BN, kb * BK], w_ready, wbuf.index(kb))
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        acc0 = gl.zeros([BN, BM], gl.float32, mma)
        acc1 = gl.zeros([BN, BM], gl.float32, mma)
        acc2 = gl.zeros([BN, BM], gl.float32, mma)
        acc3 = gl.zeros([BN, BM], gl.float32, mma)
        if not STAGER:
            mbarrier.wait(a_ready.index(0), 0)
            stage_rows(o_ptr, a_smem, a_ready, 0, rows, K, K, BM, O_BLOCK_K, 1, False)
        mbarrier.wait(w_ready, 0)
        for kb in gl.static_range(NKB):
            if STAGER:
                mbarrier.wait(a_ready.index(kb), 0)
            else:
                async_copy.wait_group(NKB - 1 - kb)
                gl.thread_barrier()  # every lane's copies of the chunk have landed
            acc0, acc1, acc2, acc3 = multiply_box(wbuf.index(kb), a_smem.slice(kb * BK, BK, dim=1), acc0, acc1,
                                                  acc2, acc3, a_layout, b_layout, BK, 4)
        acc = (acc0 + acc1) + (acc2 + acc3)
        rn = tile * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        rr = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        gl.store(po_ptr + rr[None, :] * (TILES * BN) + rn[:, None], acc, mask=(rr < rows)[None, :])
    mbarrier.arrive(o_done, count=1)


@gluon.jit
def decode_attention_o_kernel(k_desc, v_desc, wo_desc, q_ptr, o_ptr, po_ptr, bar_ptr, block_tables_ptr,
                              context_lens_ptr, query_start_ptr, h_ptr, wa_ptr, wb_ptr, h_out_ptr, x_out_ptr,
                              stride_q_row, stride_q_head, stride_o_head, stride_bt, qk_scale, kv_heads, rows, eps,
                              a_layout: gl.constexpr, PAGE: gl.constexpr, HEAD_DIM: gl.constexpr,
                              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, USE_PDL: gl.constexpr,
                              TILES: gl.constexpr, K: gl.constexpr, BM: gl.constexpr, BLOCK_H: gl.constexpr,
                              NORM: gl.constexpr, STAGER: gl.constexpr):
    kring = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    vring = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    wbuf = gl.allocate_shared_memory(wo_desc.dtype, [K // O_BLOCK_K, O_BLOCK_N, O_BLOCK_K], wo_desc.layout)
    a_smem = gl.allocate_shared_memory(wo_desc.dtype, [BM, K], a_layout)
    a_ready = gl.allocate_shared_memory(gl.int64, [K // O_BLOCK_K, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    o_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for c in gl.static_range(K // O_BLOCK_K):
        mbarrier.init(a_ready.index(c), count=1)
    mbarrier.init(w_ready, count=1)
    mbarrier.init(o_done, count=1)
    gl.warp_specialize([
        (_attend_stage_norm, (k_desc, v_desc, kring, vring, ready, empty, q_ptr, o_ptr, block_tables_ptr,
                              context_lens_ptr, query_start_ptr, stride_q_row, stride_q_head, stride_o_head,
                              stride_bt, qk_scale, kv_heads, bar_ptr, a_smem, a_ready, o_done, po_ptr, h_ptr, wa_ptr,
                              wb_ptr, h_out_ptr, x_out_ptr, rows, eps, PAGE, HEAD_DIM, BLOCK_N, STAGES, USE_PDL,
                              TILES, K, BM, BLOCK_H, NORM, STAGER)),
        (_loader, (k_desc, v_desc, kring, vring, ready, empty, q_ptr, o_ptr, block_tables_ptr, context_lens_ptr,
                   query_start_ptr, stride_q_row, stride_q_head, stride_o_head, stride_bt, qk_scale, kv_heads, PAGE,
                   HEAD_DIM, BLOCK_N, STAGES, USE_PDL, K)),
        (_o_project, (wo_desc, wbuf, w_ready, a_smem, a_ready, o_done, o_ptr, po_ptr, rows, TILES, K, BM, STAGER)),
    ], [1, 1], [48, 152])


def smem_layouts(rows_block: int, k: int):
    """The o weight boxes' shared-memory layout (their TMA descriptor's) and the staged attention rows'."""
    return (gl.NVMMASharedLayout.get_default_for([O_BLOCK_N.value, O_BLOCK_K.value], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([rows_block, k], gl.bfloat16))


def launch_decode_attention_o(q: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor,
                              block_tables: torch.Tensor, context_lens: torch.Tensor, query_start: torch.Tensor,
                              scale: float, config: DecodeConfig, wo: torch.Tensor, barrier: torch.Tensor,
                              h: torch.Tensor, w_branch: torch.Tensor, w_next: torch.Tensor, eps: float,
                              fold: FoldConfig = FoldConfig(),
                              partials_only: bool = False) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """gluon_attention.launch_decode_attention, o_proj and triton_gemm.add_rms_norm2_partials in one launch:
    with o = attention(q) @ wo.T, returns h + rms(o) w_branch and its rms times w_next ([rows, hidden] each).
    The caller checked attention_dispatch.o_fold_applies; `barrier`: two int32 zeros on q's device, kept for
    later launches; h contiguous. fold.norm False: the add + norm runs as triton_gemm's kernel after the launch.
    partials_only (fold.norm False): o itself, float32 [1, rows, hidden], for the MLP launch (gluon_mlp.py)
    that runs the add + norm."""
    grid, args, constexprs, (partials, h_out, x_out) = decode_attention_o_args(
        q, k_plane, v_plane, block_tables, context_lens, query_start, scale, config, wo, barrier, h, w_branch, w_next,
        eps, fold)
    decode_attention_o_kernel[grid](*args, **constexprs, **_pdl_kwargs(q.device, config))
    rows, hidden = q.shape[0], wo.shape[0]
    if fold.norm:
        return h_out, x_out
    if partials_only:
        return partials.view(1, rows, hidden)
    from .triton_gemm import add_rms_norm2_partials

    return add_rms_norm2_partials(h, partials.view(1, rows, hidden), w_branch, w_next, eps)


def decode_attention_o_args(q: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, query_start: torch.Tensor, scale: float, config: DecodeConfig,
                            wo: torch.Tensor, barrier: torch.Tensor, h: torch.Tensor, w_branch: torch.Tensor,
                            w_next: torch.Tensor, eps: float, fold: FoldConfig) -> tuple[tuple, tuple, dict, tuple]:
    """launch_decode_attention_o's grid, kernel arguments, constexprs but USE_PDL, and (o in float32 [rows,
    hidden], the new residual and the next input: h itself twice without fold.norm)
    (tests/test_gluon_attention_o_emulated.py runs the kernel on them on the CPU)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rows, heads, d = q.shape
    seqs = context_lens.shape[0]
    hidden, K = wo.shape
    out = torch.empty_like(q)
    partials = torch.empty((rows, hidden), dtype=torch.float32, device=q.device)
    h_out, x_out = (torch.empty_like(h), torch.empty_like(h)) if fold.norm else (h, h)
    w_layout, a_layout = smem_layouts(O_ROWS, K)
    wo_desc = TensorDescriptor.from_tensor(wo, [O_BLOCK_N.value, O_BLOCK_K.value], w_layout)
    args = (_descriptor(k_plane), _descriptor(v_plane), wo_desc, q, out, partials, barrier, block_tables, context_lens,
            query_start, h, w_branch, w_next, h_out, x_out, q.stride(0), q.stride(1), out.stride(1),
            block_tables.stride(0), scale * 1.4426950408889634, heads, rows, eps)
    constexprs = dict(a_layout=a_layout, PAGE=k_plane.shape[1], HEAD_DIM=d, BLOCK_N=config.block_n,
                      STAGES=config.stages, TILES=hidden // O_BLOCK_N.value, K=K, BM=O_ROWS,
                      BLOCK_H=max(128, 1 << (hidden - 1).bit_length()), NORM=fold.norm, STAGER=fold.stager,
                      num_warps=4)
    return (seqs, heads, 1), args, constexprs, (partials, h_out, x_out)
