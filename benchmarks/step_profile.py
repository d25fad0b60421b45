"""Where a decode step's GPU time goes: kernels per step, per-kernel time, GEMM bandwidth, graph gaps.

For each N (requests decoding at once, context ~P + M/2) and config, one engine core is driven to a
pure-decode state, then:
- ``kernels``: 6 steps under torch.profiler with CUDA graphs off: every kernel's name, calls per step and
  GPU time per step (grouped into gemm / attention / fused elementwise / sampling / other), their sum;
- ``graph``: the same engine with graphs on (a second core over the same weights), 30 steps timed with
  CUDA events around the executor: the step's GPU time. graph time - kernel sum = what the gaps cost;
- ``gemm``: each weight shape of the layer at M = N rows, F.linear over 24 distinct copies (no L2 hits),
  replayed in a CUDA graph: us per call and GB/s against the 4.3 TB/s copy bandwidth.

    python benchmarks/step_profile.py --out DIR [--ns 8,64,256] [--configs interval1,deferred8]
        [--gemm table|off|both|qkv] [--block-d-qkv 32] [--block-k-qkv 256]  # 'qkv': the table with the fused qkv + RoPE
        # + store in every bucket, beside the table
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ourobatch import EngineConfig, SamplingParams
from ourobatch.assembly import build_engine_core
from engine import gemm_dispatch
from engine.gemm_dispatch import GemmConfig
from engine.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import add_checkpoint_args, ensure_checkpoint, parse_config  # noqa: E402

GROUPS = (("gemm", ("gemm", "gemv", "sm90", "cutlass", "cublas", "splitk", "nvjet", "linear_partials", "gate_up_silu",
                   "qkv_rope_store")),
          ("attention", ("paged_attn", "_attn", "attention", "combine")),
          ("fused", ("rms_norm", "rope", "silu", "add_rms")),
          ("sampling", ("sample", "softmax", "gumbel", "argmax", "log_softmax", "topk", "sort")))


# The 64-row tiles that won gemm_sweep --tma in isolation (session 12, gemm_sweep_tma.json): o / down 32
# columns, K steps of 256, 2 splits (6.4 / 10.3 us against 6.7 / 10.5); gate_up 32 columns, K steps of 64
# (16.0 against 16.7). In a step (session 13, docs/benchmarks/h200_session13_2026-12-04/tiles64_step_profile.json)
# its gate_up ran 16.7 us against the table's 14.5, and the eager kernels summed 0.26-0.35 ms more per N = 64
# step: not adopted.
TILES64 = dict(block_n=32, block_k=256, splits_o=2, splits_down=2, block_n_gate=32, block_k_gate=64)


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def decoding_core(model_dir, model, args, name: str, N: int, graphs: bool):
    mode, B, s = parse_config(name, 2)
    cfg = EngineConfig(model=model_dir, device="cuda", mode=mode, deep_interval=B, shallow_loops=s,
                       max_num_seqs=N, max_model_len=args.prompt + args.tokens + 64, cuda_graphs=graphs,
                       max_num_batched_tokens=max(8192, N * args.prompt))
    core = build_engine_core(cfg, model=model)
    rng = random.Random(0)
    vocab = core.scheduler.config.vocab_size
    for i in range(N):
        core.add([rng.randrange(vocab) for _ in range(args.prompt)],
                 SamplingParams(max_tokens=args.tokens, seed=i, ignore_eos=True))
    while True:  # prefill everyone, then decode until the context is ~P + M/2
        plan = core.schedule()
        core.update(plan, core.executor.execute(plan))
        if not plan.prefills and core.scheduler.counters.tokens_generated >= N * args.tokens // 2:
            break
    return core


def step(core) -> None:
    plan = core.schedule()
    core.update(plan, core.executor.execute(plan))


def kernel_table(core, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step(core)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(core)
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += 1
            per[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    kernels = sorted(([n, c / steps, t / steps] for n, (c, t) in per.items()), key=lambda r: -r[2])
    groups = collections.defaultdict(lambda: [0.0, 0.0])
    for n, c, t in kernels:
        groups[group_of(n)][0] += c
        groups[group_of(n)][1] += t
    return dict(kernels_per_step=sum(k[1] for k in kernels), kernel_us_per_step=sum(k[2] for k in kernels),
                groups={g: dict(calls=c, us=t) for g, (c, t) in groups.items()},
                top=[dict(name=n[:120], calls=c, us=t) for n, c, t in kernels[:40]])


def graph_time(core, steps: int) -> dict:
    ex = core.executor
    for _ in range(3):
        step(core)
    ex.timing = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(core)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    gpu = sum(ex.timing) / len(ex.timing) / 1e3
    ex.timing = None
    return dict(gpu_ms=1e3 * gpu, wall_ms=1e3 * wall)


def gemm_table(model, ns: list[int]) -> list[dict]:
    layer = model.model.layers[0]
    shapes = dict(qkv=layer.self_attn.qkv_weight, o=layer.self_attn.o_proj.weight,
                  gate_up=layer.mlp.gate_up_weight, down=layer.mlp.down_proj.weight)
    rows = []
    for M in ns:
        for name, w in shapes.items():
            ws = [torch.randn_like(w) * 0.02 for _ in range(24)]
            x = torch.randn(M, w.shape[1], device="cuda", dtype=w.dtype)
            for wi in ws:
                F.linear(x, wi)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for wi in ws:
                    F.linear(x, wi)
            g.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) * 1e3 / (20 * len(ws))
            nbytes = w.numel() * w.element_size()
            rows.append(dict(M=M, gemm=name, shape=list(w.shape), us=us, gb_per_s=nbytes / us / 1e3,
                             floor_us=nbytes / 4.3e6))
            del ws, g
    return rows


def profile_one(model_dir, model, args, config: str, suffix: str, N: int) -> dict:
    core = decoding_core(model_dir, model, args, config, N, graphs=False)
    kt = kernel_table(core, 6)
    core.close()
    core = decoding_core(model_dir, model, args, config, N, graphs=True)
    gt = graph_time(core, 30)
    core.close()
    name = config + suffix
    groups = " ".join(f"{g}={v['us'] / 1e3:.2f}ms/{v['calls']:.0f}" for g, v in kt["groups"].items())
    print(f"N={N} {name}: graph {gt['gpu_ms']:.2f} ms (wall {gt['wall_ms']:.2f}), eager kernels "
          f"{kt['kernels_per_step']:.0f}/step sum {kt['kernel_us_per_step'] / 1e3:.2f} ms: {groups}", flush=True)
    for k in kt["top"][:12]:
        print(f"    {k['calls']:6.0f} x {k['us'] / max(k['calls'], 1):7.1f} us = {k['us'] / 1e3:6.2f} ms  "
              f"{k['name'][:90]}")
    return dict(N=N, config=name, **kt, **gt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ns", default="8,64,256")
    ap.add_argument("--configs", default="interval1,deferred8")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--gemm", default="table", choices=("table", "off", "both", "qkv", "tma", "tiles64"),
                    help="the fused skinny GEMMs: engine/gemm_dispatch.py's table, off (cuBLAS), or both side by "
                         "side ('both': the table if it has rows, else GemmConfig() up to 64 rows); 'qkv': the "
                         "table, and beside it the table with the fused qkv + RoPE + store (--block-d-qkv); "
                         "'tma': the table with GemmConfig.tma 0, 1 and 2 side by side (TMA loads, sm90+); "
                         "'tiles64': the table, and beside it the table whose 64-row bucket has TILES64")
    ap.add_argument("--block-d-qkv", type=int, default=32, help="GemmConfig.block_d_qkv of the 'qkv' variant")
    ap.add_argument("--block-k-qkv", type=int, default=256, help="GemmConfig.block_k_qkv of the 'qkv' variant")
    add_checkpoint_args(ap)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_checkpoint(args)
    model = load_model(model_dir, torch.bfloat16, "cuda")
    model.fuse_projections()
    ns = [int(n) for n in args.ns.split(",")]
    result = dict(gemm=gemm_table(model, ns), steps=[])
    for r in result["gemm"]:
        print(f"gemm M={r['M']:4d} {r['gemm']:8s} {r['us']:7.1f} us  {r['gb_per_s']:6.0f} GB/s  "
              f"floor {r['floor_us']:.1f} us", flush=True)
    table = gemm_dispatch.GEMM_TABLE
    base = table or ((64, GemmConfig()),)
    qkv = tuple((rows, dataclasses.replace(cfg, block_d_qkv=args.block_d_qkv, block_k_qkv=args.block_k_qkv))
                for rows, cfg in base)
    tma = [(f"+tma{t}" if t else "", tuple((rows, dataclasses.replace(cfg, tma=t)) for rows, cfg in base))
           for t in (0, 1, 2)]
    tiles64 = tuple((rows, dataclasses.replace(cfg, **TILES64) if rows == 64 else cfg) for rows, cfg in base)
    variants = {"table": [("", table)], "off": [("", ())], "both": [("", ()), ("+tg", base)],
                "qkv": [("", base), ("+qkv", qkv)], "tma": tma + tma,
                "tiles64": [("", base), ("+tiles64", tiles64)] * 2}[args.gemm]
    for N, config, (suffix, tab) in ((N, c, v) for N in ns for c in args.configs.split(",") for v in variants):
        gemm_dispatch.GEMM_TABLE = tab
        result["steps"].append(profile_one(model_dir, model, args, config, suffix, N))
        (out / "step_profile.json").write_text(json.dumps(result, indent=1))
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
