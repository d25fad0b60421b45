"""The 64-row GEMMs with a pair of weight row blocks a tile (gate_up + SiLU, qkv + RoPE + store) as stream-K
launches: one program per SM, each over an equal share of the work (Triton, CUDA).

triton_gemm's kernels give each program a whole tile: gate_up at Ouro-1.4B's 5,632 intermediate columns in 64-column
tiles is 88 programs, so 44 of an H100's or H200's 132 SMs stream no weights; qkv's 192 tiles of a head's 2 x 16
dims are 1.45 programs an SM. Time against program count (session 30, benchmarks/gemm_scaling_probe.py) grows with
the bytes past ~44 programs: the weights arrive faster the more SMs ask for them. Here the (tile, K block) units,
tile-major, are cut into `programs` contiguous ranges of equal length (Stream-K, Osama et al. 2023), so every SM
streams the same share. A tile whose K blocks two or more programs share is summed by the program that holds its
last K block (its *owner*); the others (*producers*) leave the pair's float32 partial sums in a workspace row of
their own and raise their flag. The owner runs the one-tile kernel's epilogue (triton_gemm.silu_store or
rope_store) on the sums.

Each program walks its range backwards, from its last unit to its first, as one flat loop (the pipeliner keeps
loading across tile boundaries): the segment it meets first is the only one that can be a producer's (it ends
inside its tile), so producers write their partials at the start of their run, and the segment it meets last is
the only one that can be an owner's, so owners wait at the end of theirs, for programs of lower ids that wrote
theirs first. The wait spins on a flag until a compare-and-swap takes it from 1 back to 0, so the flags are zero
again when the launch ends (a graph replays the launch on the same flags: fused_pass gives the model's,
OuroForCausalLM.stream_flags; gate_up and qkv launches follow one another on one stream, never overlapping).

Deadlock freedom: an owner waits only for programs of lower id, which the hardware dispatches first, and a
producer's flag goes up before it waits for anything; the grid is at most one program per SM, and a PDL dependent
launches only once every program of this grid has passed its trigger, so no later kernel holds an SM that a
program here still needs. Results: fp32 sums in another order than the one-tile kernels', then the same bf16
rounding of the GEMM output (F.linear's) and the same epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .gemm_dispatch import GemmConfig, gate_block_k, gemm_block_m, qkv_block_d, qkv_stream_stages
from .triton_gemm import _box, _tma_args, rope_store, silu_store


@triton.jit
def _partial_ptrs(part_ptr, program, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The first half of a program's workspace row [2, BLOCK_M, BLOCK_N] (fp32: the pair's first block); the second
    half is BLOCK_M x BLOCK_N on."""
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
def _publish(acc_a, acc_b, part_ptr, flag_ptr, pid, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             ASM: tl.constexpr):
    """A producer's partials into its workspace row, then its flag up (release: the stores before it)."""
    p = _partial_ptrs(part_ptr, pid, BLOCK_M, BLOCK_N)
    tl.store(p, acc_a, cache_modifier=".cg")
    tl.store(p + BLOCK_M * BLOCK_N, acc_b, cache_modifier=".cg")
    _cta_sync(pid, ASM)  # every thread's stores before the one release below
    tl.atomic_xchg(flag_ptr + pid, 1, sem="release", scope="gpu")


@triton.jit
def _collect(acc_a, acc_b, part_ptr, flag_ptr, first, pid, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             ASM: tl.constexpr):
    """An owner adds the partials of programs first..pid-1, each once its flag is up (and takes the flag down).
    In the interpreter (not ASM) the programs run by id, so a flag not up is a missing producer: an assert, not a
    spin that never ends."""
    for q in range(first, pid):
        if ASM:
            while tl.atomic_cas(flag_ptr + q, 1, 0, sem="acquire", scope="gpu") != 1:
                pass
        else:
            tl.device_assert(tl.atomic_cas(flag_ptr + q, 1, 0) == 1, "stream-K: a producer's flag is not up")
        p = _partial_ptrs(part_ptr, q, BLOCK_M, BLOCK_N)
        acc_a += tl.load(p, cache_modifier=".cg")
        acc_b += tl.load(p + BLOCK_M * BLOCK_N, cache_modifier=".cg")
    return acc_a, acc_b


