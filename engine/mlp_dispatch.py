"""Where the decode step's MLP runs as one warp-specialized Gluon launch (engine/gluon_mlp.py; Triton-free, so the
rule is tested without a GPU), the per-device switch (mlp_fold_on, mlp_folds) and the launch's counters.

The launch replaces the add + norm after attention, gate_up + SiLU and down_proj's split-K partials for calls of
up to MLP_ROWS rows. Its grid is one CTA per SM, and its waits for other CTAs' gate_up tiles need all of them
resident at once: so one CTA's shared memory (the rows and the weight ring) must fit, and the rule reads
only host ints that are fixed per CUDA graph bucket. OUROBATCH_DECODE_FOLD_MLP: 0 (off, the default) or 1. It is a
measured alternative, not the default: in the full-depth decode step at N = 8 it measured from 0.03 ms slower to
0.06 ms faster than the three kernels (docs/benchmarks.md, session 17), inside the runs' spread.
"""

from __future__ import annotations

import os

import torch

from . import pdl
from .attention_dispatch import HOPPER_SMEM_PER_CTA  # noqa: F401 - the rule's bound (its tests read it here)

MLP_BLOCK_N, MLP_BLOCK_K, MLP_ROWS = 16, 256, 8  # tile columns (the MMA's M), weight box / chunk K, rows
MLP_STAGES = 8  # weight-ring slots of 16 x 256 (benchmarks/mlp_probe.py: 8 faster than 12, 12 than 16)
MLP_WARPS = 8  # the stager's warps (the add + norm on every row: 8 warps 3 us faster than 4 per layer)
MLP_GROUP_CHUNKS = 8  # SiLU x up's chunks staged together, once their gate_up tiles are written (a counter each)
MLP_MAX_GROUPS = 8  # counters the model keeps (OuroForCausalLM.mlp_barrier: 2 for the grid barrier, then these)
MLP_MAX_HIDDEN = 2048  # the stager holds every row's hidden values in registers (8 x 2048 over 128 threads)
FOLD_ENV = "OUROBATCH_DECODE_FOLD_MLP"


def chunk_split(intermediate: int) -> tuple[int, int]:
    """SiLU x up's rows are staged in MLP_BLOCK_K-column chunks held by two shared buffers whose chunk counts are
    powers of two (Gluon's shapes): the largest power of two within the chunks, then the rest rounded up (>= 1)."""
    chunks = max(1, intermediate // MLP_BLOCK_K)
    first = 1 << (chunks.bit_length() - 1)
    rest = max(1, chunks - first)
    return first, 1 << (rest - 1).bit_length()


def mlp_smem(hidden: int, intermediate: int, stages: int = MLP_STAGES, elem_bytes: int = 2) -> int:
    """Shared memory of one CTA: the normed rows, SiLU x up's chunks, the weight ring and the mbarriers."""
    a, b = chunk_split(intermediate)
    b = b if intermediate // MLP_BLOCK_K > a else 0  # a second buffer nothing indexes is compiled away
    return (MLP_ROWS * (hidden + (a + b) * MLP_BLOCK_K) + stages * MLP_BLOCK_N * MLP_BLOCK_K) * elem_bytes + 8 * (
        2 * stages + 1 + a + b)


def mlp_fold_applies(rows: int, hidden: int, intermediate: int, stages: int = MLP_STAGES, elem_bytes: int = 2) -> bool:
    """Whether a call of `rows` rows can run its MLP in the one launch: 1..MLP_ROWS rows; hidden a power of two
    from MLP_BLOCK_K to MLP_MAX_HIDDEN; the intermediate width a whole number of chunks, in at most MLP_MAX_GROUPS
    groups; one CTA's shared memory within the sm90 limit."""
    return (1 <= rows <= MLP_ROWS and MLP_BLOCK_K <= hidden <= MLP_MAX_HIDDEN and hidden & (hidden - 1) == 0
            and intermediate % MLP_BLOCK_K == 0 and intermediate <= MLP_MAX_GROUPS * MLP_GROUP_CHUNKS * MLP_BLOCK_K
            and mlp_smem(hidden, intermediate, stages, elem_bytes) <= HOPPER_SMEM_PER_CTA)


def new_counters(device: torch.device | str) -> torch.Tensor:
    """The launch's counters on `device`, zeroed: the grid barrier's arrival count and generation (one generation
    per launch), then one count of written gate_up tiles per chunk group. Kept across launches (graphs capture
    their address): the tile counts only grow, a launch waiting for (generation + 1) x the group's tiles."""
    return torch.zeros(2 + MLP_MAX_GROUPS, dtype=torch.int32, device=device)


def parse_fold_mlp(text: str) -> bool:
    """OUROBATCH_DECODE_FOLD_MLP: "0" (off, the default for an empty value) or "1"."""
    value = text.strip() or "0"
    if value not in ("0", "1"):
        raise ValueError(f"{FOLD_ENV} must be 0 (off) or 1 (on), got {text!r}")
    return value == "1"


_FOLD_MLP: dict[int, bool] = {}  # per device: OUROBATCH_DECODE_FOLD_MLP on, with Gluon on a Hopper GPU


def mlp_fold_on(device: torch.device) -> bool:
    """Whether `device` runs the decode step's MLP as one Gluon launch where mlp_fold_applies: a Hopper GPU with
    Gluon and OUROBATCH_DECODE_FOLD_MLP=1 (off by default; read once per device)."""
    if device.type != "cuda":
        return False
    index = pdl.device_index(device)
    if index not in _FOLD_MLP:
        _FOLD_MLP[index] = parse_fold_mlp(os.environ.get(FOLD_ENV, "")) and pdl.hopper(device) and (
            pdl.gluon_importable())
    return _FOLD_MLP[index]


def mlp_folds(h: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether the decode step's MLP over the rows h [rows, hidden] runs as one Gluon launch (gluon_mlp.py):
    mlp_fold_on, 16-bit weights in h's dtype that TMA can load, and mlp_fold_applies."""
    if h.shape[0] > MLP_ROWS or not mlp_fold_on(h.device):  # the rule's row bound, before any lookup
        return False
    rows, hidden = h.shape
    inter = w_down.shape[1]
    return (h.dtype in (torch.bfloat16, torch.float16) and h.is_contiguous()
            and w_gate_up.dtype == w_down.dtype == h.dtype and w_gate_up.shape == (2 * inter, hidden)
            and w_down.shape == (hidden, inter) and w_gate_up.is_contiguous() and w_down.is_contiguous()
            and w_gate_up.data_ptr() % 16 == 0 and w_down.data_ptr() % 16 == 0
            and mlp_fold_applies(rows, hidden, inter))
