"""Can the project's Triton sum split-K partials on the chip, through thread-block clusters and distributed shared
memory?

Sessions 27 and 36 (docs/benchmarks.md) left the N = 64 floor row needing a layer with fewer dependent boundaries, whose
split-K partials would be summed between the CTAs of a cluster instead of through L2. This probe answers what the
installed Triton can express, for sm90, without a GPU:
    gluon_reduce    a Gluon tensor split over the 2 CTAs of a cluster (cga_layout), summed over that axis (gl.sum)
    gluon_convert   the same tensor converted to a layout both CTAs hold (gl.convert_layout: an all-gather)
    gluon_tma_wgmma a 64 x 64 tile's TMA loads, mbarrier and wgmma in each CTA of the cluster (layouts both hold)
    ptx_exchange    a 2-CTA cluster kernel whose CTAs swap a row through inline PTX: st.shared into its own shared
                    memory, barrier.cluster, mapa + ld.shared::cluster from its peer's
    ptx_pingpong    one-way handoffs between the 2 CTAs (pingpong_kernel): a CTA's values and a flag through the
                    receiver's shared memory or through L2, or st.async / one cp.async.bulk into it completing its
                    mbarrier
Each compiles in a child process (Triton 3.6 aborts on some), and reports whether it compiled and its PTX's
distributed-shared-memory instructions. On a GPU (`--gpu`), ptx_exchange runs over a grid of clusters, checked
against torch, and ROUNDS more swaps in its loop give one round's cost (st.shared, two cluster barriers,
the peer's load), beside the same swap through global memory (L2: the split-K partials' path today) and the
barriers alone; ROUNDS more of ptx_pingpong's handoffs give one handoff's cost, for 512 B and 16 KB (a 64 x 64 float32
partial tile) a CTA. Written against Triton 3.6.0 (the H200 image's).

    python benchmarks/cluster_probe.py --out DIR [--gpu]

Measured on an H100 (session 37, docs/benchmarks.md): Triton 3.6 refuses gluon_reduce and gluon_convert (3.9 compiles
both); the inline-PTX kernels are exact; a 512 B handoff costs 0.11 us by st.async and 0.13 by cp.async.bulk into the
peer's mbarrier, 0.93 with a flag in its shared memory, 1.23 with a flag in L2 (16 KB: 0.86, 0.91, 1.41, 2.35); a
barrier.cluster swap 0.79.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CONSTRUCTS = ("gluon_reduce", "gluon_convert", "gluon_tma_wgmma", "ptx_exchange", "ptx_pingpong")
PTX_COUNTS = {"shared_cluster": "shared::cluster", "mapa": "mapa", "cluster_barrier": "barrier.cluster",
              "cluster_launch": ".reqnctapercluster", "st_async": "st.async", "bulk_copy": "cp.async.bulk",
              "release_gpu": "st.release.gpu", "wgmma": "wgmma.mma_async", "tma_load": "cp.async.bulk.tensor"}
N = 128  # floats a CTA swaps
ROUNDS = 1024
sys.path.insert(0, str(Path(__file__).resolve().parent))  # cluster_kernels, phase_probe_ws


def kernels() -> dict:
    """The probe's Gluon kernels by construct (benchmarks/cluster_kernels.py; Triton imported there)."""
    import cluster_kernels as ck

    return {"gluon_reduce": ck.reduce_kernel, "gluon_convert": ck.convert_kernel,
            "gluon_tma_wgmma": ck.tma_wgmma_kernel, "ptx_exchange": ck.exchange_kernel,
            "ptx_pingpong": ck.pingpong_kernel}


VIAS = ("dsmem", "l2", "none")  # exchange_kernel's VIA: the peer's shared memory, global memory, no swap (barriers)
PING_VIAS = ("dsmem", "l2", "async", "bulk")  # pingpong_kernel's: a flag in shared memory, a flag in L2, st.async or
# one cp.async.bulk completing the receiver's mbarrier


def constexprs(name: str, via: str = "dsmem", per_thread: int = 1) -> dict:
    """A construct's compile-time arguments; the exchanges move N x per_thread floats a CTA."""
    from triton.experimental.gluon import language as gl

    both, split = [[0]], [[1]]  # CTA 1 holds what CTA 0 does / the next tile
    if name == "gluon_reduce":
        return {"N": N, "L": gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0], cga_layout=[[1, 0]])}
    if name == "gluon_convert":
        return {"N": 2 * N, "L": gl.BlockedLayout([1], [32], [4], [0], cga_layout=split),
                "M": gl.BlockedLayout([1], [32], [4], [0], cga_layout=both)}
    if name == "gluon_tma_wgmma":
        return {"BAR": gl.SwizzledSharedLayout(1, 1, 1, [0], cga_layout=both),
                "ACC": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16],
                                                 cga_layout=[[0, 0]]),
                "OUT": gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0], cga_layout=[[0, 0]])}
    vias = PING_VIAS if name == "ptx_pingpong" else VIAS
    return {"N": N * per_thread, "L": gl.BlockedLayout([per_thread], [32], [4], [0], cga_layout=both),
            "S": gl.SwizzledSharedLayout(1, 1, 1, [0], cga_layout=both), "VIA": vias.index(via)}


