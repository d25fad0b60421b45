"""Kernels of benchmarks/flow_probe.py (Triton, CUDA; Triton's interpreter runs them one launch after the other, so
a count or a ticket is always complete when read there):
- `attention_count_kernel`: the decode attention, each program adding 1 to its kv head's count once its output row
  is stored (a CTA barrier, then a release add at GPU scope);
- `partials_after_counts_kernel`: o_proj's split-K partials, each program spinning (acquire loads) until the counts
  of its split's kv heads reach the request count instead of waiting at ``griddepcontrol.wait`` for the whole
  attention grid, then fencing the async proxy (its activations come in through TMA) and running as the engine's
  linear_partials does, to the bit (its splits even, or uneven by head);
- `partials_norm_kernel`: a split-K GEMM and the add + norm after it in one launch, behind a ticket;
- STAMP: both counted kernels store the GPU's timer at their programs' start and end (flow_trace.py reads them).

The idea: with programmatic dependent launch (engine/pdl.py) o_proj's split s waits for every attention program,
though it reads only heads [s K / S, (s + 1) K / S), and the attention's grid runs a head's requests one after the
other (the sequence is its fastest axis). Measured on an H100 (docs/benchmarks.md, session 38): the heads end within
~1 us of each other, since all 1,024 programs of the N = 64 call are resident at once, and the counted edge ties.

Why no program waits forever: o_proj's grid launches only once every attention program has run its
``launch_dependents`` (after its own wait), so every program it waits for is resident or done; and a split-K grid's
next kernel launches only once all its programs have run theirs, so no ticket waits on a program that cannot start.
Every value a count guards was stored after that program's own PDL wait, so whatever the kernels before the attention
wrote is visible too; the add + norm after o_proj waits for o_proj's grid as before, and every attention program has
stored its row by then.
"""
from __future__ import annotations

import triton
import triton.language as tl

from engine.pdl_wait import wait_after
from engine.triton_attention import _attend_keys
from engine.triton_fused import add_norm2_store
from engine.triton_gemm import _box, partial_tile


