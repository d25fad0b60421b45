"""Pulling the next GEMM's weights into L2 from the short kernel before it (Hopper's bulk L2 prefetch).

Theory of operation. At a few rows a decode step's kernels are bound by latency, not bandwidth: the
add + norm kernels (2.8 us at N = 8) and the attention combine (1.3 us) read a few kilobytes, and the
split-K GEMMs before them stream their weights at 1.3-2.4 TB/s of the 4.3 (docs/benchmarks.md, session 9).
So the DRAM is half idle exactly when the next GEMM's weights could be on their way. Weights never depend
on a kernel of the step, so a kernel may ask for them before its PDL wait (engine/pdl.py): the request then
overlaps the tail of the kernel before it as well as its own short work.

What is asked for, and by whom (engine/model.py ``_run_loops_fused``, amounts from GemmConfig):
- the combine after split-K attention: all of o_proj (8 MB; ``prefetch_o``);
- the add + norm after o_proj: the first ``prefetch_k_gate_up`` elements of every gate_up row;
- the add + norm after down_proj: the first ``prefetch_k_qkv`` elements of every row of the next layer's
  qkv (the first layer's for the next loop; nothing after the last loop).
Every row's prefix rather than whole rows: each program of the next GEMM walks its rows from K = 0, so
each finds its first blocks in L2, and none waits on DRAM longer than the others.

Session 8 measured a different prefetch and lost (+26% at N = 8): each GEMM prefetched *its own* weights
before its wait, all of them, so the requests were doubled and raced the loads they were meant to serve.

`Prefetch` is the host-side description (this module needs no Triton); triton_gemm.prefetch_l2 is the
jitted helper a kernel calls with its share of the rows. ``OUROBATCH_L2_PREFETCH=0`` turns it off; it is off below compute capability 9.0 (no bulk prefetch)
and on CPU tensors (Triton's interpreter has no inline PTX). Turning it on or off never changes a result.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

ENV_VAR = "OUROBATCH_L2_PREFETCH"
_ENABLED: dict[int, bool] = {}


@dataclass(frozen=True)
class Prefetch:
    """The first `k` elements of every row of `weight` [N, K] (row-major, 16-byte aligned rows)."""

    weight: torch.Tensor
    k: int

    def args(self) -> tuple[torch.Tensor, int, int, int]:
        """(pointer, rows, row stride in elements, bytes per row) for a kernel; 0 rows where there is nothing
        to do or the bulk prefetch's 16-byte alignment does not hold."""
        w = self.weight
        k = min(self.k, w.shape[-1])
        nbytes = k * w.element_size()
        aligned = (w.dim() == 2 and w.stride(-1) == 1 and w.data_ptr() % 16 == 0
                   and (w.stride(0) * w.element_size()) % 16 == 0 and nbytes % 16 == 0)
        return (w, w.shape[0], w.stride(0), nbytes) if k > 0 and aligned else (w, 0, w.stride(0), 0)


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` issue bulk L2 prefetches (compute capability >= 9.0, OUROBATCH_L2_PREFETCH
    not 0; cached per device)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _ENABLED:
        value = os.environ.get(ENV_VAR, "").strip() or "1"
        if value not in ("0", "1"):
            raise ValueError(f"{ENV_VAR} must be 0 (off) or 1 (on), got {value!r}")
        _ENABLED[index] = value == "1" and torch.cuda.get_device_capability(index)[0] >= 9
    return _ENABLED[index]


def kernel_args(prefetch: "Prefetch | None", fallback: torch.Tensor) -> dict:
    """A prefetching kernel's runtime arguments (pf_ptr, pf_rows, pf_stride, pf_bytes) and its PREFETCH
    constexpr. PREFETCH depends on the device only, so a call with nothing to prefetch (0 rows) reuses the
    same compiled kernel; `fallback` is any aligned tensor on the device to point at then."""
    on = enabled(fallback.device)
    ptr, rows, stride, nbytes = prefetch.args() if (on and prefetch is not None) else (fallback, 0, 0, 0)
    return dict(pf_ptr=ptr, pf_rows=rows, pf_stride=stride, pf_bytes=nbytes, PREFETCH=on)


def next_layer_prefetch(layers, i: int, loop: int, last_loop: int, k: int) -> "Prefetch | None":
    """What the add + norm after layer i's down_proj prefetches: the qkv rows of the layer that runs next
    (layer i + 1; layer 0 of the next loop; None after the last layer of the last loop, or k = 0)."""
    if k <= 0:
        return None
    if i + 1 < len(layers):
        return Prefetch(layers[i + 1].self_attn.qkv_weight, k)
    return Prefetch(layers[0].self_attn.qkv_weight, k) if loop < last_loop else None
