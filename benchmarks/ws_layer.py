"""The layer-shaped warp-specialized Gluon kernel of benchmarks/ws_layer_probe.py: Ouro-1.4B's four GEMMs of a
layer and what joins them (norms, the residual stream, SiLU x up, down's 5632-wide activations), attention
aside, for up to 8 batch rows; ws_layer_probe.py's docstring says what it computes and how it is timed,
docs/benchmarks.md (session 14) what it measured.

One CTA per SM, as ws_chain.py's SPLIT 3: a loader warp streams every weight box (16 rows x 256) through a
ring; a 1-warp consumer multiplies (4 MMA chains; gate and up as a pair of boxes per K step) and bumps the
phase's counter after its stores; the default partition (4 warps) waits at each boundary for every CTA's
counter, then stages the phase's input into shared memory (32 chunks of 8 x 256) and signals each chunk. The
norm phases add the residual (each CTA writing its 16-column slice of the residual stream) and either
normalize whole rows before signalling, or (EPILOGUE_NORM) signal h * n chunk by chunk and publish the rows'
1 / rms for the consumer's epilogue; the other phases signal each chunk as its copy lands.
"""

from __future__ import annotations

import sys
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ws_chain import _load_box, _wait_for_phase, _weight_ring  # noqa: E402

from engine.gluon_layers import multiply, staging  # noqa: E402 - a phase's tiles; the stager's buffers
from engine.gluon_layers_stage import copy_rows  # noqa: E402 - chunks of rows staged, each signalled as it lands

SIZES = {"H": 2048, "QKV": 6144, "INTER": 5632,  # Ouro-1.4B's hidden, qkv and intermediate widths
         "BN": 16, "BK": 256, "BM": 8, "XCHUNKS": 32}  # tile columns, box K, batch rows, staged chunks (2^k >= 22)
H, QKV, INTER, BN, BK, BM, XCHUNKS = (gl.constexpr(SIZES[k]) for k in SIZES)  # what the kernels read
_EPS = 1e-6  # the norms' epsilon (Ouro's rms_norm_eps)
EPS = gl.constexpr(_EPS)


@gluon.jit
def _load_boxes(desc, ring, ready, empty, i, row0, pid, programs, NT: gl.constexpr, NKB: gl.constexpr,
                PAIR: gl.constexpr, PAIR_OFFSET: gl.constexpr, STAGES: gl.constexpr):
    for t in range(pid, NT, programs):
        for kb in range(NKB):
            for half in gl.static_range(2 if PAIR else 1):  # gate, then up
                _load_box(desc, row0 + half * PAIR_OFFSET + t * BN, kb * BK, ring, ready, empty, i, STAGES)
                i += 1
    return i