@triton.jit
def _now(token):
    """The GPU's global timer (ns) once `token` (an int32 scalar) is computed."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [token], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def attention_count_kernel(q_ptr, k_ptr, v_ptr, o_ptr, count_ptr, stamp_ptr, block_tables_ptr, context_lens_ptr,
                           query_start_ptr, stride_q_row, stride_q_head, stride_o_row, stride_o_head, stride_k_block,
                           stride_k_slot, stride_k_head, stride_bt, qk_scale, GROUP: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                           META_EARLY: tl.constexpr, STAMP: tl.constexpr, USE_PDL: tl.constexpr):
    """engine.triton_attention._paged_attention_kernel's one-row call (one M tile, no key split, sequence-fastest
    grid (seqs, kv heads)), then `count[kv_head] += 1` once the output is stored. STAMP: the program's start (past
    its wait) and end times go to stamp [seq + seqs x kv_head, 2] (int64, ns)."""
    if USE_PDL and not META_EARLY:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    q_begin = tl.load(query_start_ptr + seq)
    n_q = tl.load(query_start_ptr + seq + 1) - q_begin
    ctx = tl.load(context_lens_ptr + seq)
    last_row = tl.minimum((BLOCK_M - 1) // GROUP, n_q - 1)
    hi = tl.where(n_q > 0, ctx - n_q + last_row + 1, 0)
    if USE_PDL and META_EARLY:  # the host's lengths and block ids before the wait, as the engine's launch
        first = tl.load(block_tables_ptr + seq * stride_bt + tl.arange(0, BLOCK_N) // PAGE,
                        mask=tl.arange(0, BLOCK_N) < hi, other=0)
        wait_after(tl.sum(first, 0) + q_begin + n_q + ctx)
    if STAMP:
        t0 = _now(n_q)
    offs_m = tl.arange(0, BLOCK_M)
    row = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    m_valid = row < n_q
    offs_d = tl.arange(0, HEAD_DIM)
    q_row = (q_begin + row).to(tl.int64)
    q = tl.load(q_ptr + q_row[:, None] * stride_q_row + head[:, None] * stride_q_head + offs_d[None, :],
                mask=m_valid[:, None], other=0.0)
    acc, m_i, l_i = _attend_keys(q, ctx - n_q + row, 0, hi, k_ptr, v_ptr, block_tables_ptr, seq, stride_bt, kv_head,
                                 stride_k_block, stride_k_slot, stride_k_head, qk_scale, BLOCK_M, BLOCK_N, PAGE,
                                 HEAD_DIM, False)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = q_row[:, None] * stride_o_row + head[:, None] * stride_o_head + offs_d[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=m_valid[:, None])
    tl.debug_barrier()  # every thread's stores before the release
    done = tl.atomic_add(count_ptr + kv_head, 1, sem="release", scope="gpu")
    if STAMP:
        stamp = stamp_ptr + 2 * (seq + tl.num_programs(0) * kv_head)
        tl.store(stamp, t0)
        tl.store(stamp + 1, _now(done))


@triton.jit
def _wait_counts(count_ptr, first, last, target, FENCE: tl.constexpr):
    """Spin until count[first..last) all reach `target` (acquire); then, where FENCE, order the async proxy (TMA)
    after it."""
    seen = target
    for g in range(first, last):
        seen = tl.atomic_add(count_ptr + g, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(count_ptr + g, 0, sem="acquire", scope="gpu")
    if FENCE:
        seen = tl.inline_asm_elementwise("fence.proxy.async.global; mov.b32 $0, $1;", "=r,r", [seen], dtype=tl.int32,
                                         is_pure=False, pack=1)
    return seen


@triton.jit(do_not_specialize=["M"])
def partials_after_counts_kernel(x_ptr, w_ptr, out_ptr, count_ptr, starts_ptr, stamp_ptr, target, M, N, K,
                                 stride_xm, stride_wn, HEAD_COLS: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
                                 FENCE: tl.constexpr, STAMP: tl.constexpr, USE_PDL: tl.constexpr):
    """engine.triton_gemm._linear_partials_kernel, its PDL wait replaced by the counts of the kv heads whose
    columns (HEAD_COLS each) its K split reads; split s covers K columns starts[s]..starts[s + 1] (multiples of
    BLOCK_K). STAMP: the program's start, the counts' arrival and its end go to stamp [program, 3] (int64, ns)."""
    if USE_PDL:  # the add + norm after may launch; this grid waits for nothing but the counts
        tl.extra.cuda.gdc_launch_dependents()
    pid_n, split, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k_start = tl.load(starts_ptr + split)
    k_end = tl.load(starts_ptr + split + 1)
    if STAMP:
        t0 = _now(k_start)
    seen = _wait_counts(count_ptr, k_start // HEAD_COLS, tl.cdiv(k_end, HEAD_COLS), target, FENCE)
    if STAMP:
        t1 = _now(seen)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        a = _box(x_ptr, pid_m * BLOCK_M, rm, M, stride_xm, k, K, BLOCK_K, TMA == 2)
        b = _box(w_ptr, pid_n * BLOCK_N, rn, N, stride_wn, k, K, BLOCK_K, TMA > 0)
        acc += tl.dot(a, tl.trans(b))
    out = out_ptr + (split * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
    tl.store(out, acc, mask=(rm[:, None] < M) & (rn[None, :] < N) & (seen >= target))
    if STAMP:
        stamp = stamp_ptr + 3 * (pid_n + tl.num_programs(0) * (split + tl.num_programs(1) * pid_m))
        tl.store(stamp, t0)
        tl.store(stamp + 1, t1)
        tl.store(stamp + 2, _now(tl.sum(tl.sum(acc, 1), 0).to(tl.int32, bitcast=True)))


def attention_count(q, k_blocks, v_blocks, block_tables, context_lens, query_start, scale: float, count, config,
                    stamp=None):
    """The attention of one new row per request (q [rows, heads, d]; k_blocks, v_blocks [blocks, page, kv heads, d])
    with engine.attention_dispatch.LaunchConfig `config` (one key split, sequence-fastest grid), adding each
    program's 1 to count [kv heads] (int32) -> [rows, heads, d]. stamp: int64 [seqs x kv heads, 2] for the programs'
    start and end times (CUDA only), or None."""
    import torch

    from engine import pdl
    from engine.attention_dispatch import query_tiling

    rows, heads, d = q.shape
    _, page, kv_heads, _ = k_blocks.shape
    group = heads // kv_heads
    block_m, m_tiles = query_tiling(1, group, d)
    if config.splits != 1 or config.head_major or m_tiles != 1 or count.shape != (kv_heads,):
        raise ValueError(f"attention_count: one key split, sequence-fastest order, one M tile and a count per kv head "
                         f"({kv_heads}), got {config}, {m_tiles} M tiles, count {list(count.shape)}")
    out = torch.empty_like(q)
    attention_count_kernel[(context_lens.shape[0], kv_heads)](
        q, k_blocks, v_blocks, out, count, count if stamp is None else stamp, block_tables, context_lens,
        query_start, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_blocks.stride(0), k_blocks.stride(1),
        k_blocks.stride(2), block_tables.stride(0), scale * 1.4426950408889634, GROUP=group, BLOCK_M=block_m,
        BLOCK_N=config.block_n, PAGE=page, HEAD_DIM=d, META_EARLY=config.meta_early, STAMP=stamp is not None,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_kwargs(q.device))
    return out


def split_starts(K: int, splits: int, block_k: int) -> list[int]:
    """linear_partials' even K splits as starts [splits + 1] (the last is K)."""
    per = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    return [min(K, s * per) for s in range(splits)] + [K]


