"""The issue-22 target table (measure, value, target, met?) from a GPU run's results, as markdown.

Reads what ``bash benchmarks/gpu_suite.sh targets_a`` / ``targets_b`` leave (unpacked results.tgz folders,
or the .tgz files themselves; give both halves to see the whole table):

- public_n64_r1..r3/public_path.json: async / sync per config in three runs, the async Engine's GPU idle
  share between steps (benchmarks/gpu_idle.py), deferred B=4 / B=8 vs interval 1 (no regression);
- public_n8/public_path.json: full depth through the async Engine vs HF ``generate`` (--hf-tok-s: the
  45.7 tok/s measured earlier on the H200 at N = 8, docs/benchmarks.md; not re-measured here);
- public_n256/public_path.json: the GPU idle share at N = 256;
- harness_floor/results.json (benchmarks/throughput.py): full-depth GPU ms per decode step against the
  bytes floor = T loops x (layer weights + N x mean context x one loop's KV per position) / bandwidth,
  mean context = P + (M - 1) / 2, the shape from model_config.json (the checkpoint's config.json) or
  the Ouro-1.4B shape;
- cold/cold_start.json: ready, first / warm round, second process; rollout/rollout.json: tok/s;
- any serving.json (benchmarks/serving.py): p99 / p50 gap between deliveries at the top rate where
  interval 1 keeps p99 TTFT < 1 s.

A measure whose results are absent reads "not in these results".

    python benchmarks/targets_report.py results_a/ results_b/           # or results_a.tgz results_b.tgz
"""

from __future__ import annotations

import argparse
import json
import tarfile
import tempfile
from pathlib import Path

# benchmarks/throughput.py's OURO_1_4B (tests/test_targets_report.py checks they agree), total_ut_steps 4
OURO_1_4B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=16, head_dim=128, total_ut_steps=4)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MISSING = "not in these results"


