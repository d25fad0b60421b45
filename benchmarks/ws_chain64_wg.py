"""The 64-row chain kernel, second design (benchmarks/phase_probe_ws.py `--ways64wg`): split K, wgmma, and the
activations through TMA, so a CTA reads as many activation bytes from L2 as weight bytes.

Session 14's 64-row kernel (ws_chain64.py) was bounded by its activation stream: with 16-column tiles each CTA
pulls a phase's whole 64 x 2048 activations (256 KB) from L2 for ~16-80 columns of weights, ~1.3-4 bytes of
activations per byte of weights, through one cp.async warp (docs/benchmarks.md, session 14: 1.41 ms without
MMA and without barrier, against 1.04 for the 64-column PDL kernels). Here a phase is cut into units of
(64-column tile, 1 / SPLITS of K). CTA `pid` takes units pid, pid + CTAs, ...; with CTAs a multiple of SPLITS
every unit of a CTA has the same K range, so the CTA stages 64 rows x K / SPLITS of activations once a phase
(64 KB at SPLITS 4) and multiplies them with each of its tiles' weights (64 KB a tile and split).
One CTA per SM, three partitions:

- default (4 warps, one warpgroup): for each unit, wgmma (M = the 64 batch rows, N = the tile's 64 columns,
  K 16 an instruction) over the staged chunks and the weight ring's boxes; then the unit's fp32 partial to a
  workspace [SPLITS, 64, width], a count per (phase, tile), and the tile's last unit to arrive sums the
  SPLITS partials in split order (deterministic) and writes the tile in bf16. After its units, the CTA gives
  the staged activations back and bumps the phase's count (release);
- a loader warp: TMA-loads every weight box ([64 columns, BLOCK_K], 16 KB) of the CTA's units, phase after
  phase, into the ring; it waits only for free slots, never for a phase boundary;
- a stager warp: once the CTA has used the phase's activations and every CTA has ended the phase before
  (acquire poll), TMA-loads the next phase's activation chunks ([64 rows, BLOCK_K]), each signalled as it lands.

Writes in the generic proxy (the tiles' stores) that another CTA then reads through TMA (the async proxy)
are fenced on both sides (fence.proxy.async.global). Gluon does not run in Triton's interpreter: the results
are checked against torch on the GPU (every run of the probe); tests/test_phase_probe_ws.py compiles it for
sm90 on the CPU.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

from engine.gluon_ring import give, load_box, take, weight_ring
from engine.gluon_splitk import fence_proxy_async_global as _fence_proxy_async
from engine.gluon_splitk import staged_chunks
from ws_chain import _wait_for_phase, compile_sm90

ROWS, TILE_N, BOX_K = 64, 64, 128  # the batch rows (wgmma's M), a tile's columns (its N), a box's K
BLOCK_M, BLOCK_N, BLOCK_K = gl.constexpr(ROWS), gl.constexpr(TILE_N), gl.constexpr(BOX_K)  # the kernel's


@gluon.jit
def _load_weights(ring, ready, empty, w_desc, cols_ptr, w_row_ptr, num_phases, K: gl.constexpr,
                  SPLITS: gl.constexpr, STAGES: gl.constexpr):
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    CHUNKS: gl.constexpr = K // SPLITS // BLOCK_K
    k0 = (pid % SPLITS) * (K // SPLITS)
    i = 0
    for p in range(num_phases):
        row0 = gl.load(w_row_ptr + p).to(gl.int32)
        units = gl.load(cols_ptr + p) // BLOCK_N * SPLITS
        for u in range(pid, units, programs):
            for c in gl.static_range(CHUNKS):
                load_box(w_desc, row0 + (u // SPLITS) * BLOCK_N, k0 + c * BLOCK_K, ring, ready, empty, i, STAGES)
                i += 1


@gluon.jit
def _stage_phases(xbuf, x_ready, x_empty, x_desc, cnt_ptr, num_phases, K: gl.constexpr, SPLITS: gl.constexpr,
                  SKIP: gl.constexpr):
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    CHUNKS: gl.constexpr = K // SPLITS // BLOCK_K
    k0 = (pid % SPLITS) * (K // SPLITS)
    for p in range(num_phases):
        mbarrier.wait(x_empty.index(0), (p & 1) ^ 1)  # this CTA is done with the last phase's chunks
        if p > 0 and SKIP != 2:
            _wait_for_phase(cnt_ptr + p - 1, programs)
            _fence_proxy_async()
        for c in gl.static_range(CHUNKS):
            mbarrier.expect(x_ready.index(c), x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [p * BLOCK_M, k0 + c * BLOCK_K], x_ready.index(c), xbuf.index(c))


@gluon.jit
def _finish_unit(acc, t, p, y_ptr, part_ptr, tile_cnt_ptr, M, stride_y, slot, max_tiles, SPLITS: gl.constexpr,
                 SKIP: gl.constexpr, GROUP: gl.constexpr, mma: gl.constexpr):
    # the unit's partial; the tile's last unit to arrive sums them (split order) and writes the tile (GROUP 0;
    # with GROUP 1 _group_sum does at the phase's end). SKIP 3 (a diagnostic): each unit writes its partial as
    # the tile, no count and no sum
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
    rn = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    offs = rm[:, None] * stride_y + rn[None, :]
    rows = (rm < M)[:, None]
    out = y_ptr + (p + 1) * slot
    split = gl.program_id(0) % SPLITS
    if SKIP == 3:
        gl.store(out + offs, acc.to(gl.bfloat16), mask=rows)
        return
    gl.store(part_ptr + split * (BLOCK_M * stride_y) + offs, acc)
    if GROUP:
        return
    gl.thread_barrier()  # every warp's partial stores are issued before the count (release)
    arrived = gl.atomic_add(tile_cnt_ptr + p * max_tiles + t, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLITS - 1:
        total = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
        for s in gl.static_range(SPLITS):  # L2 (.cg): an earlier phase may have left these lines in L1
            total += gl.load(part_ptr + s * (BLOCK_M * stride_y) + offs, cache_modifier=".cg")
        gl.store(out + offs, total.to(gl.bfloat16), mask=rows)


@gluon.jit
def _group_sum(p, units, y_ptr, part_ptr, cnt_ptr, M, stride_y, slot, SPLITS: gl.constexpr, WARPS: gl.constexpr):
    # GROUP 1: CTAs g * SPLITS .. g * SPLITS + SPLITS - 1 (one per K split) hold the same tiles in every phase.
    # Once all of them have stored their partials (a count per (phase, group)), each sums its 1 / SPLITS of
    # the tiles' rows in split order and writes them in bf16
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    count = cnt_ptr + p * (programs // SPLITS) + pid // SPLITS
    gl.thread_barrier()  # every warp's partial stores are issued before the count (release)
    gl.atomic_add(count, 1, sem="release", scope="gpu")
    seen = gl.atomic_add(count, 0, sem="acquire", scope="gpu")
    while seen < SPLITS:
        seen = gl.atomic_add(count, 0, sem="acquire", scope="gpu")
    gl.thread_barrier()
    RS: gl.constexpr = BLOCK_M // SPLITS
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    rm = (pid % SPLITS) * RS + gl.arange(0, RS, layout=gl.SliceLayout(1, layout))
    rn0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    for u in range(pid, units, programs):
        offs = rm[:, None] * stride_y + ((u // SPLITS) * BLOCK_N + rn0)[None, :]
        total = gl.zeros([RS, BLOCK_N], gl.float32, layout)
        for s in gl.static_range(SPLITS):  # L2 (.cg): an earlier phase may have left these lines in L1
            total += gl.load(part_ptr + s * (BLOCK_M * stride_y) + offs, cache_modifier=".cg")
        gl.store(y_ptr + (p + 1) * slot + offs, total.to(gl.bfloat16), mask=(rm < M)[:, None])


@gluon.jit
def _multiply(xbuf, x_ready, x_empty, ring, ready, empty, y_ptr, part_ptr, cnt_ptr, tile_cnt_ptr, cols_ptr,
              num_phases, M, stride_y, slot, max_tiles, K: gl.constexpr, SPLITS: gl.constexpr,
              STAGES: gl.constexpr, SKIP: gl.constexpr, GROUP: gl.constexpr, WARPS: gl.constexpr):
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    CHUNKS: gl.constexpr = K // SPLITS // BLOCK_K
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    i = 0
    for p in range(num_phases):
        units = gl.load(cols_ptr + p) // BLOCK_N * SPLITS
        for u in range(pid, units, programs):
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
            for c in gl.static_range(CHUNKS):
                mbarrier.wait(x_ready.index(c), p & 1)  # at once after the phase's first unit
                box = take(ring, ready, i, STAGES)
                if SKIP != 1:
                    acc = warpgroup_mma(xbuf.index(c), box.permute((1, 0)), acc)
                give(empty, i, STAGES)
                i += 1
            _finish_unit(acc, u // SPLITS, p, y_ptr, part_ptr, tile_cnt_ptr, M, stride_y, slot, max_tiles, SPLITS,
                         SKIP, GROUP, mma)
        if GROUP and SKIP != 3:
            _group_sum(p, units, y_ptr, part_ptr, tile_cnt_ptr, M, stride_y, slot, SPLITS, WARPS)
        for c in gl.static_range(CHUNKS):  # a CTA without units too: no chunk may still be landing when the
            mbarrier.wait(x_ready.index(c), p & 1)  # stager arms the next phase's (one completion a phase)
        fence_async_shared()  # the wgmmas' reads (synchronous, done) ordered before the next phase's TMA writes
        mbarrier.arrive(x_empty.index(0), count=1)
        if p + 1 < num_phases:
            _fence_proxy_async()
            gl.thread_barrier()  # every warp's tile stores are issued before the phase's count
            gl.atomic_add(cnt_ptr + p, 1, sem="release", scope="gpu")


@gluon.jit
def ws64wg_kernel(w_desc, x_desc, y_ptr, part_ptr, cnt_ptr, tile_cnt_ptr, cols_ptr, w_row_ptr, num_phases, M,
                  stride_y, slot, max_tiles, K: gl.constexpr, SPLITS: gl.constexpr, STAGES: gl.constexpr,
                  SKIP: gl.constexpr, GROUP: gl.constexpr, num_warps: gl.constexpr):
    # SKIP (diagnostics; the output is then wrong): 1 no MMA, 2 no phase barrier, 3 no sum of the partials.
    # GROUP: who sums a tile's partials (0: its last unit to arrive; 1: the CTAs of its group, at the phase's end)
    CHUNKS: gl.constexpr = K // SPLITS // BLOCK_K
    ring, ready, empty = weight_ring(w_desc, STAGES)
    xbuf, x_ready, x_empty = staged_chunks(CHUNKS, x_desc)
    gl.warp_specialize([
        (_multiply, (xbuf, x_ready, x_empty, ring, ready, empty, y_ptr, part_ptr, cnt_ptr, tile_cnt_ptr, cols_ptr,
                     num_phases, M, stride_y, slot, max_tiles, K, SPLITS, STAGES, SKIP, GROUP, num_warps)),
        (_load_weights, (ring, ready, empty, w_desc, cols_ptr, w_row_ptr, num_phases, K, SPLITS, STAGES)),
        (_stage_phases, (xbuf, x_ready, x_empty, x_desc, cnt_ptr, num_phases, K, SPLITS, SKIP)),
    ], [1, 1], [40, 40])


# ---------------------------------------------------------------------------------------------- the host side

def box_layout() -> gl.NVMMASharedLayout:
    """The layout of a [64, BOX_K] box, weights' and activations' alike (128-byte swizzle)."""
    return gl.NVMMASharedLayout.get_default_for([ROWS, BOX_K], gl.bfloat16)


def check_way(stages: int, splits: int, skip: int, group: int = 0) -> None:
    """A way's values, with the field named."""
    if group not in (0, 1):
        raise ValueError(f"group must be 0 (a tile's last unit sums its partials) or 1 (the CTAs of its group do), "
                         f"got {group}")
    if splits not in (2, 4, 8):
        raise ValueError(f"splits must be 2, 4 or 8 (K / splits columns of activations staged), got {splits}")
    if not 2 <= stages <= 12 or skip not in (0, 1, 2, 3):
        raise ValueError(f"stages must be 2..12 (16 KB weight boxes) and skip 0..3, got {stages}, {skip}")


