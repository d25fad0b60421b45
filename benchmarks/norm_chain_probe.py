"""Does the add + norm between two 64-row GEMMs pay as a kernel of its own, or carried into the GEMMs around it?

Today a layer and loop runs o's K-split partials -> add + norm -> gate_up + SiLU, and down's partials -> add + norm
-> the next layer's qkv + RoPE + store (engine/triton_gemm.py): two of its seven kernels read a few rows and write two
(2.55 us each on the H200's timeline, session 18), and each adds a kernel boundary to the chain. Session 10 carried
the add + norm into the GEMMs (39eb78f, reverted) and lost twice over: the producers' split-K partials met through a
counter (three dependent round trips in each tile's tail, +2 us a producer), and the consumers read h and y with plain
loads that Triton's pipeliner left unpipelined (gate_up 15 -> 62 us). This probe rebuilds it without either cost:
- the producer (`stats_kernel`) takes all of K in a program, 16 columns a program (o: 128 programs, as today's four
  splits of 64 columns), so no partials meet: it writes y (bf16) and four row sums over its columns (S0 = sum h^2,
  S1 = sum y^2, S2 = sum h w y, S3 = sum (w y)^2) into stats [4, tiles, rows];
- the consumers (`normed_gate_kernel`, `normed_qkv_kernel`) read h, y and both norm weights through TMA descriptors,
  which Triton pipelines beside the weights, and form x = rms(h + rms(y) w_a) w_b block by block with the reference's
  roundings (sum h'^2 from the S's: S0 + 2 r S2 + r^2 S3); program p writes the new residual's K blocks p, p + P, ...
Timed as gemm_sweep.py times (24 weight copies, a CUDA graph, PDL as the engine launches): each chain (o -> gate_up,
down -> qkv) both ways, and each kernel alone. Outputs checked against today's chain.

    python benchmarks/norm_chain_probe.py --out $OUT/norm_chain
"""

from __future__ import annotations

import argparse
import json
import sys

from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS, HIDDEN, INTER, HEADS, HEAD_DIM, EPS = 64, 2048, 5632, 16, 128, 1e-6


def _cfg(**tiles):
    from engine.gemm_dispatch import gemm_config

    return replace(gemm_config(ROWS), **tiles)


def stats(a: torch.Tensor, w: torch.Tensor, h: torch.Tensor, w_branch: torch.Tensor, block_n: int = 16,
          block_k: int = 128, stages: int = 4, w_next: torch.Tensor | None = None):
    """The producer (triton_norm_gemm.linear_stats) at these tiles: a PendingNorm for a consumer."""
    from engine import triton_norm_gemm as tn

    cfg = _cfg(carry_block_n=block_n, carry_block_k=block_k, carry_stages=stages)
    return tn.linear_stats(a, w, h, w_branch, w_branch if w_next is None else w_next, EPS, cfg)


def normed_gate(p, w_gate_up: torch.Tensor, stages: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(x @ gate.T) * (x @ up.T), h') of the PendingNorm p at the table's gate_up tiles."""
    from engine import triton_norm_gemm as tn

    return tn.gate_up_silu_normed(p, w_gate_up, _cfg(carry_stages=stages))


def normed_qkv(p, w_qkv, positions, slots, inv_freq, k_plane, v_plane, n_q_heads: int, n_kv_heads: int,
               head_dim: int, stages: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(q after RoPE, h') of the PendingNorm p; k and v into their planes' slots, at the table's qkv tiles."""
    from engine import triton_norm_gemm as tn

    return tn.qkv_rope_store_normed(p, w_qkv, positions, slots, inv_freq, k_plane, v_plane, n_q_heads, n_kv_heads,
                                    head_dim, _cfg(carry_stages=stages))


def _inputs(k_in: int, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    return {"a": torch.randn(ROWS, k_in, generator=g, **bf), "h": torch.randn(ROWS, HIDDEN, generator=g, **bf),
            "wa": 1 + 0.1 * torch.randn(HIDDEN, generator=g, **bf),
            "wb": 1 + 0.1 * torch.randn(HIDDEN, generator=g, **bf)}


def _rope_args() -> dict:
    dev = "cuda"
    return {"positions": torch.arange(ROWS, dtype=torch.int32, device=dev) + 600,
            "slots": torch.arange(ROWS, dtype=torch.int32, device=dev),
            "inv_freq": 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32, device=dev) / HEAD_DIM),
            "k_plane": torch.zeros(ROWS, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev),
            "v_plane": torch.zeros(ROWS, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)}


PRODUCERS = ((16, 128), (16, 256), (32, 128))  # the carried producer's (columns a program, K step)


