"""The GEMM side of whole layers, chained, both ways: does the stacked way of benchmarks/norm_chain_probe.py pay
where its producers also form the residual the chain before left unformed?

The probe times each chain (o -> gate_up, down -> qkv) on its own, the residual formed from a zero y. Here 24
layers run back to back as a decode loop pass runs them, attention left out (each layer's o_proj reads one fixed
attention output):
- today: o's split-K partials -> add + norm -> gate_up + SiLU -> down's partials -> add + norm -> qkv + RoPE +
  store (engine/triton_gemm.py at gemm_config(64)): six launches a layer;
- stacked: o's whole-K producer (forming the residual from the down chain before) -> stacked gate_up -> down's
  producer (forming it from o's) -> stacked qkv: four launches a layer, no add + norm kernel.
Timed as gemm_sweep.py times (a CUDA graph of the 24 layers, PDL as the engine launches), in us a layer; the two
ways' last q and final residual compared. The first layer's o producer starts from a formed residual, as a loop
pass's first layer does. Measured on an H100 (session 42, docs/benchmarks.md): today 53.3 us a layer, stacked
87.6-103.0 at the three producer tiles; in the decode step too (benchmarks/stacked_decode.py).

    python benchmarks/norm_chain_layers.py --out $OUT/norm_chain_layers
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import norm_chain_probe as probe

HEADS = (probe.HEADS, probe.HEADS, probe.HEAD_DIM)  # (query heads, key / value heads, head dim): Ouro-1.4B's


def rms(v: torch.Tensor, eps: float = probe.EPS) -> torch.Tensor:
    """v * rsqrt(mean(v^2) + eps) in float32, in v's dtype."""
    f = v.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(v.dtype)


def stacked_layers(a: torch.Tensor, h: torch.Tensor, layers: list[dict], norms: dict, rope: dict, heads: tuple,
                   producer: tuple[int, int] = probe.PRODUCERS[0], stages: int = 3) -> tuple:
    """(each layer's q, the final residual) of `layers` ({o, gate_up, down, qkv} weights) the stacked way: a
    [rows, K_o] the attention output every o_proj reads, h the residual, norms {wa, wb, wc, wd} (o's branch, o's
    next, down's branch, down's next), heads (n_q_heads, n_kv_heads, head_dim), rope {positions, slots, inv_freq,
    k_plane, v_plane}."""
    qs, prev = [], None
    for w in layers:
        p_o = probe.stacked_stats(a, w["o"], h, norms["wa"], norms["wb"], *producer, stages=stages, prev=prev)
        m = probe.stacked_gate(p_o, w["gate_up"], stages=stages)
        p_d = probe.stacked_stats(m, w["down"], p_o["h"], norms["wc"], norms["wd"], *producer, stages=stages,
                                  prev={"y": p_o["y"], "stats": p_o["stats"], "wa": norms["wa"]})
        qs.append(probe.stacked_qkv(p_d, w["qkv"], *rope.values(), *heads, stages=stages))
        prev, h = {"y": p_d["y"], "stats": p_d["stats"], "wa": norms["wc"]}, p_d["h"]
    return qs, h + rms(prev["y"]) * norms["wc"] if prev else h


def today_layers(a: torch.Tensor, h: torch.Tensor, layers: list[dict], norms: dict, rope: dict,
                 heads: tuple) -> tuple:
    """stacked_layers' (qs, final residual) through the engine's 64-row kernels (engine/triton_gemm.py)."""
    from engine import triton_gemm as tg
    from engine.gemm_dispatch import gemm_config

    cfg, qs = gemm_config(a.shape[0]), []
    for w in layers:
        h, x = tg.add_rms_norm2_partials(h, tg.linear_partials(a, w["o"], cfg.splits_o, cfg), norms["wa"],
                                         norms["wb"], probe.EPS)
        m = tg.gate_up_silu(x, w["gate_up"], cfg)
        h, x = tg.add_rms_norm2_partials(h, tg.linear_partials(m, w["down"], cfg.splits_down, cfg), norms["wc"],
                                         norms["wd"], probe.EPS)
        qs.append(tg.qkv_rope_store(x, w["qkv"], *rope.values(), *heads, cfg))
    return qs, h


