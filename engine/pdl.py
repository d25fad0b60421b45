"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step (Hopper and later).

A decode step is ~800 kernels in a CUDA graph, and between two of them the GPU idles ~1.2-1.8 us while
the next grid launches (docs/benchmarks.md, "Kernels per decode step"). With PDL a kernel is launched
while the one before it still runs: its blocks start, wait at ``griddepcontrol.wait`` until the kernel
before has finished and its writes are visible, then run; and each kernel lets the next one launch as
soon as all of its own blocks are resident (``griddepcontrol.launch_dependents``). So only the launch
latency is hidden, never a dependency: every kernel launched with PDL waits before its first load or
store (the ``if USE_PDL:`` prologue of each kernel, a constexpr branch the compiler drops when off).

The skinny GEMMs (engine/triton_gemm.py) do one thing before they wait: they prefetch their program's
weight rows into L2 (Hopper's bulk prefetch), since weights never depend on the kernel before. So the
weight stream of the next GEMM starts while the norm or the attention before it still runs, as CUTLASS's
"GEMM with L2 weight prefetch" does. ``OUROBATCH_PDL_PREFETCH=0`` keeps PDL without the prefetch.

Kernels launched without PDL (cuBLAS, torch's own) are ordinary stream dependencies before and after.
``enabled(device)``: OUROBATCH_PDL=1 turns it on for CUDA devices of compute capability 9.0 and later
(off below, and by default). Read once per device; ``launch_kwargs`` are a launch's extra arguments.
"""

from __future__ import annotations

import os

import torch

ENV_VAR = "OUROBATCH_PDL"
PREFETCH_ENV_VAR = "OUROBATCH_PDL_PREFETCH"
_ENABLED: dict[int, bool] = {}
_PREFETCH: dict[str, bool] = {}


def _switch(name: str, default: str) -> bool:
    value = os.environ.get(name, "").strip() or default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 (off) or 1 (on), got {value!r}")
    return value == "1"


def enabled(device: torch.device) -> bool:
    """Whether the Triton kernels launched on `device` use PDL (cached per device)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _ENABLED:
        _ENABLED[index] = _switch(ENV_VAR, "0") and torch.cuda.get_device_capability(index)[0] >= 9
    return _ENABLED[index]


def prefetch_enabled() -> bool:
    """Whether PDL's GEMMs prefetch their weights before they wait (OUROBATCH_PDL_PREFETCH, default 1; cached)."""
    if "on" not in _PREFETCH:
        _PREFETCH["on"] = _switch(PREFETCH_ENV_VAR, "1")
    return _PREFETCH["on"]


def launch_kwargs(device: torch.device) -> dict:
    """A PDL-aware kernel's launch arguments: its USE_PDL constexpr, and Triton's launch_pdl when on."""
    return {"USE_PDL": True, "launch_pdl": True} if enabled(device) else {"USE_PDL": False}


def gemm_launch_kwargs(w: torch.Tensor) -> dict:
    """launch_kwargs for a skinny GEMM over weight `w` [N, K], plus its PREFETCH constexpr: on with PDL and
    OUROBATCH_PDL_PREFETCH, where the bulk prefetch's 16-byte alignment holds (the base, a row's stride and
    a row's bytes), so a split's segment [k_start, k_end) of a row is aligned too (k_start: whole K blocks)."""
    kwargs = launch_kwargs(w.device)
    row_bytes, size = w.stride(0) * w.element_size(), w.shape[-1] * w.element_size()
    aligned = w.data_ptr() % 16 == 0 and row_bytes % 16 == 0 and size % 16 == 0
    kwargs["PREFETCH"] = bool(kwargs["USE_PDL"] and prefetch_enabled() and aligned)
    return kwargs
