"""Every Triton kernel specialization an engine can reach, compiled at startup (CUDA), in threads.

Theory of operation. Triton compiles a kernel once per *specialization*: its constexpr arguments (the
paged attention's BLOCK_M, BLOCK_N, SPLIT, ...; num_warps, num_stages) and the class of each int
argument (== 1, divisible by 16, other) and pointer (16-byte aligned or not). The graphed calls
(cuda_graphs.py) fix theirs per bucket (requests for the decode calls, tokens for the prefill's tiled
launches), which would otherwise compile one by one inside the startup's captures; the eager calls pick
theirs from host ints at run time: a prefill chunk after a history (the paged kernel, rows x chunks), verify's
deep call and a varlen deep call (requests x rows), the sampler's fast path (the row count's parity moves
a pointer's alignment), the skinny GEMMs (rows). So the first requests would compile what startup did not.

This module enumerates the host ints each call can be given by the engine's limits (max_num_seqs,
max_num_batched_tokens, max_model_len, deep_interval), maps each to its specialization key with the
same Triton-free rules the kernels dispatch by (attention_dispatch.choose_config / query_tiling,
gemm_dispatch.gemm_config), keeps one representative per key and launches it on scratch tensors
(nothing the engine reads is written). The shapes come from the config alone (``kernel_shapes``), so the
engine starts this before its weights load (ourobatch/warmup.py ``prefetch_kernels``) and runs it again,
as a check that costs only launches, once the executor exists. The launches run in threads: a compile spends much of its time
in LLVM and ptxas with the GIL released. One launch per kernel runs first on its own (Triton builds a
kernel's per-device cache on first use, which two threads would race to create).

The int classes of the paged kernel's arguments (split strides = rows x heads (x head_dim)) mirror
triton_attention.launch_paged_attention; tests/gpu/test_gpu_warmup.py checks on the GPU that a first
round of requests compiles nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from .attention import MAX_KERNEL_HISTORY_ROWS
from .attention_dispatch import LAUNCH_TABLE, LaunchConfig, choose_config, query_tiling
from .cuda_graphs import batch_buckets
from .gemm_dispatch import GEMM_TABLE, gemm_config
from .prefill_graph import PrefillLayout, prefill_buckets

NUM_THREADS = min(8, os.cpu_count() or 1)  # compile threads (benchmarks/cold_start.py --threads sets it)


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


def attention_key(s: KernelShapes, seqs: int, max_rows: int, rows: int, tiles: int = 0) -> tuple:
    """The specialization a paged-kernel call compiles (and the combine kernel's, when it splits); `tiles` > 0:
    a graphed prefill's launch over a tile map (TILED: its own kernel variant)."""
    config = case_config(s, AttentionCase(seqs, max_rows, rows, tiles))
    block_m, m_tiles = query_tiling(max_rows, s.group, s.head_dim, fp32=s.dtype == torch.float32)
    key: tuple = (config, block_m, int_class(m_tiles)) + (("tiled",) if tiles else ())
    if config.splits > 1:  # the partials' strides: rows x heads x head_dim and rows x heads
        key += (int_class(rows * s.num_heads * s.head_dim), int_class(rows * s.num_heads))
    return key


def case_config(s: KernelShapes, case: AttentionCase) -> LaunchConfig:
    """The launch config the kernel's dispatch picks for this call (triton_attention.default_config)."""
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
    # choose_config reads the tile only through LAUNCH_TABLE's max_tile bounds: one lookup per bound class
    bounds = sorted({row[1] for row in LAUNCH_TABLE})
    memo: dict[tuple[int, tuple[bool, ...]], tuple] = {}

    def base_key(seqs: int, max_rows: int) -> tuple:
        tile = max_rows * s.group
        cls = tuple(tile <= b for b in bounds)
        if (seqs, cls) not in memo:
            memo[seqs, cls] = attention_key(s, seqs, max_rows, 1)[:1]
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
    return list(found.values())


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


def launch_attention(s: KernelShapes, case: AttentionCase, device: torch.device) -> None:
    from .triton_attention import triton_paged_attention

    q = torch.zeros(case.rows, s.num_heads, s.head_dim, dtype=s.dtype, device=device)
    plane = torch.zeros(1, s.block_size, s.num_kv_heads, s.head_dim, dtype=s.dtype, device=device)  # block 0
    tables = torch.zeros(case.seqs, s.table_width, dtype=torch.int32, device=device)
    tiles = None
    if case.tiles:  # every tile names the last sequence, which has no rows (a bucket of padding only)
        lens = torch.zeros(case.seqs, dtype=torch.int32)
        tiles = torch.tensor([case.seqs - 1, 0] * case.tiles, dtype=torch.int32).view(-1, 2).to(device)
    else:
        lens = torch.tensor(_row_counts(case), dtype=torch.int32)
    starts = torch.zeros(case.seqs + 1, dtype=torch.int32)
    starts[1:] = lens.cumsum(0)
    triton_paged_attention(q, plane, plane, tables, lens.to(device), starts.to(device), case.max_rows,
                           s.head_dim ** -0.5, tiles)


# ---------------------------------------------------------------------------------------- the other kernels

def launch_fused(s: KernelShapes, device: torch.device) -> None:
    """triton_fused's four kernels (their ints are the model's shapes: one specialization each)."""
    from . import triton_fused as fused

    H, I, Hq, Hkv, d = s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads, s.head_dim
    zeros = dict(dtype=s.dtype, device=device)
    h, w = torch.zeros(1, H, **zeros), torch.ones(H, **zeros)
    fused.add_rms_norm2(h, torch.zeros(1, H, **zeros), w, w, s.eps)
    fused.rms_norm(h, w, s.eps)
    fused.silu_mul(torch.zeros(1, 2 * I, **zeros))
    plane = torch.zeros(s.block_size, Hkv, d, **zeros)  # pool.plane()'s layout: [slots, kv_heads, d]
    one = torch.zeros(1, dtype=torch.int64, device=device)
    inv_freq = torch.ones(d // 2, dtype=torch.float32, device=device)
    fused.rope_store_kv(torch.zeros(1, (Hq + 2 * Hkv) * d, **zeros), one, one, inv_freq, plane, plane, Hq, Hkv, d)


def launch_sampler(s: KernelShapes, device: torch.device) -> None:
    """The sampler's one-kernel path, at an odd and an even row count (a row view's alignment moves)."""
    from scheduler.params import SamplingParams

    from .sampler import sample

    for rows in (1, 2):
        logits = torch.zeros(rows, s.vocab_size, dtype=s.logits_dtype, device=device)
        params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(rows)]
        sample(logits, params, [1] * rows)


def gemm_rows(s: KernelShapes, table=None) -> list[int]:
    """One row count per distinct specialization of the skinny GEMMs (gemm_dispatch's table)."""
    table = GEMM_TABLE if table is None else table
    if not table or not s.triton_attention or s.dtype not in (torch.bfloat16, torch.float16):
        return []
    found: dict[tuple, int] = {}
    for rows in range(1, max(r for r, _ in table) + 1):
        cfg = gemm_config(rows, table)
        if cfg is not None:  # triton_gemm._block_m: 16 .. 64 rows per tile
            found.setdefault((cfg, min(64, max(16, 1 << (rows - 1).bit_length())), int_class(rows)), rows)
    return list(found.values())


def launch_gemm(s: KernelShapes, rows: int, weights: dict[str, torch.Tensor], device: torch.device) -> None:
    from . import triton_gemm

    cfg = gemm_config(rows)
    zeros = dict(dtype=s.dtype, device=device)
    h, w = torch.zeros(rows, s.hidden_size, **zeros), torch.ones(s.hidden_size, **zeros)
    for x, weight, splits in ((torch.zeros(rows, s.num_heads * s.head_dim, **zeros), weights["o"], cfg.splits_o),
                              (torch.zeros(rows, s.intermediate_size, **zeros), weights["down"], cfg.splits_down)):
        triton_gemm.add_rms_norm2_partials(h, triton_gemm.linear_partials(x, weight, splits, cfg), w, w, s.eps)
    triton_gemm.gate_up_silu(h, weights["gate_up"], cfg)


# ---------------------------------------------------------------------------------------- running them

@dataclass
class KernelReport:
    """What warm_kernels launched, how long it took and what failed (a failure only costs a compile later)."""

    cases: dict[str, int] = field(default_factory=dict)  # family -> launches
    seconds: float = 0.0  # wall time
    task_seconds: float = 0.0  # the launches' times summed (the sequential cost: / seconds = the speed-up)
    failures: list[str] = field(default_factory=list)


def _tasks(s: KernelShapes, device: torch.device) -> list[list[tuple[str, Callable[[], None]]]]:
    """The launches in stages, so that no two threads ever create the same kernel's per-device cache nor
    compile the same specialization: the first attention case alone (a split one: it runs the combine
    kernel too; Triton also builds its launcher utilities once), then one launch of every other kernel
    and of every further combine-kernel specialization, then the rest."""
    cases = attention_cases(s)

    def splits(c: AttentionCase) -> int:
        return case_config(s, c).splits

    def combine_key(c: AttentionCase) -> tuple | None:
        n = splits(c)
        return None if n == 1 else (n, int_class(c.rows * s.num_heads * s.head_dim), int_class(c.rows * s.num_heads))

    cases.sort(key=lambda c: -splits(c))
    attention = [("attention", lambda c=c: launch_attention(s, c, device)) for c in cases]
    first, second, rest = attention[:1], [], []
    seen = {combine_key(cases[0])} if cases else set()
    for c, task in zip(cases[1:], attention[1:]):
        key = combine_key(c)
        (rest if key in seen else second).append(task)
        seen.add(key)
    if s.triton_attention:
        second.append(("fused", lambda: launch_fused(s, device)))
    second.append(("sampler", lambda: launch_sampler(s, device)))
    rows = gemm_rows(s)
    if rows:
        zeros = dict(dtype=s.dtype, device=device)
        weights = {"o": torch.zeros(s.hidden_size, s.num_heads * s.head_dim, **zeros),
                   "down": torch.zeros(s.hidden_size, s.intermediate_size, **zeros),
                   "gate_up": torch.zeros(2 * s.intermediate_size, s.hidden_size, **zeros)}
        second.append(("gemm", lambda r=rows[0]: launch_gemm(s, r, weights, device)))
        rest += [("gemm", lambda r=r: launch_gemm(s, r, weights, device)) for r in rows[1:]]
    return [first, second, rest]


def _run(name: str, fn: Callable[[], None], device: torch.device) -> tuple[str, float, str | None]:
    t = time.perf_counter()
    try:  # (CPU tensors: Triton's interpreter, TRITON_INTERPRET=1, for tests)
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext(), torch.inference_mode():
            fn()
    except Exception as exc:  # noqa: BLE001 - the kernel compiles on first use instead; reported
        return name, time.perf_counter() - t, f"{name}: {type(exc).__name__}: {exc}"
    return name, time.perf_counter() - t, None


def warm_kernels(s: KernelShapes, device: torch.device, threads: int | None = None,
                 should_stop: Callable[[], bool] | None = None) -> KernelReport:
    """Launch one call of every specialization (CUDA only), `threads` at a time (default NUM_THREADS)."""
    report = KernelReport()
    started = time.perf_counter()
    stages = _tasks(s, device)
    with ThreadPoolExecutor(max_workers=max(1, threads or NUM_THREADS), thread_name_prefix="ourobatch-compile") as pool:
        for stage in stages:
            if should_stop is not None and should_stop():
                break
            for name, seconds, error in pool.map(lambda task: _run(*task, device), stage):
                report.cases[name] = report.cases.get(name, 0) + 1
                report.task_seconds += seconds
                if error is not None:
                    report.failures.append(error)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report.seconds = time.perf_counter() - started
    return report


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
        prefill_buckets=tuple(prefill_buckets(max_num_batched_tokens)) if cuda_graphs else ())
