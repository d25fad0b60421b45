"""Launch configs of the paged attention kernel (triton_attention.py): the table and the rule that picks one.

Free of Triton so the rule can be tested, and benchmarks/attention_sweep.py can read it, without a GPU.

The rule reads only host ints that are fixed for one CUDA graph (graphs are captured per batch-size
bucket and rows per request), never a context length, so a captured launch stays valid:

    per_sm = seqs * kv_heads / SMs     (programs of the one-pass grid per SM)
    tile   = max_rows * GQA group      (query rows one program holds: new rows x query heads per kv head)

and takes the first LAUNCH_TABLE row with per_sm <= max_per_sm and tile <= max_tile. `splits` > 1 is
split-K (flash-decoding): every (request, kv head) gets `splits` programs, each over a contiguous,
BLOCK_N-aligned share of the keys, and a small kernel combines their partial results. It pays when
the one-pass grid cannot fill the GPU (few requests: per_sm below ~2); a split whose share is empty
(short contexts) only writes an empty partial. benchmarks/attention_sweep.py measures the candidates on
the GPU and prints rows in this table's format.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

INF = math.inf
MAX_SPLITS = 64


@dataclass(frozen=True)
class LaunchConfig:
    """One launch of the paged kernel."""

    block_n: int  # key positions per tile (a power of two, >= 16)
    num_warps: int
    num_stages: int  # software-pipelining stages of the key loop
    splits: int = 1  # 1: one pass writes the output; > 1: split-K partials + the combine kernel
    head_major: bool = False  # programs launch request by request (its kv heads together) instead of head by head
    meta_early: bool = False  # with PDL: the request's lengths and first key tile's block ids loaded before the wait

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"LaunchConfig.block_n must be a power of two >= 16, got {self.block_n}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"LaunchConfig.num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"LaunchConfig.num_stages must satisfy 1 <= num_stages <= 8, got {self.num_stages}")
        if not 1 <= self.splits <= MAX_SPLITS:
            raise ValueError(f"LaunchConfig.splits must satisfy 1 <= splits <= {MAX_SPLITS}, got {self.splits}")


# Most query rows one program holds; a larger tile runs as several programs (M tiles), each reading the
# keys its rows can see. Its float32 accumulator is BLOCK_M x head_dim, so the cap shrinks as d grows.
MAX_BLOCK_M = 64
MAX_BLOCK_M_SMALL_HEAD = 128  # head_dim <= 64
MAX_BLOCK_M_FP32 = 16  # float32 inputs (IEEE dot): 32 rows and up spill registers at sm_90

# (max_per_sm, max_tile, config): the first row that holds wins; the last row catches everything.
# Values for the H200 (132 SMs), Ouro-1.4B heads (16 q = 16 kv heads, d = 128): per_sm is 0.12 x requests.
# Measured by benchmarks/attention_sweep.py on the H200 (2026-11-30, docs/benchmarks.md): split-K reads
# the KV of 8 requests at 2.7 TB/s (L = 768) to 3.9 TB/s (L = 4096) where one pass managed 1.9-2.1, and
# 64 or more requests run one pass at 97-102% of the 4.3 TB/s copy bandwidth. Tiles past 16 rows keep
# the unmeasured defaults. 3 stages for split-K: with 2, Triton's pipeliner loads the next tile's
# block-table entries synchronously (two dependent memory round trips per tile). Sessions 29-30
# (benchmarks/decode_attention.py --triton-grid, kv_layout_probe.py; docs/benchmarks.md): one-row calls of 33-66
# requests read their keys 1.0-1.6% faster alone in one-warp programs of 16 keys, 4 stages (H200, N = 64, L = 640 /
# 768), and the N = 64 full-depth step ran 0.8-1.6% faster with them in eight of eight harness runs (H100); at 256
# requests they were 2-3% slower alone (H200), so that row keeps 32 keys and 2 warps. Session 31: that row's calls
# load their lengths and first block ids before the PDL wait (meta_early): the N = 64 step 0.06-0.5% faster in five
# of five harness runs, the N = 256 step (at n32/w2/s2) 0-0.3% slower in two (H100), so only this row has it.
LAUNCH_TABLE: tuple[tuple[float, float, LaunchConfig], ...] = (
    (0.25, 16, LaunchConfig(block_n=64, num_warps=2, num_stages=3, splits=16)),  # 1-2 requests
    (0.5, 16, LaunchConfig(block_n=64, num_warps=2, num_stages=3, splits=8)),  # 3-4
    (1.371, 16, LaunchConfig(block_n=64, num_warps=2, num_stages=3, splits=4)),  # 5-11
    (3.879, 16, LaunchConfig(block_n=64, num_warps=2, num_stages=3, splits=2)),  # 12-32
    (8.0, 1, LaunchConfig(block_n=16, num_warps=1, num_stages=4, splits=1, meta_early=True)),  # 33-66 one-row calls
    (INF, 16, LaunchConfig(block_n=32, num_warps=2, num_stages=2, splits=1)),
    (0.5, INF, LaunchConfig(block_n=64, num_warps=4, num_stages=3, splits=4)),  # big tiles: deep calls, GQA,
    (2.0, INF, LaunchConfig(block_n=64, num_warps=4, num_stages=3, splits=2)),  # prompt chunks after a history
    (INF, INF, LaunchConfig(block_n=64, num_warps=4, num_stages=3, splits=1)),
)


def choose_config(seqs: int, kv_heads: int, tile: int, head_dim: int, num_sms: int,
                  table: tuple[tuple[float, float, LaunchConfig], ...] = LAUNCH_TABLE) -> LaunchConfig:
    """The table's config for this launch (host ints only: graph-safe)."""
    per_sm = seqs * kv_heads / max(num_sms, 1)
    for max_per_sm, max_tile, config in table:
        if per_sm <= max_per_sm and tile <= max_tile:
            break
    else:
        raise ValueError(f"LAUNCH_TABLE has no row for per_sm={per_sm:.3g}, tile={tile}: end it with (inf, inf, ...)")
    if head_dim > 128 and config.block_n > 32:  # keep a K and a V tile per stage within shared memory
        config = replace(config, block_n=32)
    return config


