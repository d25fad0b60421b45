"""Ouro's residual add + RMSNorm carried across a kernel boundary into the 64-row GEMMs around it (Triton, CUDA).

After o_proj and after down_proj a layer computes h' = h + rms(y) w_branch and x = rms(h') w_next (OURO.md), y the
GEMM's output. Both norms reduce whole rows, which the GEMM producing y computes in column tiles, so the kernels path
runs them as a kernel of their own (triton_gemm.add_rms_norm2_partials): two of a layer and loop's seven kernels,
2.55 us each on the H200 at N = 64 with next to nothing to read, and two kernel boundaries. Here (GemmConfig.carry_norm,
OUROBATCH_CARRY_NORM) the work moves into the GEMMs on either side:
- the producer (`linear_stats`: o_proj, down_proj) takes all of K in a program, carry_block_n columns a program, so no
  K-split partials need to meet (session 10's counter cost +2 us a producer): it writes y in the model dtype and four
  row sums over its columns into stats [4, tiles, rows]: S0 = sum h^2, S1 = sum y^2, S2 = sum h (w_branch y),
  S3 = sum (w_branch y)^2 (y as rounded);
- the consumers (`gate_up_silu_normed`, `qkv_rope_store_normed`) sum the stats in a fixed tile order (deterministic)
  to r_y = rsqrt(S1 / n + eps) and, from sum h'^2 = S0 + 2 r_y S2 + r_y^2 S3, r_h; then form each K block of their
  input as h' = h + (y r_y -> dtype) w_branch (-> dtype), x = (h' r_h -> dtype) w_next, the reference's roundings,
  reading h, y and both norm weights through TMA descriptors that Triton pipelines beside the weights (session 10's
  plain loads waited a round trip each). Program p writes the new residual's K blocks p, p + programs, ...
The one difference from the reference: sum h'^2 is of h + w_branch y r_y before its two roundings (relative ~1e-5 in
bf16; exact in float64, where tests/engine/test_norm_gemm_interpreted.py compares). One row tile (<= 64 rows), Hopper's
TMA; pending_norm.carries says when a call qualifies. benchmarks/norm_chain_probe.py times the chains both ways.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import pdl
from .gemm_dispatch import GemmConfig, gate_block_k, qkv_block_d
from .pending_norm import PendingNorm
from .triton_gemm import rope_store, silu_store

STAT_CHUNK = tl.constexpr(32)  # tiles of stats summed per load in the consumers' row scales
ROWS = 64  # the one row tile: the TMA boxes' rows


@triton.jit(do_not_specialize=["M"])  # one compile for every row count
def stats_kernel(a_desc, w_desc, h_ptr, wa_ptr, y_ptr, stats_ptr, M, N, K, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """y = a @ w.T over columns pid * BLOCK_N.. (all of K), y in bf16 and the tile's four row sums."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid, tiles = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        acc += tl.dot(a_desc.load([0, k]), tl.trans(w_desc.load([pid * BLOCK_N, k])))
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < M)[:, None]
    offs = rm[:, None] * N + rn[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, y, mask=mask)
    yf = y.to(tl.float32)
    h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    wy = tl.load(wa_ptr + rn).to(tl.float32)[None, :] * yf
    out = stats_ptr + pid * M + rm
    rmask = rm < M
    tl.store(out, tl.sum(h * h, 1), mask=rmask)
    tl.store(out + tiles * M, tl.sum(yf * yf, 1), mask=rmask)
    tl.store(out + 2 * tiles * M, tl.sum(h * wy, 1), mask=rmask)
    tl.store(out + 3 * tiles * M, tl.sum(wy * wy, 1), mask=rmask)

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

@triton.jit(do_not_specialize=["M"])  # one compile for every row count
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

