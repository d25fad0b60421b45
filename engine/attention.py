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

from .batch import MAX_KERNEL_HISTORY_ROWS, BatchMeta, SeqSpan, SpanRead  # noqa: F401 - SeqSpan and the
# constant are re-exported: the kernel tests and engine/kernel_warmup.py import them from here

if TYPE_CHECKING:
    from .kv_cache import KVPool

# The SDPA backends prefill may use: not cuDNN's, which torch (>= 2.10 with cuDNN >= 9.15, sm90 and up) puts
# first, and which builds a plan for every new shape on its first call. On the H200 (torch 2.11, cuDNN
# 9.19) a new [chunks, 16 heads, length, 128] shape's first call took 44-1,007 ms with cuDNN and 0.14-0.33
# ms with flash; a first round's first prefill steps ran 46-616 ms longer than the same steps warm (a
# step decode rows wait for). Steady, flash takes ~2x cuDNN's time on these calls (0.10 vs 0.055 ms at 16 x
# 512), ~4 ms of a ~160 ms 8,192-token step (docs/benchmarks.md, session 7).
_PREFILL_SDPA = None


def _prefill_sdpa_backends():
    global _PREFILL_SDPA
    if _PREFILL_SDPA is None:
        from torch.nn.attention import SDPBackend

        _PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return _PREFILL_SDPA


def paged_attention(q: torch.Tensor, pool: "KVPool", loop: int, layer: int, spans: list[SeqSpan],
                    scale: float, reads: list[SpanRead] | None = None, zero_rest: bool = False) -> torch.Tensor:
    """q: [rows, heads, head_dim] -> out: [rows, heads, head_dim]. `reads`: each span's context slots and
    mask, computed once per step (BatchMeta.reads); None: computed here from the spans' block ids.
    `zero_rest`: rows no span covers (a bucket's padding) are zeros, not left undefined."""
    out = torch.zeros_like(q) if zero_rest else torch.empty_like(q)
    heads = q.shape[1]
    k_plane, v_plane = pool.plane(loop, layer)
    for i, span in enumerate(spans):
        rows = slice(span.row_start, span.row_start + span.num_rows)
        if reads is None:
            k, v = pool.read(loop, layer, span.block_ids, span.context_len)  # [ctx, kv_heads, d]
            mask = _causal_mask_after(span, q.device) if span.num_rows > 1 else None
        else:
            k, v = k_plane.index_select(0, reads[i].slots), v_plane.index_select(0, reads[i].slots)
            mask = reads[i].mask
        groups = heads // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        qs = q[rows].transpose(0, 1)  # [heads, n, d]
        scores = torch.matmul(qs, k.permute(1, 2, 0).to(qs.dtype)) * scale  # [heads, n, ctx]
        if mask is not None:  # one row sees its whole context
            scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores,
                              dim=-1).to(qs.dtype)
        out[rows] = torch.matmul(probs, v.transpose(0, 1).to(qs.dtype)).transpose(0, 1)
    return out


def _causal_mask_after(span: SeqSpan, device: torch.device) -> torch.Tensor:
    """[1, n, ctx] True where a key is after the row's position (rows at ctx - n .. ctx - 1)."""
    q_pos = torch.arange(span.context_len - span.num_rows, span.context_len, device=device)
    return torch.arange(span.context_len, device=device)[None, None, :] > q_pos[None, :, None]


