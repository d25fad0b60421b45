"""The Gluon decode attention kernel (engine/gluon_attention.py) against the Triton paged kernel's table pick.

Decode calls only (one new row per request), Ouro-1.4B heads (16 q = 16 kv heads, d = 128), pages of 16,
shuffled block tables, every request at context L; KV copies rotate so one replay defeats the L2
(attention_sweep.py's Problem and timing: a CUDA graph of back-to-back calls, CUDA events, median of 5).
Every output is checked against a float64 reference computed densely from the gathered pages.

    python benchmarks/decode_attention.py --out $OUT/decode_attention      # on an H200
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_sweep import FLUSH_BYTES, HEAD_DIM, PAGE, Problem, kv_bytes, time_call  # noqa: E402
from engine.attention_dispatch import DecodeConfig, decode_config  # noqa: E402

SHAPES = ((1, 640), (4, 640), (8, 640), (16, 640), (32, 640), (64, 640), (8, 2048), (16, 2048))
GLUON_BASES = (DecodeConfig(32, 6), DecodeConfig(64, 3), DecodeConfig(16, 12), DecodeConfig(32, 3), DecodeConfig(16, 6))
PERSISTENT = tuple(DecodeConfig(n, s, ctas_per_sm=k) for n, s, k in ((32, 6, 1), (32, 6, 2), (32, 3, 2), (64, 3, 1),
                                                                      (32, 12, 1)))


def reference(p: Problem, q: torch.Tensor) -> torch.Tensor:
    """Dense float64 attention of each request's one row over its gathered context."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for r in range(p.n):
        ctx = int(p.ctx[r])
        blocks = p.tables[0][r, : -(-ctx // PAGE)].long()
        slots = (blocks[:, None] * PAGE + torch.arange(PAGE, device=q.device)).flatten()[:ctx]
        k = p.k.flatten(0, 1)[slots].double()  # [ctx, heads, d]
        v = p.v.flatten(0, 1)[slots].double()
        s = torch.einsum("hd,chd->hc", q[r].double(), k) * HEAD_DIM**-0.5
        out[r] = torch.einsum("hc,chd->hd", torch.softmax(s, -1), v)
    return out


def candidates(n: int, sms: int) -> list[tuple[str, DecodeConfig | None]]:
    cands: list[tuple[str, DecodeConfig | None]] = [("triton table", None)]
    auto = (decode_config(n, 16, sms) or DecodeConfig()).splits
    for base in GLUON_BASES:
        for splits in sorted({max(1, auto // 2), auto, auto * 2}):
            c = replace(base, splits=splits)
            cands.append((f"gluon n{c.block_n}/s{c.stages}/k{c.splits}" + (" (auto)" if splits == auto else ""), c))
    cands += [(f"gluon n{c.block_n}/s{c.stages}/p{c.ctas_per_sm}", c) for c in PERSISTENT]
    return cands


def run_shape(n: int, ctx: int, sms: int) -> dict:
    from engine import triton_attention
    from engine.gluon_attention import launch_decode_attention

    nbytes = kv_bytes(n, ctx)
    copies = max(1, math.ceil(FLUSH_BYTES / nbytes))
    p = Problem(n, ctx, "cuda", torch.bfloat16, copies, seed=n * 7919 + ctx)
    q, starts = p.inputs(1, seed=ctx)
    ref = reference(p, q)
    res = {"n": n, "ctx": ctx, "floor_us": nbytes / 4.3e12 * 1e6, "candidates": {}}
    for label, c in candidates(n, sms):
        def fn(copy, c=c):
            args = (q, p.k, p.v, p.tables[copy], p.ctx, starts)
            if c is None:
                return triton_attention.launch_paged_attention(*args, 1, HEAD_DIM**-0.5,
                                                               triton_attention.default_config(q, p.k, n, 1))
            return launch_decode_attention(*args, HEAD_DIM**-0.5, c)
        try:
            out = fn(0).double()
            err = float((out - ref).norm() / ref.norm())
            s = time_call(fn, nbytes / 3e12, copies, True)
            res["candidates"][label] = {"us": s * 1e6, "tbps": nbytes / s / 1e12, "rel_err": err, "ok": err < 1e-2}
        except Exception as e:  # noqa: BLE001 - recorded: a config that does not compile or fit
            res["candidates"][label] = {"error": f"{type(e).__name__}: {str(e)[:300]}", "ok": False}
        print(n, ctx, label, res["candidates"][label], flush=True)
    return res


def markdown(results: list[dict]) -> str:
    lines = ["| N | L | floor us | triton table us | best gluon | us | TB/s | gluon auto us | rel err (worst) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r["candidates"]
        tri = c.get("triton table", {})
        gl = {k: v for k, v in c.items() if k.startswith("gluon") and v.get("ok")}
        best = min(gl, key=lambda k: gl[k]["us"], default=None)
        auto = next((v for k, v in c.items() if k.endswith("(auto)") and k.startswith("gluon n32/s6")), {})
        worst = max((v["rel_err"] for v in c.values() if "rel_err" in v), default=math.nan)  # of those that ran
        lines.append(f"| {r['n']} | {r['ctx']} | {r['floor_us']:.1f} | {tri.get('us', math.nan):.1f} | {best} | "
                     f"{gl[best]['us'] if best else math.nan:.1f} | {gl[best]['tbps'] if best else 0:.2f} | "
                     f"{auto.get('us', math.nan):.1f} | {worst:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default=",".join(f"{n}x{c}" for n, c in SHAPES), help="NxL,NxL,...")
    args = ap.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    results = [run_shape(n, ctx, sms) for n, ctx in shapes]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_attention.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    (args.out / "decode_attention.md").write_text(table + "\n")
    print(table)
    return results


if __name__ == "__main__":
    main()
