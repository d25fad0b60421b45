"""Where the rows of one forward call sit in the paged pool: block-table rows and batch metadata.

Block tables live on the device in one buffer, one row per live request, written when the request
first appears and extended when its block list grows (lazy allocation: a block every block_size
positions; all growths of a step are written in one copy). A step then sends only small index vectors
(table row, first position, token id per request); slots and positions are
computed on the device, which keeps the hot path free of per-request host work and lets the same
function run eagerly or inside a CUDA graph. Nothing here waits for the device: host-to-device copies
go through pinned memory without blocking, and host-built metadata reads the plan's block ids, never
the device tables (async scheduling launches a step while the one before it still runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


# Prompt chunks after shared or cached blocks with at most this many rows run in the paged Triton kernel
# (one batched call; its tile grows with the rows); longer ones gather their history and run SDPA.
MAX_KERNEL_HISTORY_ROWS = 64


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without waiting for the device (pinned memory, queued copy)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def fed_ids(token_ids: list[int | None], rows: list[int], next_tokens: torch.Tensor, vocab_size: int
            ) -> tuple[list[int], torch.Tensor | None]:
    """A shallow call's fed ids: on the host (0 where not known there) and, when some are not (None: sampled
    by a step not read back yet, async scheduling), all of them on the device, those taken from
    next_tokens[table row] (clamped into the vocabulary: the row of a failed step may hold anything)."""
    if all(t is not None for t in token_ids):
        return token_ids, None  # type: ignore[return-value]
    device = next_tokens.device
    host = [0 if t is None else t for t in token_ids]
    from_device = to_device([t is None for t in token_ids], torch.bool, device)
    drawn = next_tokens.index_select(0, to_device(rows, torch.int64, device)).clamp_(0, vocab_size - 1)
    return host, torch.where(from_device, drawn, to_device(host, torch.int64, device))


@dataclass
class SeqSpan:
    """One request's rows inside a batch of concatenated rows (host view)."""

    row_start: int  # first row of this request in the batch
    num_rows: int  # new rows, at positions context_len - num_rows .. context_len - 1
    context_len: int  # positions visible to the last row (its position + 1)
    block_ids: tuple[int, ...]


