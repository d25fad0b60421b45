"""Every Triton kernel specialization an engine can reach (engine/kernel_cases.py), compiled at startup
(CUDA) by one launch each on scratch tensors (nothing the engine reads is written), in threads.

Theory of operation. A compile holds the GIL for much of its time, so threads alone reached ~4x (30 s of
compiles in 6.5-8.5 s on the H200), and fresh worker processes lost 4-6 s each to their own start-up
(docs/benchmarks.md, session 6). So each launch's compiles run in forked child processes (engine/fork_compile.py;
a fork starts in ~10 ms), and engine/warmup_pass.py runs the launches listed here: the slowest kernels' first,
then all the others at once, and fork_compile compiles each kernel once across threads. Without fork
(``OUROBATCH_FORK_COMPILE=0``, or a Triton without AsyncCompileMode) 8 threads compile themselves, in stages
(warmup_order.staged): the first launch of each specialization (two threads would both compile it) and of each
kernel (it builds the kernel's per-device cache, which two threads would race to create) ends before any other
launch of it starts, and the very first launch runs alone (Triton builds its launcher utilities once). The
engine starts this before its weights load (ourobatch/warmup.py ``prefetch_kernels``) and runs it again, as a
check that costs only launches, once the executor exists; tests/gpu/test_gpu_warmup.py checks on the GPU that the
graph captures and a first round of requests compile nothing, nor a second process.
"""

from __future__ import annotations

import importlib
import threading
from typing import Callable

import torch

from . import layer_stack, warmup_pass
from .kernel_cases import (AttentionCase, KernelShapes, _row_counts, attention_cases, attention_key, case_config,
                           decode_keys, gemm_keys, gemm_rows, layers_keys, mlp_keys)
from .gemm_dispatch import gemm_config, new_stream_flags
from .warmup_order import SLOWEST, KernelReport, Task, longest_first, staged  # noqa: F401 - read here by tests

_layers = lambda: importlib.import_module(".gluon_layers", __package__)  # noqa: E731 - Gluon, imported lazily


def launch_attention(s: KernelShapes, case: AttentionCase, device: torch.device) -> None:
    """The paged kernel's launch for `case` (its dispatch's config; the Gluon decode kernel's: launch_decode)."""
    from .triton_attention import launch_paged_attention

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
    launch_paged_attention(q, plane, plane, tables, lens.to(device), starts.to(device), case.max_rows,
                           s.head_dim ** -0.5, case_config(s, case), tiles)


def launch_decode(s: KernelShapes, seqs: int, device: torch.device) -> None:
    """The Gluon decode kernel for `seqs` one-row requests at position 0 (decode_launch's ring and splits)."""
    from .gluon_attention import launch_decode_attention, supports
    from .triton_attention import decode_launch

    config = decode_launch(seqs, s.num_kv_heads, device)
    q = torch.zeros(seqs, s.num_heads, s.head_dim, dtype=s.dtype, device=device)
    plane = torch.zeros(1, s.block_size, s.num_kv_heads, s.head_dim, dtype=s.dtype, device=device)  # block 0
    if config is None or not supports(q, plane, plane, 1, None, config):  # the engine's calls cannot reach it
        return
    tables = torch.zeros(seqs, s.table_width, dtype=torch.int32, device=device)
    lens = torch.ones(seqs, dtype=torch.int32, device=device)
    starts = torch.arange(seqs + 1, dtype=torch.int32, device=device)
    launch_decode_attention(q, plane, plane, tables, lens, starts, s.head_dim ** -0.5, config)


def folds_o(s: KernelShapes, seqs: int, config, device: torch.device) -> bool:
    """Whether the engine's decode calls of `seqs` requests run o_proj and its add + norm inside the Gluon decode
    kernel (fused_pass.attention_add_norm: the fused path's GEMMs, triton_attention.decode_attention_o's rule)."""
    from .attention_dispatch import o_fold_applies
    from .triton_attention import fold_config

    return (s.triton_attention and s.dtype in (torch.bfloat16, torch.float16) and gemm_config(seqs) is not None
            and fold_config(device) is not None
            and o_fold_applies(config, seqs, seqs, s.num_heads, s.head_dim, s.hidden_size, s.num_sms))


