"""benchmarks/cluster_probe.py's Gluon kernels, for sm90 clusters of 2 CTAs (launch with num_ctas=2: program_id is the
cluster's). Triton 3.6's Gluon has no distributed-shared-memory op of its own that lowers (the probe's gluon_reduce and
gluon_convert), so the exchanges are inline PTX on global_smem, the kernel's dynamic shared memory, whose first words
a shared-memory allocation of the kernel's own (its only one) reserves. The layouts say both CTAs hold the same values
(cga_layout [[0]]), so Triton's own stores would be CTA 0's only: results are stored through inline PTX too. Imported
only where Triton is (written against Triton 3.6.0, the H200 image's)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

SMEM_FLAGS = 512  # bytes from global_smem to the second half of the reserved words (N = 128 floats first)


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
    """Zero 2 N words of shared memory (global_smem's first: the kernel's only allocation), then sync the cluster
    (a peer writes into them only after)."""
    buf = gl.allocate_shared_memory(gl.float32, [2 * N], S)
    buf.store(gl.zeros([2 * N], gl.float32, gl.BlockedLayout([2], [32], [4], [0], cga_layout=[[0]])))
    gl.thread_barrier()


@gluon.jit
def exchange_kernel(x_ptr, y_ptr, N: gl.constexpr, ROUNDS: gl.constexpr, L: gl.constexpr, S: gl.constexpr,
                    VIA: gl.constexpr):
    """ROUNDS swaps of the two CTAs' rows, each: a store, a cluster barrier, the peer's row, a barrier; y = x + 2 x the
    peer's, ROUNDS times. VIA 0: the peer's shared memory (mapa + ld.shared::cluster); 1: y's rows in L2 (.cg);
    2: the barriers alone (its own row)."""
    _reserve(N, S)
    c = gl.arange(0, N, layout=L)
    _cluster_sync(c)
    rank = _rank(c)
    base, peer_base = (gl.program_id(0) * 2 + rank) * N, (gl.program_id(0) * 2 + (rank ^ 1)) * N
    x = gl.load(x_ptr + base + c)
    acc = x
    for _ in range(ROUNDS):
        if VIA == 1:
            gl.inline_asm_elementwise("st.global.cg.f32 [$1], $2; mov.u32 $0, 0;", "=r,l,f",
                                      [(y_ptr + base + c).to(gl.int64), x], dtype=gl.int32, is_pure=False, pack=1)
        elif VIA == 0:
            gl.inline_asm_elementwise("{ .reg .u32 a; mov.u32 a, global_smem; mad.lo.u32 a, $1, 4, a; "
                                      "st.shared.f32 [a], $2; mov.u32 $0, 0; }", "=r,r,f", [c, x], dtype=gl.int32,
                                      is_pure=False, pack=1)
        _cluster_sync(c)
        if VIA == 1:
            peer = gl.inline_asm_elementwise("ld.global.cg.f32 $0, [$1];", "=f,l", [(y_ptr + peer_base + c).to(gl.int64)],
                                             dtype=gl.float32, is_pure=False, pack=1)
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
def _handoff_smem_flags(c, val, sender, peer, k):
    """Round k through the receiver's shared memory: the sender's threads store their value and a release flag
    (k + 1) into the peer's words; the receiver's spin on their own flag (acquire) and take the value + 1."""
    gl.inline_asm_elementwise(
        "{ .reg .pred s; .reg .u32 a, r; setp.ne.u32 s, $3, 0; mov.u32 a, global_smem; mad.lo.u32 a, $1, 4, a; "
        "mapa.shared::cluster.u32 r, a, $4; @s st.shared::cluster.f32 [r], $2; add.u32 r, r, 512; "
        "@s st.release.cluster.shared::cluster.u32 [r], $5; mov.u32 $0, 0; }",
        "=r,r,f,r,r,r", [c, val, sender, peer, c * 0 + k + 1], dtype=gl.int32, is_pure=False, pack=1)
    return gl.inline_asm_elementwise(
        "{ .reg .pred s, d; .reg .u32 a, v; setp.eq.u32 s, $2, 0; mov.u32 a, global_smem; mad.lo.u32 a, $1, 4, a; "
        "mov.f32 $0, $4; @!s bra DONE${:uid}; WAIT${:uid}: ld.acquire.cluster.shared::cta.u32 v, [a+512]; "
        "setp.lt.u32 d, v, $3; @d bra WAIT${:uid}; ld.shared::cta.f32 $0, [a]; add.f32 $0, $0, 0f3F800000; "
        "DONE${:uid}: }", "=f,r,r,r,f", [c, sender, c * 0 + k + 1, val], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _handoff_l2_flags(c, val, sender, k, data_mine, data_peer, flag_mine, flag_peer):
    """The same through global memory: the value (.cg) and a release flag into the peer's words, an acquire spin."""
    gl.inline_asm_elementwise(
        "{ .reg .pred s; setp.ne.u32 s, $3, 0; @s st.global.cg.f32 [$1], $2; @s st.release.gpu.global.u32 [$4], $5; "
        "mov.u32 $0, 0; }", "=r,l,f,r,l,r", [data_peer.to(gl.int64), val, sender, flag_peer.to(gl.int64),
                                             c * 0 + k + 1], dtype=gl.int32, is_pure=False, pack=1)
    return gl.inline_asm_elementwise(
        "{ .reg .pred s, d; .reg .u32 v; setp.eq.u32 s, $2, 0; mov.f32 $0, $5; @!s bra DONE${:uid}; WAIT${:uid}: "
        "ld.acquire.gpu.global.u32 v, [$4]; setp.lt.u32 d, v, $3; @d bra WAIT${:uid}; ld.global.cg.f32 $0, [$1]; "
        "add.f32 $0, $0, 0f3F800000; DONE${:uid}: }", "=f,l,r,r,l,f",
        [data_mine.to(gl.int64), sender, c * 0 + k + 1, flag_mine.to(gl.int64), val], dtype=gl.float32,
        is_pure=False, pack=1)


