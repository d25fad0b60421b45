"""Which Triton kernel specializations an engine can reach: the startup's warm-up list (Triton-free).

Theory of operation. Triton compiles a kernel once per *specialization*: its constexpr arguments (the
paged attention's BLOCK_M, BLOCK_N, SPLIT, ...; num_warps, num_stages) and the class of each int
argument (== 1, divisible by 16, other) and pointer (16-byte aligned or not). The graphed calls
(cuda_graphs.py) fix theirs per bucket (requests for the decode calls, tokens for the prefill's tiled
launches), which would otherwise compile one by one inside the startup's captures; the eager calls pick
theirs from host ints at run time: a prefill chunk after a history (the paged kernel, rows x chunks),
verify's deep call and a varlen deep call (requests x rows), the sampler's fast path (the row count's
parity moves a pointer's alignment), the skinny GEMMs (rows). So the first requests would compile what
startup did not.

This module enumerates the host ints each call can be given by the engine's limits (max_num_seqs,
max_num_batched_tokens, max_model_len, deep_interval) and maps each to its specialization with the same
rules the kernels dispatch by (attention_dispatch.choose_config / query_tiling, gemm_dispatch.gemm_config),
keeping one representative call per specialization (``attention_key``: the paged kernel's and the
combine kernel's, as Triton keys them, so that no specialization is compiled twice). The shapes come from
the config alone (``kernel_shapes``), so the engine lists them before its weights load. The int classes
of the paged kernel's arguments (split strides = rows x heads (x head_dim)) mirror
triton_attention.launch_paged_attention. engine/kernel_warmup.py launches the list.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import MAX_KERNEL_HISTORY_ROWS
from .attention_dispatch import LAUNCH_TABLE, LaunchConfig, choose_config, launch_override, query_tiling
from .cuda_graphs import batch_buckets
from . import gemm_dispatch
from .gemm_dispatch import (gate_block_k, gate_stages, gemm_block_m, gemm_config, qkv_block_d, qkv_stream_stages,
                            stream_k)
from .mlp_dispatch import MLP_ROWS
from .prefill_graph import PrefillLayout, prefill_buckets


@dataclass(frozen=True)
class KernelShapes:
    """What decides the kernels' specializations: the model's shapes and the engine's limits."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    eps: float
    dtype: torch.dtype  # the model's
    logits_dtype: torch.dtype  # the lm_head's output (head_dtype, else the model's)
    block_size: int
    table_width: int  # block-table entries per request (max_model_len / block_size)
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    mode: str
    deep_interval: int
    num_sms: int
    buckets: tuple[int, ...] | None  # the graphed calls' batch sizes (None: decode calls run eagerly)
    triton_attention: bool  # the paged kernel and the fused elementwise kernels run (attention_backend triton)
    prefill_buckets: tuple[int, ...] = ()  # the graphed prefill's token buckets (prefill_graph; () without graphs)
    num_layers: int = 0  # the layer stack's depth (the loop-pass launch's layer count; 0: unknown, no such launch)

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def int_class(value: int) -> str:
    """How Triton specializes an int argument: '1' (== 1), '16' (divisible by 16) or '' (neither)."""
    return "1" if value == 1 else "16" if value % 16 == 0 else ""


# ---------------------------------------------------------------------------------------- the paged kernel

@dataclass(frozen=True)
class AttentionCase:
    seqs: int  # requests in the call
    max_rows: int  # new rows of the longest
    rows: int  # new rows of all of them (max_rows + seqs - 1 <= rows <= seqs * max_rows)
    tiles: int = 0  # > 0: a graphed prefill's launch, walking a tile map of this many entries (seqs: chunks + 1)


@dataclass(frozen=True)
class _Family:
    """Calls of one kind: requests in `seqs`, rows per request up to `max_rows`, total rows in [lo, hi]."""

    seqs: range
    max_rows: range
    exact: bool  # every request has max_rows rows (uniform calls: graphed or eager decode)
    max_total: int | None = None  # a prefill call's rows are at most the token budget


