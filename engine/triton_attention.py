"""Paged causal attention in Triton: all new rows of a request against its paged history at once.

One program per (request, kv head). Its query tile holds every new row of the request times every
query head sharing that kv head (GQA), so each KV block is read once for all of them, whether the
call is a shallow step (1 row), a deep call (B rows, causal among themselves) or anything between.
Online softmax in float32 over key tiles of BLOCK_N positions gathered through the block table.
The loop bound is the request's context length, read on the device, so the launch is graph-safe.
Imported lazily: the CPU path never needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, block_tables_ptr, context_lens_ptr, query_start_ptr,
    stride_q_row, stride_q_head, stride_k_block, stride_k_slot, stride_k_head, stride_bt,
    qk_scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr, IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_begin = tl.load(query_start_ptr + seq)
    n_q = tl.load(query_start_ptr + seq + 1) - q_begin
    ctx = tl.load(context_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    row = offs_m // GROUP  # new row of this request
    head = kv_head * GROUP + offs_m % GROUP  # query head
    m_valid = row < n_q
    offs_d = tl.arange(0, HEAD_DIM)
    q_off = (q_begin + row).to(tl.int64)[:, None] * stride_q_row + head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=m_valid[:, None], other=0.0)
    q_pos = ctx - n_q + row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, ctx, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < ctx
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
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + q_off, out.to(o_ptr.dtype.element_ty), mask=m_valid[:, None])


def triton_paged_attention(q: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, query_start: torch.Tensor,
                           max_rows: int, scale: float) -> torch.Tensor:
    """q: [rows, heads, d]; k_plane, v_plane: [blocks, block_size, kv_heads, d] -> [rows, heads, d]."""
    rows, heads, d = q.shape
    _, page, kv_heads, _ = k_plane.shape
    group = heads // kv_heads
    seqs = context_lens.shape[0]
    out = torch.empty_like(q)
    block_m = max(16, triton.next_power_of_2(max_rows * group))
    block_n = 64 if d <= 128 else 32
    _paged_attention_kernel[(seqs, kv_heads)](
        q, k_plane, v_plane, out, block_tables, context_lens, query_start,
        q.stride(0), q.stride(1), k_plane.stride(0), k_plane.stride(1), k_plane.stride(2), block_tables.stride(0),
        scale * 1.4426950408889634,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page, HEAD_DIM=d, IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )
    return out


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Shapes the kernel handles: a power-of-two head_dim of at least 16, a 16/32-bit float dtype."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and dtype in (torch.bfloat16, torch.float16,
                                                                          torch.float32)