@triton.jit(do_not_specialize=["M"])  # one compile for every row count
def normed_qkv_kernel(h_desc, y_desc, wa_desc, wb_desc, w_desc, stats_ptr, h_out_ptr, pos_ptr, slot_ptr,
                      inv_freq_ptr, q_ptr, k_cache_ptr, v_cache_ptr, M, K, n_tiles, eps, n_q_heads, n_kv_heads,
                      stride_slot, stride_head, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    head = pid // (HALF // BLOCK_D)
    d = (pid % (HALF // BLOCK_D)) * BLOCK_D + tl.arange(0, BLOCK_D)
    row0 = head * 2 * HALF + (pid % (HALF // BLOCK_D)) * BLOCK_D
    r_y, r_h = norm_scales(stats_ptr, M, n_tiles, K, eps, BLOCK_M, TILES)
    acc1, acc2 = normed_dot_pair(h_desc, y_desc, wa_desc, wb_desc, w_desc, h_out_ptr, r_y, r_h, row0,
                                 row0 + HALF, M, K, BLOCK_M, BLOCK_D, BLOCK_K)
    rope_store(acc1, acc2, head, d, tl.arange(0, BLOCK_M), M, pos_ptr, slot_ptr, inv_freq_ptr, q_ptr,
               k_cache_ptr, v_cache_ptr, n_q_heads, n_kv_heads, stride_slot, stride_head, HALF)


def _desc(t: torch.Tensor, box: list[int]) -> TensorDescriptor:
    return TensorDescriptor(t, list(t.shape), list(t.stride()), box)


def _stages(cfg: GemmConfig) -> int:
    return cfg.carry_stages or cfg.num_stages


def linear_stats(a: torch.Tensor, w: torch.Tensor, h: torch.Tensor, w_branch: torch.Tensor, w_next: torch.Tensor,
                 eps: float, cfg: GemmConfig) -> PendingNorm:
    """a [rows, K] @ w [N, K].T = y with the row sums a consumer needs: the PendingNorm of h + rms(y) w_branch and
    its norm by w_next. Tiles: cfg.carry_block_n columns a program, K steps of cfg.carry_block_k."""
    a = a if a.stride(-1) == 1 else a.contiguous()
    rows, k = a.shape
    n, bn, bk = w.shape[0], cfg.carry_block_n, cfg.carry_block_k
    if n % bn or k % bk or not 0 < rows <= ROWS:
        raise ValueError(f"linear_stats: N={n} must divide by carry_block_n={bn}, K={k} by carry_block_k={bk}, "
                         f"and rows={rows} be 1-{ROWS}")
    y = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    stats = torch.empty(4, n // bn, rows, dtype=torch.float32, device=a.device)
    stats_kernel[(n // bn,)](_desc(a, [ROWS, bk]), _desc(w, [bn, bk]), h, w_branch, y, stats, rows, n, k,
                             BLOCK_M=ROWS, BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg.num_warps, num_stages=_stages(cfg),
                             **pdl.launch_kwargs(a.device))
    return PendingNorm(h, y, stats, w_branch, w_next, eps)


def _consumer_args(p: PendingNorm, w: torch.Tensor, block_rows: int, block_k: int) -> tuple:
    """The TMA descriptors of h, y, both norm weights and the consumer's weights, then the stats."""
    return (_desc(p.h, [ROWS, block_k]), _desc(p.y, [ROWS, block_k]), _desc(p.w_branch.view(1, -1), [1, block_k]),
            _desc(p.w_next.view(1, -1), [1, block_k]), _desc(w, [block_rows, block_k]), p.stats)


def _tiles(n_tiles: int) -> int:
    """The stats' tile count rounded up to whole STAT_CHUNKs (the consumers' constexpr)."""
    return triton.cdiv(n_tiles, STAT_CHUNK.value) * STAT_CHUNK.value


def gate_up_silu_normed(p: PendingNorm, w_gate_up: torch.Tensor, cfg: GemmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(x @ gate.T) * (x @ up.T), h') with x and h' those of `p` (triton_gemm.gate_up_silu's tiles)."""
    rows, k = p.h.shape
    n, bn, bk = w_gate_up.shape[0] // 2, cfg.block_n_gate, gate_block_k(cfg)
    if n % bn or k % bk:
        raise ValueError(f"gate_up_silu_normed: intermediate={n} must divide by block_n_gate={bn}, K={k} by {bk}")
    out, h_out = torch.empty(rows, n, dtype=p.h.dtype, device=p.h.device), torch.empty_like(p.h)
    tiles = p.stats.shape[1]
    normed_gate_kernel[(n // bn,)](*_consumer_args(p, w_gate_up, bn, bk), h_out, out, rows, n, k, tiles, p.eps,
                                   BLOCK_M=ROWS, BLOCK_N=bn, BLOCK_K=bk, TILES=_tiles(tiles), num_warps=cfg.num_warps,
                                   num_stages=_stages(cfg), **pdl.launch_kwargs(out.device))
    return out, h_out


def qkv_rope_store_normed(p: PendingNorm, w_qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                          inv_freq: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor, n_q_heads: int,
                          n_kv_heads: int, head_dim: int, cfg: GemmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(q after RoPE [rows, heads, d], h') with x and h' those of `p`; k and v go to their slots
    (triton_gemm.qkv_rope_store's epilogue and tiles)."""
    block_d = qkv_block_d(cfg, head_dim)
    rows, k = p.h.shape
    if not block_d or k % cfg.block_k_qkv:
        raise ValueError(f"qkv_rope_store_normed: no tile for head_dim={head_dim} (block_d_qkv={cfg.block_d_qkv}) "
                         f"or K={k} not a multiple of block_k_qkv={cfg.block_k_qkv}")
    half, tiles = head_dim // 2, p.stats.shape[1]
    q = torch.empty(rows, n_q_heads, head_dim, dtype=p.h.dtype, device=p.h.device)
    h_out = torch.empty_like(p.h)
    grid = ((n_q_heads + 2 * n_kv_heads) * (half // block_d),)
    normed_qkv_kernel[grid](*_consumer_args(p, w_qkv, block_d, cfg.block_k_qkv), h_out, positions, slots, inv_freq, q,
                            k_plane, v_plane, rows, k, tiles, p.eps, n_q_heads, n_kv_heads, k_plane.stride(0),
                            k_plane.stride(1), HALF=half, BLOCK_M=ROWS, BLOCK_D=block_d, BLOCK_K=cfg.block_k_qkv,
                            TILES=_tiles(tiles), num_warps=cfg.num_warps, num_stages=_stages(cfg),
                            **pdl.launch_kwargs(q.device))
    return q, h_out