def _families(s: KernelShapes) -> list[_Family]:
    B, all_seqs = s.deep_interval, range(1, s.max_num_seqs + 1)
    decode = [1] + ([B] if s.mode == "deferred" and B > 1 else [])
    fams = []
    for R in decode:  # shallow (1 row) and deferred deep calls (R <= B rows: B, or fewer at a forced boundary)
        rows = range(1, R + 1) if R > 1 else range(1, 2)
        if s.buckets is None:
            fams.append(_Family(all_seqs, rows, True))
        else:
            fams += [_Family(range(b, b + 1), rows, True) for b in s.buckets]
    history_rows = min(MAX_KERNEL_HISTORY_ROWS, s.max_num_batched_tokens, s.max_model_len - s.block_size)
    if history_rows >= 1:  # prefill chunks after shared or cached blocks (attention.attend, paged kernel)
        fams.append(_Family(range(1, min(s.max_num_seqs, s.max_num_batched_tokens) + 1),
                            range(1, history_rows + 1), False, s.max_num_batched_tokens))
    if B > 1 and s.mode in ("verify", "deferred"):  # verify's deep call (drafts + 1 row), varlen deep calls
        fams.append(_Family(all_seqs, range(1, B + 2 if s.mode == "verify" else B + 1), False))
    return fams


def attention_key(s: KernelShapes, seqs: int, max_rows: int, rows: int, tiles: int = 0) -> tuple[tuple, tuple | None]:
    """What a paged-kernel call compiles, as Triton keys it: (the paged kernel's specialization, the combine
    kernel's or None). The split count reaches the paged kernel only as SPLIT (> 1) and its grid, the
    combine kernel as an int argument and its power of two; `tiles` > 0: a graphed prefill's tiled launch."""
    config = case_config(s, AttentionCase(seqs, max_rows, rows, tiles))
    block_m, m_tiles = query_tiling(max_rows, s.group, s.head_dim, fp32=s.dtype == torch.float32)
    split = config.splits > 1
    strides = (int_class(rows * s.num_heads * s.head_dim), int_class(rows * s.num_heads)) if split else ()
    # a tiled launch passes m_tiles as 1 (its programs walk the tile map instead): one specialization for all
    paged = (config.block_n, config.num_warps, config.num_stages, split, block_m, int_class(1 if tiles else m_tiles),
             tiles > 0, config.head_major and not tiles, config.meta_early)
    combine = (int_class(config.splits), 1 << (config.splits - 1).bit_length()) + strides if split else None
    return paged + strides, combine


def mlp_keys(s: KernelShapes, folds_of) -> dict[tuple, tuple[int, int]]:
    """The MLP launch's specializations (engine/gluon_mlp.py), each with a (rows, o_proj's split count) call that
    compiles it, for the calls of up to MLP_ROWS rows that `folds_of(rows)` sends there: o_proj's partials come in
    one split from the decode kernel that folds o_proj, else in gemm_config(rows).splits_o. Triton keys its rows
    and split count by int class; the shapes and dtype are the engine's."""
    found: dict[tuple, tuple[int, int]] = {}
    for rows in range(1, MLP_ROWS + 1):
        cfg = gemm_config(rows)
        if cfg is None or not folds_of(rows):
            continue
        for splits in (1, cfg.splits_o):
            found.setdefault(("gluon_mlp", int_class(rows), int_class(splits)), (rows, splits))
    return found


def layers_keys(s: KernelShapes, runs: bool) -> dict[tuple, tuple[int, int]]:
    """The loop-pass launch's specializations (engine/gluon_layers.py), where `runs`: each with (rows, layers) that
    compile it. Its rows are not specialized (one kernel for 1-8 requests); Triton keys the layer count by int
    class, and a launch of that many layers compiles what the engine's does (the strides and page rows are
    multiples of 16 in both)."""
    if not runs or s.num_layers < 1:
        return {}
    layers = s.num_layers if s.num_layers == 1 else (16 if s.num_layers % 16 == 0 else 2)
    return {("gluon_layers", int_class(s.num_layers)): (1, layers)}


