"""The split-K attention's second kernel: merges the float32 partials and base-2 log-sum-exps of S key shares
per (row, head) into the output. Both paged kernels write them when they split: triton_attention.py's and the
Gluon decode kernel (gluon_attention.py). Imported lazily: the CPU path never needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl


@triton.jit
def _combine_kernel(
    part_ptr, lse_ptr, o_ptr, num_splits,
    stride_p_split, stride_p_row, stride_p_head, stride_lse_split, stride_lse_row, stride_o_row, stride_o_head,
    HEAD_DIM: tl.constexpr, SPLITS_P2: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # engine/pdl.py: wait for the kernel before, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # one program per (row, query head): out = sum_s w_s * o_s / sum_s w_s, w_s = 2^(lse_s - max lse)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    s_valid = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + offs_s * stride_lse_split + row * stride_lse_row + head, mask=s_valid,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    part = tl.load(part_ptr + offs_s[:, None] * stride_p_split + row * stride_p_row + head * stride_p_head
                   + offs_d[None, :], mask=s_valid[:, None], other=0.0)
    den = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(den == 0.0, 1.0, den)
    tl.store(o_ptr + row * stride_o_row + head * stride_o_head + offs_d, out.to(o_ptr.dtype.element_ty))


def combine_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The split-K launch's second kernel. part: [splits, rows, heads, d] fp32, lse: [splits, rows, heads]
    fp32 (base-2 log-sum-exp of each split) -> out: [rows, heads, d], written and returned."""
    splits, rows, heads, d = part.shape
    _combine_kernel[(rows, heads)](
        part, lse, out, splits, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), HEAD_DIM=d, SPLITS_P2=triton.next_power_of_2(splits), num_warps=1,
        **pdl.launch_kwargs(part.device),
    )
    return out