@dataclass(frozen=True)
class DecodeConfig:
    """One launch of the Gluon decode kernel (gluon_attention.py)."""

    block_n: int = 32  # key positions per ring slot (a multiple of the page size)
    stages: int = 6  # ring slots
    splits: int = 1  # key shares per (request, kv head); > 1: float32 partials + the combine kernel
    early: bool = True  # with PDL, load the history's pages before the wait (False: a measuring control)
    ctas_per_sm: int = 0  # > 0: persistent, this many CTAs per SM walk the (request, kv head) pairs (no splits)

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"DecodeConfig.block_n must be a power of two >= 16, got {self.block_n}")
        if not 2 <= self.stages <= 16:
            raise ValueError(f"DecodeConfig.stages must satisfy 2 <= stages <= 16, got {self.stages}")
        if not 1 <= self.splits <= MAX_SPLITS:
            raise ValueError(f"DecodeConfig.splits must satisfy 1 <= splits <= {MAX_SPLITS}, got {self.splits}")
        if not 0 <= self.ctas_per_sm <= 4 or (self.ctas_per_sm and self.splits > 1):
            raise ValueError(f"DecodeConfig.ctas_per_sm must satisfy 0 <= ctas_per_sm <= 4, and splits must be 1 "
                             f"with it; got ctas_per_sm={self.ctas_per_sm}, splits={self.splits}")


MAX_DECODE_SPLITS = 16
# The Gluon kernel serves decode calls of up to this many (request, kv head) pairs per SM; past it the Triton
# kernel wins (H200, docs/benchmarks.md session 15: alone at L = 640, N = 8 (0.97 per SM) 12.2 vs 15.5 us,
# N = 16 (1.9) 24.2 vs 25.4, N = 64 88.9 vs 82.6; in the full-depth step N = 8 5.67-5.72 vs 5.83-5.84 ms,
# N = 16 6.93-7.00 vs 6.85-6.90, N = 64 13.2-13.4 vs 12.2).
DECODE_MAX_PER_SM = 1.0
# Past it, up to this many pairs per SM, persistent CTAs (one per SM, a 192 KB ring) walk the pairs; past it the
# Triton kernel (H200, session 15: alone at L = 640, N = 16 21.3 vs 25.3 us, N = 64 76.3 vs 81.0; but in the
# full-depth step, alternated, N = 16 6.68 / 6.67 vs 6.91 / 6.85 ms and N = 64 12.43 / 12.47 vs 12.39 / 12.38).
# Those alone times were back to back, where PDL hid the ring's last round behind the next call; with a break
# between calls the N = 64 ring is slower than the Triton kernel (H100, session 40: 116.0-116.4 vs 113.9-114.1 us,
# benchmarks/attention_in_pool.py), as the step says. The N <= 16 bound rests on the step times above.
DECODE_PERSIST_MAX_PER_SM = 2.0
PERSISTENT_RING = DecodeConfig(32, 12, ctas_per_sm=1)


