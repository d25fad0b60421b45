"""LaunchConfig.head_major (the paged kernel's programs launched request by request, its kv heads together): the
same float64-close output as the default order, in one pass and in split-K shares, for decode rows and for
verify-style rows with GQA and M tiles past the first. Triton's interpreter on the CPU (float32 and float16; Case:
the GPU tests' float64 reference), where Triton is installed."""

from __future__ import annotations

from tests.interpreter import run_interpreted

INTERPRETED = """
import torch
from engine.attention_dispatch import LaunchConfig
from tests.gpu.test_gpu_attention_kernels import Case

for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 3e-3)):
    for splits in (1, 3):
        cases = (Case([60, 173, 41, 9], [12, 3, 20, 1], 8, 2, 128, dtype, seed=23 + splits, device="cpu"),
                 Case([1, 40, 97, 300, 16], [1] * 5, 4, 4, 64, dtype, seed=29 + splits, device="cpu"))
        for case in cases:
            outs = [case.run(LaunchConfig(16, 4, 2, splits, head_major=major)) for major in (False, True)]
            for out in outs:
                err = float((out.double() - case.ref).norm() / case.ref.norm())
                assert err < tol, (dtype, splits, err)
            assert torch.equal(outs[0], outs[1]), (dtype, splits)  # each program's math is the same
print("ok")
"""


def test_head_major_launch_order_in_tritons_interpreter():
    run_interpreted(INTERPRETED)
