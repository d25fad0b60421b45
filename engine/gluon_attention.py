"""Paged decode attention as a warp-specialized Gluon kernel (Hopper): one new row per request.

The Triton kernel (triton_attention.py) waits for the kernel before it (the qkv GEMM that writes this
step's keys) before it loads anything, then gathers each key tile through the block table with pointer
loads. At few requests (N = 8: 128 (request, head) pairs for 132 SMs) that prologue and its short split-K
shares left it at ~2/3 of copy bandwidth. Here one CTA per (request, kv head, split) runs two partitions:

- a 1-warp loader that TMA-loads the request's K and V pages into a ring of shared-memory slots
  (BLOCK_N positions a slot, one box per page). Every page before this step's new row was written by an
  earlier step, so the loader streams them *before* the programmatic-dependent-launch wait: the history
  flows while the qkv kernel before still runs. It waits (griddepcontrol.wait) only before the tile that
  holds the new row, which that kernel writes;
- a 4-warp consumer that waits, loads the query row and runs the online softmax in float32 FMA: every key
  slot of a tile keeps its own running max, mass and weighted values, so no tile needs a reduction across
  warps; the slots are merged once at the end.

With DecodeConfig.ctas_per_sm the grid is persistent instead: that many CTAs per SM walk the (request, kv
head) pairs pid, pid + CTAs, ..., and the ring runs on from one pair into the next (attention_dispatch
.decode_config uses it for 1-2 pairs per SM).

Only calls of one new row per request with one query head per kv head (Ouro: no GQA) and pages that tile
BLOCK_N come here (`supports`); the rest stays with the Triton kernel. splits > 1 writes the Triton
kernel's float32 partials and base-2 log-sum-exps, and attention_combine.py merges them.
Imported lazily: Gluon ships with Triton >= 3.5 and the CPU path never imports it.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from . import pdl
from .attention_combine import combine_splits
from .attention_dispatch import DecodeConfig, given_out


@gluon.jit
def _gdc_wait():
    # programmatic dependent launch: the kernel before has finished and its writes are visible
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _item(w, kv_heads, PERSIST: gl.constexpr):
    # the (request, kv head, share, shares) of a CTA's work item w: with PERSIST every CTA walks items
    # pid, pid + CTAs, ... of the (request, kv head) pairs; else the CTA is one item, named by its grid index
    if PERSIST:
        return w // kv_heads, w % kv_heads, w * 0, w * 0 + 1
    return gl.program_id(0), gl.program_id(1), gl.program_id(2), gl.num_programs(2)


@gluon.jit
def _items(items, PERSIST: gl.constexpr):
    # this CTA's range of work items
    if PERSIST:
        return gl.program_id(0), items, gl.num_programs(0)
    return 0, 1, 1


@gluon.jit
def _share(context_lens_ptr, query_start_ptr, seq, split, splits, BLOCK_N: gl.constexpr):
    # the item's key tiles [lo, hi) (as the Triton kernel splits them: whole tiles, contiguous shares), the
    # request's key count, how many of them earlier steps wrote, its query row and whether it has one
    q_begin = gl.load(query_start_ptr + seq)
    n_q = gl.load(query_start_ptr + seq + 1) - q_begin
    ctx = gl.load(context_lens_ptr + seq)
    kv_len = gl.where(n_q > 0, ctx, 0)
    per_split = gl.cdiv(gl.cdiv(kv_len, BLOCK_N), splits)
    lo = split * per_split
    hi = gl.minimum(gl.cdiv(kv_len, BLOCK_N), lo + per_split)
    return lo, hi, kv_len, ctx - n_q, q_begin, n_q > 0


@gluon.jit
def _kv_loader(k_desc, v_desc, kring, vring, ready, empty, q_ptr, o_ptr, lse_ptr, block_tables_ptr,
               context_lens_ptr, query_start_ptr, stride_q_row, stride_q_head, stride_o_split, stride_o_row,
               stride_o_head, stride_lse_split, stride_lse_row, stride_bt, qk_scale, kv_heads, items,
               PAGE: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
               SPLIT: gl.constexpr, USE_PDL: gl.constexpr, PERSIST: gl.constexpr):
    PAGES: gl.constexpr = BLOCK_N // PAGE
    offs_p = gl.arange(0, PAGES, layout=gl.BlockedLayout([1], [32], [1], [0]))
    first, last, step = _items(items, PERSIST)
    i = 0  # the ring's running slot count, across items
    for w in range(first, last, step):
        seq, head, split, splits = _item(w, kv_heads, PERSIST)
        lo, hi, kv_len, written, q_begin, has_row = _share(context_lens_ptr, query_start_ptr, seq, split, splits,
                                                           BLOCK_N)
        table = block_tables_ptr + seq * stride_bt
        col = head * HEAD_DIM
        upcoming = _page_blocks(table, lo, offs_p, kv_len, PAGE, PAGES)
        for t in range(lo, hi):
            blocks = upcoming  # the next tile's block ids are loaded one tile ahead: no round trip per box
            upcoming = _page_blocks(table, t + 1, offs_p, kv_len, PAGE, PAGES)
            if USE_PDL == 1:
                if (t + 1) * BLOCK_N > written:  # this tile holds the new row's key: the kernel before writes it
                    _gdc_wait()
            if USE_PDL == 2:  # DecodeConfig.early off: wait before the first load, as the Triton kernel does
                if i == 0:
                    _gdc_wait()
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), 2 * k_desc.block_type.nbytes * PAGES)
            for j in gl.static_range(PAGES):
                row = gl.sum(gl.where(offs_p == j, blocks, 0), axis=0) * PAGE
                landed = ready.index(s)  # the slot's barrier: both boxes count their bytes in
                tma.async_copy_global_to_shared(k_desc, [row, col], landed, kring.index(s).slice(j * PAGE, PAGE, dim=0))
                tma.async_copy_global_to_shared(v_desc, [row, col], landed, vring.index(s).slice(j * PAGE, PAGE, dim=0))
            i += 1


@gluon.jit
def _page_blocks(table, t, offs_p, kv_len, PAGE: gl.constexpr, PAGES: gl.constexpr):
    # tile t's PAGES block ids (0 past the keys: those positions are masked, the box reads a valid block)
    page = t * PAGES + offs_p
    return gl.load(table + page, mask=page * PAGE < kv_len, other=0)


@gluon.jit
def _attend(k_desc, v_desc, kring, vring, ready, empty, q_ptr, o_ptr, lse_ptr, block_tables_ptr, context_lens_ptr,
            query_start_ptr, stride_q_row, stride_q_head, stride_o_split, stride_o_row, stride_o_head,
            stride_lse_split, stride_lse_row, stride_bt, qk_scale, kv_heads, items, PAGE: gl.constexpr,
            HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
            USE_PDL: gl.constexpr, PERSIST: gl.constexpr):
    if USE_PDL:  # the query rows are the kernel before's output
        _gdc_wait()
        _gdc_launch_dependents()
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    first, last, step = _items(items, PERSIST)
    i = 0
    for w in range(first, last, step):
        seq, head, split, splits = _item(w, kv_heads, PERSIST)
        lo, hi, kv_len, written, q_begin, has_row = _share(context_lens_ptr, query_start_ptr, seq, split, splits,
                                                           BLOCK_N)
        row = q_begin.to(gl.int64)
        q = gl.load(q_ptr + row * stride_q_row + head * stride_q_head + offs_d, mask=(offs_d < HEAD_DIM) & has_row,
                    other=0.0).to(gl.float32) * qk_scale
        m = gl.full([BLOCK_N], float("-inf"), gl.float32, gl.SliceLayout(1, layout))
        mass = gl.zeros([BLOCK_N], gl.float32, gl.SliceLayout(1, layout))
        acc = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout)
        for t in range(lo, hi):  # per key slot: running max m, mass and sum of weighted values (base 2)
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            k = kring.index(s).load(layout).to(gl.float32)
            valid = t * BLOCK_N + offs_n < kv_len
            score = gl.where(valid, gl.sum(k * q[None, :], axis=1), float("-inf"))
            v = vring.index(s).load(layout).to(gl.float32)
            if (t + 1) * BLOCK_N > kv_len:  # the last tile: its slots past the keys hold whatever the memory held
                v = masked_values(v, valid)
            m, mass, acc = online_values(score, v, m, mass, acc)
            gl.thread_barrier()  # every warp has read the slot
            fence_async_shared()
            mbarrier.arrive(empty.index(s), count=1)
            i += 1
        _finish(o_ptr, lse_ptr, m, mass, acc, row, head, split, has_row, offs_d, stride_o_split, stride_o_row,
                stride_o_head, stride_lse_split, stride_lse_row, HEAD_DIM, SPLIT)


@gluon.jit
def masked_values(v, valid):
    """A tile's values [slots, d] with the slots not `valid` zeroed. A masked slot's value must be replaced by 0,
    not weighted by 0: its memory holds whatever was there (a page's tail, a padding block, memory another
    engine of the process freed), and 0 x NaN would poison the slot's running sum (session 21)."""
    return gl.where(valid[:, None], v, 0.0)


