"""Checkpoint bytes onto the device by reads, not through a memory map.

Why. safetensors' ``get_tensor`` hands out views of a private memory map of the file, so the loader's
copy out of it took a page fault per 4 KiB page, and ~15 Python-level torch calls per tensor (its check
included), each of which gives the GIL up and must win it back. On the H200 the load of 2.87 GB took
0.69-0.92 s in some engine starts and 1.3-2.8 s in others (session 20's cold starts), always beside the
kernel pass: 14 threads loading cached kernels in a second process (mostly Python: they want the GIL),
~50 forks of compile children in a cold one (a fork holds the mmap lock for writing while it copies the
page tables; a page fault waits for it). That reading of the spread is ours, not measured on the H200 in
isolation; benchmarks/weight_load.py measures both paths side by side under each kind of contention.

How. Each file's tensors, in file order, are grouped into chunks of up to STAGE_BYTES. READ_AHEAD
chunks are read at once by a pool of threads with ``os.preadv`` into their own staging buffers (pinned
on CUDA): no page faults (the buffers are resident), the GIL released for the whole read. Per chunk the
main thread then makes one ``torch._foreach_copy_`` call for all its tensors (each a typed slice of the
buffer to its own new tensor on the device), records an event, and hands the buffer back to the pool for
the chunk READ_AHEAD further on; the reader waits for that event before overwriting it. A tensor larger
than a chunk is read in pieces straight into its device copy. The bytes land in the stored dtype (the
loader converts them on the device). Per tensor that leaves ~2 torch calls (the allocation, and a
reshape past one dimension). On the CPU the path is the same, with plain buffers and no events, so
every CPU test that loads a checkpoint runs it.

The file's layout comes from its safetensors header (8 bytes of little-endian length, then JSON:
name -> dtype, shape, data_offsets relative to the end of the header), parsed here after safetensors
itself has opened the file (so a malformed file is still reported by the loader as not readable).
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from scheduler.errors import CheckpointError

STAGE_BYTES = 64 << 20  # each staging buffer (a chunk: ~2.87 GB of Ouro-1.4B in 45)
READ_AHEAD = 3  # staging buffers, and chunks read at once
ALIGN = 64  # a group's read starts at a multiple of this (every dtype's alignment)
HEADER_LIMIT = 100 << 20  # safetensors' own limit on the header's size

# safetensors' dtype names (the format's spec) -> torch
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
          "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True)
class Span:
    """One tensor's bytes in its file: [start, end) are absolute offsets."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Chunk:
    """One read: the file's bytes [start, end) and the spans inside them; `whole`: a piece [start, end) of
    one span larger than a staging buffer (its pieces are consecutive chunks)."""

    start: int
    end: int
    spans: tuple[Span, ...]
    whole: bool = False


