"""Ouro's residual add + RMSNorm carried across a kernel boundary, so it costs no kernel of its own (Triton, CUDA).

After o_proj and after down_proj a layer computes h' = h + rms(y) * w_branch and x = rms(h') * w_next, where
y is the GEMM's output (OURO.md). Both norms reduce over whole rows, which the GEMM producing y computes in
column tiles, so the fused path ran them as one kernel of their own (triton_gemm.add_rms_norm2_partials):
two per layer and loop, ~2.8 us each at N = 8 on the H200, with nothing to read but a few rows
(docs/benchmarks.md, session 9). Here the add + norm is split between the GEMM before and the GEMM after:

- `linear_stats` (the producer, o_proj / down_proj): y = a @ w.T split over K; the last program of each
  column tile to finish (a counter per tile, reset by it) sums the tile's partials in a fixed order, writes
  y in the model dtype and four row sums over its columns into `stats` [tiles, 4, rows]:
  S0 = sum h^2, S1 = sum y^2, S2 = sum h (w_branch y), S3 = sum (w_branch y)^2 (y as rounded, fp32).
- The consumer (triton_gemm's gate_up + SiLU and qkv + RoPE + store, `PendingNorm` as their input) sums
  the tiles' stats per row (a fixed order: deterministic), so r_y = rsqrt(S1 / n + eps), and
  sum h'^2 = S0 + 2 r_y S2 + r_y^2 S3 gives r_h = rsqrt(sum h'^2 / n + eps), before its K loop; then each
  K block of its input is h' = h + (y r_y -> dtype) * w_branch (-> dtype), x = (h' r_h -> dtype) * w_next, the
  reference's own elementwise rounding. One program column writes h', the next residual.
The one difference from the reference: sum h'^2 is of h + w_branch y r_y before its two roundings to the
model dtype (relative ~1e-5 in bf16; exact in float64, where the interpreter tests compare it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl
from .gemm_dispatch import GemmConfig

NUM_STATS = 4  # S0..S3 above


@dataclass(frozen=True)
class PendingNorm:
    """x = rms(h + rms(y) * w_branch) * w_next, and h' = h + rms(y) * w_branch, not computed yet: the next
    GEMM computes them as it reads its input (`stats` from linear_stats), or `resolve` does."""

    h: torch.Tensor  # [rows, n] the residual before the add
    y: torch.Tensor  # [rows, n] the GEMM output, in the model dtype
    stats: torch.Tensor  # [tiles, 4, rows] fp32 row sums over each column tile (module docstring)
    w_branch: torch.Tensor  # [n] the branch's norm weight (input_layernorm_2 / post_attention_layernorm_2)
    w_next: torch.Tensor  # [n] the next norm's weight (post_attention_layernorm / the next input_layernorm)
    eps: float

    def resolve(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(h', x) by the add + norm kernel itself (a consumer that cannot fuse it, and each loop's readout)."""
        from . import triton_fused

        return triton_fused.add_rms_norm2(self.h, self.y, self.w_branch, self.w_next, self.eps)


@triton.jit
def _tile(ptr, rows, n_rows, stride, k0, k_end, BLOCK_K: tl.constexpr):
    """rows x [k0, k0 + BLOCK_K) of a row-major matrix, zero past n_rows and past k_end (a split's or K's end)."""
    rk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(ptr + rows[:, None].to(tl.int64) * stride + rk[None, :],
                   mask=(rows[:, None] < n_rows) & (rk < k_end)[None, :], other=0.0)


@triton.jit
def _norm_scales(stats_ptr, rm, M, n_tiles, n_cols, eps, TILES: tl.constexpr):
    """(r_y, r_h) [BLOCK_M] of rows rm from the producer's per-tile row sums (module docstring)."""
    t = tl.arange(0, TILES)
    mask = (t < n_tiles)[:, None] & (rm < M)[None, :]
    base = stats_ptr + (t[:, None] * 4).to(tl.int64) * M + rm[None, :]
    s0 = tl.sum(tl.load(base, mask=mask, other=0.0), 0)
    s1 = tl.sum(tl.load(base + M, mask=mask, other=0.0), 0)
    s2 = tl.sum(tl.load(base + 2 * M, mask=mask, other=0.0), 0)
    s3 = tl.sum(tl.load(base + 3 * M, mask=mask, other=0.0), 0)
    r_y = tl.rsqrt(s1 / n_cols + eps)
    ss = tl.maximum(s0 + 2.0 * r_y * s2 + r_y * r_y * s3, 0.0)
    return r_y, tl.rsqrt(ss / n_cols + eps)


