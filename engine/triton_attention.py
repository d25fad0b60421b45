"""Paged causal attention in Triton: all new rows of a request against its paged history at once.

A program owns one (request, kv head, M tile, key split). Its query tile holds the request's new rows
times the query heads sharing that kv head (GQA), so each KV block is read once for all of them,
whether the call is a shallow step (1 row), a deep call (B rows, causal among themselves) or a prompt
chunk after a history (query tiles past MAX_BLOCK_M rows run as several M tiles). Online softmax in float32
over key tiles of BLOCK_N positions gathered through the block table. Context lengths are read on
the device, so a launch is graph-safe.

Dispatch (`triton_paged_attention`; the table and the rule live in attention_dispatch.py): the launch
config (BLOCK_N, warps, stages, splits) comes from host ints fixed per CUDA graph: requests x kv heads
per SM, and tile rows. With splits == 1 one pass writes the output. With splits = S > 1 (split-K,
flash-decoding: few requests, when the one-pass grid leaves SMs idle) the grid gets a third axis; split
s covers a contiguous, BLOCK_N-aligned 1/S share of the key tiles its rows can see and writes a
normalized partial output and its log-sum-exp (base 2) to float32 scratch; a split with an empty share
writes (0, -inf). attention_combine.py's kernel then merges the S partials of every (row, head).
Calls of one new row per request from few requests go to the Gluon decode kernel instead (gluon_attention.py,
on Hopper; `decode_launch` says when), which writes the same partials when it splits. Where its grid allows,
`decode_attention_o` runs o_proj and the add + norm after it in the same launch (gluon_attention_o.py).
Imported lazily: the CPU path never needs Triton.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import triton
import triton.language as tl

from . import pdl
from .attention_combine import combine_splits
from .attention_dispatch import (O_ROWS, DecodeConfig, FoldConfig, LaunchConfig, choose_config, decode_config,
                                 given_out, launch_override, o_fold_applies, parse_fold, parse_ring, query_tiling)
from .pdl import num_sms  # the dispatch's SM count (tests/gpu and attention_sweep.py import it from here)
from .pdl_wait import wait_after


@triton.jit
def _attend_keys(q, q_pos, lo, hi, k_ptr, v_ptr, block_tables_ptr, seq, stride_bt, kv_head, stride_k_block,
                 stride_k_slot, stride_k_head, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr):
    """Online softmax of the query tile q [BLOCK_M, HEAD_DIM] (rows at positions q_pos, causal) over key
    positions lo..hi-1, gathered BLOCK_N at a time through request seq's block table; inlined by Triton.
    -> (acc [BLOCK_M, HEAD_DIM] unnormalized, running max m_i and mass l_i [BLOCK_M], base 2, float32)."""
    offs_d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < hi
        block = tl.load(block_tables_ptr + seq * stride_bt + offs_n // PAGE, mask=n_valid, other=0)
        kv_off = block.to(tl.int64) * stride_k_block + (offs_n % PAGE) * stride_k_slot + kv_head * stride_k_head
        k = tl.load(k_ptr + kv_off[:, None] + offs_d[None, :], mask=n_valid[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet (padding)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off[:, None] + offs_d[None, :], mask=n_valid[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, block_tables_ptr, context_lens_ptr, query_start_ptr, tiles_ptr, m_tiles,
    stride_q_row, stride_q_head, stride_o_split, stride_o_row, stride_o_head, stride_lse_split, stride_lse_row,
    stride_k_block, stride_k_slot, stride_k_head, stride_bt, qk_scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr, TILED: tl.constexpr, HEAD_MAJOR: tl.constexpr,
    META_EARLY: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL and not META_EARLY:  # engine/pdl.py: wait for the kernel before, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if TILED:  # axis 0 walks a tile map of (sequence, M tile) pairs; padding tiles name a sequence of no rows
        seq = tl.load(tiles_ptr + 2 * tl.program_id(0))
        m_tile = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)
        kv_head = tl.program_id(1)
    elif HEAD_MAJOR:  # axis 0 walks one request's (kv head, M tile) programs, so they launch together
        seq = tl.program_id(1)
        kv_head = tl.program_id(0) // m_tiles
        m_tile = tl.program_id(0) % m_tiles
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1) // m_tiles
        m_tile = tl.program_id(1) % m_tiles
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    q_begin = tl.load(query_start_ptr + seq)
    n_q = tl.load(query_start_ptr + seq + 1) - q_begin
    ctx = tl.load(context_lens_ptr + seq)

    # Keys this tile's rows see: 0 .. the position of its last row (none if it holds no row of the request).
    last_row = tl.minimum((m_tile * BLOCK_M + BLOCK_M - 1) // GROUP, n_q - 1)
    kv_len = tl.where((m_tile * BLOCK_M) // GROUP < n_q, ctx - n_q + last_row + 1, 0)
    # This split's share: whole key tiles, so split boundaries never cut a tile.
    tiles_per_split = tl.cdiv(tl.cdiv(kv_len, BLOCK_N), num_splits)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(kv_len, lo + tiles_per_split * BLOCK_N)
    if USE_PDL and META_EARLY:  # the lengths and block ids are the host's (no kernel of the step writes them)
        first = tl.load(block_tables_ptr + seq * stride_bt + (lo + tl.arange(0, BLOCK_N)) // PAGE,
                        mask=lo + tl.arange(0, BLOCK_N) < hi, other=0)  # the first key tile's block ids (L1 after)
        wait_after(tl.sum(first, 0) + q_begin + n_q + ctx)  # then wait for the kernel before (q, the new row)

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row = offs_m // GROUP  # new row of this request
    head = kv_head * GROUP + offs_m % GROUP  # query head
    m_valid = row < n_q
    offs_d = tl.arange(0, HEAD_DIM)
    q_row = (q_begin + row).to(tl.int64)
    q = tl.load(q_ptr + q_row[:, None] * stride_q_row + head[:, None] * stride_q_head + offs_d[None, :],
                mask=m_valid[:, None], other=0.0)
    q_pos = ctx - n_q + row

    acc, m_i, l_i = _attend_keys(q, q_pos, lo, hi, k_ptr, v_ptr, block_tables_ptr, seq, stride_bt, kv_head,
                                 stride_k_block, stride_k_slot, stride_k_head, qk_scale,
                                 BLOCK_M, BLOCK_N, PAGE, HEAD_DIM, IEEE)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = split * stride_o_split + q_row[:, None] * stride_o_row + head[:, None] * stride_o_head + offs_d[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=m_valid[:, None])
    if SPLIT:  # log2 of this split's softmax mass, in the scaled base-2 domain (-inf: it saw no key)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(lse_ptr + split * stride_lse_split + q_row * stride_lse_row + head, lse, mask=m_valid)


def launch_paged_attention(q: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, query_start: torch.Tensor,
                           max_rows: int, scale: float, config: LaunchConfig,
                           tiles: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel with an explicit launch config (the sweep and the tests call this directly).

    q: [rows, heads, d]; k_plane, v_plane: [blocks, block_size, kv_heads, d]; block_tables: [seqs, width] int32;
    context_lens: [seqs] int32; query_start: [seqs + 1] int32 -> [rows, heads, d]. Rows no sequence covers
    hold no defined value. `tiles` ([num_tiles, 2] int32, attention_dispatch.tile_map): the programs walk this
    list of (sequence, M tile) pairs instead of every sequence times max_rows' M tiles, so a launch's grid
    is fixed by the list's length, not by how many sequences share max_rows (graphed prefill). `out`: where the
    rows go (contiguous, q's shape and dtype: engine/layers64.py's TMA-read buffer); a new tensor by default.
    """
    rows, heads, d = q.shape
    _, page, kv_heads, _ = k_plane.shape
    assert q.stride(2) == 1 and k_plane.stride(3) == 1 and k_plane.stride() == v_plane.stride()
    group = heads // kv_heads
    seqs = context_lens.shape[0]
    block_m, m_tiles = query_tiling(max_rows, group, d, fp32=q.dtype == torch.float32)
    out = given_out(q, out)
    splits = config.splits
    if splits == 1:
        part, lse, split_strides = out, out, (0, 0)
    else:
        part = torch.empty((splits, rows, heads, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((splits, rows, heads), dtype=torch.float32, device=q.device)
        split_strides = (part.stride(0), lse.stride(0))
    head_major = config.head_major and tiles is None
    grid = (tiles.shape[0], kv_heads, splits) if tiles is not None else \
        (kv_heads * m_tiles, seqs, splits) if head_major else (seqs, kv_heads * m_tiles, splits)
    _paged_attention_kernel[grid](
        q, k_plane, v_plane, part, lse, block_tables, context_lens, query_start,
        query_start if tiles is None else tiles, m_tiles if tiles is None else 1,  # (tiled: unused; one class)
        q.stride(0), q.stride(1), split_strides[0], part.stride(-3), part.stride(-2), split_strides[1],
        lse.stride(-2) if splits > 1 else 0,
        k_plane.stride(0), k_plane.stride(1), k_plane.stride(2), block_tables.stride(0),
        scale * 1.4426950408889634,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=config.block_n, PAGE=page, HEAD_DIM=d,
        IEEE=q.dtype == torch.float32, SPLIT=splits > 1, TILED=tiles is not None, HEAD_MAJOR=head_major,
        META_EARLY=config.meta_early, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl.launch_kwargs(q.device),
    )
    if splits > 1 and rows > 0:
        combine_splits(part, lse, out)
    return out


def default_config(q: torch.Tensor, k_plane: torch.Tensor, num_seqs: int, max_rows: int,
                   num_tiles: int | None = None) -> LaunchConfig:
    """The dispatch table's config for this launch (attention_dispatch.choose_config). With a tile map of
    `num_tiles` entries, each (tile, kv head) program counts as one sequence of one M tile of rows."""
    _, heads, d = q.shape
    kv_heads = k_plane.shape[2]
    group = heads // kv_heads
    if num_tiles is not None:
        block_m, _ = query_tiling(max_rows, group, d, fp32=q.dtype == torch.float32)
        return choose_config(num_tiles, kv_heads, min(max_rows * group, block_m), d, num_sms(q.device))
    return choose_config(num_seqs, kv_heads, max_rows * group, d, num_sms(q.device))


def triton_paged_attention(q: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, query_start: torch.Tensor,
                           max_rows: int, scale: float, tiles: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [rows, heads, d]; k_plane, v_plane: [blocks, block_size, kv_heads, d] -> [rows, heads, d] (into `out`
    where given). Calls of one new row per request go to the Gluon decode kernel where it is on (gluon_decode)
    and serves them."""
    if max_rows == 1 and tiles is None:
        decode = decode_launch(context_lens.shape[0], k_plane.shape[2], q.device)
        if decode is not None:
            from . import gluon_attention

            if gluon_attention.supports(q, k_plane, v_plane, max_rows, tiles, decode):
                return gluon_attention.launch_decode_attention(q, k_plane, v_plane, block_tables, context_lens,
                                                               query_start, scale, decode, out)
    config = launch_override(max_rows, tiles is not None)
    if config is None:
        config = default_config(q, k_plane, context_lens.shape[0], max_rows, None if tiles is None else tiles.shape[0])
    return launch_paged_attention(q, k_plane, v_plane, block_tables, context_lens, query_start, max_rows, scale,
                                  config, tiles, out)


DECODE_ENV = "OUROBATCH_DECODE_ATTENTION"  # gluon | triton: which kernel serves one-row-per-request calls
DECODE_DEFAULT = "gluon"
RING_ENV = "OUROBATCH_DECODE_RING"  # the Gluon kernel's ring: BLOCK_NxSTAGES
EARLY_ENV = "OUROBATCH_DECODE_EARLY"  # 0: its loader waits for the kernel before first (a measuring control)
FOLD_ENV = "OUROBATCH_DECODE_FOLD_O"  # 0 | 1 | 2 [:warp|:cta]: what the Gluon decode kernel folds in (parse_fold)
_GLUON: dict[int, bool] = {}
_RING: dict[int, DecodeConfig] = {}
_FOLD: dict[int, FoldConfig | None] = {}


def gluon_decode(device: torch.device) -> bool:
    """Whether one-row-per-request calls on `device` use the Gluon decode kernel (gluon_attention.py): a
    Hopper GPU, Gluon importable, and OUROBATCH_DECODE_ATTENTION gluon (the default: DECODE_DEFAULT).
    Cached per device, with the ring OUROBATCH_DECODE_RING names (default 32x6)."""
    if device.type != "cuda":
        return False
    index = pdl.device_index(device)
    if index not in _GLUON:
        value = os.environ.get(DECODE_ENV, "").strip() or DECODE_DEFAULT
        if value not in ("gluon", "triton"):
            raise ValueError(f"{DECODE_ENV} must be gluon or triton, got {value!r}")
        _GLUON[index] = value == "gluon" and pdl.hopper(device) and pdl.gluon_importable()
        ring = parse_ring(os.environ.get(RING_ENV, "").strip() or "32x6")
        _RING[index] = replace(ring, early=_flag(EARLY_ENV, "1"))
        _FOLD[index] = parse_fold(os.environ.get(FOLD_ENV, "").strip() or "1")
    return _GLUON[index]


def _flag(name: str, default: str) -> bool:
    value = os.environ.get(name, "").strip() or default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def decode_launch(seqs: int, kv_heads: int, device: torch.device) -> DecodeConfig | None:
    """The Gluon decode kernel's launch for `seqs` one-row requests on `device`, or None: the Triton kernel's
    (gluon_decode off, or more requests than attention_dispatch.DECODE_MAX_PER_SM lets it take)."""
    if not gluon_decode(device):
        return None
    return decode_config(seqs, kv_heads, num_sms(device), _RING[pdl.device_index(device)])


def fold_config(device: torch.device) -> FoldConfig | None:
    """What decode calls on `device` fold into the Gluon decode kernel (OUROBATCH_DECODE_FOLD_O), or None."""
    return _FOLD[pdl.device_index(device)] if gluon_decode(device) else None


def decode_attention_o(q: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, query_start: torch.Tensor, max_rows: int, scale: float,
                       tiles: torch.Tensor | None, wo: torch.Tensor, barrier: torch.Tensor, h: torch.Tensor,
                       w_branch: torch.Tensor, w_next: torch.Tensor, eps: float,
                       partials_only: bool = False) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None:
    """With o = triton_paged_attention(...) @ wo.T: (h + rms(o) w_branch, its rms times w_next) from one Gluon
    launch (gluon_attention_o.py), or None where that launch does not serve the call (then the caller runs
    attention, o_proj and the add + norm apart): the Gluon decode kernel's one-CTA-per-pair grid,
    attention_dispatch.o_fold_applies, and OUROBATCH_DECODE_FOLD_O not 0. `barrier`: the model's two int32
    grid-barrier counters on q's device. partials_only: o itself (float32 [1, rows, hidden]) for the MLP launch,
    which runs the add + norm (gluon_mlp.py)."""
    if max_rows != 1 or tiles is not None or q.shape[0] > O_ROWS:  # o_fold_applies' row bound, before any lookup
        return None
    seqs = context_lens.shape[0]
    decode = decode_launch(seqs, k_plane.shape[2], q.device)
    fold = fold_config(q.device)
    if decode is None or fold is None:
        return None
    rows, heads, d = q.shape
    if not (o_fold_applies(decode, seqs, rows, heads, d, wo.shape[0], num_sms(q.device))
            and wo.dtype == h.dtype == w_branch.dtype == w_next.dtype == q.dtype and wo.is_contiguous()
            and wo.shape[1] == heads * d and wo.data_ptr() % 16 == 0 and h.is_contiguous()
            and h.shape == (rows, wo.shape[0]) and barrier.device == q.device):
        return None
    from . import gluon_attention, gluon_attention_o

    if not gluon_attention.supports(q, k_plane, v_plane, max_rows, tiles, decode):
        return None
    if partials_only:
        fold = replace(fold, norm=False)
    return gluon_attention_o.launch_decode_attention_o(q, k_plane, v_plane, block_tables, context_lens, query_start,
                                                       scale, decode, wo, barrier, h, w_branch, w_next, eps, fold,
                                                       partials_only)


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Shapes the kernel handles: a power-of-two head_dim of at least 16, a 16/32-bit float dtype."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and dtype in (torch.bfloat16, torch.float16,
                                                                          torch.float32)
