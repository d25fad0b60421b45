"""The fused skinny GEMMs of engine/triton_gemm.py against the cuBLAS path, per rows count, on one GPU.

For each rows count M and each of a layer's fused ops, at the Ouro-1.4B shapes, over 24 distinct
weight copies (so the L2 cache holds none of them), replayed in a CUDA graph:
- ``o``: F.linear(a, w_o) + add_rms_norm2   vs  linear_partials(splits) + add_rms_norm2_partials
- ``down``: F.linear(m, w_down) + add_rms_norm2   vs  the same pair at K = intermediate
- ``gate``: F.linear(x, w_gate_up) + silu_mul   vs  gate_up_silu
- ``qkv``: F.linear(x, w_qkv) + rope_store_kv   vs  qkv_rope_store (block_d_qkv, block_k, warps)
every tile config (block_n, block_k, splits) is timed; the best per (op, M) is printed with its ratio to
cuBLAS, and the GEMM_TABLE rows for engine/gemm_dispatch.py. With --around-table, only the table's own tile
for M is timed, at warps 4 / 8 x stages 2-6 (which the tile grid keeps at 4 / 4), for a row the table covers.
With --inductor, the whole stretch between two attention calls (o_proj .. next qkv) compiled by
torch.compile (Inductor, default mode) is timed beside the current fused path and the Triton-GEMM path at M = 8 and 64.

    python benchmarks/gemm_sweep.py --out DIR [--rows 1,8,16,32,64,128] [--ops o,down,gate,qkv] [--inductor]
        [--around-table] [--tma]   # --tma: TMA loads (GemmConfig.tma) beside the pointer loads
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import triton_fused as fused
from engine import triton_gemm as tg
from engine.gemm_dispatch import GemmConfig, gemm_config

H, I, Q, KV = 2048, 5632, 2048, 2048  # hidden, intermediate, q dim, kv dim (Ouro-1.4B)
COPIES, REPS, EPS = 24, 20, 1e-6


def timed(fn) -> float:
    """us per call of fn (which runs COPIES ops), graph-replayed REPS times."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(REPS):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (REPS * COPIES)


def weights(n: int, k: int) -> list[torch.Tensor]:
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]


def around(op: str, cfg: GemmConfig, tma: bool = False):
    """The table's tile for one op at warps 4 / 8 x stages 2-6 (its split count for o / down); with tma, at
    warps 4 x stages 2-6 x GemmConfig.tma 0 / 1 / 2 (pointer loads, TMA weights, TMA weights and activations)."""
    splits = {"o": cfg.splits_o, "down": cfg.splits_down}.get(op, 1)
    stages = (2, 3, 4, 5, 6)
    grid = itertools.product((4,), stages, (0, 1, 2)) if tma else itertools.product((4, 8), stages, (cfg.tma,))
    for w, s, t in grid:
        yield dataclasses.replace(cfg, num_warps=w, num_stages=s, tma=t), splits


def configs(op: str):
    if op == "qkv":
        for bd, bk, w in itertools.product((16, 32, 64), (64, 128, 256), (4, 8)):
            yield GemmConfig(block_d_qkv=bd, block_k_qkv=bk, num_warps=w), 1
        return
    if op == "gate":
        for bn, bk in itertools.product((16, 32, 64), (64, 128, 256)):
            yield GemmConfig(block_n_gate=bn, block_k=bk), 1
    else:
        for bn, bk, s in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8)):
            yield GemmConfig(block_n=bn, block_k=bk), s


