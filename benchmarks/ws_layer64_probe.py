"""The layer-shaped chain at 64 rows as one warp-specialized Gluon launch (benchmarks/ws_layer64.py): do the norms,
the residual stream, SiLU x up and down's 5632-wide K keep the 64-row chain kernel's boundary cost?

benchmarks/ws_layer_probe.py runs these layers (Ouro-1.4B's four GEMMs per layer and what joins them, attention
aside) at 8 rows; this is the same chain (its LayerChain and torch reference, rounded where the kernel stores) at
33-64 rows in benchmarks/ws_chain64_wg.py's design: K split S_IN ways for qkv, o and gate_up and S_DOWN ways for
down (the same 512 columns of K a CTA at Ouro-1.4B's shape: 4 and 11 splits), the partials summed by each group
of CTAs with the rows' 1 / rms and SiLU x up applied there. Each way runs twice in turn in CUDA graphs, checked
against the reference (the first call per stage of the first and last layers), timed against the weights' bytes
floor at 4.3 TB/s; us per phase above the floor compares with phase_probe_ws.py's 64-row kernels.

    python benchmarks/ws_layer64_probe.py --out DIR [--rows 64] [--layers 24] [--ways 8:4:11]
    python benchmarks/ws_layer64_probe.py --compile    # CPU: compile for sm90
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from phase_probe import out_and_sms  # noqa: E402
from ws_chain import compile_sm90  # noqa: E402
from ws_chain64_wg import BOX_K, ROWS, TILE_N, box_layout  # noqa: E402
from ws_layer_probe import LayerChain, measure_layers  # noqa: E402
from ws_layer64 import ws_layer64_kernel  # noqa: E402


def check_way(h: int, inter: int, sms: int, stages: int, s_in: int, s_down: int) -> None:
    """What the kernel needs of a shape, a grid and a way, with the field named."""
    if not 2 <= stages <= 12:
        raise ValueError(f"stages must be 2..12 (16 KB weight boxes), got {stages}")
    if h % (s_in * BOX_K) or inter % (s_down * BOX_K) or h // s_in != inter // s_down:
        raise ValueError(f"s_in and s_down must give every phase the same whole chunks of {BOX_K} (hidden {h} / "
                         f"s_in == intermediate {inter} / s_down), got s_in {s_in}, s_down {s_down}")
    if sms % s_in or sms % s_down:
        raise ValueError(f"the CTAs ({sms}) must be a multiple of s_in ({s_in}) and s_down ({s_down}): a CTA's "
                         "units share a K range")
    if h % TILE_N or inter % TILE_N:
        raise ValueError(f"hidden ({h}) and intermediate ({inter}) sizes must be multiples of {TILE_N}")


def make_chain(rows: int, layers: int, device: str = "cuda", seed: int = 0, h: int = 2048,
               inter: int = 5632) -> LayerChain:
    if not 33 <= rows <= ROWS:
        raise ValueError(f"rows must be 33..{ROWS} (slots of {ROWS} rows), got {rows}")
    return LayerChain(rows, layers, device, seed, h=h, inter=inter, block_m=ROWS)


def scratch(chain: LayerChain, sms: int, s_in: int, s_down: int) -> tuple[torch.Tensor, ...]:
    """The kernel's float32 partials [max split, 64, max(qkv, 2 inter)] (one phase at a time), its ranges' row sums
    [4 layers, CTAs, 64] and its group counts [4 layers, CTAs] (zeroed)."""
    pw, device = max(chain.qkv_cols, 2 * chain.inter), chain.hm.device
    return (torch.empty(max(s_in, s_down), ROWS, pw, dtype=torch.float32, device=device),
            torch.empty(4 * chain.layers, sms, ROWS, dtype=torch.float32, device=device),
            torch.zeros(4 * chain.layers, sms, dtype=torch.int32, device=device))


def launch_args(chain: LayerChain, sms: int, stages: int, s_in: int, s_down: int) -> tuple[tuple, dict]:
    """ws_layer64_kernel's arguments and constexprs, its counts zeroed (a graph captures the memsets)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    h, qkv, inter = chain.h, chain.qkv_cols, chain.inter
    check_way(h, inter, sms, stages, s_in, s_down)
    need = (max(s_in, s_down), sms)
    if getattr(chain, "wg_scratch", None) is None or chain.wg_scratch[0] != need:
        chain.wg_scratch = (need, *scratch(chain, sms, s_in, s_down))
    _, part, rowsq, gcnt = chain.wg_scratch

    def desc(t, width):
        return TensorDescriptor.from_tensor(t.view(-1, width), [ROWS if t.dim() == 3 else TILE_N, BOX_K],
                                            box_layout())

    chain.cnt.zero_()
    gcnt.zero_()
    args = (desc(chain.wq, h), desc(chain.wo, h), desc(chain.wgu, h), desc(chain.wd, inter), desc(chain.qkv, qkv),
            desc(chain.act, inter), chain.hm, chain.d, chain.qkv, chain.o, chain.act, chain.n1, chain.n2, part, rowsq,
            chain.cnt, gcnt, chain.layers, chain.rows)
    return args, dict(H=h, QKV=qkv, INTER=inter, PW=part.shape[2], S_IN=s_in, S_DOWN=s_down, STAGES=stages,
                      num_warps=4)


