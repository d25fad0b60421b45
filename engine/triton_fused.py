"""Fused elementwise kernels for the CUDA path (Triton), each with its plain-torch reference in ops.py.

A decode step is thousands of small kernels (4 loops x layers x norms, RoPE, KV writes); in a CUDA
graph each still costs a few microseconds, so fusing them is what brings a step near its bytes floor:
- `add_rms_norm2`: h' = h + rms(y) * w_branch, x = rms(h') * w_next   (Ouro's two norms per half-layer)
- `rms_norm`: x = rms(h) * w
- `rope_store_kv`: RoPE on q and k from the fused qkv output, k and v written to their pool slots
- `silu_mul`: silu(gate) * up from the fused gate_up output
Norms compute in float32 and round like the reference: (normed in float32 -> model dtype) * weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl


@triton.jit
def _add_rms_norm2_kernel(h_ptr, y_ptr, wa_ptr, wb_ptr, h_out_ptr, x_out_ptr, n_cols, eps,
                          BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # engine/pdl.py: wait for the kernel before, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + row * n_cols + cols, mask=mask, other=0.0)
    add_norm2_store(y, h, wa_ptr, wb_ptr, h_out_ptr + row * n_cols, x_out_ptr + row * n_cols, cols, mask, n_cols, eps)


@triton.jit
def add_norm2_store(y, h, wa_ptr, wb_ptr, h_out_ptr, x_out_ptr, cols, mask, n_cols, eps):
    """One row's h + rms(y) * wa -> h_out, then rms(h_out) * wb -> x_out (inlined by both add + norm kernels).
    y: the branch's GEMM output in float32, already rounded to the model dtype; h: the residual row."""
    ynorm = y * tl.rsqrt(tl.sum(y * y, 0) / n_cols + eps)
    wa = tl.load(wa_ptr + cols, mask=mask, other=0.0)
    branch = (ynorm.to(wa.dtype) * wa).to(tl.float32)
    h_new = (h.to(tl.float32) + branch).to(h.dtype)
    tl.store(h_out_ptr + cols, h_new, mask=mask)
    hf = h_new.to(tl.float32)
    hnorm = hf * tl.rsqrt(tl.sum(hf * hf, 0) / n_cols + eps)
    wb = tl.load(wb_ptr + cols, mask=mask, other=0.0)
    tl.store(x_out_ptr + cols, hnorm.to(wb.dtype) * wb, mask=mask)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # engine/pdl.py: wait for the kernel before, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    xn = x * tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, xn.to(w.dtype) * w, mask=mask)


@triton.jit
def _rope_store_kv_kernel(qkv_ptr, pos_ptr, slot_ptr, inv_freq_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                          qkv_stride, n_q_heads, n_kv_heads, stride_slot, stride_head,
                          HALF: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # engine/pdl.py: wait for the kernel before, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + row).to(tl.float32)
    angle = pos * tl.load(inv_freq_ptr + d)
    cos, sin = tl.cos(angle), tl.sin(angle)
    base = qkv_ptr + row * qkv_stride + head * 2 * HALF
    x1 = tl.load(base + d).to(tl.float32)
    x2 = tl.load(base + HALF + d).to(tl.float32)
    if head < n_q_heads:
        out = q_out_ptr + (row * n_q_heads + head) * 2 * HALF
        tl.store(out + d, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty))
        tl.store(out + HALF + d, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty))
    else:
        kv_head = head - n_q_heads
        slot = tl.load(slot_ptr + row)
        dst = slot * stride_slot + kv_head * stride_head
        tl.store(k_cache_ptr + dst + d, (x1 * cos - x2 * sin).to(k_cache_ptr.dtype.element_ty))
        tl.store(k_cache_ptr + dst + HALF + d, (x2 * cos + x1 * sin).to(k_cache_ptr.dtype.element_ty))
        vsrc = qkv_ptr + row * qkv_stride + (n_q_heads + n_kv_heads + kv_head) * 2 * HALF
        tl.store(v_cache_ptr + dst + d, tl.load(vsrc + d))
        tl.store(v_cache_ptr + dst + HALF + d, tl.load(vsrc + HALF + d))


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # engine/pdl.py: wait for the kernel before, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < n_cols
    g = tl.load(gu_ptr + row * 2 * n_cols + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * n_cols + n_cols + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + col, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm2(h: torch.Tensor, y: torch.Tensor, w_branch: torch.Tensor, w_next: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # h, y: [rows, hidden] -> (h + rms(y) * w_branch, rms(that) * w_next)
    rows, n = h.shape
    h_out, x_out = torch.empty_like(h), torch.empty_like(h)
    if rows:
        _add_rms_norm2_kernel[(rows,)](h, y.contiguous(), w_branch, w_next, h_out, x_out, n, eps,
                                       BLOCK=triton.next_power_of_2(n), num_warps=8, **pdl.launch_kwargs(h.device))
    return h_out, x_out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    rows, n = x.shape
    out = torch.empty_like(x)
    if rows:
        _rms_norm_kernel[(rows,)](x.contiguous(), w, out, n, eps, BLOCK=triton.next_power_of_2(n), num_warps=8,
                                  **pdl.launch_kwargs(x.device))
    return out


def rope_store_kv(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, inv_freq: torch.Tensor,
                  k_plane: torch.Tensor, v_plane: torch.Tensor, n_q_heads: int, n_kv_heads: int,
                  head_dim: int) -> torch.Tensor:
    # qkv: [rows, (q + 2 kv heads) * d]; k_plane, v_plane: [slots, kv_heads, d] -> q after RoPE [rows, heads, d]
    rows = qkv.shape[0]
    q = torch.empty(rows, n_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if rows:
        _rope_store_kv_kernel[(rows, n_q_heads + n_kv_heads)](
            qkv, positions, slots, inv_freq, q, k_plane, v_plane, qkv.stride(0), n_q_heads, n_kv_heads,
            k_plane.stride(0), k_plane.stride(1), HALF=head_dim // 2, num_warps=1, **pdl.launch_kwargs(qkv.device))
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block, num_warps=4,
                                                        **pdl.launch_kwargs(gate_up.device))
    return out
