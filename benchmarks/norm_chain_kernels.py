"""The kernels of benchmarks/norm_chain_probe.py (its docstring says what they compute and why): Triton imported at
the top, so the probe imports this module only where it runs them."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.triton_gemm import rope_store, silu_store

STAT_CHUNK = tl.constexpr(32)  # tiles of stats summed per load in the consumers' row scales


@triton.jit
def _produce_y(a_desc, w_desc, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y = a @ w.T over columns pid * BLOCK_N.. (all of K), stored in bf16 -> (y as float32, its columns, the rows'
    mask, the tile's offsets)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        acc += tl.dot(a_desc.load([0, k]), tl.trans(w_desc.load([tl.program_id(0) * BLOCK_N, k])))
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < M)[:, None]
    offs = rm[:, None] * N + rn[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, y, mask=mask)
    return y.to(tl.float32), rn, mask, offs


@triton.jit
def _store_sums(stats_ptr, h, yf, wy, M, BLOCK_M: tl.constexpr):
    """The tile's four row sums (S0 = sum h^2, S1 = sum y^2, S2 = sum h w y, S3 = sum (w y)^2) into stats."""
    rm = tl.arange(0, BLOCK_M)
    out = stats_ptr + tl.program_id(0) * M + rm
    tiles, rmask = tl.num_programs(0), rm < M
    tl.store(out, tl.sum(h * h, 1), mask=rmask)
    tl.store(out + tiles * M, tl.sum(yf * yf, 1), mask=rmask)
    tl.store(out + 2 * tiles * M, tl.sum(h * wy, 1), mask=rmask)
    tl.store(out + 3 * tiles * M, tl.sum(wy * wy, 1), mask=rmask)


