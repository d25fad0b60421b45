"""Does the 64-row GEMMs' weight layout cost bandwidth? The same gate_up-shaped kernel (two accumulators, a pair of
weight row tiles a program, as engine/triton_gemm.gate_up_silu) reading its TMA boxes from three layouts of the
same weights:
- `rowmajor`: w [2N, K] as the model holds it; a [BN, BK] box is BN rows of BK x 2 bytes strided by K x 2 bytes;
- `blocked`: each (row tile, K block) box stored contiguously ([2N / BN x K / BK x BN, BK]): one box, one stretch
  of memory;
- `paired`: the gate and up boxes of one (tile, K block) side by side (one [2 BN, BK] load, 2 x BN x BK x 2 bytes
  contiguous).
At Ouro-1.4B's gate_up (N 5,632) at BN 64 (88 programs) and 32 (176), and a qkv-sized pair (N 3,072, BN 16 and 32:
192 and 96 programs), K 2,048, 64 rows, stages 3 / 4 (6 does not fit shared memory); timed as gemm_sweep.py times
(24 weight copies, a CUDA graph), each output checked against the row-major one. Reported: us a call and TB/s of
weights.

`--x-once` adds, per layout, a timing-only run whose programs load the activations' first K block once and reuse
it for every K block (outputs not comparable, marked so): what re-reading the 64 activation rows from L2 in every
program costs. A BN-row program reads 64 x BK activation bytes from L2 for each 2 BN x BK of weights, so at BN 16
the activations are two thirds of what the SMs pull. Measured on an H100 (session 34, docs/benchmarks.md): paired
1-6% faster than row-major, blocked 1-2%; reading x once, no faster anywhere.

    python benchmarks/weight_layout_probe.py --out $OUT/weight_layout
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS, K, BK = 64, 2048, 128
LAYOUTS = ("rowmajor", "blocked", "paired")
SHAPES = (("gate_up bn64", 5632, 64), ("gate_up bn32", 5632, 32), ("qkv-sized bn16", 3072, 16),
          ("qkv-sized bn32", 3072, 32))


def pack(w: torch.Tensor, bn: int, bk: int, layout: str) -> torch.Tensor:
    """w [2N, K] in `layout` (a 2-D tensor whose rows are bk wide, or w itself for rowmajor). blocked: box (t, kb)
    of row tile t (of 2N / bn) at rows (t x K / bk + kb) x bn; paired: gate tile t and up tile t's boxes for kb at
    rows (t x K / bk + kb) x 2 bn, gate first."""
    if layout == "rowmajor":
        return w
    rows, k = w.shape
    kb = k // bk
    if layout == "blocked":
        return w.view(rows // bn, bn, kb, bk).permute(0, 2, 1, 3).contiguous().view(-1, bk)
    half = w.view(2, rows // (2 * bn), bn, kb, bk)  # (gate / up, tile, rows of the tile, K block, bk)
    return half.permute(1, 3, 0, 2, 4).contiguous().view(-1, bk)


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def pair_kernel(x_desc, w_desc, out_ptr, N, KB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, LAYOUT: tl.constexpr, X_ONCE: tl.constexpr):
        """silu(x @ gate.T) * (x @ up.T) for gate / up row tile pid, the boxes at the layout's places (X_ONCE: x's
        first K block for every K block, a timing-only variant)."""
        pid = tl.program_id(0)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        if X_ONCE:
            x = x_desc.load([0, 0])
        for kb in range(0, KB):
            if not X_ONCE:
                x = x_desc.load([0, kb * BLOCK_K])
            if LAYOUT == 0:
                acc_g += tl.dot(x, tl.trans(w_desc.load([pid * BLOCK_N, kb * BLOCK_K])))
                acc_u += tl.dot(x, tl.trans(w_desc.load([N + pid * BLOCK_N, kb * BLOCK_K])))
            elif LAYOUT == 1:
                up_tile = N // BLOCK_N + pid
                acc_g += tl.dot(x, tl.trans(w_desc.load([(pid * KB + kb) * BLOCK_N, 0])))
                acc_u += tl.dot(x, tl.trans(w_desc.load([(up_tile * KB + kb) * BLOCK_N, 0])))
            else:
                acc += tl.dot(x, tl.trans(w_desc.load([(pid * KB + kb) * 2 * BLOCK_N, 0])))
        if LAYOUT == 2:
            acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        rm = tl.arange(0, BLOCK_M)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        out = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], out.to(out_ptr.dtype.element_ty))

    return pair_kernel


def launch(x: torch.Tensor, w_packed: torch.Tensor, n: int, bn: int, layout: str, stages: int,
           x_once: bool = False) -> torch.Tensor:
    """silu(x @ w[:n].T) * (x @ w[n:].T) from w packed in `layout` (pack(w, bn, BK, layout)); x_once: the
    timing-only variant (x's first K block throughout)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    box_rows = 2 * bn if layout == "paired" else bn
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [x.shape[0], BK])
    w_desc = TensorDescriptor(w_packed, list(w_packed.shape), list(w_packed.stride()), [box_rows, BK])
    _kernel()[(n // bn,)](x_desc, w_desc, out, n, KB=x.shape[1] // BK, BLOCK_M=x.shape[0], BLOCK_N=bn, BLOCK_K=BK,
                          LAYOUT=LAYOUTS.index(layout), X_ONCE=x_once, num_warps=4, num_stages=stages)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def case(label: str, n: int, bn: int, stages: int, x_once: bool = False) -> list[dict]:
    from benchmarks.gemm_sweep import timed, weights

    x = torch.randn(ROWS, K, device="cuda", dtype=torch.bfloat16)
    ws = weights(2 * n, K)
    want = launch(x, ws[0], n, bn, "rowmajor", stages)
    rows = []
    for layout, once in itertools.product(LAYOUTS, (False, True)[:1 + x_once]):
        packed = [pack(w, bn, BK, layout) for w in ws]
        ok = None if once else rel_err(launch(x, packed[0], n, bn, layout, stages), want) < 1e-3
        us = timed(lambda: [launch(x, p, n, bn, layout, stages, once) for p in packed])  # noqa: B023
        row = {"shape": label, "programs": n // bn, "stages": stages, "layout": layout + ", x once" * once,
               "us": us, "tbps": ws[0].numel() * 2 / us / 1e6, "ok": ok}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | programs | stages | layout | us | TB/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        wrong = {True: "", False: " WRONG", None: " (timing only)"}[r["ok"]]
        lines.append(f"| {r['shape']} | {r['programs']} | {r['stages']} | {r['layout']} | {r['us']:.2f}{wrong} | "
                     f"{r['tbps']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stages", default="3,4")
    ap.add_argument("--x-once", action="store_true", help="add the timing-only runs that read x's first K block once")
    args = ap.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    rows = [r for label, n, bn in SHAPES for s in stages for r in case(label, n, bn, s, args.x_once)]
    save(args.out, "weight_layout", rows, markdown(rows))
    return rows


def save(out: Path, stem: str, rows: list[dict], table: str) -> None:
    """rows as out/stem.json, the table as out/stem.md, and the table printed (the probes' results)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    (out / f"{stem}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
