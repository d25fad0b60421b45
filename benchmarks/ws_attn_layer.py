"""ws_layer.py's layer-shaped warp-specialized Gluon kernel with decode attention inside it, for up to 8 batch
rows: does attention cost, inside one persistent kernel, what it costs as its own launch?

Per layer, five phases, each ended by a grid-wide counter (every CTA bumps it after its stores):
  qkv   x = rms(h) n1 (the stager), qkv = x Wqkv (the consumer warp, 16-column tiles)
  attn  one (request, head) item per CTA (pid < rows x 16): softmax(q K^T / sqrt(d)) V over the layer's cache
  o     o = attn Wo;  then hm = h + o, x2 = rms(hm) n2 (the stager)
  gu    act = silu(x2 Wg) (x2 Wu)
  down  d = act Wd;   the next layer's h = hm + d
The loader warp streams, in this order, the CTA's qkv weight boxes, its item's K / V pages (a [16, 128] box of
keys and one of values per 8 KB ring slot: the ring reinterpreted), then o's, gate_up's and down's boxes; it
waits only for free slots, so the item's first pages are in before the qkv phase ends. The stager (4 warps)
waits for the qkv phase, then attends (FMA, a running max, mass and weighted sum per key slot, as
engine/gluon_attention.py) taking the KV slots from the ring, writes the item's row and bumps the attention
phase's counter; the consumer warp skips the item's slots in its count. Not here (the probe's stand-ins):
RoPE, the new row's key and value, paged block tables (each request's keys are contiguous rows), Ouro's
two norms on the attention and MLP outputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ws_chain import _give, _take, _wait_for_phase, _weight_ring  # noqa: E402
from ws_layer import (BK, BM, BN, H, INTER, QKV, XCHUNKS, _finish_phase, _load_boxes,  # noqa: E402
                      _multiply_phase, _stage_copy, _stage_in)

HEADS, HEAD_DIM, PAGE = gl.constexpr(16), gl.constexpr(128), gl.constexpr(16)  # Ouro-1.4B's heads; a page of keys
PHASES = gl.constexpr(5)  # counters per layer: qkv, attn, o, gate_up, down


@gluon.jit
def _tiles(n_tiles, pid, programs):
    # how many of range(pid, n_tiles, programs)
    return gl.maximum(n_tiles - pid + programs - 1, 0) // programs


@gluon.jit
def _kv_slots(M, L, pid):
    # this CTA's KV ring slots per layer: its item's pages, if it has an item
    return gl.where(pid < M * HEADS, L // PAGE, 0)


@gluon.jit
def _load_kv(k_desc, v_desc, kv_ring, ready, empty, i, layer, M, L, pid, STAGES: gl.constexpr):
    if pid < M * HEADS:
        row0 = (layer * BM + pid // HEADS) * L
        col = (pid % HEADS) * HEAD_DIM
        for t in range(L // PAGE):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), 2 * k_desc.block_type.nbytes)
            slot = kv_ring.index(s)
            tma.async_copy_global_to_shared(k_desc, [row0 + t * PAGE, col], ready.index(s), slot.slice(0, PAGE, dim=0))
            tma.async_copy_global_to_shared(v_desc, [row0 + t * PAGE, col], ready.index(s),
                                            slot.slice(PAGE, PAGE, dim=0))
            i += 1
    return i


@gluon.jit
def _loader(wq, wo, wgu, wd, k_desc, v_desc, ring, kv_ring, ready, empty, num_layers, M, L, STAGES: gl.constexpr):
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    i = 0
    for layer in range(num_layers):
        i = _load_boxes(wq, ring, ready, empty, i, layer * QKV, pid, programs, QKV // BN, H // BK, False, 0, STAGES)
        i = _load_kv(k_desc, v_desc, kv_ring, ready, empty, i, layer, M, L, pid, STAGES)
        i = _load_boxes(wo, ring, ready, empty, i, layer * H, pid, programs, H // BN, H // BK, False, 0, STAGES)
        i = _load_boxes(wgu, ring, ready, empty, i, layer * 2 * INTER, pid, programs, INTER // BN, H // BK, True,
                        INTER, STAGES)
        i = _load_boxes(wd, ring, ready, empty, i, layer * H, pid, programs, H // BN, INTER // BK, False, 0, STAGES)


@gluon.jit
def _consumer_w(ring, ready, empty, xbuf, x_ready, scales, acts, cnt_ptr, num_layers, M, L, STAGES: gl.constexpr):
    # ws_layer's consumer, its phases counted five a layer, the item's KV slots skipped after the qkv phase;
    # _multiply_phase's `p` is the staging's index (four stagings a layer), which its chunk waits count
    hm_ptr, d_ptr, hq_ptr, qkv_ptr, o_ptr, act_ptr, attn_ptr = acts
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    i = 0
    for layer in range(num_layers):
        s = 4 * layer
        c = PHASES * layer
        i = _multiply_phase(ring, ready, empty, xbuf, x_ready, scales, i, s, layer, qkv_ptr + layer * BM * QKV, M,
                            pid, programs, QKV // BN, H // BK, False, QKV, STAGES, True)
        _finish_phase(cnt_ptr, c)
        i += _kv_slots(M, L, pid)
        i = _multiply_phase(ring, ready, empty, xbuf, x_ready, scales, i, s + 1, layer, o_ptr + layer * BM * H, M,
                            pid, programs, H // BN, H // BK, False, H, STAGES, False)
        _finish_phase(cnt_ptr, c + 2)
        i = _multiply_phase(ring, ready, empty, xbuf, x_ready, scales, i, s + 2, layer,
                            act_ptr + layer * BM * INTER, M, pid, programs, INTER // BN, H // BK, True, INTER, STAGES,
                            True)
        _finish_phase(cnt_ptr, c + 3)
        i = _multiply_phase(ring, ready, empty, xbuf, x_ready, scales, i, s + 3, layer,
                            d_ptr + (layer + 1) * BM * H, M, pid, programs, H // BN, INTER // BK, False, H, STAGES,
                            False)
        _finish_phase(cnt_ptr, c + 4)


@gluon.jit
def _attend(kv_ring, ready, empty, i, q_ptr, out_ptr, M, L, pid, qk_scale, STAGES: gl.constexpr):
    # the item's attention row from the KV slots i, i + 1, ... (its query: q_ptr's row, head pid % HEADS)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    r = pid // HEADS
    col = (pid % HEADS) * HEAD_DIM
    q = gl.load(q_ptr + r * QKV + col + offs_d).to(gl.float32) * qk_scale
    m = gl.full([PAGE], float("-inf"), gl.float32, gl.SliceLayout(1, layout))
    mass = gl.zeros([PAGE], gl.float32, gl.SliceLayout(1, layout))
    acc = gl.zeros([PAGE, HEAD_DIM], gl.float32, layout)
    for t in range(L // PAGE):
        slot = _take(kv_ring, ready, i, STAGES)
        k = slot.slice(0, PAGE, dim=0).load(layout).to(gl.float32)
        score = gl.sum(k * q[None, :], axis=1)
        m_new = gl.maximum(m, score)
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(score - m_new)
        mass = mass * alpha + p
        v = slot.slice(PAGE, PAGE, dim=0).load(layout).to(gl.float32)
        acc = acc * alpha[:, None] + p[:, None] * v
        m = m_new
        gl.thread_barrier()  # every warp has read the slot
        _give(empty, i, STAGES)
        i += 1
    top = gl.max(m, axis=0)
    w = gl.exp2(m - top)
    out = gl.sum(acc * w[:, None], axis=0) / gl.sum(mass * w, axis=0)
    gl.store(out_ptr + r * H + col + offs_d, out.to(gl.bfloat16))
    return i


@gluon.jit
def _stager(kv_ring, ready, empty, xbuf, x_ready, scales, acts, norms, cnt_ptr, num_layers, M, L,
            qk_scale, WARPS: gl.constexpr, STAGES: gl.constexpr):
    hm_ptr, d_ptr, hq_ptr, qkv_ptr, o_ptr, act_ptr, attn_ptr = acts
    n1_ptr, n2_ptr = norms
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    # the ring's boxes per layer before this CTA's KV slots, and in all
    qkv_boxes = _tiles(QKV // BN, pid, programs) * (H // BK)
    per_layer = (qkv_boxes + _kv_slots(M, L, pid) + _tiles(H // BN, pid, programs) * (H // BK)
                 + _tiles(INTER // BN, pid, programs) * (2 * H // BK) + _tiles(H // BN, pid, programs) * (INTER // BK))
    for layer in range(num_layers):
        c = PHASES * layer
        if layer > 0:
            _wait_for_phase(cnt_ptr + c - 1, programs)
        _stage_in(hm_ptr + layer * BM * H, d_ptr + layer * BM * H, hq_ptr + layer * BM * H, n1_ptr + layer * H,
                  xbuf, x_ready, scales, M, pid, WARPS, 0, True)
        _wait_for_phase(cnt_ptr + c, programs)
        if pid < M * HEADS:
            _attend(kv_ring, ready, empty, layer * per_layer + qkv_boxes, qkv_ptr + layer * BM * QKV,
                    attn_ptr + layer * BM * H, M, L, pid, qk_scale, STAGES)
        _finish_phase(cnt_ptr, c + 1)
        _wait_for_phase(cnt_ptr + c + 1, programs)
        _stage_copy(attn_ptr + layer * BM * H, xbuf, x_ready, M, H, H // BK, WARPS)
        _wait_for_phase(cnt_ptr + c + 2, programs)
        _stage_in(hq_ptr + layer * BM * H, o_ptr + layer * BM * H, hm_ptr + (layer + 1) * BM * H,
                  n2_ptr + layer * H, xbuf, x_ready, scales, M, pid, WARPS, 0, True)
        _wait_for_phase(cnt_ptr + c + 3, programs)
        _stage_copy(act_ptr + layer * BM * INTER, xbuf, x_ready, M, INTER, INTER // BK, WARPS)


@gluon.jit
def ws_attn_layer_kernel(wq, wo, wgu, wd, k_desc, v_desc, hm_ptr, d_ptr, hq_ptr, qkv_ptr, o_ptr, act_ptr, attn_ptr,
                         n1_ptr, n2_ptr, cnt_ptr, num_layers, M, L, qk_scale, x_layout: gl.constexpr,
                         STAGES: gl.constexpr, num_warps: gl.constexpr):
    gl.static_assert(BN * BK == 2 * PAGE * HEAD_DIM, "a weight box's slot holds one page of keys and one of values")
    ring, ready, empty = _weight_ring(wq, STAGES)
    kv_ring = ring._reinterpret(gl.bfloat16, [STAGES, 2 * PAGE, HEAD_DIM], k_desc.layout)
    xbuf = gl.allocate_shared_memory(gl.bfloat16, [XCHUNKS, BM, BK], x_layout)
    x_ready = gl.allocate_shared_memory(gl.int64, [XCHUNKS, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(XCHUNKS):
        mbarrier.init(x_ready.index(c), count=1)
    scale_smem = gl.allocate_shared_memory(gl.float32, [BM], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    scale_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(scale_ready.index(0), count=1)
    fence_async_shared()
    scales = (scale_smem, scale_ready)
    acts = (hm_ptr, d_ptr, hq_ptr, qkv_ptr, o_ptr, act_ptr, attn_ptr)
    norms = (n1_ptr, n2_ptr)
    gl.warp_specialize([
        (_stager, (kv_ring, ready, empty, xbuf, x_ready, scales, acts, norms, cnt_ptr, num_layers, M, L,
                   qk_scale, num_warps, STAGES)),
        (_consumer_w, (ring, ready, empty, xbuf, x_ready, scales, acts, cnt_ptr, num_layers, M, L, STAGES)),
        (_loader, (wq, wo, wgu, wd, k_desc, v_desc, ring, kv_ring, ready, empty, num_layers, M, L, STAGES)),
    ], [1, 1], [192, 40])
