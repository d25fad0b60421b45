"""Graphed prefill: a step's prompt chunks as one CUDA graph per token bucket.

Theory of operation. Eager, a step that prefills launches every kernel of loops 1..T over its chunks
(~1,500 launches for Ouro-1.4B): on the H200 that took 50-90 ms of host time where the GPU needed 5-20,
so every step that prefilled stalled the decoding requests beside it. Here the chunks of a step are
described by device data only, in one packed int64 vector per bucket of tokens (PrefillLayout):

    ids, positions, chunk of each row      [tokens]      (padding rows: id 0, position 0, the padding chunk)
    table row, context length per chunk    [chunks + 1]  (the last, and unused ones, a chunk of no rows)
    row offsets                            [chunks + 2]
    the paged kernel's tile map            [2 x tiles]   ((chunk, M tile) pairs; spare ones name no rows)

so the forward (``forward``) has fixed shapes and no host reads: the cache captures it once per bucket
and a step costs one host-to-device copy and one replay. Each row's KV slot is computed on the device
from its chunk's table row; the padding chunk's table row is the scratch row, so padding rows write their
keys to the scratch block only, and no tile covers them (their outputs are garbage rows nobody reads).
Attention is the paged Triton kernel over the pool for every chunk, fresh or after a history (the
chunk's own keys are written before its layer's attention), walking the tile map so the grid does not
depend on how the bucket's tokens split into chunks. Steps with more chunks than a layout holds, or more
tokens than the largest bucket, run eagerly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_dispatch import max_tiles, query_tiling, tile_map
from .batch import BatchMeta, BlockTables
from .kv_cache import KVPool

# Token buckets of the graphed prefill (a step's prefill tokens round up to the next one), capped by the
# step budget (max_num_batched_tokens) and by MAX_GRAPH_TOKENS: past ~2,048 tokens a prefill is long
# enough on the GPU that its eager launch no longer shows.
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
MAX_GRAPH_TOKENS = 2048
# Chunks one call holds (each adds a tile and an entry per chunk field); at full depth a step's decode rows
# are chunks too (engine/phases.py _merged), so this covers a large decode batch beside its prompt chunks.
MAX_GRAPH_CHUNKS = 256


def prefill_buckets(max_num_batched_tokens: int) -> list[int]:
    """The token buckets an engine with this step budget captures (its largest is the budget, capped)."""
    cap = min(max_num_batched_tokens, MAX_GRAPH_TOKENS)
    return [b for b in PREFILL_BUCKETS if b < cap] + [cap]


def layouts_for(max_num_batched_tokens: int, max_num_seqs: int, config, dtype: torch.dtype) -> list["PrefillLayout"]:
    """Every bucket's layout for an engine of these limits and this model config (OuroConfig)."""
    group = config.num_attention_heads // config.num_key_value_heads
    return [PrefillLayout.for_bucket(b, max_num_seqs, group, config.head_dim, dtype == torch.float32)
            for b in prefill_buckets(max_num_batched_tokens)]


def smallest_layout(layouts: list["PrefillLayout"], num_tokens: int, num_chunks: int) -> "PrefillLayout | None":
    """The smallest bucket that holds these chunks (None: none does; run them eagerly)."""
    for layout in layouts:
        if layout.holds(num_tokens, num_chunks):
            return layout
    return None


# Most padded rows a merged call (engine/phases.py _merged) may add over the prefill's own bucket. Merging
# saves the decode call (its weight reads and launches) but pays for every padded row. H200, Ouro-1.4B, 64
# decode rows beside one chunk of k (benchmarks/mixed_step.py, docs/benchmarks.md, session 4): merged vs
# two calls 13.3 vs 17.8 ms (k = 64, +64 rows), 16.8 vs 19.3 (256, +128), 23.5 vs 24.5 (512, +256), and
# 39.1 vs 34.8 (1,024: +512, the 1,536 bucket).
MAX_MERGE_PADDING = 256


def merged_layout(layouts: list["PrefillLayout"], num_prefill_tokens: int, num_chunks: int,
                  num_decode_rows: int) -> "PrefillLayout | None":
    """The bucket of one call for a step's prompt chunks and its decode rows (one-token chunks), or None
    when none holds them or it would add more than MAX_MERGE_PADDING rows over the chunks' own bucket."""
    merged = smallest_layout(layouts, num_prefill_tokens + num_decode_rows, num_chunks + num_decode_rows)
    alone = smallest_layout(layouts, num_prefill_tokens, num_chunks)
    if merged is None or (alone is not None and merged.tokens - alone.tokens > MAX_MERGE_PADDING):
        return None
    return merged


