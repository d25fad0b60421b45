"""Causal attention of new rows against a request's paged history.

Every call serves contiguous new rows per request: one row (a shallow step), B rows (a deep call over
retained rows) or a whole prompt (prefill). Keys are written to the plane first, so row i at position
p attends to the plane's positions 0..p.

Backends: `paged_attention` (plain torch, the reference, loops over requests on the host) and the
Triton kernel in triton_attention.py (reads each KV block once for all new rows of a request; used on
CUDA, inside CUDA graphs). Prefill from position 0 needs no history: dense causal SDPA over the prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .batch import BatchMeta, SeqSpan  # SeqSpan re-exported: the kernel tests import it from here

if TYPE_CHECKING:
    from .kv_cache import KVPool


# Prompt chunks after shared or cached blocks with at most this many rows run in the paged Triton kernel
# (one batched call; its tile grows with the rows); longer ones gather their history and run SDPA.
MAX_KERNEL_HISTORY_ROWS = 64


def paged_attention(q: torch.Tensor, pool: "KVPool", loop: int, layer: int, spans: list[SeqSpan],
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


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[SeqSpan],
                      scale: float, pool: "KVPool | None" = None, loop: int = 0, layer: int = 0,
                      history_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Dense causal attention of prompt chunks.

    q: [rows, heads, d]; k, v: [rows, kv_heads, d] (this call's keys) -> [rows, heads, d].
    Chunks from position 0 of equal length run as one batched SDPA call. A chunk after shared or cached
    blocks (context_len > num_rows) reads its whole history from the pool (this call's keys are already
    written there) and runs SDPA with the causal mask aligned to its last row.
    """
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    by_len: dict[int, list[SeqSpan]] = {}
    if history_out is not None:  # the chunks with a history, already computed by the paged kernel
        rows, hist = history_out
        out[rows] = hist
    for span in spans:
        if span.context_len > span.num_rows:
            if history_out is not None:
                continue
            assert pool is not None, "a prefill chunk with history needs the pool"
            out[span.row_start:span.row_start + span.num_rows] = _chunk_with_history(q, pool, loop, layer, span,
                                                                                      scale, groups)
            continue
        by_len.setdefault(span.num_rows, []).append(span)
    for n, group in by_len.items():
        idx = torch.cat([torch.arange(s.row_start, s.row_start + n, device=q.device) for s in group])
        qg = q[idx].view(len(group), n, *q.shape[1:]).transpose(1, 2)  # [b, heads, n, d]
        kg = k[idx].view(len(group), n, *k.shape[1:]).transpose(1, 2)
        vg = v[idx].view(len(group), n, *v.shape[1:]).transpose(1, 2)
        if groups > 1:
            kg = kg.repeat_interleave(groups, dim=1)
            vg = vg.repeat_interleave(groups, dim=1)
        og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale)
        out[idx] = og.transpose(1, 2).reshape(len(group) * n, *q.shape[1:])
    return out


def _chunk_with_history(q: torch.Tensor, pool: "KVPool", loop: int, layer: int, span: SeqSpan, scale: float,
                        groups: int) -> torch.Tensor:
    # rows at positions ctx - n .. ctx - 1 attend to positions 0 .. their own
    n, ctx = span.num_rows, span.context_len
    k, v = pool.read(loop, layer, span.block_ids, ctx)  # [ctx, kv_heads, d]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    qs = q[span.row_start:span.row_start + n].transpose(0, 1)[None]  # [1, heads, n, d]
    mask = (torch.arange(ctx, device=q.device)[None, :]
            <= torch.arange(ctx - n, ctx, device=q.device)[:, None])  # [n, ctx]
    o = F.scaled_dot_product_attention(qs, k.transpose(0, 1)[None].to(qs.dtype), v.transpose(0, 1)[None].to(qs.dtype),
                                       attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1)


def attend(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, pool: "KVPool", loop: int,
           layer: int, meta: "BatchMeta", scale: float, backend: str) -> torch.Tensor:
    """Attention for one layer of one loop. k, v: this call's keys and values, already written to the
    pool (None: read them back from their slots)."""
    if meta.prefill and meta.spans is not None:
        if k is None or v is None:
            k_plane, v_plane = pool.plane(loop, layer)
            k, v = k_plane[meta.slots], v_plane[meta.slots]
        history_out = None
        h = meta.history
        if backend == "triton" and h is not None and h.max_rows <= MAX_KERNEL_HISTORY_ROWS:
            from .triton_attention import triton_paged_attention

            hist = triton_paged_attention(q.index_select(0, h.rows), pool.k[loop - 1, layer], pool.v[loop - 1, layer],
                                          h.block_tables, h.context_lens, h.query_start, h.max_rows, scale)
            history_out = (h.rows, hist)
        return prefill_attention(q, k, v, meta.spans, scale, pool, loop, layer, history_out)
    if backend == "triton":
        from .triton_attention import triton_paged_attention

        k_plane, v_plane = pool.k[loop - 1, layer], pool.v[loop - 1, layer]
        return triton_paged_attention(q, k_plane, v_plane, meta.block_tables, meta.context_lens,
                                      meta.query_start, meta.max_rows, scale)
    assert meta.spans is not None, "the reference attention needs host spans"
    return paged_attention(q, pool, loop, layer, meta.spans, scale)