def bytes_floor_s(shape: dict, N: int, context: float, dtype_bytes: int, bandwidth: float) -> float:
    """Seconds to read, per loop pass, every layer's weights once and each request's KV of that loop."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    weights = layers * (h * (q + 2 * kv) + q * h + 3 * h * inter) * dtype_bytes
    kv_per_position = layers * 2 * kv * dtype_bytes
    return shape["total_ut_steps"] * (weights + N * context * kv_per_position) / bandwidth


def load(paths: list[Path]) -> dict[str, list[tuple[str, dict]]]:
    """{kind: [(folder relative to its root, parsed JSON)]} of every result file under `paths`."""
    names = {"public_path.json": "public", "results.json": "harness", "cold_start.json": "cold",
             "rollout.json": "rollout", "serving.json": "serving", "model_config.json": "model"}
    found: dict[str, list[tuple[str, dict]]] = {kind: [] for kind in names.values()}
    for root in paths:
        for f in sorted(root.rglob("*.json")):
            if f.name in names:
                found[names[f.name]].append((str(f.parent.relative_to(root)), json.loads(f.read_text())))
    return found


def _public(found, N: int) -> list[tuple[str, dict]]:
    return [(d, r) for d, r in found["public"] if r["meta"]["N"] == N and not r["meta"].get("replicas")]


def _by(data: dict) -> dict[tuple[str, str], dict]:
    return {(r["config"], r["path"]): r for r in data["rows"]}


def _idle(row: dict | None) -> float | None:
    return None if row is None else (row.get("gpu_idle") or {}).get("gpu_idle_share")


def _row(measure: str, value: str, target: str, met: bool | None) -> tuple[str, str, str, str]:
    return measure, value, target, {True: "yes", False: "**no**", None: "-"}[met]


def floor_rows(found, args) -> list[tuple]:
    shape = found["model"][0][1] if found["model"] else OURO_1_4B
    rows = []
    for N, target in ((64, 1.2), (8, 1.6)):
        measure = f"full-depth decode step / bytes floor, N={N} (decode harness)"
        hits = [(d, r, m) for d, data in found["harness"] for r in data["rows"] for m in [data["meta"]]
                if r["N"] == N and r["config"] == "interval1"]
        if not hits or hits[-1][1].get("gpu_ms_per_step") is None:
            rows.append(_row(measure, MISSING if not hits else "no GPU time (CPU run)", f"<= {target}x", None))
            continue
        _, r, meta = hits[-1]
        floor = 1e3 * bytes_floor_s(shape, N, r["prompt"] + (r["output"] - 1) / 2,
                                    DTYPE_BYTES[meta.get("dtype", "bfloat16")], args.bandwidth_tbps * 1e12)
        ratio = r["gpu_ms_per_step"] / floor
        rows.append(_row(measure, f"{ratio:.2f}x ({r['gpu_ms_per_step']:.2f} ms vs {floor:.2f} ms)", f"<= {target}x",
                         ratio <= target))
    return rows


def hf_row(found, args) -> tuple:
    measure = "full depth vs HF `generate`, N=8, through the async Engine"
    n8 = [_by(data) for _, data in _public(found, 8)]
    a = n8[-1].get(("interval1", "async")) if n8 else None
    if a is None:
        return _row(measure, MISSING, ">= 25x", None)
    x = a["tokens_per_s"] / args.hf_tok_s
    return _row(measure, f"{x:.1f}x ({a['tokens_per_s']:,.0f} vs {args.hf_tok_s:g} tok/s)", ">= 25x", x >= 25)


def _per_config(runs: list[dict], value) -> dict[str, list]:
    """{config: [value(by, config) for each run that has the config]}, configs in the order first seen."""
    configs = list(dict.fromkeys(c for by in runs for c, _ in by))
    return {c: [value(by, c) for by in runs if (c, "async") in by and (c, "sync") in by] for c in configs}


def ratio_row(runs: list[dict]) -> tuple:
    measure = "async Engine / SyncEngine, every config, three runs in a row"
    if not runs:
        return _row(measure, MISSING, ">= 0.97 in all", None)
    ratios = _per_config(runs, lambda by, c: by[(c, "async")]["tokens_per_s"] / by[(c, "sync")]["tokens_per_s"])
    low = min(v for vs in ratios.values() for v in vs)
    text = "; ".join(f"{c} " + " / ".join(f"{v:.3f}" for v in vs) for c, vs in ratios.items())
    return _row(measure, f"{text} ({len(runs)} runs, min {low:.3f})", ">= 0.97 in all", low >= 0.97 and len(runs) >= 3)


def idle_row(runs: list[dict], N: int, target: float) -> tuple:
    measure = f"host time between GPU steps (GPU idle), share of the step phase, N={N}, async Engine"
    shares = _per_config(runs, lambda by, c: (_idle(by[(c, "async")]), _idle(by[(c, "sync")])))
    values = [a for pairs in shares.values() for a, _ in pairs]
    if not values or None in values:
        return _row(measure, MISSING, f"<= {target:.0%}", None)

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"
    text = "; ".join(f"{c} " + " / ".join(pct(a) for a, _ in pairs) + " (sync " + " / ".join(pct(s) for _, s in pairs)
                     + ")" for c, pairs in shares.items())
    return _row(measure, f"{text}; worst {pct(max(values))}", f"<= {target:.0%}", max(values) <= target)


def regression_row(runs: list[dict]) -> tuple:
    measure = "no regression: public path N=64 deferred B=4 / B=8 vs interval 1 (async)"
    got = [tuple(by[(c, "async")]["tokens_per_s"] / by[("interval1", "async")]["tokens_per_s"]
                 for c in ("deferred4", "deferred8"))
           for by in runs if all((c, "async") in by for c in ("interval1", "deferred4", "deferred8"))]
    if not got:
        return _row(measure, MISSING, ">= 1.45x / 1.6x", None)
    text = ", ".join(f"{b4:.2f}x / {b8:.2f}x" for b4, b8 in got)
    return _row(measure, text, ">= 1.45x / 1.6x", all(b4 >= 1.45 and b8 >= 1.6 for b4, b8 in got))


def public_rows(found, args) -> list[tuple]:
    n64 = [_by(data) for _, data in _public(found, 64)]
    n256 = [_by(data) for _, data in _public(found, 256)]
    return [hf_row(found, args), ratio_row(n64), idle_row(n64, 64, 0.02), idle_row(n256, 256, 0.03),
            regression_row(n64)]


def cold_rows(found) -> list[tuple]:
    measures = [("cold engine: ready, any mode (empty compile cache)", "<= 8 s"),
                ("first 64 x 128 round / warm round (cold process)", "<= 1.15x"),
                ("second process start (warm caches): ready", "<= 5 s")]
    if not found["cold"]:
        return [_row(m, MISSING, t, None) for m, t in measures]
    rows = [r for _, data in found["cold"] for r in data["rows"]]
    one, two = [r for r in rows if r["process"] == 1], [r for r in rows if r["process"] == 2]

    def ready(rs):
        return ", ".join(f"{r['config']} {r['ready_s']:.1f} s (from spawn {r['start_to_ready_s']:.1f} s)" for r in rs)
    out = [_row(measures[0][0], ready(one), measures[0][1], max(r["ready_s"] for r in one) <= 8)]
    text = ", ".join(f"{r['config']} {r['first_over_warm']:.2f}x" for r in one)
    out.append(_row(measures[1][0], text + " (warm process: " + ", ".join(f"{r['first_over_warm']:.2f}x" for r in two)
                    + ")", measures[1][1], max(r["first_over_warm"] for r in one) <= 1.15))
    out.append(_row(measures[2][0], ready(two), measures[2][1], bool(two) and max(r["ready_s"] for r in two) <= 5))
    return out


def serving_rows(found) -> list[tuple]:
    measure = "p99 / p50 gap between deliveries, Poisson arrivals, top rate with interval 1 p99 TTFT < 1 s"
    out = []
    for d, data in found["serving"]:
        base = [r for r in data["rows"] if r["config"] == "interval1" and r["rate"] != "inf"
                and r["ttft_ms"]["p99"] is not None and r["ttft_ms"]["p99"] < 1000]
        if not base:
            out.append(_row(f"{measure} ({d})", "interval 1 missed p99 TTFT < 1 s at every rate", "<= 2x", False))
            continue
        rate = max(r["rate"] for r in base)
        at = {r["config"]: r.get("itl_p99_over_p50") for r in data["rows"] if r["rate"] == rate}
        worst = max((v for v in at.values() if v is not None), default=float("inf"))
        text = ", ".join(f"{c} {v:.2f}x" for c, v in at.items() if v is not None)
        out.append(_row(f"{measure} ({d})", f"rate {rate:g}/s: {text}", "<= 2x", worst <= 2))
    return out or [_row(measure, MISSING, "<= 2x", None)]


def rollout_rows(found) -> list[tuple]:
    measure = "rollout batch (benchmarks/rollout.py) full depth / deferred B=8 tok/s"
    rows = {r["config"]: r for _, data in found["rollout"] for r in data["rows"] if r["kv_allocation"] == "lazy"}
    if "interval1" not in rows or "deferred8" not in rows:
        return [_row(measure, MISSING, ">= 3,700 / 5,500", None)]
    a, b = rows["interval1"]["tokens_per_s"], rows["deferred8"]["tokens_per_s"]
    return [_row(measure, f"{a:,.0f} / {b:,.0f}", ">= 3,700 / 5,500", a >= 3700 and b >= 5500)]


def report(found, args) -> str:
    rows = (floor_rows(found, args) + public_rows(found, args) + cold_rows(found) + serving_rows(found)
            + rollout_rows(found))
    lines = ["| measure | value | target | met? |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="folders (unpacked results.tgz) or .tgz files")
    ap.add_argument("--hf-tok-s", type=float, default=45.7, help="HF generate's tok/s at N = 8 (the reference)")
    ap.add_argument("--bandwidth-tbps", type=float, default=4.3, help="HBM bandwidth of the bytes floor")
    args = ap.parse_args(argv)
    for name in ("hf_tok_s", "bandwidth_tbps"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    with tempfile.TemporaryDirectory() as tmp:
        roots = []
        for i, p in enumerate(map(Path, args.results)):
            if not p.exists():
                ap.error(f"results: {p} does not exist")
            if p.is_file():
                dest = Path(tmp) / str(i)
                with tarfile.open(p) as tar:
                    tar.extractall(dest, filter="data")
                p = dest
            roots.append(p)
        print(report(load(roots), args), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
