"""Ouro's decode layer between two attention calls at up to 64 requests (one new row each) as one warp-specialized
Gluon launch (Hopper): what a decode loop pass of more than 8 requests runs between its decode attention calls where
OUROBATCH_DECODE_LAYERS64 is on (layers64.py: the pass, layers64_dispatch.py: when; off by default: on the H200 the
N = 64 step took 17.3 ms against the kernels' 12.2, the K-split partials' round trip bounding it, docs/benchmarks.md
session 27). gluon_layers64_stage.py holds the stager's and the sums' math.

A launch of layer l (HAS_MLP) runs, from the attention output a and the residual h:
    o    = a Wo_l^T                                     (a through TMA)
    hm   = h + n1_l * rms(o);   x = n2_l * rms(hm)      (the stager's sandwich)
    act  = SiLU(x Wg_l^T) * (x Wu_l^T)
    d    = act Wd_l^T                                   (act through TMA)
    h'   = hm + n3_l * rms(d);  x' = n0_{l+1} * rms(h') (HAS_QKV)
    qkv  = x' Wqkv_{l+1}^T, RoPE on q and k; q out, k and v to layer l + 1's slots (HAS_QKV)
with n0..n3 the layer's input_layernorm, input_layernorm_2, post_attention_layernorm and post_attention_layernorm_2
(layer_stack.NORMS). Without HAS_QKV (a pass's last layer) it ends at d, hm and d left for the readout's add + norm;
without HAS_MLP (a pass's first) it is x' = n0_0 * rms(h) and the qkv phase. Each phase splits K S_IN ways (o,
gate_up, qkv) or S_DOWN ways (down) among the CTAs of a group, which sum their tiles' partials (gluon_splitk.py);
the qkv sums wait for the partner half of each head (another group's tile) to rotate it. One CTA per SM, all
resident: the phases end in grid-wide counts (zeroed once a pass). Imported lazily.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .gluon_attention import _gdc_launch_dependents, _gdc_wait
from .gluon_layers64_stage import DOWN_, GU_, O_, QKV_, group_sums, stage_sandwich
from .gluon_ring import weight_ring
from .gluon_splitk import (BLOCK_K, BLOCK_N, fence_proxy_async_global, group_barrier, load_phase, mma_unit,
                           staged_chunks, wait_for_count)

STAGER_WARPS = gl.constexpr(8)  # the stager's warps (a sandwich's 16 x 128 values over 256 threads)
STAGER_REGS = gl.constexpr(144)  # its registers (ptxas: 60 B of spill at Ouro-1.4B's shape, 192 B with 4 warps)


@gluon.constexpr_function
def _present(kind, has_mlp, has_qkv):
    return has_qkv if kind == 3 else has_mlp


@gluon.constexpr_function
def _last_kind(has_qkv):
    return 3 if has_qkv else 2


@gluon.jit
def _loader(wo, wgu, wd, wq, ring, ready, empty, layer, H: gl.constexpr, QKV: gl.constexpr, INTER: gl.constexpr,
            S_IN: gl.constexpr, S_DOWN: gl.constexpr, CHUNKS: gl.constexpr, STAGES: gl.constexpr,
            HAS_MLP: gl.constexpr, HAS_QKV: gl.constexpr):
    # every phase's weight boxes in order, across the boundaries (nobody writes weights: no wait for the kernel before)
    i = 0
    if HAS_MLP:
        i = load_phase(wo, layer * H, i, ring, ready, empty, H // BLOCK_N, 0, S_IN, CHUNKS, STAGES)
        i = load_phase(wgu, layer * 2 * INTER, i, ring, ready, empty, INTER // BLOCK_N, INTER, S_IN, CHUNKS, STAGES)
        i = load_phase(wd, layer * H, i, ring, ready, empty, H // BLOCK_N, 0, S_DOWN, CHUNKS, STAGES)
    if HAS_QKV:
        i = load_phase(wq, (layer + 1) * QKV, i, ring, ready, empty, QKV // BLOCK_N, 0, S_IN, CHUNKS, STAGES)


@gluon.jit
def _stage_copy(desc, xbuf, x_ready, S: gl.constexpr, CHUNKS: gl.constexpr):
    # a / act: the CTA's K range of rows 0..63 (rows past the tensor's come back as zeros)
    k0 = (gl.program_id(0) % S) * (CHUNKS * BLOCK_K)
    for c in gl.static_range(CHUNKS):
        mbarrier.expect(x_ready.index(c), desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [0, k0 + c * BLOCK_K], x_ready.index(c), xbuf.index(c))


@gluon.jit
def _stager(xbuf, x_ready, x_empty, a_desc, act_desc, rows_io, n_ptr, rowsq_ptr, cnt_ptr, layer, M, eps,
            H: gl.constexpr, S_IN: gl.constexpr, S_DOWN: gl.constexpr, CHUNKS: gl.constexpr, HAS_MLP: gl.constexpr,
            HAS_QKV: gl.constexpr, USE_PDL: gl.constexpr, LAYERS: gl.constexpr):
    # each phase's K range once every CTA has ended the phase before (its count); the norms n0..n3 of layer l at
    # n_ptr + (k x LAYERS + l) x H
    h_ptr, h_out_ptr, hm_ptr, o_ptr, d_ptr, osq_ptr, dsq_ptr = rows_io
    programs = gl.num_programs(0)
    if USE_PDL:  # the kernel before wrote a and h; every store of the launch comes after a staging
        _gdc_wait()
        _gdc_launch_dependents()
    p = 0  # the launch's phase ordinal: its chunks' barrier parity
    for kind in gl.static_range(4):
        if _present(kind, HAS_MLP, HAS_QKV):
            mbarrier.wait(x_empty.index(0), (p & 1) ^ 1)  # this CTA is done with the last phase's chunks
            if p > 0:
                wait_for_count(cnt_ptr + kind - 1, programs)
                fence_proxy_async_global()
            if kind == O_:
                _stage_copy(a_desc, xbuf, x_ready, S_IN, CHUNKS)
            elif kind == GU_:
                stage_sandwich(xbuf, x_ready, GU_, h_ptr, o_ptr, osq_ptr, hm_ptr, n_ptr + (LAYERS + layer) * H,
                               n_ptr + (2 * LAYERS + layer) * H, rowsq_ptr, M, eps, True, S_IN, CHUNKS, H, STAGER_WARPS)
            elif kind == DOWN_:
                _stage_copy(act_desc, xbuf, x_ready, S_DOWN, CHUNKS)
            elif HAS_MLP:
                stage_sandwich(xbuf, x_ready, QKV_, hm_ptr, d_ptr, dsq_ptr, h_out_ptr,
                               n_ptr + (3 * LAYERS + layer) * H, n_ptr + (layer + 1) * H, rowsq_ptr, M, eps, True,
                               S_IN, CHUNKS, H, STAGER_WARPS)
            else:
                stage_sandwich(xbuf, x_ready, QKV_, h_ptr, d_ptr, dsq_ptr, h_out_ptr, n_ptr, n_ptr + (layer + 1) * H,
                               rowsq_ptr, M, eps, False, S_IN, CHUNKS, H, STAGER_WARPS)
            p += 1


@gluon.jit
def _mma_phase(xbuf, x_ready, x_empty, ring, ready, empty, i, p, out_ptr, sq_ptr, part_ptr, rowsq_ptr, cnt_ptr,
               gcnt_ptr, io, M, eps, KIND: gl.constexpr, LAST: gl.constexpr, H: gl.constexpr, QKV: gl.constexpr,
               INTER: gl.constexpr, PW: gl.constexpr, S: gl.constexpr, CHUNKS: gl.constexpr, STAGES: gl.constexpr,
               HQ: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, WARPS: gl.constexpr):
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    cols: gl.constexpr = QKV if KIND == QKV_ else (INTER if KIND == GU_ else H)
    n_tiles: gl.constexpr = cols // BLOCK_N
    pair: gl.constexpr = INTER if KIND == GU_ else 0
    for u in range(pid, n_tiles * S, programs):
        i = mma_unit(xbuf, x_ready, ring, ready, empty, i, p & 1, u // S, pid % S, part_ptr, PW, pair, CHUNKS, STAGES,
                     mma)
    for c in gl.static_range(CHUNKS):  # a CTA without units too: no chunk may still be landing when the stager
        mbarrier.wait(x_ready.index(c), p & 1)  # arms the next phase's (one completion a phase)
    fence_async_shared()  # the wgmmas' reads (synchronous, done) ordered before the next phase's writes
    mbarrier.arrive(x_empty.index(0), count=1)
    group_barrier(gcnt_ptr, KIND, S)
    group_sums(KIND, n_tiles, out_ptr, sq_ptr, part_ptr, rowsq_ptr, gcnt_ptr, io, M, eps, KIND, H, INTER, PW, S, HQ,
               HKV, D, WARPS)
    if not LAST:
        fence_proxy_async_global()
        gl.thread_barrier()  # every warp's stores of this phase are issued before its count
        gl.atomic_add(cnt_ptr + KIND, 1, sem="release", scope="gpu")
    return i


@gluon.jit
def _multiply(xbuf, x_ready, x_empty, ring, ready, empty, scratch, part_ptr, rowsq_ptr, cnt_ptr, gcnt_ptr, io, M,
              eps, H: gl.constexpr, QKV: gl.constexpr, INTER: gl.constexpr, PW: gl.constexpr, S_IN: gl.constexpr,
              S_DOWN: gl.constexpr, CHUNKS: gl.constexpr, STAGES: gl.constexpr, HQ: gl.constexpr,
              HKV: gl.constexpr, D: gl.constexpr, HAS_MLP: gl.constexpr, HAS_QKV: gl.constexpr, WARPS: gl.constexpr):
    o_ptr, osq_ptr, act_ptr, d_ptr, dsq_ptr = scratch
    last: gl.constexpr = _last_kind(HAS_QKV)
    i = 0
    p = 0
    if HAS_MLP:
        i = _mma_phase(xbuf, x_ready, x_empty, ring, ready, empty, i, p, o_ptr, osq_ptr, part_ptr, rowsq_ptr, cnt_ptr,
                       gcnt_ptr, io, M, eps, O_, False, H, QKV, INTER, PW, S_IN, CHUNKS, STAGES, HQ, HKV, D, WARPS)
        i = _mma_phase(xbuf, x_ready, x_empty, ring, ready, empty, i, p + 1, act_ptr, osq_ptr, part_ptr, rowsq_ptr,
                       cnt_ptr, gcnt_ptr, io, M, eps, GU_, False, H, QKV, INTER, PW, S_IN, CHUNKS, STAGES, HQ, HKV, D,
                       WARPS)
        i = _mma_phase(xbuf, x_ready, x_empty, ring, ready, empty, i, p + 2, d_ptr, dsq_ptr, part_ptr, rowsq_ptr,
                       cnt_ptr, gcnt_ptr, io, M, eps, DOWN_, last == 2, H, QKV, INTER, PW, S_DOWN, CHUNKS, STAGES, HQ,
                       HKV, D, WARPS)
        p = 3
    if HAS_QKV:
        i = _mma_phase(xbuf, x_ready, x_empty, ring, ready, empty, i, p, d_ptr, dsq_ptr, part_ptr, rowsq_ptr, cnt_ptr,
                       gcnt_ptr, io, M, eps, QKV_, True, H, QKV, INTER, PW, S_IN, CHUNKS, STAGES, HQ, HKV, D, WARPS)


@gluon.jit(do_not_specialize=["layer", "M"])  # one compile a launch kind, for every layer and 1..64 rows
def layers64_kernel(wo, wgu, wd, wq, a_desc, act_desc, h_ptr, h_out_ptr, hm_ptr, o_ptr, d_ptr, act_ptr, osq_ptr,
                     dsq_ptr, n_ptr, q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, inv_freq_ptr, part_ptr, rowsq_ptr,
                     cnt_ptr, gcnt_ptr, layer, M, eps, H: gl.constexpr, QKV: gl.constexpr, INTER: gl.constexpr,
                     HQ: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, LAYERS: gl.constexpr, PW: gl.constexpr,
                     S_IN: gl.constexpr, S_DOWN: gl.constexpr, STAGES: gl.constexpr, HAS_MLP: gl.constexpr,
                     HAS_QKV: gl.constexpr, USE_PDL: gl.constexpr, num_warps: gl.constexpr):
    # layer: the MLP's layer (the qkv phase's is layer + 1; -1 for a launch without the MLP)
    CHUNKS: gl.constexpr = H // S_IN // BLOCK_K
    ring, ready, empty = weight_ring(wo, STAGES)
    xbuf, x_ready, x_empty = staged_chunks(CHUNKS, a_desc)
    io = (q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, inv_freq_ptr)
    gl.warp_specialize([
        (_multiply, (xbuf, x_ready, x_empty, ring, ready, empty, (o_ptr, osq_ptr, act_ptr, d_ptr, dsq_ptr), part_ptr,
                     rowsq_ptr, cnt_ptr, gcnt_ptr, io, M, eps, H, QKV, INTER, PW, S_IN, S_DOWN, CHUNKS, STAGES, HQ,
                     HKV, D, HAS_MLP, HAS_QKV, num_warps)),
        (_loader, (wo, wgu, wd, wq, ring, ready, empty, layer, H, QKV, INTER, S_IN, S_DOWN, CHUNKS, STAGES, HAS_MLP,
                   HAS_QKV)),
        (_stager, (xbuf, x_ready, x_empty, a_desc, act_desc, (h_ptr, h_out_ptr, hm_ptr, o_ptr, d_ptr, osq_ptr,
                                                               dsq_ptr),
                   n_ptr, rowsq_ptr, cnt_ptr, layer, M, eps, H, S_IN, S_DOWN, CHUNKS, HAS_MLP, HAS_QKV, USE_PDL,
                   LAYERS)),
    ], [1, STAGER_WARPS], [40, STAGER_REGS])