def decode_config(seqs: int, kv_heads: int, num_sms: int, base: DecodeConfig = DecodeConfig(),
                  persistent: DecodeConfig | None = PERSISTENT_RING) -> DecodeConfig | None:
    """The Gluon decode kernel's launch for `seqs` one-row requests, or None where the Triton kernel serves
    them. Up to DECODE_MAX_PER_SM (request, kv head) pairs per SM, one CTA per pair (`base`'s ring), with key
    shares (splits, each written as a partial for the combine kernel) only where that would leave 3/4 of the
    SMs idle, then as many as fill them (H200, L = 640: one request in 8 shares 5.6 us, in 4 5.9, in 16 8.4;
    four requests in one share 9.0 us, in two 10.1); up to DECODE_PERSIST_MAX_PER_SM, `persistent`."""
    pairs = max(seqs * kv_heads, 1)
    if base.ctas_per_sm:  # a persistent ring (OUROBATCH_DECODE_RING=...pK) serves every count, unsplit
        return base
    if pairs > DECODE_MAX_PER_SM * num_sms:
        if persistent is not None and pairs <= DECODE_PERSIST_MAX_PER_SM * num_sms:
            return replace(persistent, early=base.early)
        return None
    splits = num_sms // pairs if 4 * pairs <= num_sms else 1
    return replace(base, splits=max(1, min(MAX_DECODE_SPLITS, splits)))


# o_proj and its add + norm folded into the decode kernel's tail (gluon_attention_o.py): output tiles of O_BLOCK_N
# columns, weight boxes of O_BLOCK_K, the attention rows staged for the MMA as an O_ROWS-row operand.
O_BLOCK_N, O_BLOCK_K, O_ROWS = 16, 256, 8
HOPPER_SMEM_PER_CTA = 232448  # bytes of shared memory one CTA may use on sm90 (H100 / H200)


@dataclass(frozen=True)
class FoldConfig:
    """What the decode kernel folds into its tail (gluon_attention_o.py), past o_proj itself."""

    norm: bool = False  # the add + norm + norm after o_proj too (a second pass of the grid barrier)
    stager: int = 0  # who copies the attention rows for the o warp: 0 the o warp itself, 1 the 4 attention warps

    def __post_init__(self) -> None:
        if self.stager not in (0, 1):
            raise ValueError(f"FoldConfig.stager must be 0 or 1, got {self.stager}")


def parse_fold(text: str) -> FoldConfig | None:
    """OUROBATCH_DECODE_FOLD_O: "0" (no fold), "1" (o_proj, the default), "2" (o_proj and its add + norm), with an
    optional ":cta" for the 4 attention warps copying the rows (e.g. "1:cta"); None for "0"."""
    level, _, stager = text.strip().partition(":")
    if level not in ("0", "1", "2") or stager not in ("", "warp", "cta"):
        raise ValueError(f"OUROBATCH_DECODE_FOLD_O must be 0, 1 or 2, optionally followed by :warp or :cta, "
                         f"got {text!r}")
    return None if level == "0" else FoldConfig(norm=level == "2", stager=int(stager == "cta"))