def sweep_op(op: str, M: int, around_table: bool = False, tma: bool = False) -> dict:
    k = {"o": Q, "down": I, "gate": H, "qkv": H}[op]
    ws = weights(2 * I, H) if op == "gate" else weights(Q + 2 * KV, H) if op == "qkv" else weights(H, k)
    x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    wa, wb = (torch.ones(H, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    # qkv: positions, slots (M distinct ones), inv_freq and the K / V planes of the Ouro-1.4B heads (d = 128)
    pos = torch.arange(M, device="cuda") + 500
    slots = torch.arange(M, device="cuda") * 3
    inv_freq = 10000.0 ** (-torch.arange(0, 128, 2, device="cuda", dtype=torch.float32) / 128)
    kp, vp = (torch.zeros(3 * M, KV // 128, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if op == "gate":
        base = timed(lambda: [fused.silu_mul(F.linear(x, w)) for w in ws])
    elif op == "qkv":
        base = timed(lambda: [fused.rope_store_kv(F.linear(x, w), pos, slots, inv_freq, kp, vp, Q // 128, KV // 128,
                                                  128) for w in ws])
    else:
        base = timed(lambda: [fused.add_rms_norm2(h, F.linear(x, w), wa, wb, EPS) for w in ws])
    rows = []
    table_cfg = gemm_config(M)
    if around_table and table_cfg is not None:
        candidates = around(op, table_cfg, tma)
    elif tma:  # the tile grid with TMA loads of weights and activations, beside the table's own tile without
        table_splits = {"o": table_cfg.splits_o, "down": table_cfg.splits_down}.get(op, 1) if table_cfg else 1
        candidates = itertools.chain([(table_cfg, table_splits)] if table_cfg else [],
                                     ((dataclasses.replace(c, tma=2), s) for c, s in configs(op)))
    else:
        candidates = configs(op)
    for cfg, splits in candidates:
        try:
            if op == "gate":
                us = timed(lambda: [tg.gate_up_silu(x, w, cfg) for w in ws])
            elif op == "qkv":
                us = timed(lambda: [tg.qkv_rope_store(x, w, pos, slots, inv_freq, kp, vp, Q // 128, KV // 128, 128, cfg)
                                    for w in ws])
            else:
                us = timed(lambda: [tg.add_rms_norm2_partials(h, tg.linear_partials(x, w, splits, cfg), wa, wb, EPS)
                                    for w in ws])
        except Exception as exc:  # noqa: BLE001 - a tile that does not fit (shared memory): skip it
            rows.append(dict(cfg=cfg.__dict__, splits=splits, error=f"{type(exc).__name__}"))
            continue
        rows.append(dict(cfg=cfg.__dict__, splits=splits, us=us))
    ok = [r for r in rows if "us" in r]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    ws.clear()  # the lambdas above still name ws: empty it (frees the copies) rather than del it
    torch.cuda.empty_cache()
    return dict(op=op, M=M, cublas_us=base, best=best, speedup=base / best["us"] if best else None, all=rows)


def check_exact_enough(M: int) -> dict:
    """bf16 outputs of the fused kernels against the cuBLAS path (relative error)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    ref = fused.silu_mul(F.linear(x, w)).double()
    got = tg.gate_up_silu(x, w, GemmConfig()).double()
    wo = torch.randn(H, Q, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    h = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=g)
    wa = torch.ones(H, device="cuda", dtype=torch.bfloat16)
    r_h, r_x = fused.add_rms_norm2(h, F.linear(x, wo), wa, wa, EPS)
    g_h, g_x = tg.add_rms_norm2_partials(h, tg.linear_partials(x, wo, 4, GemmConfig()), wa, wa, EPS)
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    return dict(M=M, gate_rel=rel(got, ref), o_h_rel=rel(g_h, r_h), o_x_rel=rel(g_x, r_x))


def inductor_compare(M: int) -> dict:
    """o_proj .. next qkv (everything between two attention calls) three ways, per layer."""
    wq, wo, wgu, wd = weights(Q + 2 * KV, H), weights(H, Q), weights(2 * I, H), weights(H, I)
    n1, n2, n3, n4 = (torch.ones(H, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    a = torch.randn(M, Q, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)

    def rms(t, w):
        tf = t.float()
        return (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + EPS)).to(t.dtype) * w

    def plain(a, h, wo, wgu, wd, wq):
        h = h + rms(F.linear(a, wo), n1)
        g, u = F.linear(rms(h, n2), wgu).chunk(2, dim=-1)
        h = h + rms(F.linear(F.silu(g) * u, wd), n3)
        return h, F.linear(rms(h, n4), wq)

    def ours(a, h, wo, wgu, wd, wq):
        h, x = fused.add_rms_norm2(h, F.linear(a, wo), n1, n2, EPS)
        h, x = fused.add_rms_norm2(h, F.linear(fused.silu_mul(F.linear(x, wgu)), wd), n3, n4, EPS)
        return h, F.linear(x, wq)

    cfg = GemmConfig()

    def triton_gemms(a, h, wo, wgu, wd, wq):
        h, x = tg.add_rms_norm2_partials(h, tg.linear_partials(a, wo, cfg.splits_o, cfg), n1, n2, EPS)
        m = tg.gate_up_silu(x, wgu, cfg)
        h, x = tg.add_rms_norm2_partials(h, tg.linear_partials(m, wd, cfg.splits_down, cfg), n3, n4, EPS)
        return h, F.linear(x, wq)

    compiled = torch.compile(plain, dynamic=False)
    out = {}
    for name, fn in (("fused_now", ours), ("triton_gemm", triton_gemms), ("inductor", compiled)):
        out[name] = timed(lambda fn=fn: [fn(a, h, wo[i], wgu[i], wd[i], wq[i]) for i in range(COPIES)])
    return dict(M=M, **out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,8,16,32,64,128")
    ap.add_argument("--ops", default="o,down,gate,qkv")
    ap.add_argument("--inductor", action="store_true")
    ap.add_argument("--around-table", action="store_true",
                    help="time only GEMM_TABLE's tile per M, at warps 4 / 8 x stages 2-6 (rows the table covers)")
    ap.add_argument("--tma", action="store_true",
                    help="with --around-table: warps 4 x stages 2-6 x GemmConfig.tma 0 / 1 / 2; without: the tile "
                         "grid with tma 2 beside the table's tile (tma 0); the best of each tma value printed")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = dict(checks=[check_exact_enough(M) for M in (8, 64)], sweep=[], inductor=[])
    print("checks", result["checks"], flush=True)
    for M in (int(m) for m in args.rows.split(",")):
        for op in args.ops.split(","):
            if args.around_table and (gemm_config(M) is None or (op == "qkv" and not gemm_config(M).block_d_qkv)):
                continue  # cuBLAS at this M (or its qkv): no tile of the table to vary
            r = sweep_op(op, M, args.around_table, args.tma)
            result["sweep"].append(r)
            b = r["best"]
            print(f"M={M:4d} {op:5s} cuBLAS path {r['cublas_us']:6.1f} us  "
                  f"best {b['us'] if b else float('nan'):6.1f} us "
                  f"x{r['speedup'] or 0:.2f}  {b['cfg'] if b else None} splits={b['splits'] if b else None}",
                  flush=True)
            if args.tma:
                for t in (0, 1, 2):
                    ok = [c for c in r["all"] if c["cfg"]["tma"] == t and "us" in c]
                    best = min(ok, key=lambda c: c["us"]) if ok else None
                    print(f"    tma={t}: best {best['us'] if best else float('nan'):6.1f} us "
                          f"stages={best['cfg']['num_stages'] if best else None}", flush=True)
            (out / "gemm_sweep.json").write_text(json.dumps(result, indent=1))
    if args.inductor:
        for M in (8, 64):
            r = inductor_compare(M)
            result["inductor"].append(r)
            print(f"between attention calls, M={M}: " + ", ".join(f"{k} {v:.1f} us" for k, v in r.items() if k != "M"),
                  flush=True)
            (out / "gemm_sweep.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
