"""Does a warp-specialized persistent kernel close the phase boundary's cost? The Gluon half of the phase probe.

benchmarks/phase_probe.py measured a chain of 96 skinny GEMM phases (Ouro-1.4B layer-sized, distinct weights)
as PDL-chained kernels (3.7 us per phase above the bytes floor at 8 rows) and as one persistent Triton kernel
with grid barriers (worse: 6.3-10.5 us). There every warp waits at the barrier, so the weight stream stops
at every boundary. Here the stream never waits for a boundary: one CTA per SM, warp-specialized (Gluon,
Triton 3.6's `triton.experimental.gluon`):

- a loader warp TMA-loads the CTA's weight boxes ([BLOCK_N, BLOCK_K] of W_i) of every phase, in order, into
  a ring of STAGES shared-memory slots; it waits only for a free slot (an `empty` mbarrier), never for a
  phase boundary, so while the CTA waits at a boundary the ring fills with the next phase's weights;
- a consumer multiplies the ring's boxes with the phase's activations (x_i = y_(i-1)[:, :K], BLOCK_M <= 16
  rows, 32-64 KB, staged in shared memory once per phase; mma.sync, swap-AB: the 16 weight rows are the MMA's
  M, the batch rows its N) and writes its 16 output columns per tile;
- at each boundary every CTA waits for every CTA's previous phase (a per-phase counter in global memory:
  release increment after the CTA's stores, acquire poll before its loads).

SPLIT (ws_chain_kernel) says who does what. 0: the default partition (4 warps) waits, stages and multiplies;
1: a 1-warp worker does all three; 2: a 1-warp worker multiplies while the default partition waits and stages
into two buffers; 3: as 2, the staging signalled per BLOCK_K chunk so the MMAs start on the first chunk (the
fastest: docs/benchmarks.md, session 14).

Same chain, same columns (whole waves of 16-column tiles), same CUDA-graph timing and torch check as
phase_probe.py; the ways run side by side, each twice in turn:

    python benchmarks/phase_probe_ws.py --out DIR [--rows 8,16,64] [--ways 12:4:0:3,12:4:0:2] [--ways64 12:3:0]
        [--ways64wg 8:4:0]   # 33-64 rows: benchmarks/ws_chain64_wg.py (split K, wgmma, TMA activations)
    python benchmarks/phase_probe_ws.py --compile   # CPU: compile the kernel (benchmarks/ws_chain.py) for sm90
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from phase_probe import BLOCK_N, COPY_TBPS, K, Chain, measure, out_and_sms, phase_columns, rel_err  # noqa: E402
from ws_chain import (BLOCK_K_WS, CHAIN_ALIGNED, chain_signature, compile_sm90, smem_layouts,  # noqa: E402
                      ws_chain_kernel)
from ws_chain64 import compile64_for_sm90, parse_ways64, run_ws64  # noqa: E402
from ws_chain64_wg import compile_wg_for_sm90, parse_ways_wg, run_ws64wg  # noqa: E402


def ws_block_m(rows: int) -> int:
    if rows > 16:
        raise ValueError(f"rows must be <= 16 (the activations are staged in shared memory), got {rows}")
    return 8 if rows <= 8 else 16


def run_ws(chain: Chain, stages: int, sms: int, chains: int = 4, skip: int = 0, split: int = 0,
           chunks: int = 0, stage_k: int = 0) -> None:
    """The chain as one warp-specialized launch of `sms` CTAs (chain.y's slots as phase_probe.py uses them)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    block_m, stage_k = ws_block_m(chain.rows), stage_k or K
    chain.check_whole_waves(sms)
    if stage_k > chain.width:
        raise ValueError(f"stage_k {stage_k} is wider than the chain's activation slots ({chain.width})")
    w_layout, x_layout = smem_layouts(block_m, stage_k)
    desc = TensorDescriptor.from_tensor(chain.w, [BLOCK_N, BLOCK_K_WS], w_layout)
    chain.cnt.zero_()
    ws_chain_kernel[(sms,)](desc, chain.y, chain.cnt, chain.cols_t, chain.w_rows, len(chain.cols), chain.rows,
                            chain.width, chain.y.stride(0), x_layout=x_layout, K=K, BLOCK_M=block_m,
                            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K_WS, STAGES=stages, CHAINS=chains, SKIP=skip,
                            SPLIT=split, CHUNKS=chunks, STAGE_K=stage_k, num_warps=4)


def compile_for_sm90(stages: int = 20, block_m: int = 8, chains: int = 4, skip: int = 0, split: int = 0,
                     chunks: int = 0, stage_k: int = 0) -> dict:
    """ws_chain_kernel compiled for sm90 without a GPU (ws_chain.compile_sm90)."""
    stage_k = stage_k or K
    w_layout, x_layout = smem_layouts(block_m, stage_k)
    constexprs = dict(x_layout=x_layout, K=K, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K_WS, STAGES=stages,
                      CHAINS=chains, SKIP=skip, SPLIT=split, CHUNKS=chunks, STAGE_K=stage_k, num_warps=4)
    return compile_sm90(ws_chain_kernel, chain_signature(w_layout), constexprs, CHAIN_ALIGNED)


def first_call_or_exit(fn, what: str, seconds: float = 60.0) -> None:
    """Run fn once (compiling it) and wait for the GPU with a deadline: a kernel that waits at a barrier
    nobody reaches would hold the device call until its time limit, so the process ends itself instead."""
    fn()
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + seconds
    while not done.query():
        if time.monotonic() > deadline:
            print(f"{what}: not finished after {seconds:.0f} s (a hang); exiting", flush=True)
            os._exit(3)
        time.sleep(0.01)


def parse_ways(text: str) -> list[tuple[int, ...]]:
    """"12:4:0:2,12:4:0:2:0:4096" -> [(stages, chains, skip, split, chunks, stage_k), ...] (ws_chain_kernel's
    constexprs; chunks and stage_k 0 when left out: 256 columns per warp, K)."""
    ways = []
    for item in text.split(","):
        values = [int(v) for v in item.split(":")]
        stages, chains, skip, split, chunks, stage_k = values + [0] * (6 - len(values))
        if (len(values) not in (4, 5, 6) or chains not in (1, 4) or skip not in (0, 1, 2) or not 2 <= stages <= 24
                or split not in (0, 1, 2, 3) or chunks not in (0, 1, 2, 4, 8) or stage_k not in (0, K, 2 * K)
                or (stage_k and split != 2)):
            raise ValueError(f"--ways item {item!r}: stages:chains:skip:split[:chunks[:stage_k]] with stages 2..24, "
                             f"chains 1 or 4, skip 0, 1 or 2, split 0..3, chunks 0, 1, 2, 4 or 8, stage_k 0, {K} or "
                             f"{2 * K} (with split 2)")
        ways.append((stages, chains, skip, split, chunks, stage_k))
    return ways


def first_calls(chain: Chain, ways: dict, names: list[str], ref, result: dict) -> None:
    """Each named way's first call (compiling it), checked for a hang; a way that does not fit is dropped."""
    for name in names:
        chain.y[1:].zero_()
        try:
            first_call_or_exit(ways[name], f"rows={chain.rows} {name}")
        except triton.runtime.errors.OutOfResources as exc:  # e.g. too many ring slots beside 16 rows' buffers
            result["skipped"][name] = str(exc)
            del ways[name]
            print(f"rows={chain.rows} {name}: skipped, {exc}", flush=True)
            continue
        print(f"rows={chain.rows} {name}: first call done, rel err {rel_err(chain.output(), ref):.1e}", flush=True)


def probe(rows: int, layers: int, sms: int, variants: list[tuple[int, ...]],
          variants64: list[tuple[int, int, int]], variants_wg: list[tuple[int, int, int, int]] = (),
          save=lambda result: None) -> dict:
    """Up to 16 rows: the kernels and ws_chain_kernel's `variants`; 17-64 rows: the kernels (16- and 64-column
    tiles), ws_chain64_kernel's `variants64` and (33-64 rows) ws64wg_kernel's `variants_wg`, whose first calls
    come after the other ways have been timed (two rounds) and `save`d."""
    chain = Chain(rows, phase_columns(sms, layers), "cuda")
    ref = chain.reference()
    floor_ms = chain.w.numel() * 2 / (COPY_TBPS * 1e9)
    ways = {"kernels": lambda: chain.run_kernels(pdl=True)}
    if rows > 16:
        ways["kernels_n64"] = lambda: chain.run_kernels(pdl=True, block_n=64)
        for st, xs, sk in variants64:
            ways[f"ws64_s{st}_x{xs}" + ("", "_nomma", "_nobarrier")[sk]] = (
                lambda st=st, xs=xs, sk=sk: run_ws64(chain, st, xs, sms, sk))
        if variants_wg and chain.block_m != 64:
            print(f"rows={rows}: ws64wg takes 33-64 rows (slots of 64); its ways are left out", flush=True)
        for st, sp, sk, gr in variants_wg if chain.block_m == 64 else ():
            ways[f"ws64wg_s{st}_k{sp}" + ("", "_group")[gr] + ("", "_nomma", "_nobarrier", "_nosum")[sk]] = (
                lambda st=st, sp=sp, sk=sk, gr=gr: run_ws64wg(chain, st, sp, sms, sk, gr))
    for v in variants if rows <= 16 else ():
        st, ch, sk, sp, cu, kk = v
        name = (f"ws_s{st}_c{ch}_split{sp}" + (f"_chunks{cu}" if cu else "") + (f"_stage{kk}" if kk else "")
                + ("", "_nomma", "_nobarrier")[sk])
        ways[name] = lambda v=v: run_ws(chain, v[0], sms, *v[1:])
    result = dict(rows=rows, layers=layers, block_n=BLOCK_N, phases=len(chain.cols), floor_ms=floor_ms, ways={},
                  skipped={})
    known = [name for name in ways if not name.startswith("ws64wg")]
    first_calls(chain, ways, known, ref, result)
    if len(known) < len(ways):  # the unproven kernel last: if it hangs, the others' times are already saved
        alone = dict(ways={})
        measure(chain, {name: ways[name] for name in known if name in ways}, ref, floor_ms, alone)
        result["before_ws64wg"] = alone["ways"]
        save(result)
        first_calls(chain, ways, [name for name in ways if name not in known], ref, result)
    measure(chain, ways, ref, floor_ms, result)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--rows", default="8,16,64")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--ways", default="12:4:0:2,12:4:0:3",
                    help="stages:chains:skip:split[:chunks[:stage_k]],... (ring slots of 8 KB weight boxes; 1 or 4 MMA "
                         "chains; skip 1: no MMA, 2: no phase barrier, diagnostics whose output is wrong; split: "
                         "ws_chain_kernel's SPLIT; chunks: the staging's column chunks; stage_k: columns staged)")
    ap.add_argument("--ways64", default="12:3:0", help="17-64 rows: stages:xstages:skip,... (benchmarks/ws_chain64.py)")
    ap.add_argument("--ways64wg", default="8:4:0,8:4:0:1,6:2:0,8:4:1,8:4:2,8:4:3",
                    help="33-64 rows: stages:splits:skip[:group],... (benchmarks/ws_chain64_wg.py: split K, wgmma, "
                         "TMA activations; group 1: a group of CTAs sums the partials at the phase's end)")
    ap.add_argument("--compile", action="store_true", help="CPU: compile for sm90 and print what it built")
    args = ap.parse_args(argv)
    if args.compile:
        for st, ch, sk, sp, cu, kk in parse_ways(args.ways):
            for block_m in (8, 16):
                print(dict(stages=st, chains=ch, skip=sk, split=sp, chunks=cu, stage_k=kk, block_m=block_m,
                           **compile_for_sm90(st, block_m, ch, sk, sp, cu, kk)), flush=True)
        for st, xs, sk in parse_ways64(args.ways64):
            print(dict(stages=st, xstages=xs, skip=sk, block_m=64, **compile64_for_sm90(st, xs, sk)), flush=True)
        for st, sp, sk, gr in parse_ways_wg(args.ways64wg):
            print(dict(kernel="ws64wg", stages=st, splits=sp, skip=sk, group=gr, **compile_wg_for_sm90(st, sp, sk, gr)),
                  flush=True)
        return 0
    out, sms = out_and_sms(ap, args.out)
    results = dict(device=torch.cuda.get_device_name(0), sms=sms, torch=torch.__version__, probes=[])
    for rows in (int(r) for r in args.rows.split(",")):
        def save(partial: dict) -> None:  # so far: the earlier rows' probes and this one's
            (out / "phase_probe_ws.json").write_text(json.dumps({**results, "probes": results["probes"] + [partial]},
                                                                indent=1))

        results["probes"].append(probe(rows, args.layers, sms, parse_ways(args.ways), parse_ways64(args.ways64),
                                       parse_ways_wg(args.ways64wg), save))
        (out / "phase_probe_ws.json").write_text(json.dumps(results, indent=1))
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
