"""benchmarks/cluster_probe.py's Gluon kernels, for sm90 clusters of 2 CTAs (launch with num_ctas=2: program_id is the
cluster's). Triton 3.6's Gluon has no distributed-shared-memory op of its own that lowers (the probe's gluon_reduce and
gluon_convert), so the exchanges are inline PTX on global_smem, the kernel's dynamic shared memory, whose first words
a shared-memory allocation of the kernel's own (its only one) reserves. The layouts say both CTAs hold the same values
(cga_layout [[0]]), so Triton's own stores would be CTA 0's only: results are stored through inline PTX too. Imported
only where Triton is (written against Triton 3.6.0, the H200 image's)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma

@gluon.jit
def reduce_kernel(x_ptr, y_ptr, N: gl.constexpr, L: gl.constexpr):
    """y = the sum of x's two rows, each row one CTA's (L's cga_layout splits dim 0)."""
    r = gl.arange(0, 2, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, N, layout=gl.SliceLayout(0, L))
    gl.store(y_ptr + c, gl.sum(gl.load(x_ptr + r[:, None] * N + c[None, :]), axis=0))


@gluon.jit
def convert_kernel(x_ptr, y_ptr, N: gl.constexpr, L: gl.constexpr, M: gl.constexpr):
    """x split over the CTAs (L) converted to a layout both hold (M): an all-gather."""
    x = gl.convert_layout(gl.load(x_ptr + gl.arange(0, N, layout=L)), M)
    gl.store(y_ptr + gl.arange(0, N, layout=M), x + 1.0)


@gluon.jit
def tma_wgmma_kernel(a_desc, b_desc, out_ptr, BAR: gl.constexpr, ACC: gl.constexpr, OUT: gl.constexpr):
    """out = a @ b.T for one 64 x 64 tile in each CTA of the cluster: TMA loads into its own shared memory (layouts with
    cga_layout [[0, 0]]), an mbarrier, wgmma; the stores through PTX (Triton's own would be CTA 0's only). What a
    split-K GEMM whose CTAs then sum through the peer's shared memory is made of."""
    a = gl.allocate_shared_memory(gl.bfloat16, [64, 64], a_desc.layout)
    b = gl.allocate_shared_memory(gl.bfloat16, [64, 64], b_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], BAR)
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, 2 * 64 * 64 * 2)
    tma.async_copy_global_to_shared(a_desc, [0, 0], bar, a)
    tma.async_copy_global_to_shared(b_desc, [0, 0], bar, b)
    mbarrier.wait(bar, 0)
    acc = warpgroup_mma(a, b.permute((1, 0)), gl.zeros([64, 64], gl.float32, ACC))
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, OUT))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, OUT))
    _store_out(out_ptr + r[:, None] * 64 + c[None, :], gl.convert_layout(acc, OUT))


@gluon.jit
def _cluster_sync(c):
    gl.inline_asm_elementwise("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; "
                              "mov.u32 $0, 0;", "=r,r", [c], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _rank(c):
    return gl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank;", "=r,r", [c], dtype=gl.int32, is_pure=False,
                                     pack=1)