@gluon.jit
def online_values(score, v, m, mass, acc):
    """One tile of keys in the per-key-slot online softmax (base 2): `score` the slots' scores (-inf: masked),
    v their values (float32, masked slots zeroed: masked_values); the running max m, mass and weighted values
    updated."""
    m_new = gl.maximum(m, score)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m - m_safe)
    p = gl.exp2(score - m_safe)
    mass = mass * alpha + p
    return m_new, mass, acc * alpha[:, None] + p[:, None] * v


@gluon.jit
def _finish(o_ptr, lse_ptr, m, mass, acc, row, head, split, has_row, offs_d, stride_o_split, stride_o_row,
            stride_o_head, stride_lse_split, stride_lse_row, HEAD_DIM: gl.constexpr, SPLIT: gl.constexpr):
    # the key slots merged: the item's output row (SPLIT: its normalized partial and base-2 log-sum-exp)
    top = gl.max(m, axis=0)
    w = gl.exp2(m - gl.where(top == float("-inf"), 0.0, top))
    total = gl.sum(mass * w, axis=0)
    out = gl.sum(acc * w[:, None], axis=0) / gl.where(total == 0.0, 1.0, total)
    o_off = split * stride_o_split + row * stride_o_row + head * stride_o_head + offs_d
    gl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=(offs_d < HEAD_DIM) & has_row)
    if SPLIT:  # log2 of this share's softmax mass (-inf: it saw no key)
        lse = gl.where(total == 0.0, float("-inf"), top + gl.log2(gl.where(total == 0.0, 1.0, total)))
        gl.store(lse_ptr + split * stride_lse_split + row * stride_lse_row + head, lse, mask=has_row)


