"""A step's attention inputs are built once per step (engine/batch.py), so a layer pass only runs its math.

Checked against an independent float64 reference (per chunk: its keys gathered position by position from the
block ids, softmax attention written out per head): prompt chunks from position 0 of equal and different
lengths (equal ones batched, contiguous and not), chunks after a history (gathered for SDPA), read from the
call's keys or back from the plane; the reference attention with the per-step reads. And what a layer pass
dispatches: no arange / cat / index / index_put / host read (each computes metadata or waits on CUDA), and
one batched call whatever the number of equal-length chunks."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.attention import attend, paged_attention
from engine.batch import BlockTables, SeqSpan, uniform_meta, varlen_meta
from engine.kv_cache import KVPool

BS, HEADS, KV_HEADS, D, BLOCKS = 4, 4, 2, 8, 64
# metadata work a layer pass must not do: it is built once per step (and on CUDA .item() / tolist() sync)
PER_STEP_OPS = {"aten.arange", "aten.cat", "aten.index", "aten.index_put", "aten.index_put_", "aten.nonzero",
                "aten._local_scalar_dense", "aten.lift_fresh", "aten.remainder", "aten.div", "aten.floor_divide"}


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _pool() -> KVPool:
    pool = KVPool(2, 1, BLOCKS, BS, KV_HEADS, D, torch.float64, "cpu")
    g = torch.Generator().manual_seed(0)
    pool.k.copy_(torch.randn(pool.shape, generator=g, dtype=torch.float64))
    pool.v.copy_(torch.randn(pool.shape, generator=g, dtype=torch.float64))
    return pool


def _layout(chunks: list[tuple[int, int]]) -> tuple[list[int], list[int], list[tuple[int, ...]]]:
    """(start, rows) per chunk -> starts, rows, block ids (scattered blocks, none shared)."""
    blocks = iter(torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(1)).tolist())
    ids = [tuple(next(blocks) for _ in range(math.ceil((s + n) / BS))) for s, n in chunks]
    return [s for s, _ in chunks], [n for _, n in chunks], ids


def _reference(q: torch.Tensor, pool: KVPool, loop: int, starts, num_rows, block_ids) -> torch.Tensor:
    """Each row at position p attends to positions 0..p of its chunk's request, read slot by slot."""
    out, row, groups = torch.zeros_like(q), 0, HEADS // KV_HEADS
    for start, n, ids in zip(starts, num_rows, block_ids):
        ctx = start + n
        k = torch.stack([pool.k[loop - 1, 0, ids[p // BS], p % BS] for p in range(ctx)])  # [ctx, kv_heads, d]
        v = torch.stack([pool.v[loop - 1, 0, ids[p // BS], p % BS] for p in range(ctx)])
        for i in range(n):
            p = start + i
            for h in range(HEADS):
                s = (k[:p + 1, h // groups] @ q[row + i, h]) / math.sqrt(D)
                out[row + i, h] = torch.softmax(s, 0) @ v[:p + 1, h // groups]
        row += n
    return out


def _prefill_call(chunks):
    pool = _pool()
    starts, num_rows, ids = _layout(chunks)
    tables = BlockTables(8, 16, pool.scratch_block, torch.device("cpu"))
    meta = varlen_meta(tables, starts, num_rows, ids, BS, prefill=True, device=torch.device("cpu"))
    rows = sum(num_rows)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(rows, HEADS, D, generator=g, dtype=torch.float64)
    k = torch.randn(rows, KV_HEADS, D, generator=g, dtype=torch.float64)
    v = torch.randn(rows, KV_HEADS, D, generator=g, dtype=torch.float64)
    pool.write(2, 0, meta.slots, k, v)  # this call's keys, as the layer writes them before attending
    return pool, meta, q, k, v, (starts, num_rows, ids)


CASES = {
    "one fresh chunk": [(0, 9)],
    "equal fresh chunks": [(0, 5), (0, 5), (0, 5)],
    "equal chunks not contiguous": [(0, 5), (0, 3), (0, 5)],
    "after a history": [(8, 6)],
    "mixed": [(0, 5), (12, 7), (0, 3), (4, 1), (0, 5), (0, 2)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("from_plane", [False, True])
def test_prefill_attention_matches_the_reference(case, from_plane):
    pool, meta, q, k, v, layout = _prefill_call(CASES[case])
    got = attend(q, None if from_plane else k, None if from_plane else v, pool, 2, 0, meta, D**-0.5, "torch")
    torch.testing.assert_close(got, _reference(q, pool, 2, *layout), rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_prefill_layer_pass_computes_no_metadata(case):
    pool, meta, q, _, _, _ = _prefill_call(CASES[case])
    with Ops() as ops:
        attend(q, None, None, pool, 2, 0, meta, D**-0.5, "torch")
    assert not PER_STEP_OPS & set(ops.names), ops.names


def test_equal_fresh_chunks_are_one_batched_call():
    def pass_ops(chunks):
        pool, meta, q, _, _, _ = _prefill_call(chunks)
        with Ops() as ops:
            attend(q, None, None, pool, 2, 0, meta, D**-0.5, "torch")
        return ops.names

    one, three = pass_ops([(0, 5)]), pass_ops([(0, 5)] * 3)
    assert one == three and sum("scaled_dot_product" in name for name in one) == 1
    # a whole call of one piece is returned as is: nothing allocated for the output, nothing scattered
    assert "aten.empty_like" not in one and "aten.copy_" not in one


def test_reference_attention_reads_once_per_step():
    pool = _pool()
    spans_in = [(7, 1), (0, 3), (13, 2)]  # (start, rows): decode-like and deep-like spans
    starts, num_rows, ids = _layout(spans_in)
    spans, row = [], 0
    for s, n, b in zip(starts, num_rows, ids):
        spans.append(SeqSpan(row, n, s + n, b))
        row += n
    tables = BlockTables(8, 16, pool.scratch_block, torch.device("cpu"))
    for i, b in enumerate(ids):
        tables.row(f"r{i}", b)
    meta = varlen_meta(tables, starts, num_rows, ids, BS, prefill=False, device=torch.device("cpu"), reads=True)
    q = torch.randn(row, HEADS, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want = _reference(q, pool, 1, starts, num_rows, ids)
    with Ops() as ops:
        got = paged_attention(q, pool, 1, 0, meta.spans, D**-0.5, meta.reads)
    assert not PER_STEP_OPS & set(ops.names), ops.names
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert torch.equal(got, paged_attention(q, pool, 1, 0, spans, D**-0.5))  # without reads: the same
    # uniform_meta builds the same reads from its spans (the reference decode and deep calls)
    spans1 = [SeqSpan(i, 1, s + 1, b) for i, (s, b) in enumerate(zip(starts, ids))]
    rows_t = torch.tensor([tables.row_of[f"r{i}"] for i in range(3)])
    meta1 = uniform_meta(tables, rows_t, torch.tensor(starts), 1, BS, spans1)
    q1 = q[:3]
    torch.testing.assert_close(paged_attention(q1, pool, 1, 0, spans1, D**-0.5, meta1.reads),
                               _reference(q1, pool, 1, starts, [1] * 3, ids), rtol=0, atol=1e-12)


def test_pool_plane_views_follow_the_pool_memory():
    pool = _pool()
    k, v = pool.plane(2, 0)
    assert k.data_ptr() == pool.k[1, 0].data_ptr() and k.shape == (pool.shape[2] * BS, KV_HEADS, D)
    assert pool.plane(2, 0)[0] is k  # made once
    kb, _ = pool.block_plane(2, 0)
    assert kb.shape == pool.shape[2:] and kb.data_ptr() == k.data_ptr()
    pool.release()
    assert pool._views is None  # the views let go of the freed memory
    pool.reallocate()
    assert pool.plane(2, 0)[0].data_ptr() == pool.k[1, 0].data_ptr()
    # a pool assembled field by field (tests/gpu does) reads too
    bare = KVPool.__new__(KVPool)
    bare.k, bare.v, bare.block_size = torch.randn(pool.shape), torch.randn(pool.shape), BS  # (reallocate: NaNs maybe)
    assert torch.equal(bare.read(1, 0, (3, 5), 6)[0], torch.cat([bare.k[0, 0, 3], bare.k[0, 0, 5, :2]]))
