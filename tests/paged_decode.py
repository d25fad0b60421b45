"""Decode metadata over a paged pool for the kernel tests: each request's pages drawn from the pool in a seeded
shuffled order, so a request's history is scattered as the block manager leaves it after churn."""

from __future__ import annotations

import random

import torch

from engine.batch import BatchMeta, BlockTables, SeqSpan, uniform_meta


def scattered_meta(contexts: list[int], pool, seed: int) -> tuple[BatchMeta, list[SeqSpan]]:
    """Request i has contexts[i] positions, its new row the last, on ceil(contexts[i] / page) of `pool`'s blocks:
    the one-row-a-request decode metadata (on the pool's device) and the reference attention's spans."""
    page, device = pool.block_size, pool.k.device
    free = list(range(pool.num_blocks))
    random.Random(seed).shuffle(free)
    tables = BlockTables(max(8, len(contexts)), max(-(-c // page) for c in contexts), pool.scratch_block, device)
    spans = []
    for i, c in enumerate(contexts):
        ids = tuple(free.pop() for _ in range(-(-c // page)))
        tables.row(f"r{i}", ids)
        spans.append(SeqSpan(i, 1, c, ids))
    rows = torch.tensor([tables.row_of[f"r{i}"] for i in range(len(contexts))], device=device)
    return uniform_meta(tables, rows, torch.tensor(contexts, device=device) - 1, 1, page, spans), spans
