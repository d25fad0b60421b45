"""When a decode loop pass runs as gluon_layers.py's one launch, and its sizes (Triton-free).

The launch serves calls of one new row per request, at most ROWS requests, on a Hopper GPU with Gluon, for models
whose shapes it tiles: no GQA, head_dim 128, KV pages of 16 positions, hidden and intermediate sizes multiples of
BLOCK_K, and no more (request, head) items or 16-column residual shares than SMs (every CTA resident at once,
one per SM). OUROBATCH_DECODE_LAYERS: "1" (default) or "0" (the per-kernel path: triton_gemm, the Gluon
decode attention and triton_fused).
"""

from __future__ import annotations

import os

from .attention_dispatch import HOPPER_SMEM_PER_CTA  # noqa: F401 - the rule's bound (its tests read it here)

BLOCK_N, BLOCK_K, ROWS = 16, 256, 8  # a tile's output columns, a weight box's K, the rows the MMA holds
PHASES = 5  # grid-wide counts per layer: qkv, attention, o, gate_up, down
TRACE_EVENTS = 32  # the measuring build's stamps a layer (gluon_layers_stage.stamp; benchmarks/layers_probe.py)
STAGES = 16  # ring slots of 8 KB (a weight box, or a page of keys and one of values)
HEAD_DIM, PAGE = 128, 16
MAX_SMS = 256  # the grid's CTAs (one per SM) whose row sums the stager adds up in one load
ENV = "OUROBATCH_DECODE_LAYERS"


def staged_chunks(hidden: int, inter: int) -> int:
    """The staging buffer's chunks of ROWS x BLOCK_K: a norm's residual and branch rows (hidden each) and its two
    norm weights (one row of BLOCK_K per chunk of them), or the intermediate rows."""
    nc = hidden // BLOCK_K
    return max(2 * nc + -(-2 * nc // ROWS), inter // BLOCK_K)


def smem_bytes(hidden: int, inter: int, elem: int = 2) -> int:
    """Shared memory of one CTA, an upper bound: the ring, the staging buffer, and 4 KB for the barriers, the row
    scales and the compiler's scratch (2.5 KB at Ouro-1.4B's shape: tests/engine/test_gluon_layers_compile.py)."""
    return STAGES * BLOCK_N * BLOCK_K * elem + staged_chunks(hidden, inter) * ROWS * BLOCK_K * elem + 4096


def shape_fits(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, page: int, num_sms: int) -> bool:
    """Whether the launch tiles this model shape on a GPU of num_sms SMs (at ROWS requests)."""
    return (heads == kv_heads and head_dim == HEAD_DIM and page == PAGE and heads * head_dim == hidden
            and hidden % BLOCK_K == 0 and inter % BLOCK_K == 0
            and ROWS * heads <= num_sms <= MAX_SMS and hidden <= BLOCK_N * num_sms
            and smem_bytes(hidden, inter) <= HOPPER_SMEM_PER_CTA)


def parse_flag(text: str, env: str, default: str) -> bool:
    """A launch's on / off variable `env`: "1" or "0", `default` for an empty value; anything else refused."""
    value = text.strip() or default
    if value not in ("0", "1"):
        raise ValueError(f"{env} must be 1 (on) or 0 (off), got {text!r}")
    return value == "1"


def parse_switch(text: str) -> bool:
    """OUROBATCH_DECODE_LAYERS: "1" (on, the default for an empty value) or "0"."""
    return parse_flag(text, ENV, "1")


def switch_on() -> bool:
    return parse_switch(os.environ.get(ENV, ""))


def call_fits(rows: int, max_rows: int, prefill: bool, has_tiles: bool) -> bool:
    """Whether a call's rows are the launch's: decode, one row per request, at most ROWS of them."""
    return 1 <= rows <= ROWS and max_rows == 1 and not prefill and not has_tiles
