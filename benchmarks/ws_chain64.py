"""The 64-row warp-specialized chain kernel of benchmarks/phase_probe_ws.py (`--rows 64`).

At 64 rows a phase's activations (64 x 2048 bf16, 256 KB) do not fit in shared memory, so they stream in
BLOCK_K-column chunks through a ring of their own, and the multiply runs K-outer: each chunk is multiplied
with every one of the CTA's tiles of the phase (up to T_MAX accumulators), so a chunk comes from L2 once per
CTA and phase. Partitions, one CTA per SM:

- default (4 warps): multiplies (mma.sync, swap-AB: 16 weight rows x the batch rows, the warps splitting the
  batch rows), writes the tiles, bumps the phase's counter (release) after its last store;
- a loader warp: TMA-loads the weight boxes in the multiply's order (chunk-outer, tile-inner) into the
  weight ring; it waits only for free slots, never for a boundary;
- a stager warp: at each boundary waits for every CTA's counter (acquire poll), then cp.async-copies the
  phase's activation chunks into the activation ring; each chunk is signalled by the copies' own
  asynchronous arrivals (x_ready counts the warp's 32 threads), so staging never blocks the stager's issue.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from ws_chain import (BLOCK_K_WS, CHAIN_ALIGNED, _give, _load_box, _take, _wait_for_phase, _weight_ring,
                      chain_signature, compile_sm90, smem_layouts)

T_MAX = 5  # tiles per CTA and phase at most: the probe's widest phase (gate_up) is 5 waves of 16-column tiles


@gluon.jit
def _tiles_of(cols_ptr, p, pid, programs, BLOCK_N: gl.constexpr):
    return (gl.load(cols_ptr + p) // BLOCK_N - pid + programs - 1) // programs


@gluon.jit
def _loader64(xring, x_ready, x_empty, ring, ready, empty, w_desc, y_ptr, cnt_ptr, cols_ptr, w_row_ptr,
              num_phases, M, stride_y, slot, K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_K: gl.constexpr, STAGES: gl.constexpr, XSTAGES: gl.constexpr, SKIP: gl.constexpr):
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    i = 0
    for p in range(num_phases):
        row0 = gl.load(w_row_ptr + p).to(gl.int32)
        mine = _tiles_of(cols_ptr, p, pid, programs, BLOCK_N)
        for kb in range(K // BLOCK_K):
            for j in range(mine):
                _load_box(w_desc, row0 + (pid + j * programs) * BLOCK_N, kb * BLOCK_K, ring, ready, empty, i, STAGES)
                i += 1


@gluon.jit
def _stager64(xring, x_ready, x_empty, ring, ready, empty, w_desc, y_ptr, cnt_ptr, cols_ptr, w_row_ptr,
              num_phases, M, stride_y, slot, K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_K: gl.constexpr, STAGES: gl.constexpr, XSTAGES: gl.constexpr, SKIP: gl.constexpr):
    programs = gl.num_programs(0)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [1, 1], [1, 0])
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    j = 0
    for p in range(num_phases):
        if p > 0 and SKIP != 2:
            _wait_for_phase(cnt_ptr + p - 1, programs)
        x_ptr = y_ptr + p * slot
        for kb in range(K // BLOCK_K):
            s = j % XSTAGES
            mbarrier.wait(x_empty.index(s), ((j // XSTAGES) & 1) ^ 1)
            async_copy.async_copy_global_to_shared(xring.index(s),
                                                   x_ptr + rm[:, None] * stride_y + (kb * BLOCK_K + rk)[None, :],
                                                   mask=(rm < M)[:, None])
            async_copy.mbarrier_arrive(x_ready.index(s), increment_count=False)
            j += 1


@gluon.jit
def _box(ring, ready, empty, i, b, acc, a_layout: gl.constexpr, STAGES: gl.constexpr, SKIP: gl.constexpr):
    box = _take(ring, ready, i, STAGES)
    if SKIP != 1:
        acc = mma_v2(box.load(a_layout), b, acc)
    _give(empty, i, STAGES)
    return acc


@gluon.jit
def _store_tile(acc, out, t, M, stride_y, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, mma: gl.constexpr):
    rn = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    gl.store(out + rm[None, :] * stride_y + rn[:, None], acc.to(gl.bfloat16), mask=(rm < M)[None, :])


@gluon.jit
def _consumer64(xring, x_ready, x_empty, ring, ready, empty, y_ptr, cnt_ptr, cols_ptr, num_phases, M, stride_y,
                slot, K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                STAGES: gl.constexpr, XSTAGES: gl.constexpr, SKIP: gl.constexpr, WARPS: gl.constexpr):
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, WARPS], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    i = 0
    j = 0
    for p in range(num_phases):
        mine = _tiles_of(cols_ptr, p, pid, programs, BLOCK_N)
        acc0 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
        acc1 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
        acc2 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
        acc3 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
        acc4 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
        for kb in range(K // BLOCK_K):
            xs = j % XSTAGES
            mbarrier.wait(x_ready.index(xs), (j // XSTAGES) & 1)
            b = xring.index(xs).permute((1, 0)).load(b_layout)
            mbarrier.arrive(x_empty.index(xs), count=1)  # b is in registers: the slot may be refilled
            j += 1
            acc0 = _box(ring, ready, empty, i, b, acc0, a_layout, STAGES, SKIP)
            i += 1
            if mine > 1:
                acc1 = _box(ring, ready, empty, i, b, acc1, a_layout, STAGES, SKIP)
                i += 1
            if mine > 2:
                acc2 = _box(ring, ready, empty, i, b, acc2, a_layout, STAGES, SKIP)
                i += 1
            if mine > 3:
                acc3 = _box(ring, ready, empty, i, b, acc3, a_layout, STAGES, SKIP)
                i += 1
            if mine > 4:
                acc4 = _box(ring, ready, empty, i, b, acc4, a_layout, STAGES, SKIP)
                i += 1
        out = y_ptr + (p + 1) * slot
        _store_tile(acc0, out, pid, M, stride_y, BLOCK_N, BLOCK_M, mma)
        if mine > 1:
            _store_tile(acc1, out, pid + programs, M, stride_y, BLOCK_N, BLOCK_M, mma)
        if mine > 2:
            _store_tile(acc2, out, pid + 2 * programs, M, stride_y, BLOCK_N, BLOCK_M, mma)
        if mine > 3:
            _store_tile(acc3, out, pid + 3 * programs, M, stride_y, BLOCK_N, BLOCK_M, mma)
        if mine > 4:
            _store_tile(acc4, out, pid + 4 * programs, M, stride_y, BLOCK_N, BLOCK_M, mma)
        if p + 1 < num_phases:
            gl.thread_barrier()  # every warp's stores of this phase are issued
            gl.atomic_add(cnt_ptr + p, 1, sem="release", scope="gpu")


@gluon.jit
def ws_chain64_kernel(w_desc, y_ptr, cnt_ptr, cols_ptr, w_row_ptr, num_phases, M, stride_y, slot,
                      x_layout: gl.constexpr, K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      BLOCK_K: gl.constexpr, STAGES: gl.constexpr, XSTAGES: gl.constexpr, SKIP: gl.constexpr,
                      num_warps: gl.constexpr):
    # SKIP (diagnostics; the output is then wrong): 1 no MMA, 2 no phase barrier. A CTA has at most T_MAX
    # tiles in a phase (the host checks).
    ring, ready, empty = _weight_ring(w_desc, STAGES)
    xring = gl.allocate_shared_memory(gl.bfloat16, [XSTAGES, BLOCK_M, BLOCK_K], x_layout)
    x_ready = gl.allocate_shared_memory(gl.int64, [XSTAGES, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [XSTAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(XSTAGES):
        mbarrier.init(x_ready.index(s), count=32)  # the stager warp's threads, each once its copies landed
        mbarrier.init(x_empty.index(s), count=1)
    gl.warp_specialize([
        (_consumer64, (xring, x_ready, x_empty, ring, ready, empty, y_ptr, cnt_ptr, cols_ptr, num_phases, M,
                       stride_y, slot, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, XSTAGES, SKIP, num_warps)),
        (_loader64, (xring, x_ready, x_empty, ring, ready, empty, w_desc, y_ptr, cnt_ptr, cols_ptr, w_row_ptr,
                     num_phases, M, stride_y, slot, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, XSTAGES, SKIP)),
        (_stager64, (xring, x_ready, x_empty, ring, ready, empty, w_desc, y_ptr, cnt_ptr, cols_ptr, w_row_ptr,
                     num_phases, M, stride_y, slot, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, XSTAGES, SKIP)),
    ], [1, 1], [40, 64])


# ---------------------------------------------------------------------------------------------- the host side

def run_ws64(chain, stages: int, xstages: int, sms: int, skip: int = 0) -> None:
    """The chain (phase_probe.Chain, 17-64 rows, 16-column tiles in whole waves) as one launch of `sms` CTAs."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from phase_probe import BLOCK_N, K
    if not 16 < chain.rows <= 64 or chain.block_m != 64 or chain.block_n != BLOCK_N:
        raise ValueError(f"the 64-row kernel takes 17-64 rows in 16-column tiles, got {chain.rows} rows, "
                         f"block_n {chain.block_n}")
    chain.check_whole_waves(sms)
    if max(chain.cols) > T_MAX * BLOCK_N * sms:
        raise ValueError(f"a phase of {max(chain.cols)} columns gives a CTA more than {T_MAX} tiles")
    w_layout, x_layout = smem_layouts(64)
    desc = TensorDescriptor.from_tensor(chain.w, [BLOCK_N, BLOCK_K_WS], w_layout)
    chain.cnt.zero_()
    ws_chain64_kernel[(sms,)](desc, chain.y, chain.cnt, chain.cols_t, chain.w_rows, len(chain.cols), chain.rows,
                              chain.width, chain.y.stride(0), x_layout=x_layout, K=K, BLOCK_M=64, BLOCK_N=BLOCK_N,
                              BLOCK_K=BLOCK_K_WS, STAGES=stages, XSTAGES=xstages, SKIP=skip, num_warps=4)


