"""Can bytes staged in L2 make a later HBM-bound read cheaper on this card? A probe of the idea behind session 28.

At N = 64 the decode attention reads ~335 MB of keys and values a layer and loop at the device's read rate, while
the GEMM side before it (~44 us, seven launches) leaves about half of HBM's bandwidth unused. Session 28 asked the
L2 for the attention's first pages during that GEMM side (engine/kv_prefetch.py, Hopper's bulk prefetch) and every
setting was slower, even the attention right after its own prefetch; why was not analysed. This probe asks the
question without the engine: a read kernel streams a `--kv-mb` buffer front to back (a grid-stride sum, so its first
bytes are read first, as the attention's programs read their first pages first); before it, `--stage-mb` of that
buffer's first bytes are staged, by plain loads, line prefetches (prefetch.global.L2) or bulk prefetches, with an L2
policy, optionally with a `--weights-mb` stream between (as a GEMM's weights would pass) read normally or
evict_first. Each sequence runs twice, its last read over the staged buffer (`same`) or over another of the same
size (`other`): the same launches, the same bytes, only the reuse differs. saving = other - same; `of ideal` =
saving against the staged bytes at the read kernel's own rate. `side` stages on a second stream beside a chain of
`--chain` dependent small reads (KERNELSxMB, `--chain-programs` programs each: the GEMM side's launches at part of
the bandwidth), then reads; `net` is what staging there gains over the chain and the read without it.

    python benchmarks/l2_reuse_probe.py --out DIR [--kv-mb 335] [--stage-mb 8,16,24,32] [--weights-mb 46]
        [--chain 6x4] [--chain-programs 32] [--rounds 2] [--persist-mb 0]

Needs CUDA and Triton (Hopper for the bulk prefetch); flags are checked first. Writes l2_reuse.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

MB = 1 << 20
STAGERS = ("load:normal", "load:evict_last", "line:normal", "line:evict_last", "bulk:normal", "bulk:evict_last")
GAPS = ("none", "weights:normal", "weights:evict_first")


def parse_mb_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated whole MB, e.g. 8,16,24; got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{flag} must list at least one positive size in MB; got {text!r}")
    return values


def parse_chain(text: str) -> tuple[int, int]:
    """"6x4" -> (6 kernels, 4 MB each)."""
    try:
        kernels, mb = (int(t) for t in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--chain must be KERNELSxMB, e.g. 6x4; got {text!r}") from None
    if not (1 <= kernels <= 64 and 1 <= mb <= 1024):
        raise ValueError(f"--chain {text!r}: KERNELS in 1..64 and MB in 1..1024")
    return kernels, mb


def check_args(args) -> None:
    args.stage = parse_mb_list(args.stage_mb, "--stage-mb")
    args.chain_kernels, args.chain_each = parse_chain(args.chain)
    if args.kv_mb < 2 * max(args.stage):
        raise ValueError(f"--kv-mb ({args.kv_mb}) must be at least twice the largest --stage-mb ({max(args.stage)})")
    if args.weights_mb <= 0 or args.chain_programs <= 0 or args.rounds <= 0:
        raise ValueError("--weights-mb, --chain-programs and --rounds must be positive")
    if args.persist_mb < 0:
        raise ValueError(f"--persist-mb must be 0 (the default carve-out) or a positive MB; got {args.persist_mb}")


def _table(heading: str, columns: list[str], cells: list[list[str]]) -> str:
    lines = [heading, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells]) + "\n"


def markdown(rows: list[dict], device: str, kv_mb: int, read_tbps: float) -> str:
    heading = f"### Bytes staged in L2 before a {kv_mb} MB read ({device}; the read kernel alone: {read_tbps:.2f} TB/s)"
    columns = ["stager", "between", "staged MB", "round", "other us", "same us", "saving us", "of ideal"]
    cells = [[r["stager"], r["gap"], str(r["stage_mb"]), str(r["round"]), f"{r['other_us']:.1f}",
              f"{r['same_us']:.1f}", f"{r['saving_us']:+.1f}", f"{r['of_ideal']:.2f}"] for r in rows]
    return _table(heading, columns, cells)


def side_markdown(rows: list[dict]) -> str:
    columns = ["stager", "staged MB", "round", "chain + read us", "side, other us", "side, same us", "net us"]
    return "\n" + _table("### Staged on a second stream beside the chain, then the read", columns,
                         [[r["stager"], str(r["stage_mb"]), str(r["round"]), f"{r['plain_us']:.1f}",
                           f"{r['other_us']:.1f}", f"{r['same_us']:.1f}", f"{r['net_us']:+.1f}"] for r in rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--kv-mb", type=int, default=335, help="the read's bytes (one attention's keys and values)")
    ap.add_argument("--stage-mb", default="8,16,24,32", help="bytes staged before it, comma-separated MB")
    ap.add_argument("--weights-mb", type=int, default=46, help="a weights stream between (gate_up's 46 MB)")
    ap.add_argument("--chain", default="6x4", help="the side stream's chain: KERNELSxMB")
    ap.add_argument("--chain-programs", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--persist-mb", type=int, default=0,
                    help="set aside this much L2 for evict_last lines first (the CUDA context's persisting L2 "
                    "limit, clamped to the device's most)")
    args = ap.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        ap.error(str(e))
    import torch
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (and Triton)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # engine/, which gemm_sweep's timing imports
    from l2_reuse_kernels import Probe, set_persisting_l2

    persisting = set_persisting_l2(args.persist_mb * MB) if args.persist_mb else 0
    probe = Probe(args.kv_mb * MB, args.weights_mb * MB, args.chain_kernels, args.chain_each * MB,
                  args.chain_programs)
    rows, side = [], []
    for rnd in range(1, args.rounds + 1):
        for stager in STAGERS:
            for s in args.stage:
                for gap in GAPS:
                    rows.append(dict(stager=stager, gap=gap, stage_mb=s, round=rnd,
                                     **probe.staged(stager, s * MB, gap)))
                side.append(dict(stager=stager, stage_mb=s, round=rnd, **probe.beside(stager, s * MB)))
            print(markdown([r for r in rows if r["round"] == rnd and r["stager"] == stager], probe.device,
                           args.kv_mb, probe.read_tbps), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    info = dict(device=probe.device, l2_bytes=probe.l2_bytes, read_tbps=probe.read_tbps, kv_mb=args.kv_mb,
                weights_mb=args.weights_mb, chain=args.chain, chain_programs=args.chain_programs,
                persisting_l2_bytes=persisting)
    (args.out / "l2_reuse.json").write_text(json.dumps(dict(info=info, staged=rows, side=side), indent=1))
    text = markdown(rows, probe.device, args.kv_mb, probe.read_tbps) + side_markdown(side)
    (args.out / "l2_reuse.md").write_text(text)
    print(side_markdown(side))
    best = max(rows, key=lambda r: r["saving_us"])
    print(f"best saving {best['saving_us']:.1f} us ({best['stager']}, {best['gap']}, {best['stage_mb']} MB); "
          f"median of ideal {statistics.median(r['of_ideal'] for r in rows):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
