"""The layer-shaped chain of benchmarks/ws_layer_probe.py at 64 rows, in ws_chain64_wg.py's design (K split so a
CTA stages its K range once, wgmma, the split partials summed by each group of CTAs), with what joins a layer's
GEMMs: benchmarks/ws_layer64_probe.py runs it, docs/benchmarks.md (session 26) says why.

Per layer (attention aside: o's input stands in for attention's output), the four phases and their stagings:
    qkv   x = rms(h) n1, h = hm_l + d_l        the stager adds the residual (bf16), stages h * n1 and writes
                                               its K range's row sums of h^2; the rows' 1 / rms scales the sums
    o     qkv[:, :H]                           TMA
    gu    x2 = rms(hm) n2, hm = h + o          the stager adds o, stages hm * n2 and its row sums; group 0 writes
                                               hm (the next residual); the sums: SiLU(g s) x (u s)
    down  act (K = INTER)                      TMA; d = act Wd^T
A phase's units are (64-column tile, 1 / S of K), S = S_IN for the first three and S_DOWN for down, each K range
CHUNKS boxes of 128 in all four (so the chunks' barriers complete once a phase). The S CTAs of a group hold the
same tiles; once all of them have stored their partials and row sums (a count per (phase, group)), each sums its
1 / S of the tiles' rows. One CTA per SM, three partitions: the warpgroup multiplies and sums, a loader warp
streams the weight boxes (gate and up as a pair) across phase boundaries, a 4-warp stager stages the next phase
once every CTA has ended this one.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from engine.gluon_attention import _gdc_launch_dependents, _gdc_wait
from engine.gluon_ring import weight_ring
from engine.gluon_splitk import fence_proxy_async_global as _fence_proxy_async
from engine.gluon_splitk import group_barrier, load_phase, mma_unit, staged_chunks
from ws_chain import _wait_for_phase

BLOCK_M, BLOCK_N, BLOCK_K = gl.constexpr(64), gl.constexpr(64), gl.constexpr(128)
EPS = gl.constexpr(1e-6)
QKV_, O_, GU_, DOWN_ = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2), gl.constexpr(3)


@gluon.constexpr_function
def _cols_of(kind, h, qkv, inter):
    """A phase's output columns (gate_up: act's, each tile a gate box and an up box)."""
    return {0: qkv, 2: inter}.get(kind, h)


@gluon.constexpr_function
def _rows_per_layer(kind, h, qkv, inter):
    """A phase's weight rows per layer (gate_up: gate's, then up's)."""
    return 2 * inter if kind == 2 else _cols_of(kind, h, qkv, inter)


@gluon.constexpr_function
def _pair(kind, inter):
    """gate_up's up rows: INTER rows (and partial columns) after its gate rows; no pair elsewhere."""
    return inter if kind == 2 else 0


@gluon.jit
def _load_phase(desc, layer, i, ring, ready, empty, KIND: gl.constexpr, H: gl.constexpr, QKV: gl.constexpr,
                INTER: gl.constexpr, S: gl.constexpr, CHUNKS: gl.constexpr, STAGES: gl.constexpr):
    rows_per_layer: gl.constexpr = _rows_per_layer(KIND, H, QKV, INTER)
    n_tiles: gl.constexpr = _cols_of(KIND, H, QKV, INTER) // BLOCK_N
    return load_phase(desc, layer * rows_per_layer, i, ring, ready, empty, n_tiles, _pair(KIND, INTER), S, CHUNKS,
                      STAGES)


@gluon.jit
def _loader(wq, wo, wgu, wd, ring, ready, empty, num_layers, H: gl.constexpr, QKV: gl.constexpr,
            INTER: gl.constexpr, S_IN: gl.constexpr, S_DOWN: gl.constexpr, CHUNKS: gl.constexpr,
            STAGES: gl.constexpr):
    i = 0
    for layer in range(num_layers):
        i = _load_phase(wq, layer, i, ring, ready, empty, QKV_, H, QKV, INTER, S_IN, CHUNKS, STAGES)
        i = _load_phase(wo, layer, i, ring, ready, empty, O_, H, QKV, INTER, S_IN, CHUNKS, STAGES)
        i = _load_phase(wgu, layer, i, ring, ready, empty, GU_, H, QKV, INTER, S_IN, CHUNKS, STAGES)
        i = _load_phase(wd, layer, i, ring, ready, empty, DOWN_, H, QKV, INTER, S_DOWN, CHUNKS, STAGES)


