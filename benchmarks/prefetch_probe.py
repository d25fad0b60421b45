"""Do the 64-row gate_up, qkv and split-K partials GEMMs gain from loading weights before the PDL wait, where a loader
warp of their own issues the TMA boxes from launch (benchmarks/prefetch_kernels.py)?

Each GEMM follows a small add + norm kernel (2.2-2.6 us a launch on the H200, ~2 MB read) during which HBM idles
while the GEMM's programs sit resident at griddepcontrol.wait. Sessions 9 and 30 loaded weights before the wait from
Triton kernels, where the loads completed (or were serialized) before the wait and measured no gain; session 30's
were o_proj and down_proj, whose programs can only start in the attention's / gate_up's tail. Here the weight
stream is a warp of its own, asynchronous, for the two GEMMs after the add + norm. Each chain, o's split-K partials
-> add + norm -> gate_up + SiLU and down's partials -> add + norm -> qkv + RoPE + store, is timed three ways, as
gemm_sweep.py times (24 weight copies, a CUDA graph, PDL as the engine launches): today's Triton kernels, the Gluon
kernel with the weights from launch ("prefetch"), and the same kernel waiting before its weights too ("wait": what
the Gluon kernel itself costs). Outputs (gate_up's product, qkv's q) are checked against today's chain. "down" times
gate_up -> down's split-K partials -> add + norm (the GEMM after a GEMM, checked on the add + norm's output), and
`--harness WAY` runs the decode harness with the engine's 64-row linear_partials calls on the Gluon kernel (WAY: none,
down, or partials: o's too). Measured on H100s (session 36, docs/benchmarks.md): no gain in the step from any of them.

    python benchmarks/prefetch_probe.py --out $OUT/prefetch
    python benchmarks/prefetch_probe.py --harness down --ring 8,4 --out $OUT/harness_down
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.norm_chain_probe import EPS, HEAD_DIM, HEADS, HIDDEN, INTER, ROWS, inputs, rope_args  # noqa: E402

# (weight boxes, activation boxes)
RINGS = {"gate": ((8, 4), (6, 4), (4, 6)), "qkv": ((8, 4), (4, 4), (12, 4)), "down": ((4, 4), (8, 4), (10, 2))}
HARNESS_WAYS = ("none", "down", "partials")  # --harness: which linear_partials calls the Gluon kernel takes
WAYS = ("triton", "wait", "prefetch")


def consumer(op: str, way: str, ring: tuple[int, int]):
    """fn(x, w) -> the op's output: today's Triton kernel (way "triton") or the Gluon one."""
    from benchmarks import prefetch_kernels as pk
    from engine import triton_gemm as tg
    from engine.gemm_dispatch import gemm_config

    cfg, rope = gemm_config(ROWS), tuple(rope_args().values())
    tiles = {"stages": ring[0], "x_stages": ring[1], "prefetch": way != "wait"}
    if op == "down":
        if way == "triton":
            return lambda x, w: tg.linear_partials(x, w, cfg.splits_down, cfg)
        return lambda x, w: pk.linear_partials(x, w, cfg.splits_down, **tiles)
    if op == "gate":
        if way == "triton":
            return lambda x, w: tg.gate_up_silu(x, w, cfg)
        return lambda x, w: pk.gate_up_silu(x, w, **tiles)
    if way == "triton":
        return lambda x, w: tg.qkv_rope_store(x, w, *rope, HEADS, HEADS, HEAD_DIM, cfg)
    return lambda x, w: pk.qkv_rope_store(x, w, rope, HEADS, HEADS, HEAD_DIM, **tiles)


def data(op: str) -> dict:
    """The chain's inputs, shared by every way: the rows, the norms, 24 producer and 24 consumer weight copies."""
    from benchmarks.gemm_sweep import weights
    from engine.gemm_dispatch import gemm_config

    if op == "down":  # gate_up -> down: the producer is gate_up's weights, the consumer down's
        return {"t": inputs(HIDDEN), "prod": weights(2 * INTER, HIDDEN), "cons": weights(HIDDEN, INTER)}
    cfg = gemm_config(ROWS)
    k_in, splits = (HIDDEN, cfg.splits_o) if op == "gate" else (INTER, cfg.splits_down)
    cons = weights(2 * INTER, HIDDEN) if op == "gate" else weights(3 * HEADS * HEAD_DIM, HIDDEN)
    return {"t": inputs(k_in), "prod": weights(HIDDEN, k_in), "cons": cons, "splits": splits}


