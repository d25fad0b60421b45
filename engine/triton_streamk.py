"""gate_up + SiLU x up as a stream-K launch: one program per SM, each over an equal share of the work (Triton, CUDA).

triton_gemm.gate_up_silu gives each program a whole 64-column tile: at Ouro-1.4B's 5,632 intermediate columns that
is 88 programs, and 44 of an H100's or H200's 132 SMs stream no weights. Time against program count (session 30,
benchmarks/gemm_scaling_probe.py) grows with the bytes past ~44 programs: the weights arrive faster the more SMs ask
for them. Here the (tile, K block) units, tile-major, are cut into `programs` contiguous ranges of equal length
(Stream-K, Osama et al. 2023), so every SM streams the same share. A tile whose K blocks two or three programs
share is summed by the program that holds its last K block (its *owner*); the others (*producers*) leave float32
partial sums of gate and up in a workspace row of their own and raise their flag.

Each program walks its range backwards, from its last unit to its first, as one flat loop (the pipeliner keeps
loading across tile boundaries): the segment it meets first is the only one that can be a producer's (it ends
inside its tile), so producers write their partials at the start of their run, and the segment it meets last is
the only one that can be an owner's, so owners wait at the end of theirs, for programs of lower ids that wrote
theirs first. The wait spins on a flag until a compare-and-swap takes it from 1 back to 0, so the flags are zero
again when the launch ends (a graph replays the launch on the same flags: fused_pass gives the model's).

Deadlock freedom: an owner waits only for programs of lower id, which the hardware dispatches first, and a
producer's flag goes up before it waits for anything; the grid is at most one program per SM, and a PDL dependent
launches only once every program of this grid has passed its trigger, so no later kernel holds an SM that a
program here still needs. Results: fp32 sums in another order than the one-tile kernel's, then the same bf16
rounding of gate and up (F.linear's) and the same SiLU x up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .gemm_dispatch import GemmConfig, gate_block_k, gemm_block_m
from .triton_gemm import _box, _tma_args


@triton.jit
def _silu_store(acc_g, acc_u, out_ptr, rm, rn, M, N):
    dtype = out_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)  # rounded as F.linear's output is, then silu_mul's math
    up = acc_u.to(dtype).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _partial_ptrs(part_ptr, program, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The gate half of a program's workspace row [2, BLOCK_M, BLOCK_N] (fp32); the up half is BLOCK_M x BLOCK_N on."""
    r = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    return part_ptr + program * (2 * BLOCK_M * BLOCK_N) + r  # < 2^31: at most a few hundred programs


@triton.jit
def _cta_sync(token, ASM: tl.constexpr):
    """bar.sync. On the GPU as an asm statement (ASM): tl.debug_barrier in the K loop stops Triton's pipeliner from
    pipelining it. In the interpreter (no asm) the barrier, which there is nothing to wait for."""
    if ASM:
        tl.inline_asm_elementwise("bar.sync 0;\n\tmov.u32 $0, $1;", "=r,r", [token], dtype=tl.int32, is_pure=False,
                                  pack=1)
    else:
        tl.debug_barrier()


@triton.jit
def _publish(acc_g, acc_u, part_ptr, flag_ptr, pid, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             ASM: tl.constexpr):
    """A producer's partials into its workspace row, then its flag up (release: the stores before it)."""
    p = _partial_ptrs(part_ptr, pid, BLOCK_M, BLOCK_N)
    tl.store(p, acc_g, cache_modifier=".cg")
    tl.store(p + BLOCK_M * BLOCK_N, acc_u, cache_modifier=".cg")
    _cta_sync(pid, ASM)  # every thread's stores before the one release below
    tl.atomic_xchg(flag_ptr + pid, 1, sem="release", scope="gpu")


