"""benchmarks/mixed_step.py's numbers from its samples: per (config, N, kind, k) the step times and their
ratio to the decode step, the fixed + per-token fit of the extra time, the summary lines, the markdown."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_report import fmt, percentiles  # noqa: E402

KINDS = ("fresh", "history")


def gemm_flops_per_token(c: Any) -> float:
    """The GEMM FLOPs of one prompt token through every loop (qkv, o, gate_up, down of each layer)."""
    H, I, L = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return 2.0 * (H * (q + 2 * kv) + q * H + 2 * H * I + I * H) * L * c.total_ut_steps


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _allocs(group: list[dict]) -> int | None:
    """cudaMalloc calls (the caching allocator's num_device_alloc) during these steps; None off CUDA."""
    counts = [s["allocator"]["num_device_alloc"] for s in group if s.get("allocator")]
    return sum(counts) if counts else None


def _fit(points: list[tuple[int, float]]) -> tuple[float | None, float | None]:
    """Least squares extra_ms = fixed + per_token * k: (fixed ms, us per token); None below two distinct k."""
    if len({k for k, _ in points}) < 2:
        return None, None
    n = len(points)
    mk, me = sum(k for k, _ in points) / n, sum(e for _, e in points) / n
    slope = sum((k - mk) * (e - me) for k, e in points) / sum((k - mk) ** 2 for k, _ in points)
    return me - slope * mk, 1e3 * slope


def _group(samples: list[dict], config: str, N: int, flops_per_token: float, threshold: float
           ) -> tuple[list[dict], list[dict]]:
    mine = [s for s in samples if s["config"] == config and s["N"] == N]
    decode = [s for s in mine if s["kind"] == "decode"]
    base_all = _median([s["step_ms"] for s in decode])
    base = {deep: _median([s["step_ms"] for s in decode if s["deep"] == deep]) or base_all for deep in (False, True)}
    rows = [dict(config=config, N=N, kind="decode", k=0, n=len(decode),
                 step_ms=percentiles([s["step_ms"] for s in decode]),
                 gpu_ms=percentiles([s["gpu_ms"] for s in decode if s["gpu_ms"] is not None]),
                 launch_ms=percentiles([s["launch_ms"] for s in decode]), ratio=1.0, base_ms=base_all,
                 base_by_deep=base)]
    summary = []
    for kind in KINDS:
        ks = sorted({s["k"] for s in mine if s["kind"] == kind})
        points, within = [], None
        for k in ks:
            group = [s for s in mine if s["kind"] == kind and s["k"] == k]
            extra = [s["step_ms"] - base[s["deep"]] for s in group]
            ratio = _median([s["step_ms"] / base[s["deep"]] for s in group])
            points += [(k, e) for e in extra]
            extra_ms = _median(extra)
            rows.append(dict(config=config, N=N, kind=kind, k=k, n=len(group),
                             step_ms=percentiles([s["step_ms"] for s in group]),
                             gpu_ms=percentiles([s["gpu_ms"] for s in group if s["gpu_ms"] is not None]),
                             launch_ms=percentiles([s["launch_ms"] for s in group]),
                             result_ms=percentiles([s["result_ms"] for s in group]),
                             host_ms=percentiles([s["schedule_ms"] + s["update_ms"] for s in group]),
                             deep_steps=sum(s["deep"] for s in group), ratio=ratio, extra_ms=extra_ms,
                             device_allocs=_allocs(group),
                             chunk_tflop=flops_per_token * k / 1e12,
                             prefill_tflops=(flops_per_token * k / 1e9 / extra_ms
                                             if extra_ms and extra_ms > 0 else None)))
            if ratio <= threshold:
                within = k
        fixed, per_token = _fit(points)
        summary.append(dict(config=config, N=N, kind=kind, decode_ms=base_all, threshold=threshold,
                            largest_k=within, fixed_ms=fixed, us_per_token=per_token,
                            ratio_at_largest=next((r["ratio"] for r in rows if r["kind"] == kind and r["k"] == within),
                                                  None)))
    return rows, summary


def summary_line(s: dict) -> str:
    fit = ("" if s["fixed_ms"] is None else
           f"; extra over decode = {s['fixed_ms']:.1f} ms + {s['us_per_token']:.2f} us/token (least squares)")
    k = "none" if s["largest_k"] is None else f"{s['largest_k']} (x{s['ratio_at_largest']:.2f})"
    return (f"{s['config']} N={s['N']} {s['kind']}: largest k whose mixed step stays <= {s['threshold']:g}x the "
            f"decode step ({fmt(s['decode_ms'], '{:.2f}')} ms): {k}{fit}")


def summarize(samples: list[dict], model_config: Any, threshold: float) -> dict[str, Any]:
    """rows (per config, N, kind, k), summary (per config, N, kind) and its printed lines."""
    flops = gemm_flops_per_token(model_config)
    rows, summary = [], []
    for config, N in dict.fromkeys((s["config"], s["N"]) for s in samples):
        r, s = _group(samples, config, N, flops, threshold)
        rows += r
        summary += s
    return dict(rows=rows, summary=summary, lines=[summary_line(s) for s in summary])


def _table(rows: list[dict], config: str, N: int) -> list[str]:
    mine = [r for r in rows if r["config"] == config and r["N"] == N]
    base = next(r for r in mine if r["kind"] == "decode")
    lines = [f"\n{config}, N = {N}: decode step {fmt(base['step_ms']['p50'], '{:.2f}')} ms (GPU "
             f"{fmt(base['gpu_ms']['p50'], '{:.2f}')}, launch {fmt(base['launch_ms']['p50'], '{:.2f}')}; "
             f"{base['n']} steps). Per chunk: step p50 ms (x decode) / GPU ms / launch ms / prefill TFLOP/s", "",
             "| k | fresh | history |", "|---|---|---|"]
    for k in sorted({r["k"] for r in mine if r["kind"] in KINDS}):
        cells = []
        for kind in KINDS:
            r = next((r for r in mine if r["kind"] == kind and r["k"] == k), None)
            cells.append("-" if r is None else
                         f"{fmt(r['step_ms']['p50'], '{:.1f}')} (x{r['ratio']:.2f})"
                         f" / {fmt(r['gpu_ms']['p50'], '{:.1f}')}"
                         f" / {fmt(r['launch_ms']['p50'], '{:.1f}')} / {fmt(r['prefill_tflops'], '{:.0f}')}")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


def _profile_lines(profile: dict | None, syncs: dict | None) -> list[str]:
    if not profile:
        return []
    lines = [f"\nProfile ({profile['config']}, N = {profile['N']}, chunks of {profile['k']} tokens; one step each, "
             "under torch.profiler, so wall times are inflated):", "",
             "| step | wall ms | GPU ms | kernel ms | busy | device activities | launches | host self ms | syncs |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in ("decode", *KINDS):
        p = profile.get(name)
        if p is None:
            continue
        sync = ("-" if not syncs else
                f"{syncs[name]['engine_count']} (+{syncs[name]['count'] - syncs[name]['engine_count']})")
        lines.append(f"| {name} | {p['wall_ms']:.1f} | {fmt(p['gpu_ms'], '{:.1f}')} | {p['kernel_ms']:.1f} | "
                     f"{fmt(p['busy_share'], '{:.0%}')} | {p['device_activities']} | {p['launches']} | "
                     f"{p['host_ms']:.1f} | {sync} |")
    for name in KINDS:
        p = profile.get(name)
        if p is None:
            continue
        lines += [f"\nTop device activities of the {name} mixed step (calls, ms):", ""]
        lines += [f"- {k['calls']} x {k['name'][:100]}: {k['us'] / 1e3:.2f}" for k in p["top_kernels"][:10]]
        lines += [f"\nTop CPU ops of the {name} mixed step by self time (calls, self ms):", ""]
        lines += [f"- {c['calls']} x {c['name'][:100]}: {c['self_us'] / 1e3:.2f}" for c in p["top_cpu"][:10]]
        if syncs:
            lines += [f"\nSynchronizing calls in the {name} mixed step (sync debug mode): {syncs[name]['count']}", ""]
            lines += [f"- {s['calls']} x {s['site']}" for s in syncs[name]["sites"][:10]]
    return lines


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"Measured {m['date']} on {m['device_name']}, commit {m['commit']}, torch {m['torch']}, {m['dtype']}: "
             f"one step at a time (async scheduling off), N requests decoding (prompts of {m['decode_prompt']} "
             f"tokens) beside one prefill chunk of k tokens: fresh (from position 0) or after a cached history of "
             f"{m['history']} tokens; {m['reps']} steps per (k, kind), the decode baseline from {m['between']} "
             "decode steps after each. Ratio: the mixed step over the median decode step of the same kind (with "
             "or without a deep call)."]
    for config, N in dict.fromkeys((r["config"], r["N"]) for r in result["rows"]):
        lines += _table(result["rows"], config, N)
    lines += ["", *[f"- {line}" for line in result["lines"]]]
    allocs = [s["allocator"] for s in result["samples"] if s.get("allocator")]
    if allocs:
        lines.append(f"- CUDA caching allocator during the timed steps: {sum(a['num_device_alloc'] for a in allocs)} "
                     f"cudaMalloc, {sum(a['num_device_free'] for a in allocs)} cudaFree, "
                     f"{sum(a['num_alloc_retries'] for a in allocs)} flush-and-retry, in "
                     f"{sum(a['num_device_alloc'] > 0 for a in allocs)} of {len(allocs)} steps")
    lines += _profile_lines(result.get("profile"), result.get("syncs"))
    return "\n".join(lines) + "\n"