@gluon.jit
def _loader(wq, wo, wgu, wd, ring, ready, empty, xbuf, x_ready, scales, acts, norms, cnt_ptr, num_layers, M,
            STAGES: gl.constexpr, EPILOGUE_NORM: gl.constexpr):
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    i = 0
    for layer in range(num_layers):
        i = _load_boxes(wq, ring, ready, empty, i, layer * QKV, pid, programs, QKV // BN, H // BK, False, 0, STAGES)
        i = _load_boxes(wo, ring, ready, empty, i, layer * H, pid, programs, H // BN, H // BK, False, 0, STAGES)
        i = _load_boxes(wgu, ring, ready, empty, i, layer * 2 * INTER, pid, programs, INTER // BN, H // BK, True,
                        INTER, STAGES)
        i = _load_boxes(wd, ring, ready, empty, i, layer * H, pid, programs, H // BN, INTER // BK, False, 0, STAGES)


@gluon.jit
def _finish_phase(cnt_ptr, p):
    gl.thread_barrier()  # the consumer's stores of this phase are issued
    gl.atomic_add(cnt_ptr + p, 1, sem="release", scope="gpu")


@gluon.jit
def _consumer_w(wq, wo, wgu, wd, ring, ready, empty, xbuf, x_ready, scales, acts, norms, cnt_ptr, num_layers, M,
                STAGES: gl.constexpr, EPILOGUE_NORM: gl.constexpr):
    hm_ptr, d_ptr, hq_ptr, qkv_ptr, o_ptr, act_ptr = acts
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    i = 0
    for layer in range(num_layers):
        p = 4 * layer
        i = multiply(ring, ready, empty, xbuf, x_ready, scales, i, p, layer, qkv_ptr + layer * BM * QKV, qkv_ptr, M,
                     pid, programs, QKV // BN, H, False, QKV, H, STAGES, EPILOGUE_NORM, False)
        _finish_phase(cnt_ptr, p)
        i = multiply(ring, ready, empty, xbuf, x_ready, scales, i, p + 1, layer, o_ptr + layer * BM * H, o_ptr, M, pid,
                     programs, H // BN, H, False, H, H, STAGES, False, False)
        _finish_phase(cnt_ptr, p + 1)
        i = multiply(ring, ready, empty, xbuf, x_ready, scales, i, p + 2, layer, act_ptr + layer * BM * INTER, act_ptr,
                     M, pid, programs, INTER // BN, H, True, INTER, H, STAGES, EPILOGUE_NORM, False)
        _finish_phase(cnt_ptr, p + 2)
        i = multiply(ring, ready, empty, xbuf, x_ready, scales, i, p + 3, layer, d_ptr + (layer + 1) * BM * H, d_ptr, M,
                     pid, programs, H // BN, INTER, False, H, H, STAGES, False, False)
        _finish_phase(cnt_ptr, p + 3)


@gluon.jit
def _stage_norm(a_ptr, b_ptr, res_ptr, n_ptr, xbuf, x_ready, scales, M, pid, WARPS: gl.constexpr,
                EPILOGUE_NORM: gl.constexpr):
    # h = a + b: a's and b's chunks land in xbuf[0..7] and [8..15] (cp.async, all in flight at once), h goes
    # back to [0..7], its squares summed per row, and this CTA writes its 16 columns of h to res_ptr (the
    # residual stream, read in later phases). EPILOGUE_NORM: each chunk becomes h * n and is signalled as
    # it lands, the rows' 1 / rms follows in `scales` for the consumer's epilogue; else, once every chunk is
    # in, each becomes rms(h) * n and all are signalled.
    NC: gl.constexpr = H // BK
    scale_smem, scale_ready = scales
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    rm = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    rk = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    rows = (rm < M)[:, None]
    for c in gl.static_range(NC):
        async_copy.async_copy_global_to_shared(xbuf.index(c), a_ptr + rm[:, None] * H + (c * BK + rk)[None, :],
                                               mask=rows)
        async_copy.async_copy_global_to_shared(xbuf.index(NC + c), b_ptr + rm[:, None] * H + (c * BK + rk)[None, :],
                                               mask=rows)
        async_copy.commit_group()
    ss = gl.zeros([BM], gl.float32, gl.SliceLayout(1, layout))
    for c in gl.static_range(NC):
        async_copy.wait_group(NC - 1 - c)
        gl.thread_barrier()
        h = (xbuf.index(c).load(layout).to(gl.float32) + xbuf.index(NC + c).load(layout).to(gl.float32))
        h = h.to(gl.bfloat16)
        cols = c * BK + rk
        mine = (cols >= pid * BN) & (cols < pid * BN + BN)
        gl.store(res_ptr + rm[:, None] * H + cols[None, :], h, mask=rows & mine[None, :])
        hf = h.to(gl.float32)
        ss += gl.sum(hf * hf, axis=1)
        if EPILOGUE_NORM:
            w = gl.load(n_ptr + cols).to(gl.float32)
            xbuf.index(c).store((hf * w[None, :]).to(gl.bfloat16))
            gl.thread_barrier()
            mbarrier.arrive(x_ready.index(c), count=1)
        else:
            xbuf.index(c).store(h)
    scale = gl.rsqrt(ss / H + EPS)
    if EPILOGUE_NORM:
        scale_smem.store(scale)
        gl.thread_barrier()
        mbarrier.arrive(scale_ready.index(0), count=1)
    else:
        gl.thread_barrier()
        for c in gl.static_range(NC):
            w = gl.load(n_ptr + c * BK + rk).to(gl.float32)
            x = xbuf.index(c).load(layout).to(gl.float32) * scale[:, None] * w[None, :]
            xbuf.index(c).store(x.to(gl.bfloat16))
        gl.thread_barrier()
        for c in gl.static_range(NC):
            mbarrier.arrive(x_ready.index(c), count=1)


@gluon.jit
def _stage_in(a_ptr, b_ptr, res_ptr, n_ptr, xbuf, x_ready, scales, M, pid, WARPS: gl.constexpr, DIAG: gl.constexpr,
              EPILOGUE_NORM: gl.constexpr):
    if DIAG == 2:  # diagnostic: a norm phase staged as a plain copy of a (no sum, no norm, no residual)
        copy_rows(a_ptr, xbuf, x_ready, M, H, H // BK, WARPS)
    else:
        _stage_norm(a_ptr, b_ptr, res_ptr, n_ptr, xbuf, x_ready, scales, M, pid, WARPS, EPILOGUE_NORM)


@gluon.jit
def _stager(xbuf, x_ready, scales, acts, norms, cnt_ptr, num_layers, M, WARPS: gl.constexpr, DIAG: gl.constexpr,
            EPILOGUE_NORM: gl.constexpr):
    hm_ptr, d_ptr, hq_ptr, qkv_ptr, o_ptr, act_ptr = acts
    n1_ptr, n2_ptr = norms
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    for layer in range(num_layers):
        p = 4 * layer
        if layer > 0:
            _wait_for_phase(cnt_ptr + p - 1, programs)
        # h = hm + d of the layer before (layer 0: the input and zeros)
        _stage_in(hm_ptr + layer * BM * H, d_ptr + layer * BM * H, hq_ptr + layer * BM * H, n1_ptr + layer * H,
                  xbuf, x_ready, scales, M, pid, WARPS, DIAG, EPILOGUE_NORM)
        _wait_for_phase(cnt_ptr + p, programs)
        copy_rows(qkv_ptr + layer * BM * QKV, xbuf, x_ready, M, QKV, H // BK, WARPS)
        _wait_for_phase(cnt_ptr + p + 1, programs)
        _stage_in(hq_ptr + layer * BM * H, o_ptr + layer * BM * H, hm_ptr + (layer + 1) * BM * H,
                  n2_ptr + layer * H, xbuf, x_ready, scales, M, pid, WARPS, DIAG, EPILOGUE_NORM)
        _wait_for_phase(cnt_ptr + p + 2, programs)
        copy_rows(act_ptr + layer * BM * INTER, xbuf, x_ready, M, INTER, INTER // BK, WARPS)


@gluon.jit
def ws_layer_kernel(wq, wo, wgu, wd, hm_ptr, d_ptr, hq_ptr, qkv_ptr, o_ptr, act_ptr, n1_ptr, n2_ptr, cnt_ptr,
                    num_layers, M, x_layout: gl.constexpr, STAGES: gl.constexpr, DIAG: gl.constexpr,
                    EPILOGUE_NORM: gl.constexpr, num_warps: gl.constexpr):
    # DIAG 2 (diagnostic; the output is then wrong): the norm phases staged as copies. EPILOGUE_NORM: the norm
    # phases stage h * n chunk by chunk and the consumer divides by the rms in its epilogue (rounding after
    # the product, not before: within bf16 of the reference)
    gl.static_assert(DIAG != 2 or not EPILOGUE_NORM, "the copies publish no row scales: the epilogue would wait")
    ring, ready, empty = _weight_ring(wq, STAGES)
    xbuf, x_ready, scale_smem, scale_ready = staging(gl.bfloat16, XCHUNKS, x_layout)
    scales = (scale_smem, scale_ready)
    acts = (hm_ptr, d_ptr, hq_ptr, qkv_ptr, o_ptr, act_ptr)
    norms = (n1_ptr, n2_ptr)
    gl.warp_specialize([
        (_stager, (xbuf, x_ready, scales, acts, norms, cnt_ptr, num_layers, M, num_warps, DIAG, EPILOGUE_NORM)),
        (_consumer_w, (wq, wo, wgu, wd, ring, ready, empty, xbuf, x_ready, scales, acts, norms, cnt_ptr, num_layers,
                       M, STAGES, EPILOGUE_NORM)),
        (_loader, (wq, wo, wgu, wd, ring, ready, empty, xbuf, x_ready, scales, acts, norms, cnt_ptr, num_layers, M,
                   STAGES, EPILOGUE_NORM)),
    ], [1, 1], [192, 40])