def prefill_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, pool: "KVPool", loop: int,
                      layer: int, meta: BatchMeta, scale: float, backend: str) -> torch.Tensor:
    """Dense causal attention of prompt chunks, in the batched calls meta.prefill_attention lists.

    q: [rows, heads, d]; k, v: [rows, kv_heads, d], this call's keys (None: read from the plane, where they
    are already written) -> [rows, heads, d]. Chunks from position 0 of equal length run as one batched SDPA
    call; chunks after shared or cached blocks run in the paged kernel (meta.history) or each gather their
    whole history from the pool (this call's keys are already there) for SDPA with the causal mask aligned
    to their last row. Nothing here computes metadata or waits for the device: it was all built per step.
    """
    plan = meta.prefill_attention
    k_plane, v_plane = pool.plane(loop, layer)
    groups = q.shape[1] // k_plane.shape[1]
    pieces: list[tuple[slice | torch.Tensor, torch.Tensor]] = []
    h = meta.history
    if h is not None:  # the chunks with a history, in one paged-kernel call
        assert backend == "triton", "meta.history is the paged kernel's batch (varlen_meta paged_history=True)"
        from .triton_attention import triton_paged_attention

        k_blocks, v_blocks = pool.block_plane(loop, layer)
        pieces.append((h.rows, triton_paged_attention(q.index_select(0, h.rows), k_blocks, v_blocks, h.block_tables,
                                                      h.context_lens, h.query_start, h.max_rows, scale)))
    if plan.fresh or plan.gathered:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(_prefill_sdpa_backends()):
            pieces += _sdpa_pieces(q, k, v, k_plane, v_plane, plan, groups, scale)
    return _assemble(q, pieces, plan.whole)


def _sdpa_pieces(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_plane: torch.Tensor,
                 v_plane: torch.Tensor, plan, groups: int,
                 scale: float) -> list[tuple[slice | torch.Tensor, torch.Tensor]]:
    """prefill_attention's SDPA calls: fresh chunk groups batched, chunks that gather their history."""
    pieces: list[tuple[slice | torch.Tensor, torch.Tensor]] = []
    if plan.fresh and k is None:  # every fresh group's keys in one gather (views of it per group)
        k_fresh, v_fresh = k_plane.index_select(0, plan.fresh_slots), v_plane.index_select(0, plan.fresh_slots)
    for g in plan.fresh:
        b, n = g.num_seqs, g.num_rows
        if k is None:
            kg, vg = k_fresh[g.kv_start:g.kv_start + b * n], v_fresh[g.kv_start:g.kv_start + b * n]
        else:
            kg, vg = _rows(k, g.rows), _rows(v, g.rows)
        qg = _rows(q, g.rows).view(b, n, *q.shape[1:]).transpose(1, 2)  # [b, heads, n, d]
        kg = kg.reshape(b, n, *kg.shape[1:]).transpose(1, 2)
        vg = vg.reshape(b, n, *vg.shape[1:]).transpose(1, 2)
        if groups > 1:
            kg = kg.repeat_interleave(groups, dim=1)
            vg = vg.repeat_interleave(groups, dim=1)
        og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale)
        pieces.append((g.rows, og.transpose(1, 2)))  # [b, n, heads, d]
    if plan.gathered:  # every gathered chunk's context in one gather
        k_hist, v_hist = k_plane.index_select(0, plan.gathered_slots), v_plane.index_select(0, plan.gathered_slots)
    for c in plan.gathered:  # rows at positions ctx - n .. ctx - 1 attend to positions 0 .. their own
        kh = k_hist[c.kv_start:c.kv_start + c.context_len]  # [ctx, kv_heads, d]
        vh = v_hist[c.kv_start:c.kv_start + c.context_len]
        if groups > 1:
            kh = kh.repeat_interleave(groups, dim=1)
            vh = vh.repeat_interleave(groups, dim=1)
        qs = q[c.rows].transpose(0, 1)[None]  # [1, heads, n, d]
        o = F.scaled_dot_product_attention(qs, kh.transpose(0, 1)[None].to(qs.dtype),
                                           vh.transpose(0, 1)[None].to(qs.dtype), attn_mask=c.mask, scale=scale)
        pieces.append((c.rows, o[0].transpose(0, 1)))
    return pieces


def _assemble(q: torch.Tensor, pieces: list[tuple[slice | torch.Tensor, torch.Tensor]], whole: bool) -> torch.Tensor:
    """The call's [rows, heads, d] output from its pieces: one piece covering every row is returned as it is
    (reshaped), else each is copied to its rows (one copy per piece)."""
    if whole:
        return pieces[0][1].reshape(q.shape)
    out = torch.empty_like(q)
    for rows, o in pieces:
        if isinstance(rows, slice):
            out[rows].view(o.shape).copy_(o)
        else:
            out.index_copy_(0, rows, o.reshape(-1, *q.shape[1:]))
    return out


