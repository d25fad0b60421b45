"""What gluon_layers64.py's launch does between its GEMMs: the stager's sandwich norms (Ouro's residual add of a
normed branch, then the next norm) and the group sums (SiLU x up, the branch's row sums, RoPE and the key / value
store). Gluon; the tiles are gluon_splitk.py's (64 rows, 64-column tiles, chunks of 128 columns).

The sandwich, for a branch y (o after attention, d after the MLP) on the residual h:
    h' = h + n_a * y * rsqrt(mean(y^2) + eps)      (bf16, as the engine stores the residual)
    x  = n_b * h' * rsqrt(mean(h'^2) + eps)
The stager stages h' * n_b for its K range and writes the range's row sums of h'^2; the next phase's group sums
apply the rows' rsqrt (a row's scale factors out of the GEMM). mean(y^2) needs y's whole row: the group sums that
write y also write each tile's row sums of y^2 ([tiles, 64] float32), which the stager adds up.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .gluon_splitk import BLOCK_K, BLOCK_M, BLOCK_N

O_, GU_, DOWN_, QKV_ = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2), gl.constexpr(3)


@gluon.jit
def _branch_scale(sq_ptr, quarter, eps, H: gl.constexpr, WARPS: gl.constexpr, layout: gl.constexpr):
    # rsqrt(mean(y^2) + eps) for 16 rows (rows 16 quarter ..) from the tiles' row sums [H / 64, 64]
    tiles: gl.constexpr = H // BLOCK_N
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 1], [16, 2], [WARPS, 1], [1, 0])
    rm = quarter * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, rows_layout))
    tt = gl.arange(0, tiles, layout=gl.SliceLayout(0, rows_layout))
    sq = gl.load(sq_ptr + tt[None, :] * BLOCK_M + rm[:, None], cache_modifier=".cg")
    return gl.convert_layout(gl.rsqrt(gl.sum(sq, axis=1) / H + eps), gl.SliceLayout(1, layout))


@gluon.jit
def _sandwich_rows(xc, c, quarter, scale, h_ptr, y_ptr, out_ptr, na_ptr, nb_ptr, M, k0, write, BRANCH: gl.constexpr,
                   H: gl.constexpr, layout: gl.constexpr):
    # a quarter of chunk c (16 rows, so that a thread holds 16 values a tensor): h' = h + n_a y scale (BRANCH;
    # else h' = h), written to out where `write`, staged times n_b; returns the rows' sums of h'^2 over the chunk
    rm = quarter * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
    cols = k0 + c * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    offs = rm[:, None] * H + cols[None, :]
    rows = (rm < M)[:, None]
    h = gl.load(h_ptr + offs, mask=rows, other=0.0).to(gl.float32)
    if BRANCH:
        y = gl.load(y_ptr + offs, mask=rows, other=0.0).to(gl.float32)
        na = gl.load(na_ptr + cols).to(gl.float32)
        h = (h + na[None, :] * (y * scale[:, None])).to(gl.bfloat16).to(gl.float32)
        gl.store(out_ptr + offs, h.to(gl.bfloat16), mask=rows & write)
    nb = gl.load(nb_ptr + cols).to(gl.float32)
    xc.slice(quarter * 16, 16, dim=0).store((h * nb[None, :]).to(gl.bfloat16))
    return gl.sum(h * h, axis=1)


@gluon.jit
def stage_sandwich(xbuf, x_ready, kind, h_ptr, y_ptr, sq_ptr, out_ptr, na_ptr, nb_ptr, rowsq_ptr, M, eps,
                   BRANCH: gl.constexpr, S: gl.constexpr, CHUNKS: gl.constexpr, H: gl.constexpr,
                   WARPS: gl.constexpr):
    """The CTA's K range of x = norm_b(h + norm_a(y)) (BRANCH; else norm_b(h)) into its chunks, each signalled once
    staged; group 0 (every K range once) writes h + norm_a(y) to out; the range's row sums of squares to rowsq."""
    pid = gl.program_id(0)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
    k0 = (pid % S) * (CHUNKS * BLOCK_K)
    rows: gl.constexpr = gl.SliceLayout(1, layout)
    sq0, sq1, sq2, sq3 = (gl.zeros([16], gl.float32, rows), gl.zeros([16], gl.float32, rows),
                          gl.zeros([16], gl.float32, rows), gl.zeros([16], gl.float32, rows))
    sc0, sc1, sc2, sc3 = sq0, sq1, sq2, sq3
    if BRANCH:
        sc0, sc1 = _branch_scale(sq_ptr, 0, eps, H, WARPS, layout), _branch_scale(sq_ptr, 1, eps, H, WARPS, layout)
        sc2, sc3 = _branch_scale(sq_ptr, 2, eps, H, WARPS, layout), _branch_scale(sq_ptr, 3, eps, H, WARPS, layout)
    write = pid < S
    for c in gl.static_range(CHUNKS):
        xc = xbuf.index(c)
        sq0 += _sandwich_rows(xc, c, 0, sc0, h_ptr, y_ptr, out_ptr, na_ptr, nb_ptr, M, k0, write, BRANCH, H, layout)
        sq1 += _sandwich_rows(xc, c, 1, sc1, h_ptr, y_ptr, out_ptr, na_ptr, nb_ptr, M, k0, write, BRANCH, H, layout)
        sq2 += _sandwich_rows(xc, c, 2, sc2, h_ptr, y_ptr, out_ptr, na_ptr, nb_ptr, M, k0, write, BRANCH, H, layout)
        sq3 += _sandwich_rows(xc, c, 3, sc3, h_ptr, y_ptr, out_ptr, na_ptr, nb_ptr, M, k0, write, BRANCH, H, layout)
        fence_async_shared()  # the generic stores ordered before the wgmmas' reads
        if c < CHUNKS - 1:
            mbarrier.arrive(x_ready.index(c), count=1)
    # the row sums before the last chunk's signal: the group sums read them once the group's multiplying
    # partitions have waited for every chunk (group_barrier), so stored after it they could be read unwritten
    rm = gl.arange(0, 16, layout=rows)
    row0 = (kind * gl.num_programs(0) + pid) * BLOCK_M
    gl.store(rowsq_ptr + row0 + rm, sq0)
    gl.store(rowsq_ptr + row0 + 16 + rm, sq1)
    gl.store(rowsq_ptr + row0 + 32 + rm, sq2)
    gl.store(rowsq_ptr + row0 + 48 + rm, sq3)
    mbarrier.arrive(x_ready.index(CHUNKS - 1), count=1)


