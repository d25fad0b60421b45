"""The PDL wait after a kernel's early work (Triton; engine/pdl.py says what PDL is and when it is on).

With programmatic dependent launch a kernel's programs start while the kernel before still runs, and
``griddepcontrol.wait`` holds them until its results are visible. Why some data can be read before the wait: a
kernel launched after one that ran without PDL (torch's, cuBLAS's: they never let the next one launch early) starts
only once that one has finished, and so does every kernel after it. The step's metadata (lengths, block tables,
positions, slots) is written by torch's kernels at the step's start (batch.uniform_meta, or copies from the host),
before the embedding; the model's constants by nobody during a step. So they are complete before any later kernel's
programs start, and can be read, and worked on, before the wait. (Also, a kernel's programs start only once the
kernel before has run ``launch_dependents``, which the Triton kernels here run after their own wait, except
kv_prefetch's, off by default: so everything two or three kernels back has finished too.) LLVM sinks such loads
past Triton's ``gdc_wait`` to their first use, so ``wait_after`` is the wait as an asm that consumes a value
computed from them: everything that value depends on happens first.
Used by the paged attention kernel (LaunchConfig.meta_early). The qkv + RoPE + store kernel's positions, slots
and RoPE's cos / sin computed before its wait made the N = 64 step 0.4-0.6% slower (session 31, three of three
harness runs, H100: 16.65-16.69 against 16.55-16.60 ms; 90 registers a thread against 58) and are not.
Imported lazily, as every Triton module here.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_after(token):
    """griddepcontrol.wait once `token` (a 32-bit scalar: int32 or float32) is computed, then let the next kernel
    launch (griddepcontrol.launch_dependents), as engine/pdl.py's prologue does."""
    tl.inline_asm_elementwise("griddepcontrol.wait; mov.b32 $0, $1;", "=r,r", [token], dtype=token.dtype,
                              is_pure=False, pack=1)
    tl.extra.cuda.gdc_launch_dependents()
