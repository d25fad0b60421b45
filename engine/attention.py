"""Causal attention of new rows against a request's paged history (reference torch implementation).

Every call serves contiguous new rows per request: one row (a shallow step), B rows (a deep call over
retained rows) or a prompt chunk (prefill). Their keys are written to the plane first, so row i at
position p attends to the plane's positions 0..p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import KVPool


@dataclass
class SeqSpan:
    """One request's rows inside a batch of concatenated rows."""

    row_start: int  # first row of this request in the batch
    num_rows: int  # new rows, at positions context_len - num_rows .. context_len - 1
    context_len: int  # positions visible to the last row (its position + 1)
    block_ids: tuple[int, ...]


def paged_attention(q: torch.Tensor, pool: KVPool, loop: int, layer: int, spans: list[SeqSpan],
                    scale: float) -> torch.Tensor:
    # q: [rows, heads, head_dim] -> out: [rows, heads, head_dim]
    out = torch.empty_like(q)
    heads = q.shape[1]
    for span in spans:
        rows = slice(span.row_start, span.row_start + span.num_rows)
        k, v = pool.read(loop, layer, span.block_ids, span.context_len)  # [ctx, kv_heads, d]
        groups = heads // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        qs = q[rows].transpose(0, 1)  # [heads, n, d]
        scores = torch.matmul(qs, k.permute(1, 2, 0).to(qs.dtype)) * scale  # [heads, n, ctx]
        q_pos = torch.arange(span.context_len - span.num_rows, span.context_len, device=q.device)
        k_pos = torch.arange(span.context_len, device=q.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores,
                              dim=-1).to(qs.dtype)
        out[rows] = torch.matmul(probs, v.transpose(0, 1).to(qs.dtype)).transpose(0, 1)
    return out