@gluon.jit
def _partials(part_ptr, offs, PW: gl.constexpr, S: gl.constexpr, layout: gl.constexpr):
    # the splits' float32 partials summed in split order (L2, .cg: an earlier phase may have left them in L1)
    total = gl.zeros([16, BLOCK_N], gl.float32, layout)
    for s in gl.static_range(S):
        total += gl.load(part_ptr + s * (BLOCK_M * PW) + offs, cache_modifier=".cg")
    return total


@gluon.jit
def _row_scale(rowsq_ptr, kind, g, rows, eps, H: gl.constexpr, S: gl.constexpr, layout: gl.constexpr):
    # the rows' rsqrt(mean(x^2) + eps) from the group's S K ranges' sums
    sq = gl.zeros([16], gl.float32, gl.SliceLayout(1, layout))
    for s in gl.static_range(S):
        sq += gl.load(rowsq_ptr + (kind * gl.num_programs(0) + g * S + s) * BLOCK_M + rows, cache_modifier=".cg")
    return gl.rsqrt(sq / H + eps)[:, None]


@gluon.jit
def _wait_group(gcnt_ptr, kind, group, S: gl.constexpr):
    # another group's S CTAs have stored this phase's partials (acquire)
    count = gcnt_ptr + kind * gl.num_programs(0) + group
    seen = gl.atomic_add(count, 0, sem="acquire", scope="gpu")
    while seen < S:
        seen = gl.atomic_add(count, 0, sem="acquire", scope="gpu")
    gl.thread_barrier()  # every warp's loads after the acquire (as gluon_splitk.group_barrier's)


