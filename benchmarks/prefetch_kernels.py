"""The 64-row gate_up + SiLU and qkv + RoPE + store GEMMs as warp-specialized Gluon kernels whose weight loads may
start before the PDL wait (Hopper): benchmarks/prefetch_probe.py's kernels. Measured on H100s (session 36,
docs/benchmarks.md): the weights from launch save ~0.5 us of the o -> add + norm -> gate_up chain against the same
kernel waiting first, which put the Gluon gate_up 0.4 us ahead of triton_gemm's there (call 3) and level with it in the
decode step (an engine switch built for the measurement, then taken out); the Gluon qkv is ~4 us slower than
triton_gemm's in its chain either way; partials_kernel (linear_partials' split-K partials, after gate_up) saves
0.5-1.4 us from launch but loses 3-4 us to triton_gemm's in its chain, and made the step slower. The engine keeps its
Triton GEMMs.

Today's Triton kernels (engine/triton_gemm.py) wait for the kernel before (griddepcontrol.wait) before their first
load: Triton pipelines the weight and activation boxes together, so no weight box can be asked for earlier. Both
GEMMs follow the small add + norm kernel (2.2-2.6 us, reading a few rows), during which HBM is nearly idle while
their programs already sit resident at the wait. Here the two streams are split: a loader warp TMA-loads the tile's
weight boxes into a ring from launch (weights are no kernel's output; PREFETCH=0 makes it wait too, the control),
a second loader warp waits for the kernel before, lets the next one launch, and TMA-loads the activation boxes; the
default warpgroup multiplies (asynchronous wgmma, a K step's two in flight while the next step's boxes are awaited)
and runs the epilogue, which matches triton_gemm's roundings.

A program's tile: rows row_a + [0, BN) and their partners row_b + [0, BN) of the weight matrix, K step by K step
(gate_up: gate rows t BN.. and up rows I + t BN..; qkv: BN dims of a head's first half and their RoPE partners HALF
rows further, as triton_gemm._qkv_rope_store_kernel splits it). One row tile: M <= 64 (the activation
descriptor's rows past M come back as zeros; the stores drop them).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from engine import pdl
from engine.gluon_attention import _gdc_launch_dependents, _gdc_wait
from engine.gluon_ring import load_box, take, weight_ring

BM, BK = gl.constexpr(64), gl.constexpr(128)  # rows (wgmma's M), a box's K
GATE, QKV = gl.constexpr(0), gl.constexpr(1)  # the epilogue


@gluon.jit
def _tile_rows(N, HALF: gl.constexpr, BN: gl.constexpr, KIND: gl.constexpr):
    """(row_a, row_b, head): the program's first weight row, its partners' first, and (qkv) its head."""
    pid = gl.program_id(0)
    if KIND == GATE:
        return pid * BN, N + pid * BN, 0
    else:
        per_head: gl.constexpr = HALF // BN
        head = pid // per_head
        row = head * 2 * HALF + (pid % per_head) * BN
        return row, row + HALF, head


@gluon.jit
def _load_weights(w_desc, ring, ready, empty, N, K: gl.constexpr, HALF: gl.constexpr, BN: gl.constexpr,
                  KIND: gl.constexpr, STAGES: gl.constexpr, PREFETCH: gl.constexpr, USE_PDL: gl.constexpr):
    # the tile's boxes, a and b per K step; from launch where PREFETCH (nobody writes weights during a step)
    if USE_PDL and not PREFETCH:
        _gdc_wait()
    row_a, row_b, _ = _tile_rows(N, HALF, BN, KIND)
    for kb in range(K // BK):
        load_box(w_desc, row_a, kb * BK, ring, ready, empty, 2 * kb, STAGES)
        load_box(w_desc, row_b, kb * BK, ring, ready, empty, 2 * kb + 1, STAGES)


@gluon.jit
def _load_rows(x_desc, xring, xready, xempty, k0, K: gl.constexpr, X_STAGES: gl.constexpr, USE_PDL: gl.constexpr):
    # the activation boxes of K columns from k0 once the kernel before (which wrote them) has finished; then the next
    # kernel may launch
    if USE_PDL:
        _gdc_wait()
        _gdc_launch_dependents()
    for kb in range(K // BK):
        load_box(x_desc, 0, k0 + kb * BK, xring, xready, xempty, kb, X_STAGES)


@gluon.jit
def _silu_store(acc_g, acc_u, out_ptr, row_a, M, N, mma: gl.constexpr):
    # triton_gemm.silu_store's math: each half rounded to the model dtype, silu(gate) * up, rounded
    dtype: gl.constexpr = out_ptr.dtype.element_ty
    rm = gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    rn = row_a + gl.arange(0, acc_g.shape[1], layout=gl.SliceLayout(0, mma))
    gate = acc_g.to(dtype).to(gl.float32)
    up = acc_u.to(dtype).to(gl.float32)
    y = (gate / (1.0 + gl.exp(-gate)) * up).to(dtype)
    gl.store(out_ptr + rm[:, None].to(gl.int64) * N + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


@gluon.jit
def _rope_store(acc1, acc2, row_a, head, M, io, HQ: gl.constexpr, HKV: gl.constexpr, HALF: gl.constexpr,
                mma: gl.constexpr):
    # triton_gemm.rope_store's math: RoPE on q and k heads, q out, k and v to the rows' slots
    pos_ptr, slot_ptr, inv_freq_ptr, q_ptr, k_ptr, v_ptr, stride_slot, stride_head = io
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    rm = gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    d = row_a - head * 2 * HALF + gl.arange(0, acc1.shape[1], layout=gl.SliceLayout(0, mma))
    rmask = rm < M
    mask = rmask[:, None] & (d[None, :] < HALF)
    x1 = acc1.to(dtype).to(gl.float32)
    x2 = acc2.to(dtype).to(gl.float32)
    if head < HQ + HKV:
        pos = gl.load(pos_ptr + rm, mask=rmask, other=0).to(gl.float32)
        angle = pos[:, None] * gl.load(inv_freq_ptr + d)[None, :]
        cos, sin = gl.cos(angle), gl.sin(angle)
        x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if head < HQ:
        out = q_ptr + (rm[:, None].to(gl.int64) * HQ + head) * 2 * HALF + d[None, :]
        gl.store(out, x1.to(dtype), mask=mask)
        gl.store(out + HALF, x2.to(dtype), mask=mask)
    else:
        slot = gl.load(slot_ptr + rm, mask=rmask, other=0).to(gl.int64)
        dst = slot[:, None] * stride_slot + ((head - HQ) % HKV) * stride_head + d[None, :]
        plane = k_ptr if head < HQ + HKV else v_ptr
        gl.store(plane + dst, x1.to(dtype), mask=mask)
        gl.store(plane + dst + HALF, x2.to(dtype), mask=mask)


@gluon.jit
def _release(empty, i, STAGES: gl.constexpr):
    # the i-th box's slot back to its loader: read only by wgmma (the async proxy, as the TMA copy that refills it),
    # so no proxy fence (gluon_ring.give's is for slots read by generic loads)
    mbarrier.arrive(empty.index(i % STAGES), count=1)


@gluon.jit
def _multiply(ring, ready, empty, xring, xready, xempty, out_ptr, io, M, N, K: gl.constexpr, HALF: gl.constexpr,
              HQ: gl.constexpr, HKV: gl.constexpr, BN: gl.constexpr, KIND: gl.constexpr, STAGES: gl.constexpr,
              X_STAGES: gl.constexpr, num_warps: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BN, 16])
    acc_a = gl.zeros([BM, BN], gl.float32, mma)
    acc_b = gl.zeros([BM, BN], gl.float32, mma)
    for kb in range(K // BK):
        xs = take(xring, xready, kb, X_STAGES)
        acc_a = warpgroup_mma(xs, take(ring, ready, 2 * kb, STAGES).permute((1, 0)), acc_a, is_async=True)
        acc_b = warpgroup_mma(xs, take(ring, ready, 2 * kb + 1, STAGES).permute((1, 0)), acc_b, is_async=True)
        # this K step's two may run on; the step before's are done, and its slots go back
        acc_a, acc_b = warpgroup_mma_wait(num_outstanding=2, deps=[acc_a, acc_b])
        if kb > 0:
            _release(empty, 2 * kb - 2, STAGES)
            _release(empty, 2 * kb - 1, STAGES)
            _release(xempty, kb - 1, X_STAGES)
    acc_a, acc_b = warpgroup_mma_wait(num_outstanding=0, deps=[acc_a, acc_b])
    row_a, _, head = _tile_rows(N, HALF, BN, KIND)
    if KIND == GATE:
        _silu_store(acc_a, acc_b, out_ptr, row_a, M, N, mma)
    else:
        _rope_store(acc_a, acc_b, row_a, head, M, io, HQ, HKV, HALF, mma)


@gluon.jit(do_not_specialize=["M"])
def pair_gemm_kernel(w_desc, x_desc, out_ptr, pos_ptr, slot_ptr, inv_freq_ptr, k_ptr, v_ptr, stride_slot,
                     stride_head, M, N, K: gl.constexpr, HALF: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr,
                     BN: gl.constexpr, KIND: gl.constexpr, STAGES: gl.constexpr, X_STAGES: gl.constexpr,
                     PREFETCH: gl.constexpr, USE_PDL: gl.constexpr, num_warps: gl.constexpr):
    """out: gate_up's [M, N] product (KIND GATE; N = I) or q [M, HQ, 2 HALF] (KIND QKV; k_ptr / v_ptr the planes)."""
    ring, ready, empty = weight_ring(w_desc, STAGES)
    xring, xready, xempty = weight_ring(x_desc, X_STAGES)
    io = (pos_ptr, slot_ptr, inv_freq_ptr, out_ptr, k_ptr, v_ptr, stride_slot, stride_head)
    gl.warp_specialize([
        (_multiply, (ring, ready, empty, xring, xready, xempty, out_ptr, io, M, N, K, HALF, HQ, HKV, BN, KIND,
                     STAGES, X_STAGES, num_warps)),
        (_load_weights, (w_desc, ring, ready, empty, N, K, HALF, BN, KIND, STAGES, PREFETCH, USE_PDL)),
        (_load_rows, (x_desc, xring, xready, xempty, 0, K, X_STAGES, USE_PDL)),
    ], [1, 1], [40, 40])