@gluon.jit
def _norm_rows(xs, layer, c, half, hm_ptr, d_ptr, o_ptr, n_ptr, M, KIND: gl.constexpr, H: gl.constexpr,
               S: gl.constexpr, CHUNKS: gl.constexpr, WARPS: gl.constexpr):
    # half of chunk c's rows (32, so that a thread holds 32 values a tensor): h = hm_l + d_l (qkv), hm = h + o_l
    # (gu; group 0 writes it to hm_(l + 1)), staged times n; returns the rows' sums of squares
    pid = gl.program_id(0)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
    rm = half * 32 + gl.arange(0, 32, layout=gl.SliceLayout(1, layout))
    cols = (pid % S) * (CHUNKS * BLOCK_K) + c * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    offs = rm[:, None] * H + cols[None, :]
    rows = (rm < M)[:, None]
    h = gl.load(hm_ptr + layer * (BLOCK_M * H) + offs, mask=rows, other=0.0).to(gl.float32)
    h = (h + gl.load(d_ptr + layer * (BLOCK_M * H) + offs, mask=rows, other=0.0).to(gl.float32)).to(gl.bfloat16)
    h = h.to(gl.float32)
    if KIND == GU_:
        h = (h + gl.load(o_ptr + layer * (BLOCK_M * H) + offs, mask=rows, other=0.0).to(gl.float32)).to(gl.bfloat16)
        h = h.to(gl.float32)
        if pid < S:  # group 0 covers every K range once
            gl.store(hm_ptr + (layer + 1) * (BLOCK_M * H) + offs, h.to(gl.bfloat16), mask=rows)
    n = gl.load(n_ptr + layer * H + cols).to(gl.float32)
    xs.store((h * n[None, :]).to(gl.bfloat16))
    return gl.sum(h * h, axis=1)


@gluon.jit
def _stage_norm(xbuf, x_ready, layer, q, hm_ptr, d_ptr, o_ptr, n_ptr, rowsq_ptr, M, KIND: gl.constexpr,
                H: gl.constexpr, S: gl.constexpr, CHUNKS: gl.constexpr, WARPS: gl.constexpr):
    # qkv: (hm_l + d_l) * n1; gu: (h + o_l) * n2, chunk by chunk (each signalled once both halves are staged; the
    # last once this CTA's row sums of squares over its K range are stored too)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
    sq0 = gl.zeros([32], gl.float32, gl.SliceLayout(1, layout))
    sq1 = gl.zeros([32], gl.float32, gl.SliceLayout(1, layout))
    for c in gl.static_range(CHUNKS):
        sq0 += _norm_rows(xbuf.index(c).slice(0, 32, dim=0), layer, c, 0, hm_ptr, d_ptr, o_ptr, n_ptr, M, KIND, H, S,
                          CHUNKS, WARPS)
        sq1 += _norm_rows(xbuf.index(c).slice(32, 32, dim=0), layer, c, 1, hm_ptr, d_ptr, o_ptr, n_ptr, M, KIND, H, S,
                          CHUNKS, WARPS)
        fence_async_shared()  # the generic stores ordered before the wgmmas' reads
        if c < CHUNKS - 1:
            mbarrier.arrive(x_ready.index(c), count=1)
    # the row sums before the last chunk's signal: the group sums read them after the group's multiplying
    # partitions have waited for every chunk
    rm = gl.arange(0, 32, layout=gl.SliceLayout(1, layout))
    row0 = (q * gl.num_programs(0) + gl.program_id(0)) * BLOCK_M
    gl.store(rowsq_ptr + row0 + rm, sq0)
    gl.store(rowsq_ptr + row0 + 32 + rm, sq1)
    mbarrier.arrive(x_ready.index(CHUNKS - 1), count=1)


@gluon.jit
def _stage_copy(desc, xbuf, x_ready, layer, S: gl.constexpr, CHUNKS: gl.constexpr):
    # o: qkv_l[:, :H]; down: act_l (desc over [layers x 64, the row's width])
    k0 = (gl.program_id(0) % S) * (CHUNKS * BLOCK_K)
    for c in gl.static_range(CHUNKS):
        mbarrier.expect(x_ready.index(c), desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [layer * BLOCK_M, k0 + c * BLOCK_K], x_ready.index(c), xbuf.index(c))