def check_chain(k: int, cols: list[int], sms: int, splits: int) -> None:
    """What the kernel needs of a chain and a grid at `splits`, with the field named."""
    if k % (splits * BOX_K):
        raise ValueError(f"K ({k}) must be a multiple of splits x {BOX_K}, got splits {splits}")
    if sms % splits:
        raise ValueError(f"the CTAs ({sms}) must be a multiple of splits ({splits}): a CTA's units share a K range")
    if any(c % TILE_N for c in cols):
        raise ValueError(f"every phase's columns must be a multiple of {TILE_N}, got {sorted(set(cols))}")


def launch_args(chain, stages: int, splits: int, sms: int, skip: int = 0, group: int = 0) -> tuple[tuple, dict]:
    """ws64wg_kernel's arguments and constexprs for the chain (phase_probe.Chain, 33-64 rows) on `sms` CTAs, its
    counts zeroed (a graph captures the memsets)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from phase_probe import K
    if chain.block_m != ROWS:
        raise ValueError(f"the kernel takes 33-64 rows (slots of 64), got {chain.rows} rows")
    check_way(stages, splits, skip, group)
    check_chain(K, chain.cols, sms, splits)
    max_tiles = max(chain.cols) // TILE_N
    counts = len(chain.cols) * max(max_tiles, sms // splits)  # per (phase, tile) or per (phase, group)
    scratch = getattr(chain, "wg_scratch", None)
    if scratch is None or scratch[0].shape[0] != splits or scratch[1].numel() < counts:
        chain.wg_scratch = (torch.empty(splits, ROWS, chain.width, dtype=torch.float32, device=chain.y.device),
                            torch.zeros(counts, dtype=torch.int32, device=chain.y.device))
    part, tile_cnt = chain.wg_scratch
    w_desc = TensorDescriptor.from_tensor(chain.w, [TILE_N, BOX_K], box_layout())
    x_desc = TensorDescriptor.from_tensor(chain.y.view(-1, chain.width), [ROWS, BOX_K], box_layout())
    chain.cnt.zero_()
    tile_cnt.zero_()
    args = (w_desc, x_desc, chain.y, part, chain.cnt, tile_cnt, chain.cols_t, chain.w_rows, len(chain.cols), chain.rows,
            chain.width, chain.y.stride(0), max_tiles)
    return args, dict(K=K, SPLITS=splits, STAGES=stages, SKIP=skip, GROUP=group, num_warps=4)


def run_ws64wg(chain, stages: int, splits: int, sms: int, skip: int = 0, group: int = 0) -> None:
    """The chain as one launch of `sms` CTAs."""
    args, constexprs = launch_args(chain, stages, splits, sms, skip, group)
    ws64wg_kernel[(sms,)](*args, **constexprs)


def compile_wg_for_sm90(stages: int = 8, splits: int = 4, skip: int = 0, group: int = 0) -> dict:
    """ws64wg_kernel compiled for sm90 without a GPU (ws_chain.compile_sm90: shared memory and PTX counts)."""
    from phase_probe import K
    check_way(stages, splits, skip, group)
    box = f"tensordesc<bf16[{ROWS}, {BOX_K}],{box_layout()!r}>"
    signature = {"w_desc": box, "x_desc": box, "y_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32",
                 "tile_cnt_ptr": "*i32", "cols_ptr": "*i32", "w_row_ptr": "*i64", "num_phases": "i32", "M": "i32",
                 "stride_y": "i32", "slot": "i32", "max_tiles": "i32"}
    constexprs = {"K": K, "SPLITS": splits, "STAGES": stages, "SKIP": skip, "GROUP": group, "num_warps": 4}
    aligned = ("y_ptr", "part_ptr", "cnt_ptr", "tile_cnt_ptr", "cols_ptr", "w_row_ptr", "stride_y", "slot")
    return compile_sm90(ws64wg_kernel, signature, constexprs, aligned)


def parse_ways_wg(text: str) -> list[tuple[int, int, int, int]]:
    """"8:4:0,8:4:2:1" -> [(weight slots, splits, skip, group), ...] (group 0 when left out); "" -> none."""
    ways = []
    for item in text.split(",") if text.strip() else ():
        values = [int(v) for v in item.split(":")] if item.strip() else []
        if len(values) not in (3, 4):
            raise ValueError(f"--ways64wg item {item!r}: stages:splits:skip[:group] with stages 2..12 (16 KB weight "
                             "boxes), splits 2, 4 or 8, skip 0, 1 (no MMA), 2 (no phase barrier) or 3 (no sum of "
                             "the partials), group 0 (a tile's last unit sums) or 1 (its group's CTAs do)")
        values += [0] * (4 - len(values))
        check_way(*values)
        ways.append(tuple(values))
    return ways
