"""Do wider tiles split over K beat one narrow tile a program for the 64-row pair GEMMs (qkv, gate_up)?

A BN-row pair program (gate + up, or a head's dims + their RoPE partners) reads the 64 activation rows (64 x BK x 2
bytes) from L2 for each 2 x BN x BK x 2 bytes of weights: at qkv's BN 16 (192 programs) the activations are two
thirds of what the SMs pull, 50 MB a call against 25 MB of weights. Wider tiles read them fewer times, but fewer
programs stream the weights (the sweep of session 8: BN 32, 96 programs, slower). Splitting K gives the programs
back: BN x S programs over K / S each, the activation bytes those of BN alone. The S partial sums of a tile meet in
the program that arrives last at the tile's counter (a float32 row of its own per split, a release on the counter
after them; the last one adds them in split order, so the sum does not depend on who arrives last, and resets the
counter for the next launch), which runs the epilogue (SiLU x up here).

Timed as gemm_sweep.py times (24 weight copies, a CUDA graph), each output checked against the one-tile launch.
Measured on an H100 (session 34, docs/benchmarks.md): every split slower than one BN 16 (qkv) or BN 64 (gate_up)
tile a program, by 8-53% (qkv) and 35-106% (gate_up).

    python benchmarks/splitk_pair_probe.py --out $OUT/splitk_pair
"""

from __future__ import annotations

import argparse
import json
import sys

from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS, K, BK = 64, 2048, 128
# (label, N pairs, BN, splits, K step); the first of each shape is today's one-tile launch. BN 128 takes K steps of
# 64 (a stage of 128 would be 80 KB)
CASES = (("qkv-sized", 3072, 16, 1, BK), ("qkv-sized", 3072, 32, 1, BK), ("qkv-sized", 3072, 32, 2, BK),
         ("qkv-sized", 3072, 64, 2, BK), ("qkv-sized", 3072, 64, 4, BK),
         ("gate_up", 5632, 64, 1, BK), ("gate_up", 5632, 64, 2, BK), ("gate_up", 5632, 64, 1, 64),
         ("gate_up", 5632, 128, 2, 64), ("gate_up", 5632, 128, 4, 64))


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def split_pair_kernel(x_desc, w_desc, part_ptr, count_ptr, out_ptr, N, KB: tl.constexpr, SPLITS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """silu(x @ gate.T) * (x @ up.T) for tile pid // SPLITS over K blocks of split pid % SPLITS."""
        pid = tl.program_id(0)
        tile, split = pid // SPLITS, pid % SPLITS
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(0, KB // SPLITS):
            kb = split * (KB // SPLITS) + i
            x = x_desc.load([0, kb * BLOCK_K])
            acc_g += tl.dot(x, tl.trans(w_desc.load([tile * BLOCK_N, kb * BLOCK_K])))
            acc_u += tl.dot(x, tl.trans(w_desc.load([N + tile * BLOCK_N, kb * BLOCK_K])))
        r = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        last = True
        if SPLITS > 1:
            mine = part_ptr + pid * (2 * BLOCK_M * BLOCK_N) + r
            tl.store(mine, acc_g, cache_modifier=".cg")
            tl.store(mine + BLOCK_M * BLOCK_N, acc_u, cache_modifier=".cg")
            tl.debug_barrier()  # every thread's stores before the release below
            last = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLITS - 1
            if last:  # the tile's sums in split order, then its counter back to 0
                acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLITS):
                    p = part_ptr + (tile * SPLITS + s) * (2 * BLOCK_M * BLOCK_N) + r
                    acc_g += tl.load(p, cache_modifier=".cg")
                    acc_u += tl.load(p + BLOCK_M * BLOCK_N, cache_modifier=".cg")
                tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
        if last:
            rm = tl.arange(0, BLOCK_M)
            rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            out = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], out.to(out_ptr.dtype.element_ty))

    return split_pair_kernel


def workspace(n: int, bn: int, splits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 partials, one [2, ROWS, bn] row a program; int32 counters, one a tile, zero)."""
    tiles = n // bn
    return (torch.empty(tiles * splits * 2 * ROWS * bn, dtype=torch.float32, device=device),
            torch.zeros(tiles, dtype=torch.int32, device=device))


def launch(x: torch.Tensor, w: torch.Tensor, n: int, bn: int, splits: int, ws: tuple[torch.Tensor, torch.Tensor],
           stages: int = 3, bk: int = BK) -> torch.Tensor:
    """silu(x @ w[:n].T) * (x @ w[n:].T) (w [2n, K]) in n / bn tiles of `splits` programs each, K steps of bk."""
    k_blocks = x.shape[1] // bk
    if k_blocks % splits:
        raise ValueError(f"splits={splits} must divide the K blocks ({k_blocks})")
    from triton.tools.tensor_descriptor import TensorDescriptor

    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [x.shape[0], bk])
    w_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [bn, bk])
    _kernel()[(n // bn * splits,)](x_desc, w_desc, ws[0], ws[1], out, n, KB=k_blocks, SPLITS=splits,
                                    BLOCK_M=x.shape[0], BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=stages)
    return out


def case(label: str, n: int, bn: int, splits: int, bk: int, stages: int) -> dict:
    from benchmarks.gemm_sweep import timed, weights
    from benchmarks.weight_layout_probe import rel_err

    x = torch.randn(ROWS, K, device="cuda", dtype=torch.bfloat16)
    w = weights(2 * n, K)
    ws = workspace(n, bn, splits, x.device)
    want = launch(x, w[0], n, 16, 1, workspace(n, 16, 1, x.device), stages)
    ok = rel_err(launch(x, w[0], n, bn, splits, ws, stages, bk), want) < 1e-3 and not ws[1].any().item()
    us = timed(lambda: [launch(x, p, n, bn, splits, ws, stages, bk) for p in w])
    row = {"shape": label, "bn": bn, "bk": bk, "splits": splits, "programs": n // bn * splits, "stages": stages,
           "us": us, "tbps": w[0].numel() * 2 / us / 1e6, "x_mb": n // bn * ROWS * K * 2 / 1e6, "ok": ok}
    print(json.dumps(row), flush=True)
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | BN | BK | splits | programs | stages | activations read (MB) | us | TB/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        wrong = "" if r["ok"] else " WRONG"
        lines.append(f"| {r['shape']} | {r['bn']} | {r['bk']} | {r['splits']} | {r['programs']} | {r['stages']} | "
                     f"{r['x_mb']:.1f} | {r['us']:.2f}{wrong} | {r['tbps']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stages", default="3,4")
    args = ap.parse_args(argv)
    rows = [case(*c, int(s)) for c in CASES for s in args.stages.split(",")]
    from benchmarks.weight_layout_probe import save

    save(args.out, "splitk_pair", rows, markdown(rows))
    return rows


if __name__ == "__main__":
    main()