def tensor_spans(file: Path) -> dict[str, Span]:
    """Every tensor's Span in a safetensors file (CheckpointError naming the file when the header is not
    one: safetensors' reader has accepted it first, so this is a file that changed or a foreign dtype)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < length <= min(HEADER_LIMIT, size - 8):
            raise CheckpointError(f"{file}: not a readable safetensors file (header length {length})")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file (header: {exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: not a readable safetensors file (its header is not a JSON object)")
    base, spans = 8 + length, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(v) for v in entry["data_offsets"])
            dtype, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: tensor {name} has a malformed header entry {entry!r}") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{file}: tensor {name} has dtype {dtype}, not one of {sorted(DTYPES)}")
        spans[name] = Span(name, DTYPES[dtype], shape, base + begin, base + end)
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= size - base or end - begin != numel * DTYPES[dtype].itemsize:
            raise CheckpointError(f"{file}: tensor {name}'s bytes [{begin}, {end}) do not fit its shape {shape} "
                                  f"and dtype {dtype} inside the file")
    return spans


def shard_spans(file: Path, names: list[str]) -> list[Span]:
    """The Spans of `names` in `file` (tensor_spans), in that order; CheckpointError naming the first that
    the file lacks though its index lists it there."""
    spans = tensor_spans(file)
    for name in names:
        if name not in spans:
            raise CheckpointError(f"{file.name}: tensor {name} listed in the index is not in the file")
    return [spans[name] for name in names]


def plan_chunks(spans: list[Span], stage_bytes: int) -> list[Chunk]:
    """The reads for `spans`, in file order: consecutive spans grouped while they fit one staging buffer
    (a group starts ALIGN-aligned, a few bytes early, so each tensor sits in the buffer as in the file); a
    span larger than that is read in pieces (`whole`) of at most stage_bytes."""
    chunks: list[Chunk] = []
    group: list[Span] = []

    def close_group() -> None:
        if group:
            chunks.append(Chunk(group[0].start // ALIGN * ALIGN, max(s.end for s in group), tuple(group)))
            group.clear()

    for span in sorted(spans, key=lambda s: s.start):
        if span.nbytes > stage_bytes - ALIGN:
            close_group()
            for at in range(span.start, span.end, stage_bytes):
                chunks.append(Chunk(at, min(at + stage_bytes, span.end), (span,), whole=True))
            continue
        if group and span.end - group[0].start // ALIGN * ALIGN > stage_bytes:
            close_group()
        group.append(span)
    close_group()
    return chunks


class StagedReader:
    """Reads tensors of checkpoint files onto `device` through `depth` staging buffers (module docstring):
    up to `depth` chunks are read at once by a pool of threads, ahead of the copies out of them. Use as a
    context manager: leaving it waits for every copy out of the buffers."""

    def __init__(self, device: torch.device, stage_bytes: int | None = None, depth: int | None = None) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.stage_bytes, self.depth = stage_bytes or STAGE_BYTES, depth or READ_AHEAD  # None: the module's
        if self.stage_bytes <= ALIGN:
            raise ValueError(f"stage_bytes must be more than {ALIGN}, got {self.stage_bytes}")
        self.buffers: list[torch.Tensor] = []  # made at the first file, as large as its largest chunk
        self.events: list[torch.cuda.Event | None] = [None] * self.depth  # the copies out of each buffer
        self.next_slot = 0
        self.pool = ThreadPoolExecutor(self.depth, thread_name_prefix="ourobatch-weights")
        self.whole: torch.Tensor | None = None  # a span being read in pieces
        self.read_s = 0.0  # seconds the copies waited for reads

    def __enter__(self) -> "StagedReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self._wait_for_copies()  # no copy out of a staging buffer outlives the reader

    def read_file(self, file: Path, spans: list[Span]) -> Iterator[tuple[Span, torch.Tensor]]:
        """Each span's tensor on the device, in its dtype as stored, in file order (its copy queued)."""
        chunks = plan_chunks(spans, self.stage_bytes)
        largest = max((c.end - c.start for c in chunks), default=0)
        if not self.buffers or self.buffers[0].numel() < largest:
            self._wait_for_copies()
            size = -(-largest // ALIGN) * ALIGN  # a multiple of every itemsize: typed views of the whole
            self.buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(self.depth)]
        fd = os.open(file, os.O_RDONLY)
        pending: deque[tuple[Future, int]] = deque()
        try:
            for chunk in chunks[:self.depth]:
                pending.append(self._submit(file, fd, chunk))
            for k, chunk in enumerate(chunks):
                future, slot = pending.popleft()
                started = time.perf_counter()
                future.result()
                self.read_s += time.perf_counter() - started
                tensors = self._copies(chunk, self.buffers[slot])
                if self.cuda:
                    self.events[slot] = torch.cuda.Event()
                    self.events[slot].record()
                if k + self.depth < len(chunks):
                    pending.append(self._submit(file, fd, chunks[k + self.depth]))
                yield from tensors
        finally:
            for future, _ in pending:
                future.cancel()
            wait([future for future, _ in pending])  # no read of this descriptor is left running
            os.close(fd)

    def _submit(self, file: Path, fd: int, chunk: Chunk) -> tuple[Future, int]:
        """Read `chunk` into the next buffer, on a pool thread, once the device has copied out of it."""
        slot, self.next_slot = self.next_slot, (self.next_slot + 1) % self.depth
        event, self.events[slot] = self.events[slot], None
        return self.pool.submit(_read_chunk, file, fd, chunk, self.buffers[slot], event), slot

    def _copies(self, chunk: Chunk, buffer: torch.Tensor) -> list[tuple[Span, torch.Tensor]]:
        """Queue the copies out of a landed chunk; the tensors it completes."""
        if chunk.whole:
            span = chunk.spans[0]
            if chunk.start == span.start:
                self.whole = torch.empty(span.shape, dtype=span.dtype, device=self.device)
            at, n = chunk.start - span.start, chunk.end - chunk.start
            self.whole.view(-1).view(torch.uint8)[at:at + n].copy_(buffer[:n], non_blocking=True)
            return [(span, self.whole)] if chunk.end == span.end else []
        flats, sources, tensors, typed = [], [], [], {}
        for span in chunk.spans:
            at, item = span.start - chunk.start, span.dtype.itemsize
            if span.nbytes and at % item == 0:  # the common case: one typed slice of the buffer
                view = typed.get(span.dtype)
                if view is None:
                    view = typed[span.dtype] = buffer.view(span.dtype)
                flat = torch.empty(span.nbytes // item, dtype=span.dtype, device=self.device)
                flats.append(flat)
                sources.append(view[at // item:(at + span.nbytes) // item])
                tensors.append((span, flat))
                continue
            out = torch.empty(span.shape, dtype=span.dtype, device=self.device)  # empty, or not aligned
            if span.nbytes:
                out.view(-1).view(torch.uint8).copy_(buffer[at:at + span.nbytes], non_blocking=True)
            tensors.append((span, out))
        if flats:
            torch._foreach_copy_(flats, sources, non_blocking=True)  # one call for the chunk's tensors
        return [(span, t if t.shape == span.shape else t.view(span.shape)) for span, t in tensors]

    def _wait_for_copies(self) -> None:
        for event in self.events:
            if event is not None:
                event.synchronize()
        self.events = [None] * self.depth


def _read_chunk(file: Path, fd: int, chunk: Chunk, buffer: torch.Tensor, event) -> None:
    """buffer[:n] <- the chunk's bytes, once `event` (the copies out of the buffer's last chunk) is done."""
    if event is not None:
        event.synchronize()
    view = memoryview(buffer.numpy())[:chunk.end - chunk.start]
    done = 0
    while done < len(view):  # preadv releases the GIL; a short read is retried
        got = os.preadv(fd, [view[done:]], chunk.start + done)
        if got <= 0:
            raise CheckpointError(f"{file}: the file ended at byte {chunk.start + done} while it was read "
                                  f"(it changed while loading?)")
        done += got
