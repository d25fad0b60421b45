"""Ouro's decode layer between two attentions at 64 rows, as one warp-specialized Gluon launch in ws_layer64.py's
design: what the engine's N = 64 step would launch between its decode attention calls (benchmarks/ws_step64_probe.py
times it there; docs/benchmarks.md, session 27). Not yet dispatched by the engine.

A launch of layer l (HAS_MLP) runs, from the attention output a and the residual h:
    o    = a Wo_l^T                                     (a through TMA)
    hm   = h + n1_l * rms(o);   x = n2_l * rms(hm)      (the stager; ws_ouro64_stage.py's sandwich)
    act  = SiLU(x Wg_l^T) * (x Wu_l^T)
    d    = act Wd_l^T                                   (act through TMA)
    h'   = hm + n3_l * rms(d);  x' = n0_{l+1} * rms(h') (HAS_QKV)
    qkv  = x' Wqkv_{l+1}^T, RoPE on q and k; q out, k and v to layer l + 1's slots (HAS_QKV)
with n0..n3 the layer's input_layernorm, input_layernorm_2, post_attention_layernorm and post_attention_layernorm_2
(engine/layer_stack.NORMS). Without HAS_QKV (a pass's last layer) it ends at d, hm and d left for the readout's
add + norm; without HAS_MLP (a pass's first) it is x' = n0_0 * rms(h) and the qkv phase. Phases split K S_IN ways
(o, gate_up, qkv) or S_DOWN ways (down), the S CTAs of a group summing their tiles' partials (ws_layer64.py);
the qkv sums wait for the partner half of each head (another group's tile) to rotate it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ws_chain import _wait_for_phase  # noqa: E402
from ws_chain64_wg import _fence_proxy_async, staged_chunks  # noqa: E402
from ws_layer64 import _group_barrier, _load_phase, _mma_unit  # noqa: E402
from ws_ouro64_stage import BLOCK_K, BLOCK_N, DOWN_, GU_, O_, QKV_, group_sums, stage_sandwich  # noqa: E402

from engine.gluon_attention import _gdc_launch_dependents, _gdc_wait  # noqa: E402
from engine.gluon_ring import weight_ring  # noqa: E402

STAGER_WARPS = gl.constexpr(8)  # the stager's warps (its sandwich's rows: 16 x 128 values over 256 threads)
STAGER_REGS = gl.constexpr(144)


@gluon.constexpr_function
def _kind64(kind):
    # ws_layer64's kind of a phase (its column count and gate / up pairs in _load_phase and _mma_unit)
    return {0: 1, 1: 2, 2: 3, 3: 0}[kind]


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
        i = _load_phase(wo, layer, i, ring, ready, empty, 1, H, QKV, INTER, S_IN, CHUNKS, STAGES)
        i = _load_phase(wgu, layer, i, ring, ready, empty, 2, H, QKV, INTER, S_IN, CHUNKS, STAGES)
        i = _load_phase(wd, layer, i, ring, ready, empty, 3, H, QKV, INTER, S_DOWN, CHUNKS, STAGES)
    if HAS_QKV:
        i = _load_phase(wq, layer + 1, i, ring, ready, empty, 0, H, QKV, INTER, S_IN, CHUNKS, STAGES)


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
                _wait_for_phase(cnt_ptr + kind - 1, programs)
                _fence_proxy_async()
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
    kind64: gl.constexpr = _kind64(KIND)
    cols: gl.constexpr = QKV if KIND == QKV_ else (INTER if KIND == GU_ else H)
    n_tiles: gl.constexpr = cols // BLOCK_N
    for u in range(pid, n_tiles * S, programs):
        i = _mma_unit(xbuf, x_ready, ring, ready, empty, i, p, u // S, pid % S, part_ptr, PW, INTER, kind64, CHUNKS,
                      STAGES, mma)
    for c in gl.static_range(CHUNKS):  # a CTA without units too: no chunk may still be landing when the stager
        mbarrier.wait(x_ready.index(c), p & 1)  # arms the next phase's (one completion a phase)
    fence_async_shared()  # the wgmmas' reads (synchronous, done) ordered before the next phase's writes
    mbarrier.arrive(x_empty.index(0), count=1)
    _group_barrier(gcnt_ptr, KIND, S)
    group_sums(KIND, n_tiles, out_ptr, sq_ptr, part_ptr, rowsq_ptr, gcnt_ptr, io, M, eps, KIND, H, INTER, PW, S, HQ,
               HKV, D, WARPS)
    if not LAST:
        _fence_proxy_async()
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


@gluon.jit
def ws_ouro64_kernel(wo, wgu, wd, wq, a_desc, act_desc, h_ptr, h_out_ptr, hm_ptr, o_ptr, d_ptr, act_ptr, osq_ptr,
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


class Scratch:
    """A pass's launches' rows and scratch (one launch at a time): hm, o, d ([64, H] bf16), act ([64, INTER]), the
    tiles' row sums of o and d, the float32 partials, the row sums of the staged ranges, and per launch its four
    phase counts and [4, CTAs] group counts (zeroed once a pass: `zero_counts`)."""

    def __init__(self, h: int, qkv: int, inter: int, launches: int, sms: int, s_in: int, s_down: int,
                 device) -> None:
        def rows(width, dtype=torch.bfloat16):
            return torch.zeros(64, width, dtype=dtype, device=device)

        self.hm, self.o, self.d, self.act = rows(h), rows(h), rows(h), rows(inter)
        self.osq = torch.zeros(h // 64, 64, dtype=torch.float32, device=device)
        self.dsq = torch.zeros_like(self.osq)
        self.part = torch.zeros(max(s_in, s_down), 64, max(qkv, 2 * inter), dtype=torch.float32, device=device)
        self.rowsq = torch.zeros(4, sms, 64, dtype=torch.float32, device=device)
        self.counts = torch.zeros(launches, 4 + 4 * sms, dtype=torch.int32, device=device)

    def zero_counts(self) -> None:
        self.counts.zero_()


def check_shapes(h: int, inter: int, hq: int, hkv: int, d: int, sms: int, stages: int, s_in: int,
                 s_down: int) -> None:
    """What the kernel needs of a model and a grid, with the field named."""
    if d != 128:
        raise ValueError(f"head_dim must be 128 (a head's halves are two 64-column tiles), got {d}")
    if hq * d != h:
        raise ValueError(f"num_attention_heads x head_dim ({hq} x {d}) must equal hidden_size ({h})")
    if h % (s_in * BOX) or inter % (s_down * BOX) or h // s_in != inter // s_down:
        raise ValueError(f"s_in ({s_in}) and s_down ({s_down}) must give every phase the same whole chunks of {BOX} "
                         f"(hidden {h} / s_in == intermediate {inter} / s_down)")
    if sms % s_in or sms % s_down:
        raise ValueError(f"the CTAs ({sms}) must be a multiple of s_in ({s_in}) and s_down ({s_down})")
    if not 2 <= stages <= 12:
        raise ValueError(f"stages must be 2..12 (16 KB weight boxes), got {stages}")


BOX = 128


def ouro64_args(w: dict, sc: Scratch, launch: int, layer: int, rows: dict, kv, rope, eps: float, has_mlp: bool,
                has_qkv: bool, stages: int = 8, s_in: int = 4, s_down: int = 11) -> tuple[tuple, dict]:
    """ws_ouro64_kernel's arguments and constexprs but USE_PDL. w: the stacked weights (wq, wo, wgu, wd: [layers x
    rows, K]; norms: [4, layers, H], engine/layer_stack.NORMS' order); launch: its counts' row; layer: the MLP's
    (-1 without); rows: h, h_out ([M, H]), a ([M, H], the attention's rows), q ([M, HQ x D]); kv: layer + 1's planes
    ([slots, HKV, D] each); rope: (positions [M] int64, slots [M] int64, inv_freq [D / 2] float32)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    norms = w["norms"]
    layers, h = norms.shape[1], norms.shape[2]
    qkv, inter = w["wq"].shape[0] // layers, w["wd"].shape[1]
    d = kv[0].shape[-1]
    hkv, hq = kv[0].shape[-2], (qkv - 2 * kv[0].shape[-2] * d) // d
    sms = sc.rowsq.shape[1]
    check_shapes(h, inter, hq, hkv, d, sms, stages, s_in, s_down)
    m = rows["h"].shape[0]
    if not 1 <= m <= 64:
        raise ValueError(f"rows must be 1..64, got {m}")
    box = gl.NVMMASharedLayout.get_default_for([64, BOX], gl.bfloat16)

    def desc(t):
        return TensorDescriptor.from_tensor(t, [64, BOX], box)

    counts = sc.counts[launch]
    args = (desc(w["wo"]), desc(w["wgu"]), desc(w["wd"]), desc(w["wq"]), desc(rows["a"]), desc(sc.act), rows["h"],
            rows["h_out"], sc.hm, sc.o, sc.d, sc.act, sc.osq, sc.dsq, norms, rows["q"], kv[0], kv[1], *rope, sc.part,
            sc.rowsq, counts[:4], counts[4:], layer, m, eps)
    return args, dict(H=h, QKV=qkv, INTER=inter, HQ=hq, HKV=hkv, D=d, LAYERS=layers, PW=sc.part.shape[2], S_IN=s_in,
                      S_DOWN=s_down, STAGES=stages, HAS_MLP=has_mlp, HAS_QKV=has_qkv, num_warps=4)


def compile_for_sm90(has_mlp: bool = True, has_qkv: bool = True, stages: int = 8, s_in: int = 4, s_down: int = 11,
                     use_pdl: bool = True) -> dict:
    """ws_ouro64_kernel compiled for sm90 at Ouro-1.4B's shape without a GPU (ws_chain.compile_sm90)."""
    from ws_chain import compile_sm90

    h, inter, heads, d, layers = 2048, 5632, 16, 128, 24
    check_shapes(h, inter, heads, heads, d, s_in * s_down, stages, s_in, s_down)
    layout = gl.NVMMASharedLayout.get_default_for([64, BOX], gl.bfloat16)
    box = f"tensordesc<bf16[64, {BOX}],{layout!r}>"
    signature = {name: box for name in ("wo", "wgu", "wd", "wq", "a_desc", "act_desc")}
    bf16 = ("h_ptr", "h_out_ptr", "hm_ptr", "o_ptr", "d_ptr", "act_ptr")
    signature.update({name: "*bf16" for name in bf16})
    signature.update(osq_ptr="*fp32", dsq_ptr="*fp32", n_ptr="*bf16", q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16",
                     pos_ptr="*i64", slot_ptr="*i64", inv_freq_ptr="*fp32", part_ptr="*fp32", rowsq_ptr="*fp32",
                     cnt_ptr="*i32", gcnt_ptr="*i32", layer="i32", M="i32", eps="fp32")
    constexprs = dict(H=h, QKV=3 * h, INTER=inter, HQ=heads, HKV=heads, D=d, LAYERS=layers,
                      PW=max(3 * h, 2 * inter), S_IN=s_in, S_DOWN=s_down, STAGES=stages, HAS_MLP=has_mlp,
                      HAS_QKV=has_qkv, USE_PDL=use_pdl, num_warps=4)
    aligned = (*bf16, "osq_ptr", "dsq_ptr", "n_ptr", "q_ptr", "k_ptr", "v_ptr", "part_ptr", "rowsq_ptr")
    return compile_sm90(ws_ouro64_kernel, signature, constexprs, aligned)