def compile_one(name: str, via: str = "dsmem", per_thread: int = 1) -> dict:
    """Compile one construct for sm90 (2 CTAs a cluster) in this process: whether it compiled, its PTX's counts."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cx = constexprs(name, via, per_thread)
    rounds = {"rounds": "i32"} if name.startswith("ptx_") else {}
    signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", **rounds, **{k: "constexpr" for k in cx}}
    if name == "gluon_tma_wgmma":
        from triton.experimental.gluon import language as gl

        box = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=[[0, 0]])
        signature = {"a_desc": f"tensordesc<bf16[64, 64],{box!r}>", "b_desc": f"tensordesc<bf16[64, 64],{box!r}>",
                     "out_ptr": "*fp32", **{k: "constexpr" for k in cx}}
    try:
        compiled = triton.compile(GluonASTSource(kernels()[name], signature, cx, {}), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4, "num_ctas": 2})
    except Exception as e:  # the compiler's refusal is the answer: the innermost error's last line
        while e.__cause__ is not None:
            e = e.__cause__
        last = next((ln.strip() for ln in reversed(str(e).splitlines()) if ln.strip() != "^"), "")
        return {"compiles": False, "error": f"{type(e).__name__}: {last}"[:400]}
    ptx = compiled.asm["ptx"]
    return {"compiles": True, **{k: ptx.count(v) for k, v in PTX_COUNTS.items()}}


def compile_report() -> dict:
    """Every construct compiled in its own child process (an abort there is reported, not fatal)."""
    import triton

    report = {"triton": triton.__version__, "constructs": {}}
    for name in CONSTRUCTS:
        code = f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import cluster_probe as p; " \
               f"print('RESULT' + json.dumps(p.compile_one({name!r})))"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")]
        # the compiler's own words go to stderr (an assertion, an MLIR verifier error): its first such line
        cause = next((ln.strip()[:300] for ln in done.stderr.splitlines()
                      if "Assertion" in ln or "error:" in ln or "LLVM ERROR" in ln), "")
        result = json.loads(lines[-1][6:]) if lines else \
            {"compiles": False, "error": f"the compiler's process ended with {done.returncode}"}
        if not result["compiles"] and cause:
            result["cause"] = cause
        report["constructs"][name] = result
    return report


def ms_per_launch(launch, times: int = 10) -> float:
    """ms a call of launch (sampler_bench.eager_us: CUDA events around `times` calls after a warm-up call)."""
    from sampler_bench import eager_us

    return eager_us(launch, times) / 1e3


def run_exchange(clusters: int, rounds: int, via: str = "dsmem") -> dict:
    """ptx_exchange on the GPU, `via` one of VIAS: every value against torch's, and ms for the launch (CUDA events,
    after a warm-up that must finish in 60 s)."""
    import torch
    from phase_probe_ws import first_call_or_exit

    kernel = kernels()["ptx_exchange"]
    g = torch.Generator(device="cuda").manual_seed(rounds)
    x = torch.randn(clusters * 2 * N, device="cuda", generator=g)
    y = torch.full_like(x, float("nan"))

    def launch():
        kernel[(clusters,)](x, y, rounds, **constexprs("ptx_exchange", via), num_warps=4, num_ctas=2)

    first_call_or_exit(launch, f"ptx_exchange {via} x {rounds}")
    v = x.view(clusters, 2, N)
    ref, got, peer = v.clone(), y.view(clusters, 2, N), v if via == "none" else v.flip(1)
    for _ in range(rounds):  # the kernel's float32 sums in its order
        ref = ref + 2.0 * peer
    return {"clusters": clusters, "rounds": rounds, "via": via, "equal": bool(torch.equal(got, ref)),
            "unwritten": int(torch.isnan(got).sum()), "ms": ms_per_launch(launch)}


def run_pingpong(clusters: int, rounds: int, via: str, per_thread: int = 1) -> dict:
    """ptx_pingpong on the GPU, N x per_thread floats a handoff: the values against torch's replay of the handoffs,
    and ms for the launch (the flags zeroed before each; a launch that does not finish in 60 s ends the process: a
    lost flag would spin forever)."""
    import torch
    from phase_probe_ws import first_call_or_exit

    kernel, n = kernels()["ptx_pingpong"], N * per_thread
    g = torch.Generator(device="cuda").manual_seed(rounds + per_thread)
    x = torch.zeros(3, clusters * 2 * n, device="cuda")
    x[0] = torch.randn(clusters * 2 * n, device="cuda", generator=g)
    y = torch.full_like(x[0], float("nan"))

    def launch():
        x[1:].zero_()
        kernel[(clusters,)](x, y, rounds, **constexprs("ptx_pingpong", via, per_thread), num_warps=4, num_ctas=2)

    first_call_or_exit(launch, f"ptx_pingpong {via} x {rounds}")
    ref = x[0].view(clusters, 2, n).clone()
    for k in range(rounds):  # round k: the CTA of rank k % 2 hands its values to the other, which adds 1
        ref[:, 1 - k % 2] = ref[:, k % 2] + 1.0
    got = y.view(clusters, 2, n)
    return {"kernel": "pingpong", "clusters": clusters, "rounds": rounds, "via": via, "bytes": 4 * n,
            "equal": bool(torch.equal(got, ref)), "unwritten": int(torch.isnan(got).sum()), "ms": ms_per_launch(launch)}


def gpu_report() -> dict:
    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = ((4 * sms, 1), (sms // 2, 2), (sms // 2, ROUNDS + 2))  # a check; then two timings, ROUNDS apart
    runs = [run_exchange(c, r, v) for v in VIAS for c, r in shapes]
    per_round = {v: (runs[3 * i + 2]["ms"] - runs[3 * i + 1]["ms"]) * 1e3 / ROUNDS for i, v in enumerate(VIAS)}
    pings, handoff = [], {}
    for per_thread in (1, 32):  # 512 B and 16 KB a handoff (a 64 x 64 float32 partial tile)
        for v in PING_VIAS:
            few, many = run_pingpong(sms // 2, 2, v, per_thread), run_pingpong(sms // 2, ROUNDS + 2, v, per_thread)
            pings += [few, many]
            handoff[f"{v}_{4 * N * per_thread}"] = (many["ms"] - few["ms"]) * 1e3 / ROUNDS
    return {"device": torch.cuda.get_device_name(0), "runs": runs + pings, "us_per_round": per_round,
            "us_per_handoff": handoff}


def markdown(report: dict) -> str:
    lines = [f"| construct (Triton {report['triton']}, sm90, 2 CTAs a cluster) | compiles | "
             "shared::cluster / mapa / barrier.cluster | error |", "|---|---|---|---|"]
    for name, r in report["constructs"].items():
        counts = " / ".join(str(r.get(k, "-")) for k in ("shared_cluster", "mapa", "cluster_barrier"))
        why = f"{r.get('error', '')} ({r['cause']})" if r.get("cause") else r.get("error", "")
        lines.append(f"| {name} | {r['compiles']} | {counts} | {why[:300]} |")
    gpu = report.get("gpu")
    if gpu:
        lines += ["", f"| on {gpu['device']}: kernel, via, clusters x rounds | equal to torch | unwritten | ms |",
                  "|---|---|---|---|"]
        lines += [f"| {r.get('kernel', 'exchange')}, {r['via']}, {r['clusters']} x {r['rounds']}"
                  f"{', %d B' % r['bytes'] if 'bytes' in r else ''} | {r['equal']} | {r['unwritten']} | {r['ms']:.4f} |"
                  for r in gpu["runs"]]
        per = gpu["us_per_round"]
        lines.append(f"\none round (a store, two cluster barriers, the peer's load): {per['dsmem']:.3f} us through "
                     f"the peer's shared memory, {per['l2']:.3f} us through L2, {per['none']:.3f} us for the barriers "
                     "alone")
        hand = gpu.get("us_per_handoff")
        if hand:
            lines += ["", "| one handoff, us (a CTA's values, then its flag / the mbarrier's transaction) | "
                      + " | ".join(PING_VIAS) + " |", "|---" * (len(PING_VIAS) + 1) + "|"]
            for size in sorted({int(key.rsplit("_", 1)[1]) for key in hand}):
                lines.append(f"| {size} B | " + " | ".join(f"{hand[f'{v}_{size}']:.3f}" for v in PING_VIAS) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpu", action="store_true", help="also run ptx_exchange on the GPU")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = compile_report()
    if args.gpu:
        report["gpu"] = gpu_report()
    (out / "cluster_probe.json").write_text(json.dumps(report, indent=1))
    (out / "cluster_probe.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