def run(chain: LayerChain, sms: int, stages: int = 8, s_in: int = 4, s_down: int = 11) -> None:
    args, constexprs = launch_args(chain, sms, stages, s_in, s_down)
    ws_layer64_kernel[(sms,)](*args, **constexprs)


def compile_for_sm90(stages: int = 8, s_in: int = 4, s_down: int = 11, h: int = 2048, inter: int = 5632,
                     use_pdl: bool = False) -> dict:
    """ws_layer64_kernel compiled for sm90 without a GPU (ws_chain.compile_sm90); use_pdl: the build
    ws_step64_probe.py launches a layer at a time with PDL."""
    check_way(h, inter, s_in * s_down, stages, s_in, s_down)
    box = f"tensordesc<bf16[{TILE_N}, {BOX_K}],{box_layout()!r}>"
    rows_box = f"tensordesc<bf16[{ROWS}, {BOX_K}],{box_layout()!r}>"
    signature = {name: box for name in ("wq", "wo", "wgu", "wd")}
    signature.update(qkv_desc=rows_box, act_desc=rows_box)
    pointers = ("hm_ptr", "d_ptr", "qkv_ptr", "o_ptr", "act_ptr", "n1_ptr", "n2_ptr")
    signature.update({name: "*bf16" for name in pointers})
    signature.update(part_ptr="*fp32", rowsq_ptr="*fp32", cnt_ptr="*i32", gcnt_ptr="*i32", num_layers="i32", M="i32")
    constexprs = dict(H=h, QKV=3 * h, INTER=inter, PW=max(3 * h, 2 * inter), S_IN=s_in, S_DOWN=s_down,
                      STAGES=stages, num_warps=4, USE_PDL=use_pdl)
    return compile_sm90(ws_layer64_kernel, signature, constexprs,
                        (*pointers, "part_ptr", "rowsq_ptr", "cnt_ptr", "gcnt_ptr"))


def parse_ways(text: str) -> list[tuple[int, int, int]]:
    """"8:4:11,6:4:11" -> [(weight slots, s_in, s_down), ...]."""
    ways = []
    for item in text.split(","):
        values = [int(v) for v in item.split(":")] if item.strip() else []
        if len(values) != 3:
            raise ValueError(f"--ways item {item!r}: stages:s_in:s_down (16 KB weight slots, the K splits of qkv / o "
                             "/ gate_up and of down)")
        ways.append(tuple(values))
    return ways


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--ways", default="8:4:11,6:4:11", help="stages:s_in:s_down,...")
    ap.add_argument("--compile", action="store_true", help="CPU: compile for sm90 and print what it built")
    args = ap.parse_args(argv)
    ways = {f"ws_layer64_s{st}_k{si}x{sd}": (st, si, sd) for st, si, sd in parse_ways(args.ways)}
    if args.compile:
        for name, way in ways.items():
            print({"way": name, **compile_for_sm90(*way)}, flush=True)
        return 0
    out, sms = out_and_sms(ap, args.out)
    chain = make_chain(args.rows, args.layers)
    measure_layers(chain, {name: (lambda way=way: run(chain, sms, *way)) for name, way in ways.items()},
                   out / "ws_layer64.json", sms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
