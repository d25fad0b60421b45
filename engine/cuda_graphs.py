"""CUDA graphs for the hot calls: the shallow step and the deep call, captured per batch-size bucket.

The engine captures every bucket of the calls its mode makes at startup (``capture_all``, vLLM-style,
logged as ``cuda_graphs_captured`` with its time); any other (call, loops, rows-per-request, bucket) is
captured lazily the first time it is needed. A capture warms up twice on a side stream (Triton
compiles, cuBLAS picks kernels), then captures. Replays copy the
step's small index vectors (token ids, table rows, positions, retained-row slots) into the graph's
static inputs; padding entries point at the scratch table row, whose blocks are the scratch block, so
they write nowhere that matters. Warm-up runs are real runs of the step with the same inputs, and every
write they make (KV slots, retained rows) is idempotent, so capturing mid-generation is safe.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from .batch import uniform_meta

if TYPE_CHECKING:
    from .executor import ModelExecutor

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # static inputs, [bucket] int64 each
    outputs: list[torch.Tensor] = field(default_factory=list)  # static outputs


class GraphCache:
    def __init__(self, executor: "ModelExecutor", max_num_seqs: int) -> None:
        self.ex = weakref.proxy(executor)  # no executor <-> graphs cycle: closing frees both at once
        self.max_num_seqs = max_num_seqs
        self.buckets = [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.num_captures = 0

    def close(self) -> None:
        """Drop every captured graph and the memory pool they share."""
        self.graphs.clear()
        self.pool = None

    def _bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise RuntimeError(f"{n} requests in one call, more than max_num_seqs={self.buckets[-1]}")

    def _fill(self, g: _Graph, values: dict[str, list[int]], n: int) -> None:
        scratch = {"rows": self.ex.tables.scratch_row}
        for name, buf in g.inputs.items():
            vals = values[name]
            pad = buf.shape[0] - n
            host = torch.tensor(vals + [scratch.get(name, 0)] * pad, dtype=torch.int64, pin_memory=True)
            buf.copy_(host, non_blocking=True)

    def _get(self, key: tuple, n: int, names: list[str], build: Callable[[dict[str, torch.Tensor]], list],
             values: dict[str, list[int]]) -> _Graph:
        bucket = self._bucket(n)
        g = self.graphs.get(key + (bucket,))
        if g is not None:
            self._fill(g, values, n)
            return g
        inputs = {name: torch.zeros(bucket, dtype=torch.int64, device=self.ex.device) for name in names}
        g = _Graph(torch.cuda.CUDAGraph(), inputs)
        self._fill(g, values, n)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                build(inputs)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.outputs = build(inputs)
        self.graphs[key + (bucket,)] = g
        self.num_captures += 1
        return g

    def capture_all(self, calls: list[tuple], should_stop: Callable[[], bool] | None = None) -> int:
        """Capture every bucket of each call in `calls`: ("shallow", last_loop, retain) or ("deep",
        first_loop, rows_per_request). The dummy inputs all point at the scratch table row, so the runs
        write only the scratch block and the scratch row's retained rows. Returns the graphs captured."""
        before = self.num_captures
        for call in calls:
            for bucket in self.buckets:
                if should_stop is not None and should_stop():
                    return self.num_captures - before
                rows = [self.ex.tables.scratch_row] * bucket
                if call[0] == "shallow":
                    self.shallow([0] * bucket, rows, [0] * bucket, [0] * bucket if call[2] else None, call[1])
                else:
                    self.deep(rows, [0] * bucket, call[2], call[1])
        return self.num_captures - before

    def shallow(self, token_ids: list[int], rows: list[int], positions: list[int],
                retain_slots: list[int] | None, last_loop: int) -> list[torch.Tensor]:
        ex, n = self.ex, len(rows)
        retain = retain_slots is not None

        def build(inp: dict[str, torch.Tensor]) -> list[torch.Tensor]:
            meta = uniform_meta(ex.tables, inp["rows"], inp["positions"], 1, ex.block_size)
            readouts = ex.model.run_loops(ex.model.embed(inp["ids"]), meta, ex.pool, 1, last_loop)
            if retain:
                ex.retained_rows[inp["rows"], inp["slots"]] = readouts[-1]
            return readouts

        values = {"ids": token_ids, "rows": rows, "positions": positions, "slots": retain_slots or [0] * n}
        names = ["ids", "rows", "positions"] + (["slots"] if retain else [])
        g = self._get(("shallow", last_loop, retain), n, names, build, values)
        g.graph.replay()
        return [h[:n] for h in g.outputs]

    def deep(self, rows: list[int], starts: list[int], R: int, first_loop: int) -> torch.Tensor:
        ex, n = self.ex, len(rows)

        def build(inp: dict[str, torch.Tensor]) -> list[torch.Tensor]:
            meta = uniform_meta(ex.tables, inp["rows"], inp["starts"], R, ex.block_size)
            h = ex.retained_rows[inp["rows"], :R].reshape(-1, ex.retained_rows.shape[-1])
            h_T = ex.model.run_loops(h, meta, ex.pool, first_loop, ex.total_ut_steps)[-1]
            return [h_T.view(-1, R, h_T.shape[-1])[:, -1]]

        g = self._get(("deep", first_loop, R), n, ["rows", "starts"], build, {"rows": rows, "starts": starts})
        g.graph.replay()
        return g.outputs[0][:n]