def launch_decode_o(s: KernelShapes, seqs: int, device: torch.device) -> None:
    """The decode kernel with o_proj and its add + norm folded in, for `seqs` requests of one row at position 0."""
    from .gluon_attention_o import launch_decode_attention_o
    from .triton_attention import decode_launch, fold_config

    config = decode_launch(seqs, s.num_kv_heads, device)
    q = torch.zeros(seqs, s.num_heads, s.head_dim, dtype=s.dtype, device=device)
    plane = torch.zeros(1, s.block_size, s.num_kv_heads, s.head_dim, dtype=s.dtype, device=device)  # block 0
    wo = torch.zeros(s.hidden_size, s.num_heads * s.head_dim, dtype=s.dtype, device=device)
    tables = torch.zeros(seqs, s.table_width, dtype=torch.int32, device=device)
    lens = torch.ones(seqs, dtype=torch.int32, device=device)
    starts = torch.arange(seqs + 1, dtype=torch.int32, device=device)
    barrier = torch.zeros(2, dtype=torch.int32, device=device)
    h, w = torch.zeros(seqs, s.hidden_size, dtype=s.dtype, device=device), torch.ones(s.hidden_size, dtype=s.dtype,
                                                                                         device=device)
    launch_decode_attention_o(q, plane, plane, tables, lens, starts, s.head_dim ** -0.5, config, wo, barrier, h, w, w,
                              s.eps, fold_config(device))


def folds_mlp(s: KernelShapes, rows: int, device: torch.device) -> bool:
    """Whether the engine's calls of `rows` rows run the MLP as one Gluon launch (fused_pass.attention_mlp: the fused
    path's GEMMs, mlp_dispatch.mlp_folds's rule)."""
    from .mlp_dispatch import mlp_fold_applies, mlp_fold_on

    return (s.triton_attention and s.dtype in (torch.bfloat16, torch.float16) and gemm_config(rows) is not None
            and mlp_fold_on(device) and mlp_fold_applies(rows, s.hidden_size, s.intermediate_size))


def launch_mlp(s: KernelShapes, rows: int, splits: int, weights: dict[str, torch.Tensor],
               device: torch.device) -> None:
    """The MLP launch (engine/gluon_mlp.py) for `rows` rows and o_proj's partials in `splits` splits, on zeros."""
    from .gluon_mlp import launch_mlp as launch
    from .mlp_dispatch import new_counters

    h = torch.zeros(rows, s.hidden_size, dtype=s.dtype, device=device)
    w = torch.ones(s.hidden_size, dtype=s.dtype, device=device)
    partials = torch.zeros(splits, rows, s.hidden_size, dtype=torch.float32, device=device)
    barrier = new_counters(device)  # its own: launches in other threads run at once
    launch(h, partials, w, w, weights["gate_up"], weights["down"], barrier, s.eps)


def launch_combine(s: KernelShapes, case: AttentionCase, device: torch.device) -> None:
    """The split launch's combine kernel alone, as `case`'s call would launch it (its split count and rows)."""
    from .attention_combine import combine_splits

    splits = case_config(s, case).splits
    part = torch.zeros(splits, case.rows, s.num_heads, s.head_dim, dtype=torch.float32, device=device)
    lse = torch.zeros(splits, case.rows, s.num_heads, dtype=torch.float32, device=device)
    combine_splits(part, lse, torch.empty(case.rows, s.num_heads, s.head_dim, dtype=s.dtype, device=device))


# ---------------------------------------------------------------------------------------- the other kernels

FUSED = ("add_rms_norm2", "rms_norm", "silu_mul", "rope_store_kv")  # triton_fused's kernels


def launch_fused(s: KernelShapes, which: str, device: torch.device) -> None:
    """One of triton_fused's kernels (their ints are the model's shapes: one specialization each)."""
    from . import triton_fused as fused

    H, I, Hq, Hkv, d = s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads, s.head_dim
    zeros = dict(dtype=s.dtype, device=device)
    h, w = torch.zeros(1, H, **zeros), torch.ones(H, **zeros)
    if which == "add_rms_norm2":
        fused.add_rms_norm2(h, torch.zeros(1, H, **zeros), w, w, s.eps)
    elif which == "rms_norm":
        fused.rms_norm(h, w, s.eps)
    elif which == "silu_mul":
        fused.silu_mul(torch.zeros(1, 2 * I, **zeros))
    else:
        plane = torch.zeros(s.block_size, Hkv, d, **zeros)  # pool.plane()'s layout: [slots, kv_heads, d]
        one = torch.zeros(1, dtype=torch.int64, device=device)
        inv_freq = torch.ones(d // 2, dtype=torch.float32, device=device)
        fused.rope_store_kv(torch.zeros(1, (Hq + 2 * Hkv) * d, **zeros), one, one, inv_freq, plane, plane, Hq, Hkv, d)


def launch_sampler(s: KernelShapes, rows: int, device: torch.device, filtered: bool = False) -> None:
    """The sampler's fast path (triton_sampler.py) at `rows` rows (an odd and an even count: a row view's
    alignment moves); `filtered`: rows with top-k, whose race runs the same kernels on float32 log-probs."""
    from scheduler.params import SamplingParams

    from .sampler import sample

    logits = torch.zeros(rows, s.vocab_size, dtype=s.logits_dtype, device=device)
    sample(logits, [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, top_k=5 if filtered else 0)
                    for i in range(rows)], [1] * rows)


