"""Does a warp-specialized persistent kernel close the phase boundary's cost? The Gluon half of the phase probe.

benchmarks/phase_probe.py measured a chain of 96 skinny GEMM phases (Ouro-1.4B layer-sized, distinct weights)
as PDL-chained kernels (3.7 us per phase above the bytes floor at 8 rows) and as one persistent Triton kernel
with grid barriers (worse: 6.3-10.5 us). There every warp waits at the barrier, so the weight stream stops
at every boundary. Here the stream never waits for a boundary: one CTA per SM, warp-specialized (Gluon,
Triton 3.6's `triton.experimental.gluon`):

- a loader warp TMA-loads the CTA's weight boxes ([BLOCK_N, BLOCK_K] of W_i) of every phase, in order, into
  a ring of STAGES shared-memory slots; it waits only for a free slot (an `empty` mbarrier), never for a
  phase boundary, so while the CTA waits at a boundary the ring fills with the next phase's weights;
- the default partition (4 warps) waits at each boundary for every CTA's previous phase (a per-phase counter
  in global memory: release increment after the CTA's stores, acquire poll before its loads), loads the
  phase's activations (x_i = y_(i-1)[:, :K], BLOCK_M <= 16 rows, 32-64 KB) into shared memory once, then for
  each of its tiles multiplies the ring's boxes (mma.sync, swap-AB: the 16 weight rows are the MMA's M, the
  batch rows its N) and writes its 16 output columns.

Same chain, same columns (whole waves of 16-column tiles), same CUDA-graph timing and torch check as
phase_probe.py; the ways run side by side, each twice in turn:

    python benchmarks/phase_probe_ws.py --out DIR [--rows 8,16] [--ways 12:4:0:1,20:1:0:4]
    python benchmarks/phase_probe_ws.py --compile   # CPU: compile the kernel for sm90 (no GPU needed)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

sys.path.insert(0, str(Path(__file__).resolve().parent))
from phase_probe import BLOCK_N, COPY_TBPS, K, Chain, measure, phase_columns, rel_err  # noqa: E402

BLOCK_K_WS = 256  # one TMA box of weights: 16 rows x 256 (8 KB)


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
                s = i % STAGES
                mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), BLOCK_N * BLOCK_K * 2)
                tma.async_copy_global_to_shared(w_desc, [row0 + t * BLOCK_N, kb * BLOCK_K], ready.index(s),
                                                ring.index(s))
                i += 1


@gluon.jit
def _wait_for_phase(cnt_ptr, programs):
    seen = gl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    while seen < programs:
        seen = gl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    gl.thread_barrier()


@gluon.jit
def _stage_activations(x_ptr, x_smem, M, stride_y, K: gl.constexpr, BLOCK_M: gl.constexpr, WARPS: gl.constexpr,
                       CHUNKS: gl.constexpr):
    # in CHUNKS column chunks (0: 256 columns per warp, so that one warp's registers hold a chunk); each
    # chunk's loads are one round trip to L2
    CHUNK: gl.constexpr = 256 * WARPS if CHUNKS == 0 else K // CHUNKS
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [1, WARPS], [1, 0])
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    rk = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout))
    for c in gl.static_range(K // CHUNK):
        x = gl.load(x_ptr + rm[:, None] * stride_y + (c * CHUNK + rk)[None, :], mask=(rm < M)[:, None], other=0.0)
        x_smem.slice(c * CHUNK, CHUNK, dim=1).store(x)
    gl.thread_barrier()


@gluon.jit
def _multiply_box(slot, xs, acc0, acc1, acc2, acc3, a_layout: gl.constexpr, b_layout: gl.constexpr,
                  BLOCK_K: gl.constexpr, CHAINS: gl.constexpr):
    # one weight box times the staged activations' same K range; CHAINS 4: its four 64-wide quarters go to
    # four accumulators, so the MMAs form four independent chains instead of one chain of BLOCK_K / 16
    if CHAINS == 1:
        acc0 = mma_v2(slot.load(a_layout), xs.permute((1, 0)).load(b_layout), acc0)
    else:
        Q: gl.constexpr = BLOCK_K // 4
        a0 = slot.slice(0, Q, dim=1).load(a_layout)
        a1 = slot.slice(Q, Q, dim=1).load(a_layout)
        a2 = slot.slice(2 * Q, Q, dim=1).load(a_layout)
        a3 = slot.slice(3 * Q, Q, dim=1).load(a_layout)
        b0 = xs.slice(0, Q, dim=1).permute((1, 0)).load(b_layout)
        b1 = xs.slice(Q, Q, dim=1).permute((1, 0)).load(b_layout)
        b2 = xs.slice(2 * Q, Q, dim=1).permute((1, 0)).load(b_layout)
        b3 = xs.slice(3 * Q, Q, dim=1).permute((1, 0)).load(b_layout)
        acc0 = mma_v2(a0, b0, acc0)
        acc1 = mma_v2(a1, b1, acc1)
        acc2 = mma_v2(a2, b2, acc2)
        acc3 = mma_v2(a3, b3, acc3)
    return acc0, acc1, acc2, acc3


@gluon.jit
def _consumer(y_ptr, cnt_ptr, cols_ptr, ring, ready, empty, x_smem, x_ready, x_empty, num_phases, M, stride_y,
              slot, K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              STAGES: gl.constexpr, CHAINS: gl.constexpr, SKIP: gl.constexpr, WARPS: gl.constexpr,
              STAGED: gl.constexpr):
    # STAGED: another partition waits at the boundary and stages the activations into x_smem's two buffers
    # (x_ready / x_empty); else this one does, into its one buffer.
    # SKIP (diagnostics; the output is then wrong): 1 no MMA (the ring's stream alone), 2 no phase barrier
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    rn0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    i = 0
    for p in range(num_phases):
        if STAGED:
            mbarrier.wait(x_ready.index(p % 2), (p // 2) & 1)
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
            for kb in gl.static_range(K // BLOCK_K):  # static: a shared-memory slice starts at a constant
                s = i % STAGES
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                if SKIP != 1:
                    acc0, acc1, acc2, acc3 = _multiply_box(ring.index(s), xb.slice(kb * BLOCK_K, BLOCK_K, dim=1),
                                                           acc0, acc1, acc2, acc3, a_layout, b_layout, BLOCK_K,
                                                           CHAINS)
                fence_async_shared()  # the slot's reads are ordered before the next TMA write into it
                mbarrier.arrive(empty.index(s), count=1)
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
def _stager(y_ptr, cnt_ptr, x_smem, x_ready, x_empty, num_phases, M, stride_y, slot, K: gl.constexpr,
            BLOCK_M: gl.constexpr, SKIP: gl.constexpr, WARPS: gl.constexpr, CHUNKS: gl.constexpr):
    # the default partition when STAGED: at each boundary, wait for every CTA, then stage the next phase's
    # activations into the buffer the consumer freed two phases ago
    programs = gl.num_programs(0)
    for p in range(num_phases):
        mbarrier.wait(x_empty.index(p % 2), ((p // 2) & 1) ^ 1)
        if p > 0 and SKIP != 2:
            _wait_for_phase(cnt_ptr + p - 1, programs)
        _stage_activations(y_ptr + p * slot, x_smem.index(p % 2), M, stride_y, K, BLOCK_M, WARPS, CHUNKS)
        mbarrier.arrive(x_ready.index(p % 2), count=1)


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
                    SPLIT: gl.constexpr, CHUNKS: gl.constexpr, num_warps: gl.constexpr):
    # SPLIT 0: the default partition (num_warps = 4) waits, stages and multiplies, every warp the whole 16-row
    # tile (the MMA layout replicates it); 1: a 1-warp worker does all three (no replicated shared-memory
    # reads), the default partition idles (a warp-specialized kernel's num_warps is a multiple of 4); 2: a
    # 1-warp worker multiplies, the default partition waits and stages (two activation buffers)
    NBUF: gl.constexpr = 2 if SPLIT == 2 else 1
    ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_M, K], x_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for b in gl.static_range(2):
        mbarrier.init(x_ready.index(b), count=1)
        mbarrier.init(x_empty.index(b), count=1)
    if SPLIT == 0:
        gl.warp_specialize([
            (_consumer, (y_ptr, cnt_ptr, cols_ptr, ring, ready, empty, x_smem, x_ready, x_empty, num_phases, M,
                         stride_y, slot, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CHAINS, SKIP, num_warps, False)),
            (_weight_loader, (w_desc, ring, ready, empty, cols_ptr, w_row_ptr, num_phases, K, BLOCK_N, BLOCK_K,
                              STAGES)),
        ], [1], [40])
    elif SPLIT == 1:
        gl.warp_specialize([
            (_idle, (num_phases,)),
            (_consumer_worker, (y_ptr, cnt_ptr, cols_ptr, ring, ready, empty, x_smem, x_ready, x_empty, num_phases,
                                M, stride_y, slot, w_desc, w_row_ptr, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CHAINS,
                                SKIP, False)),
            (_loader_worker, (y_ptr, cnt_ptr, cols_ptr, ring, ready, empty, x_smem, x_ready, x_empty, num_phases,
                              M, stride_y, slot, w_desc, w_row_ptr, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CHAINS,
                              SKIP, False)),
        ], [1, 1], [192, 40])
    else:
        gl.warp_specialize([
            (_stager, (y_ptr, cnt_ptr, x_smem, x_ready, x_empty, num_phases, M, stride_y, slot, K, BLOCK_M, SKIP,
                       num_warps, CHUNKS)),
            (_consumer_worker, (y_ptr, cnt_ptr, cols_ptr, ring, ready, empty, x_smem, x_ready, x_empty, num_phases,
                                M, stride_y, slot, w_desc, w_row_ptr, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CHAINS,
                                SKIP, True)),
            (_loader_worker, (y_ptr, cnt_ptr, cols_ptr, ring, ready, empty, x_smem, x_ready, x_empty, num_phases,
                              M, stride_y, slot, w_desc, w_row_ptr, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CHAINS,
                              SKIP, True)),
        ], [1, 1], [192, 40])


def layouts(block_m: int) -> tuple[gl.NVMMASharedLayout, gl.NVMMASharedLayout]:
    """The weight boxes' layout (the TMA descriptor's) and the staged activations'."""
    return (gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K_WS], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([block_m, K], gl.bfloat16))


