"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step (Hopper and later).

A decode step is ~800 kernels in a CUDA graph, and between two of them the GPU idles ~1.2-1.8 us while
the next grid launches (docs/benchmarks.md, "Kernels per decode step"). With PDL a kernel is launched
while the one before it still runs: its blocks start, wait at ``griddepcontrol.wait`` until the kernel
before has finished and its writes are visible, then run; and each kernel lets the next one launch as
soon as all of its own blocks are resident (``griddepcontrol.launch_dependents``). So only the launch
latency is hidden, never a dependency: every kernel launched with PDL waits before it stores anything or
loads anything the kernel right before it may write (the ``if USE_PDL:`` prologue of each kernel, a constexpr
branch the compiler drops when off; the paged attention kernel's meta_early reads the step's metadata, written
many kernels earlier, before its wait: engine/pdl_wait.py says why that is safe). Loading weights (which no
kernel of a step writes) before the wait was measured twice on the H200 and lost both times: an L2 prefetch
(session 8) and the first blocks into registers (session 9, docs/benchmarks.md).

Kernels launched without PDL (cuBLAS, torch's own) are ordinary stream dependencies before and after.
``enabled(device)``: on for CUDA devices of compute capability 9.0 and later (off below); OUROBATCH_PDL=0
turns it off. Read once per device; ``launch_kwargs`` are a launch's extra arguments. ``hopper``, ``num_sms`` and
``gluon_importable`` are the device facts the kernels' dispatch reads (cached per device, ``device_index``). On the
H200 it took the full-depth decode step from 6.16-6.21 to 5.90-5.95 ms at N = 8 and from 13.06-13.13 to 12.71-12.73 ms
at N = 64 (docs/benchmarks.md, session 8), once the qkv GEMM there was a Triton kernel too. Prefetching
each GEMM's weight rows into L2 before the wait (CUTLASS's "GEMM with L2 weight prefetch") was measured
and made both slower (7.75-7.82 / 13.28-13.37 ms); it is gone. So did the other way round (session 11): the
add + norm and combine kernels asking L2, before their wait, for the next GEMM's weights (N = 8 6.19-6.30 ->
6.24-6.43 ms): the GEMMs gained 0.3-1.0 us each, the kernels that asked lost 0.9-1.5 us each. At N = 64, where
o_proj's and down_proj's programs launch ~13 us before the kernel before ends, their first 1-4 weight boxes through
TMA before the wait tied for o_proj and cost ~1% of the step for down_proj (session 30, on an H100); gate_up's whole
weight ring loaded from launch by a loader warp of its own (a Gluon kernel, benchmarks/prefetch_probe.py) took
~0.5 us off its add + norm chain and nothing off the N = 64 step, and down_proj's partials so loaded made it slower
(session 36, H100). And a PDL
boundary is cheaper than the alternative sessions 9-11 pointed to, a persistent kernel with grid barriers:
benchmarks/phase_probe.py measured 3.7 against 6.3 us per phase above the bytes at 8 rows, a tie at 64 (session 12).
Nor is a dataflow edge in its place (benchmarks/flow_probe.py, session 38, H100, N = 64): o_proj's K splits waiting on
per-kv-head counts of finished attention programs tied (the heads end together), and the add + norm run inside the
split-K launch behind a grid-wide ticket cost 0.9-1.8 us a layer more than its own PDL-launched kernel.
"""

from __future__ import annotations

import os

import torch

ENV_VAR = "OUROBATCH_PDL"
_ENABLED: dict[int, bool] = {}
_HOPPER: dict[int, bool] = {}
_SMS: dict[int, int] = {}
INTERPRETER_SMS = 132  # TRITON_INTERPRET=1 on CPU tensors: the kernels dispatch as on an H200


def device_index(device: torch.device) -> int:
    """The CUDA device index of `device` (its own, else the current device's): the key of the caches here."""
    return device.index if device.index is not None else torch.cuda.current_device()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (cached: the attention kernels' dispatch runs on every launch)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    index = device_index(device)
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def hopper(device: torch.device) -> bool:
    """Whether `device` is a CUDA device of compute capability 9.0 or later (cached per device): PDL and TMA."""
    if device.type != "cuda":
        return False
    index = device_index(device)
    if index not in _HOPPER:
        _HOPPER[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _HOPPER[index]


def gluon_importable() -> bool:
    """Whether Triton's Gluon (triton.experimental.gluon, Triton >= 3.5: the warp-specialized kernels) imports."""
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        return False
    return True


def enabled(device: torch.device) -> bool:
    """Whether the Triton kernels launched on `device` use PDL (cached per device)."""
    if device.type != "cuda":
        return False
    index = device_index(device)
    if index not in _ENABLED:
        value = os.environ.get(ENV_VAR, "").strip() or "1"
        if value not in ("0", "1"):
            raise ValueError(f"{ENV_VAR} must be 0 (off) or 1 (on), got {value!r}")
        _ENABLED[index] = value == "1" and hopper(device)
    return _ENABLED[index]


def launch_kwargs(device: torch.device) -> dict:
    """A PDL-aware kernel's launch arguments: its USE_PDL constexpr, and Triton's launch_pdl when on."""
    return {"USE_PDL": True, "launch_pdl": True} if enabled(device) else {"USE_PDL": False}
