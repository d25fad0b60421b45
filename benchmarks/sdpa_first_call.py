"""Why prefill's SDPA excludes cuDNN (engine/attention.py): the first call of each new shape, and the steady
time, of causal SDPA at prefill shapes ([chunks, 16 heads, length, 128] bf16), under torch's default backend
order (cuDNN first on sm90 with torch >= 2.10 and cuDNN >= 9.15) and with cuDNN excluded. A first call of a
new shape pays cuDNN's plan build. One GPU, a fresh process (plans are cached per process).

    python benchmarks/sdpa_first_call.py --out DIR      # DIR/sdpa_first_call.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
SHAPES_DEFAULT = [(16, 512), (13, 624), (14, 512), (8, 1024), (3, 2000)]
SHAPES_NO_CUDNN = [(16, 500), (12, 640), (15, 512), (7, 1024), (4, 2000)]  # new shapes again


def call(q: torch.Tensor, backends) -> torch.Tensor:
    if backends is None:
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)
    with sdpa_kernel(backends):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


def ms(fn, reps: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out: dict = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    for name, shapes, backends in (("default", SHAPES_DEFAULT, None), ("no_cudnn", SHAPES_NO_CUDNN, NO_CUDNN)):
        rows = []
        for b, n in shapes:
            q = torch.randn(b, 16, n, 128, device="cuda", dtype=torch.bfloat16)
            first = ms(lambda: call(q, backends), 1)
            for _ in range(3):
                call(q, backends)
            rows.append(dict(b=b, n=n, first_ms=round(first, 2), steady_ms=round(ms(lambda: call(q, backends), 20), 3)))
            print(name, rows[-1], flush=True)
        out[name] = rows
    steady = []
    for b, n in SHAPES_DEFAULT:  # the same shapes under both, all warm
        q = torch.randn(b, 16, n, 128, device="cuda", dtype=torch.bfloat16)
        row = dict(b=b, n=n)
        for name, backends in (("default", None), ("no_cudnn", NO_CUDNN)):
            for _ in range(3):
                call(q, backends)
            row[name] = round(ms(lambda: call(q, backends), 50), 3)
        steady.append(row)
        print("steady", row, flush=True)
    out["steady"] = steady
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sdpa_first_call.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