def inputs() -> tuple:
    """(a, h, the 24 layers' weights, norms, rope) at the Ouro-1.4B shapes, 64 rows, on the GPU."""
    from benchmarks.gemm_sweep import weights

    t = probe.inputs(probe.HEADS * probe.HEAD_DIM)
    g = torch.Generator(device="cuda").manual_seed(1)
    norms = {"wa": t["wa"], "wb": t["wb"]}
    for name in ("wc", "wd"):
        norms[name] = 1 + 0.1 * torch.randn(probe.HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16)
    shapes = {"o": (probe.HIDDEN, probe.HEADS * probe.HEAD_DIM), "gate_up": (2 * probe.INTER, probe.HIDDEN),
              "down": (probe.HIDDEN, probe.INTER), "qkv": (3 * probe.HEADS * probe.HEAD_DIM, probe.HIDDEN)}
    per_name = {name: weights(*shape) for name, shape in shapes.items()}
    layers = [{name: ws[i] for name, ws in per_name.items()} for i in range(len(per_name["o"]))]
    return t["a"], t["h"], layers, norms, probe.rope_args()


def case(stages: int, producer: tuple[int, int], want: tuple | None, data: tuple) -> dict:
    """One way's row: us a layer, and its errors against today's last q and final residual (`want`)."""
    from benchmarks.gemm_sweep import timed
    from benchmarks.weight_layout_probe import rel_err

    if producer is None:
        way, run = "today", lambda: today_layers(*data, HEADS)
    else:
        way, run = "stacked, producer {}x{}".format(*producer), lambda: stacked_layers(*data, HEADS, producer, stages)
    qs, h_end = run()
    errs = (rel_err(qs[-1], want[0][-1]), rel_err(h_end, want[1])) if want else (0.0, 0.0)
    row = {"way": way, "stages": stages, "layer_us": timed(run), "q_err": errs[0],
           "h_err": errs[1], "ok": max(errs) < 5e-2}
    print(json.dumps(row), flush=True)
    return row


def markdown(rows: list[dict]) -> str:
    lines = [("| way (producer: columns x K step) | stages | us a layer | against today | last q rel. err | "
              "residual rel. err |"), "|---|---|---|---|---|---|"]
    base = rows[0]["layer_us"]
    for r in rows:
        base = r["layer_us"] if r["way"] == "today" else base  # each round against its own today
        wrong = "" if r["ok"] else " WRONG"
        stages = r["stages"] or "table"
        lines.append(f"| {r['way']} | {stages} | {r['layer_us']:.2f}{wrong} | {r['layer_us'] - base:+.2f} | "
                     f"{r['q_err']:.1e} | {r['h_err']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stages", default="3", help="the stacked kernels' pipeline depths, comma-separated: 2 or 3 "
                    "(gate_up's stacked boxes at 4 stages do not fit in shared memory)")
    ap.add_argument("--rounds", type=int, default=2, help="times each way runs, alternated")
    args = ap.parse_args(argv)
    if not all(s.strip() in ("2", "3") for s in args.stages.split(",")):
        ap.error(f"--stages must be a comma list of 2 and 3 (gate_up's stacked boxes at 4 stages do not fit in "
                 f"shared memory); got {args.stages!r}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1; got {args.rounds}")
    data = inputs()
    want = today_layers(*data, HEADS)
    rows = []
    for _ in range(args.rounds):
        rows.append(case(0, None, None, data))
        rows += [case(int(s), p, want, data) for s in args.stages.split(",") for p in probe.PRODUCERS]
    from benchmarks.weight_layout_probe import save

    save(args.out, "norm_chain_layers", rows, markdown(rows))
    return rows


if __name__ == "__main__":
    main()
