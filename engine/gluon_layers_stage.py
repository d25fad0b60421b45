"""The stager of gluon_layers.py's loop-pass kernel (4 warps): the norms and the residual stream between the GEMM
phases, and each CTA's (request, head) item of attention. Imported lazily (Gluon)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from . import layers_dispatch as ld
from .gluon_attention import _gdc_launch_dependents, _gdc_wait, masked_values, online_values

BN, BK, BM = gl.constexpr(ld.BLOCK_N), gl.constexpr(ld.BLOCK_K), gl.constexpr(ld.ROWS)
PHASES = gl.constexpr(ld.PHASES)
TRACE_EVENTS = gl.constexpr(ld.TRACE_EVENTS)
MAX_PROGRAMS = gl.constexpr(ld.MAX_SMS)


@gluon.jit
def copy_rows(x_ptr, xbuf, x_ready, M, W: gl.constexpr, NC: gl.constexpr, WARPS: gl.constexpr):
    """NC chunks of x_ptr's rows (row stride W) into the staging buffer, each signalled as it lands (unrolled: the
    waits count copy groups; benchmarks/ws_layer.py's stager too)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    rm = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    rk = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    for c in gl.static_range(NC):
        async_copy.async_copy_global_to_shared(xbuf.index(c), x_ptr + rm[:, None] * W + (c * BK + rk)[None, :],
                                               mask=(rm < M)[:, None])
        async_copy.commit_group()
    for c in gl.static_range(NC):
        async_copy.wait_group(NC - 1 - c)
        gl.thread_barrier()
        mbarrier.arrive(x_ready.index(c), count=1)


@gluon.jit
def _sandwich(a_ptr, y_ptr, wb_ptr, wn_ptr, res_ptr, out_ptr, xbuf, x_ready, bufs, y_sums, n, M, pid, eps,
              H: gl.constexpr, HAS_Y: gl.constexpr, SIGNAL: gl.constexpr, WARPS: gl.constexpr, tr=None,
              EV: gl.constexpr = -1, TRACE: gl.constexpr = False):
    # h = a + rms(y) wb (HAS_Y; else h = a), rounded to the model dtype; this CTA's 16 columns of h to res_ptr.
    # rms(y) from its producers' row sums (y_sums: one [ROWS] per CTA), so each chunk of h is made as its copies
    # land (n: this launch's staging count, the `landed` barriers' parity). SIGNAL: each chunk of h wn is
    # signalled to the consumer, the rows' 1 / rms(h) follows in `scales` for its epilogue; else (the loop's
    # readout) this CTA's columns of rms(h) wn go to out_ptr. Loops over chunks are not unrolled: the kernel's
    # code must fit the instruction cache (unrolled, the launch took ~73 us a layer against ~53)
    NC: gl.constexpr = H // BK
    scale_smem, scale_ready, landed, sums_ptr = bufs
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    rm = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    rk = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    rows = (rm < M)[:, None]
    norms = _norm_rows(xbuf)
    W0: gl.constexpr = 2 * NC * BM
    y_sq = gl.zeros([BM], gl.float32, gl.SliceLayout(1, layout))
    if HAS_Y:  # first: its load's latency passes while the copies are issued (after them: ~1 us later)
        y_sq = _row_sums(y_sums, gl.num_programs(0), layout, WARPS)
    _copy_chunks(a_ptr, y_ptr, wb_ptr, wn_ptr, xbuf, landed, M, H, HAS_Y, WARPS)
    _sub(tr, pid, EV, 0, TRACE)
    s1 = gl.rsqrt(y_sq / H + eps)
    _sub(tr, pid, EV, 1, TRACE)
    sq = gl.zeros([BM, BK], gl.float32, layout)  # h's squares, added up across lanes once after the chunks
    for c in range(NC):
        mbarrier.wait(landed.index(c), n & 1)
        cols = c * BK + rk
        h = xbuf.index(c).load(layout).to(gl.float32)
        if HAS_Y:
            wb = norms.index(W0 + c).load(gl.SliceLayout(0, layout)).to(gl.float32)
            h = h + xbuf.index(NC + c).load(layout).to(gl.float32) * s1[:, None] * wb[None, :]
        h = h.to(xbuf.dtype)
        mine = (cols >= pid * BN) & (cols < pid * BN + BN)
        hf = h.to(gl.float32)
        sq += hf * hf
        if SIGNAL:
            gl.store(res_ptr + rm[:, None] * H + cols[None, :], h, mask=rows & mine[None, :])
            wn = norms.index(W0 + NC + c).load(gl.SliceLayout(0, layout)).to(gl.float32)
            xbuf.index(c).store((hf * wn[None, :]).to(xbuf.dtype))
            gl.thread_barrier()
            mbarrier.arrive(x_ready.index(c), count=1)
            if c == 0:
                _sub(tr, pid, EV, 2, TRACE)
        else:
            xbuf.index(c).store(h)
    _sub(tr, pid, EV, 3, TRACE)
    s2 = gl.rsqrt(gl.sum(sq, axis=1) / H + eps)
    if SIGNAL:
        scale_smem.store(s2)
        gl.thread_barrier()
        mbarrier.arrive(scale_ready.index(0), count=1)
    else:
        gl.thread_barrier()
        _readout(xbuf, norms, s2, out_ptr, M, pid, H, WARPS)


