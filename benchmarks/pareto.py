"""Join a quality run with a throughput run: accuracy from benchmarks/quality.py against the decode speed-up
benchmarks/throughput.py measured for the same configuration (mode, deep_interval, shallow_loops).

Quality can be measured on any machine (the law of the tokens does not depend on it) and on the model you
care about; speed-ups only mean something on the GPU and model size you will serve. This puts the two on
one Pareto plot.

    python benchmarks/pareto.py --quality docs/quality/cpu_results.json \\
        --throughput docs/benchmarks/h200_shallow_loops_results.json --scenario 64x512x512 \\
        --out docs/quality/pareto_h200_speed.png --markdown docs/quality/pareto_h200_speed.md

Configurations with no throughput row for that scenario (verify, whose speed depends on the model's own
acceptance rate, unless the throughput run used the same model) are listed in the table without a speed-up
and left out of the plot.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is a folder of scripts, not a package
from bench_plot import accuracy_plot  # noqa: E402


def config_key(row: dict) -> tuple:
    """Rows of either harness -> (mode, B, s); B = 1 is full depth whatever the mode or s."""
    if row["deep_interval"] == 1:
        return ("full", 1, 0)
    return (row["mode"], row["deep_interval"], row["shallow_loops"])


def join(quality_rows: list[dict], throughput_rows: list[dict], scenario: tuple[int, int, int] | None) -> list[dict]:
    """Each quality row with `speedup` (throughput.py's ratio to interval 1) and `scenario`, or None."""
    speed: dict[tuple, dict] = {}
    for r in throughput_rows:
        if scenario is None or (r["N"], r["prompt"], r["output"]) == scenario:
            key = config_key(r)
            if key in speed:
                raise ValueError(f"throughput results hold {r['config']} twice for one scenario: pass --scenario")
            speed[key] = r
    out = []
    for q in quality_rows:
        t = speed.get(config_key(q))
        out.append(dict(q, speedup=t.get("ratio") if t else None,
                        scenario=f"{t['N']}x{t['prompt']}x{t['output']}" if t else None))
    return out


def markdown(rows: list[dict], qmeta: dict, tmeta: dict, scenario: str) -> str:
    lines = [f"Accuracy: `{Path(qmeta['model']).name}`, {qmeta['num_tasks']} tasks, {qmeta['device']} {qmeta['dtype']} "
             f"({qmeta['date']}). Speed-up: decode tokens/s relative to interval 1 from benchmarks/throughput.py, "
             f"{tmeta.get('device_name', tmeta.get('device'))} {tmeta['dtype']}, "
             f"scenario {scenario} ({tmeta['date']}).",
             "", "| config | mode | B | s | accuracy [95% CI] | agree exact | KL shallow | speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["accuracy_ci95"]
        kl = "-" if r["kl_shallow"] is None else f"{r['kl_shallow']:.4g}"
        sp = "not measured" if r["speedup"] is None else f"{r['speedup']:.2f}"
        lines.append(f"| {r['config']} | {r['mode']} | {r['deep_interval']} | {r['shallow_loops']} | "
                     f"{r['accuracy']:.3f} [{lo:.3f}, {hi:.3f}] | {r['agree_exact']:.3f} | {kl} | {sp} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], qmeta: dict, tmeta: dict, scenario: str, path: Path) -> bool:
    return accuracy_plot(rows, "speedup", path,
                         xlabel=f"decode speed-up over interval 1 ({tmeta.get('device_name', tmeta.get('device'))}, "
                                f"{tmeta['dtype']}, N x prompt x output = {scenario})",
                         ylabel=f"accuracy, 95% Wilson CI ({qmeta['device']} {qmeta['dtype']})",
                         title=f"{Path(qmeta['model']).name}: {qmeta['num_tasks']} tasks; speed from the throughput "
                               f"benchmark")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quality", required=True, help="results.json of benchmarks/quality.py")
    ap.add_argument("--throughput", required=True, help="results.json of benchmarks/throughput.py")
    ap.add_argument("--scenario", default=None,
                    help="NxPROMPTxOUTPUT of the throughput run (needed when it has several)")
    ap.add_argument("--out", required=True, help="PNG path")
    ap.add_argument("--markdown", default=None, help="also write the joined table here")
    args = ap.parse_args(argv)
    scenario = None
    if args.scenario is not None:
        try:
            N, P, M = (int(x) for x in args.scenario.split("x"))
        except ValueError:
            ap.error(f"--scenario: expected NxPROMPTxOUTPUT such as 64x512x512, got {args.scenario!r}")
        scenario = (N, P, M)
    try:
        q = json.loads(Path(args.quality).read_text())
        t = json.loads(Path(args.throughput).read_text())
        rows = join(q["rows"], t["rows"], scenario)
    except (OSError, json.JSONDecodeError, KeyError) as exc:
        ap.error(f"cannot read the results files: {exc!r}")
    except ValueError as exc:
        ap.error(str(exc))
    label = args.scenario or next((r["scenario"] for r in rows if r["scenario"]), "?")
    if not any(r["speedup"] is not None for r in rows):
        ap.error("no configuration of the quality run has a throughput row: compare the config names")
    text = markdown(rows, q["meta"], t["meta"], label)
    if args.markdown:
        Path(args.markdown).write_text(text)
    plot(rows, q["meta"], t["meta"], label, Path(args.out))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