@gluon.jit
def _stager(xbuf, x_ready, x_empty, qkv_desc, act_desc, hm_ptr, d_ptr, o_ptr, n1_ptr, n2_ptr, rowsq_ptr, cnt_ptr,
            num_layers, M, H: gl.constexpr, QKV: gl.constexpr, INTER: gl.constexpr, S_IN: gl.constexpr,
            S_DOWN: gl.constexpr, CHUNKS: gl.constexpr, WARPS: gl.constexpr, USE_PDL: gl.constexpr):
    programs = gl.num_programs(0)
    if USE_PDL:  # the kernel before wrote what the first staging reads; every store of the launch comes after a
        _gdc_wait()  # staging, so this wait orders them too. The loader streams weights (nobody writes them) ahead
        _gdc_launch_dependents()
    for layer in range(num_layers):
        for k in gl.static_range(4):
            q = 4 * layer + k
            mbarrier.wait(x_empty.index(0), (q & 1) ^ 1)  # this CTA is done with the last phase's chunks
            if q > 0:
                _wait_for_phase(cnt_ptr + q - 1, programs)
                _fence_proxy_async()
            if k == QKV_:
                _stage_norm(xbuf, x_ready, layer, q, hm_ptr, d_ptr, o_ptr, n1_ptr, rowsq_ptr, M, QKV_, H, S_IN, CHUNKS,
                            WARPS)
            elif k == O_:
                _stage_copy(qkv_desc, xbuf, x_ready, layer, S_IN, CHUNKS)
            elif k == GU_:
                _stage_norm(xbuf, x_ready, layer, q, hm_ptr, d_ptr, o_ptr, n2_ptr, rowsq_ptr, M, GU_, H, S_IN, CHUNKS,
                            WARPS)
            else:
                _stage_copy(act_desc, xbuf, x_ready, layer, S_DOWN, CHUNKS)


