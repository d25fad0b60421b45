"""CUDA graphs for the hot calls: the shallow step and the deep call, captured per batch-size bucket, and
the prefill, captured per bucket of tokens (engine/prefill_graph.py).

The engine captures every bucket of the calls its mode makes at startup (``capture_all``, vLLM-style,
logged as ``cuda_graphs_captured`` with its time); any other (call, loops, rows-per-request, bucket) is
captured lazily the first time it is needed. A lazy capture runs the call once eagerly on a side stream
first (it may need a Triton specialization compiled, cuBLAS's lazy set-up), then captures. At startup
only the first (largest) bucket of each call gets that eager run: the kernel warm-up has compiled every
specialization by then, and the eager run was the larger half of each capture's time (Python launching
the whole forward); OUROBATCH_CAPTURE_WARMUP=all runs it before every startup capture. Replays copy the
step's small index vectors (token ids, table rows, positions, retained-row slots) into the graph's
static inputs; padding entries point at the scratch table row, whose blocks are the scratch block, so
they write nowhere that matters. Fed token ids that a step not yet read back sampled (async scheduling)
are copied device-to-device into the ids input before the replay, so the graph itself never changes.
Warm-up runs are real runs of the step with the same inputs, and every write they make (KV slots,
retained rows) is idempotent, so capturing mid-generation is safe.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import prefill_graph
from .batch import BlockTables, uniform_meta
from .graph_calls import DeepCall, GraphCall, PrefillCall, ShallowCall
from .kv_cache import KVPool
from .model import OuroForCausalLM
from .prefill_graph import PrefillLayout

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


WARMUP_RUNS = 1  # eager runs before a lazy capture, and before the first capture of each call at startup
WARMUP_ENV = "OUROBATCH_CAPTURE_WARMUP"  # "all": the eager runs before every startup capture too


def warm_every_capture() -> bool:
    """OUROBATCH_CAPTURE_WARMUP=all: an eager run before every startup capture (default: the first of each call)."""
    return os.environ.get(WARMUP_ENV, "").strip().lower() == "all"


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The request counts the shallow and deep calls are captured at (a call pads up to the next one)."""
    return [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # static inputs, [bucket] int64 each
    outputs: list[torch.Tensor] = field(default_factory=list)  # static outputs


class GraphCache:
    """The graphs of one model and its buffers: the KV pool, the block tables and the retained-row buffer
    they read and write (the executor builds a new cache when it reallocates them, on wake-up)."""

    def __init__(self, model: OuroForCausalLM, pool: KVPool, tables: BlockTables, retained_rows: torch.Tensor,
                 max_num_seqs: int, device: torch.device, prefill_layouts: list[PrefillLayout]) -> None:
        self.model, self.pool, self.tables, self.retained_rows = model, pool, tables, retained_rows
        self.device = device
        self.block_size, self.total_ut_steps = pool.block_size, model.config.total_ut_steps
        self.max_num_seqs = max_num_seqs
        self.buckets = batch_buckets(max_num_seqs)
        self.prefill_layouts = prefill_layouts  # the executor's token buckets (prefill_graph.layouts_for)
        self.graphs: dict[tuple[GraphCall, int], _Graph] = {}  # (call, bucket) -> graph
        self.mempool = torch.cuda.graph_pool_handle()
        self.num_captures = 0
        self.warmup_runs = WARMUP_RUNS  # capture_all lowers it to 0 past each call's first bucket
        self.capture_mode = "global"  # torch.cuda.graph's capture_error_mode (capture_all: thread_local on request)
        self.capture_seconds: dict[tuple[GraphCall, int], float] = {}  # (call, bucket) -> capture_all's seconds

    def close(self) -> None:
        """Drop every captured graph, the memory pool they share and the model and buffers (sleep, close)."""
        self.graphs.clear()
        self.mempool = None
        self.model = self.pool = self.tables = self.retained_rows = None  # type: ignore[assignment]

    def _bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise RuntimeError(f"{n} requests in one call, more than max_num_seqs={self.buckets[-1]}")

    def _fill(self, g: _Graph, values: dict[str, list[int]], n: int, on_device: dict[str, torch.Tensor]) -> None:
        """Copy the step's index vectors into the graph's inputs (padded); `on_device`: inputs whose first n
        entries come from a device tensor instead (fed token ids the step before sampled), copied after."""
        scratch = {"rows": self.tables.scratch_row}
        for name, buf in g.inputs.items():
            vals = values[name]
            pad = buf.shape[0] - n
            host = torch.tensor(vals + [scratch.get(name, 0)] * pad, dtype=torch.int64, pin_memory=True)
            buf.copy_(host, non_blocking=True)
        for name, t in on_device.items():
            g.inputs[name][:t.shape[0]].copy_(t)

    def _get(self, call: GraphCall, n: int, names: list[str], build: Callable[[dict[str, torch.Tensor]], list],
             values: dict[str, list[int]], on_device: dict[str, torch.Tensor] | None = None,
             bucket: int | None = None) -> _Graph:
        """The graph of (call, bucket), captured now if new, its inputs filled; `bucket` None: the request
        bucket of n, and every input is [bucket] long; else each input is [n] (a prefill's packed vector)."""
        size = self._bucket(n) if bucket is None else n
        bucket = size if bucket is None else bucket
        g = self.graphs.get((call, bucket))
        on_device = on_device or {}
        if g is not None:
            self._fill(g, values, n, on_device)
            return g
        inputs = {name: torch.zeros(size, dtype=torch.int64, device=self.device) for name in names}
        g = _Graph(torch.cuda.CUDAGraph(), inputs)
        self._fill(g, values, n, on_device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                build(inputs)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g.graph, pool=self.mempool, capture_error_mode=self.capture_mode):
            g.outputs = build(inputs)
        self.graphs[(call, bucket)] = g
        self.num_captures += 1
        return g

    def capture_all(self, calls: list[GraphCall], should_stop: Callable[[], bool] | None = None,
                    which: Callable[[GraphCall, int], bool] | None = None, thread_local: bool = False) -> int:
        """Capture every bucket of the prefill and of each call in `calls` (`which`: those it selects) not captured
        yet. The dummy inputs all point at the scratch table row, so the runs write only the scratch block and the
        scratch row's retained rows. Returns the graphs captured. The largest bucket goes first, so the smaller
        ones reuse its memory in the shared pool (vLLM's order), and only it gets the eager warm-up run (module
        docstring); `capture_seconds` records each (call, bucket)'s time (startup log, benchmarks).
        `thread_local`: captures in thread-local mode, so another thread's launches and module loads (the
        startup's compile pass, still running: ourobatch/kernel_prefetch.py) do not break them."""
        before = self.num_captures
        every = warm_every_capture()
        todo = [(PrefillCall(), layout.tokens) for layout in reversed(self.prefill_layouts)]
        todo += [(call, bucket) for call in calls for bucket in reversed(self.buckets)]
        todo = [(c, b) for c, b in todo if (c, b) not in self.graphs and (which is None or which(c, b))]
        layouts = {layout.tokens: layout for layout in self.prefill_layouts}
        warmed: set[GraphCall] = set()
        self.capture_mode = "thread_local" if thread_local else "global"
        try:
            for call, bucket in todo:
                if should_stop is not None and should_stop():
                    break
                self.warmup_runs = WARMUP_RUNS if every or call not in warmed else 0
                warmed.add(call)
                started = time.perf_counter()
                if isinstance(call, PrefillCall):  # one token at position 0 of the scratch row
                    self.prefill(layouts[bucket], [[0]], [0], [self.tables.scratch_row])
                else:
                    self._capture_decode(call, bucket)
                torch.cuda.synchronize(self.device)
                self.capture_seconds[call, bucket] = time.perf_counter() - started
        finally:
            self.warmup_runs = WARMUP_RUNS  # lazy captures later always warm up
            self.capture_mode = "global"
        return self.num_captures - before

    def _capture_decode(self, call: GraphCall, bucket: int) -> None:
        """One dummy run of a shallow or deep call at `bucket` requests, all on the scratch row."""
        rows = [self.tables.scratch_row] * bucket
        if isinstance(call, ShallowCall):
            self.shallow([0] * bucket, rows, [0] * bucket, [0] * bucket if call.retain else None, call.last_loop)
        else:
            self.deep(rows, [0] * bucket, call.rows_per_request, call.first_loop)

    def shallow(self, token_ids: list[int], rows: list[int], positions: list[int],
                retain_slots: list[int] | None, last_loop: int,
                device_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """One shallow step; `device_ids` ([n] int64 on the device), when given, are the fed ids instead of
        `token_ids` (async scheduling: some were sampled by a step not read yet)."""
        n = len(rows)
        retain = retain_slots is not None
        model, pool, tables, retained_rows = self.model, self.pool, self.tables, self.retained_rows

        def build(inp: dict[str, torch.Tensor]) -> list[torch.Tensor]:
            meta = uniform_meta(tables, inp["rows"], inp["positions"], 1, self.block_size)
            readouts = model.run_loops(model.embed(inp["ids"]), meta, pool, 1, last_loop)
            if retain:
                retained_rows[inp["rows"], inp["slots"]] = readouts[-1]
            return readouts

        values = {"ids": token_ids, "rows": rows, "positions": positions, "slots": retain_slots or [0] * n}
        names = ["ids", "rows", "positions"] + (["slots"] if retain else [])
        on_device = {"ids": device_ids} if device_ids is not None else None
        g = self._get(ShallowCall(last_loop, retain), n, names, build, values, on_device)
        g.graph.replay()
        return [h[:n] for h in g.outputs]

    def prefill(self, layout: PrefillLayout, token_ids: list[list[int]], starts: list[int],
                table_rows: list[int], device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Loops 1..T over prompt chunks (engine/prefill_graph.py) -> the loop-T readouts [layout.tokens, hidden]:
        the graph's static output, overwritten by its next replay (copy what must outlive the step).
        `device_ids`: the first ids, copied from the device after the packed vector (not read back yet)."""
        values = layout.pack(token_ids, starts, table_rows, self.tables.scratch_row)
        model, pool, tables = self.model, self.pool, self.tables

        def build(inp: dict[str, torch.Tensor]) -> list[torch.Tensor]:
            return [prefill_graph.forward(model, pool, tables, layout, inp["packed"])]

        on_device = {"packed": device_ids} if device_ids is not None else None
        g = self._get(PrefillCall(), layout.length, ["packed"], build, {"packed": values}, on_device,
                      bucket=layout.tokens)
        g.graph.replay()
        return g.outputs[0]

    def deep(self, rows: list[int], starts: list[int], R: int, first_loop: int) -> torch.Tensor:
        n = len(rows)
        model, pool, tables, retained_rows = self.model, self.pool, self.tables, self.retained_rows

        def build(inp: dict[str, torch.Tensor]) -> list[torch.Tensor]:
            meta = uniform_meta(tables, inp["rows"], inp["starts"], R, self.block_size)
            h = retained_rows[inp["rows"], :R].reshape(-1, retained_rows.shape[-1])
            h_T = model.run_loops(h, meta, pool, first_loop, self.total_ut_steps)[-1]
            return [h_T.view(-1, R, h_T.shape[-1])[:, -1]]

        g = self._get(DeepCall(first_loop, R), n, ["rows", "starts"], build, {"rows": rows, "starts": starts})
        g.graph.replay()
        return g.outputs[0][:n]
