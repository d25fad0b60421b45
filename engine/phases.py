"""The phases a step runs (ModelExecutor's, over the state its __init__ sets): prefill, shallow, deep.

Prefill runs loops 1..T over prompt chunks: as a fixed-shape call of a token bucket (engine/prefill_graph.py;
a CUDA graph replay, or eagerly with ``static_prefill``) when one holds the chunks, else eagerly with host-
built metadata. At full depth a step's decode rows are rows of loops 1..T too, so they join that call as
one-token chunks after their histories (``_merged``): the weights are read once per loop for both, and a
step that prefills costs about what its prompt tokens cost. A failure of that call fails both phases.
The shallow call runs one fed token per decoding request (loops 1..last_loop) and the deep call the
retained rows of every boundary request (loops first_loop..T), graphed per batch bucket where uniform.
"""

from __future__ import annotations

import itertools

import torch

from scheduler.plan import DeepWork, PrefillWork, ShallowWork, StepPlan, VerifyResult

from . import prefill_graph
from .batch import BatchMeta, SeqSpan, fed_ids, to_device, uniform_meta, varlen_meta
from .pending import PendingStep
from .prefill_graph import PrefillLayout, merged_layout, smallest_layout
from .prompt_logprobs import prompt_logprobs
from .readout import Readout, require_finite
from .verify import VerifyItem, verify_batch