def compile64_for_sm90(stages: int = 12, xstages: int = 3, skip: int = 0) -> dict:
    """ws_chain64_kernel compiled for sm90 without a GPU (ws_chain.compile_sm90)."""
    from phase_probe import BLOCK_N, K
    w_layout, x_layout = smem_layouts(64)
    constexprs = {"x_layout": x_layout, "K": K, "BLOCK_M": 64, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K_WS,
                  "STAGES": stages, "XSTAGES": xstages, "SKIP": skip, "num_warps": 4}
    return compile_sm90(ws_chain64_kernel, chain_signature(w_layout), constexprs, CHAIN_ALIGNED)


def parse_ways64(text: str) -> list[tuple[int, int, int]]:
    """"12:3:0,12:3:1" -> [(weight slots, activation slots, skip), ...]."""
    ways = []
    for item in text.split(","):
        values = [int(v) for v in item.split(":")]
        if len(values) != 3 or not 2 <= values[0] <= 24 or not 2 <= values[1] <= 4 or values[2] not in (0, 1, 2):
            raise ValueError(f"--ways64 item {item!r}: stages:xstages:skip with stages 2..24 (8 KB weight boxes), "
                             "xstages 2..4 (32 KB activation chunks), skip 0, 1 (no MMA) or 2 (no phase barrier)")
        ways.append(tuple(values))
    return ways