@gluon.jit
def _handoff_async(c, val, sender, peer, k):
    """Round k as Hopper's producer / consumer path: the sender's threads st.async their value into the peer's words,
    each completing 4 bytes of the peer's mbarrier (at global_smem + 512); the receiver's thread 0 arrives expecting
    4 N bytes, and all its threads wait on the barrier's phase (its receives so far, k // 2, mod 2)."""
    gl.inline_asm_elementwise(
        "{ .reg .pred s; .reg .u32 a, r, b; setp.ne.u32 s, $3, 0; mov.u32 a, global_smem; add.u32 b, a, 512; "
        "mad.lo.u32 a, $1, 4, a; mapa.shared::cluster.u32 r, a, $4; mapa.shared::cluster.u32 b, b, $4; "
        "@s st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [r], $2, [b]; mov.u32 $0, 0; }",
        "=r,r,f,r,r", [c, val, sender, peer], dtype=gl.int32, is_pure=False, pack=1)
    return gl.inline_asm_elementwise(
        "{ .reg .pred s, f, d; .reg .u32 a, b; setp.eq.u32 s, $2, 0; setp.eq.and.u32 f, $1, 0, s; "
        "mov.u32 a, global_smem; add.u32 b, a, 512; mad.lo.u32 a, $1, 4, a; mov.f32 $0, $4; "
        "@f mbarrier.arrive.expect_tx.shared::cta.b64 _, [b], 512; @!s bra DONE${:uid}; WAIT${:uid}: "
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 d, [b], $3; @!d bra WAIT${:uid}; "
        "ld.shared::cta.f32 $0, [a]; add.f32 $0, $0, 0f3F800000; DONE${:uid}: }",
        "=f,r,r,r,f", [c, sender, c * 0 + (k // 2) % 2, val], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _init_barrier(c):
    """Thread 0 initializes the CTA's mbarrier (one arrival a phase) at global_smem + 512, fenced for the cluster."""
    gl.inline_asm_elementwise(
        "{ .reg .pred f; .reg .u32 b; setp.eq.u32 f, $1, 0; mov.u32 b, global_smem; add.u32 b, b, 512; "
        "@f mbarrier.init.shared::cta.b64 [b], 1; @f fence.mbarrier_init.release.cluster; mov.u32 $0, 0; }",
        "=r,r", [c], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def pingpong_kernel(x_ptr, y_ptr, N: gl.constexpr, ROUNDS: gl.constexpr, L: gl.constexpr, S: gl.constexpr,
                    VIA: gl.constexpr):
    """ROUNDS one-way handoffs: in round k the CTA of rank k % 2 hands its value to the other, which takes it + 1.
    VIA 0: release / acquire flags in the receiver's shared memory; 1: the same in L2 (x's second and third rows:
    data words, flags; zero before a launch); 2: st.async + the receiver's mbarrier. x: three rows of
    clusters x 2 x N words (values, data, flags); y: the values after the last round."""
    _reserve(N, S)
    c = gl.arange(0, N, layout=L)
    if VIA == 2:
        _init_barrier(c)
    _cluster_sync(c)
    rank = _rank(c)
    words = gl.num_programs(0) * 2 * N
    base, peer_base = (gl.program_id(0) * 2 + rank) * N, (gl.program_id(0) * 2 + (rank ^ 1)) * N
    val = gl.load(x_ptr + base + c)
    for k in range(ROUNDS):
        sender = (rank == (k % 2)).to(gl.int32)
        if VIA == 0:
            val = _handoff_smem_flags(c, val, sender, rank ^ 1, k)
        elif VIA == 1:
            val = _handoff_l2_flags(c, val, sender, k, x_ptr + words + base + c, x_ptr + words + peer_base + c,
                                    x_ptr + 2 * words + base + c, x_ptr + 2 * words + peer_base + c)
        else:
            val = _handoff_async(c, val, sender, rank ^ 1, k)
    _cluster_sync(c)
    _store_out(y_ptr + base + c, val)