def decode_keys(s: KernelShapes, config_of, fold_of=None) -> dict[tuple, int]:
    """The Gluon decode kernel's specializations (engine/gluon_attention.py), each with a request count that
    compiles it: the calls of one new row per request (rows = requests) that `config_of(seqs)` (the device's
    triton_attention.decode_launch: a DecodeConfig, or None) sends there. A key holds the ring (BLOCK_N,
    STAGES), persistent or not, split or not; split launches key their partials' strides (rows x heads
    (x head_dim)) like the paged kernel's. Where `fold_of(seqs, config)` holds, the engine's decode calls fold
    o_proj into the kernel (gluon_attention_o.py): a "gluon_o" key too, by ring and its rows' int class (calls
    that do not fold, such as one-row prompt chunks, keep the plain kernel's)."""
    if (not s.triton_attention or s.group != 1 or s.dtype not in (torch.bfloat16, torch.float16)
            or s.head_dim not in (64, 128, 256)):  # gluon_attention.supports
        return {}
    seqs_all = set(s.buckets) if s.buckets is not None else set(range(1, s.max_num_seqs + 1))
    history = min(MAX_KERNEL_HISTORY_ROWS, s.max_num_batched_tokens, s.max_model_len - s.block_size)
    if history >= 1:  # one-row prefill chunks after a history
        seqs_all |= set(range(1, min(s.max_num_seqs, s.max_num_batched_tokens) + 1))
    found: dict[tuple, int] = {}
    for seqs in sorted(seqs_all):
        c = config_of(seqs)
        if c is None:
            continue
        if fold_of is not None and fold_of(seqs, c):
            found.setdefault(("gluon_o", c.block_n, c.stages, int_class(seqs)), seqs)
        split = c.splits > 1
        key = ("gluon", c.block_n, c.stages, c.ctas_per_sm > 0, split) + (
            (int_class(seqs * s.num_heads * s.head_dim), int_class(seqs * s.num_heads)) if split else ())
        found.setdefault(key, seqs)
    return found


def case_config(s: KernelShapes, case: AttentionCase) -> LaunchConfig:
    """The launch config the kernel's dispatch picks for this call (triton_attention.triton_paged_attention)."""
    override = launch_override(case.max_rows, case.tiles > 0)
    if override is not None:
        return override
    tile = case.max_rows * s.group
    if case.tiles:  # each (tile, kv head) program counts as one sequence of one M tile
        block_m, _ = query_tiling(case.max_rows, s.group, s.head_dim, fp32=s.dtype == torch.float32)
        return choose_config(case.tiles, s.num_kv_heads, min(tile, block_m), s.head_dim, s.num_sms)
    return choose_config(case.seqs, s.num_kv_heads, tile, s.head_dim, s.num_sms)


def prefill_cases(s: KernelShapes) -> list[AttentionCase]:
    """One tiled launch per distinct specialization among the graphed prefill's buckets: a bucket of t
    tokens calls the kernel on t rows (max_rows t) of its layout's chunks + 1 sequences, over its tile map."""
    found: dict[tuple, AttentionCase] = {}
    for tokens in s.prefill_buckets:
        layout = PrefillLayout.for_bucket(tokens, s.max_num_seqs, s.group, s.head_dim, s.dtype == torch.float32)
        case = AttentionCase(layout.chunks + 1, tokens, tokens, layout.tiles)
        found.setdefault(attention_key(s, case.seqs, tokens, tokens, case.tiles), case)
    return list(found.values())


def attention_cases(s: KernelShapes) -> list[AttentionCase]:
    """One call per distinct specialization of every call the engine can make with the paged kernel: the
    eager and graphed decode-shaped calls, then the graphed prefill's tiled ones (prefill_cases)."""
    if not s.triton_attention:
        return []
    return _untiled_cases(s) + prefill_cases(s)