@dataclass(frozen=True)
class PrefillLayout:
    """The packed input vector of one bucket: where each field sits."""

    tokens: int  # rows of the call (the bucket)
    chunks: int  # most chunks it holds; entry `chunks` is the padding chunk (no rows, the scratch row)
    tiles: int  # capacity of the tile map
    block_m: int  # the kernel's tile height at this bucket (query_tiling)
    group: int  # query heads per kv head (GQA): a tile holds block_m // group rows

    @classmethod
    def for_bucket(cls, tokens: int, max_num_seqs: int, group: int, head_dim: int, fp32: bool) -> "PrefillLayout":
        chunks = min(MAX_GRAPH_CHUNKS, max_num_seqs + 1, tokens)  # + 1: a decode batch beside one chunk
        block_m, _ = query_tiling(tokens, group, head_dim, fp32)
        return cls(tokens, chunks, max_tiles(tokens, chunks, group, block_m), block_m, group)

    @property
    def sizes(self) -> dict[str, int]:
        t, c = self.tokens, self.chunks
        return {"ids": t, "positions": t, "chunk_of_row": t, "table_rows": c + 1, "context_lens": c + 1,
                "query_start": c + 2, "tiles": 2 * self.tiles}

    @property
    def length(self) -> int:
        return sum(self.sizes.values())

    def holds(self, num_tokens: int, num_chunks: int) -> bool:
        return num_tokens <= self.tokens and num_chunks <= self.chunks

    def pack(self, token_ids: list[list[int]], starts: list[int], table_rows: list[int],
             scratch_row: int) -> list[int]:
        """The vector for chunks of `token_ids` at first positions `starts` of the requests in `table_rows`
        (BlockTables rows): the values of every field in `sizes` order, padded."""
        lens = [len(t) for t in token_ids]
        total, n, pad = sum(lens), len(lens), self.chunks
        if not self.holds(total, n):
            raise ValueError(f"{n} chunks of {total} tokens do not fit a layout of {self.chunks} x {self.tokens}")
        ids: list[int] = [t for chunk in token_ids for t in chunk]
        positions: list[int] = []
        chunk_of_row: list[int] = []
        for i, (start, length) in enumerate(zip(starts, lens)):
            positions.extend(range(start, start + length))
            chunk_of_row.extend([i] * length)
        offsets = [0]
        for length in lens:
            offsets.append(offsets[-1] + length)
        rows_pad, chunks_pad = self.tokens - total, pad + 1 - n
        return (ids + [0] * rows_pad + positions + [0] * rows_pad + chunk_of_row + [pad] * rows_pad
                + table_rows + [scratch_row] * chunks_pad
                + [s + length for s, length in zip(starts, lens)] + [0] * chunks_pad
                + offsets + [total] * chunks_pad
                + tile_map(lens, self.group, self.block_m, self.tiles, pad_seq=pad))


def forward(model, pool: KVPool, tables: BlockTables, layout: PrefillLayout, packed: torch.Tensor) -> torch.Tensor:
    """Loops 1..T over a packed bucket (fixed shapes, no host read: graph-safe). packed: [layout.length]
    int64 -> the loop-T readout of every row, [layout.tokens, hidden] (padding rows: garbage)."""
    f = dict(zip(layout.sizes, packed.split(list(layout.sizes.values()))))
    block_tables = tables.table.index_select(0, f["table_rows"])  # [chunks + 1, width] int32
    positions = f["positions"]
    blocks = block_tables[f["chunk_of_row"], positions // pool.block_size].to(torch.int64)
    slots = blocks * pool.block_size + positions % pool.block_size
    meta = BatchMeta(positions, slots, block_tables, f["context_lens"].to(torch.int32),
                     f["query_start"].to(torch.int32), layout.tokens, False,
                     tiles=f["tiles"].to(torch.int32).view(-1, 2))
    return model.run_loops(model.embed(f["ids"]), meta, pool, 1, model.config.total_ut_steps)[-1]
