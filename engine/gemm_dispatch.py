"""Which decode batches use the fused skinny GEMMs of triton_gemm.py, and with which tiles (Triton-free).

Picked from host ints only (the rows of a call, fixed per CUDA graph bucket), so a graph replays the
kernels it captured. The table is benchmarks/gemm_sweep.py's pick on the H200 per rows bucket; rows past
its last entry (or a shape the kernels were not tuned for) keep the cuBLAS path.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class GemmConfig:
    """Tiles of the fused GEMMs at one rows bucket."""

    block_n: int = 64  # output columns per program (o_proj, down_proj)
    block_k: int = 128
    splits_o: int = 4  # K splits of o_proj (K = heads x head_dim)
    splits_down: int = 4  # K splits of down_proj (K = intermediate)
    block_n_gate: int = 32  # intermediate columns per program of gate_up_silu
    block_k_gate: int = 0  # K per step of gate_up_silu (0: block_k, the split-K partials' own)
    # qkv_rope_store: dims of a head's first half per program (with their RoPE partners); 0: the qkv GEMM
    # stays cuBLAS + triton_fused.rope_store_kv (the table's 17-32 row bucket)
    block_d_qkv: int = 0
    block_k_qkv: int = 128  # K per step of qkv_rope_store (its own: 256 wins there at <= 16 rows, 128 in the others)
    num_warps: int = 4
    num_stages: int = 4
    stages_gate: int = 0  # gate_up_silu's pipeline depth (0: num_stages)
    # loads through Hopper's TMA (tensor descriptors; Triton pipelines the box loads with mbarriers) instead of
    # pointer loads (cp.async): 0 none, 1 the weights, 2 the weights and the activations; sm90+ only, else 0
    tma: int = 0
    # gate_up_silu / qkv_rope_store as stream-K launches (engine/triton_streamk.py): one program per SM over equal
    # shares of the (tile, K block) units instead of one program per tile; one row tile (<= 64 rows), CUDA only
    stream_gate: bool = False
    stream_qkv: bool = False
    # the stream-K qkv's pipeline depth (0: num_stages): its program holds a whole SM where the one-tile qkv's
    # two 96 KB programs share one, so it needs the deeper pipeline to keep as many bytes in flight (8: 200 KB)
    stages_qkv_stream: int = 8


# (largest rows, config), ascending: benchmarks/gemm_sweep.py on the H200 (docs/benchmarks/h200_gemm_sweep.json).
# Each op ran 1.08-1.15x faster than its cuBLAS path (GEMM + the elementwise kernel after it) up to 64 rows
# and 0.88-1.0x at 128, so calls past 64 rows keep cuBLAS. The fused qkv + RoPE + store (session 8's sweep,
# docs/benchmarks/h200_session8_2026-12-03/gemm_sweep_qkv.json) ran 9.3-9.5 us against 10.6-11.5 us for
# cuBLAS + rope_store_kv at 1-16 rows (block_d 32, block_k 256), lost at 32 (13.8 vs 12.0) and tied at 64
# (12.0 vs 11.9) on its own; but with PDL on (engine/pdl.py) the N = 64 graphed step ran 13.15 ms with it
# against 13.56 ms without (the whole layer chained, no cuBLAS launch), so it runs at 64 rows too. The
# 17-32 row bucket, not measured in a step, keeps cuBLAS. Session 9 (gemm_sweep --around-table): these tiles
# at warps 4 / 8 x stages 2-6 came within 1-2% of the best, so they stay; and loading each program's first
# weight blocks before the PDL wait measured no gain (N = 8 step 6.15 -> 6.19 ms with one, 6.11 -> 6.36 with
# two) and is gone. Session 12: TMA loads of weights and activations (`tma=2`) took the N = 64 graphed step from
# 13.21 / 13.28 to 12.90 / 13.15 ms (gate_up + SiLU 15.5 -> 14.7 us, qkv + RoPE + store 12.2 -> 11.4 us) and made
# the N = 8 one slower (6.22 / 6.31 -> 6.29 / 6.24 ms; qkv 9.6 -> 10.4 us), so only the 64-row bucket has them
# (docs/benchmarks/h200_session12_2026-12-04/). Session 38: gate_up + SiLU at 3 pipeline stages (stages_gate; alone
# 2.7% faster than 4 in session 30's sweep) ran the N = 64 step no faster on an H100, so it keeps num_stages.
GEMM_TABLE: tuple[tuple[int, GemmConfig], ...] = (
    (16, GemmConfig(block_n=32, block_k=128, splits_o=4, splits_down=4, block_n_gate=64, block_d_qkv=32,
                    block_k_qkv=256)),
    (32, GemmConfig(block_n=32, block_k=128, splits_o=4, splits_down=4, block_n_gate=64)),
    (64, GemmConfig(block_n=64, block_k=128, splits_o=4, splits_down=4, block_n_gate=64, block_d_qkv=16, tma=2)),
)


def gate_block_k(cfg: GemmConfig) -> int:
    """gate_up_silu's K per step: its own block_k_gate, else the config's block_k."""
    return cfg.block_k_gate or cfg.block_k


def gemm_block_m(rows: int) -> int:
    """Rows per tile of the fused GEMMs at `rows` rows: tl.dot needs 16 at least (padding rows are masked);
    past 64 rows the rows are tiled."""
    return min(64, max(16, 1 << (rows - 1).bit_length()))


def gemm_config(rows: int, table: tuple[tuple[int, GemmConfig], ...] | None = None) -> GemmConfig | None:
    """The fused GEMMs' tiles for a call of `rows` rows, or None: use cuBLAS (F.linear) for this call.
    OUROBATCH_STREAM_K sets stream_gate and stream_qkv, OUROBATCH_GATE_STAGES stages_gate, in every row of the table
    (measuring switches)."""
    for max_rows, cfg in GEMM_TABLE if table is None else table:
        if rows <= max_rows:
            stream, stages = stream_k_setting(), gate_stages_setting()
            if stages is not None:
                cfg = replace(cfg, stages_gate=stages)
            return cfg if stream is None else replace(cfg, stream_gate="gate" in stream, stream_qkv="qkv" in stream)
    return None


@functools.cache
def gate_stages_setting() -> int | None:
    """OUROBATCH_GATE_STAGES: gate_up_silu's pipeline depth (2-6) in every row of the table; unset: the table's."""
    value = os.environ.get("OUROBATCH_GATE_STAGES", "").strip()
    if not value:
        return None
    if value not in ("2", "3", "4", "5", "6"):
        raise ValueError(f"OUROBATCH_GATE_STAGES must be an integer from 2 to 6, got {value!r}")
    return int(value)


def gate_stages(cfg: GemmConfig) -> int:
    """gate_up_silu's pipeline depth: its own stages_gate, else the config's num_stages."""
    return cfg.stages_gate or cfg.num_stages


STREAM_K_OPS = ("gate", "qkv")


@functools.cache
def stream_k_setting() -> frozenset[str] | None:
    """OUROBATCH_STREAM_K: the ops launched stream-K ("gate", "qkv", "gate,qkv"; "none": neither), unset: the
    table's choice."""
    value = os.environ.get("OUROBATCH_STREAM_K", "").strip()
    if not value:
        return None
    ops = frozenset() if value == "none" else frozenset(v.strip() for v in value.split(","))
    if not ops <= set(STREAM_K_OPS):
        raise ValueError(f"OUROBATCH_STREAM_K must be 'none' or a comma list of {', '.join(STREAM_K_OPS)}, got "
                         f"{value!r}")
    return ops


