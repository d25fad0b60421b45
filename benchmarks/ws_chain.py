"""The warp-specialized Gluon kernel of benchmarks/phase_probe_ws.py: the phase chain in one persistent launch
whose weight stream never waits at a phase boundary. phase_probe_ws.py's docstring says how it is built and
docs/benchmarks.md (session 14) what it measured; SPLIT (ws_chain_kernel) says which partition does what."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from engine.gluon_attention_o import multiply_box as _multiply_box  # one weight box times the staged rows
from engine.gluon_attention_o import stage_rows
from engine.gluon_ring import give as _give  # the weight ring (ws_layer.py imports these names from here)
from engine.gluon_ring import load_box as _load_box
from engine.gluon_ring import take as _take
from engine.gluon_ring import weight_ring as _weight_ring
from engine.gluon_splitk import wait_for_count as _wait_for_phase  # a phase's grid-wide count (ws_chain64 imports it)

BOX_ROWS, BLOCK_K_WS = 16, 256  # one TMA box of weights: 16 rows x 256 (8 KB)


# ---------------------------------------------------------------------------- the weight ring (every kernel's)

@gluon.jit
def _weight_loader(w_desc, ring, ready, empty, cols_ptr, w_row_ptr, num_phases,
                   K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    # every weight box of this CTA's tiles, phase after phase; waits only for a free slot
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    i = 0
    for p in range(num_phases):
        row0 = gl.load(w_row_ptr + p).to(gl.int32)
        n_tiles = gl.load(cols_ptr + p) // BLOCK_N
        for t in range(pid, n_tiles, programs):
            for kb in range(K // BLOCK_K):
                _load_box(w_desc, row0 + t * BLOCK_N, kb * BLOCK_K, ring, ready, empty, i, STAGES)
                i += 1


@gluon.jit
def _stage_activations(x_ptr, x_smem, M, stride_y, K: gl.constexpr, BLOCK_M: gl.constexpr, WARPS: gl.constexpr,
                       CHUNKS: gl.constexpr):
    # K columns in CHUNKS column chunks (0: 256 columns per warp, so that one warp's registers hold a chunk);
    # each chunk's loads are one round trip to L2
    CHUNK: gl.constexpr = 256 * WARPS if CHUNKS == 0 else K // CHUNKS
    gl.static_assert(K % CHUNK == 0, "the chunks must tile the staged columns")
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [1, WARPS], [1, 0])
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    rk = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout))
    for c in gl.static_range(K // CHUNK):
        x = gl.load(x_ptr + rm[:, None] * stride_y + (c * CHUNK + rk)[None, :], mask=(rm < M)[:, None], other=0.0)
        x_smem.slice(c * CHUNK, CHUNK, dim=1).store(x)
    gl.thread_barrier()


@gluon.jit
def _consumer(y_ptr, cnt_ptr, cols_ptr, ring, ready, empty, x_smem, x_ready, x_empty, num_phases, M, stride_y,
              slot, K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              STAGES: gl.constexpr, CHAINS: gl.constexpr, SKIP: gl.constexpr, WARPS: gl.constexpr,
              STAGED: gl.constexpr):
    # STAGED 0: this partition waits at the boundary and stages the activations into its one buffer; 1:
    # another partition does, into x_smem's two buffers (x_ready / x_empty), signalling a whole buffer; 2: the
    # same, signalling each BLOCK_K chunk (x_ready[buffer * NCH + chunk]), so the MMAs start on the first.
    # SKIP (diagnostics; the output is then wrong): 1 no MMA (the ring's stream alone), 2 no phase barrier
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    NCH: gl.constexpr = K // BLOCK_K
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    rn0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    i = 0
    for p in range(num_phases):
        if STAGED == 1:
            mbarrier.wait(x_ready.index((p % 2) * NCH), (p // 2) & 1)
        if STAGED:
            xb = x_smem.index(p % 2)
        else:
            if p > 0 and SKIP != 2:
                _wait_for_phase(cnt_ptr + p - 1, programs)
            xb = x_smem.index(0)
            _stage_activations(y_ptr + p * slot, xb, M, stride_y, K, BLOCK_M, WARPS, 0)
        out = y_ptr + (p + 1) * slot
        n_tiles = gl.load(cols_ptr + p) // BLOCK_N
        for t in range(pid, n_tiles, programs):
            acc0 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
            acc1 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
            acc2 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
            acc3 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
            for kb in gl.static_range(NCH):  # static: a shared-memory slice starts at a constant
                if STAGED == 2:  # (a wait for a phase already complete returns at once)
                    mbarrier.wait(x_ready.index((p % 2) * NCH + kb), (p // 2) & 1)
                box = _take(ring, ready, i, STAGES)
                if SKIP != 1:
                    acc0, acc1, acc2, acc3 = _multiply_box(box, xb.slice(kb * BLOCK_K, BLOCK_K, dim=1), acc0, acc1,
                                                           acc2, acc3, a_layout, b_layout, BLOCK_K, CHAINS)
                _give(empty, i, STAGES)
                i += 1
            rn = t * BLOCK_N + rn0
            acc = (acc0 + acc1) + (acc2 + acc3)
            gl.store(out + rm[None, :] * stride_y + rn[:, None], acc.to(gl.bfloat16), mask=(rm < M)[None, :])
        if STAGED:
            mbarrier.arrive(x_empty.index(p % 2), count=1)
        if p + 1 < num_phases:
            gl.thread_barrier()  # every warp's stores of this phase are issued
            gl.atomic_add(cnt_ptr + p, 1, sem="release", scope="gpu")


@gluon.jit
def _stager(y_ptr, cnt_ptr, x_smem, x_ready, x_empty, num_phases, M, stride_y, slot, STAGE_K: gl.constexpr,
            BLOCK_M: gl.constexpr, SKIP: gl.constexpr, WARPS: gl.constexpr, CHUNKS: gl.constexpr,
            K: gl.constexpr, BLOCK_K: gl.constexpr, PER_CHUNK: gl.constexpr):
    # the default partition when STAGED: at each boundary, wait for every CTA, then stage the next phase's
    # activations (STAGE_K >= K columns: more than the MMAs read, to measure how staging's cost grows toward
    # down's 5632-wide activations; shared memory takes powers of 2) into the buffer the consumer freed two
    # phases ago
    programs = gl.num_programs(0)
    for p in range(num_phases):
        mbarrier.wait(x_empty.index(p % 2), ((p // 2) & 1) ^ 1)
        if p > 0 and SKIP != 2:
            _wait_for_phase(cnt_ptr + p - 1, programs)
        if PER_CHUNK:
            stage_rows(y_ptr + p * slot, x_smem.index(p % 2), x_ready, (p % 2) * (K // BLOCK_K), M, stride_y, K,
                       BLOCK_M, BLOCK_K, WARPS, True)  # each chunk signalled as soon as it has landed
        else:
            _stage_activations(y_ptr + p * slot, x_smem.index(p % 2), M, stride_y, STAGE_K, BLOCK_M, WARPS, CHUNKS)
            mbarrier.arrive(x_ready.index((p % 2) * (K // BLOCK_K)), count=1)


@gluon.jit
def _idle(num_phases):
    pass


@gluon.jit
def _consumer_worker(y_ptr, cnt_ptr, cols_ptr, ring, ready, empty, x_smem, x_ready, x_empty, num_phases, M,
                     stride_y, slot, w_desc, w_row_ptr, K: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, CHAINS: gl.constexpr,
                     SKIP: gl.constexpr, STAGED: gl.constexpr):
    _consumer(y_ptr, cnt_ptr, cols_ptr, ring, ready, empty, x_smem, x_ready, x_empty, num_phases, M, stride_y, slot,
              K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CHAINS, SKIP, 1, STAGED)


@gluon.jit
def _loader_worker(y_ptr, cnt_ptr, cols_ptr, ring, ready, empty, x_smem, x_ready, x_empty, num_phases, M,
                   stride_y, slot, w_desc, w_row_ptr, K: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, CHAINS: gl.constexpr,
                   SKIP: gl.constexpr, STAGED: gl.constexpr):
    _weight_loader(w_desc, ring, ready, empty, cols_ptr, w_row_ptr, num_phases, K, BLOCK_N, BLOCK_K, STAGES)


@gluon.jit
def ws_chain_kernel(w_desc, y_ptr, cnt_ptr, cols_ptr, w_row_ptr, num_phases, M, stride_y, slot,
                    x_layout: gl.constexpr, K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    BLOCK_K: gl.constexpr, STAGES: gl.constexpr, CHAINS: gl.constexpr, SKIP: gl.constexpr,
                    SPLIT: gl.constexpr, CHUNKS: gl.constexpr, STAGE_K: gl.constexpr, num_warps: gl.constexpr):
    # SPLIT 0: the default partition (num_warps = 4) waits, stages and multiplies, every warp the whole 16-row
    # tile (the MMA layout replicates it); 1: a 1-warp worker does all three (no replicated shared-memory
    # reads), the default partition idles (a warp-specialized kernel's num_warps is a multiple of 4); 2: a
    # 1-warp worker multiplies, the default partition waits and stages (two activation buffers); 3: as 2, the
    # staging signalled per BLOCK_K chunk
    NBUF: gl.constexpr = 2 if SPLIT >= 2 else 1
    ring, ready, empty = _weight_ring(w_desc, STAGES)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_M, STAGE_K], x_layout)
    x_ready = gl.allocate_shared_memory(gl.int64, [2 * (K // BLOCK_K), 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2 * (K // BLOCK_K)):
        mbarrier.init(x_ready.index(b), count=1)
    for b in gl.static_range(2):
        mbarrier.init(x_empty.index(b), count=1)
    if SPLIT == 0:
        gl.warp_specialize([
            (_consumer, (y_ptr, cnt_ptr, cols_ptr, ring, ready, empty, x_smem, x_ready, x_empty, num_phases, M,
                         stride_y, slot, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CHAINS, SKIP, num_warps, 0)),
            (_weight_loader, (w_desc, ring, ready, empty, cols_ptr, w_row_ptr, num_phases, K, BLOCK_N, BLOCK_K,
                              STAGES)),
        ], [1], [40])
    elif SPLIT == 1:
        gl.warp_specialize([
            (_idle, (num_phases,)),
            (_consumer_worker, (y_ptr, cnt_ptr, cols_ptr, ring, ready, empty, x_smem, x_ready, x_empty, num_phases,
                                M, stride_y, slot, w_desc, w_row_ptr, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CHAINS,
                                SKIP, 0)),
            (_loader_worker, (y_ptr, cnt_ptr, cols_ptr, ring, ready, empty, x_smem, x_ready, x_empty, num_phases,
                              M, stride_y, slot, w_desc, w_row_ptr, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CHAINS,
                              SKIP, 0)),
        ], [1, 1], [192, 40])
    else:
        gl.warp_specialize([
            (_stager, (y_ptr, cnt_ptr, x_smem, x_ready, x_empty, num_phases, M, stride_y, slot, STAGE_K, BLOCK_M,
                       SKIP, num_warps, CHUNKS, K, BLOCK_K, SPLIT == 3)),
            (_consumer_worker, (y_ptr, cnt_ptr, cols_ptr, ring, ready, empty, x_smem, x_ready, x_empty, num_phases,
                                M, stride_y, slot, w_desc, w_row_ptr, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CHAINS,
                                SKIP, SPLIT - 1)),
            (_loader_worker, (y_ptr, cnt_ptr, cols_ptr, ring, ready, empty, x_smem, x_ready, x_empty, num_phases,
                              M, stride_y, slot, w_desc, w_row_ptr, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CHAINS,
                              SKIP, SPLIT - 1)),
        ], [1, 1], [192, 40])


# ---------------------------------------------------------------------------------------------- the host side

CHAIN_ALIGNED = ("y_ptr", "cnt_ptr", "cols_ptr", "w_row_ptr", "stride_y", "slot")  # 16-aligned at the probes' shapes


def smem_layouts(block_m: int, k: int = BLOCK_K_WS) -> tuple[gl.NVMMASharedLayout, gl.NVMMASharedLayout]:
    """The weight boxes' layout (their TMA descriptors') and that of `block_m` x `k` staged activations."""
    return (gl.NVMMASharedLayout.get_default_for([BOX_ROWS, BLOCK_K_WS], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([block_m, k], gl.bfloat16))


def box_type(w_layout: gl.NVMMASharedLayout) -> str:
    """A weight descriptor's type in a compile signature."""
    return f"tensordesc<bf16[{BOX_ROWS}, {BLOCK_K_WS}],{w_layout!r}>"