def chains(op: str, stages: int, producer: tuple[int, int] = PRODUCERS[0]) -> dict:
    """{way: (chain(i) -> (output, h'), its producer alone, its consumer alone)} for `op` ("gate": o -> gate_up,
    "qkv": down -> qkv), over weight copies i; today's way through engine/triton_gemm.py at gemm_config(64)."""
    from benchmarks.gemm_sweep import weights
    from engine import triton_gemm as tg
    from engine.gemm_dispatch import gemm_config

    cfg = gemm_config(ROWS)
    k_in, splits = (HIDDEN, cfg.splits_o) if op == "gate" else (INTER, cfg.splits_down)
    t, prod = _inputs(k_in), weights(HIDDEN, k_in)
    cons = weights(2 * INTER, HIDDEN) if op == "gate" else weights(3 * HEADS * HEAD_DIM, HIDDEN)
    rope = _rope_args()

    def consume_today(x, i):
        if op == "gate":
            return tg.gate_up_silu(x, cons[i], cfg)
        return tg.qkv_rope_store(x, cons[i], rope["positions"], rope["slots"], rope["inv_freq"], rope["k_plane"],
                                 rope["v_plane"], HEADS, HEADS, HEAD_DIM, cfg)

    def consume_carried(p, i):
        if op == "gate":
            return normed_gate(p, cons[i], stages=stages)
        return normed_qkv(p, cons[i], *rope.values(), HEADS, HEADS, HEAD_DIM, stages=stages)

    def today(i):
        h2, x = tg.add_rms_norm2_partials(t["h"], tg.linear_partials(t["a"], prod[i], splits, cfg), t["wa"], t["wb"],
                                          EPS)
        return consume_today(x, i), h2

    def produce(i):
        return stats(t["a"], prod[i], t["h"], t["wa"], *producer, stages=stages, w_next=t["wb"])

    def carried(i):
        return consume_carried(produce(i), i)

    p0, x0 = produce(0), torch.randn_like(t["h"])
    zeros = torch.zeros(splits, ROWS, HIDDEN, device="cuda")
    return {"today": (today, lambda i: tg.linear_partials(t["a"], prod[i], splits, cfg), lambda i: consume_today(x0, i),
                      lambda i: tg.add_rms_norm2_partials(t["h"], zeros, t["wa"], t["wb"], EPS)),
            "carried": (carried, produce, lambda i: consume_carried(p0, i), None)}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def case(op: str, stages: int, producer: tuple[int, int], with_today: bool) -> list[dict]:
    from benchmarks.gemm_sweep import COPIES, timed

    ways = chains(op, stages, producer)
    (want, want_h), (got, got_h) = ways["today"][0](0), ways["carried"][0](0)
    ok = rel_err(got, want) < 2e-2 and rel_err(got_h, want_h) < 2e-2
    rows = []
    for way, (chain, producer_fn, consumer, norm) in ways.items():
        if way == "today" and not with_today:
            continue
        row = {"op": op, "way": way if way == "today" else "carried, producer %dx%d" % producer, "stages": stages,
               "ok": ok, "err": rel_err(got, want),
               "chain_us": timed(lambda: [chain(i) for i in range(COPIES)]),
               "producer_us": timed(lambda: [producer_fn(i) for i in range(COPIES)]),
               "consumer_us": timed(lambda: [consumer(i) for i in range(COPIES)]),
               "norm_us": timed(lambda: [norm(i) for i in range(COPIES)]) if norm else 0.0}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| chain | way (producer: columns x K step) | stages | chain (us) | producer alone | add + norm alone | "
             "consumer alone | rel. err |", "|---|---|---|---|---|---|---|---|"]
    names = {"gate": "o -> gate_up", "qkv": "down -> qkv"}
    for r in rows:
        wrong = "" if r["ok"] else " WRONG"
        norm = f"{r['norm_us']:.2f}" if r["norm_us"] else "-"
        lines.append(f"| {names[r['op']]} | {r['way']} | {r['stages']} | {r['chain_us']:.2f}{wrong} | "
                     f"{r['producer_us']:.2f} | {norm} | {r['consumer_us']:.2f} | {r['err']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stages", default="3,4", help="the carried kernels' pipeline depths, comma-separated")
    ap.add_argument("--ops", default="gate,qkv")
    args = ap.parse_args(argv)
    rows = [r for op in args.ops.split(",") for s in args.stages.split(",") for n, p in enumerate(PRODUCERS)
            for r in case(op, int(s), p, with_today=n == 0)]
    from benchmarks.weight_layout_probe import save

    save(args.out, "norm_chain", rows, markdown(rows))
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
