"""benchmarks/serving.py's numbers from its records: a round's latencies and occupancy, the summary against
interval 1, the markdown table and the plots."""

from __future__ import annotations

import bisect
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is a folder of scripts, not a package
from bench_plot import pyplot  # noqa: E402

BASELINE, COMPARED = "interval1", "deferred4"
GAP_EDGES_MS = [0.1 * 2 ** (i / 4) for i in range(81)]  # itl_hist bin edges: 0.1 ms .. 105 s, 4 per octave


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50 / p90 / p99 (linear between order statistics, numpy's default), mean and max."""
    if not values:
        return dict(p50=None, p90=None, p99=None, mean=None, max=None, count=0)
    v = sorted(values)

    def q(p: float) -> float:
        x = (len(v) - 1) * p / 100
        lo = math.floor(x)
        hi = min(lo + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (x - lo)

    return dict(p50=q(50), p90=q(90), p99=q(99), mean=sum(v) / len(v), max=v[-1], count=len(v))


def measure(records: list[dict], trace: list) -> dict[str, Any]:
    """Every latency of a round (ms), its throughput and its occupancy."""
    ttft, e2e, itl, itl_token, tpot = [], [], [], [], []
    for r in records:
        if not r["times"]:
            raise RuntimeError(f"a request produced no tokens (finish_reason {r['finish_reason']!r}): {r}")
        t, c = r["times"], r["counts"]
        ttft.append(1e3 * (t[0] - r["arrival"]))
        e2e.append(1e3 * (t[-1] - r["arrival"]))
        itl += [1e3 * (b - a) for a, b in zip(t, t[1:])]
        itl_token += [0.0] * (c[0] - 1)
        for a, b, k in zip(t, t[1:], c[1:]):
            itl_token += [1e3 * (b - a)] + [0.0] * (k - 1)
        if sum(c) > 1:
            tpot.append(1e3 * (t[-1] - t[0]) / (sum(c) - 1))
    duration = max(r["times"][-1] for r in records)  # the first arrival is at 0
    tokens = sum(sum(r["counts"]) for r in records)
    events = sorted([(r["arrival"], 1) for r in records] + [(r["times"][-1], -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    hist = [0] * (len(GAP_EDGES_MS) - 1)
    for g in itl:  # bins [e_i, e_i+1); gaps outside the range go to the end bins
        hist[min(max(bisect.bisect_right(GAP_EDGES_MS, g) - 1, 0), len(hist) - 1)] += 1
    p = percentiles(itl)
    return dict(num_requests=len(records), output_tokens=tokens, duration_s=duration,
                requests_per_s=len(records) / duration, output_tokens_per_s=tokens / duration,
                ttft_ms=percentiles(ttft), itl_ms=p, itl_token_ms=percentiles(itl_token), tpot_ms=percentiles(tpot),
                e2e_ms=percentiles(e2e), itl_p99_over_p50=p["p99"] / p["p50"] if p["p50"] else None,
                itl_p90_over_p50=p["p90"] / p["p50"] if p["p50"] else None,
                tokens_per_delivery=tokens / sum(len(r["times"]) for r in records), itl_hist=hist,
                mean_in_flight=sum(e2e) / 1e3 / duration, peak_in_flight=peak,
                max_send_lag_ms=max(1e3 * (r["sent"] - r["arrival"]) for r in records),
                mean_running=_time_mean(trace, 1), peak_running=max((x[1] for x in trace), default=0),
                peak_waiting=max((x[2] for x in trace), default=0), trace=trace)


def _time_mean(trace: list, col: int) -> float:
    if len(trace) < 2:
        return float(trace[0][col]) if trace else 0.0
    return sum((b[0] - a[0]) * a[col] for a, b in zip(trace, trace[1:])) / (trace[-1][0] - trace[0][0])


def summarize(rows: list[dict], slo_ms: float) -> dict[str, Any]:
    """The highest finite rate where the baseline's p99 TTFT < slo_ms; there, every config against it."""
    out: dict[str, Any] = dict(baseline=BASELINE, compared=COMPARED, ttft_slo_ms=slo_ms, rate=None,
                               compared_throughput_gain=None, compared_itl_p99_ratio=None)
    base = {r["rate"]: r for r in rows if r["config"] == BASELINE}
    ok = [rate for rate, r in base.items() if rate != "inf" and r["ttft_ms"]["p99"] < slo_ms]
    if ok:
        rate = out["rate"] = max(ok)
        b = base[rate]
        out.update(baseline_ttft_p99_ms=b["ttft_ms"]["p99"], baseline_itl_p99_ms=b["itl_ms"]["p99"],
                   baseline_output_tokens_per_s=b["output_tokens_per_s"])
        ratio = lambda r, key, q: r[key][q] / b[key][q]  # noqa: E731
        out["at_rate"] = {r["config"]: dict(
            throughput_gain=r["output_tokens_per_s"] / b["output_tokens_per_s"],
            itl_p99_ratio=ratio(r, "itl_ms", "p99"), itl_p50_ratio=ratio(r, "itl_ms", "p50"),
            ttft_p99_ratio=ratio(r, "ttft_ms", "p99"), e2e_p50_ratio=ratio(r, "e2e_ms", "p50"))
            for r in rows if r["rate"] == rate and r["config"] != BASELINE}
        if COMPARED in out["at_rate"]:
            out["compared_throughput_gain"] = out["at_rate"][COMPARED]["throughput_gain"]
            out["compared_itl_p99_ratio"] = out["at_rate"][COMPARED]["itl_p99_ratio"]
        else:
            out["note"] = f"{COMPARED} was not run"
    else:
        out["note"] = (f"{BASELINE} missed p99 TTFT < {slo_ms:g} ms at every finite rate" if base
                       else f"{BASELINE} was not run")
    top = [r for r in rows if r["rate"] == rows[-1]["rate"]]  # the highest rate run: closest to capacity
    base_top = next((r for r in top if r["config"] == BASELINE), None)
    out["top_rate"] = rows[-1]["rate"]
    out["top_rate_throughput_gain"] = {r["config"]: r["output_tokens_per_s"] / base_top["output_tokens_per_s"]
                                       for r in top} if base_top else None
    return out


def fmt(x: float | None, spec: str = "{:.0f}", scale: float = 1.0) -> str:
    return "-" if x is None else spec.format(x / scale)


def progress_line(row: dict) -> str:
    t, i = row["ttft_ms"], row["itl_ms"]
    return (f"{row['config']:>10} rate {str(row['rate']):>5}: {row['num_requests']} req in {row['duration_s']:.1f} s, "
            f"{row['requests_per_s']:.1f} req/s, {row['output_tokens_per_s']:.0f} tok/s, TTFT p50/p99 {fmt(t['p50'])}/"
            f"{fmt(t['p99'])} ms, ITL p50/p99 {fmt(i['p50'], '{:.1f}')}/{fmt(i['p99'], '{:.1f}')} ms, running mean "
            f"{row['mean_running']:.1f}, graph captures {row['graph_captures_during_round']}, kernels compiled "
            f"{_compiled(row.get('kernels_compiled_during_round'))}")


def _compiled(c: dict | None) -> str:
    return "-" if c is None else f"{c['compiled']} (+{c['loaded']} from cache, {c['seconds']:.1f} s)"


def _allocs(row: dict) -> str:
    a = row.get("allocator_during_round")
    return "-" if a is None else f"{a['num_device_alloc']} / {a['num_alloc_retries']}"


def steps_table(rows: list[dict]) -> list[str]:
    """Markdown lines: per round, pure-decode vs prefill step times and step times by prefill tokens."""
    rows = [r for r in rows if r.get("steps")]
    if not rows:
        return []
    lines = ["", "Engine steps (step log; ms from the previous step's result or the step's launch to its result; "
             "prefill buckets: step p50 / p99 ms (steps)):", "",
             "| config | rate /s | steps | decode p50 / p99 | prefill p50 / p99 | prefill launch p50 | with history "
             "| ahead | compiled / captures | cudaMalloc / retries | by prefill tokens |", "|---" * 11 + "|"]
    for r in rows:
        st = r["steps"]
        d, p = st["decode"], st["prefill"]
        by = "; ".join(f"{k}: {fmt(v['step_ms']['p50'], '{:.1f}')} / {fmt(v['step_ms']['p99'], '{:.1f}')} "
                       f"({v['count']})" for k, v in st["by_prefill_tokens"].items())
        lines.append(f"| {r['config']} | {r['rate']} | {st['num_steps']} | {fmt(d['step_ms']['p50'], '{:.1f}')} / "
                     f"{fmt(d['step_ms']['p99'], '{:.1f}')} | {fmt(p['step_ms']['p50'], '{:.1f}')} / "
                     f"{fmt(p['step_ms']['p99'], '{:.1f}')} | {fmt(p['launch_ms']['p50'], '{:.1f}')} | "
                     f"{p['with_history']} | {st['ahead']} | {st['compiled']} / {st['captures']} | "
                     f"{_allocs(r)} | {by} |")
    return lines


def markdown(rows: list[dict], meta: dict, summary: dict) -> str:
    m = meta
    lines = [f"Measured {m['date']} on {m['device_name']}, commit {m['commit']}, torch {m['torch']}, {m['dtype']}, "
             f"through the {m['transport']}: {m['num_requests']} requests per rate, Poisson arrivals (seed "
             f"{m['seed']}), prompt lognormal(median {m['prompt_median']:g}, sigma {m['prompt_sigma']:g}) <= "
             f"{m['max_prompt_len']}, "
             f"output lognormal(median {m['output_median']:g}, sigma {m['output_sigma']:g}) <= {m['max_tokens']}, "
             "ignore_eos, temperature 1. ITL: gap between consecutive deliveries of one request.", "",
             "| config | rate /s | req/s | out tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | "
             "ITL p99/p50 | tok/delivery | TPOT mean ms | E2E p50 / p99 s | running mean / peak |", "|---" * 11 + "|"]
    for r in rows:
        t, i, e = r["ttft_ms"], r["itl_ms"], r["e2e_ms"]
        lines.append(f"| {r['config']} | {r['rate']} | {r['requests_per_s']:.1f} | {r['output_tokens_per_s']:.0f} | "
                     f"{fmt(t['p50'])} / {fmt(t['p90'])} / {fmt(t['p99'])} | "
                     + " / ".join(fmt(i[q], "{:.1f}") for q in ("p50", "p90", "p99"))
                     + f" | {fmt(r['itl_p99_over_p50'], '{:.2f}')} | {r['tokens_per_delivery']:.2f} | "
                     f"{fmt(r['tpot_ms']['mean'], '{:.1f}')} | {fmt(e['p50'], '{:.2f}', 1e3)} / "
                     f"{fmt(e['p99'], '{:.2f}', 1e3)} | {r['mean_running']:.1f} / {r['peak_running']} |")
    lines += steps_table(rows)
    s = summary
    if s["rate"] is None:
        lines.append(f"\nSummary: {s['note']}.")
    else:
        lines.append(f"\nSummary: the highest rate where {BASELINE} keeps p99 TTFT < {s['ttft_slo_ms']:g} ms is "
                     f"{s['rate']:g} requests/s (p99 TTFT {s['baseline_ttft_p99_ms']:.0f} ms). There:")
        lines += [f"- {name}: output tok/s x{v['throughput_gain']:.2f}, p99 ITL x{v['itl_p99_ratio']:.2f}, p50 ITL "
                  f"x{v['itl_p50_ratio']:.2f}, p99 TTFT x{v['ttft_p99_ratio']:.2f}, p50 E2E x{v['e2e_p50_ratio']:.2f}"
                  f" of {BASELINE}'s" for name, v in s["at_rate"].items()]
    if s["top_rate_throughput_gain"]:
        gains = ", ".join(f"{k} x{v:.2f}" for k, v in s["top_rate_throughput_gain"].items())
        lines.append(f"\nOutput tok/s at rate {s['top_rate']} relative to {BASELINE}: {gains}.")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out: Path, plot_rate: Any) -> bool:
    """serving_latency.png (p99 TTFT and ITL against rate), serving_running.png and serving_gaps.png (one rate)."""
    plt = pyplot("the plots")
    if plt is None:
        return False
    names, rates = list(dict.fromkeys(r["config"] for r in rows)), list(dict.fromkeys(r["rate"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "ttft_ms", "p99 TTFT (ms)"),
                           (axes[1], "itl_ms", "p99 gap between deliveries (ms)")):
        for name in names:
            pts = [(rates.index(r["rate"]), r[key]["p99"]) for r in rows if r["config"] == name and r[key]["p99"]]
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=name)
        ax.set_xticks(range(len(rates)), [str(r) for r in rates])
        ax.set(xlabel="arrival rate (requests/s)", ylabel=label, yscale="log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "serving_latency.png", dpi=120)
    at = [r for r in rows if r["rate"] == plot_rate]
    for filename, xlabel, ylabel in (
            ("serving_running.png", "seconds since the first arrival", "running requests"),
            ("serving_gaps.png", "gap between deliveries of one request (ms)", "share of gaps")):
        fig, ax = plt.subplots(figsize=(9, 4))
        for r in at:
            if filename == "serving_running.png":
                ax.plot([x[0] for x in r["trace"]], [x[1] for x in r["trace"]], label=r["config"])
            else:
                ax.stairs([c / max(sum(r["itl_hist"]), 1) for c in r["itl_hist"]], GAP_EDGES_MS, label=r["config"])
                ax.set_xscale("log")
        ax.set(xlabel=xlabel, ylabel=ylabel, title=f"arrival rate {plot_rate} requests/s")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=120)
    plt.close("all")
    return True
