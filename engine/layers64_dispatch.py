"""When a decode loop pass of more than 8 requests runs gluon_layers64.py's launches between its attention calls,
and their sizes (Triton-free).

The launches serve calls of one new row per request, 9..ROWS requests, where the loop-pass launch's stacked weights
exist (layer_stack.py: a Hopper GPU with Gluon, OUROBATCH_DECODE_LAYERS on) and the model's shapes tile: head_dim
128, no GQA, hidden and intermediate sizes multiples of K_RANGE, and the SMs a multiple of both K splits (every CTA
stages K_RANGE columns of a phase's rows; 132 SMs at Ouro-1.4B's 2048 / 5632: 4 and 11 splits). The decode
attention between them is whichever kernel the engine dispatches the call to (layers64.py).
OUROBATCH_DECODE_LAYERS64: "0" (off, the default: measured slower than the kernels on the H200, docs/benchmarks.md
session 27) or "1".
"""

from __future__ import annotations

import os

from .attention_dispatch import HOPPER_SMEM_PER_CTA
from .layers_dispatch import ROWS as LAUNCH_ROWS
from .layers_dispatch import parse_flag

ROWS, MIN_ROWS = 64, LAUNCH_ROWS + 1  # wgmma's M; up to LAUNCH_ROWS the loop-pass launch serves the call
K_RANGE, BOX_K, TILE_N = 512, 128, 64  # a CTA's K columns a phase; a box's K; a tile's columns
STAGES = 8  # the weight ring's slots of 16 KB
HEAD_DIM = 128  # a head's halves are two tiles (RoPE pairs them)
ENV = "OUROBATCH_DECODE_LAYERS64"


def splits(hidden: int, inter: int, k_range: int = K_RANGE) -> tuple[int, int]:
    """(S_IN, S_DOWN): the K splits of the phases of K = hidden (o, gate_up, qkv) and of down (K = inter)."""
    return hidden // k_range, inter // k_range


def smem_bytes(k_range: int = K_RANGE, stages: int = STAGES) -> int:
    """One CTA's shared memory, an upper bound: the ring, the staged K range and 4 KB for barriers and scratch
    (197,040 B at Ouro-1.4B's shape compiled: tests/test_gluon_layers64_emulated.py)."""
    return stages * TILE_N * BOX_K * 2 + ROWS * k_range * 2 + 4096


def shape_fits(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, num_sms: int,
               k_range: int = K_RANGE) -> bool:
    """Whether the launches tile this model shape on a GPU of num_sms SMs."""
    if head_dim != HEAD_DIM or heads * head_dim != hidden or heads != kv_heads:
        return False
    if hidden % k_range or inter % k_range or k_range % BOX_K:
        return False
    s_in, s_down = splits(hidden, inter, k_range)
    return num_sms % s_in == 0 and num_sms % s_down == 0 and smem_bytes(k_range) <= HOPPER_SMEM_PER_CTA


def parse_switch(text: str) -> bool:
    """OUROBATCH_DECODE_LAYERS64: "0" (off, the default for an empty value) or "1"."""
    return parse_flag(text, ENV, "0")


def switch_on() -> bool:
    return parse_switch(os.environ.get(ENV, ""))


def call_fits(rows: int, max_rows: int, prefill: bool, has_tiles: bool) -> bool:
    """Whether a call's rows are the launches': decode, one row per request, MIN_ROWS..ROWS of them."""
    return MIN_ROWS <= rows <= ROWS and max_rows == 1 and not prefill and not has_tiles
