"""The pieces of the 64-row warp-specialized Gluon kernels (Hopper) that split each GEMM phase's K among the CTAs
of a group: gluon_layers64.py in the engine, benchmarks/ws_layer64.py and ws_chain64_wg.py in the probes.

A phase multiplies 64 rows (wgmma's M) by a weight matrix in units of (64-column tile, 1 / S of K). CTA `pid`
takes units pid, pid + CTAs, ..., so with the CTAs a multiple of S all of a CTA's units share one K range (split
pid % S), which it stages once a phase (CHUNKS boxes of [64 rows, 128]); the S CTAs of group pid // S hold the same
tiles (g, g + CTAs / S, ...). Each unit stores its float32 partial; once the group's S CTAs have (group_barrier),
each sums 1 / S of the group's tiles. A loader warp streams the units' weight boxes ([64 columns, 128] of K)
through a ring (gluon_ring.py) across phase boundaries.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma

from .gluon_ring import give, load_box, take

BLOCK_M, BLOCK_N, BLOCK_K = gl.constexpr(64), gl.constexpr(64), gl.constexpr(128)  # rows, a tile's columns, a box's K


@gluon.jit
def wait_for_count(cnt_ptr, target):
    """Poll a global count (acquire) until it reaches `target`, then a CTA-wide barrier."""
    seen = gl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = gl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    gl.thread_barrier()


@gluon.jit
def fence_proxy_async_global():
    """Generic-proxy writes to global memory ordered with async-proxy (TMA) accesses."""
    gl.inline_asm_elementwise("fence.proxy.async.global; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def staged_chunks(CHUNKS: gl.constexpr, desc):
    """A CTA's staged K range: CHUNKS chunks in the layout of desc's [64, BLOCK_K] boxes, a barrier each (landed:
    one completion a phase) and one the multiplying partition arrives at once it is done with the phase's chunks."""
    xbuf = gl.allocate_shared_memory(gl.bfloat16, [CHUNKS, BLOCK_M, BLOCK_K], desc.layout)
    x_ready = gl.allocate_shared_memory(gl.int64, [CHUNKS, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(CHUNKS):
        mbarrier.init(x_ready.index(c), count=1)
    mbarrier.init(x_empty.index(0), count=1)
    return xbuf, x_ready, x_empty


@gluon.jit
def load_phase(desc, row0, i, ring, ready, empty, N_TILES: gl.constexpr, PAIR: gl.constexpr, S: gl.constexpr,
               CHUNKS: gl.constexpr, STAGES: gl.constexpr):
    """The loader's boxes of one phase, from weight row row0 (its layer's first): per unit, its K range's boxes of
    the tile's rows (PAIR > 0: and of the rows PAIR further on, gate_up's up rows, box by box); returns i."""
    pid = gl.program_id(0)
    k0 = (pid % S) * (CHUNKS * BLOCK_K)
    for u in range(pid, N_TILES * S, gl.num_programs(0)):
        row = row0 + (u // S) * BLOCK_N
        for c in gl.static_range(CHUNKS):
            load_box(desc, row, k0 + c * BLOCK_K, ring, ready, empty, i, STAGES)
            i += 1
            if PAIR > 0:
                load_box(desc, row + PAIR, k0 + c * BLOCK_K, ring, ready, empty, i, STAGES)
                i += 1
    return i


@gluon.jit
def mma_unit(xbuf, x_ready, ring, ready, empty, i, parity, t, s, part_ptr, PW: gl.constexpr, PAIR: gl.constexpr,
             CHUNKS: gl.constexpr, STAGES: gl.constexpr, mma: gl.constexpr):
    """One unit's wgmmas over the staged chunks (PAIR > 0: a second accumulator for the paired boxes, stored PAIR
    columns further on), then its float32 partials at part[s, rows, tile t's columns] (rows PW apart); returns i."""
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    acc_u = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    for c in gl.static_range(CHUNKS):
        mbarrier.wait(x_ready.index(c), parity)
        acc = warpgroup_mma(xbuf.index(c), take(ring, ready, i, STAGES).permute((1, 0)), acc)
        give(empty, i, STAGES)
        i += 1
        if PAIR > 0:
            acc_u = warpgroup_mma(xbuf.index(c), take(ring, ready, i, STAGES).permute((1, 0)), acc_u)
            give(empty, i, STAGES)
            i += 1
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
    rn = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    offs = s * (BLOCK_M * PW) + rm[:, None] * PW + rn[None, :]
    gl.store(part_ptr + offs, acc)
    if PAIR > 0:
        gl.store(part_ptr + offs + PAIR, acc_u)
    return i


@gluon.jit
def group_barrier(gcnt_ptr, q, S: gl.constexpr):
    """This CTA's group's S CTAs have stored their partials and row sums (release / acquire); q: the count's row."""
    pid = gl.program_id(0)
    count = gcnt_ptr + q * gl.num_programs(0) + pid // S
    gl.thread_barrier()
    gl.atomic_add(count, 1, sem="release", scope="gpu")
    seen = gl.atomic_add(count, 0, sem="acquire", scope="gpu")
    while seen < S:
        seen = gl.atomic_add(count, 0, sem="acquire", scope="gpu")
    gl.thread_barrier()
