"""The pieces the warp-specialized Gluon kernels share (Hopper): a ring of TMA-loaded weight boxes in shared
memory, and a grid barrier for kernels whose CTAs are all resident at once.

The ring: STAGES slots of one weight box each, a `ready` mbarrier per slot (the box landed: TMA counts its
bytes in) and an `empty` one (the consumer gave the slot back). A loader warp calls `load_box` for the i-th
box of its stream, a consumer `take`s it, multiplies and `give`s it back; both count boxes from 0.

The grid barrier: two int32s in global memory, an arrival count and a generation. A CTA reads the generation
before it arrives (it cannot move before this CTA has arrived), arrives, and waits for the generation to
change; the last CTA to arrive resets the count and bumps the generation, so every launch (eager or a graph's
replay) finds the two as the last launch left them. It needs every CTA of the grid resident at once: the
dispatch of each kernel that uses it allows only grids of at most one CTA per SM (attention_dispatch,
mlp_dispatch). `grid_arrive` and `grid_wait` apart let one partition arrive after its stores while another
waits (gluon_mlp.py); `grid_barrier` is both in one partition (gluon_attention_o.py).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma


@gluon.jit
def weight_ring(desc, STAGES: gl.constexpr):
    """STAGES slots of one of desc's boxes each, with their `ready` and `empty` mbarriers."""
    ring = gl.allocate_shared_memory(desc.dtype, [STAGES] + desc.block_type.shape, desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    return ring, ready, empty


@gluon.jit
def load_box(desc, row, col, ring, ready, empty, i, STAGES: gl.constexpr):
    """The stream's i-th box (desc's box at [row, col]) into its slot, once the consumer gave the slot back."""
    s = i % STAGES
    mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(s), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, col], ready.index(s), ring.index(s))


@gluon.jit
def take(ring, ready, i, STAGES: gl.constexpr):
    """The slot of the stream's i-th box, once it has landed."""
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    return ring.index(s)


@gluon.jit
def give(empty, i, STAGES: gl.constexpr):
    """The i-th box's slot back to the loader."""
    fence_async_shared()  # the slot's reads are ordered before the next TMA write into it
    mbarrier.arrive(empty.index(i % STAGES), count=1)


@gluon.jit
def grid_generation(bar_ptr):
    """The barrier's generation now: read it before this CTA arrives, then grid_wait for it to move."""
    return gl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu")


@gluon.jit
def grid_arrive(bar_ptr, programs):
    """This CTA's arrival, after the calling partition's stores (they are released to every CTA that sees the
    generation move); the last of `programs` arrivals resets the count and bumps the generation."""
    gl.thread_barrier()  # every warp of the partition has issued its stores
    arrived = gl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == programs - 1:
        gl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        gl.atomic_add(bar_ptr + 1, 1, sem="release", scope="gpu")


@gluon.jit
def grid_wait(bar_ptr, gen):
    """Until the generation moves past `gen` (grid_generation's): every CTA has arrived (acquire atomics; polling
    with volatile loads and a fence measured slower, docs/benchmarks.md session 17)."""
    seen = gl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu")
    while seen == gen:
        seen = gl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu")
    gl.thread_barrier()


@gluon.jit
def grid_barrier(bar_ptr, programs):
    """Arrive and wait in one partition."""
    gen = grid_generation(bar_ptr)
    grid_arrive(bar_ptr, programs)
    grid_wait(bar_ptr, gen)