def chain_signature(w_layout: gl.NVMMASharedLayout) -> dict:
    """The runtime arguments of ws_chain_kernel and ws_chain64_kernel, as compile_sm90 takes them."""
    return {"w_desc": box_type(w_layout), "y_ptr": "*bf16", "cnt_ptr": "*i32", "cols_ptr": "*i32",
            "w_row_ptr": "*i64", "num_phases": "i32", "M": "i32", "stride_y": "i32", "slot": "i32"}


def compile_sm90(kernel, signature: dict, constexprs: dict, aligned: tuple[str, ...]) -> dict:
    """Compile a Gluon kernel for sm90 without a GPU (Triton builds the PTX, ptxas the cubin). `aligned`: the
    arguments the launcher would specialize as 16-byte aligned / divisible by 16 at the probes' shapes.
    Returns its shared memory and the PTX's counts of TMA loads, cp.async copies, mma.sync and wgmma
    instructions, programmatic-dependent-launch waits, global proxy fences, global atomics, acquire loads
    (Triton's atomic adds of 0 with acquire) and clock reads."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": constexprs.get("num_warps", 4)})
    ptx = compiled.asm["ptx"]
    counts = {"tma_loads": "cp.async.bulk.tensor", "cp_async": "cp.async.cg.shared.global", "mma": "mma.sync",
              "gdc_wait": "griddepcontrol.wait", "wgmma": "wgmma.mma_async", "proxy_fence": "fence.proxy.async.global",
              "atomics": "atom.global", "acquire_loads": "ld.global.gpu.acquire", "globaltimer": "%globaltimer"}
    return {"shared": compiled.metadata.shared, **{name: ptx.count(text) for name, text in counts.items()},
            "spills": getattr(compiled.metadata, "n_spills", None), "cubin_bytes": len(compiled.asm["cubin"])}
