"""How the 64-row fused GEMMs' time grows with their program count: is a kernel bound by the device's bandwidth
(time grows with the bytes) or by each program's own stream (time stays flat while programs fill idle SMs)?

Each op of engine/triton_gemm.py at the table's 64-row tiles (gemm_dispatch.gemm_config(64)), with every program's
work as at Ouro-1.4B (K = 2048, or o_proj's 2048 in 4 splits), but the output width set so the grid has P programs:
- `gate`: gate_up_silu, 64 gate + 64 up rows a program (Ouro-1.4B: 88 programs);
- `qkv`: qkv_rope_store, a head's 2 x 16 dims a program, 4 a head (Ouro-1.4B: 48 heads, 192 programs);
- `o`: linear_partials in 4 splits of 512, 64 columns a program (Ouro-1.4B: 128 programs).
Timed as gemm_sweep.py times (24 weight copies so the L2 holds none, a CUDA graph, CUDA events), PDL as the engine
launches. Reported: us a call, weight bytes, TB/s of weights, programs per SM.

    python benchmarks/gemm_scaling_probe.py --out DIR [--tiles | --split | --stream | --k-sweep | --narrow]

--narrow: o_proj (K 2048) and down_proj (K 5632) over Ouro-1.4B's 2048 output columns in 8-32 programs over the
whole K, one such program alone, and 32 in 2 splits (the table's 4-split launch beside them): how fast a layer's
whole-row GEMM runs on the SMs of one thread-block cluster (at most 16), where its norm could follow without a kernel
boundary. Each row also
gives the tensor cores' bound for its busiest program at the device's dense bf16 rate spread over its SMs
(`--peak-tflops`, 989: the H100 / H200 SXM sheet), which the bytes do not show.

--k-sweep: gate_up and qkv at their table tiles and program counts (88, 192) over K = 256-8192, and per op the
least-squares line through us against weight MB: its intercept is what a launch costs beyond its bytes in a PDL chain
(pipeline fill and drain), its slope the rate at which the launch streams. Measured on an H100 (session 35,
docs/benchmarks.md): 3.35 us and 2.74 TB/s for gate_up, 3.36 us and 2.69 TB/s for qkv.
"""

from __future__ import annotations

import argparse
import json
import sys

from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.gemm_dispatch import gemm_config, new_stream_flags  # noqa: E402

ROWS, HIDDEN, HEAD_DIM = 64, 2048, 128
PROGRAMS = {"gate": (22, 44, 66, 88, 110, 132, 176, 264), "qkv": (48, 96, 132, 192, 264),
            "o": (32, 64, 128, 132, 192, 264)}


def _gpu():
    """(triton_gemm, gemm_sweep's timed and weights): Triton's kernels, imported where a GPU runs them."""
    from benchmarks.gemm_sweep import timed, weights
    from engine import triton_gemm

    return triton_gemm, timed, weights