@gluon.jit
def _rope_store(total, t, rows, rn, part_ptr, offs, gcnt_ptr, scale, io, M, PW: gl.constexpr, S: gl.constexpr,
                HQ: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, layout: gl.constexpr):
    # a qkv tile's rows (D = 128: a head's halves are tiles 2j, 2j + 1): q and k rotated with their partner half
    # (tile t ^ 1, another group's, waited for), q to q_out [rows, HQ x D], k and v to their slots in the layer's
    # planes [slots, HKV, D]
    q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, inv_freq_ptr = io
    groups = gl.num_programs(0) // S
    live = (rows < M)[:, None]
    half = t % 2
    out = total
    if t < 2 * (HQ + HKV):
        partner = t ^ 1
        _wait_group(gcnt_ptr, QKV_, partner % groups, S)
        other = _partials(part_ptr, offs + (partner - t) * BLOCK_N, PW, S, layout) * scale
        pos = gl.load(pos_ptr + rows, mask=rows < M, other=0).to(gl.float32)
        ang = pos[:, None] * gl.load(inv_freq_ptr + rn)[None, :]
        sign = (2 * half - 1).to(gl.float32)  # rotate-half: the first half takes -x2 sin, the second +x1 sin
        out = total * gl.cos(ang) + sign * other * gl.sin(ang)
    col = (half * BLOCK_N + rn)[None, :]
    head = t // 2
    y = out.to(gl.bfloat16)
    if head < HQ:
        gl.store(q_ptr + rows[:, None] * (HQ * D) + head * D + col, y, mask=live)
    else:
        at = gl.load(slot_ptr + rows, mask=rows < M, other=0).to(gl.int64)[:, None] * (HKV * D) + col
        if head < HQ + HKV:
            gl.store(k_ptr + at + (head - HQ) * D, y, mask=live)
        else:
            gl.store(v_ptr + at + (head - HQ - HKV) * D, y, mask=live)


@gluon.jit
def group_sums(kind, n_tiles, out_ptr, sq_ptr, part_ptr, rowsq_ptr, gcnt_ptr, io, M, eps, KIND: gl.constexpr,
               H: gl.constexpr, INTER: gl.constexpr, PW: gl.constexpr, S: gl.constexpr, HQ: gl.constexpr,
               HKV: gl.constexpr, D: gl.constexpr, WARPS: gl.constexpr):
    """This CTA's items of its group's tiles ((tile, 16-row block) pairs s, s + S, ...): the partials summed; o and
    d written in bf16 with each tile's row sums of squares, SiLU(g) x u (gate_up), RoPE and the store (qkv)."""
    pid = gl.program_id(0)
    groups = gl.num_programs(0) // S
    g = pid // S
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    r16 = gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
    rn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    mine = (n_tiles - g + groups - 1) // groups  # the group's tiles: g, g + groups, ...
    for item in range(pid % S, mine * 4, S):
        rows = (item % 4) * 16 + r16
        t = g + (item // 4) * groups
        offs = rows[:, None] * PW + (t * BLOCK_N + rn)[None, :]
        total = _partials(part_ptr, offs, PW, S, layout)
        if KIND == GU_:
            scale = _row_scale(rowsq_ptr, kind, g, rows, eps, H, S, layout)
            gate = total * scale
            up = _partials(part_ptr, offs + INTER, PW, S, layout) * scale
            act = gate / (1.0 + gl.exp(-gate)) * up
            gl.store(out_ptr + rows[:, None] * INTER + (t * BLOCK_N + rn)[None, :], act.to(gl.bfloat16))
        elif KIND == QKV_:
            scale = _row_scale(rowsq_ptr, kind, g, rows, eps, H, S, layout)
            _rope_store(total * scale, t, rows, rn, part_ptr, offs, gcnt_ptr, scale, io, M, PW, S, HQ, HKV, D, layout)
        else:  # o, d: bf16, and the tile's row sums of the stored values' squares
            y = total.to(gl.bfloat16)
            gl.store(out_ptr + rows[:, None] * H + (t * BLOCK_N + rn)[None, :], y)
            y = y.to(gl.float32)
            gl.store(sq_ptr + t * BLOCK_M + rows, gl.sum(y * y, axis=1))
