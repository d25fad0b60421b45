"""Skinny-batch GEMMs for the decode path (Triton, CUDA), with the elementwise work around them fused in.

At a few dozen rows a layer's GEMMs stream their weights and little else, and cuBLAS launches too few
programs for the small ones (o_proj: 2048 x 2048 in 32 tiles on 132 SMs). Two kernels replace three
GEMMs and two elementwise kernels of a layer (engine/fused_pass.py `run_loops`), and a third, where the
table turns it on, the qkv GEMM with the RoPE + K / V store kernel after it:
- `linear_partials` (o_proj, down_proj): x @ w.T split over K into fp32 partial sums [splits, rows, n],
  reduced by the add + norm kernel that reads the GEMM's output anyway (`add_rms_norm2_partials`): no
  separate split-K reduce kernel and no bf16 round trip of the GEMM output through memory.
- `gate_up_silu` (gate_up_proj + SiLU x up): both halves accumulated in one program, the product written
  once (half the output of the fused gate_up GEMM, and no silu_mul kernel).
- `qkv_rope_store` (qkv_proj + RoPE + the K / V store): a program holds dims of a head's first half and
  their rotation partners, so RoPE runs on its accumulators; q goes out, k and v go to their pool slots.
Rounding follows the reference path: each GEMM output is rounded to the model dtype before the norm or
the SiLU, as F.linear's output is; only the order of the fp32 accumulation differs.

Which rows counts use these kernels, and with which tiles, is `GemmConfig` from engine/gemm_dispatch.py's
`gemm_config(rows)` (tuned on the H200 by benchmarks/gemm_sweep.py); above its range the cuBLAS path stays. Its
`tma` field loads the weights (1), or the weights and the activations (2), through Hopper's tensor memory
accelerator: a tensor descriptor per matrix, built per launch (a graph captures it once), whose box loads Triton
pipelines with mbarriers instead of per-thread cp.async; out-of-range rows and K come back as zeros, as the masked
loads'.

The row count (M; the norm's `rows`) is not specialized (`do_not_specialize`): Triton would compile each kernel
three times, for 1 row, for multiples of 16 and for the rest. Compiled for sm90 at the decode shapes, those
variants' PTX differs by 2-16 of 350-3,700 instructions, none of them a load, store, MMA or vector width
(session 21, docs/benchmarks.md), and they were 13 of a cold start's ~51 compiles (~8 of its ~54 compile
seconds on the H200's host, session 20).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import pdl
from .gemm_dispatch import GemmConfig, gate_block_k, gate_stages, gemm_block_m, qkv_block_d
from .triton_fused import add_norm2_store


@triton.jit
def _tile(ptr, rows, n_rows, stride, k0, k_end, BLOCK_K: tl.constexpr):
    """rows x [k0, k0 + BLOCK_K) of a row-major matrix, zero past n_rows and past k_end (a split's or K's end)."""
    rk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(ptr + rows[:, None].to(tl.int64) * stride + rk[None, :],
                   mask=(rows[:, None] < n_rows) & (rk < k_end)[None, :], other=0.0)


@triton.jit
def _box(w, row0, rows, n_rows, stride_wn, k, K, BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    """Rows row0 + [0, len(rows)) x [k, k + BLOCK_K) of a row-major matrix: through w's TMA descriptor when
    TMA (zero past its shape), else from the pointer w (rows: row0 + arange, masked past n_rows and K)."""
    if TMA:
        return w.load([row0, k])
    else:
        return _tile(w, rows, n_rows, stride_wn, k, K, BLOCK_K)


@triton.jit
def _dot_pair(x_ptr, m0, rm, M, stride_xm, w, row_a, row_b, rows_a, rows_b, n_rows, stride_wn, K,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
              USE_PDL: tl.constexpr):
    """x[rm] @ w[row_a + i].T and x[rm] @ w[row_b + i].T, i < BLOCK_N, over all of K, fp32 (gate and up; a
    head's two halves). w: the weight matrix's TMA descriptor when TMA, else its pointer."""
    if USE_PDL:  # engine/pdl.py: wait for the kernel before, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = _box(x_ptr, m0, rm, M, stride_xm, k, K, BLOCK_K, TMA == 2)
        acc_a += tl.dot(x, tl.trans(_box(w, row_a, rows_a, n_rows, stride_wn, k, K, BLOCK_K, TMA > 0)))
        acc_b += tl.dot(x, tl.trans(_box(w, row_b, rows_b, n_rows, stride_wn, k, K, BLOCK_K, TMA > 0)))
    return acc_a, acc_b


@triton.jit
def silu_store(acc_g, acc_u, out_ptr, rm, rn, M, N):
    """gate_up's epilogue: silu(gate) * up of rows rm x columns rn into out [M, N] (past M or N: dropped)."""
    dtype = out_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)  # rounded as F.linear's output is, then silu_mul's math
    up = acc_u.to(dtype).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def rope_store(acc1, acc2, head, d, rm, M, pos_ptr, slot_ptr, inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, n_q_heads,
               n_kv_heads, stride_slot, stride_head, HALF: tl.constexpr):
    """qkv's epilogue: dims d of `head`'s first half (acc1) and their partners (acc2) for rows rm < M, RoPE'd where
    a q or k head, into q or the head's key or value slots."""
    rmask = rm < M
    dtype = q_ptr.dtype.element_ty
    x1 = acc1.to(dtype).to(tl.float32)  # the GEMM output in the model dtype, as F.linear's is
    x2 = acc2.to(dtype).to(tl.float32)
    if head < n_q_heads + n_kv_heads:  # q and k heads: RoPE, as triton_fused.rope_store_kv computes it
        pos = tl.load(pos_ptr + rm, mask=rmask, other=0).to(tl.float32)
        angle = pos[:, None] * tl.load(inv_freq_ptr + d)[None, :]
        cos, sin = tl.cos(angle), tl.sin(angle)
        x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    mask = rmask[:, None]
    if head < n_q_heads:
        out = q_ptr + (rm[:, None].to(tl.int64) * n_q_heads + head) * 2 * HALF + d[None, :]
        tl.store(out, x1.to(dtype), mask=mask)
        tl.store(out + HALF, x2.to(dtype), mask=mask)
    else:
        kv_head = (head - n_q_heads) % n_kv_heads
        slot = tl.load(slot_ptr + rm, mask=rmask, other=0).to(tl.int64)
        dst = slot[:, None] * stride_slot + kv_head * stride_head + d[None, :]
        if head < n_q_heads + n_kv_heads:
            tl.store(k_cache_ptr + dst, x1.to(dtype), mask=mask)
            tl.store(k_cache_ptr + dst + HALF, x2.to(dtype), mask=mask)
        else:
            tl.store(v_cache_ptr + dst, x1.to(dtype), mask=mask)
            tl.store(v_cache_ptr + dst + HALF, x2.to(dtype), mask=mask)