def _qkv_calls(tg, x: torch.Tensor, ws: list[torch.Tensor], kv_heads: int, cfg):
    """qkv_rope_store over every weight copy: `kv_heads` kv heads, the rest of a copy's heads q heads, keys and
    values into slot 0 of throwaway planes."""
    planes = torch.zeros(16, kv_heads, HEAD_DIM, device=x.device, dtype=x.dtype)
    index = torch.zeros(ROWS, dtype=torch.int64, device=x.device)
    inv = torch.ones(HEAD_DIM // 2, dtype=torch.float32, device=x.device)
    q_heads = ws[0].shape[0] // HEAD_DIM - 2 * kv_heads
    return lambda: [tg.qkv_rope_store(x, w, index, index, inv, planes, planes, q_heads, kv_heads, HEAD_DIM, cfg)
                    for w in ws]


def case(op: str, programs: int) -> dict:
    tg, timed, weights = _gpu()
    cfg = gemm_config(ROWS)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(ROWS, HIDDEN, **bf)
    if op == "gate":
        inter = 64 * programs
        ws = weights(2 * inter, HIDDEN)
        fn = lambda: [tg.gate_up_silu(x, w, cfg) for w in ws]  # noqa: E731
    elif op == "qkv":
        heads = max(1, programs // 4)  # one kv head, the rest q heads: 4 programs a head at block_d 16
        ws = weights(heads * HEAD_DIM, HIDDEN)
        fn = _qkv_calls(tg, x, ws, 1, cfg)
    else:
        n = 64 * max(1, programs // cfg.splits_o)
        ws = weights(n, HIDDEN)
        fn = lambda: [tg.linear_partials(x, w, cfg.splits_o, cfg) for w in ws]  # noqa: E731
    us = timed(fn)
    wbytes = ws[0].numel() * 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    row = {"op": op, "programs": programs, "per_sm": programs / sms, "us": us, "weight_mb": wbytes / 1e6,
           "tbps": wbytes / us / 1e6}
    print(json.dumps(row), flush=True)
    return row


def tiles(op: str) -> list[dict]:
    """The op at Ouro-1.4B's shape (64 rows) over tiles x stages x warps the table's sweep left out: deeper
    pipelines (more bytes in flight per program) and wider tiles (fewer activation re-reads per weight byte)."""
    tg, _, weights = _gpu()
    base = gemm_config(ROWS)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(ROWS, HIDDEN, **bf)
    out = []
    if op == "qkv":
        ws = weights(48 * HEAD_DIM, HIDDEN)
        grid = [(bd, bk, st, w) for bd in (16, 32) for bk in (64, 128) for st in (3, 4, 6, 8) for w in (4, 8)
                if (ROWS + 2 * bd) * bk * 2 * st <= 200_000]
        for bd, bk, st, w in grid:
            cfg = replace(base, block_d_qkv=bd, block_k_qkv=bk, num_stages=st, num_warps=w)
            out.append(_timed_row(op, f"d{bd}/k{bk}/s{st}/w{w}", _qkv_calls(tg, x, ws, 16, cfg), ws[0]))
    else:
        ws = weights(2 * 5632, HIDDEN)
        grid = [(bn, bk, st, w) for bn in (32, 64) for bk in (64, 128) for st in (3, 4, 6, 8) for w in (4, 8)
                if (ROWS + 2 * bn) * bk * 2 * st <= 200_000]
        for bn, bk, st, w in grid:
            cfg = replace(base, block_n_gate=bn, block_k=bk, num_stages=st, num_warps=w)
            fn = lambda cfg=cfg: [tg.gate_up_silu(x, w_, cfg) for w_ in ws]  # noqa: E731
            out.append(_timed_row(op, f"n{bn}/k{bk}/s{st}/w{w}", fn, ws[0]))
    return out


def split_shapes() -> list[dict]:
    """What a K-split version of qkv and gate would stream, before any fix-up of the partial sums: the same weight
    bytes as Ouro-1.4B's op (25.2 / 46.1 MB), each program over K / S of the hidden size, so S times the programs."""
    tg, _, weights = _gpu()
    base = gemm_config(ROWS)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    out = []
    for k, bd in ((2048, 16), (1024, 32), (1024, 16), (512, 32)):
        heads = 48 * HIDDEN // k
        x = torch.randn(ROWS, k, **bf)
        ws = weights(heads * HEAD_DIM, k)
        fn = _qkv_calls(tg, x, ws, 16, replace(base, block_d_qkv=bd))
        out.append(_timed_row("qkv", f"K{k}/d{bd} ({heads * HEAD_DIM // (2 * bd)} programs)", fn, ws[0]))
    for k, bn in ((2048, 64), (1024, 64), (1024, 32), (512, 64)):
        inter = 5632 * HIDDEN // k
        x = torch.randn(ROWS, k, **bf)
        ws = weights(2 * inter, k)
        cfg = replace(base, block_n_gate=bn)
        fn = lambda x=x, ws=ws, cfg=cfg: [tg.gate_up_silu(x, w_, cfg) for w_ in ws]  # noqa: E731
        out.append(_timed_row("gate", f"K{k}/n{bn} ({inter // bn} programs)", fn, ws[0]))
    return out


def stream_k() -> list[dict]:
    """gate_up + SiLU and qkv + RoPE + store at Ouro-1.4B's shape: the one-tile launches against the stream-K ones
    (engine/triton_streamk.py) at program counts up to one per SM, tiles, K steps and stages; each stream-K output
    checked against the one-tile launch's."""
    tg, _, weights = _gpu()
    from engine import triton_streamk as sk

    base, sms = gemm_config(ROWS), torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    flags = new_stream_flags(x.device)
    ws = weights(2 * 5632, HIDDEN)
    out = [_timed_row("gate", "one tile a program (table)", lambda: [tg.gate_up_silu(x, w, base) for w in ws], ws[0])]
    for programs in (sms, sms - 4, 110, 88):
        for bk, st in ((128, 4), (128, 3), (64, 6), (64, 8)):
            cfg = replace(base, block_k=bk, block_k_gate=0, num_stages=st)
            got, want = sk.gate_up_silu_stream(x, ws[0], cfg, flags, programs), tg.gate_up_silu(x, ws[0], base)
            fn = lambda cfg=cfg, p=programs: [sk.gate_up_silu_stream(x, w, cfg, flags, p) for w in ws]  # noqa: E731
            out.append(_checked_row("gate", f"stream-K {programs} programs, k{bk}/s{st}", fn, ws[0], got, want, flags))
    ws = weights(48 * HEAD_DIM, HIDDEN)
    planes = torch.zeros(64, 16, HEAD_DIM, device=x.device, dtype=x.dtype)
    index = torch.arange(ROWS, device=x.device)
    inv = torch.ones(HEAD_DIM // 2, dtype=torch.float32, device=x.device)
    qkv = lambda w, cfg: tg.qkv_rope_store(x, w, index, index, inv, planes, planes, 16, 16, HEAD_DIM, cfg)  # noqa: E731
    sk_qkv = lambda w, cfg, p: sk.qkv_rope_store_stream(  # noqa: E731
        x, w, index, index, inv, planes, planes, 16, 16, HEAD_DIM, cfg, flags, p)
    out.append(_timed_row("qkv", "one tile a program (table)", lambda: [qkv(w, base) for w in ws], ws[0]))
    for programs in (sms, 96):
        for bd, st in ((16, 4), (16, 6), (16, 8), (32, 4), (32, 6)):
            cfg = replace(base, block_d_qkv=bd, stages_qkv_stream=st)
            got, want = sk_qkv(ws[0], cfg, programs), qkv(ws[0], base)
            fn = lambda cfg=cfg, p=programs: [sk_qkv(w, cfg, p) for w in ws]  # noqa: E731
            out.append(_checked_row("qkv", f"stream-K {programs} programs, d{bd}/s{st}", fn, ws[0], got, want, flags))
    return out


K_SWEEP = (256, 512, 1024, 2048, 4096, 8192)


def k_sweep() -> list[dict]:
    """gate_up + SiLU (88 programs) and qkv + RoPE + store (192) at the table's 64-row tiles over K_SWEEP, then
    line_fit's rows."""
    tg, _, weights = _gpu()
    cfg, rows = gemm_config(ROWS), []
    for k in K_SWEEP:
        x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
        ws = weights(2 * 5632, k)
        rows.append(_timed_row("gate", f"K {k}", lambda x=x, ws=ws: [tg.gate_up_silu(x, w, cfg) for w in ws], ws[0]))
        ws = weights(48 * HEAD_DIM, k)
        rows.append(_timed_row("qkv", f"K {k}", _qkv_calls(tg, x, ws, 16, cfg), ws[0]))
        del x, ws
    return rows + line_fit(rows)


NARROW = ((4, 64, 128, 4), (2, 128, 128, 4), (1, 64, 128, 4), (1, 128, 128, 3), (1, 128, 128, 4),
          (1, 128, 64, 4), (1, 128, 64, 6), (1, 128, 64, 8), (1, 256, 64, 4))  # splits, block_n, block_k, stages


def narrow(peak_tflops: float) -> list[dict]:
    """o_proj and down_proj (64 rows, 2048 columns) at NARROW's launches, each checked against torch's product
    (float32 partials summed), and one program alone (128 columns): us, TB/s of weights, and the tensor cores' bound
    for one program's share."""
    tg, _, weights = _gpu()
    base, sms = gemm_config(ROWS), torch.cuda.get_device_properties(0).multi_processor_count
    per_sm = peak_tflops * 1e12 / sms
    rows = []
    for op, k in (("o", HIDDEN), ("down", 5632)):
        x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
        for n, launches in ((HIDDEN, NARROW), (128, ((1, 128, 128, 4), (1, 128, 64, 6)))):
            ws = weights(n, k)
            want = x.float() @ ws[0].float().T
            for splits, bn, bk, st in launches:
                cfg = replace(base, block_n=bn, block_k=bk, num_stages=st)
                fn = lambda x=x, ws=ws, s=splits, cfg=cfg: [tg.linear_partials(x, w, s, cfg) for w in ws]  # noqa: E731
                programs = -(-n // bn) * splits
                row = _timed_row(op, f"N {n}: {programs} programs, {splits} split(s), n{bn}/k{bk}/s{st}", fn, ws[0])
                if "us" in row:  # compiled and ran: its result against torch's
                    got = tg.linear_partials(x, ws[0], splits, cfg).sum(0)
                    row["rel_err"] = float((got - want).norm() / want.norm())
                    row["tensor_bound_us"] = 2 * ROWS * bn * (k // splits) / per_sm * 1e6
                rows.append(row)
            del ws
    return rows


def line_fit(rows: list[dict]) -> list[dict]:
    """Per op with timed rows at two sizes or more, the least-squares line us = a + b x MB through them (MB = us x
    TB/s): a row with tile "fit", intercept_us a and us_per_mb b, and tbps 1 / b (the rate past the intercept)."""
    fits = []
    for op in dict.fromkeys(r["op"] for r in rows if "us" in r):
        pts = [(r["us"] * r["tbps"], r["us"]) for r in rows if r["op"] == op and "us" in r]
        if len({mb for mb, _ in pts}) < 2:  # no line through fewer than two sizes
            continue
        n, sx, sy = len(pts), sum(p[0] for p in pts), sum(p[1] for p in pts)
        sxx, sxy = sum(p[0] ** 2 for p in pts), sum(p[0] * p[1] for p in pts)
        b = (n * sxy - sx * sy) / (n * sxx - sx * sx)
        a = (sy - b * sx) / n
        fits.append({"op": op, "tile": "fit", "intercept_us": a, "us_per_mb": b, "us": a, "tbps": 1 / b})
    return fits


def _checked_row(op: str, label: str, fn, w: torch.Tensor, got: torch.Tensor, want: torch.Tensor,
                 flags: torch.Tensor) -> dict:
    err = float((got.double() - want.double()).norm() / want.double().norm())
    return {**_timed_row(op, label, fn, w), "rel_err_vs_one_tile": err, "flags_zero": int(flags.abs().sum()) == 0}


def _timed_row(op: str, label: str, fn, w: torch.Tensor) -> dict:
    try:
        us = _gpu()[1](fn)
    except Exception as e:  # noqa: BLE001 - recorded: a tile that does not compile or fit
        row = {"op": op, "tile": label, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    else:
        row = {"op": op, "tile": label, "us": us, "tbps": w.numel() * 2 / us / 1e6}
    print(json.dumps(row), flush=True)
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| op | programs | per SM | us | weights MB | TB/s |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['programs']} | {r['per_sm']:.2f} | {r['us']:.2f} | {r['weight_mb']:.1f} | "
              f"{r['tbps']:.2f} |" for r in rows]
    return "\n".join(lines)


def mode_markdown(rows: list[dict], mode: str) -> str:
    """A mode's table: each timed row's op, tile, us and TB/s (--tiles: by op, fastest first), and for --narrow the
    tensor cores' bound and the error against torch's product; rows that did not compile or run are left out."""
    ok = [r for r in rows if "us" in r]
    if mode == "tiles":
        ok.sort(key=lambda r: (r["op"], r["us"]))
    extra = mode == "narrow"
    head = "| op | tile | us | TB/s |" + (" tensor-core bound us | rel. error |" if extra else "")
    cells = lambda r: f" {r['tensor_bound_us']:.2f} | {r['rel_err']:.1e} |" if extra else ""  # noqa: E731
    return "\n".join([head, "|---" * (head.count("|") - 1) + "|"]
                     + [f"| {r['op']} | {r['tile']} | {r['us']:.2f} | {r['tbps']:.2f} |{cells(r)}" for r in ok])


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ops", default="gate,qkv,o")
    mode = ap.add_mutually_exclusive_group()  # none: the program-count scaling of --ops
    for flag, name, text in (("--tiles", "tiles", "qkv and gate at Ouro-1.4B's shape over tiles x stages"),
                             ("--split", "split", "qkv and gate over K / S with S times the programs"),
                             ("--stream", "stream", "gate, qkv: the one-tile launches against stream-K ones"),
                             ("--k-sweep", "ksweep", "gate, qkv over K: a launch's fixed cost and its rate"),
                             ("--narrow", "narrow", "o, down over 2048 columns in 1-32 programs, most whole-K")):
        mode.add_argument(flag, dest="mode", action="store_const", const=name, help=text)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 TFLOP/s of the device (--narrow)")
    args = ap.parse_args(argv)
    from benchmarks.weight_layout_probe import save

    if args.mode:
        run = {"split": split_shapes, "stream": stream_k, "ksweep": k_sweep, "narrow": lambda: narrow(args.peak_tflops),
               "tiles": lambda: tiles("qkv") + tiles("gate")}
        rows = run[args.mode]()
        save(args.out, f"gemm_{args.mode}", rows, mode_markdown(rows, args.mode) + "\n")
        return rows
    rows = [case(op, p) for op in args.ops.split(",") for p in PROGRAMS[op]]
    save(args.out, "gemm_scaling", rows, markdown(rows) + "\n")
    return rows


if __name__ == "__main__":
    main()
