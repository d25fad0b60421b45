"""The decode step's MLP at 8 rows: the engine's three kernels against the one Gluon launch (engine/gluon_mlp.py),
alone, on 24 layers of Ouro-1.4B-shaped random weights (distinct per layer: 1.66 GB, no L2 reuse).

Each way runs a layer's MLP 24 times in a row (each layer's output the next one's input), captured in a CUDA
graph and timed as phase_probe.py times its chains (PDL on, as in the engine):
- kernels: triton_gemm.add_rms_norm2_partials, gate_up_silu, linear_partials (the engine's path without the fold);
- mlp: gluon_mlp.launch_mlp, with STAGES ring slots (mlpSTAGES), a stager of WARPS warps (wWARPS, default 8),
  SiLU x up staged group by group (g1, the default) or after the grid barrier (g0); diagnostics (the output then
  wrong): d1 no MMAs, d2 no waits for SiLU x up, d3 no add + norm.
Every way twice in turn; us per layer and above the weights' bytes floor (gate_up + down at 4.3 TB/s).

    python benchmarks/mlp_probe.py --out DIR [--ways kernels,mlp12,mlp16,mlp12d1,mlp12d2,mlp12d3] [--layers 24]
        [--between MB]   # a torch copy of MB between layers (timed in both ways; no PDL overlap across it)
        [--attention L]  # the step's attention with o_proj folded in before each MLP (L keys per row), and the
                         # add + norm after it: the step's layer without its qkv kernel
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from phase_probe import COPY_TBPS, timed  # noqa: E402

from engine.mlp_dispatch import new_counters  # noqa: E402
from provenance import commit  # noqa: E402

HIDDEN, INTER, ROWS, EPS = 2048, 5632, 8, 1e-6


class Layers:
    def __init__(self, layers: int, rows: int = ROWS, between_mb: int = 0, context: int = 0) -> None:
        g = torch.Generator(device="cuda").manual_seed(0)
        bf16 = dict(dtype=torch.bfloat16, device="cuda")
        self.gate_up = [(torch.randn(2 * INTER, HIDDEN, generator=g, device="cuda") / HIDDEN**0.5).to(torch.bfloat16)
                        for _ in range(layers)]
        self.down = [(torch.randn(HIDDEN, INTER, generator=g, device="cuda") / INTER**0.5).to(torch.bfloat16)
                     for _ in range(layers)]
        self.w = torch.ones(HIDDEN, **bf16)
        self.h = torch.randn(rows, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
        self.po = torch.randn(1, rows, HIDDEN, generator=g, device="cuda")
        self.barrier = new_counters("cuda")
        # --between: a torch copy (no PDL) between layers, as the step's attention sits between two MLPs
        n = between_mb * 2**20 // 2
        self.copies = [(torch.empty(n, **bf16), torch.empty(n, **bf16)) for _ in range(layers)] if n else []
        # --attention: the step's decode attention with o_proj folded in (gluon_attention_o.py) before each MLP, one
        # request per row, `context` keys each, a KV plane and o_proj weights per layer
        self.context = context
        if context:
            page, heads, d = 16, 16, 128
            pages = -(-context // page)
            self.planes = [[torch.randn(rows * pages, page, heads, d, generator=g, device="cuda").to(torch.bfloat16)
                            for _ in range(2)] for _ in range(layers)]
            self.wo = [(torch.randn(HIDDEN, heads * d, generator=g, device="cuda") / HIDDEN**0.5).to(torch.bfloat16)
                       for _ in range(layers)]
            self.q = torch.randn(rows, heads, d, generator=g, device="cuda").to(torch.bfloat16)
            self.tables = torch.zeros(rows, pages + 2, dtype=torch.int32, device="cuda")  # padded as the engine's
            self.tables[:, :pages] = torch.arange(rows * pages, dtype=torch.int32, device="cuda").view(rows, pages)
            self.lens = torch.full((rows,), context, dtype=torch.int32, device="cuda")
            self.starts = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
            self.o_barrier = torch.zeros(2, dtype=torch.int32, device="cuda")

    def _attention(self, layer: int, h: torch.Tensor, partials_only: bool):
        from engine.attention_dispatch import DecodeConfig
        from engine.gluon_attention_o import launch_decode_attention_o

        k, v = self.planes[layer]
        return launch_decode_attention_o(self.q, k, v, self.tables, self.lens, self.starts, 128**-0.5, DecodeConfig(),
                                         self.wo[layer], self.o_barrier, h, self.w, self.w, EPS,
                                         partials_only=partials_only)

    def _between(self, layer: int) -> None:
        if self.copies:
            dst, src = self.copies[layer]
            dst.copy_(src)

    def kernels(self) -> None:
        from engine import triton_gemm
        from engine.gemm_dispatch import gemm_config

        cfg, h, po = gemm_config(self.h.shape[0]), self.h, self.po
        for layer, (gu, down) in enumerate(zip(self.gate_up, self.down)):
            self._between(layer)
            if self.context:  # attention, o_proj and the add + norm (one launch and the add + norm kernel)
                h, x = self._attention(layer, h, False)
            else:
                h, x = triton_gemm.add_rms_norm2_partials(h, po, self.w, self.w, EPS)
            po = triton_gemm.linear_partials(triton_gemm.gate_up_silu(x, gu, cfg), down, cfg.splits_down, cfg)
            if self.context:  # the add + norm after the MLP
                h, _ = triton_gemm.add_rms_norm2_partials(h, po, self.w, self.w, EPS)

    def mlp(self, stages: int, diag: int, warps: int, groups: int) -> None:
        from engine.gluon_mlp import launch_mlp

        h, po = self.h, self.po
        for layer, (gu, down) in enumerate(zip(self.gate_up, self.down)):
            self._between(layer)
            if self.context:
                po = self._attention(layer, h, True)
            h, po = launch_mlp(h, po, self.w, self.w, gu, down, self.barrier, EPS, stages=stages, diag=diag,
                               warps=warps, groups=groups)
            if self.context:
                from engine import triton_gemm

                h, _ = triton_gemm.add_rms_norm2_partials(h, po, self.w, self.w, EPS)

    def way(self, name: str):
        if name == "kernels":
            return self.kernels
        m = re.fullmatch(r"mlp(\d+)(?:w(\d+))?(?:g(\d))?(?:d(\d))?", name)
        if not m:
            raise ValueError(f"--ways: kernels or mlpSTAGES[wWARPS][gGROUPS][dDIAG] (e.g. mlp8, mlp8w4g0, mlp8d1), "
                             f"got {name!r}")
        return lambda: self.mlp(int(m[1]), int(m[4] or 0), int(m[2] or 8), int(m[3] or 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ways", default="kernels,mlp12,mlp16,mlp12d1,mlp12d2,mlp12d3")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--between", type=int, default=0, help="MB copied by a torch kernel between layers (0: none)")
    ap.add_argument("--attention", type=int, default=0,
                    help="keys per request of a decode attention (o_proj folded in) before each MLP, as in the step")
    args = ap.parse_args(argv)
    layers = Layers(args.layers, between_mb=args.between, context=args.attention)
    floor_us = (2 * INTER * HIDDEN + HIDDEN * INTER) * 2 / (COPY_TBPS * 1e6)
    if args.attention:  # o_proj's weights and the keys and values
        floor_us += (HIDDEN * 2048 + 2 * ROWS * args.attention * 2048) * 2 / (COPY_TBPS * 1e6)
    ways = {name: layers.way(name) for name in args.ways.split(",")}
    result = {"between_mb": args.between, "attention_context": args.attention, "commit": commit(),
              "gpu": torch.cuda.get_device_name(), "floor_us_per_layer": floor_us, "layers": args.layers, "ways": {}}
    for _ in range(2):
        for name, fn in ways.items():
            us = timed(fn) * 1e3 / args.layers
            result["ways"].setdefault(name, []).append(us)
            print(f"{name:12s} {us:7.2f} us per layer ({us - floor_us:+.2f} above the {floor_us:.2f} us floor)",
                  flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = (f"_between{args.between}" if args.between else "") + (
        f"_attention{args.attention}" if args.attention else "")
    (out / f"mlp_probe{tag}.json").write_text(json.dumps(result, indent=1))
    lines = ["| way | us per layer (two rounds) | above the floor |", "|---|---|---|"]
    lines += [f"| {n} | {' / '.join(f'{u:.2f}' for u in v)} | {min(v) - floor_us:+.2f} |"
              for n, v in result["ways"].items()]
    (out / f"mlp_probe{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