@triton.jit
def _normed_tile(h_ptr, y_ptr, wa_ptr, wb_ptr, rm, M, stride, k0, K, r_y, r_h, BLOCK_K: tl.constexpr):
    """(x, h') over rows rm x [k0, k0 + BLOCK_K): the add + norm of triton_fused.add_rms_norm2, elementwise,
    with the row scales of _norm_scales."""
    rk = k0 + tl.arange(0, BLOCK_K)
    kmask = rk < K
    wa = tl.load(wa_ptr + rk, mask=kmask, other=0.0)
    wb = tl.load(wb_ptr + rk, mask=kmask, other=0.0)
    h = _tile(h_ptr, rm, M, stride, k0, K, BLOCK_K)
    y = _tile(y_ptr, rm, M, stride, k0, K, BLOCK_K).to(tl.float32)
    branch = ((y * r_y[:, None]).to(wa.dtype) * wa[None, :]).to(tl.float32)
    h_new = (h.to(tl.float32) + branch).to(h.dtype)
    x = (h_new.to(tl.float32) * r_h[:, None]).to(wb.dtype) * wb[None, :]
    return x, h_new


@triton.jit
def _stats_epilogue(acc, rm, rn, M, N, h_ptr, wa_ptr, y_ptr, stats_ptr, tile):
    """Write y = acc in y's dtype and this column tile's four row sums (module docstring)."""
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, y, mask=mask)
    yf = y.to(tl.float32)
    h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    wy = tl.load(wa_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :] * yf
    out = stats_ptr + (tile * 4).to(tl.int64) * M + rm
    rmask = rm < M
    tl.store(out, tl.sum(h * h, 1), mask=rmask)
    tl.store(out + M, tl.sum(yf * yf, 1), mask=rmask)
    tl.store(out + 2 * M, tl.sum(h * wy, 1), mask=rmask)
    tl.store(out + 3 * M, tl.sum(wy * wy, 1), mask=rmask)


@triton.jit
def _linear_stats_kernel(a_ptr, w_ptr, h_ptr, wa_ptr, part_ptr, count_ptr, y_ptr, stats_ptr, M, N, K, k_per_split,
                         stride_am, stride_wn, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # engine/pdl.py: wait for the kernel before, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_n, split, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = split * k_per_split  # k_per_split is a multiple of BLOCK_K: no block crosses two splits
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        a = _tile(a_ptr, rm, M, stride_am, k_start + k, K, BLOCK_K)
        acc += tl.dot(a, tl.trans(_tile(w_ptr, rn, N, stride_wn, k_start + k, K, BLOCK_K)))
    if SPLITS == 1:
        _stats_epilogue(acc, rm, rn, M, N, h_ptr, wa_ptr, y_ptr, stats_ptr, pid_n)
    else:
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        offs = rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(part_ptr + split * M * N + offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the counter says so (release, gpu scope)
        counter = count_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:  # the tile's last split
            tl.debug_barrier()
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLITS):  # a fixed order, whichever split came last: deterministic
                total += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(counter, 0)  # ready for the next launch (no other program of this one touches it)
            _stats_epilogue(total, rm, rn, M, N, h_ptr, wa_ptr, y_ptr, stats_ptr, pid_n)


def _block_m(rows: int) -> int:
    # tl.dot needs 16 rows at least (padding rows are masked); past 64 rows the rows are tiled
    return min(64, max(16, triton.next_power_of_2(rows)))


def counters(device: torch.device) -> torch.Tensor:
    """A zeroed int32 buffer for linear_stats' per-tile counters (each launch leaves it zeroed again)."""
    return torch.zeros(4096, dtype=torch.int32, device=device)


def linear_stats(a: torch.Tensor, w: torch.Tensor, h: torch.Tensor, w_branch: torch.Tensor, w_next: torch.Tensor,
                 eps: float, splits: int, cfg: GemmConfig, count: torch.Tensor) -> PendingNorm:
    """a: [rows, K], w: [N, K], h: [rows, N] -> the PendingNorm of h + rms(a @ w.T) * w_branch, x its norm
    by w_next. `count`: a `counters` buffer (no other launch may use it at the same time)."""
    a = a if a.stride(-1) == 1 else a.contiguous()
    rows, K = a.shape
    N = w.shape[0]
    bm, tiles = _block_m(rows), triton.cdiv(N, cfg.block_n)
    y = torch.empty(rows, N, dtype=a.dtype, device=a.device)
    stats = torch.empty(tiles, 4, rows, dtype=torch.float32, device=a.device)
    if rows:
        m_tiles = triton.cdiv(rows, bm)
        if m_tiles * tiles > count.numel():
            raise ValueError(f"linear_stats: {m_tiles * tiles} tile counters needed, the buffer has {count.numel()}")
        part = torch.empty(splits if splits > 1 else 0, rows, N, dtype=torch.float32, device=a.device)
        k_per_split = triton.cdiv(triton.cdiv(K, splits), cfg.block_k) * cfg.block_k
        _linear_stats_kernel[(tiles, splits, m_tiles)](
            a, w, h, w_branch, part, count, y, stats, rows, N, K, k_per_split, a.stride(0), w.stride(0),
            SPLITS=splits, BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **pdl.launch_kwargs(a.device))
    return PendingNorm(h, y, stats, w_branch, w_next, eps)