def stream_k(cfg: GemmConfig | None, op: str, rows: int) -> bool:
    """Whether a call of `rows` rows runs `op` ("gate" or "qkv") as a stream-K launch (engine/triton_streamk.py): the
    config asks for it, and the rows are one row tile (gemm_block_m's most, 64)."""
    wanted = cfg is not None and (cfg.stream_gate if op == "gate" else cfg.stream_qkv)
    return wanted and rows <= gemm_block_m(rows)


def new_stream_flags(device: torch.device | str, count: int = 1024) -> torch.Tensor:
    """Zeroed flags for up to `count` stream-K programs (OuroForCausalLM.stream_flags: one set a model, since its
    launches follow one another on one stream; the warm-up's launches each get their own); each launch leaves them
    zero."""
    return torch.zeros(count, dtype=torch.int32, device=device)


STREAM_SMEM_BYTES = 212 * 1024  # the pipeline's share of an sm90 SM's 227 KB (the rest: the epilogue's scratch)


def qkv_stream_stages(cfg: GemmConfig, block_d: int, block_m: int) -> int:
    """The stream-K qkv's pipeline depth: stages_qkv_stream (0: num_stages), at most what fits the SM's shared
    memory at this tile (a stage: the pair's 2 x block_d weight rows and the block_m activation rows, K step wide,
    bf16), at least 2."""
    stage = (2 * block_d + block_m) * cfg.block_k_qkv * 2
    return max(2, min(cfg.stages_qkv_stream or cfg.num_stages, STREAM_SMEM_BYTES // stage))


def qkv_block_d(cfg: GemmConfig | None, head_dim: int) -> int:
    """triton_gemm.qkv_rope_store's dims per program for this head size, or 0: the qkv GEMM stays cuBLAS and
    RoPE + the K / V store its own kernel (off in the config, an odd head size, or a half under 16, which
    tl.dot cannot tile, or not split evenly by a power of two)."""
    if cfg is None or cfg.block_d_qkv <= 0 or head_dim % 2:
        return 0
    half = head_dim // 2
    block = min(cfg.block_d_qkv, half)
    return block if block >= 16 and block & (block - 1) == 0 and half % block == 0 else 0