def o_fold_applies(config: DecodeConfig | None, seqs: int, rows: int, heads: int, head_dim: int, hidden: int,
                   num_sms: int, elem_bytes: int = 2) -> bool:
    """Whether the decode launch `config` of `seqs` requests (`rows` query rows) can fold o_proj (hidden x
    heads * head_dim) and the add + norm after it into its tail: one CTA per (request, head) and no key shares;
    no more CTAs than SMs (its grid barrier needs every CTA resident at once) and at least one per output tile
    and per row; at most O_ROWS rows; K a whole number of weight boxes; the ring, the weight tile and the staged
    rows within one CTA's shared memory."""
    if config is None or config.splits != 1 or config.ctas_per_sm or rows > O_ROWS or rows < 1:
        return False
    K, ctas = heads * head_dim, seqs * heads
    ring = 2 * config.stages * config.block_n * head_dim * elem_bytes
    smem = ring + (O_BLOCK_N + O_ROWS) * K * elem_bytes + 1024
    return (hidden % O_BLOCK_N == 0 and hidden >= 128 and K % O_BLOCK_K == 0
            and max(hidden // O_BLOCK_N, rows) <= ctas <= num_sms and smem <= HOPPER_SMEM_PER_CTA)


def parse_ring(text: str) -> DecodeConfig:
    """A ring shape "BLOCK_NxSTAGES" (OUROBATCH_DECODE_RING), e.g. "32x6"; "32x6p2": persistent, 2 CTAs per SM."""
    try:
        ring, p, per_sm = text.lower().partition("p")
        block_n, stages = (int(x) for x in ring.split("x"))
        ctas = int(per_sm) if p else 0
    except ValueError:
        raise ValueError(f"OUROBATCH_DECODE_RING must be BLOCK_NxSTAGES[pCTAS_PER_SM] (e.g. 32x6, 32x6p2), "
                         f"got {text!r}") from None
    return DecodeConfig(block_n, stages, ctas_per_sm=ctas)


def parse_launch(text: str) -> LaunchConfig | None:
    """A launch of the paged kernel as text (OUROBATCH_PAGED_DECODE; benchmarks/decode_attention.py's labels):
    "n32/w2/s2" with optional "/kSPLITS", then "/head" (head_major) and "/meta" (meta_early), e.g.
    "n16/w2/s3/k1/head", "n16/w1/s4/k1/meta"; None for "" or "0"."""
    text = text.strip().lower()
    if text in ("", "0"):
        return None
    parts = text.split("/")
    meta_early = parts[-1] == "meta"
    parts = parts[: len(parts) - meta_early]
    head_major = parts[-1] == "head"
    fields = {p[:1]: p[1:] for p in parts[: len(parts) - head_major]}
    if (len(fields) != len(parts) - head_major or not {"n", "w", "s"} <= set(fields) <= {"n", "w", "s", "k"}
            or not all(v.isdigit() for v in fields.values())):
        raise ValueError(f"a paged attention launch must read nBLOCK_N/wWARPS/sSTAGES[/kSPLITS][/head][/meta] (e.g. "
                         f"n32/w2/s2, n16/w2/s3/k1/head, n16/w1/s4/meta) or 0, got {text!r}")
    return LaunchConfig(int(fields["n"]), int(fields["w"]), int(fields["s"]), int(fields.get("k", 1)), head_major,
                        meta_early)


PAGED_DECODE_ENV = "OUROBATCH_PAGED_DECODE"  # the paged kernel's launch for one-row calls (a measuring knob)


@functools.cache
def paged_decode() -> LaunchConfig | None:
    """The launch OUROBATCH_PAGED_DECODE names (parse_launch), or None (unset or 0). Read once a process."""
    return parse_launch(os.environ.get(PAGED_DECODE_ENV, ""))


def launch_override(max_rows: int, tiled: bool) -> LaunchConfig | None:
    """The launch that replaces the table's for a call of `max_rows` rows per request: OUROBATCH_PAGED_DECODE's
    for one-row calls without a tile map, else None (the table's). triton_paged_attention and the warm-up's
    kernel_cases.case_config both ask here."""
    return paged_decode() if max_rows == 1 and not tiled else None


def launch_label(c: LaunchConfig) -> str:
    """parse_launch's text for `c`."""
    return (f"n{c.block_n}/w{c.num_warps}/s{c.num_stages}/k{c.splits}" + ("/head" if c.head_major else "")
            + ("/meta" if c.meta_early else ""))


def query_tiling(max_rows: int, group: int, head_dim: int, fp32: bool = False) -> tuple[int, int]:
    """(BLOCK_M, M tiles) for a request of max_rows new rows times `group` query heads per kv head."""
    tile = max(1, max_rows * group)
    cap = MAX_BLOCK_M_FP32 if fp32 else MAX_BLOCK_M_SMALL_HEAD if head_dim <= 64 else MAX_BLOCK_M
    block_m = min(max(16, 1 << (tile - 1).bit_length()), cap)  # tl.dot needs M >= 16
    return block_m, -(-tile // block_m)


def max_tiles(num_tokens: int, num_seqs: int, group: int, block_m: int) -> int:
    """Most M tiles `num_seqs` sequences of `num_tokens` new rows in all can need: each sequence's
    ceil(rows x group / block_m) is below rows x group / block_m + 1."""
    return -(-num_tokens * group // block_m) + num_seqs


def tile_map(num_rows: list[int], group: int, block_m: int, capacity: int, pad_seq: int) -> list[int]:
    """The paged kernel's tile map (its `tiles` argument), flattened: (sequence, M tile) for every M tile that
    holds rows of a sequence, then (pad_seq, 0) up to `capacity` tiles. pad_seq must name a sequence with
    no rows (its programs read and write nothing)."""
    flat: list[int] = []
    for seq, n in enumerate(num_rows):
        for m in range(-(-n * group // block_m)):
            flat += (seq, m)
    if len(flat) > 2 * capacity:
        raise ValueError(f"{len(flat) // 2} M tiles, more than the map's capacity of {capacity}")
    return flat + [pad_seq, 0] * (capacity - len(flat) // 2)


def given_out(q, out):
    """An attention launch's output: a new tensor of q's shape, or `out` (engine/layers64.py's TMA-read buffer)
    checked to be one: contiguous, q's shape and dtype."""
    if out is None:
        return q.new_empty(q.shape)
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {q.dtype} tensor of q's shape {tuple(q.shape)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    return out