def _untiled_cases(s: KernelShapes) -> list[AttentionCase]:
    # choose_config reads the tile only through LAUNCH_TABLE's max_tile bounds: one lookup per bound class (and
    # one-row calls apart: OUROBATCH_PAGED_DECODE's launch may replace the table's for them)
    bounds = sorted({row[1] for row in LAUNCH_TABLE})
    memo: dict[tuple[int, tuple[bool, ...]], tuple] = {}

    def base_key(seqs: int, max_rows: int) -> tuple:
        tile = max_rows * s.group
        cls = (max_rows == 1,) + tuple(tile <= b for b in bounds)
        if (seqs, cls) not in memo:
            memo[seqs, cls] = (case_config(s, AttentionCase(seqs, max_rows, 1)),)
        block_m, m_tiles = query_tiling(max_rows, s.group, s.head_dim, fp32=s.dtype == torch.float32)
        return memo[seqs, cls] + (block_m, int_class(m_tiles))

    def split_class(rows: int) -> tuple[str, str]:  # the partials' strides: rows x heads (x head_dim)
        return int_class(rows * s.num_heads * s.head_dim), int_class(rows * s.num_heads)

    split_classes = {split_class(rows) for rows in range(1, 33)}
    found: dict[tuple, AttentionCase] = {}
    done: dict[tuple, set] = {}  # split base key -> the split classes found for it
    for fam in _families(s):
        seq_values = _seq_values(s, fam.seqs)
        for max_rows in fam.max_rows:
            for seqs in seq_values:
                base = base_key(seqs, max_rows)
                if base[0].splits == 1:  # the total rows do not matter
                    found.setdefault(base, AttentionCase(seqs, max_rows, seqs * max_rows if fam.exact
                                                         else max_rows + seqs - 1))
                    continue
                if len(done.setdefault(base, set())) == len(split_classes):
                    continue
                lo = seqs * max_rows if fam.exact else max_rows + seqs - 1
                hi = seqs * max_rows if fam.max_total is None else min(seqs * max_rows, fam.max_total)
                for rows in range(lo, min(hi, lo + 15) + 1):  # the split classes repeat with rows mod 16
                    cls = split_class(rows)
                    if cls not in done[base]:
                        done[base].add(cls)
                        found[base + cls] = AttentionCase(seqs, max_rows, rows)
    unique: dict[tuple, AttentionCase] = {}  # the candidates above, one per specialization Triton compiles
    for case in found.values():
        unique.setdefault(attention_key(s, case.seqs, case.max_rows, case.rows), case)
    return list(unique.values())


def _seq_values(s: KernelShapes, seqs: range) -> list[int]:
    """The request counts worth trying: every one up to the last that can split (the split strides depend
    on the rows), then only those around a LAUNCH_TABLE bound (the config is constant between them)."""
    per_seq = s.num_kv_heads / max(s.num_sms, 1)
    limits = [m / per_seq for m, _, cfg in LAUNCH_TABLE if cfg.splits > 1]
    split_limit = max(limits, default=0.0)
    edges = {int(m / per_seq) + d for m, _, _ in LAUNCH_TABLE if m != float("inf") for d in (-1, 0, 1, 2)}
    return [n for n in seqs if n <= split_limit + 2 or n in edges or n in (seqs.start, seqs.stop - 1)]


def _row_counts(case: AttentionCase) -> list[int]:
    """Rows per request: the first has max_rows, the others share the rest (each 1..max_rows)."""
    counts, rest = [case.max_rows], case.rows - case.max_rows
    for left in range(case.seqs - 2, -1, -1):
        c = min(case.max_rows, rest - left)
        counts.append(c)
        rest -= c
    assert rest == 0 and min(counts) >= 1, case
    return counts