def ws_block_m(rows: int) -> int:
    if rows > 16:
        raise ValueError(f"rows must be <= 16 (the activations are staged in shared memory), got {rows}")
    return 8 if rows <= 8 else 16


def run_ws(chain: Chain, stages: int, sms: int, chains: int = 4, skip: int = 0, split: int = 0,
           chunks: int = 0) -> None:
    """The chain as one warp-specialized launch of `sms` CTAs (chain.y's slots as phase_probe.py uses them)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    block_m = ws_block_m(chain.rows)
    w_layout, x_layout = layouts(block_m)
    desc = TensorDescriptor.from_tensor(chain.w, [BLOCK_N, BLOCK_K_WS], w_layout)
    chain.cnt.zero_()
    ws_chain_kernel[(sms,)](desc, chain.y, chain.cnt, chain.cols_t, chain.w_rows, len(chain.cols), chain.rows,
                            chain.width, chain.y.stride(0), x_layout=x_layout, K=K, BLOCK_M=block_m,
                            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K_WS, STAGES=stages, CHAINS=chains, SKIP=skip,
                            SPLIT=split, CHUNKS=chunks, num_warps=4)


def compile_for_sm90(stages: int = 20, block_m: int = 8, chains: int = 4, skip: int = 0, split: int = 0,
                     chunks: int = 0) -> dict:
    """Compile the kernel for sm90 without a GPU (Triton builds the PTX, ptxas the cubin); returns its
    shared memory, registers and the PTX's count of TMA loads and mma.sync instructions."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    w_layout, x_layout = layouts(block_m)
    signature = dict(w_desc=f"tensordesc<bf16[{BLOCK_N}, {BLOCK_K_WS}],{w_layout!r}>", y_ptr="*bf16",
                     cnt_ptr="*i32", cols_ptr="*i32", w_row_ptr="*i64", num_phases="i32", M="i32", stride_y="i32",
                     slot="i32")
    constexprs = dict(x_layout=x_layout, K=K, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K_WS, STAGES=stages,
                      CHAINS=chains, SKIP=skip, SPLIT=split, CHUNKS=chunks,
                      num_warps=4)
    signature.update({name: "constexpr" for name in constexprs})
    compiled = triton.compile(GluonASTSource(ws_chain_kernel, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx = compiled.asm["ptx"]
    return dict(shared=compiled.metadata.shared, tma_loads=ptx.count("cp.async.bulk.tensor"),
                mma=ptx.count("mma.sync"), cubin_bytes=len(compiled.asm["cubin"]))


def first_call_or_exit(fn, what: str, seconds: float = 60.0) -> None:
    """Run fn once (compiling it) and wait for the GPU with a deadline: a kernel that waits at a barrier
    nobody reaches would hold the device call until its time limit, so the process ends itself instead."""
    fn()
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + seconds
    while not done.query():
        if time.monotonic() > deadline:
            print(f"{what}: not finished after {seconds:.0f} s (a hang); exiting", flush=True)
            os._exit(3)
        time.sleep(0.01)


def parse_ways(text: str) -> list[tuple[int, ...]]:
    """"12:4:0:2,12:4:0:2:1" -> [(stages, chains, skip, split, chunks), ...] (ws_chain_kernel's constexprs;
    chunks 0 when left out)."""
    ways = []
    for item in text.split(","):
        values = [int(v) for v in item.split(":")]
        stages, chains, skip, split, chunks = values + [0] * (5 - len(values))
        if (len(values) not in (4, 5) or chains not in (1, 4) or skip not in (0, 1, 2) or not 2 <= stages <= 24
                or split not in (0, 1, 2) or chunks not in (0, 1, 2, 4, 8)):
            raise ValueError(f"--ways item {item!r}: stages:chains:skip:split[:chunks] with stages 2..24, chains 1 "
                             "or 4, skip 0, 1 or 2, split 0, 1 or 2, chunks 0, 1, 2, 4 or 8")
        ways.append((stages, chains, skip, split, chunks))
    return ways


def probe(rows: int, layers: int, sms: int, variants: list[tuple[int, ...]]) -> dict:
    chain = Chain(rows, phase_columns(sms, layers), "cuda")
    ref = chain.reference()
    floor_ms = chain.w.numel() * 2 / (COPY_TBPS * 1e9)
    ways = {"kernels": lambda: chain.run_kernels(pdl=True)}
    for v in variants:
        st, ch, sk, sp, cu = v
        name = f"ws_s{st}_c{ch}_split{sp}" + (f"_chunks{cu}" if cu else "") + ("", "_nomma", "_nobarrier")[sk]
        ways[name] = lambda v=v: run_ws(chain, v[0], sms, *v[1:])
    result = dict(rows=rows, layers=layers, block_n=BLOCK_N, phases=len(chain.cols), floor_ms=floor_ms, ways={},
                  skipped={})
    for name, fn in list(ways.items()):
        chain.y[1:].zero_()
        try:
            first_call_or_exit(fn, f"rows={rows} {name}")
        except triton.runtime.errors.OutOfResources as exc:  # e.g. too many ring slots beside 16 rows' buffers
            result["skipped"][name] = str(exc)
            del ways[name]
            print(f"rows={rows} {name}: skipped, {exc}", flush=True)
            continue
        print(f"rows={rows} {name}: first call done, rel err {rel_err(chain.output(), ref):.1e}", flush=True)
    measure(chain, ways, ref, floor_ms, result)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--rows", default="8,16")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--ways", default="12:4:0:0,12:4:0:1,12:4:0:2",
                    help="stages:chains:skip:split[:chunks],... (ring slots of 8 KB weight boxes; 1 or 4 MMA "
                         "chains; skip 1: no MMA, 2: no phase barrier, diagnostics whose output is wrong; split: "
                         "ws_chain_kernel's SPLIT; chunks: the staging's column chunks)")
    ap.add_argument("--compile", action="store_true", help="CPU: compile for sm90 and print what it built")
    args = ap.parse_args(argv)
    if args.compile:
        for st, ch, sk, sp, cu in parse_ways(args.ways):
            for block_m in (8, 16):
                print(dict(stages=st, chains=ch, skip=sk, split=sp, chunks=cu, block_m=block_m,
                           **compile_for_sm90(st, block_m, ch, sk, sp, cu)), flush=True)
        return 0
    if not args.out:
        ap.error("--out is required to measure")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = dict(device=torch.cuda.get_device_name(0), sms=sms, torch=torch.__version__, probes=[])
    for rows in (int(r) for r in args.rows.split(",")):
        results["probes"].append(probe(rows, args.layers, sms, parse_ways(args.ways)))
        (out / "phase_probe_ws.json").write_text(json.dumps(results, indent=1))
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