@gluon.jit
def decode_attention_kernel(k_desc, v_desc, q_ptr, o_ptr, lse_ptr, block_tables_ptr, context_lens_ptr,
                            query_start_ptr, stride_q_row, stride_q_head, stride_o_split, stride_o_row,
                            stride_o_head, stride_lse_split, stride_lse_row, stride_bt, qk_scale, kv_heads, items,
                            PAGE: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr, SPLIT: gl.constexpr, USE_PDL: gl.constexpr,
                            PERSIST: gl.constexpr):
    kring = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    vring = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([
        (_attend, (k_desc, v_desc, kring, vring, ready, empty, q_ptr, o_ptr, lse_ptr, block_tables_ptr,
                   context_lens_ptr, query_start_ptr, stride_q_row, stride_q_head, stride_o_split, stride_o_row,
                   stride_o_head, stride_lse_split, stride_lse_row, stride_bt, qk_scale, kv_heads, items, PAGE,
                   HEAD_DIM, BLOCK_N, STAGES, SPLIT, USE_PDL, PERSIST)),
        (_kv_loader, (k_desc, v_desc, kring, vring, ready, empty, q_ptr, o_ptr, lse_ptr, block_tables_ptr,
                      context_lens_ptr, query_start_ptr, stride_q_row, stride_q_head, stride_o_split, stride_o_row,
                      stride_o_head, stride_lse_split, stride_lse_row, stride_bt, qk_scale, kv_heads, items, PAGE,
                      HEAD_DIM, BLOCK_N, STAGES, SPLIT, USE_PDL, PERSIST)),
    ], [1], [48])


def _pdl_kwargs(device: torch.device, config: DecodeConfig) -> dict:
    # USE_PDL 1: the loader streams the history before the wait; 2: it waits first (config.early off)
    kwargs = pdl.launch_kwargs(device)
    if kwargs["USE_PDL"] and not config.early:
        kwargs["USE_PDL"] = 2
    return kwargs