@gluon.jit
def _load_split_weights(w_desc, ring, ready, empty, KS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                        PREFETCH: gl.constexpr, USE_PDL: gl.constexpr):
    # the tile's boxes over its split's KS columns; from launch where PREFETCH
    if USE_PDL and not PREFETCH:
        _gdc_wait()
    k0 = gl.program_id(1) * KS
    for kb in range(KS // BK):
        load_box(w_desc, gl.program_id(0) * BN, k0 + kb * BK, ring, ready, empty, kb, STAGES)


@gluon.jit
def _multiply_split(ring, ready, empty, xring, xready, xempty, out_ptr, M, N, KS: gl.constexpr, BN: gl.constexpr,
                    STAGES: gl.constexpr, X_STAGES: gl.constexpr, num_warps: gl.constexpr):
    # one accumulator over the split's K steps (asynchronous wgmma, one step in flight), stored as float32 partials
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, mma)
    for kb in range(KS // BK):
        xs = take(xring, xready, kb, X_STAGES)
        acc = warpgroup_mma(xs, take(ring, ready, kb, STAGES).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
        if kb > 0:
            _release(empty, kb - 1, STAGES)
            _release(xempty, kb - 1, X_STAGES)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    rm = gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    rn = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    out = out_ptr + (gl.program_id(1) * M + rm[:, None]).to(gl.int64) * N + rn[None, :]
    gl.store(out, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@gluon.jit(do_not_specialize=["M"])
def partials_kernel(w_desc, x_desc, out_ptr, M, N, KS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                    X_STAGES: gl.constexpr, PREFETCH: gl.constexpr, USE_PDL: gl.constexpr, num_warps: gl.constexpr):
    """triton_gemm.linear_partials: program (n tile, split) writes out[split, :M, its BN columns] = x[:, its KS
    columns] @ w[its columns, its KS columns].T in float32."""
    ring, ready, empty = weight_ring(w_desc, STAGES)
    xring, xready, xempty = weight_ring(x_desc, X_STAGES)
    gl.warp_specialize([
        (_multiply_split, (ring, ready, empty, xring, xready, xempty, out_ptr, M, N, KS, BN, STAGES, X_STAGES,
                           num_warps)),
        (_load_split_weights, (w_desc, ring, ready, empty, KS, BN, STAGES, PREFETCH, USE_PDL)),
        (_load_rows, (x_desc, xring, xready, xempty, gl.program_id(1) * KS, KS, X_STAGES, USE_PDL)),
    ], [1, 1], [40, 40])


def _descs(w: torch.Tensor, x: torch.Tensor, bn: int):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    w_layout = gl.NVMMASharedLayout.get_default_for([bn, BK.value], gl.bfloat16)
    x_layout = gl.NVMMASharedLayout.get_default_for([BM.value, BK.value], gl.bfloat16)
    return (TensorDescriptor.from_tensor(w, [bn, BK.value], w_layout),
            TensorDescriptor.from_tensor(x, [BM.value, BK.value], x_layout))


def _check(x: torch.Tensor, w: torch.Tensor, rows_per_tile: int) -> None:
    rows, k = x.shape
    bm, bk = BM.value, BK.value
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise TypeError(f"pair GEMM: x and w must be bfloat16, got {x.dtype} and {w.dtype}")
    if not 1 <= rows <= bm or k % bk or w.shape[1] != k or w.shape[0] % rows_per_tile:
        raise ValueError(f"pair GEMM: x [rows <= {bm}, K % {bk} == 0] and w [n % {rows_per_tile} == 0, K], got "
                         f"{list(x.shape)} and {list(w.shape)}")


def _check_pair_rings(stages: int, x_stages: int) -> None:
    if stages < 4 or stages % 2 or x_stages < 2:  # the consumer holds a K step's slots until the next step's land
        raise ValueError(f"pair GEMM: stages must be even and >= 4 (two K steps of a and b boxes), x_stages >= 2; got "
                         f"{stages}, {x_stages}")


def gate_launch(x: torch.Tensor, w_gate_up: torch.Tensor, out: torch.Tensor, bn: int = 64, stages: int = 8,
                x_stages: int = 4, prefetch: bool = True, use_pdl: bool = True) -> tuple[tuple, tuple, dict]:
    """(grid, arguments, constexprs) of pair_gemm_kernel for gate_up + SiLU into out [rows, I]."""
    _check(x, w_gate_up, 2 * bn)
    _check_pair_rings(stages, x_stages)
    n = w_gate_up.shape[0] // 2
    w_desc, x_desc = _descs(w_gate_up, x, bn)
    args = (w_desc, x_desc, out, out, out, out, out, out, 0, 0, x.shape[0], n)
    return (n // bn,), args, dict(K=x.shape[1], HALF=1, HQ=1, HKV=1, BN=bn, KIND=GATE, STAGES=stages,
                                  X_STAGES=x_stages, PREFETCH=prefetch, num_warps=4, **_pdl(x.device, use_pdl))


def gate_up_silu(x: torch.Tensor, w_gate_up: torch.Tensor, **tiles) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T): x [rows <= 64, K], w_gate_up [2 I, K] -> [rows, I] (triton_gemm.gate_up_silu);
    tiles: gate_launch's."""
    out = torch.empty(x.shape[0], w_gate_up.shape[0] // 2, dtype=x.dtype, device=x.device)
    grid, args, constexprs = gate_launch(x, w_gate_up, out, **tiles)
    pair_gemm_kernel[grid](*args, **constexprs)
    return out


def qkv_launch(x: torch.Tensor, w_qkv: torch.Tensor, q: torch.Tensor, rope: tuple, n_q_heads: int, n_kv_heads: int,
               bd: int = 16, stages: int = 8, x_stages: int = 4, prefetch: bool = True,
               use_pdl: bool = True) -> tuple[tuple, tuple, dict]:
    """(grid, arguments, constexprs) of pair_gemm_kernel for qkv + RoPE + store: q [rows, heads, head_dim] out,
    rope = (positions, slots, inv_freq, k_plane, v_plane) as triton_gemm.qkv_rope_store takes them."""
    positions, slots, inv_freq, k_plane, v_plane = rope
    head_dim = q.shape[-1]
    half = head_dim // 2
    if head_dim % 2 or half % bd:
        raise ValueError(f"qkv_rope_store: head_dim={head_dim} must be even, its half a multiple of bd={bd}")
    _check(x, w_qkv, bd)
    _check_pair_rings(stages, x_stages)
    w_desc, x_desc = _descs(w_qkv, x, bd)
    args = (w_desc, x_desc, q, positions, slots, inv_freq, k_plane, v_plane, k_plane.stride(0), k_plane.stride(1),
            x.shape[0], w_qkv.shape[0])
    return ((n_q_heads + 2 * n_kv_heads) * (half // bd),), args, dict(
        K=x.shape[1], HALF=half, HQ=n_q_heads, HKV=n_kv_heads, BN=bd, KIND=QKV, STAGES=stages, X_STAGES=x_stages,
        PREFETCH=prefetch, num_warps=4, **_pdl(x.device, use_pdl))


def qkv_rope_store(x: torch.Tensor, w_qkv: torch.Tensor, rope: tuple, n_q_heads: int, n_kv_heads: int,
                   head_dim: int, **tiles) -> torch.Tensor:
    """triton_gemm.qkv_rope_store: q after RoPE [rows, heads, head_dim]; k and v to their planes' slots."""
    q = torch.empty(x.shape[0], n_q_heads, head_dim, dtype=x.dtype, device=x.device)
    grid, args, constexprs = qkv_launch(x, w_qkv, q, rope, n_q_heads, n_kv_heads, **tiles)
    pair_gemm_kernel[grid](*args, **constexprs)
    return q


def partials_launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, splits: int, bn: int = 64, stages: int = 4,
                    x_stages: int = 4, prefetch: bool = True, use_pdl: bool = True) -> tuple[tuple, tuple, dict]:
    """(grid, arguments, constexprs) of partials_kernel: out [splits, rows, N] float32, x [rows, K] @ w [N, K].T split
    over K in `splits` equal ranges of whole K steps."""
    k = x.shape[1]
    if splits < 1 or k % (splits * BK.value):
        raise ValueError(f"partials: K={k} must split into splits={splits} ranges of whole {BK.value}-column steps")
    if stages < 2 or x_stages < 2:  # the consumer holds a K step's slots until the next step's land
        raise ValueError(f"partials: stages and x_stages must be >= 2, got {stages}, {x_stages}")
    _check(x, w, bn)
    w_desc, x_desc = _descs(w, x, bn)
    return (w.shape[0] // bn, splits), (w_desc, x_desc, out, x.shape[0], w.shape[0]), dict(
        KS=k // splits, BN=bn, STAGES=stages, X_STAGES=x_stages, PREFETCH=prefetch, num_warps=4,
        **_pdl(x.device, use_pdl))


def linear_partials(x: torch.Tensor, w: torch.Tensor, splits: int, **tiles) -> torch.Tensor:
    """triton_gemm.linear_partials: float32 partial sums [splits, rows, N] of x @ w.T; tiles: partials_launch's."""
    out = torch.empty(splits, x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    grid, args, constexprs = partials_launch(x, w, out, splits, **tiles)
    partials_kernel[grid](*args, **constexprs)
    return out


def _pdl(device: torch.device, use_pdl: bool) -> dict:
    return pdl.launch_kwargs(device) if use_pdl else {"USE_PDL": False}

