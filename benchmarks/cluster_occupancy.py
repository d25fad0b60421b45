"""How many thread-block clusters of C CTAs one GPU runs at once, by cluster size and shared memory a CTA: the
driver's own answer (cuOccupancyMaxActiveClusters), for a kernel compiled by the project's Triton with num_ctas = C.

It sized the cluster layer kernel for issue 22's N = 64 floor row (docs/decode_floor.md, "What is left"): one
cluster per attention head (16 at Ouro-1.4B) owning its qkv rows, its attention and its K slice of o_proj, so a
cluster's handoffs go through its CTAs' shared memory (~0.1-0.9 us, session 37) instead of L2 and kernel boundaries.
Such a kernel reads at the device's rate only if its clusters are resident together, and a cluster must sit inside
one GPC, so how many of each size the chip holds is the hardware's answer, not 132 / C. This prints it for every size
and shared-memory budget asked, with the CTAs the clusters hold: past 114 KB a CTA (one CTA an SM) those are the SMs
a kernel of such clusters can keep busy. On an H100 (session 47): 15 clusters of 8 (120 SMs), one short of a cluster
per head, which with the costs measured beside it closed that route.
Sizes past 8 are non-portable: the kernel is allowed them (CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED) first.

    python benchmarks/cluster_occupancy.py --out DIR [--sizes 1,2,4,8,16] [--smem-kb 0,120,200] [--warps 4]

Writes cluster_occupancy.json and cluster_occupancy.md in DIR. Needs a CUDA GPU of sm90 or later (clusters).
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # cuda.h's CUfunction_attribute
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4  # cuda.h's CUlaunchAttributeID
SIZES = (1, 2, 4, 8, 16)  # the cluster sizes sm90 can launch (past 8: non-portable)
MAX_SMEM_KB = 227  # a CTA's most shared memory on sm90 (232,448 B)


class CUlaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute: an id, then a 64-byte value union at offset 8 (a cluster's dims: 3 uints)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class CUlaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(CUlaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def parse_list(text: str, name: str, allowed, what: str) -> list[int]:
    """A comma-separated list of ints, each one `allowed` accepts; ValueError naming the flag and `what` is allowed."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(allowed(v) for v in values):
        raise ValueError(f"{name} must be comma-separated integers, each {what}; got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="1,2,4,8,16", help=f"CTAs a cluster, each one of {SIZES}")
    ap.add_argument("--smem-kb", default="0,120,200", help=f"shared memory a CTA, KB, each 0..{MAX_SMEM_KB}")
    ap.add_argument("--warps", type=int, default=4, help="warps a CTA, 1..32")
    args = ap.parse_args(argv)
    try:
        args.sizes = parse_list(args.sizes, "--sizes", lambda v: v in SIZES, f"one of {', '.join(map(str, SIZES))}")
        args.smem_kb = parse_list(args.smem_kb, "--smem-kb", lambda v: 0 <= v <= MAX_SMEM_KB, f"0..{MAX_SMEM_KB}")
        if not 1 <= args.warps <= 32:
            raise ValueError(f"--warps must be 1..32, got {args.warps}")
    except ValueError as e:
        ap.error(str(e))
    return args


def compile_noop(cluster: int, warps: int, target=None):
    """An empty Gluon kernel compiled with num_ctas = cluster (.reqnctapercluster) for `target` (default: this GPU)."""
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon._runtime import GluonASTSource

    @gluon.jit
    def noop(x_ptr):
        pass

    target = target or triton.runtime.driver.active.get_current_target()
    return triton.compile(GluonASTSource(noop, {"x_ptr": "*fp32"}, {}, {}), target=target,
                          options={"num_warps": warps, "num_ctas": cluster})


def noop_function(cluster: int, warps: int) -> int:
    """compile_noop's kernel loaded on this GPU: its CUfunction."""
    kernel = compile_noop(cluster, warps)
    kernel._init_handles()
    return kernel.function


class Driver:
    """The two driver calls, through libcuda; an error comes back as its name, not raised."""

    def __init__(self) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")

    def check(self, result: int) -> str | None:
        if result == 0:
            return None
        name = ctypes.c_char_p()
        self.cuda.cuGetErrorName(result, ctypes.byref(name))
        return (name.value or b"CUDA error %d" % result).decode()

    def max_active_clusters(self, function: int, cluster: int, smem: int, threads: int, sms: int) -> tuple:
        """(clusters, error): how many clusters of `cluster` CTAs of `threads` threads and `smem` bytes of dynamic
        shared memory the GPU holds at once, for a grid of as many clusters as SMs."""
        fn = ctypes.c_void_p(function)
        for attribute, value in ((CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                                 (CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, int(cluster > 8))):
            error = self.check(self.cuda.cuFuncSetAttribute(fn, attribute, value))
            if error:
                return 0, error
        attr = CUlaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
        attr.value[0:3] = [cluster, 1, 1]
        config = CUlaunchConfig(gridDimX=cluster * sms, gridDimY=1, gridDimZ=1, blockDimX=threads, blockDimY=1,
                              blockDimZ=1, sharedMemBytes=smem, hStream=None, attrs=ctypes.pointer(attr), numAttrs=1)
        count = ctypes.c_int(0)
        error = self.check(self.cuda.cuOccupancyMaxActiveClusters(ctypes.byref(count), fn, ctypes.byref(config)))
        return count.value, error


def measure(sizes: list[int], smem_kb: list[int], warps: int) -> dict:
    """One row a (size, shared memory): the clusters held at once and their CTAs."""
    import torch

    torch.zeros(1, device="cuda")  # the primary context, current for Triton's module load
    props = torch.cuda.get_device_properties(0)
    driver, rows = Driver(), []
    for cluster in sizes:
        function = noop_function(cluster, warps)
        for kb in smem_kb:
            clusters, error = driver.max_active_clusters(function, cluster, kb * 1024, 32 * warps,
                                                         props.multi_processor_count)
            rows.append({"cluster": cluster, "smem_kb": kb, "clusters": clusters, "ctas": clusters * cluster,
                         "error": error})
    return {"device": props.name, "sms": props.multi_processor_count, "warps": warps, "rows": rows}


def markdown(report: dict) -> str:
    """The table: clusters held at once and their CTAs, by size and shared memory."""
    header = (f"| CTAs a cluster ({report['device']}, {report['sms']} SMs, {report['warps']} warps a CTA) | shared "
              "memory a CTA | clusters at once | CTAs at once (SMs) | error |")
    lines = [header, "|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['cluster']} | {r['smem_kb']} KB | {r['clusters']} | {r['ctas']} / {report['sms']} | "
                     f"{r['error'] or ''} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = measure(args.sizes, args.smem_kb, args.warps)
    (out / "cluster_occupancy.json").write_text(json.dumps(report, indent=1))
    (out / "cluster_occupancy.md").write_text(markdown(report))
    print(markdown(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