def smem_layout() -> gl.NVMMASharedLayout:
    """The pages' shared-memory layout (their TMA boxes' and the ring's): unswizzled rows (a [page, head_dim]
    box is wider than the 128-byte swizzle span at head_dim 128, and the consumer reads whole rows)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


def supports(q: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor, max_rows: int, tiles,
             config: DecodeConfig) -> bool:
    """Calls this kernel serves: one new row per request, no GQA, 16-bit keys, pages that tile block_n."""
    _, heads, d = q.shape
    _, page, kv_heads, _ = k_plane.shape
    return (max_rows == 1 and tiles is None and heads == kv_heads and q.dtype in (torch.bfloat16, torch.float16)
            and q.stride(2) == 1 and k_plane.dtype == v_plane.dtype == q.dtype and d in (64, 128, 256)
            and page % 8 == 0 and config.block_n % page == 0 and _plane_ok(k_plane) and _plane_ok(v_plane))


def _plane_ok(plane: torch.Tensor) -> bool:
    blocks, page, kv_heads, d = plane.shape
    return (plane.stride(3) == 1 and plane.stride(2) == d and plane.stride(1) == kv_heads * d
            and plane.stride(0) == page * kv_heads * d and plane.data_ptr() % 16 == 0)


def _descriptor(plane: torch.Tensor):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    blocks, page, kv_heads, d = plane.shape
    flat = plane.view(blocks * page, kv_heads * d)  # rows: slots; a page of one head is a [page, d] box
    return TensorDescriptor.from_tensor(flat, [page, d], smem_layout())


def launch_decode_attention(q: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, query_start: torch.Tensor,
                            scale: float, config: DecodeConfig, out: torch.Tensor | None = None,
                            sms: int | None = None) -> torch.Tensor:
    """q: [rows, heads, d] (one row per request at most); k_plane, v_plane: [blocks, page, kv_heads, d]
    -> [rows, heads, d] (`out` where given: contiguous, q's shape and dtype); rows no request covers hold no
    defined value. `sms`: the SMs a persistent grid spreads over (default the device's; a benchmark's control)."""
    grid, args, constexprs, (part, lse, out) = decode_attention_args(
        q, k_plane, v_plane, block_tables, context_lens, query_start, scale, config, sms or pdl.num_sms(q.device),
        out)
    decode_attention_kernel[grid](*args, **constexprs, **_pdl_kwargs(q.device, config))
    if config.splits > 1 and q.shape[0] > 0:
        combine_splits(part, lse, out)
    return out


def decode_attention_args(q: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor, block_tables: torch.Tensor,
                          context_lens: torch.Tensor, query_start: torch.Tensor, scale: float, config: DecodeConfig,
                          sms: int, out: torch.Tensor | None = None) -> tuple[tuple, tuple, dict, tuple]:
    """launch_decode_attention's grid, kernel arguments, constexprs but USE_PDL, and (the splits' float32
    partials, their log-sum-exps, the output); with one split the kernel writes the output itself
    (tests/test_gluon_attention_emulated.py runs the kernel on them on the CPU)."""
    rows, heads, d = q.shape
    seqs = context_lens.shape[0]
    out = torch.empty_like(q) if out is None else given_out(q, out)
    if config.splits == 1:
        part, lse, split_strides = out, out, (0, 0)
    else:
        part = torch.empty((config.splits, rows, heads, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((config.splits, rows, heads), dtype=torch.float32, device=q.device)
        split_strides = (part.stride(0), lse.stride(0))
    items = seqs * heads
    if config.ctas_per_sm:  # persistent: CTAs walk the (request, kv head) pairs
        grid = (max(1, min(items, config.ctas_per_sm * sms)), 1, 1)
    else:
        grid = (seqs, heads, config.splits)
    args = (_descriptor(k_plane), _descriptor(v_plane), q, part, lse, block_tables, context_lens, query_start,
            q.stride(0), q.stride(1), split_strides[0], part.stride(-3), part.stride(-2), split_strides[1],
            lse.stride(-2) if config.splits > 1 else 0, block_tables.stride(0), scale * 1.4426950408889634, heads,
            items)
    constexprs = dict(PAGE=k_plane.shape[1], HEAD_DIM=d, BLOCK_N=config.block_n, STAGES=config.stages,
                      SPLIT=config.splits > 1, PERSIST=config.ctas_per_sm > 0, num_warps=4)
    return grid, args, constexprs, (part, lse, out)
