"""engine/triton_attention.triton_paged_attention's `out` (engine/layers64.py reads the decode rows from a buffer of
its own through TMA): the Triton paged kernel writes a decode call's rows there, in one pass and in split-K shares
(combined into it), as close to float64 as into a new tensor, and a wrong `out` is refused naming what it must be.
Triton's interpreter on the CPU (float32; Case: the GPU tests' float64 reference), where Triton is installed."""

from __future__ import annotations

from tests.interpreter import run_interpreted

INTERPRETED = """
import torch
from engine.attention_dispatch import LaunchConfig
from engine.triton_attention import launch_paged_attention, triton_paged_attention
from tests.gpu.test_gpu_attention_kernels import Case

case = Case([3, 30, 17, 40], [1, 1, 1, 1], 2, 2, 64, torch.float32, seed=5, device="cpu")
tables, ctx, starts, max_rows, scale = case.args
err = lambda a: float((a.double() - case.ref).norm() / case.ref.norm())
buffer = torch.full((6, 128), 7.0)
out = buffer[:4].view(4, 2, 64)
got = triton_paged_attention(case.q, case.k, case.v, tables, ctx, starts, 1, scale, None, out)
assert got is out and err(out) < 1e-5, err(out)
assert bool((buffer[4:] == 7.0).all())  # rows past the call's untouched
buffer.fill_(7.0)
split = launch_paged_attention(case.q, case.k, case.v, tables, ctx, starts, 1, scale, LaunchConfig(16, 4, 2, splits=3),
                               None, out)
assert split is out and err(out) < 1e-5, err(out)
for bad in (torch.empty(4, 2, 32), torch.empty(4, 2, 64, dtype=torch.float64), buffer[:4, ::2].reshape(4, 1, 64)):
    try:
        triton_paged_attention(case.q, case.k, case.v, tables, ctx, starts, 1, scale, None, bad)
    except ValueError as e:
        assert "out must be a contiguous" in str(e), e
    else:
        raise AssertionError("a wrong out was taken")
print("ok")
"""


def test_a_decode_calls_rows_go_to_a_given_output_in_tritons_interpreter():
    run_interpreted(INTERPRETED)
