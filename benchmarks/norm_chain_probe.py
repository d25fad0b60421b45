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
The stacked way (session 40; gate_up's at most 3 stages: its boxes are twice as tall) takes the norm's
elementwise work out of the consumer's K loop: x @ w.T = r_h (A1 @ w.T + r_y A2 @ w.T) with A1 = h w_b and
A2 = (w_a y) w_b, which the producer (`stacked_stats_kernel`) writes column by column beside y and the row sums; the
consumers (`stacked_gate_kernel`, `stacked_qkv_kernel`) multiply both, stacked as 128 rows, against each weight box
once and scale the rows after their loops. They leave the new residual h' to the next producer, which forms it
from h, y and the row sums before its own (FORM_H; timed here with the chain before's y at zero).
Measured on an H100 (session 35, docs/benchmarks.md): every carried chain slower, o -> gate_up 40.9-43.2 us against
27.7, down -> qkv 50.4-69.7 against 26.6. The consumers carry it worst (gate_up 33-38 us against 20.1; qkv 34-50
against 12.7: the norm's elementwise work on every K block, and at 4 stages one qkv program an SM); the producers lose
too (o 6.3-9.7 against 5.7, down 12.7-21.6 against 10.9). The stacked way at 3 stages (H100, session 42): o -> gate_up
34.8-40.7 us against 27.3, down -> qkv 51.8-60.1 against 26.3 (consumers gate_up 23.3-28.1 against 19.8, qkv
27.5-35.2 against 12.5: twice the rows a box). The engine keeps its add + norm kernels.

    python benchmarks/norm_chain_probe.py --out $OUT/norm_chain
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS, HIDDEN, INTER, HEADS, HEAD_DIM, EPS = 64, 2048, 5632, 16, 128, 1e-6


def kernels():
    """(stats_kernel, normed_gate_kernel, normed_qkv_kernel): Triton imported where the probe runs them."""
    from benchmarks import norm_chain_kernels as nk

    return nk.stats_kernel, nk.normed_gate_kernel, nk.normed_qkv_kernel


def _desc(t: torch.Tensor, box: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), box)


def _pdl(device) -> dict:
    from engine import pdl

    return pdl.launch_kwargs(device)


def _producer_outputs(a: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int) -> tuple:
    """A whole-K producer's (rows, K, N, tiles, y, stats) for a [rows, K] @ w [N, K].T, its tiles checked."""
    rows, k = a.shape
    n = w.shape[0]
    if n % block_n or k % block_k or rows > 64:
        raise ValueError(f"stats: N={n} must divide by block_n={block_n}, K={k} by block_k={block_k}, rows <= 64")
    tiles = n // block_n
    return (rows, k, n, tiles, torch.empty(rows, n, dtype=a.dtype, device=a.device),
            torch.empty(4, tiles, rows, dtype=torch.float32, device=a.device))


def stats(a: torch.Tensor, w: torch.Tensor, h: torch.Tensor, w_branch: torch.Tensor, block_n: int = 16,
          block_k: int = 128, stages: int = 4) -> dict:
    """The producer: {h, y, stats} for a consumer (a [rows, K] @ w [N, K].T = y; h [rows, N] the residual)."""
    rows, k, n, tiles, y, st = _producer_outputs(a, w, block_n, block_k)
    kernels()[0][(tiles,)](_desc(a, [64, block_k]), _desc(w, [block_n, block_k]), h, w_branch, y, st, rows, n, k,
                           BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=stages,
                           **_pdl(a.device))
    return {"h": h, "y": y, "stats": st}


def stacked_stats(a: torch.Tensor, w: torch.Tensor, h: torch.Tensor, w_branch: torch.Tensor, w_next: torch.Tensor,
                  block_n: int = 16, block_k: int = 128, stages: int = 4, prev: dict | None = None) -> dict:
    """The stacked way's producer: stats' {h, y, stats} and ab [128, N] (A1 = h w_next, then A2 = (w_branch y)
    w_next). With prev ({y, stats, wa} of the chain before, whose residual h is), h is first formed as
    h + rms(prev y) prev wa, and returned as "h"."""
    from benchmarks import norm_chain_kernels as nk

    rows, k, n, tiles, y, st = _producer_outputs(a, w, block_n, block_k)
    ab = torch.empty(128, n, dtype=a.dtype, device=a.device)
    h_out = torch.empty_like(h) if prev else h
    before = (h_out, prev["y"], prev["wa"], prev["stats"], prev["stats"].shape[1]) if prev else (h, h, w_branch, st, 1)
    nk.stacked_stats_kernel[(tiles,)](_desc(a, [64, block_k]), _desc(w, [block_n, block_k]), h, w_branch, w_next, y,
                                      ab, st, *before, EPS, rows, n, k, BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=block_k,
                                      FORM_H=prev is not None, TILES=_tiles_constexpr(before[4]), num_warps=4,
                                      num_stages=stages, **_pdl(a.device))
    return {"h": h_out, "y": y, "stats": st, "ab": ab}


def stacked_gate(p: dict, w_gate_up: torch.Tensor, block_n: int = 64, block_k: int = 128, stages: int = 3,
                 warps: int = 8) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T), x = rms(h + rms(y) w_branch) w_next, from stacked_stats' ab and row sums."""
    from benchmarks import norm_chain_kernels as nk

    rows, k = p["h"].shape
    n = w_gate_up.shape[0] // 2
    out = torch.empty(rows, n, dtype=p["h"].dtype, device=p["h"].device)
    n_tiles = p["stats"].shape[1]
    nk.stacked_gate_kernel[(n // block_n,)](_desc(p["ab"], [128, block_k]), _desc(w_gate_up, [block_n, block_k]),
                                            p["stats"], out, rows, n, k, n_tiles, EPS, BLOCK_M=64, BLOCK_N=block_n,
                                            BLOCK_K=block_k, TILES=_tiles_constexpr(n_tiles), num_warps=warps,
                                            num_stages=stages, **_pdl(out.device))
    return out


def stacked_qkv(p: dict, w_qkv, positions, slots, inv_freq, k_plane, v_plane, n_q_heads: int, n_kv_heads: int,
                head_dim: int, block_d: int = 16, block_k: int = 128, stages: int = 3, warps: int = 4) -> torch.Tensor:
    """normed_qkv's q (k and v into their planes' slots) from stacked_stats' ab and row sums."""
    from benchmarks import norm_chain_kernels as nk

    rows, k = p["h"].shape
    half = head_dim // 2
    q = torch.empty(rows, n_q_heads, head_dim, dtype=p["h"].dtype, device=p["h"].device)
    n_tiles = p["stats"].shape[1]
    grid = ((n_q_heads + 2 * n_kv_heads) * (half // block_d),)
    nk.stacked_qkv_kernel[grid](_desc(p["ab"], [128, block_k]), _desc(w_qkv, [block_d, block_k]), p["stats"],
                                positions, slots, inv_freq, q, k_plane, v_plane, rows, k, n_tiles, EPS, n_q_heads,
                                n_kv_heads, k_plane.stride(0), k_plane.stride(1), HALF=half, BLOCK_M=64,
                                BLOCK_D=block_d, BLOCK_K=block_k, TILES=_tiles_constexpr(n_tiles), num_warps=warps,
                                num_stages=stages, **_pdl(q.device))
    return q


def _normed_args(p: dict, w_branch: torch.Tensor, w_next: torch.Tensor, w: torch.Tensor, block_rows: int,
                 block_k: int) -> tuple:
    h, y = p["h"], p["y"]
    return (_desc(h, [64, block_k]), _desc(y, [64, block_k]), _desc(w_branch.view(1, -1), [1, block_k]),
            _desc(w_next.view(1, -1), [1, block_k]), _desc(w, [block_rows, block_k]), p["stats"])


def _tiles_constexpr(n_tiles: int) -> int:
    """The stats' tile count rounded up to whole chunks of the consumers' sum (at least one)."""
    from benchmarks.norm_chain_kernels import STAT_CHUNK

    chunk = STAT_CHUNK.value
    return max(chunk, -(-n_tiles // chunk) * chunk)


def normed_gate(p: dict, w_branch, w_next, w_gate_up: torch.Tensor, block_n: int = 64, block_k: int = 128,
                stages: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(x @ gate.T) * (x @ up.T), h') with x = rms(h') w_next, h' = h + rms(y) w_branch (p: `stats`)."""
    rows, k = p["h"].shape
    n = w_gate_up.shape[0] // 2
    out, h_out = torch.empty(rows, n, dtype=p["h"].dtype, device=p["h"].device), torch.empty_like(p["h"])
    n_tiles = p["stats"].shape[1]
    kernels()[1][(n // block_n,)](*_normed_args(p, w_branch, w_next, w_gate_up, block_n, block_k), h_out, out, rows,
                                  n, k, n_tiles, EPS, BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=block_k,
                                  TILES=_tiles_constexpr(n_tiles), num_warps=4, num_stages=stages,
                                  **_pdl(out.device))
    return out, h_out


def normed_qkv(p: dict, w_branch, w_next, w_qkv, positions, slots, inv_freq, k_plane, v_plane, n_q_heads: int,
               n_kv_heads: int, head_dim: int, block_d: int = 16, block_k: int = 128,
               stages: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(q after RoPE, h'); k and v go to their planes' slots (triton_gemm.qkv_rope_store's epilogue)."""
    rows, k = p["h"].shape
    half = head_dim // 2
    q = torch.empty(rows, n_q_heads, head_dim, dtype=p["h"].dtype, device=p["h"].device)
    h_out = torch.empty_like(p["h"])
    n_tiles = p["stats"].shape[1]
    grid = ((n_q_heads + 2 * n_kv_heads) * (half // block_d),)
    kernels()[2][grid](*_normed_args(p, w_branch, w_next, w_qkv, block_d, block_k), h_out, positions, slots,
                       inv_freq, q, k_plane, v_plane, rows, k, n_tiles, EPS, n_q_heads, n_kv_heads,
                       k_plane.stride(0), k_plane.stride(1), HALF=half, BLOCK_M=64, BLOCK_D=block_d,
                       BLOCK_K=block_k, TILES=_tiles_constexpr(n_tiles), num_warps=4, num_stages=stages,
                       **_pdl(q.device))
    return q, h_out


def inputs(k_in: int, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = {"device": "cuda", "dtype": torch.bfloat16}
    return {"a": torch.randn(ROWS, k_in, generator=g, **bf), "h": torch.randn(ROWS, HIDDEN, generator=g, **bf),
            "wa": 1 + 0.1 * torch.randn(HIDDEN, generator=g, **bf),
            "wb": 1 + 0.1 * torch.randn(HIDDEN, generator=g, **bf)}


def rope_args() -> dict:
    dev = "cuda"
    return {"positions": torch.arange(ROWS, dtype=torch.int32, device=dev) + 600,
            "slots": torch.arange(ROWS, dtype=torch.int32, device=dev),
            "inv_freq": 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32, device=dev) / HEAD_DIM),
            "k_plane": torch.zeros(ROWS, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev),
            "v_plane": torch.zeros(ROWS, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)}


PRODUCERS = ((16, 128), (16, 256), (32, 128))  # the carried producer's (columns a program, K step)


def _stacked_way(op: str, t: dict, prod, cons, rope: dict, producer: tuple[int, int], stages: int) -> tuple:
    """chains()' stacked way: (chain(i) -> (output, None), its producer alone, its consumer alone, None)."""
    # the residual the stacked consumers leave is formed by the next producer: timed here with the chain before's y
    # at zero, so h stays t["h"] and the output comparable with today's chain
    before = {"y": torch.zeros_like(t["h"]), "wa": t["wa"],
              "stats": torch.zeros(4, HIDDEN // producer[0], ROWS, device="cuda")}

    def produce(i):
        return stacked_stats(t["a"], prod[i], t["h"], t["wa"], t["wb"], *producer, stages=stages, prev=before)

    def consume(p, i):
        if op == "gate":
            return stacked_gate(p, cons[i], stages=stages)
        return stacked_qkv(p, cons[i], *rope.values(), HEADS, HEADS, HEAD_DIM, stages=stages)

    p0 = produce(0)
    return (lambda i: (consume(produce(i), i), None), produce, lambda i: consume(p0, i), None)


def chains(op: str, stages: int, producer: tuple[int, int] = PRODUCERS[0]) -> dict:
    """{way: (chain(i) -> (output, h'), its producer alone, its consumer alone, its add + norm alone or None)} for
    `op` ("gate": o -> gate_up, "qkv": down -> qkv), each a function of the weight copy i; today's way through
    engine/triton_gemm.py at gemm_config(64)."""
    from benchmarks.gemm_sweep import weights
    from engine import triton_gemm as tg
    from engine.gemm_dispatch import gemm_config

    cfg = gemm_config(ROWS)
    k_in, splits = (HIDDEN, cfg.splits_o) if op == "gate" else (INTER, cfg.splits_down)
    t, prod = inputs(k_in), weights(HIDDEN, k_in)
    cons = weights(2 * INTER, HIDDEN) if op == "gate" else weights(3 * HEADS * HEAD_DIM, HIDDEN)
    rope = rope_args()

    def consume_today(x, i):
        if op == "gate":
            return tg.gate_up_silu(x, cons[i], cfg)
        return tg.qkv_rope_store(x, cons[i], rope["positions"], rope["slots"], rope["inv_freq"], rope["k_plane"],
                                 rope["v_plane"], HEADS, HEADS, HEAD_DIM, cfg)

    def consume_carried(p, i):
        if op == "gate":
            return normed_gate(p, t["wa"], t["wb"], cons[i], stages=stages)
        return normed_qkv(p, t["wa"], t["wb"], cons[i], *rope.values(), HEADS, HEADS, HEAD_DIM, stages=stages)

    def today(i):
        h2, x = tg.add_rms_norm2_partials(t["h"], tg.linear_partials(t["a"], prod[i], splits, cfg), t["wa"], t["wb"],
                                          EPS)
        return consume_today(x, i), h2

    def produce(i):
        return stats(t["a"], prod[i], t["h"], t["wa"], *producer, stages=stages)

    def carried(i):
        return consume_carried(produce(i), i)

    p0, x0 = produce(0), torch.randn_like(t["h"])
    zeros = torch.zeros(splits, ROWS, HIDDEN, device="cuda")
    ways = {"today": (today, lambda i: tg.linear_partials(t["a"], prod[i], splits, cfg), lambda i: consume_today(x0, i),
                      lambda i: tg.add_rms_norm2_partials(t["h"], zeros, t["wa"], t["wb"], EPS)),
            "carried": (carried, produce, lambda i: consume_carried(p0, i), None)}
    if op == "qkv" or stages <= 3:  # gate_up's stacked boxes take 64 KB a stage: 4 do not fit
        ways["stacked"] = _stacked_way(op, t, prod, cons, rope, producer, stages)
    return ways


def case(op: str, stages: int, producer: tuple[int, int], with_today: bool) -> list[dict]:
    from benchmarks.gemm_sweep import COPIES, timed
    from benchmarks.weight_layout_probe import rel_err

    ways = chains(op, stages, producer)
    want, want_h = ways["today"][0](0)
    rows = []
    for way, (chain, producer_fn, consumer, norm) in ways.items():
        if way == "today" and not with_today:
            continue
        def each(fn):  # every weight copy's call, as one timed function
            return lambda: [fn(i) for i in range(COPIES)]

        got, got_h = chain(0)  # today's against itself: 0; the stacked way forms no h'
        err = rel_err(got, want)
        ok = err < 2e-2 and (got_h is None or rel_err(got_h, want_h) < 2e-2)
        row = {"op": op, "way": way if way == "today" else "{}, producer {}x{}".format(way, *producer),
               "stages": stages, "ok": ok, "err": err, "chain_us": timed(each(chain)),
               "producer_us": timed(each(producer_fn)), "consumer_us": timed(each(consumer)),
               "norm_us": timed(each(norm)) if norm else 0.0}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [("| chain | way (producer: columns x K step) | stages | chain (us) | producer alone | add + norm alone | "
              "consumer alone | rel. err |"), "|---|---|---|---|---|---|---|---|"]
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
    ap.add_argument("--ops", default="gate,qkv", help="chains to time, comma-separated: gate (o -> gate_up), qkv "
                    "(down -> qkv)")
    args = ap.parse_args(argv)
    ops = args.ops.split(",")
    if not ops or not set(ops) <= {"gate", "qkv"}:
        ap.error(f"--ops must be a comma list of gate, qkv; got {args.ops!r}")
    if not all(s.strip().isdigit() and int(s) >= 2 for s in args.stages.split(",")):
        ap.error(f"--stages must be a comma list of pipeline depths >= 2; got {args.stages!r}")
    rows = [r for op in ops for s in args.stages.split(",") for n, p in enumerate(PRODUCERS)
            for r in case(op, int(s), p, with_today=n == 0)]
    from benchmarks.weight_layout_probe import save

    save(args.out, "norm_chain", rows, markdown(rows))
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