@gluon.jit
def _store_out(ptrs, v):
    gl.inline_asm_elementwise("st.global.f32 [$1], $2; mov.u32 $0, 0;", "=r,l,f", [ptrs.to(gl.int64), v],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _reserve(N: gl.constexpr, S: gl.constexpr):
    """Zero 2 N words of shared memory (global_smem's first: the kernel's only allocation) and sync the CTA; the
    kernels then sync the cluster, so a peer writes into them only after."""
    buf = gl.allocate_shared_memory(gl.float32, [2 * N], S)
    buf.store(gl.zeros([2 * N], gl.float32, gl.BlockedLayout([2], [32], [4], [0], cga_layout=[[0]])))
    gl.thread_barrier()


@gluon.jit
def exchange_kernel(x_ptr, y_ptr, rounds, N: gl.constexpr, L: gl.constexpr, S: gl.constexpr, VIA: gl.constexpr):
    """`rounds` swaps of the two CTAs' rows, each: a store, a cluster barrier, the peer's row, a barrier; y = x + 2 x
    the peer's, `rounds` times. VIA 0: the peer's shared memory (mapa + ld.shared::cluster); 1: y's rows in L2 (.cg);
    2: the barriers alone (its own row)."""
    _reserve(N, S)
    c = gl.arange(0, N, layout=L)
    _cluster_sync(c)
    rank = _rank(c)
    base, peer_base = (gl.program_id(0) * 2 + rank) * N, (gl.program_id(0) * 2 + (rank ^ 1)) * N
    x = gl.load(x_ptr + base + c)
    acc = x
    for _ in range(rounds):
        if VIA == 1:
            gl.inline_asm_elementwise("st.global.cg.f32 [$1], $2; mov.u32 $0, 0;", "=r,l,f",
                                      [(y_ptr + base + c).to(gl.int64), x], dtype=gl.int32, is_pure=False, pack=1)
        elif VIA == 0:
            gl.inline_asm_elementwise("{ .reg .u32 a; mov.u32 a, global_smem; mad.lo.u32 a, $1, 4, a; "
                                      "st.shared.f32 [a], $2; mov.u32 $0, 0; }", "=r,r,f", [c, x], dtype=gl.int32,
                                      is_pure=False, pack=1)
        _cluster_sync(c)
        if VIA == 1:
            peer = gl.inline_asm_elementwise("ld.global.cg.f32 $0, [$1];", "=f,l",
                                             [(y_ptr + peer_base + c).to(gl.int64)], dtype=gl.float32, is_pure=False,
                                             pack=1)
        elif VIA == 2:
            peer = x
        else:
            peer = gl.inline_asm_elementwise("{ .reg .u32 a, r, p; mov.u32 a, global_smem; mad.lo.u32 a, $1, 4, a; "
                                             "xor.b32 p, $2, 1; mapa.shared::cluster.u32 r, a, p; "
                                             "ld.shared::cluster.f32 $0, [r]; }", "=f,r,r", [c, rank],
                                             dtype=gl.float32, is_pure=False, pack=1)
        _cluster_sync(c)
        acc = acc + 2.0 * peer
    _store_out(y_ptr + base + c, acc)


@gluon.jit
def _flag_handoff(c, val, sender, peer, k, data_mine, data_peer, flag_mine, flag_peer, SMEM: gl.constexpr):
    """Round k with a flag a CTA: the sender's threads store their values into the peer's words, sync, and thread 0
    fences and stores a release flag (k + 1); the receiver's thread 0 spins on its flag (acquire), the CTA syncs and
    every thread takes its value + 1. SMEM: in the receiver's shared memory (addresses are global_smem byte offsets,
    mapped to the peer's by mapa; scope cluster), else in global memory (addresses are pointers; .cg, scope gpu)."""
    if SMEM:
        gl.inline_asm_elementwise(
            "{ .reg .pred s; .reg .u32 a, r; setp.ne.u32 s, $3, 0; mov.u32 a, global_smem; add.u32 a, a, $1; "
            "mapa.shared::cluster.u32 r, a, $4; @s st.shared::cluster.f32 [r], $2; mov.u32 $0, 0; }",
            "=r,r,f,r,r", [data_peer, val, sender, peer], dtype=gl.int32, is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("{ .reg .pred s; setp.ne.u32 s, $3, 0; @s st.global.cg.f32 [$1], $2; "
                                  "mov.u32 $0, 0; }", "=r,l,f,r", [data_peer.to(gl.int64), val, sender],
                                  dtype=gl.int32, is_pure=False, pack=1)
    gl.thread_barrier()
    one = ((c == 0) & (sender != 0)).to(gl.int32)
    if SMEM:
        gl.inline_asm_elementwise(
            "{ .reg .pred s; .reg .u32 a, r; setp.ne.u32 s, $2, 0; mov.u32 a, global_smem; add.u32 a, a, $1; "
            "mapa.shared::cluster.u32 r, a, $4; @s fence.acq_rel.cluster; @s st.release.cluster.shared::cluster.u32 "
            "[r], $3; mov.u32 $0, 0; }", "=r,r,r,r,r", [flag_peer, one, c * 0 + k + 1, peer],
            dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise(
            "{ .reg .pred s, d; .reg .u32 a, v; setp.ne.u32 s, $2, 0; @!s bra DONE${:uid}; mov.u32 a, global_smem; "
            "add.u32 a, a, $1; WAIT${:uid}: ld.acquire.cluster.shared::cta.u32 v, [a]; setp.lt.u32 d, v, $3; "
            "@d bra WAIT${:uid}; DONE${:uid}: mov.u32 $0, 0; }", "=r,r,r,r",
            [flag_mine, ((c == 0) & (sender == 0)).to(gl.int32), c * 0 + k + 1], dtype=gl.int32, is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise(
            "{ .reg .pred s; setp.ne.u32 s, $2, 0; @s fence.acq_rel.gpu; @s st.release.gpu.global.u32 [$1], $3; "
            "mov.u32 $0, 0; }", "=r,l,r,r", [flag_peer.to(gl.int64), one, c * 0 + k + 1], dtype=gl.int32,
            is_pure=False, pack=1)
        gl.inline_asm_elementwise(
            "{ .reg .pred s, d; .reg .u32 v; setp.ne.u32 s, $2, 0; @!s bra DONE${:uid}; WAIT${:uid}: "
            "ld.acquire.gpu.global.u32 v, [$1]; setp.lt.u32 d, v, $3; @d bra WAIT${:uid}; DONE${:uid}: "
            "mov.u32 $0, 0; }", "=r,l,r,r", [flag_mine.to(gl.int64), ((c == 0) & (sender == 0)).to(gl.int32),
                                             c * 0 + k + 1], dtype=gl.int32, is_pure=False, pack=1)
    gl.thread_barrier()
    if SMEM:
        got = gl.inline_asm_elementwise("{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; "
                                        "ld.shared::cta.f32 $0, [a]; }", "=f,r", [data_mine], dtype=gl.float32,
                                        is_pure=False, pack=1)
    else:
        got = gl.inline_asm_elementwise("ld.global.cg.f32 $0, [$1];", "=f,l", [data_mine.to(gl.int64)],
                                        dtype=gl.float32, is_pure=False, pack=1)
    return gl.where(sender == 0, got + 1.0, val)


@gluon.jit
def _handoff_async(c, slot, val, sender, peer, k, BAR: gl.constexpr, PER: gl.constexpr):
    """Round k as Hopper's producer / consumer path: the sender's threads st.async their values into the peer's words,
    each completing 4 bytes of the peer's mbarrier (at global_smem + BAR); the receiver waits on it (_receive)."""
    gl.inline_asm_elementwise(
        "{ .reg .pred s; .reg .u32 a, r, b; setp.ne.u32 s, $3, 0; mov.u32 a, global_smem; add.u32 b, a, $5; "
        "mad.lo.u32 a, $1, 4, a; mapa.shared::cluster.u32 r, a, $4; mapa.shared::cluster.u32 b, b, $4; "
        "@s st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [r], $2, [b]; mov.u32 $0, 0; }",
        "=r,r,f,r,r,r", [slot, val, sender, peer, c * 0 + BAR], dtype=gl.int32, is_pure=False, pack=1)
    return _receive(c, slot, val, sender, k, BAR, PER)


@gluon.jit
def _handoff_bulk(c, slot, val, sender, peer, k, BAR: gl.constexpr, PER: gl.constexpr):
    """Round k as one bulk copy: the sender's threads write their values into their own words (then a proxy fence and a
    CTA sync), and its thread 0 copies all BAR bytes into the peer's words with cp.async.bulk, completing the peer's
    mbarrier; the receiver waits on it (_receive)."""
    gl.inline_asm_elementwise(
        "{ .reg .pred s; .reg .u32 a; setp.ne.u32 s, $3, 0; mov.u32 a, global_smem; mad.lo.u32 a, $1, 4, a; "
        "@s st.shared::cta.f32 [a], $2; mov.u32 $0, 0; }", "=r,r,f,r", [slot, val, sender], dtype=gl.int32,
        is_pure=False, pack=1)
    gl.inline_asm_elementwise(  # once a thread, after its stores: the async proxy (the bulk copy) sees them
        "{ .reg .pred s; setp.ne.u32 s, $1, 0; @s fence.proxy.async.shared::cta; mov.u32 $0, 0; }", "=r,r",
        [((c % PER) == 0).to(gl.int32) * sender], dtype=gl.int32, is_pure=False, pack=1)
    gl.thread_barrier()
    gl.inline_asm_elementwise(
        "{ .reg .pred s; .reg .u32 a, r, b; setp.ne.u32 s, $1, 0; mov.u32 a, global_smem; add.u32 b, a, $3; "
        "mapa.shared::cluster.u32 r, a, $2; mapa.shared::cluster.u32 b, b, $2; "
        "@s cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [r], [a], $3, [b]; mov.u32 $0, 0; }",
        "=r,r,r,r", [((c == 0) & (sender != 0)).to(gl.int32), peer, c * 0 + BAR], dtype=gl.int32, is_pure=False,
        pack=1)
    return _receive(c, slot, val, sender, k, BAR, PER)


@gluon.jit
def _receive(c, slot, val, sender, k, BAR: gl.constexpr, PER: gl.constexpr):
    """The receiver's side of a transaction-counted handoff: thread 0 arrives expecting BAR bytes, each thread waits on
    the phase once (at its first element), then every element is its word + 1."""
    first = ((c % PER) == 0).to(gl.int32) * (1 - sender)
    gl.inline_asm_elementwise(
        "{ .reg .pred s, f, d; .reg .u32 b; setp.ne.u32 s, $2, 0; setp.eq.and.u32 f, $1, 0, s; mov.u32 b, global_smem; "
        "add.u32 b, b, $4; @f mbarrier.arrive.expect_tx.shared::cta.b64 _, [b], $4; @!s bra DONE${:uid}; "
        "WAIT${:uid}: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 d, [b], $3; @!d bra WAIT${:uid}; "
        "DONE${:uid}: mov.u32 $0, 0; }", "=r,r,r,r,r", [c, first, c * 0 + (k // 2) % 2, c * 0 + BAR], dtype=gl.int32,
        is_pure=False, pack=1)
    got = gl.inline_asm_elementwise("{ .reg .u32 a; mov.u32 a, global_smem; mad.lo.u32 a, $1, 4, a; "
                                    "ld.shared::cta.f32 $0, [a]; }", "=f,r", [slot], dtype=gl.float32,
                                    is_pure=False, pack=1)
    return gl.where(sender == 0, got + 1.0, val)


@gluon.jit
def _init_barrier(c, BAR: gl.constexpr):
    """Thread 0 initializes the CTA's mbarrier (one arrival a phase) at global_smem + BAR, fenced for the cluster."""
    gl.inline_asm_elementwise(
        "{ .reg .pred f; .reg .u32 b; setp.eq.u32 f, $1, 0; mov.u32 b, global_smem; add.u32 b, b, $2; "
        "@f mbarrier.init.shared::cta.b64 [b], 1; @f fence.mbarrier_init.release.cluster; mov.u32 $0, 0; }",
        "=r,r,r", [c, c * 0 + BAR], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def pingpong_kernel(x_ptr, y_ptr, rounds, N: gl.constexpr, L: gl.constexpr, S: gl.constexpr, VIA: gl.constexpr):
    """`rounds` one-way handoffs of N floats a CTA: in round k the CTA of rank k % 2 hands its values to the other,
    which takes them + 1. VIA 0: a flag in the receiver's shared memory; 1: the same in L2 (x's second and third
    rows: data words, flags; zero before a launch); 2: st.async + the receiver's mbarrier; 3: one cp.async.bulk of
    the CTA's words into the receiver's, completing its mbarrier. x: three rows of
    clusters x 2 x N words (values, data, flags); y: the values after the last round."""
    _reserve(N, S)  # data at global_smem[0, 4 N), the flag or the mbarrier at 4 N
    c = gl.arange(0, N, layout=L)
    if VIA >= 2:
        _init_barrier(c, 4 * N)
    _cluster_sync(c)
    rank = _rank(c)
    words = gl.num_programs(0) * 2 * N
    base, peer_base = (gl.program_id(0) * 2 + rank) * N, (gl.program_id(0) * 2 + (rank ^ 1)) * N
    val = gl.load(x_ptr + base + c)
    # element c (a thread's c % PER-th of its PER) lives in word slot: a warp's lanes touch consecutive words (no bank
    # conflicts in shared memory, coalesced in L2)
    slot = (c % (N // 128)) * 128 + c // (N // 128)
    for k in range(rounds):
        sender = (rank == (k % 2)).to(gl.int32)
        if VIA == 0:
            val = _flag_handoff(c, val, sender, rank ^ 1, k, slot * 4, slot * 4, c * 0 + 4 * N, c * 0 + 4 * N, True)
        elif VIA == 1:
            val = _flag_handoff(c, val, sender, rank ^ 1, k, x_ptr + words + base + slot,
                                x_ptr + words + peer_base + slot, x_ptr + 2 * words + base + c * 0,
                                x_ptr + 2 * words + peer_base + c * 0, False)
        elif VIA == 2:
            val = _handoff_async(c, slot, val, sender, rank ^ 1, k, 4 * N, N // 128)
        else:
            val = _handoff_bulk(c, slot, val, sender, rank ^ 1, k, 4 * N, N // 128)
    _cluster_sync(c)
    _store_out(y_ptr + base + c, val)