def _rows(x: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def attend(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, pool: "KVPool", loop: int,
           layer: int, meta: "BatchMeta", scale: float, backend: str) -> torch.Tensor:
    """Attention for one layer of one loop. k, v: this call's keys and values, already written to the
    pool (None: read them back from their slots)."""
    if meta.prefill and meta.prefill_attention is not None:
        return prefill_attention(q, k, v, pool, loop, layer, meta, scale, backend)
    if backend == "triton":
        from .triton_attention import triton_paged_attention

        k_blocks, v_blocks = pool.block_plane(loop, layer)
        return triton_paged_attention(q, k_blocks, v_blocks, meta.block_tables, meta.context_lens,
                                      meta.query_start, meta.max_rows, scale, meta.tiles)
    if meta.spans is None:  # device-only metadata (a graph's forward run eagerly): read it back
        return paged_attention(q, pool, loop, layer, spans_on_device(meta, pool.block_size), scale, zero_rest=True)
    return paged_attention(q, pool, loop, layer, meta.spans, scale, meta.reads)


def attend_o(q: torch.Tensor, pool: "KVPool", loop: int, layer: int, meta: "BatchMeta", scale: float, backend: str,
             wo: torch.Tensor, barrier: torch.Tensor | None, h: torch.Tensor, w_branch: torch.Tensor,
             w_next: torch.Tensor, eps: float,
             partials_only: bool = False) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None:
    """With o = attend(q, None, None, ...) @ wo.T: (h + rms(o) w_branch, its rms times w_next) in one launch where
    the Gluon decode kernel folds o_proj and the add + norm into its tail (triton_attention.decode_attention_o);
    None elsewhere (the caller runs them apart). partials_only: o itself, float32 [1, rows, hidden]."""
    if backend != "triton" or barrier is None or (meta.prefill and meta.prefill_attention is not None):
        return None
    from .triton_attention import decode_attention_o

    k_blocks, v_blocks = pool.block_plane(loop, layer)
    return decode_attention_o(q, k_blocks, v_blocks, meta.block_tables, meta.context_lens, meta.query_start,
                              meta.max_rows, scale, meta.tiles, wo, barrier, h, w_branch, w_next, eps, partials_only)


def attend_o_partials(q: torch.Tensor, pool: "KVPool", loop: int, layer: int, meta: "BatchMeta", scale: float,
                      backend: str, wo: torch.Tensor, barrier: torch.Tensor | None, h: torch.Tensor,
                      gemm) -> torch.Tensor:
    """attend(q, None, None, ...) @ wo.T as float32 partial sums [splits, rows, hidden] (the fused path's GEMM
    config `gemm`): from the decode kernel that folds o_proj where it serves the call, else attention, then o_proj's
    split-K partials (triton_gemm.linear_partials). h: the residual rows (the folded launch's signature)."""
    unused = h[0]  # the norm weights of an add + norm that a partials-only launch does not run
    folded = attend_o(q, pool, loop, layer, meta, scale, backend, wo, barrier, h, unused, unused, 0.0,
                      partials_only=True)
    if folded is not None:
        return folded
    from .triton_gemm import linear_partials

    a = attend(q, None, None, pool, loop, layer, meta, scale, backend)
    return linear_partials(a.reshape(q.shape[0], -1), wo, gemm.splits_o, gemm)


def spans_on_device(meta: "BatchMeta", block_size: int) -> list[SeqSpan]:
    """The host spans of metadata that lives on the device only (waits for the device: reference path)."""
    starts, ctx = meta.query_start.tolist(), meta.context_lens.tolist()
    spans = []
    for i, c in enumerate(ctx):
        n = starts[i + 1] - starts[i]
        if n > 0:
            spans.append(SeqSpan(starts[i], n, c, tuple(meta.block_tables[i, :-(-c // block_size)].tolist())))
    return spans