@triton.jit(do_not_specialize=["M"])  # one compile for every row count, as the engine's
def stats_kernel(a_desc, w_desc, h_ptr, wa_ptr, y_ptr, stats_ptr, M, N, K, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """y = a @ w.T over columns pid * BLOCK_N.. (all of K), y in bf16 and the tile's four row sums."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    yf, rn, mask, offs = _produce_y(a_desc, w_desc, y_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K)
    h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    wy = tl.load(wa_ptr + rn).to(tl.float32)[None, :] * yf
    _store_sums(stats_ptr, h, yf, wy, M, BLOCK_M)


@triton.jit
def norm_scales(stats_ptr, M, n_tiles, n_cols, eps, BLOCK_M: tl.constexpr, TILES: tl.constexpr):
    """(r_y, r_h) of the rows from the producer's stats, summed in a fixed tile order."""
    rm = tl.arange(0, BLOCK_M)
    s0 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    s1, s2, s3 = s0, s0, s0
    for c in tl.static_range(0, TILES, STAT_CHUNK):
        t = c + tl.arange(0, STAT_CHUNK)
        mask = (t < n_tiles)[:, None] & (rm < M)[None, :]
        base = stats_ptr + t[:, None] * M + rm[None, :]
        s0 += tl.sum(tl.load(base, mask=mask, other=0.0), 0)
        s1 += tl.sum(tl.load(base + n_tiles * M, mask=mask, other=0.0), 0)
        s2 += tl.sum(tl.load(base + 2 * n_tiles * M, mask=mask, other=0.0), 0)
        s3 += tl.sum(tl.load(base + 3 * n_tiles * M, mask=mask, other=0.0), 0)
    r_y = tl.rsqrt(s1 / n_cols + eps)
    return r_y, tl.rsqrt(tl.maximum(s0 + 2.0 * r_y * s2 + r_y * r_y * s3, 0.0) / n_cols + eps)


@triton.jit
def normed_dot_pair(h_desc, y_desc, wa_desc, wb_desc, w_desc, h_out_ptr, r_y, r_h, row_a, row_b, M, K,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x @ w[row_a + i].T and x @ w[row_b + i].T (i < BLOCK_N), x = rms(h + rms(y) wa) wb formed block by
    block; this program writes the new residual's K blocks pid, pid + programs, ..."""
    pid, n_prog = tl.program_id(0), tl.num_programs(0)
    rm = tl.arange(0, BLOCK_M)
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        wa = wa_desc.load([0, k])
        wb = wb_desc.load([0, k])
        branch = ((y_desc.load([0, k]).to(tl.float32) * r_y[:, None]).to(wa.dtype) * wa).to(tl.float32)
        h_new = (h_desc.load([0, k]).to(tl.float32) + branch).to(h_out_ptr.dtype.element_ty)
        if (k // BLOCK_K) % n_prog == pid:
            cols = k + tl.arange(0, BLOCK_K)
            tl.store(h_out_ptr + rm[:, None] * K + cols[None, :], h_new, mask=(rm < M)[:, None])
        x = (h_new.to(tl.float32) * r_h[:, None]).to(wb.dtype) * wb
        acc_a += tl.dot(x, tl.trans(w_desc.load([row_a, k])))
        acc_b += tl.dot(x, tl.trans(w_desc.load([row_b, k])))
    return acc_a, acc_b


@triton.jit(do_not_specialize=["M"])  # one compile for every row count, as the engine's
def normed_gate_kernel(h_desc, y_desc, wa_desc, wb_desc, w_desc, stats_ptr, h_out_ptr, out_ptr, M, N, K,
                       n_tiles, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       TILES: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    r_y, r_h = norm_scales(stats_ptr, M, n_tiles, K, eps, BLOCK_M, TILES)
    acc_g, acc_u = normed_dot_pair(h_desc, y_desc, wa_desc, wb_desc, w_desc, h_out_ptr, r_y, r_h,
                                   pid * BLOCK_N, N + pid * BLOCK_N, M, K, BLOCK_M, BLOCK_N, BLOCK_K)
    silu_store(acc_g, acc_u, out_ptr, tl.arange(0, BLOCK_M), pid * BLOCK_N + tl.arange(0, BLOCK_N), M, N)


@triton.jit
def _qkv_program(HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """This qkv program's head, its BLOCK_D dims of the head's first half, and their first weight row."""
    pid = tl.program_id(0)
    head = pid // (HALF // BLOCK_D)
    d0 = (pid % (HALF // BLOCK_D)) * BLOCK_D
    return head, d0 + tl.arange(0, BLOCK_D), head * 2 * HALF + d0


@triton.jit(do_not_specialize=["M"])  # one compile for every row count, as the engine's
def normed_qkv_kernel(h_desc, y_desc, wa_desc, wb_desc, w_desc, stats_ptr, h_out_ptr, pos_ptr, slot_ptr,
                      inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, M, K, n_tiles, eps, n_q_heads, n_kv_heads,
                      stride_slot, stride_head, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    head, d, row0 = _qkv_program(HALF, BLOCK_D)
    r_y, r_h = norm_scales(stats_ptr, M, n_tiles, K, eps, BLOCK_M, TILES)
    acc1, acc2 = normed_dot_pair(h_desc, y_desc, wa_desc, wb_desc, w_desc, h_out_ptr, r_y, r_h, row0,
                                 row0 + HALF, M, K, BLOCK_M, BLOCK_D, BLOCK_K)
    rope_store(acc1, acc2, head, d, tl.arange(0, BLOCK_M), M, pos_ptr, slot_ptr, inv_freq_ptr, q_ptr,
               k_cache_ptr, v_cache_ptr, n_q_heads, n_kv_heads, stride_slot, stride_head, HALF)


# The stacked way (session 40): no elementwise work in the consumer's K loop. With x = r_h (h + r_y wa y) wb (r_y,
# r_h the rows' two rsqrt scales), x @ w.T = r_h (A1 @ w.T + r_y A2 @ w.T) for A1 = h wb and A2 = (wa y) wb, both
# known to the producer column by column. The producer writes them stacked (ab: [2 x 64, N], A1's rows first), the
# consumer multiplies the 128 rows against each weight box once (M = 128) and scales the rows in its epilogue.


@triton.jit(do_not_specialize=["M"])  # one compile for every row count, as the engine's
def stacked_stats_kernel(a_desc, w_desc, h_ptr, wa_ptr, wb_ptr, y_ptr, ab_ptr, stats_ptr, h_out_ptr, prev_y_ptr,
                         prev_wa_ptr, prev_stats_ptr, prev_tiles, eps, M, N, K, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FORM_H: tl.constexpr, TILES: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """stats_kernel's y and row sums, and the tile's columns of A1 = h wb and A2 = (wa y) wb into ab (bf16). FORM_H:
    h is first formed from the chain before's (h_ptr + rms(prev y) prev wa, its rows' rsqrt from prev stats, with
    the add + norm kernel's roundings) and stored into h_out: the residual the stacked consumers do not form."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    yf, rn, mask, offs = _produce_y(a_desc, w_desc, y_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K)
    h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if FORM_H:
        prev_r_y, _ = norm_scales(prev_stats_ptr, M, prev_tiles, N, eps, BLOCK_M, TILES)
        prev_y = tl.load(prev_y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        prev_wa = tl.load(prev_wa_ptr + rn)
        branch = ((prev_y * prev_r_y[:, None]).to(prev_wa.dtype) * prev_wa[None, :]).to(tl.float32)
        h = (h + branch).to(h_out_ptr.dtype.element_ty).to(tl.float32)  # the residual's dtype, as add_norm2_store
        tl.store(h_out_ptr + offs, h.to(h_out_ptr.dtype.element_ty), mask=mask)
    wy = tl.load(wa_ptr + rn).to(tl.float32)[None, :] * yf
    wb = tl.load(wb_ptr + rn).to(tl.float32)[None, :]
    tl.store(ab_ptr + offs, (h * wb).to(ab_ptr.dtype.element_ty), mask=mask)
    tl.store(ab_ptr + BLOCK_M * N + offs, (wy * wb).to(ab_ptr.dtype.element_ty), mask=mask)
    _store_sums(stats_ptr, h, yf, wy, M, BLOCK_M)


@triton.jit
def _rescaled(acc, r_y, r_h, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """r_h (A1 @ w.T + r_y A2 @ w.T) from the stacked accumulator's two halves."""
    top, bottom = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_M, BLOCK_N)), (1, 2, 0)))
    return r_h[:, None] * (top + r_y[:, None] * bottom)


@triton.jit(do_not_specialize=["M"])  # one compile for every row count, as the engine's
def stacked_gate_kernel(ab_desc, w_desc, stats_ptr, out_ptr, M, N, K, n_tiles, eps, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr, USE_PDL: tl.constexpr):
    """silu(x @ gate.T) * (x @ up.T) for x = rms(h + rms(y) wa) wb: the stacked A1, A2 rows against each gate and
    up box once, the rows' scales after the loop."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    acc_g = tl.zeros((2 * BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((2 * BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = ab_desc.load([0, k])
        acc_g += tl.dot(x, tl.trans(w_desc.load([pid * BLOCK_N, k])))
        acc_u += tl.dot(x, tl.trans(w_desc.load([N + pid * BLOCK_N, k])))
    r_y, r_h = norm_scales(stats_ptr, M, n_tiles, K, eps, BLOCK_M, TILES)
    silu_store(_rescaled(acc_g, r_y, r_h, BLOCK_M, BLOCK_N), _rescaled(acc_u, r_y, r_h, BLOCK_M, BLOCK_N), out_ptr,
               tl.arange(0, BLOCK_M), pid * BLOCK_N + tl.arange(0, BLOCK_N), M, N)


@triton.jit(do_not_specialize=["M"])  # one compile for every row count, as the engine's
def stacked_qkv_kernel(ab_desc, w_desc, stats_ptr, pos_ptr, slot_ptr, inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                       M, K, n_tiles, eps, n_q_heads, n_kv_heads, stride_slot, stride_head, HALF: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """normed_qkv_kernel's output (q after RoPE; k, v into their slots) from the stacked A1, A2 rows."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    head, d, row0 = _qkv_program(HALF, BLOCK_D)
    acc1 = tl.zeros((2 * BLOCK_M, BLOCK_D), dtype=tl.float32)
    acc2 = tl.zeros((2 * BLOCK_M, BLOCK_D), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = ab_desc.load([0, k])
        acc1 += tl.dot(x, tl.trans(w_desc.load([row0, k])))
        acc2 += tl.dot(x, tl.trans(w_desc.load([row0 + HALF, k])))
    r_y, r_h = norm_scales(stats_ptr, M, n_tiles, K, eps, BLOCK_M, TILES)
    rope_store(_rescaled(acc1, r_y, r_h, BLOCK_M, BLOCK_D), _rescaled(acc2, r_y, r_h, BLOCK_M, BLOCK_D), head, d,
               tl.arange(0, BLOCK_M), M, pos_ptr, slot_ptr, inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, n_q_heads,
               n_kv_heads, stride_slot, stride_head, HALF)