@gluon.jit
def _group_sums(q, n_tiles, out_ptr, part_ptr, rowsq_ptr, M, KIND: gl.constexpr, H: gl.constexpr,
                QKV: gl.constexpr, INTER: gl.constexpr, PW: gl.constexpr, S: gl.constexpr, WARPS: gl.constexpr):
    # this CTA's items of its group's tiles: (tile, 16-row block) pairs s, s + S, ...; the partials summed in split
    # order, scaled by the rows' 1 / rms (qkv, gu), SiLU(g) x u (gu), written in bf16
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    g = pid // S
    width: gl.constexpr = _cols_of(KIND, H, QKV, INTER)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    r16 = gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
    rn0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    mine = (n_tiles - g + programs // S - 1) // (programs // S)  # the group's tiles: g, g + programs / S, ...
    for item in range(pid % S, mine * 4, S):
        rows = (item % 4) * 16 + r16
        cols = (g + (item // 4) * (programs // S)) * BLOCK_N + rn0
        offs = rows[:, None] * PW + cols[None, :]
        total = gl.zeros([16, BLOCK_N], gl.float32, layout)
        up = gl.zeros([16, BLOCK_N], gl.float32, layout)
        for s in gl.static_range(S):  # L2 (.cg): an earlier phase may have left these lines in L1
            total += gl.load(part_ptr + s * (BLOCK_M * PW) + offs, cache_modifier=".cg")
            if KIND == GU_:
                up += gl.load(part_ptr + s * (BLOCK_M * PW) + offs + INTER, cache_modifier=".cg")
        if KIND == QKV_ or KIND == GU_:
            sq = gl.zeros([16], gl.float32, gl.SliceLayout(1, layout))
            for s in gl.static_range(S):
                sq += gl.load(rowsq_ptr + (q * programs + g * S + s) * BLOCK_M + rows, cache_modifier=".cg")
            scale = gl.rsqrt(sq / H + EPS)[:, None]
            total = total * scale
            if KIND == GU_:
                up = up * scale
                total = total / (1.0 + gl.exp(-total)) * up
        gl.store(out_ptr + rows[:, None] * width + cols[None, :], total.to(gl.bfloat16), mask=(rows < M)[:, None])


@gluon.jit
def _mma_phase(xbuf, x_ready, x_empty, ring, ready, empty, i, layer, out_ptr, part_ptr, rowsq_ptr, cnt_ptr, gcnt_ptr,
               num_layers, M, KIND: gl.constexpr, H: gl.constexpr, QKV: gl.constexpr, INTER: gl.constexpr,
               PW: gl.constexpr, S: gl.constexpr, CHUNKS: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr):
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    q = 4 * layer + KIND
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    n_tiles: gl.constexpr = _cols_of(KIND, H, QKV, INTER) // BLOCK_N
    for u in range(pid, n_tiles * S, programs):
        i = mma_unit(xbuf, x_ready, ring, ready, empty, i, q & 1, u // S, pid % S, part_ptr, PW, _pair(KIND, INTER),
                     CHUNKS, STAGES, mma)
    for c in gl.static_range(CHUNKS):  # a CTA without units too: no chunk may still be landing when the stager
        mbarrier.wait(x_ready.index(c), q & 1)  # arms the next phase's (one completion a phase)
    fence_async_shared()  # the wgmmas' reads (synchronous, done) ordered before the next phase's writes
    mbarrier.arrive(x_empty.index(0), count=1)
    group_barrier(gcnt_ptr, q, S)
    _group_sums(q, n_tiles, out_ptr, part_ptr, rowsq_ptr, M, KIND, H, QKV, INTER, PW, S, WARPS)
    if q + 1 < 4 * num_layers:
        _fence_proxy_async()
        gl.thread_barrier()  # every warp's stores of this phase are issued before its count
        gl.atomic_add(cnt_ptr + q, 1, sem="release", scope="gpu")
    return i


@gluon.jit
def _multiply(xbuf, x_ready, x_empty, ring, ready, empty, d_ptr, qkv_ptr, o_ptr, act_ptr, part_ptr,
              rowsq_ptr, cnt_ptr, gcnt_ptr, num_layers, M, H: gl.constexpr, QKV: gl.constexpr, INTER: gl.constexpr,
              PW: gl.constexpr, S_IN: gl.constexpr, S_DOWN: gl.constexpr, CHUNKS: gl.constexpr,
              STAGES: gl.constexpr, WARPS: gl.constexpr):
    i = 0
    for layer in range(num_layers):
        i = _mma_phase(xbuf, x_ready, x_empty, ring, ready, empty, i, layer, qkv_ptr + layer * (BLOCK_M * QKV),
                       part_ptr, rowsq_ptr, cnt_ptr, gcnt_ptr, num_layers, M, QKV_, H, QKV, INTER, PW, S_IN, CHUNKS,
                       STAGES, WARPS)
        i = _mma_phase(xbuf, x_ready, x_empty, ring, ready, empty, i, layer, o_ptr + layer * (BLOCK_M * H),
                       part_ptr, rowsq_ptr, cnt_ptr, gcnt_ptr, num_layers, M, O_, H, QKV, INTER, PW, S_IN, CHUNKS,
                       STAGES, WARPS)
        i = _mma_phase(xbuf, x_ready, x_empty, ring, ready, empty, i, layer, act_ptr + layer * (BLOCK_M * INTER),
                       part_ptr, rowsq_ptr, cnt_ptr, gcnt_ptr, num_layers, M, GU_, H, QKV, INTER, PW, S_IN, CHUNKS,
                       STAGES, WARPS)
        i = _mma_phase(xbuf, x_ready, x_empty, ring, ready, empty, i, layer, d_ptr + (layer + 1) * (BLOCK_M * H),
                       part_ptr, rowsq_ptr, cnt_ptr, gcnt_ptr, num_layers, M, DOWN_, H, QKV, INTER, PW, S_DOWN, CHUNKS,
                       STAGES, WARPS)


@gluon.jit
def ws_layer64_kernel(wq, wo, wgu, wd, qkv_desc, act_desc, hm_ptr, d_ptr, qkv_ptr, o_ptr, act_ptr, n1_ptr, n2_ptr,
                      part_ptr, rowsq_ptr, cnt_ptr, gcnt_ptr, num_layers, M, H: gl.constexpr, QKV: gl.constexpr,
                      INTER: gl.constexpr, PW: gl.constexpr, S_IN: gl.constexpr, S_DOWN: gl.constexpr,
                      STAGES: gl.constexpr, num_warps: gl.constexpr, USE_PDL: gl.constexpr = False):
    # PW: the partials' row width (max(QKV, 2 INTER)); every phase stages the same number of chunks
    CHUNKS: gl.constexpr = H // S_IN // BLOCK_K
    ring, ready, empty = weight_ring(wq, STAGES)
    xbuf, x_ready, x_empty = staged_chunks(CHUNKS, qkv_desc)
    gl.warp_specialize([
        (_multiply, (xbuf, x_ready, x_empty, ring, ready, empty, d_ptr, qkv_ptr, o_ptr, act_ptr, part_ptr,
                     rowsq_ptr, cnt_ptr, gcnt_ptr, num_layers, M, H, QKV, INTER, PW, S_IN, S_DOWN, CHUNKS, STAGES,
                     num_warps)),
        (_loader, (wq, wo, wgu, wd, ring, ready, empty, num_layers, H, QKV, INTER, S_IN, S_DOWN, CHUNKS, STAGES)),
        (_stager, (xbuf, x_ready, x_empty, qkv_desc, act_desc, hm_ptr, d_ptr, o_ptr, n1_ptr, n2_ptr, rowsq_ptr,
                   cnt_ptr, num_layers, M, H, QKV, INTER, S_IN, S_DOWN, CHUNKS, 4, USE_PDL)),
    ], [1, 4], [40, 232])