def chain(op: str, way: str, ring: tuple[int, int], d: dict) -> tuple:
    """(chain(i), consumer alone(i)) for weight copy i: partials -> add + norm -> the op (op "down": gate_up ->
    down's partials -> add + norm, the GEMM after a GEMM)."""
    from engine import triton_gemm as tg
    from engine.gemm_dispatch import gemm_config

    cfg, t = gemm_config(ROWS), d["t"]
    fn = consumer(op, way, ring)
    x0 = torch.randn_like(t["h"])
    if op == "down":
        m0 = torch.randn(ROWS, INTER, device="cuda", dtype=torch.bfloat16)

        def after_gate_up(i):
            parts = fn(tg.gate_up_silu(t["a"], d["prod"][i], cfg), d["cons"][i])
            return tg.add_rms_norm2_partials(t["h"], parts, t["wa"], t["wb"], EPS)[1]

        return after_gate_up, lambda i: fn(m0, d["cons"][i])

    def run(i):
        partials = tg.linear_partials(t["a"], d["prod"][i], d["splits"], cfg)
        _, x = tg.add_rms_norm2_partials(t["h"], partials, t["wa"], t["wb"], EPS)
        return fn(x, d["cons"][i])

    return run, lambda i: fn(x0, d["cons"][i])


def case(op: str, ring: tuple[int, int], with_triton: bool) -> list[dict]:
    from benchmarks.gemm_sweep import COPIES, timed
    from benchmarks.weight_layout_probe import rel_err

    d = data(op)
    want = chain(op, "triton", ring, d)[0](0)
    rows = []
    for way in WAYS[0 if with_triton else 1:]:
        run, alone = chain(op, way, ring, d)
        err = rel_err(run(0), want)
        row = {"op": op, "way": way, "ring": list(ring) if way != "triton" else None, "err": err, "ok": err < 1e-2,
               "chain_us": timed(lambda fn=run: [fn(i) for i in range(COPIES)]),
               "alone_us": timed(lambda fn=alone: [fn(i) for i in range(COPIES)])}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def harness(way: str, ring: tuple[int, int], out: Path) -> list[dict]:
    """The decode harness with the engine's 64-row linear_partials calls (way "down": down_proj's only; "partials":
    o_proj's too; "none": neither) on prefetch_kernels.linear_partials, weights from launch."""
    from benchmarks import prefetch_kernels as pk
    from benchmarks import throughput
    from engine import triton_gemm

    original = triton_gemm.linear_partials

    def patched(x, w, splits, cfg):
        k = x.shape[1]
        takes = way == "partials" or (way == "down" and k > w.shape[0])
        if takes and x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] <= 64 and k % (splits * 128) == 0:
            return pk.linear_partials(x.contiguous(), w, splits, stages=ring[0], x_stages=ring[1])
        return original(x, w, splits, cfg)

    triton_gemm.linear_partials = patched
    throughput.main(["--out", str(out), "--configs", "interval1", "--scenarios", "64x512x256"])
    return []


def markdown(rows: list[dict]) -> str:
    lines = ["| chain | way | ring (weight boxes, activation boxes) | chain (us) | GEMM alone (us) | rel. err |",
             "|---|---|---|---|---|---|"]
    names = {"gate": "o -> add + norm -> gate_up", "qkv": "down -> add + norm -> qkv",
             "down": "gate_up -> down -> add + norm"}
    for r in rows:
        ring = "-" if r["ring"] is None else "{}, {}".format(*r["ring"])
        wrong = "" if r["ok"] else " WRONG"
        lines.append(f"| {names[r['op']]} | {r['way']} | {ring} | {r['chain_us']:.2f}{wrong} | {r['alone_us']:.2f} | "
                     f"{r['err']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ops", default="gate,qkv,down", help="chains to time, comma-separated: gate, qkv, down")
    ap.add_argument("--harness", choices=HARNESS_WAYS, help="instead: the decode harness at N = 64 (throughput.py, "
                    "interval 1, 64x512x256) with this way's linear_partials calls on the Gluon kernel")
    ap.add_argument("--ring", default="8,4", help="--harness: the Gluon partials' ring, weight boxes,activation boxes")
    args = ap.parse_args(argv)
    ring = args.ring.split(",")
    if len(ring) != 2 or not all(v.strip().isdigit() and int(v) >= 2 for v in ring):
        ap.error(f"--ring must be two counts >= 2, weight boxes,activation boxes; got {args.ring!r}")
    if args.harness:
        return harness(args.harness, (int(ring[0]), int(ring[1])), args.out)
    ops = args.ops.split(",")
    if not ops or not set(ops) <= set(RINGS):
        ap.error(f"--ops must be a comma list of {', '.join(RINGS)}; got {args.ops!r}")
    rows = [r for op in ops for n, ring in enumerate(RINGS[op]) for r in case(op, ring, with_triton=n == 0)]
    from benchmarks.weight_layout_probe import save

    save(args.out, "prefetch", rows, markdown(rows))
    return rows


if __name__ == "__main__":
    main()