@triton.jit
def _pair_rows(tile, n_tiles, N, HALF: tl.constexpr, BLOCK_N: tl.constexpr, OP: tl.constexpr):
    """A tile's two weight row blocks and their rows (for pointer loads, masked past n_rows): gate and up rows
    ("gate"), or BLOCK_N dims of a head's first half and their RoPE partners ("qkv")."""
    if OP == "qkv":
        row0 = (tile // (HALF // BLOCK_N)) * 2 * HALF + (tile % (HALF // BLOCK_N)) * BLOCK_N
        rows = row0 + tl.arange(0, BLOCK_N)
        return row0, row0 + HALF, rows, rows + HALF, n_tiles * 2 * BLOCK_N
    else:
        rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # past N: masked, or a TMA gate box reading into the up rows
        return tile * BLOCK_N, N + tile * BLOCK_N, tl.where(rn < N, rn, 2 * N), tl.where(rn < N, N + rn, 2 * N), 2 * N


@triton.jit
def _finish(acc_a, acc_b, tile, rm, M, out_ptr, N, pos_ptr, slot_ptr, inv_freq_ptr, k_cache_ptr, v_cache_ptr,
            n_q_heads, n_kv_heads, stride_slot, stride_head, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
            OP: tl.constexpr):
    """A whole tile's epilogue: triton_gemm's, SiLU x up into out, or RoPE and the q / key / value stores."""
    if OP == "qkv":
        d = (tile % (HALF // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
        rope_store(acc_a, acc_b, tile // (HALF // BLOCK_N), d, rm, M, pos_ptr, slot_ptr, inv_freq_ptr, out_ptr,
                   k_cache_ptr, v_cache_ptr, n_q_heads, n_kv_heads, stride_slot, stride_head, HALF)
    else:
        silu_store(acc_a, acc_b, out_ptr, rm, tile * BLOCK_N + tl.arange(0, BLOCK_N), M, N)


@triton.jit(do_not_specialize=["M"])  # one compile for every row count
def _stream_k_kernel(x_ptr, w_ptr, out_ptr, part_ptr, flag_ptr, M, N, K, n_tiles, stride_xm, stride_wn,
                     pos_ptr, slot_ptr, inv_freq_ptr, k_cache_ptr, v_cache_ptr, n_q_heads, n_kv_heads, stride_slot,
                     stride_head, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, TMA: tl.constexpr, ASM: tl.constexpr, OP: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """OP "gate": gate_up + SiLU, out [M, N] (N intermediate columns, n_tiles = cdiv(N, BLOCK_N)); "qkv": qkv +
    RoPE + store, out = q, n_tiles = heads x HALF / BLOCK_N (the qkv arguments unused by "gate")."""
    if USE_PDL:  # engine/pdl.py: wait for the kernel before, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid, programs = tl.program_id(0), tl.num_programs(0)
    iters = tl.cdiv(K, BLOCK_K)
    total = n_tiles * iters
    start = pid * total // programs  # ranges of floor(total / programs) or one more units, none empty
    end = (pid + 1) * total // programs
    rm = tl.arange(0, BLOCK_M)
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the range's running sums, never reset: a segment's
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # are them less the sums when the segment before ended
    base_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (writes to the MMA accumulators between MMAs would
    base_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # make ptxas serialize them)
    top = (end - 1) % iters  # K block the current segment started at (walking down): iters - 1 unless a producer's
    for i in range(0, end - start):
        u = end - 1 - i
        tile, kb = u // iters, u % iters
        row_a, row_b, rows_a, rows_b, n_rows = _pair_rows(tile, n_tiles, N, HALF, BLOCK_N, OP)
        x = _box(x_ptr, 0, rm, M, stride_xm, kb * BLOCK_K, K, BLOCK_K, TMA == 2)
        acc_a = tl.dot(x, tl.trans(_box(w_ptr, row_a, rows_a, n_rows, stride_wn, kb * BLOCK_K, K, BLOCK_K, TMA > 0)),
                       acc_a)
        acc_b = tl.dot(x, tl.trans(_box(w_ptr, row_b, rows_b, n_rows, stride_wn, kb * BLOCK_K, K, BLOCK_K, TMA > 0)),
                       acc_b)
        if kb == 0 and u != start:  # a segment ends inside the range: the first met (maybe a producer) or a whole tile
            if top != iters - 1:
                _publish(acc_a - base_a, acc_b - base_b, part_ptr, flag_ptr, pid, BLOCK_M, BLOCK_N, ASM)
            else:
                _finish(acc_a - base_a, acc_b - base_b, tile, rm, M, out_ptr, N, pos_ptr, slot_ptr, inv_freq_ptr,
                        k_cache_ptr, v_cache_ptr, n_q_heads, n_kv_heads, stride_slot, stride_head, HALF, BLOCK_N, OP)
            base_a, base_b = acc_a, acc_b
            top = iters - 1
    acc_a, acc_b = acc_a - base_a, acc_b - base_b
    tile = start // iters  # the last segment met: a producer's (range inside one tile), an owner's, or a whole tile
    if top != iters - 1:
        _publish(acc_a, acc_b, part_ptr, flag_ptr, pid, BLOCK_M, BLOCK_N, ASM)
    else:
        if start % iters != 0:  # programs from the one holding the tile's first unit up to pid - 1 hold partials
            first = ((tile * iters + 1) * programs - 1) // total
            acc_a, acc_b = _collect(acc_a, acc_b, part_ptr, flag_ptr, first, pid, BLOCK_M, BLOCK_N, ASM)
        _finish(acc_a, acc_b, tile, rm, M, out_ptr, N, pos_ptr, slot_ptr, inv_freq_ptr, k_cache_ptr, v_cache_ptr,
                n_q_heads, n_kv_heads, stride_slot, stride_head, HALF, BLOCK_N, OP)


def stream_programs(tiles: int, k_blocks: int, num_sms: int) -> int:
    """The launch's program count: one per SM, never more than (tile, K block) units (no range is empty)."""
    return max(1, min(num_sms, tiles * k_blocks))


def gate_up_silu_stream(x: torch.Tensor, w_gate_up: torch.Tensor, cfg: GemmConfig, flags: torch.Tensor,
                        num_sms: int | None = None) -> torch.Tensor:
    """triton_gemm.gate_up_silu as a stream-K launch (rows <= 64: one row tile). flags: int32, zero, one per
    program (gemm_dispatch.new_stream_flags); left zero. num_sms: the program count's bound (default: the
    device's SMs)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    n = w_gate_up.shape[0] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    _launch("gate", x, w_gate_up, out, n, triton.cdiv(n, cfg.block_n_gate), cfg.block_n_gate, gate_block_k(cfg),
            cfg.num_stages, cfg, flags, num_sms, (out, out, out, out, out, 0, 0, 0, 0), 1)
    return out


def qkv_rope_store_stream(x: torch.Tensor, w_qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                          inv_freq: torch.Tensor, k_plane: torch.Tensor, v_plane: torch.Tensor, n_q_heads: int,
                          n_kv_heads: int, head_dim: int, cfg: GemmConfig, flags: torch.Tensor,
                          num_sms: int | None = None) -> torch.Tensor:
    """triton_gemm.qkv_rope_store as a stream-K launch (rows <= 64); flags and num_sms as gate_up_silu_stream's."""
    block_d = qkv_block_d(cfg, head_dim)
    if not block_d:
        raise ValueError(f"qkv_rope_store_stream: no tile for head_dim={head_dim} with block_d_qkv={cfg.block_d_qkv}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty(x.shape[0], n_q_heads, head_dim, dtype=x.dtype, device=x.device)
    half = head_dim // 2
    tiles = (n_q_heads + 2 * n_kv_heads) * (half // block_d)
    qkv = (positions, slots, inv_freq, k_plane, v_plane, n_q_heads, n_kv_heads, k_plane.stride(0), k_plane.stride(1))
    stages = qkv_stream_stages(cfg, block_d, gemm_block_m(x.shape[0]))
    _launch("qkv", x, w_qkv, q, 0, tiles, block_d, cfg.block_k_qkv, stages, cfg, flags, num_sms, qkv, half)
    return q


def _launch(op: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, n: int, tiles: int, block_n: int,
            block_k: int, stages: int, cfg: GemmConfig, flags: torch.Tensor, num_sms: int | None, qkv: tuple,
            half: int) -> None:
    """The stream-K kernel over `tiles` tiles of 2 x block_n weight rows: its program count, checks, workspace."""
    rows, K = x.shape
    bm = gemm_block_m(rows)
    if rows > bm:
        raise ValueError(f"stream-K {op}: at most {bm} rows (one row tile), got {rows}")
    if not rows:
        return
    sms = num_sms if num_sms is not None else pdl.num_sms(x.device)
    programs = stream_programs(tiles, triton.cdiv(K, block_k), sms)
    if flags.numel() < programs or flags.dtype != torch.int32:
        raise ValueError(f"stream-K {op}: flags must be int32 with at least {programs} entries, got {flags.numel()} "
                         f"of {flags.dtype}")
    part = torch.empty(programs, 2, bm, block_n, dtype=torch.float32, device=x.device)
    x_arg, w_arg, tma = _tma_args(x, w, bm, block_n, block_k, cfg)
    _stream_k_kernel[(programs,)](x_arg, w_arg, out, part, flags, rows, n, K, tiles, x.stride(0), w.stride(0), *qkv,
                                  HALF=half, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, TMA=tma,
                                  ASM=x.device.type == "cuda", OP=op, num_warps=cfg.num_warps, num_stages=stages,
                                  **pdl.launch_kwargs(x.device))