def gemm_rows(s: KernelShapes, table=None) -> list[int]:
    """One row count per distinct specialization of the skinny GEMMs (gemm_dispatch's table): per config and tile
    height (their row counts are not specialized)."""
    table = gemm_dispatch.GEMM_TABLE if table is None else table  # read now: tests swap the table
    if not table or not s.triton_attention or s.dtype not in (torch.bfloat16, torch.float16):
        return []
    found: dict[tuple, int] = {}
    for rows in range(1, max(r for r, _ in table) + 1):
        cfg = gemm_config(rows, table)
        if cfg is not None:
            found.setdefault((cfg, gemm_block_m(rows)), rows)
    return list(found.values())


def gemm_keys(rows: int, table=None, head_dim: int = 0) -> set[tuple]:
    """What the skinny GEMMs compile for a call of `rows` rows, as Triton keys it: the split-K partials and
    gate_up + SiLU (one-tile or stream-K launch) per tile height and tiles, the add + norm over partials per split
    count (its SPLITS constexpr), and (where the config turns it on for `head_dim`) qkv + RoPE + store (one-tile or
    stream-K) per tile height and tiles. Their row counts are not specialized (engine/triton_gemm.py). Each key's
    first item names the kernel; no key for a call cuBLAS runs."""
    cfg = gemm_config(rows, table)
    if cfg is None:
        return set()
    bm, rest = gemm_block_m(rows), (cfg.num_warps, cfg.num_stages, cfg.tma)
    gate = "gate_up_stream" if stream_k(cfg, "gate", rows) else "gate_up"  # triton_streamk's kernel, or triton_gemm's
    gate_rest = rest if gate == "gate_up_stream" else (cfg.num_warps, gate_stages(cfg), cfg.tma)
    keys = ({("partials", bm, cfg.block_n, cfg.block_k) + rest,
             (gate, bm, cfg.block_n_gate, gate_block_k(cfg)) + gate_rest}
            | {("norm_partials", n) for n in (cfg.splits_o, cfg.splits_down)})
    block_d = qkv_block_d(cfg, head_dim)
    if block_d:
        stream = stream_k(cfg, "qkv", rows)
        stages = qkv_stream_stages(cfg, block_d, bm) if stream else cfg.num_stages
        keys.add(("qkv_stream" if stream else "qkv", bm, block_d, cfg.block_k_qkv, cfg.num_warps, stages, cfg.tma))
    return keys


def shapes_of(executor, max_num_batched_tokens: int, max_model_len: int, mode: str, deep_interval: int,
              num_sms: int | None = None) -> KernelShapes:
    """The KernelShapes of a built executor (its model, pool, block tables and graph buckets)."""
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(executor.device).multi_processor_count
    return kernel_shapes(executor.model.config, executor.dtype, executor.head_dtype, block_size=executor.block_size,
                         table_width=executor.tables.width, max_num_seqs=executor.max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, mode=mode,
                         deep_interval=deep_interval, attention=executor.attention,
                         cuda_graphs=executor.graphs is not None, num_sms=num_sms)


def kernel_shapes(cfg, dtype: torch.dtype, head_dtype: torch.dtype | None, *, block_size: int, table_width: int,
                  max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, mode: str, deep_interval: int,
                  attention: str, cuda_graphs: bool, num_sms: int) -> KernelShapes:
    """The KernelShapes of an engine of this model config (OuroConfig), limits, resolved attention backend and
    graph setting: shapes_of (a built executor) and the startup's prefetch (before any weight) build them here."""
    return KernelShapes(
        num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
        eps=cfg.rms_norm_eps, dtype=dtype, logits_dtype=head_dtype or dtype, block_size=block_size,
        table_width=table_width, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, mode=mode, deep_interval=deep_interval, num_sms=num_sms,
        buckets=tuple(batch_buckets(max_num_seqs)) if cuda_graphs else None, triton_attention=attention == "triton",
        prefill_buckets=tuple(prefill_buckets(max_num_batched_tokens)) if cuda_graphs else (),
        num_layers=cfg.num_hidden_layers)