@triton.jit
def _collect(acc_g, acc_u, part_ptr, flag_ptr, first, pid, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """An owner adds the partials of programs first..pid-1, each once its flag is up (and takes the flag down)."""
    for q in range(first, pid):
        while tl.atomic_cas(flag_ptr + q, 1, 0, sem="acquire", scope="gpu") != 1:
            pass
        p = _partial_ptrs(part_ptr, q, BLOCK_M, BLOCK_N)
        acc_g += tl.load(p, cache_modifier=".cg")
        acc_u += tl.load(p + BLOCK_M * BLOCK_N, cache_modifier=".cg")
    return acc_g, acc_u


@triton.jit(do_not_specialize=["M"])  # one compile for every row count
def _gate_up_silu_sk_kernel(x_ptr, w_ptr, out_ptr, part_ptr, flag_ptr, M, N, K, stride_xm, stride_wn,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
                            ASM: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # engine/pdl.py: wait for the kernel before, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid, programs = tl.program_id(0), tl.num_programs(0)
    iters = tl.cdiv(K, BLOCK_K)
    total = tl.cdiv(N, BLOCK_N) * iters
    start = pid * total // programs  # ranges of floor(total / programs) or one more units, none empty
    end = (pid + 1) * total // programs
    rm = tl.arange(0, BLOCK_M)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the range's running sums, never reset: a segment's
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # are them less the sums when the segment before ended
    base_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (writes to the MMA accumulators between MMAs would
    base_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # make ptxas serialize them)
    top = (end - 1) % iters  # K block the current segment started at (walking down): iters - 1 unless a producer's
    for i in range(0, end - start):
        u = end - 1 - i
        tile, kb = u // iters, u % iters
        rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        # gate rows rn, up rows N + rn (past N: masked pointer loads, or a TMA gate box reading into the up rows;
        # the store drops those columns)
        x = _box(x_ptr, 0, rm, M, stride_xm, kb * BLOCK_K, K, BLOCK_K, TMA == 2)
        wg = _box(w_ptr, tile * BLOCK_N, tl.where(rn < N, rn, 2 * N), 2 * N, stride_wn, kb * BLOCK_K, K, BLOCK_K,
                  TMA > 0)
        wu = _box(w_ptr, N + tile * BLOCK_N, tl.where(rn < N, N + rn, 2 * N), 2 * N, stride_wn, kb * BLOCK_K, K,
                  BLOCK_K, TMA > 0)
        acc_g = tl.dot(x, tl.trans(wg), acc_g)
        acc_u = tl.dot(x, tl.trans(wu), acc_u)
        if kb == 0 and u != start:  # a segment ends inside the range: the first met (maybe a producer) or a whole tile
            if top != iters - 1:
                _publish(acc_g - base_g, acc_u - base_u, part_ptr, flag_ptr, pid, BLOCK_M, BLOCK_N, ASM)
            else:
                _silu_store(acc_g - base_g, acc_u - base_u, out_ptr, rm, rn, M, N)
            base_g, base_u = acc_g, acc_u
            top = iters - 1
    acc_g, acc_u = acc_g - base_g, acc_u - base_u
    tile = start // iters  # the last segment met: a producer's (range inside one tile), an owner's, or a whole tile
    if top != iters - 1:
        _publish(acc_g, acc_u, part_ptr, flag_ptr, pid, BLOCK_M, BLOCK_N, ASM)
    else:
        if start % iters != 0:  # programs from the one holding the tile's first unit up to pid - 1 hold partials
            first = ((tile * iters + 1) * programs - 1) // total
            acc_g, acc_u = _collect(acc_g, acc_u, part_ptr, flag_ptr, first, pid, BLOCK_M, BLOCK_N)
        _silu_store(acc_g, acc_u, out_ptr, rm, tile * BLOCK_N + tl.arange(0, BLOCK_N), M, N)

def stream_programs(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> int:
    """The launch's program count: one per SM, never more than (tile, K block) units (no range is empty)."""
    return max(1, min(num_sms, triton.cdiv(n, block_n) * triton.cdiv(k, block_k)))


def new_flags(device: torch.device, count: int = 1024) -> torch.Tensor:
    """Zeroed flags for `count` programs (a model keeps one set: gate_up calls on one stream never overlap)."""
    return torch.zeros(count, dtype=torch.int32, device=device)


def gate_up_silu_stream(x: torch.Tensor, w_gate_up: torch.Tensor, cfg: GemmConfig, flags: torch.Tensor,
                        num_sms: int | None = None) -> torch.Tensor:
    """triton_gemm.gate_up_silu as a stream-K launch (rows <= 64: one row tile). flags: int32, zero, one per
    program (new_flags); left zero. num_sms: the program count's bound (default: the device's SMs)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, K = x.shape
    n = w_gate_up.shape[0] // 2
    bm = gemm_block_m(rows)
    if rows > bm:
        raise ValueError(f"gate_up_silu_stream: at most {bm} rows (one row tile), got {rows}")
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        block_k = gate_block_k(cfg)
        sms = num_sms if num_sms is not None else pdl.num_sms(x.device)
        programs = stream_programs(n, K, cfg.block_n_gate, block_k, sms)
        if flags.numel() < programs or flags.dtype != torch.int32:
            raise ValueError(f"gate_up_silu_stream: flags must be int32 with at least {programs} entries, got "
                             f"{flags.numel()} of {flags.dtype}")
        part = torch.empty(programs, 2, bm, cfg.block_n_gate, dtype=torch.float32, device=x.device)
        x_arg, w_arg, tma = _tma_args(x, w_gate_up, bm, cfg.block_n_gate, block_k, cfg)
        _gate_up_silu_sk_kernel[(programs,)](x_arg, w_arg, out, part, flags, rows, n, K, x.stride(0),
                                             w_gate_up.stride(0), BLOCK_M=bm, BLOCK_N=cfg.block_n_gate,
                                             BLOCK_K=block_k, TMA=tma, ASM=x.device.type == "cuda",
                                             num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages, **pdl.launch_kwargs(x.device))
    return out