class BlockTables:
    """Device-side block tables: ``table[row]`` holds one request's block ids (padded with the scratch block)."""

    def __init__(self, capacity: int, width: int, scratch_block: int, device: torch.device) -> None:
        # row `capacity` is the scratch row: every entry is the scratch block (padding rows of a graph)
        self.table = torch.full((capacity + 1, width), scratch_block, dtype=torch.int32, device=device)
        self.capacity = capacity
        self.width = width
        self.scratch_row = capacity
        self.scratch_block = scratch_block
        self.row_of: dict[str, int] = {}
        self.block_ids_of: dict[str, tuple[int, ...]] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._pending: list[tuple[int, int, int]] = []  # (row, column, block) growths not yet written

    def row(self, request_id: str, block_ids: tuple[int, ...]) -> int:
        row = self.row_of.get(request_id)
        if row is not None:
            known = self.block_ids_of[request_id]
            if len(block_ids) != len(known):  # grown since the last step (a block is never replaced)
                if len(block_ids) > self.width:
                    raise RuntimeError(f"req {request_id}: {len(block_ids)} blocks, block tables hold {self.width}")
                self.grow(row, len(known), block_ids[len(known):])
                self.block_ids_of[request_id] = block_ids
            return row
        if not self._free:
            raise RuntimeError(f"more than {self.capacity} live requests in the executor")
        if len(block_ids) > self.width:
            raise RuntimeError(f"req {request_id}: {len(block_ids)} blocks, block tables hold {self.width}")
        row = self._free.pop()
        padded = list(block_ids) + [self.scratch_block] * (self.width - len(block_ids))
        self.table[row].copy_(to_device(padded, torch.int32, self.table.device), non_blocking=True)
        self.row_of[request_id] = row
        self.block_ids_of[request_id] = block_ids
        return row

    def grow(self, row: int, start: int, new_ids: tuple[int, ...]) -> None:
        self._pending.extend((row, start + i, b) for i, b in enumerate(new_ids))

    def flush(self) -> None:
        """Write every growth since the last flush in one copy (call before the step's first forward)."""
        if not self._pending:
            return
        idx = to_device(self._pending, torch.int64, self.table.device)
        self._pending.clear()
        self.table[idx[:, 0], idx[:, 1]] = idx[:, 2].to(torch.int32)

    def release(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        self.block_ids_of.pop(request_id, None)
        if row is not None:
            self._free.append(row)


@dataclass
class HistoryMeta:
    """The prompt chunks of a prefill call that start after shared or cached blocks (they attend to a
    history in the pool), as one batch for the paged kernel."""

    rows: torch.Tensor  # [n] int64: their rows in the call
    block_tables: torch.Tensor  # [chunks, width] int32
    context_lens: torch.Tensor  # [chunks] int32
    query_start: torch.Tensor  # [chunks + 1] int32, offsets within `rows`
    max_rows: int


@dataclass
class FreshGroup:
    """Prompt chunks from position 0 of one length: one batched causal SDPA call."""

    num_seqs: int
    num_rows: int  # rows of each chunk
    rows: slice | torch.Tensor  # their rows in the call: a slice when contiguous, else [num_seqs * num_rows] int64
    kv_start: int  # their keys' first row in PrefillAttention.fresh_slots (this call's keys, read from the plane)


@dataclass
class GatheredChunk:
    """A prompt chunk after shared or cached blocks that gathers its history from the pool and runs SDPA."""

    rows: slice  # its rows in the call, at positions context_len - num_rows .. context_len - 1
    kv_start: int  # its context's first row in PrefillAttention.gathered_slots
    context_len: int
    mask: torch.Tensor  # [num_rows, context_len] bool: a row sees the positions up to its own


@dataclass
class PrefillAttention:
    """How a prefill call's attention splits into batched calls, computed once per step (every layer pass of
    every loop only launches them). Pieces: the fresh groups, the chunks with a history (the paged kernel's
    batch, BatchMeta.history, or one gathered SDPA call each). Each kind reads its keys in one gather."""

    fresh: list[FreshGroup]
    fresh_slots: torch.Tensor | None  # [fresh rows] int64: KV slots of the fresh groups' rows, group after group
    gathered: list[GatheredChunk]
    gathered_slots: torch.Tensor | None  # [sum of context_len] int64: slots of each gathered chunk's positions
    whole: bool  # a single piece covers every row in order: its output is the call's, no scatter


@dataclass
class SpanRead:
    """What the reference attention reads for one request, computed once per step (engine/attention.py
    paged_attention): the KV slots of its context and its causal mask."""

    slots: torch.Tensor  # [context_len] int64: KV slots of positions 0 .. context_len - 1
    mask: torch.Tensor | None  # [1, num_rows, context_len] bool, True where a key is after the row (None: 1 row)


@dataclass
class BatchMeta:
    """One forward call's rows. Tensors are on the device; `spans` is the host view (None in graphs)."""

    positions: torch.Tensor  # [rows] int64 absolute positions
    slots: torch.Tensor  # [rows] int64 flat KV slot of each row (the same in every loop plane)
    block_tables: torch.Tensor  # [seqs, width] int32
    context_lens: torch.Tensor  # [seqs] int32: positions visible to each sequence's last row
    query_start: torch.Tensor  # [seqs + 1] int32: row offsets of each sequence
    max_rows: int  # most rows of one sequence (sizes the attention tile)
    prefill: bool  # every sequence is a whole prompt from position 0: dense causal attention
    spans: list[SeqSpan] | None = None
    history: HistoryMeta | None = None  # prefill: the chunks with a history for the paged kernel (None: none)
    prefill_attention: PrefillAttention | None = None  # prefill: the batched attention calls
    reads: list[SpanRead] | None = None  # the reference attention's per-span reads (one per span)
    tiles: torch.Tensor | None = None  # [num_tiles, 2] int32: the paged kernel's tile map (engine/prefill_graph.py)
    rope: dict = field(default_factory=dict)  # the reference path's RoPE cos/sin per dtype (engine/model.py)


def uniform_meta(tables: BlockTables, row_ids: torch.Tensor, starts: torch.Tensor, rows_per_seq: int,
                 block_size: int, spans: list[SeqSpan] | None = None) -> BatchMeta:
    """Metadata for `rows_per_seq` contiguous rows per sequence, computed on the device (graph-safe).

    row_ids, starts: [seqs] int64 (table row and first position of each sequence). With `spans` (the
    reference attention's host view) the per-span reads are computed here too.
    """
    R = rows_per_seq
    seqs = row_ids.shape[0]
    offs = torch.arange(R, device=row_ids.device, dtype=torch.int64)
    positions = (starts[:, None] + offs[None, :]).reshape(-1)  # [seqs * R]
    block_tables = tables.table.index_select(0, row_ids)  # [seqs, width]
    seq_of_row = torch.arange(seqs, device=row_ids.device).repeat_interleave(R)
    blocks = block_tables[seq_of_row, positions // block_size].to(torch.int64)
    slots = blocks * block_size + positions % block_size
    context_lens = (starts + R).to(torch.int32)
    query_start = (torch.arange(seqs + 1, device=row_ids.device, dtype=torch.int32) * R)
    reads = span_reads(spans, block_size, row_ids.device) if spans else None
    return BatchMeta(positions, slots, block_tables, context_lens, query_start, R, False, spans, reads=reads)


def varlen_meta(tables: BlockTables, starts: list[int], num_rows: list[int], block_ids: list[tuple[int, ...]],
                block_size: int, prefill: bool, device: torch.device, *, paged_history: bool = False,
                reads: bool = False) -> BatchMeta:
    """Metadata for sequences with different row counts (prefills, and the general case), built on the host
    from each sequence's block ids (its table row holds the same ids).

    prefill: also the batched attention calls (PrefillAttention); `paged_history`: the backend runs chunks
    after a history in the paged kernel when none has more than MAX_KERNEL_HISTORY_ROWS rows (else each
    gathers its history for SDPA). `reads`: the reference attention's per-span reads (non-prefill)."""
    positions, spans, row = [], [], 0
    for block_table, start, n in zip(block_ids, starts, num_rows):
        positions.extend(range(start, start + n))
        spans.append(SeqSpan(row, n, start + n, block_table))
        row += n
    pos = torch.tensor(positions, dtype=torch.int64)
    seq_of_row = torch.repeat_interleave(torch.arange(len(starts)), torch.tensor(num_rows))
    # the rows' device tables, as the plan's block ids (padded with the scratch block): no device read
    pad = tables.scratch_block
    host_tables = torch.tensor([list(b) + [pad] * (tables.width - len(b)) for b in block_ids], dtype=torch.int32)
    slots = host_tables[seq_of_row, pos // block_size].to(torch.int64) * block_size + pos % block_size
    query_start = torch.zeros(len(starts) + 1, dtype=torch.int32)
    query_start[1:] = torch.tensor(num_rows).cumsum(0)
    context_lens = torch.tensor([s + n for s, n in zip(starts, num_rows)], dtype=torch.int32)
    meta = BatchMeta(_put(pos, device), _put(slots, device), _put(host_tables, device), _put(context_lens, device),
                     _put(query_start, device), max(num_rows), prefill, spans)
    if prefill:
        _plan_prefill(meta, host_tables, slots, block_size, device, paged_history)
    elif reads:
        meta.reads = span_reads(spans, block_size, device, host_tables)
    return meta


def _plan_prefill(meta: BatchMeta, host_tables: torch.Tensor, slots: torch.Tensor, block_size: int,
                  device: torch.device, paged_history: bool) -> None:
    """meta.prefill_attention (and meta.history for the paged kernel): the batched attention calls."""
    spans = meta.spans
    total = spans[-1].row_start + spans[-1].num_rows
    hist = [i for i, s in enumerate(spans) if s.context_len > s.num_rows]
    fresh_of_len: dict[int, list[SeqSpan]] = {}
    for s in spans:
        if s.context_len == s.num_rows:
            fresh_of_len.setdefault(s.num_rows, []).append(s)
    fresh, fresh_idx, start = [], [], 0
    for n, group in fresh_of_len.items():
        first, last = group[0].row_start, group[-1].row_start + n
        if last - first == n * len(group):  # consecutive chunks: a slice of the call's rows
            idx, rows = torch.arange(first, last), slice(first, last)
        else:
            idx = torch.cat([torch.arange(s.row_start, s.row_start + n) for s in group])
            rows = _put(idx, device)
        fresh.append(FreshGroup(len(group), n, rows, start))
        fresh_idx.append(idx)
        start += len(idx)
    fresh_slots = _put(slots[torch.cat(fresh_idx)], device) if fresh else None
    gathered: list[GatheredChunk] = []
    gathered_slots = None
    if hist and paged_history and max(spans[i].num_rows for i in hist) <= MAX_KERNEL_HISTORY_ROWS:
        rows_idx = torch.cat([torch.arange(spans[i].row_start, spans[i].row_start + spans[i].num_rows) for i in hist])
        hq = torch.zeros(len(hist) + 1, dtype=torch.int32)
        hq[1:] = torch.tensor([spans[i].num_rows for i in hist]).cumsum(0)
        ctx = torch.tensor([spans[i].context_len for i in hist], dtype=torch.int32)
        meta.history = HistoryMeta(_put(rows_idx, device), _put(host_tables[hist], device), _put(ctx, device),
                                   _put(hq, device), max(spans[i].num_rows for i in hist))
        pieces, whole_rows = len(fresh) + 1, len(hist) == len(spans)
    elif hist:
        ctx = [spans[i].context_len for i in hist]
        gathered_slots = _put(_context_slots(host_tables, hist, ctx, block_size), device)
        start = 0
        for i in hist:
            s = spans[i]
            mask = (torch.arange(s.context_len, device=device)[None, :]
                    <= torch.arange(s.context_len - s.num_rows, s.context_len, device=device)[:, None])
            gathered.append(GatheredChunk(slice(s.row_start, s.row_start + s.num_rows), start, s.context_len, mask))
            start += s.context_len
        pieces = len(fresh) + len(gathered)
        whole_rows = len(gathered) == 1 and gathered[0].rows == slice(0, total)
    else:
        pieces, whole_rows = len(fresh), isinstance(fresh[0].rows, slice) and fresh[0].rows == slice(0, total)
    meta.prefill_attention = PrefillAttention(fresh, fresh_slots, gathered, gathered_slots,
                                              pieces == 1 and whole_rows)


def _context_slots(host_tables: torch.Tensor, seqs: list[int], context_lens: list[int],
                   block_size: int) -> torch.Tensor:
    """KV slots of positions 0 .. context_len - 1 of each listed table row, concatenated (host tensors)."""
    lens = torch.tensor(context_lens)
    seq = torch.repeat_interleave(torch.tensor(seqs), lens)
    pos = torch.arange(int(lens.sum())) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    return host_tables[seq, pos // block_size].to(torch.int64) * block_size + pos % block_size


def span_reads(spans: list[SeqSpan], block_size: int, device: torch.device,
               host_tables: torch.Tensor | None = None) -> list[SpanRead]:
    """Each span's context slots and causal mask for the reference attention, in one host-built copy."""
    if host_tables is None:
        width = max(len(s.block_ids) for s in spans)
        host_tables = torch.tensor([list(s.block_ids) + [0] * (width - len(s.block_ids)) for s in spans],
                                   dtype=torch.int32)
    ctx = [s.context_len for s in spans]
    parts = _put(_context_slots(host_tables, list(range(len(spans))), ctx, block_size), device).split(ctx)
    reads = []
    for s, s_slots in zip(spans, parts):
        mask = None
        if s.num_rows > 1:
            q_pos = torch.arange(s.context_len - s.num_rows, s.context_len, device=device)
            mask = torch.arange(s.context_len, device=device)[None, None, :] > q_pos[None, :, None]
        reads.append(SpanRead(s_slots, mask))
    return reads


def _put(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, queued (pinned first on CUDA, so the copy never waits for the device)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