def launch_gemm(s: KernelShapes, rows: int, key: tuple, weights: dict[str, torch.Tensor],
                device: torch.device) -> None:
    """The skinny-GEMM kernel of `key` (kernel_cases.gemm_keys) at `rows` rows: the split-K partials
    (o_proj's and down_proj's launches), the add + norm over key[1] partials, gate_up + SiLU (one-tile or
    stream-K), or qkv + RoPE + store (one-tile or stream-K)."""
    from . import triton_gemm

    cfg = gemm_config(rows)
    zeros = dict(dtype=s.dtype, device=device)
    if key[0] in ("qkv", "qkv_stream"):
        Hq, Hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        plane = torch.zeros(s.block_size, Hkv, d, **zeros)  # pool.plane()'s layout: [slots, kv_heads, d]
        index = torch.zeros(rows, dtype=torch.int64, device=device)  # positions and slots (slot 0)
        inv_freq = torch.ones(d // 2, dtype=torch.float32, device=device)
        args = (torch.zeros(rows, s.hidden_size, **zeros), weights["qkv"], index, index, inv_freq, plane, plane, Hq,
                Hkv, d, cfg)
        if key[0] == "qkv":
            triton_gemm.qkv_rope_store(*args)
        else:
            from . import triton_streamk

            triton_streamk.qkv_rope_store_stream(*args, new_stream_flags(device))
    elif key[0] == "partials":
        for x, weight, splits in ((torch.zeros(rows, s.num_heads * s.head_dim, **zeros), weights["o"], cfg.splits_o),
                                  (torch.zeros(rows, s.intermediate_size, **zeros), weights["down"], cfg.splits_down)):
            triton_gemm.linear_partials(x, weight, splits, cfg)
    elif key[0] == "norm_partials":
        h, w = torch.zeros(rows, s.hidden_size, **zeros), torch.ones(s.hidden_size, **zeros)
        partials = torch.zeros(key[1], rows, s.hidden_size, dtype=torch.float32, device=device)
        triton_gemm.add_rms_norm2_partials(h, partials, w, w, s.eps)
    elif key[0] == "gate_up_stream":
        from . import triton_streamk

        triton_streamk.gate_up_silu_stream(torch.zeros(rows, s.hidden_size, **zeros), weights["gate_up"], cfg,
                                           new_stream_flags(device))
    else:
        triton_gemm.gate_up_silu(torch.zeros(rows, s.hidden_size, **zeros), weights["gate_up"], cfg)


# ---------------------------------------------------------------------------------------- running them

def task_list(s: KernelShapes, device: torch.device) -> list[Task]:
    """Every launch, in a fixed order that depends only on `s`, each there for one specialization no earlier
    launch compiles (so the threads share the compiles evenly): an attention case only for a new paged-kernel
    key, a combine-only launch where only the combine kernel's key is new, each fused and GEMM kernel apart."""
    tasks, covered = [], set()
    for c in sorted(attention_cases(s), key=lambda c: -case_config(s, c).splits):  # a split one first
        paged, combine = attention_key(s, c.seqs, c.max_rows, c.rows, c.tiles)
        paged, combine = ("paged",) + paged, None if combine is None else ("combine",) + combine
        if paged not in covered:
            keys = (paged,) if combine is None else (paged, combine)  # all it compiles: _staged orders by them
            kernels = frozenset({"paged"} | ({"combine"} if combine is not None else set()))
            tasks.append(Task("attention", lambda c=c: launch_attention(s, c, device), kernels, keys))
        elif combine is not None and combine not in covered:
            tasks.append(Task("attention", lambda c=c: launch_combine(s, c, device), frozenset({"combine"}),
                              (combine,)))
        covered.update(k for k in (paged, combine) if k is not None)
    tasks += _decode_tasks(s, device)
    if s.triton_attention:
        tasks += [Task("fused", lambda k=k: launch_fused(s, k, device), frozenset({f"fused.{k}"}), (("fused", k),))
                  for k in FUSED]
    tasks += [Task("sampler", lambda r=r: launch_sampler(s, r, device), frozenset({"sampler"}), (("sampler", r),))
              for r in (1, 2)]
    tasks.append(Task("sampler", lambda: launch_sampler(s, 2, device, filtered=True), frozenset({"sampler"}),
                      (("sampler", "filtered"),)))
    return tasks + _gemm_tasks(s, device, covered)


def _decode_tasks(s: KernelShapes, device: torch.device) -> list[Task]:
    """The Gluon decode kernel's launches (CUDA), the o-folded one's where decode calls fold o_proj."""
    if device.type != "cuda":
        return []
    from .triton_attention import decode_launch

    tasks = []
    for key, seqs in decode_keys(s, lambda n: decode_launch(n, s.num_kv_heads, device),
                                 lambda n, c: folds_o(s, n, c, device)).items():
        if key[0] == "gluon_o":
            tasks.append(Task("attention", lambda n=seqs: launch_decode_o(s, n, device), frozenset({"gluon_o"}),
                              (key,)))
            continue
        kernels = frozenset({"gluon"} | ({"combine"} if key[4] else set()))
        tasks.append(Task("attention", lambda n=seqs: launch_decode(s, n, device), kernels, (key,)))
    return tasks


def _gemm_tasks(s: KernelShapes, device: torch.device, covered: set) -> list[Task]:
    """The skinny GEMMs' launches, each kernel apart, then the MLP launch's and the loop-pass launch's where they
    run (CUDA); the scratch weights are made by the first launch that needs them (launches run in threads)."""
    tasks, weights, made = [], {}, threading.Lock()
    shapes = {"qkv": ((s.num_heads + 2 * s.num_kv_heads) * s.head_dim, s.hidden_size),
              "o": (s.hidden_size, s.num_heads * s.head_dim), "down": (s.hidden_size, s.intermediate_size),
              "gate_up": (2 * s.intermediate_size, s.hidden_size)}
    uses = {"qkv": ("qkv",), "qkv_stream": ("qkv",), "partials": ("o", "down"), "gate_up": ("gate_up",),
            "gate_up_stream": ("gate_up",), "norm_partials": ()}

    def scratch(names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        with made:
            for name in names:
                if name not in weights:
                    weights[name] = torch.zeros(shapes[name], dtype=s.dtype, device=device)
        return weights

    for rows in gemm_rows(s):
        for key in sorted(gemm_keys(rows, head_dim=s.head_dim)):
            if key not in covered:
                covered.add(key)
                tasks.append(Task("gemm", lambda r=rows, k=key: launch_gemm(s, r, k, scratch(uses[k[0]]), device),
                                  frozenset({key[0]}), (key,)))
    if device.type == "cuda":
        for key, (rows, splits) in mlp_keys(s, lambda r: folds_mlp(s, r, device)).items():
            tasks.append(Task("gemm", lambda r=rows, n=splits: launch_mlp(s, r, n, scratch(("gate_up", "down")),
                                                                          device), frozenset({"gluon_mlp"}), (key,)))
        for key, (rows, layers) in layers_keys(s, layer_stack.warm_runs(s, device)).items():  # the loop-pass launch
            tasks.append(Task("gemm", lambda r=rows, n=layers: _layers().warm_launch(s, r, n, device),
                              frozenset({"gluon_layers"}), (key,)))
    return tasks


def warm_kernels(s: KernelShapes, device: torch.device, threads: int | None = None,
                 should_stop: Callable[[], bool] | None = None, milestone: "warmup_pass.Milestone | None" = None,
                 setup: "warmup_pass.PassSetup | None" = None) -> KernelReport:
    """Launch one call of every specialization (CUDA only; engine/warmup_pass.py runs them), `threads` at a time
    (default: warmup_pass.NUM_THREADS, else its default_threads), their compiles in forked children where
    fork_compile is on; `milestone`: told when every launch but the loop-pass launch's has ended; `setup`: the
    driver and Triton's key, started before (warmup_pass.PassSetup)."""
    return warmup_pass.run_pass(lambda: task_list(s, device), device, threads, should_stop, milestone, setup)