class StepPhases:
    """Mixed into ModelExecutor: reads model, pool, tables, graphs, kept_rows, next_tokens, device and the
    settings it holds; launch() calls the phases and turns what they raise into StepFailures."""

    def _spans(self, works, starts: list[int], num_rows: list[int]) -> list[SeqSpan] | None:
        if self.attention != "torch":
            return None
        spans, row = [], 0
        for w, start, n in zip(works, starts, num_rows):
            spans.append(SeqSpan(row, n, start + n, w.block_ids))
            row += n
        return spans

    def _index(self, values: list[int]) -> torch.Tensor:
        return to_device(values, torch.int64, self.device)

    def _prefill(self, works: tuple[PrefillWork, ...], step: PendingStep,
                 h_T: torch.Tensor | None = None) -> list[Readout]:
        """The prefill phase's readouts; `h_T`: its rows' loop-T readouts when a merged call computed them."""
        run = [w for w in works if w.token_ids]  # forks (sample_from) compute nothing
        lens = [len(w.token_ids) for w in run]
        row_starts = list(itertools.accumulate(lens, initial=0))[:-1]
        wants_prompt = any(w.prompt_logprobs is not None for w in run)
        if h_T is None:
            h_T = self._prefill_rows(run, lens, keep=wants_prompt)
        if wants_prompt:  # engine/prompt_logprobs.py, read with the result
            step.prompt_job = lambda: prompt_logprobs(self.model, h_T, run, row_starts, self.logprobs_mode,
                                                      self.head_dtype, require_finite)
        last = {w.request_id: start + n - 1 for w, start, n in zip(run, row_starts, lens)}
        items = [(w.request_id, w.sample) for w in works if w.sample is not None]
        keep = [last[w.sample_from or w.request_id] for w in works if w.sample is not None]
        return [Readout(h_T.index_select(0, self._index(keep)), items)] if items else []

    def _prefill_rows(self, run: list[PrefillWork], lens: list[int], keep: bool) -> torch.Tensor:
        """Every chunk row's loop-T readout, [sum(lens), hidden]: the fixed-shape call of the smallest token
        bucket that holds them (engine/prefill_graph.py; copied when `keep`: read after the step), else eager."""
        layout = self._layout(sum(lens), len(run))
        if layout is not None:
            h = self._static(layout, [list(w.token_ids) for w in run], [w.start_position for w in run],
                             [self.tables.row_of[w.request_id] for w in run])[:sum(lens)]
            return h.clone() if keep else h
        meta = varlen_meta(self.tables, [w.start_position for w in run], lens, [w.block_ids for w in run],
                           self.block_size, prefill=True, device=self.device, paged_history=self.attention == "triton")
        ids = self._index([t for w in run for t in w.token_ids])
        return self.model.run_loops(self.model.embed(ids), meta, self.pool, 1, self.total_ut_steps)[-1]

    @property
    def _fixed_layouts(self) -> list[PrefillLayout]:
        """The buckets of fixed-shape prefill calls (graphed, or eager with static_prefill); none otherwise."""
        return self.prefill_layouts if self.graphs is not None or self.static_prefill else []

    def _layout(self, num_tokens: int, num_chunks: int) -> PrefillLayout | None:
        """The bucket of a fixed-shape prefill call, or None."""
        return smallest_layout(self._fixed_layouts, num_tokens, num_chunks)

    def _static(self, layout: PrefillLayout, chunks: list[list[int]], starts: list[int], rows: list[int],
                device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Loops 1..T over chunks in `layout` -> [layout.tokens, hidden] (a graph's output: overwritten by its
        next replay). `device_ids`: the first ids, from the device (tokens not read back yet)."""
        if self.graphs is not None:
            return self.graphs.prefill(layout, chunks, starts, rows, device_ids)
        packed = self._index(layout.pack(chunks, starts, rows, self.tables.scratch_row))
        if device_ids is not None:
            packed[:device_ids.shape[0]] = device_ids
        return prefill_graph.forward(self.model, self.pool, self.tables, layout, packed)

    def _merge_layout(self, plan: StepPlan) -> PrefillLayout | None:
        """The bucket of one call for the step's prompt chunks and its decode rows, when every decode row runs
        loops 1..T and reads loop T (full depth: both are rows of loops 1..T at their positions) and merging
        pads little (prefill_graph.merged_layout), else None."""
        T = self.total_ut_steps
        if not (plan.prefills and plan.shallow) or any(
                w.last_loop != T or w.retain or (w.sample is not None and w.sample.loop != T) for w in plan.shallow):
            return None
        run = [w for w in plan.prefills if w.token_ids]
        return merged_layout(self._fixed_layouts, sum(len(w.token_ids) for w in run), len(run), len(plan.shallow))

    def _merged(self, plan: StepPlan, layout: PrefillLayout, step: PendingStep) -> list[Readout]:
        """Prefill and full-depth decode rows in one call: each decode row is a chunk of one token after its
        history (first, so fed ids that are still on the device fill the packed vector's first entries), so
        the weights are read once per loop for both."""
        shallow, run = plan.shallow, [w for w in plan.prefills if w.token_ids]
        rows = [self.tables.row_of[w.request_id] for w in shallow]
        host_ids, device_ids = fed_ids([w.token_id for w in shallow], rows, self.next_tokens,
                                       self.model_config.vocab_size)
        h = self._static(layout, [[t] for t in host_ids] + [list(w.token_ids) for w in run],
                         [w.position for w in shallow] + [w.start_position for w in run],
                         rows + [self.tables.row_of[w.request_id] for w in run], device_ids)
        n, k = len(shallow), sum(len(w.token_ids) for w in run)
        h_run = h[n:n + k]
        if any(w.prompt_logprobs is not None for w in run):
            h_run = h_run.clone()  # read after the step
        readouts = self._prefill(plan.prefills, step, h_T=h_run)
        idx = [i for i, w in enumerate(shallow) if w.sample is not None]
        if idx:
            readouts.append(Readout(h[:n].index_select(0, self._index(idx)),
                                    [(shallow[i].request_id, shallow[i].sample) for i in idx]))
        return readouts

    def _shallow(self, works: tuple[ShallowWork, ...]) -> list[Readout]:
        out: list[Readout] = []
        groups: dict[tuple[int, bool], list[ShallowWork]] = {}
        for w in works:
            groups.setdefault((w.last_loop, w.retain), []).append(w)
        for (last_loop, retain), group in groups.items():
            rows = [self.tables.row_of[w.request_id] for w in group]
            slots = self.kept_rows.next_slots(group) if retain else None
            positions = [w.position for w in group]
            readouts = self._run_shallow([w.token_id for w in group], rows, positions, slots, last_loop, group)
            if retain:
                self.kept_rows.advance(group)
            by_loop: dict[int, list[int]] = {}
            for i, w in enumerate(group):
                if w.sample is not None:
                    by_loop.setdefault(w.sample.loop, []).append(i)
            for loop, idx in by_loop.items():
                h = readouts[loop - 1]
                if len(idx) != len(group):
                    h = h.index_select(0, self._index(idx))
                out.append(Readout(h, [(group[i].request_id, group[i].sample) for i in idx]))
        return out

    def _run_shallow(self, token_ids: list[int | None], rows: list[int], positions: list[int],
                     retain_slots: list[int] | None, last_loop: int, works) -> list[torch.Tensor]:
        """Loops 1..last_loop over one fed token per request (None: the token this request's last sampled
        step drew, read from next_tokens); returns readouts [n, hidden] of each loop."""
        host_ids, device_ids = fed_ids(token_ids, rows, self.next_tokens, self.model_config.vocab_size)
        if self.graphs is not None:
            return self.graphs.shallow(host_ids, rows, positions, retain_slots, last_loop, device_ids)
        row_t, pos_t = self._index(rows), self._index(positions)
        meta = uniform_meta(self.tables, row_t, pos_t, 1, self.block_size,
                            self._spans(works, positions, [1] * len(rows)))
        ids = device_ids if device_ids is not None else self._index(host_ids)
        readouts = self.model.run_loops(self.model.embed(ids), meta, self.pool, 1, last_loop)
        if retain_slots is not None:
            self.retained_rows[row_t, self._index(retain_slots)] = readouts[-1]
        return readouts

    def _deep(self, works: list[DeepWork]) -> list[Readout]:
        self.kept_rows.check(works)
        first_loop = works[0].first_loop
        R = works[0].num_rows
        rows = [self.tables.row_of[d.request_id] for d in works]
        starts = [d.start_position for d in works]
        if all(d.num_rows == R for d in works):
            h_last = self._run_deep(rows, starts, R, first_loop, works)
        else:  # the general case (different row counts): host-built metadata, eager
            meta, _, h_T = self._run_deep_varlen(works)
            h_last = h_T.index_select(0, self._index([s.row_start + s.num_rows - 1 for s in meta.spans]))
        items = [(d.request_id, d.sample) for d in works if d.sample is not None]
        keep = [i for i, d in enumerate(works) if d.sample is not None]
        if len(keep) != len(works):
            h_last = h_last.index_select(0, self._index(keep))
        return [Readout(h_last, items)] if items else []

    def _run_deep(self, rows: list[int], starts: list[int], R: int, first_loop: int, works) -> torch.Tensor:
        """Loops first_loop..T over R retained rows per request; returns each request's last-row readout."""
        if self.graphs is not None:
            return self.graphs.deep(rows, starts, R, first_loop)
        row_t = self._index(rows)
        meta = uniform_meta(self.tables, row_t, self._index(starts), R, self.block_size,
                            self._spans(works, starts, [R] * len(rows)))
        h = self.retained_rows[row_t, :R].reshape(len(rows) * R, -1)
        h_T = self.model.run_loops(h, meta, self.pool, first_loop, self.total_ut_steps)[-1]
        return h_T.view(len(rows), R, -1)[:, -1]

    def _run_deep_varlen(self, works: list[DeepWork]) -> tuple[BatchMeta, torch.Tensor, torch.Tensor]:
        """Deep loops over every retained row of requests with different row counts (host-built metadata,
        no graph). Returns the metadata, the retained loop-s rows and their loop-T readouts."""
        rows = [self.tables.row_of[d.request_id] for d in works]
        num_rows = [d.num_rows for d in works]
        meta = varlen_meta(self.tables, [d.start_position for d in works], num_rows, [d.block_ids for d in works],
                           self.block_size, prefill=False, device=self.device, reads=self.attention == "torch")
        h_s = torch.cat([self.retained_rows[r, :n] for r, n in zip(rows, num_rows)])
        h_T = self.model.run_loops(h_s, meta, self.pool, works[0].first_loop, self.total_ut_steps)[-1]
        return meta, h_s, h_T

    def _deep_verify(self, works: list[DeepWork]) -> list[VerifyResult]:
        """Deep loops over every retained row, then the acceptance test of each request's drafts."""
        self.kept_rows.check(works)
        meta, h_s, h_T = self._run_deep_varlen(works)
        items = [VerifyItem(d.request_id, d.draft_token_ids, d.sample.token_index - len(d.draft_token_ids),
                            d.sample.params, span.row_start, span.num_rows) for d, span in zip(works, meta.spans)]
        logits_s, logits_T = self.model.logits(h_s, self.head_dtype), self.model.logits(h_T, self.head_dtype)
        row_ids = [d.request_id for d, span in zip(works, meta.spans) for _ in range(span.num_rows)]
        finite = torch.isfinite(logits_s).all(-1) & torch.isfinite(logits_T).all(-1)  # [rows]
        try:
            return verify_batch(items, logits_s, logits_T, self.logprobs_mode)
        finally:  # checked after verify_batch's own syncs (no extra stall); wins over what NaNs broke there
            require_finite(finite, row_ids)
