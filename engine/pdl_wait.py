"""The PDL wait after a kernel's early work (Triton; engine/pdl.py says what PDL is and when it is on).

With programmatic dependent launch a kernel's programs start while the kernel before still runs, and
``griddepcontrol.wait`` holds them until its results are visible. Why reading earlier data before the wait is
safe: a kernel's programs can start only once the kernel before has run ``launch_dependents``, which every kernel
here runs after its own wait, so by then every kernel two or more back (and all work launched without PDL) has
finished. Only the kernel right before may still be writing. So data written two or more kernels earlier (the
step's metadata, which uniform_meta computes at its start: lengths, block tables, positions, slots; the model's
constants) can be read, and worked on, before the wait. LLVM sinks such loads past Triton's ``gdc_wait`` to their
first use, so ``wait_after`` is the wait as an asm that consumes a value computed from them: everything that value
depends on happens first.
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
    if token.dtype == tl.float32:
        tl.inline_asm_elementwise("griddepcontrol.wait; mov.b32 $0, $1;", "=r,r", [token], dtype=tl.float32,
                                  is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("griddepcontrol.wait; mov.b32 $0, $1;", "=r,r", [token], dtype=tl.int32,
                                  is_pure=False, pack=1)
    tl.extra.cuda.gdc_launch_dependents()
