"""The decode step's MLP as one warp-specialized Gluon launch (Hopper, up to 8 rows): the add + norm after
attention, gate_up + SiLU and down_proj, instead of three kernels. Off by default (OUROBATCH_DECODE_FOLD_MLP=1 turns
it on): in the full-depth step at N = 8 it measured between 0.03 ms slower and 0.06 ms faster than the kernels,
inside the runs' spread (docs/benchmarks.md, session 17), so it is kept as a measured alternative.

At N = 8 a layer and loop ran the add + norm kernel (2.5 us, no bytes to speak of), gate_up + SiLU (13.9 us
against 10.7 us of weights) and down_proj's split-K partials (8.0 against 5.4), each a kernel boundary.
Session 14's probe (benchmarks/ws_chain.py) measured the alternative, one CTA per SM whose weight stream never waits
at a phase boundary. Here, one CTA per SM and three partitions:

- the loader warp TMA-loads every weight box (16 rows x 256) of the CTA's gate_up tiles (a gate box and an up
  box per K step) and then of its down tiles into a ring of shared-memory slots (gluon_ring.py). Weights are no
  kernel's output, so it starts at launch, before the wait for the kernel before, and never waits for a phase;
- the stager (8 warps: with 4 the step lost 0.7 ms) waits for the kernel before (PDL), reads o_proj's float32
  partials and the residual rows, runs triton_fused.add_norm2_store's math on all rows at once (h + rms(o)
  w_branch, then its rms times w_next, the same roundings), writes its share of the new residual rows and puts
  the normed rows into shared memory for the consumer. Then it copies SiLU x up's rows into shared memory group by
  group (8 chunks of 256 columns), each group as soon as its 128 gate_up tiles are written, each chunk signalled as
  it lands (cp.async);
- the consumer warp multiplies (mma.sync, the weight rows as the MMA's M, four accumulator chains), writes its
  SiLU x up columns and counts each tile in its group's counter (release), then multiplies its down tiles as the
  chunks land and writes float32 columns of down's output for triton_gemm.add_rms_norm2_partials (the add + norm
  after the MLP).

Tiles go to CTAs round-robin (tile t to CTA t mod 132), so the first groups are complete long before the last CTA
ends its gate_up tiles, and no CTA waits for the slowest one as behind a grid barrier (groups=0 keeps that barrier
as a control). The counters (mlp_dispatch.new_counters, OuroForCausalLM.mlp_barrier) are never reset: each launch
adds its tiles, and the grid barrier's generation (bumped once per launch by the consumers' arrivals, never waited
on with groups) tells a launch which count to wait for. Every CTA must be resident at once: one CTA per SM, and
mlp_dispatch.mlp_fold_applies bounds the shared memory. Two engines sharing a GPU through MPS could deadlock on
the counters, as on the decode kernel's barrier (docs/api.md).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from . import mlp_dispatch, pdl
from .gluon_attention import _gdc_launch_dependents, _gdc_wait
from .gluon_ring import give, grid_arrive, grid_generation, grid_wait, load_box, take, weight_ring

BN = gl.constexpr(mlp_dispatch.MLP_BLOCK_N)  # output columns of a tile (the MMA's M)
BK = gl.constexpr(mlp_dispatch.MLP_BLOCK_K)  # K of a weight box and of a staged chunk
BM = gl.constexpr(mlp_dispatch.MLP_ROWS)  # rows the MMA's N holds
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))  # 1 warp
A_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))  # a weight box's rows
B_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=2))  # the staged rows
GROUP_CHUNKS = gl.constexpr(mlp_dispatch.MLP_GROUP_CHUNKS)  # SiLU x up's chunks staged together
GROUP_TILES = gl.constexpr(mlp_dispatch.MLP_GROUP_CHUNKS * mlp_dispatch.MLP_BLOCK_K // mlp_dispatch.MLP_BLOCK_N)


@gluon.jit
def _chunk(act_a, act_b, c: gl.constexpr):
    # chunk c (BM x BK) of SiLU x up's staged rows: the first buffer's power of two of chunks, then the second's
    if c < act_a.shape[0]:
        return act_a.index(c)
    else:
        return act_b.index(c - act_a.shape[0])


@gluon.jit
def _load_weights(wgu_desc, wd_desc, ring, ready, empty, H: gl.constexpr, I: gl.constexpr, STAGES: gl.constexpr):
    # every box of the CTA's gate_up tiles (gate, then up, per K step), then of its down tiles
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    i = pid * 0
    for t in range(pid, I // BN, programs):
        for kb in range(H // BK):
            load_box(wgu_desc, t * BN, kb * BK, ring, ready, empty, i, STAGES)
            load_box(wgu_desc, I + t * BN, kb * BK, ring, ready, empty, i + 1, STAGES)
            i += 2
    for t in range(pid, H // BN, programs):
        for kb in range(I // BK):
            load_box(wd_desc, t * BN, kb * BK, ring, ready, empty, i, STAGES)
            i += 1


@gluon.jit
def quarters(slot, b0, b1, b2, b3, acc0, acc1, acc2, acc3, a_layout: gl.constexpr):
    """acc_j += slot's j-th quarter (16 x BK / 4) @ b_j: four independent MMA chains (benchmarks/ws_layer.py's too)."""
    Q: gl.constexpr = BK // 4
    acc0 = mma_v2(slot.slice(0, Q, dim=1).load(a_layout), b0, acc0)
    acc1 = mma_v2(slot.slice(Q, Q, dim=1).load(a_layout), b1, acc1)
    acc2 = mma_v2(slot.slice(2 * Q, Q, dim=1).load(a_layout), b2, acc2)
    acc3 = mma_v2(slot.slice(3 * Q, Q, dim=1).load(a_layout), b3, acc3)
    return acc0, acc1, acc2, acc3


@gluon.jit
def zeros4():
    """Four float32 accumulators of a tile (BN weight rows x BM rows) in the MMA's layout: quarters' four chains."""
    z = gl.zeros([BN, BM], gl.float32, MMA)
    return z, z, z, z


@gluon.jit
def _operands(xs):
    # the staged rows' K chunk xs [BM, BK] as the MMA's four B operands (BK / 4 x BM each)
    Q: gl.constexpr = BK // 4
    return (xs.slice(0, Q, dim=1).permute((1, 0)).load(B_LAYOUT), xs.slice(Q, Q, dim=1).permute((1, 0)).load(B_LAYOUT),
            xs.slice(2 * Q, Q, dim=1).permute((1, 0)).load(B_LAYOUT),
            xs.slice(3 * Q, Q, dim=1).permute((1, 0)).load(B_LAYOUT))


@gluon.jit
def _gate_up_tiles(ring, ready, empty, xs, act_ptr, flags_ptr, rows, i, H: gl.constexpr, I: gl.constexpr,
                   STAGES: gl.constexpr, DIAG: gl.constexpr):
    # the CTA's tiles of silu(x gate.T) * (x up.T), rounded as triton_gemm's gate_up + SiLU kernel rounds
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    rn0 = gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    rr = gl.arange(0, BM, layout=gl.SliceLayout(0, MMA))
    for t in range(pid, I // BN, programs):
        g0, g1, g2, g3 = zeros4()
        u0, u1, u2, u3 = zeros4()
        for kb in gl.static_range(H // BK):  # static: a shared-memory slice starts at a constant
            if DIAG == 1:  # diagnostic: the stream without the MMAs
                take(ring, ready, i, STAGES)
                give(empty, i, STAGES)
                take(ring, ready, i + 1, STAGES)
                give(empty, i + 1, STAGES)
            else:
                b0, b1, b2, b3 = _operands(xs.slice(kb * BK, BK, dim=1))
                g0, g1, g2, g3 = quarters(take(ring, ready, i, STAGES), b0, b1, b2, b3, g0, g1, g2, g3, A_LAYOUT)
                give(empty, i, STAGES)
                u0, u1, u2, u3 = quarters(take(ring, ready, i + 1, STAGES), b0, b1, b2, b3, u0, u1, u2, u3,
                                           A_LAYOUT)
                give(empty, i + 1, STAGES)
            i += 2
        dtype: gl.constexpr = act_ptr.dtype.element_ty
        gate = ((g0 + g1) + (g2 + g3)).to(dtype).to(gl.float32)  # rounded as F.linear's output is
        up = ((u0 + u1) + (u2 + u3)).to(dtype).to(gl.float32)
        y = (gate / (1.0 + gl.exp(-gate)) * up).to(dtype)
        rn = t * BN + rn0
        gl.store(act_ptr + rr[None, :] * I + rn[:, None], y, mask=(rr < rows)[None, :])
        # one more tile of its chunk group written (released to the stagers that poll the group; counted with
        # GROUPS off too, so that launches of either kind can share the counters)
        gl.thread_barrier()
        gl.atomic_add(flags_ptr + t // GROUP_TILES, 1, sem="release", scope="gpu")
    return i


@gluon.jit
def _down_tiles(ring, ready, empty, act_a, act_b, a_ready, pd_ptr, rows, i, H: gl.constexpr, I: gl.constexpr,
                STAGES: gl.constexpr, DIAG: gl.constexpr):
    # the CTA's float32 tiles of act @ down.T, each chunk of act multiplied as it lands
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    rn0 = gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    rr = gl.arange(0, BM, layout=gl.SliceLayout(0, MMA))
    for t in range(pid, H // BN, programs):
        acc0, acc1, acc2, acc3 = zeros4()
        for kb in gl.static_range(I // BK):
            mbarrier.wait(a_ready.index(kb), 0)
            if DIAG == 1:
                take(ring, ready, i, STAGES)
            else:
                b0, b1, b2, b3 = _operands(_chunk(act_a, act_b, kb))
                acc0, acc1, acc2, acc3 = quarters(take(ring, ready, i, STAGES), b0, b1, b2, b3, acc0, acc1, acc2,
                                                   acc3, A_LAYOUT)
            give(empty, i, STAGES)
            i += 1
        rn = t * BN + rn0
        gl.store(pd_ptr + rr[None, :] * H + rn[:, None], (acc0 + acc1) + (acc2 + acc3), mask=(rr < rows)[None, :])
    return i


@gluon.jit
def _multiply(ring, ready, empty, xs, act_a, act_b, x_ready, a_ready, act_ptr, pd_ptr, bar_ptr, rows,
              H: gl.constexpr, I: gl.constexpr, STAGES: gl.constexpr, DIAG: gl.constexpr):
    # the consumer: gate_up once the normed rows are in (every CTA waits for them, tiles or not, so that its
    # stager has read the barrier's generation before this CTA can arrive), the barrier, then down
    mbarrier.wait(x_ready.index(0), 0)
    i = _gate_up_tiles(ring, ready, empty, xs, act_ptr, bar_ptr + 2, rows,
                       gl.program_id(0) * 0, H, I, STAGES, DIAG)  # the ring's box count, a loop-carried int
    grid_arrive(bar_ptr, gl.num_programs(0))  # (always: the generation counts launches, which the tile counts need)
    _down_tiles(ring, ready, empty, act_a, act_b, a_ready, pd_ptr, rows, i, H, I, STAGES, DIAG)


@gluon.constexpr_function
def _rows_layout(warps):
    # BM rows x columns over the stager's warps: a warp per row up to BM warps, then warps side by side in a row
    # (no two warps hold the same element)
    rows_w = min(warps, BM.value)
    return gl.BlockedLayout([1, 8], [1, 32], [rows_w, warps // rows_w], [1, 0])


@gluon.jit
def _add_norm_rows(po_ptr, split_stride, splits, h_ptr, wa_ptr, wb_ptr, h_out_ptr, xs, rows, eps, H: gl.constexpr,
                   WARPS: gl.constexpr):
    # triton_fused.add_norm2_store on every row at once, the same roundings: y = the partials' sum in the model
    # dtype, h + rms(y) wa -> h_out (this CTA's share of the columns), rms(h_out) wb -> xs [BM, H] (shared memory)
    layout: gl.constexpr = _rows_layout(WARPS)
    rm = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, H, layout=gl.SliceLayout(0, layout))
    mask = (rm < rows)[:, None]
    offs = rm[:, None] * H + cols[None, :]
    y = gl.load(po_ptr + offs, mask=mask, other=0.0)
    for s in range(1, splits):
        y += gl.load(po_ptr + s * split_stride + offs, mask=mask, other=0.0)
    h = gl.load(h_ptr + offs, mask=mask, other=0.0)
    y = y.to(h.dtype).to(gl.float32)
    ynorm = y * gl.rsqrt(gl.sum(y * y, axis=1) / H + eps)[:, None]
    wa = gl.load(wa_ptr + cols)
    h_new = (h.to(gl.float32) + (ynorm.to(wa.dtype) * wa[None, :]).to(gl.float32)).to(h.dtype)
    share = gl.cdiv(H, gl.num_programs(0))
    mine = (cols >= gl.program_id(0) * share) & (cols < gl.program_id(0) * share + share)
    gl.store(h_out_ptr + offs, h_new, mask=mask & mine[None, :])
    hf = h_new.to(gl.float32)
    hnorm = hf * gl.rsqrt(gl.sum(hf * hf, axis=1) / H + eps)[:, None]
    wb = gl.load(wb_ptr + cols)
    xs.store(hnorm.to(wb.dtype) * wb[None, :])


@gluon.jit
def _stage_chunks(act_ptr, act_a, act_b, a_ready, rows, C0: gl.constexpr, C1: gl.constexpr, I: gl.constexpr,
                  WARPS: gl.constexpr):
    # SiLU x up's chunks C0..C1-1 into shared memory, every copy in flight at once (cp.async), each chunk
    # signalled as it lands
    layout: gl.constexpr = _rows_layout(WARPS)
    rm = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    rk = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    for c in gl.static_range(C0, C1):
        async_copy.async_copy_global_to_shared(_chunk(act_a, act_b, c),
                                               act_ptr + rm[:, None] * I + (c * BK + rk)[None, :],
                                               mask=(rm < rows)[:, None])
        async_copy.commit_group()
    for c in gl.static_range(C0, C1):
        async_copy.wait_group(C1 - 1 - c)
        gl.thread_barrier()  # every lane's copies of the chunk have landed
        mbarrier.arrive(a_ready.index(c), count=1)


@gluon.constexpr_function
def _group_end(g, chunks):
    # one past chunk group g's last chunk
    return min((g + 1) * GROUP_CHUNKS.value, chunks)


@gluon.jit
def _wait_tiles(flag_ptr, expected):
    # until the group's tile count reaches `expected` (int32 arithmetic that wraps: the counts only grow)
    seen = gl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    while seen - expected < 0:
        seen = gl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    gl.thread_barrier()


@gluon.jit
def _stage_act(act_ptr, act_a, act_b, a_ready, bar_ptr, gen, rows, I: gl.constexpr, WARPS: gl.constexpr,
               DIAG: gl.constexpr, GROUPS: gl.constexpr):
    # SiLU x up's rows once written: GROUPS, each group of GROUP_CHUNKS chunks as soon as its GROUP_TILES tiles
    # are (their count in launch `gen` reaches (gen + 1) x the group's tiles: the counts are never reset); else
    # all chunks after the grid barrier
    NC: gl.constexpr = I // BK
    if GROUPS:
        for g in gl.static_range((NC + GROUP_CHUNKS - 1) // GROUP_CHUNKS):  # (no constexpr assigned in here:
            if DIAG != 2:                                                    # an unrolled body may not reassign one)
                _wait_tiles(bar_ptr + 2 + g, (gen + 1) * ((_group_end(g, NC) - g * GROUP_CHUNKS) * (BK // BN)))
            _stage_chunks(act_ptr, act_a, act_b, a_ready, rows, g * GROUP_CHUNKS, _group_end(g, NC), I, WARPS)
    else:
        if DIAG != 2:  # diagnostic 2: no grid barrier (SiLU x up's rows staged whenever: wrong output)
            grid_wait(bar_ptr, gen)
        _stage_chunks(act_ptr, act_a, act_b, a_ready, rows, 0, NC, I, WARPS)


@gluon.jit
def _stage(po_ptr, split_stride, splits, h_ptr, wa_ptr, wb_ptr, h_out_ptr, act_ptr, bar_ptr, xs, act_a, act_b, x_ready,
           a_ready, rows, eps, H: gl.constexpr, I: gl.constexpr, USE_PDL: gl.constexpr, WARPS: gl.constexpr,
           DIAG: gl.constexpr, GROUPS: gl.constexpr):
    # the default partition: the add + norm into shared memory, then SiLU x up's rows once every CTA wrote its own
    if USE_PDL:  # o's partials and the residual rows are the kernels before's output
        _gdc_wait()
        _gdc_launch_dependents()
    # the barrier's generation: after the wait (a launch before this one on the same counters has bumped it by
    # then) and before this CTA's consumer can arrive (it waits for x_ready first)
    gen = grid_generation(bar_ptr)
    if DIAG != 3:  # diagnostic 3: no add + norm (the MMAs read whatever is there)
        _add_norm_rows(po_ptr, split_stride, splits, h_ptr, wa_ptr, wb_ptr, h_out_ptr, xs, rows, eps, H, WARPS)
    gl.thread_barrier()  # every warp's rows are in shared memory
    mbarrier.arrive(x_ready.index(0), count=1)
    _stage_act(act_ptr, act_a, act_b, a_ready, bar_ptr, gen, rows, I, WARPS, DIAG, GROUPS)


@gluon.jit
def mlp_kernel(wgu_desc, wd_desc, po_ptr, h_ptr, wa_ptr, wb_ptr, h_out_ptr, act_ptr, pd_ptr, bar_ptr, split_stride,
               splits, rows, eps, x_layout: gl.constexpr, chunk_layout: gl.constexpr, H: gl.constexpr,
               I: gl.constexpr, CHUNKS_A: gl.constexpr, CHUNKS_B: gl.constexpr, STAGES: gl.constexpr,
               USE_PDL: gl.constexpr,
               num_warps: gl.constexpr, DIAG: gl.constexpr = 0, GROUPS: gl.constexpr = 1):
    # DIAG (diagnostics for benchmarks/mlp_probe.py; the output is then wrong): 1 no MMAs, 2 no grid barrier,
    # 3 no add + norm
    # the normed rows [BM, H], and SiLU x up's rows in chunks of BK columns: CHUNKS_A then CHUNKS_B (powers of two,
    # at least I / BK in all: mlp_dispatch.chunk_split)
    ring, ready, empty = weight_ring(wgu_desc, STAGES)
    xs = gl.allocate_shared_memory(wgu_desc.dtype, [BM, H], x_layout)
    act_a = gl.allocate_shared_memory(wgu_desc.dtype, [CHUNKS_A, BM, BK], chunk_layout)
    act_b = gl.allocate_shared_memory(wgu_desc.dtype, [CHUNKS_B, BM, BK], chunk_layout)
    x_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [CHUNKS_A + CHUNKS_B, 1], mbarrier.MBarrierLayout())
    mbarrier.init(x_ready.index(0), count=1)
    for c in gl.static_range(CHUNKS_A + CHUNKS_B):
        mbarrier.init(a_ready.index(c), count=1)
    gl.warp_specialize([
        (_stage, (po_ptr, split_stride, splits, h_ptr, wa_ptr, wb_ptr, h_out_ptr, act_ptr, bar_ptr, xs, act_a, act_b,
                  x_ready, a_ready, rows, eps, H, I, USE_PDL, num_warps, DIAG, GROUPS)),
        (_multiply, (ring, ready, empty, xs, act_a, act_b, x_ready, a_ready, act_ptr, pd_ptr, bar_ptr, rows, H, I,
                     STAGES, DIAG)),
        (_load_weights, (wgu_desc, wd_desc, ring, ready, empty, H, I, STAGES)),
    ], [1, 1], [192, 40])


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def smem_layouts(dtype: torch.dtype, hidden: int):
    """The shared-memory layouts of the weight boxes (their TMA descriptors'), the normed rows [8, hidden] and a
    staged chunk [8, 256]."""
    gl_dtype = _GL_DTYPES[dtype]
    return (gl.NVMMASharedLayout.get_default_for([BN.value, BK.value], gl_dtype),
            gl.NVMMASharedLayout.get_default_for([BM.value, hidden], gl_dtype),
            gl.NVMMASharedLayout.get_default_for([BM.value, BK.value], gl_dtype))


def launch_mlp(h: torch.Tensor, partials_o: torch.Tensor, w_branch: torch.Tensor, w_next: torch.Tensor,
               w_gate_up: torch.Tensor, w_down: torch.Tensor, barrier: torch.Tensor, eps: float,
               stages: int = mlp_dispatch.MLP_STAGES, diag: int = 0, warps: int = mlp_dispatch.MLP_WARPS,
               groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """h: [rows, hidden] residual rows; partials_o: o_proj's float32 partial sums [splits, rows, hidden]. With
    h_mid = h + rms(o) w_branch and x = rms(h_mid) w_next: returns (h_mid, the float32 partials [1, rows, hidden]
    of down(silu(x gate.T) * (x up.T))), for triton_gemm.add_rms_norm2_partials. The caller checked
    mlp_dispatch.mlp_fold_applies; `barrier`: two int32s on h's device, kept for later launches."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rows, hidden = h.shape
    inter = w_down.shape[1]
    if barrier.dtype != torch.int32 or barrier.numel() < 2 + mlp_dispatch.MLP_MAX_GROUPS:
        raise ValueError(f"launch_mlp: barrier must be mlp_dispatch.new_counters' "
                         f"int32[{2 + mlp_dispatch.MLP_MAX_GROUPS}], got {barrier.dtype}[{barrier.numel()}]")
    h_mid = torch.empty_like(h)
    act = torch.empty(rows, inter, dtype=h.dtype, device=h.device)
    pd = torch.empty(1, rows, hidden, dtype=torch.float32, device=h.device)
    w_layout, x_layout, chunk_layout = smem_layouts(h.dtype, hidden)
    chunks_a, chunks_b = mlp_dispatch.chunk_split(inter)
    box = [BN.value, BK.value]
    mlp_kernel[(pdl.num_sms(h.device),)](
        TensorDescriptor.from_tensor(w_gate_up, box, w_layout), TensorDescriptor.from_tensor(w_down, box, w_layout),
        partials_o, h, w_branch, w_next, h_mid, act, pd, barrier, partials_o.stride(0), partials_o.shape[0], rows, eps,
        x_layout=x_layout, chunk_layout=chunk_layout, H=hidden, I=inter, CHUNKS_A=chunks_a, CHUNKS_B=chunks_b,
        STAGES=stages,
        num_warps=warps, DIAG=diag, GROUPS=groups, **pdl.launch_kwargs(h.device))
    return h_mid, pd