@triton.jit
def partial_tile(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    """This program's tile of the split-K partials (grid: column tiles, splits, row tiles): x[rm] @ w[rn].T over its
    split's K, fp32, stored into out [splits, M, N]; inlined (benchmarks/flow_kernels.py's fold kernel calls it too)."""
    pid_n, split, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = split * k_per_split  # k_per_split is a multiple of BLOCK_K: no block crosses two splits
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        a = _box(x_ptr, pid_m * BLOCK_M, rm, M, stride_xm, k_start + k, K, BLOCK_K, TMA == 2)
        b = _box(w_ptr, pid_n * BLOCK_N, rn, N, stride_wn, k_start + k, K, BLOCK_K, TMA > 0)
        acc += tl.dot(a, tl.trans(b))
    out = out_ptr + (split * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
    tl.store(out, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["M"])  # one compile for every row count
def _linear_partials_kernel(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
                            USE_PDL: tl.constexpr):
    if USE_PDL:  # engine/pdl.py: wait for the kernel before, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    partial_tile(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, TMA)


@triton.jit(do_not_specialize=["M"])  # one compile for every row count
def _gate_up_silu_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # gate rows rn, up rows N + rn. A partial last tile's columns past N: masked pointer loads, or (TMA) a gate
    # box that reads on into the up rows; either way the store below drops those columns.
    acc_g, acc_u = _dot_pair(x_ptr, pid_m * BLOCK_M, rm, M, stride_xm, w_ptr, pid_n * BLOCK_N, N + pid_n * BLOCK_N,
                             tl.where(rn < N, rn, 2 * N), tl.where(rn < N, N + rn, 2 * N), 2 * N, stride_wn, K,
                             BLOCK_M, BLOCK_N, BLOCK_K, TMA, USE_PDL)
    silu_store(acc_g, acc_u, out_ptr, rm, rn, M, N)


@triton.jit(do_not_specialize=["rows"])  # one compile for every row count
def _add_rms_norm2_partials_kernel(h_ptr, p_ptr, wa_ptr, wb_ptr, h_out_ptr, x_out_ptr, rows, n_cols, eps,
                                   SPLITS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # engine/pdl.py: wait for the kernel before, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        y += tl.load(p_ptr + (s * rows + row) * n_cols + cols, mask=mask, other=0.0)
    h = tl.load(h_ptr + row * n_cols + cols, mask=mask, other=0.0)
    y = y.to(h.dtype).to(tl.float32)  # the GEMM output in the model dtype, as the reference path has it
    add_norm2_store(y, h, wa_ptr, wb_ptr, h_out_ptr + row * n_cols, x_out_ptr + row * n_cols, cols, mask, n_cols, eps)


@triton.jit(do_not_specialize=["M"])  # one compile for every row count
def _qkv_rope_store_kernel(x_ptr, w_ptr, pos_ptr, slot_ptr, inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                           M, K, stride_xm, stride_wn, n_q_heads, n_kv_heads, stride_slot, stride_head,
                           HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
                           TMA: tl.constexpr, USE_PDL: tl.constexpr):
    # one program: BLOCK_D dims of one head's first half and their RoPE partners in the second half
    pid_c, pid_m = tl.program_id(0), tl.program_id(1)
    head = pid_c // (HALF // BLOCK_D)
    d0 = (pid_c % (HALF // BLOCK_D)) * BLOCK_D
    d = d0 + tl.arange(0, BLOCK_D)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    w_rows = head * 2 * HALF + d  # the first half's rows; their partners are HALF rows further
    n_rows = (n_q_heads + 2 * n_kv_heads) * 2 * HALF
    row0 = head * 2 * HALF + d0
    acc1, acc2 = _dot_pair(x_ptr, pid_m * BLOCK_M, rm, M, stride_xm, w_ptr, row0, row0 + HALF, w_rows, w_rows + HALF,
                           n_rows, stride_wn, K, BLOCK_M, BLOCK_D, BLOCK_K, TMA, USE_PDL)
    rope_store(acc1, acc2, head, d, rm, M, pos_ptr, slot_ptr, inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, n_q_heads,
               n_kv_heads, stride_slot, stride_head, HALF)


def _tma_ok(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can cover t [n, K]: a Hopper or later GPU (or CPU tensors: Triton's interpreter,
    which emulates TMA loads), a contiguous last dim, a 16-byte aligned base and row stride."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
            and (t.device.type == "cpu" or pdl.hopper(t.device)))


def _tma_args(x: torch.Tensor, w: torch.Tensor, block_m: int, block_rows: int, block_k: int,
              cfg: GemmConfig) -> tuple[object, object, int]:
    """(x argument, w argument, TMA) of a GEMM kernel: TMA 0 loads both through pointers; 1 loads the weights
    [n, K] in [block_rows, block_k] boxes through a TMA descriptor; 2 also the activations x [rows, K] in
    [block_m, block_k] boxes. What cfg.tma asks for, where the hardware and the layouts allow it."""
    if not cfg.tma or not _tma_ok(w):
        return x, w, 0
    w_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [block_rows, block_k])
    if cfg.tma < 2 or not _tma_ok(x):
        return x, w_desc, 1
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [block_m, block_k]), w_desc, 2


def linear_partials(x: torch.Tensor, w: torch.Tensor, splits: int, cfg: GemmConfig,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [rows, K], w: [N, K] -> fp32 partial sums [splits, rows, N] of x @ w.T (sum over dim 0), into `out` where
    given (contiguous, that shape: a slice of a larger partials buffer another call fills the rest of)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, K = x.shape
    N = w.shape[0]
    if out is None:
        out = torch.empty(splits, rows, N, dtype=torch.float32, device=x.device)
    elif out.shape != (splits, rows, N) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"linear_partials: out must be a contiguous float32 [{splits}, {rows}, {N}] tensor, got "
                         f"{out.dtype} {list(out.shape)}{'' if out.is_contiguous() else ', not contiguous'}")
    if rows:
        k_per_split = triton.cdiv(triton.cdiv(K, splits), cfg.block_k) * cfg.block_k
        bm = gemm_block_m(rows)
        grid = (triton.cdiv(N, cfg.block_n), splits, triton.cdiv(rows, bm))
        x_arg, w_arg, tma = _tma_args(x, w, bm, cfg.block_n, cfg.block_k, cfg)
        _linear_partials_kernel[grid](x_arg, w_arg, out, rows, N, K, k_per_split, x.stride(0), w.stride(0),
                                      BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, TMA=tma,
                                      num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_kwargs(x.device))
    return out


def gate_up_silu(x: torch.Tensor, w_gate_up: torch.Tensor, cfg: GemmConfig) -> torch.Tensor:
    """x: [rows, K], w_gate_up: [2 I, K] (gate rows, then up rows) -> silu(x @ gate.T) * (x @ up.T): [rows, I]."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, K = x.shape
    n = w_gate_up.shape[0] // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        bm = gemm_block_m(rows)
        grid = (triton.cdiv(n, cfg.block_n_gate), triton.cdiv(rows, bm))
        block_k = gate_block_k(cfg)
        x_arg, w_arg, tma = _tma_args(x, w_gate_up, bm, cfg.block_n_gate, block_k, cfg)
        _gate_up_silu_kernel[grid](x_arg, w_arg, out, rows, n, K, x.stride(0), w_gate_up.stride(0),
                                   BLOCK_M=bm, BLOCK_N=cfg.block_n_gate, BLOCK_K=block_k, TMA=tma,
                                   num_warps=cfg.num_warps, num_stages=gate_stages(cfg), **pdl.launch_kwargs(x.device))
    return out


def add_rms_norm2_partials(h: torch.Tensor, partials: torch.Tensor, w_branch: torch.Tensor,
                           w_next: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """triton_fused.add_rms_norm2 with y = the sum of `partials` [splits, rows, hidden] (fp32)."""
    rows, n = h.shape
    h_out, x_out = torch.empty_like(h), torch.empty_like(h)
    if rows:
        _add_rms_norm2_partials_kernel[(rows,)](h, partials, w_branch, w_next, h_out, x_out, rows, n, eps,
                                                SPLITS=partials.shape[0], BLOCK=triton.next_power_of_2(n),
                                                num_warps=8, **pdl.launch_kwargs(h.device))
    return h_out, x_out


def qkv_rope_store(x: torch.Tensor, w_qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   inv_freq: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor, n_q_heads: int,
                   n_kv_heads: int, head_dim: int, cfg: GemmConfig) -> torch.Tensor:
    """triton_fused.rope_store_kv(F.linear(x, w_qkv), ...) in one kernel: the qkv GEMM with RoPE and the K / V
    store in its epilogue. x: [rows, hidden], w_qkv: [(q + 2 kv heads) x d, hidden]; k_plane, v_plane:
    [slots, kv_heads, d] -> q after RoPE [rows, heads, d]. For the head sizes gemm_dispatch.qkv_block_d allows."""
    block_d = qkv_block_d(cfg, head_dim)
    if not block_d:
        raise ValueError(f"qkv_rope_store: no tile for head_dim={head_dim} with block_d_qkv={cfg.block_d_qkv}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, K = x.shape
    q = torch.empty(rows, n_q_heads, head_dim, dtype=x.dtype, device=x.device)
    if rows:
        half, bm = head_dim // 2, gemm_block_m(rows)
        grid = ((n_q_heads + 2 * n_kv_heads) * (half // block_d), triton.cdiv(rows, bm))
        x_arg, w_arg, tma = _tma_args(x, w_qkv, bm, block_d, cfg.block_k_qkv, cfg)
        _qkv_rope_store_kernel[grid](x_arg, w_arg, positions, slots, inv_freq, q, k_plane, v_plane, rows, K,
                                     x.stride(0), w_qkv.stride(0), n_q_heads, n_kv_heads, k_plane.stride(0),
                                     k_plane.stride(1), HALF=half, BLOCK_M=bm, BLOCK_D=block_d,
                                     BLOCK_K=cfg.block_k_qkv, TMA=tma, num_warps=cfg.num_warps,
                                     num_stages=cfg.num_stages, **pdl.launch_kwargs(x.device))
    return q