def partials_after_counts(x, w, starts, cfg, count, target: int, head_cols: int, out=None, stamp=None):
    """engine.triton_gemm.linear_partials(x, w, splits, cfg, out) with split s over K columns starts[s]..starts[s + 1]
    (an int32 tensor on x's device, multiples of cfg.block_k), each program first waiting for count[g] >= target
    for the kv heads g (head_cols columns of x each) of its split. stamp: int64 [programs, 3] or None."""
    import torch

    from engine import pdl, triton_gemm
    from engine.gemm_dispatch import gemm_block_m

    rows, K = x.shape
    N, splits = w.shape[0], starts.shape[0] - 1
    if out is None:
        out = torch.empty(splits, rows, N, dtype=torch.float32, device=x.device)
    bm = gemm_block_m(rows)
    x_arg, w_arg, tma = triton_gemm._tma_args(x, w, bm, cfg.block_n, cfg.block_k, cfg)
    grid = (triton.cdiv(N, cfg.block_n), splits, triton.cdiv(rows, bm))
    partials_after_counts_kernel[grid](x_arg, w_arg, out, count, starts, count if stamp is None else stamp, target,
                                       rows, N, K, x.stride(0), w.stride(0), HEAD_COLS=head_cols, BLOCK_M=bm,
                                       BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, TMA=tma,
                                       FENCE=x.device.type == "cuda", STAMP=stamp is not None,
                                       num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                       **pdl.launch_kwargs(x.device))
    return out


@triton.jit(do_not_specialize=["M", "workers"])
def partials_norm_kernel(x_ptr, w_ptr, part_ptr, ticket_ptr, h_ptr, wa_ptr, wb_ptr, h_out_ptr, x_out_ptr, M, N, K,
                         k_per_split, stride_xm, stride_wn, workers, eps, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr, SPLITS: tl.constexpr,
                         BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """engine.triton_gemm._linear_partials_kernel (SPLITS K splits on grid axis 1), then the add + norm
    (_add_rms_norm2_partials_kernel's math) in the same launch: every program takes a ticket once its partial tile is
    stored; the last `workers` to take one wait until all have, then each runs rows worker, worker + workers, ...
    of h + rms(sum of the partials) wa -> h_out, rms(h_out) wb -> x_out. `ticket`: one int32, zero before."""
    if USE_PDL:  # engine/pdl.py: wait for the kernel before, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    partial_tile(x_ptr, w_ptr, part_ptr, M, N, K, k_per_split, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, TMA)
    tl.debug_barrier()  # every thread's stores before the release
    total = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    worker = ticket - (total - workers)
    if worker >= 0:
        seen = ticket + 1
        while seen < total:
            seen = tl.atomic_add(ticket_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        for row in range(worker, M, workers):
            base = row * N  # rows x hidden of one decode batch: well inside int32
            y = tl.zeros((BLOCK,), dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                y += tl.load(part_ptr + s * M * N + base + cols, mask=mask, other=0.0, cache_modifier=".cg")
            h = tl.load(h_ptr + base + cols, mask=mask, other=0.0)
            y = y.to(h.dtype).to(tl.float32)  # the GEMM output in the model dtype, as the reference path has it
            add_norm2_store(y, h, wa_ptr, wb_ptr, h_out_ptr + base, x_out_ptr + base, cols, mask, N, eps)


def partials_norm(x, w, splits: int, cfg, ticket, h, w_branch, w_next, eps: float, workers: int | None = None):
    """engine.triton_gemm.add_rms_norm2_partials(h, linear_partials(x, w, splits, cfg), w_branch, w_next, eps) as one
    launch (partials_norm_kernel; `ticket` a zeroed int32 on x's device; `workers`: rows, at most the grid) ->
    (h_out, x_out)."""
    import torch

    from engine import pdl, triton_gemm
    from engine.gemm_dispatch import gemm_block_m

    rows, K = x.shape
    N = w.shape[0]
    part = torch.empty(splits, rows, N, dtype=torch.float32, device=x.device)
    h_out, x_out = torch.empty_like(h), torch.empty_like(h)
    k_per_split = triton.cdiv(triton.cdiv(K, splits), cfg.block_k) * cfg.block_k
    bm = gemm_block_m(rows)
    grid = (triton.cdiv(N, cfg.block_n), splits, triton.cdiv(rows, bm))
    workers = min(rows, grid[0] * grid[1] * grid[2]) if workers is None else workers
    x_arg, w_arg, tma = triton_gemm._tma_args(x, w, bm, cfg.block_n, cfg.block_k, cfg)
    partials_norm_kernel[grid](x_arg, w_arg, part, ticket, h, w_branch, w_next, h_out, x_out, rows, N, K, k_per_split,
                               x.stride(0), w.stride(0), workers, eps, BLOCK_M=bm, BLOCK_N=cfg.block_n,
                               BLOCK_K=cfg.block_k, TMA=tma, SPLITS=splits, BLOCK=triton.next_power_of_2(N),
                               num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_kwargs(x.device))
    return h_out, x_out