@gluon.jit
def _copy_chunks(a_ptr, y_ptr, wb_ptr, wn_ptr, xbuf, landed, M, H: gl.constexpr, HAS_Y: gl.constexpr,
                 WARPS: gl.constexpr):
    # _sandwich's copies: chunk c of a and y into xbuf[c], xbuf[NC + c]; of wb and wn, once (not a copy per row:
    # every CTA's eight rows reading the same 8 KB cost ~5 us a staging), into rows W0 + c and W0 + NC + c of the
    # plain view (_norm_rows); landed[c] completes once every thread's copies of chunk c are in
    NC: gl.constexpr = H // BK
    W0: gl.constexpr = 2 * NC * BM
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    rm = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    rk = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    rw = gl.arange(0, BK, layout=gl.BlockedLayout([2], [32], [WARPS], [0]))
    rows = (rm < M)[:, None]
    norms = _norm_rows(xbuf)
    for c in range(NC):
        cols = (c * BK + rk)[None, :]
        async_copy.async_copy_global_to_shared(xbuf.index(c), a_ptr + rm[:, None] * H + cols, mask=rows)
        if HAS_Y:
            async_copy.async_copy_global_to_shared(xbuf.index(NC + c), y_ptr + rm[:, None] * H + cols, mask=rows)
            async_copy.async_copy_global_to_shared(norms.index(W0 + c), wb_ptr + c * BK + rw)
        async_copy.async_copy_global_to_shared(norms.index(W0 + NC + c), wn_ptr + c * BK + rw)
        async_copy.mbarrier_arrive(landed.index(c), increment_count=False)


@gluon.jit
def _norm_rows(xbuf):
    # the staging buffer as plain rows of BLOCK_K (a chunk is ROWS of them): where _sandwich keeps the norm weights
    return xbuf._reinterpret(xbuf.dtype, [xbuf.shape[0] * BM, BK], gl.SwizzledSharedLayout(1, 1, 1, [0]))


@gluon.jit
def _row_sums(y_sums, programs, layout: gl.constexpr, WARPS: gl.constexpr):
    # the rows' sums of squares: the producers' per-CTA partial sums ([programs, ROWS]) added up
    parts: gl.constexpr = gl.BlockedLayout([1, BM], [32, 1], [WARPS, 1], [1, 0])
    rp = gl.arange(0, MAX_PROGRAMS, layout=gl.SliceLayout(1, parts))
    rm = gl.arange(0, BM, layout=gl.SliceLayout(0, parts))
    p = gl.load(y_sums + rp[:, None] * BM + rm[None, :], mask=(rp < programs)[:, None], other=0.0)
    return gl.convert_layout(gl.sum(p, axis=0), gl.SliceLayout(1, layout))


@gluon.jit
def _readout(xbuf, norms, s2, out_ptr, M, pid, H: gl.constexpr, WARPS: gl.constexpr):
    # this CTA's columns of rms(h) wn: h's rows staged in xbuf[c], wn in _sandwich's norm rows, s2 the rows' 1 / rms
    NC: gl.constexpr = H // BK
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    rm = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    rk = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    for c in range(NC):
        cols = c * BK + rk
        mine = (cols >= pid * BN) & (cols < pid * BN + BN)
        wn = norms.index(2 * NC * BM + NC + c).load(gl.SliceLayout(0, layout)).to(gl.float32)
        x = xbuf.index(c).load(layout).to(gl.float32) * s2[:, None] * wn[None, :]
        gl.store(out_ptr + rm[:, None] * H + cols[None, :], x.to(out_ptr.dtype.element_ty),
                 mask=(rm < M)[:, None] & mine[None, :])


@gluon.jit
def _rope(row_ptr, offs_d, cs, sn, D: gl.constexpr):
    # a head's row after RoPE (rotate-half pairs d, d + D / 2), float32
    half: gl.constexpr = D // 2
    x = gl.load(row_ptr + offs_d).to(gl.float32)
    partner = gl.load(row_ptr + (offs_d + half) % D).to(gl.float32)
    return x * cs + gl.where(offs_d < half, -partner, partner) * sn


@gluon.jit
def _attend(kv_ring, ready, empty, i, qkv_ptr, attn_ptr, kv, layer_row0, item, qk_scale, pid, QKV: gl.constexpr,
            HEADS: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, tr, TRACE: gl.constexpr):
    # the item (row pid // HEADS, head pid % HEADS): RoPE on q and k, the new key and value to their slot, then the
    # online softmax over the streamed pages (per key slot: running max, mass, weighted values), the new position
    # (masked in its page: its slot may be streamed before it is written) merged from registers. `item`: the
    # row's launch-constant values (_item_constants), read once per launch
    k_ptr, v_ptr = kv
    cs, sn, slot, new = item
    layout: gl.constexpr = gl.BlockedLayout([1, D // 16], [2, 16], [4, 1], [1, 0])
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    offs_n = gl.arange(0, PAGE, layout=gl.SliceLayout(1, layout))
    r = pid // HEADS
    head = pid % HEADS
    row = qkv_ptr + r * QKV + head * D
    q = _rope(row, offs_d, cs, sn, D) * qk_scale
    k_new = _rope(row + HEADS * D, offs_d, cs, sn, D).to(k_ptr.dtype.element_ty)
    v_new = gl.load(row + 2 * HEADS * D + offs_d)
    dst = (layer_row0 + slot) * (HEADS * D) + head * D + offs_d
    gl.store(k_ptr + dst, k_new)
    gl.store(v_ptr + dst, v_new)
    m = gl.full([PAGE], float("-inf"), gl.float32, gl.SliceLayout(1, layout))
    mass = gl.zeros([PAGE], gl.float32, gl.SliceLayout(1, layout))
    acc = gl.zeros([PAGE, D], gl.float32, layout)
    pages = (new + PAGE) // PAGE
    _sub(tr, pid, 24, 0, TRACE)
    for t in range(0, pages, 2):  # two pages at a time: their latencies overlap (one at a time: ~14 us for 40)
        two = t + 1 < pages
        k0, v0 = _page(kv_ring, ready, i, True, layout, PAGE, STAGES)
        # not two: slot i again (landed, not yet given back; all masked below), not slot i + 1, which a copy may
        # be landing in (found by tests/test_gluon_layers_emulated.py: harmless, the values are masked, but a race)
        k1, v1 = _page(kv_ring, ready, gl.where(two, i + 1, i), two, layout, PAGE, STAGES)
        gl.thread_barrier()  # every warp has its values in registers: the slots go back before the math
        fence_async_shared()
        mbarrier.arrive(empty.index(i % STAGES), count=1)
        mbarrier.arrive(empty.index((i + 1) % STAGES), count=1, pred=two)
        valid0 = t * PAGE + offs_n < new
        valid1 = (t + 1) * PAGE + offs_n < new  # not two: none
        s0 = gl.where(valid0, gl.sum(k0 * q[None, :], axis=1), float("-inf"))
        s1 = gl.where(valid1, gl.sum(k1 * q[None, :], axis=1), float("-inf"))
        if t + 2 >= pages:  # the pair holding the new position's page: its slots from `new` on hold anything
            v0 = masked_values(v0, valid0)
            v1 = masked_values(v1, valid1)
        m, mass, acc = online_values(s0, v0, m, mass, acc)
        m, mass, acc = online_values(s1, v1, m, mass, acc)
        i += 1 + two.to(gl.int32)
    _sub(tr, pid, 24, 1, TRACE)
    s_new = gl.sum(k_new.to(gl.float32) * q, axis=0)
    top = gl.maximum(gl.max(m, axis=0), s_new)
    w = gl.exp2(m - top)
    w_new = gl.exp2(s_new - top)
    out = (gl.sum(acc * w[:, None], axis=0) + w_new * v_new.to(gl.float32)) / (gl.sum(mass * w, axis=0) + w_new)
    gl.store(attn_ptr + r * (HEADS * D) + head * D + offs_d, out.to(attn_ptr.dtype.element_ty))


@gluon.jit
def _page(kv_ring, ready, i, has, layout: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr):
    # the stream's i-th slot's keys and values in registers (float32), once landed (has: else no wait)
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1, pred=has)
    page = kv_ring.index(s)
    k = page.slice(0, PAGE, dim=0).load(layout).to(gl.float32)
    return k, page.slice(PAGE, PAGE, dim=0).load(layout).to(gl.float32)


@gluon.jit
def _item_constants(meta, inv_freq_ptr, M, pid, HEADS: gl.constexpr, D: gl.constexpr):
    # the CTA's attention row's RoPE cos and sin (_attend's layout; libdevice's, computed once: its code is large),
    # KV slot and new position's index
    pos_ptr, slots_ptr, tables_ptr, stride_bt, ctx_ptr = meta
    layout: gl.constexpr = gl.BlockedLayout([1, D // 16], [2, 16], [4, 1], [1, 0])
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    r = gl.minimum(pid // HEADS, M - 1)
    ang = gl.load(pos_ptr + r).to(gl.float32) * gl.load(inv_freq_ptr + offs_d % (D // 2))
    return gl.cos(ang), gl.sin(ang), gl.load(slots_ptr + r), gl.load(ctx_ptr + r) - 1


@gluon.jit
def stamp(trace_ptr, pid, layer, num_layers, event: gl.constexpr, TRACE: gl.constexpr):
    """TRACE (benchmarks/layers_probe.py --trace; off in the engine): the global timer (ns) at `event` of `layer`
    in trace_ptr[pid, layer, event] (TRACE_EVENTS a layer)."""
    if TRACE:
        now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                        pack=1)
        gl.store(trace_ptr + (pid * num_layers + layer) * TRACE_EVENTS + event, now)


@gluon.jit
def _sub(tr, pid, EV: gl.constexpr, k: gl.constexpr, TRACE: gl.constexpr):
    # a stamp inside a staging or the attention (EV: its first event; -1: none)
    if EV >= 0:
        stamp(tr[0], pid, tr[1], tr[2], EV + k, TRACE)


@gluon.jit
def _wait_count(cnt_ptr, base, programs):
    # until every CTA has added to this count in this launch (wrapping int32 differences)
    seen = gl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    while seen - base < programs:
        seen = gl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    gl.thread_barrier()


@gluon.jit
def _count(cnt_ptr):
    gl.thread_barrier()  # the partition's stores are issued
    gl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")


@gluon.jit
def tiles(n_tiles, pid, programs):
    """How many of range(pid, n_tiles, programs): the CTA's tiles of a phase."""
    return gl.maximum(n_tiles - pid + programs - 1, 0) // programs


@gluon.jit
def kv_pages(ctx_ptr, M, pid, HEADS: gl.constexpr, PAGE: gl.constexpr):
    """The key pages this CTA's (request, head) item streams per layer (0: no item)."""
    has = pid < M * HEADS
    ctx = gl.load(ctx_ptr + gl.where(has, pid // HEADS, 0))
    return gl.where(has, (ctx + PAGE - 1) // PAGE, 0)


@gluon.jit
def stager(kv_ring, ready, empty, xbuf, x_ready, bufs, acts, io, norms, meta, cnt_ptr, num_layers, M, layer_rows,
           eps, qk_scale, H: gl.constexpr, QKV: gl.constexpr, INTER: gl.constexpr, HEADS: gl.constexpr,
           D: gl.constexpr, PAGE: gl.constexpr, WARPS: gl.constexpr, STAGES: gl.constexpr, USE_PDL: gl.constexpr,
           TRACE: gl.constexpr):
    """The default partition: each layer's four stagings and the CTA's attention item, the readout, _finish."""
    hq_ptr, hm_ptr, qkv_ptr, attn_ptr, o_ptr, act_ptr, d_ptr = acts
    h_in_ptr, out_ptr, k_ptr, v_ptr, inv_freq_ptr, trace = io
    n_in, n_in2, n_post, n_post2, n_final = norms
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    if USE_PDL:  # the loop's input is the kernel before's output
        _gdc_wait()
    base = gl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu") * programs
    qkv_boxes = tiles(QKV // BN, pid, programs) * (H // BK)
    per_layer = (qkv_boxes + kv_pages(meta[4], M, pid, HEADS, PAGE) + tiles(H // BN, pid, programs) * (H // BK)
                 + tiles(INTER // BN, pid, programs) * (2 * H // BK) + tiles(H // BN, pid, programs) * (INTER // BK))
    item = _item_constants(meta, inv_freq_ptr, M, pid, HEADS, D)
    for layer in range(num_layers):
        c = cnt_ptr + 1 + PHASES * layer
        lh = layer * BM * H
        sums = bufs[3] + layer * 2 * programs * BM  # this layer's o and down row sums
        if layer == 0:
            stamp(trace, pid, layer, num_layers, 0, TRACE)
            _sandwich(h_in_ptr, h_in_ptr, n_in, n_in, hq_ptr, out_ptr, xbuf, x_ready, bufs, sums, 0, M, pid, eps, H,
                      False, True, WARPS)
        else:
            _wait_count(c - 1, base, programs)
            stamp(trace, pid, layer, num_layers, 0, TRACE)
            _sandwich(hm_ptr + lh - BM * H, d_ptr + lh - BM * H, n_post2 + (layer - 1) * H, n_in + layer * H,
                      hq_ptr + lh, out_ptr, xbuf, x_ready, bufs, sums - programs * BM, 2 * layer, M, pid, eps, H,
                      True, True, WARPS, (trace, layer, num_layers), 16, TRACE)
        stamp(trace, pid, layer, num_layers, 1, TRACE)
        _wait_count(c, base, programs)
        stamp(trace, pid, layer, num_layers, 2, TRACE)
        if pid < M * HEADS:
            _attend(kv_ring, ready, empty, layer * per_layer + qkv_boxes, qkv_ptr + layer * BM * QKV, attn_ptr + lh,
                    (k_ptr, v_ptr), layer.to(gl.int64) * layer_rows, item, qk_scale, pid, QKV, HEADS, D, PAGE,
                    STAGES, (trace, layer, num_layers), TRACE)
        _count(c + 1)
        stamp(trace, pid, layer, num_layers, 3, TRACE)
        _wait_count(c + 1, base, programs)
        stamp(trace, pid, layer, num_layers, 4, TRACE)
        copy_rows(attn_ptr + lh, xbuf, x_ready, M, H, H // BK, WARPS)
        stamp(trace, pid, layer, num_layers, 5, TRACE)
        _wait_count(c + 2, base, programs)
        stamp(trace, pid, layer, num_layers, 6, TRACE)
        _sandwich(hq_ptr + lh, o_ptr + lh, n_in2 + layer * H, n_post + layer * H, hm_ptr + lh, out_ptr, xbuf,
                  x_ready, bufs, sums, 2 * layer + 1, M, pid, eps, H, True, True, WARPS, (trace, layer, num_layers),
                  20, TRACE)
        stamp(trace, pid, layer, num_layers, 7, TRACE)
        _wait_count(c + 3, base, programs)
        stamp(trace, pid, layer, num_layers, 8, TRACE)
        copy_rows(act_ptr + layer * BM * INTER, xbuf, x_ready, M, INTER, INTER // BK, WARPS)
        stamp(trace, pid, layer, num_layers, 9, TRACE)
    last = (num_layers - 1) * BM * H
    _wait_count(cnt_ptr + PHASES * num_layers, base, programs)
    _sandwich(hm_ptr + last, d_ptr + last, n_post2 + (num_layers - 1) * H, n_final, hq_ptr, out_ptr, xbuf, x_ready,
              bufs, bufs[3] + (2 * num_layers - 1) * programs * BM, 2 * num_layers, M, pid, eps, H, True, False, WARPS)
    stamp(trace, pid, num_layers - 1, num_layers, 14, TRACE)
    _finish(cnt_ptr, base, programs, num_layers, USE_PDL)


@gluon.jit
def _finish(cnt_ptr, base, programs, num_layers, USE_PDL: gl.constexpr):
    # the launch's end count; the last CTA to finish bumps the generation (cnt_ptr[0])
    if USE_PDL:
        _gdc_launch_dependents()
    gl.thread_barrier()
    done = gl.atomic_add(cnt_ptr + 1 + PHASES * num_layers, 1, sem="acq_rel", scope="gpu")
    if done - base == programs - 1:
        gl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
