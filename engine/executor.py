"""ModelExecutor: runs a StepPlan on the model and the paged pool, returns a StepResult.

Order within a step: prefills (loops 1..T; their loop-T readouts also give the prompt log-probs a
PrefillWork asks for, engine/prompt_logprobs.py), the shallow call (one fed token per decoding request,
loops 1..last_loop), the deep call (retained rows of every boundary request, loops first_loop..T, one
batch), then one batched sampling pass over every work item that carries a SampleSpec.

Retained rows (deferred mode) are the loop-s readouts of fed positions whose deep loops have not run.
They live in one device buffer ``rows[table_row, i]`` (i < deep_interval; engine/retained.py owns it),
written by the shallow call and read by the deep call, so neither needs per-request host work; a
released request's rows are simply forgotten. A failing phase is reported as a StepFailure, never raised: the scheduler decides
who ends with it.

``execute(plan)`` is ``launch(plan).result()``. ``launch`` only queues work on the device (host-to-device
copies through pinned memory, metadata from the plan's block ids, no read of a device value), so with
async scheduling the next plan is launched before this one is read (engine/pending.py: the readback,
the non-finite check, prompt log-probs). The sampling pass also writes each request's token to
``next_tokens[table row]``; a ShallowWork whose token_id is None feeds the token from there, gathered
on the device before the shallow call (outside the CUDA graph, which reads its input-id buffer as always).

On CUDA with the Triton backend, shallow and deep calls replay CUDA graphs captured per batch-size
bucket (cuda_graphs.py); elsewhere the same functions run eagerly.
"""

from __future__ import annotations

from typing import Callable

import torch

from scheduler.plan import (DeepWork, Phase, PrefillWork, ShallowWork, StepFailure, StepPlan,
                                      StepResult, VerifyResult)

from .batch import BatchMeta, BlockTables, SeqSpan, fed_ids, to_device, uniform_meta, varlen_meta
from .cuda_graphs import GraphCache
from .graph_calls import GraphCall, mode_calls
from .kv_cache import KVPool
from .model import OuroForCausalLM
from .pending import PendingStep, start_timing, without_requests
from .pending import failure as _failure
from .prompt_logprobs import prompt_logprobs
from .readout import PendingSample, Readout, launch_sample, require_finite
from .retained import RetainedRows, RetainedSpan
from . import weights
from .verify import VerifyItem, verify_batch


class ModelExecutor:
    def __init__(self, model: OuroForCausalLM, pool: KVPool, device: torch.device | str = "cpu", *,
                 logprobs_mode: str, max_num_seqs: int = 256, max_blocks_per_seq: int = 256,
                 deep_interval: int = 1, attention: str = "auto", cuda_graphs: bool | None = None,
                 head_dtype: torch.dtype | None = None, max_num_batched_tokens: int = 8192) -> None:
        self.model = model
        self.logprobs_mode = logprobs_mode  # "processed" | "raw" (EngineConfig's): which log-probs tokens report
        self.head_dtype = head_dtype  # dtype of the lm_head matmul (None: the model's)
        self.pool = pool
        self.device = torch.device(device)
        cfg = model.config
        self.total_ut_steps = cfg.total_ut_steps
        self.block_size = pool.block_size
        if attention == "auto":
            from_triton = self.device.type == "cuda"
            if from_triton:
                from .triton_attention import supports

                from_triton = supports(cfg.head_dim, pool.k.dtype)
            attention = "triton" if from_triton else "torch"
        self.attention = attention
        model.set_attention_backend(attention)
        self.tables = BlockTables(max_num_seqs, max_blocks_per_seq, pool.scratch_block, self.device)
        dtype = next(model.parameters()).dtype
        # A request holds at most deep_interval retained rows, and never more than it has positions.
        max_retained = max(1, min(deep_interval, max_blocks_per_seq * self.block_size))
        self.kept_rows = RetainedRows(max_num_seqs + 1, max_retained, cfg.hidden_size, dtype, self.device)
        # next_tokens[table row]: the token each request's last sampled step drew, written on the device by
        # that step's sampling pass; a step launched before it is read feeds it from here (async scheduling)
        self.next_tokens = torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=self.device)
        self._failed: set[str] = set()  # requests a phase of the step last launched failed
        # Tests set this to raise inside a phase: called as fault_hook(phase, request_ids) at its start.
        self.fault_hook: Callable[[Phase, tuple[str, ...]], None] | None = None
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and attention == "triton"
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens  # sizes the prefill graphs' token buckets
        self.graphs = None
        if cuda_graphs:
            self.graphs = self._new_graph_cache()
        self.timing: list[float] | None = None  # set to a list to record GPU ms per step (CUDA events)
        # what wake_up needs to rebuild the model
        self.model_config, self.dtype = cfg, dtype
        self.sleeping_state: dict[str, torch.Tensor] | None = None
        self.sleep_level = 0  # 0 awake; 1 weights in CPU memory; 2 weights dropped

    def _new_graph_cache(self) -> GraphCache:
        return GraphCache(self.model, self.pool, self.tables, self.kept_rows.rows, self.max_num_seqs, self.device,
                          self.max_num_batched_tokens)

    @property
    def retained(self) -> dict[str, RetainedSpan]:
        """Request id -> the retained rows this executor holds for it (engine/retained.py)."""
        return self.kept_rows.spans

    @property
    def retained_rows(self) -> torch.Tensor | None:
        """The retained-row buffer, [max_num_seqs + 1, rows, hidden] (None while asleep or closed)."""
        return self.kept_rows.rows

    # ------------------------------------------------------------------ the seam

    def execute(self, plan: StepPlan) -> StepResult:
        return self.launch(plan).result()

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> PendingStep:
        """Queue the plan's work on the device and return at once (nothing here waits for the device); the
        result is read by PendingStep.result(). The next plan may be launched first: its rows with
        token_id None feed the tokens this step samples (a device buffer indexed by table row)."""
        failed_before, self._failed = self._failed - set(plan.released_request_ids), set()
        for rid in plan.released_request_ids:
            self.kept_rows.forget(rid)
            self.tables.release(rid)
        if failed_before:  # rows planned ahead for requests a phase of the step before failed: never run
            plan = without_requests(plan, failed_before)
        try:  # new rows and grown block lists, once per step; the phases below read tables.row_of
            for w in (*plan.prefills, *plan.shallow, *plan.deep):
                self.tables.row(w.request_id, w.block_ids)
            self.tables.flush()
        except Exception as exc:  # noqa: BLE001 - every request of the step fails, none is left hanging
            failures = [_failure(Phase.PREFILL, plan.prefills, exc)] if plan.prefills else []
            decoding = {w.request_id: w for w in (*plan.shallow, *plan.deep)}
            if decoding:
                failures.append(_failure(Phase.SHALLOW, tuple(decoding.values()), exc))
            return self._launched(PendingStep(plan, failures))
        step = PendingStep(plan, [], timing=start_timing(self.device, self.timing is not None))
        readouts: list[Readout] = []
        if plan.prefills:
            try:
                self._enter(Phase.PREFILL, plan.prefills)
                readouts += self._prefill(plan.prefills, step)
            except Exception as exc:  # noqa: BLE001 - reported to the scheduler as data
                step.failures.append(_failure(Phase.PREFILL, plan.prefills, exc))
                step.prompt_job = None
        failed: set[str] = set()
        if plan.shallow:
            try:
                self._enter(Phase.SHALLOW, plan.shallow)
                readouts += self._shallow(plan.shallow)
            except Exception as exc:  # noqa: BLE001
                step.failures.append(_failure(Phase.SHALLOW, plan.shallow, exc))
                failed.update(w.request_id for w in plan.shallow)
        deep = [d for d in plan.deep if d.request_id not in failed]
        if deep:
            readouts += self._run_deep_phase(deep, step)
        if readouts:
            try:
                step.sample = self._sample(readouts)
            except Exception as exc:  # noqa: BLE001
                ids = tuple(rid for r in readouts for rid, _ in r.items)
                step.failures.append(StepFailure(Phase.SAMPLE, ids, f"{type(exc).__name__}: {exc}"))
        if step.timing is not None:
            step.timing[1].record()
        return self._launched(step)

    def _launched(self, step: PendingStep) -> PendingStep:
        self._failed = {rid for f in step.failures for rid in f.request_ids}
        step.timings = self.timing
        return step

    def _run_deep_phase(self, deep: list[DeepWork], step: PendingStep) -> list[Readout]:
        try:
            self._enter(Phase.DEEP, deep)
            if deep[0].verify:  # verify mode reads its verdicts back here (it never runs a step ahead)
                step.verified = self._deep_verify(deep)
                return []
            return self._deep(deep)
        except Exception as exc:  # noqa: BLE001
            step.failures.append(_failure(Phase.DEEP, deep, exc))
            return []
        finally:
            for d in deep:  # consumed, or discarded with a failed (closing) cohort
                self.kept_rows.forget(d.request_id)

    def _sample(self, readouts: list[Readout]) -> PendingSample:
        """The batched sampling pass, queued (benchmarks/public_path.py times it as a phase); its tokens are
        also written to next_tokens[table row], where a step launched before this one is read feeds them
        from (ShallowWork.token_id None)."""
        pending = launch_sample(self.model, readouts, self.head_dtype, self.logprobs_mode)
        rows = self._index([self.tables.row_of[rid] for rid, _ in pending.items])
        self.next_tokens.index_copy_(0, rows, pending.token_ids)
        return pending

    def _enter(self, phase: Phase, works) -> None:
        if self.fault_hook is not None:
            self.fault_hook(phase, tuple(w.request_id for w in works))

    # ------------------------------------------------------------------ phases

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

    def _prefill(self, works: tuple[PrefillWork, ...], step: PendingStep) -> list[Readout]:
        run = [w for w in works if w.token_ids]  # forks (sample_from) compute nothing
        lens = [len(w.token_ids) for w in run]
        row_starts = [sum(lens[:i]) for i in range(len(run))]
        wants_prompt = any(w.prompt_logprobs is not None for w in run)
        h_T = self._prefill_rows(run, lens, keep=wants_prompt)
        if wants_prompt:  # engine/prompt_logprobs.py, read with the result
            step.prompt_job = lambda: prompt_logprobs(self.model, h_T, run, row_starts, self.logprobs_mode,
                                                      self.head_dtype, require_finite)
        last = {w.request_id: start + n - 1 for w, start, n in zip(run, row_starts, lens)}
        items = [(w.request_id, w.sample) for w in works if w.sample is not None]
        keep = [last[w.sample_from or w.request_id] for w in works if w.sample is not None]
        return [Readout(h_T.index_select(0, self._index(keep)), items)] if items else []

    def _prefill_rows(self, run: list[PrefillWork], lens: list[int], keep: bool) -> torch.Tensor:
        """Every chunk row's loop-T readout, [sum(lens), hidden]: the prefill graph of the smallest token bucket
        that holds them (engine/prefill_graph.py; copied when `keep`: read after the step), else eager."""
        layout = self.graphs.prefill_layout(sum(lens), len(run)) if self.graphs is not None else None
        if layout is not None:
            h = self.graphs.prefill(layout, [list(w.token_ids) for w in run], [w.start_position for w in run],
                                    [self.tables.row_of[w.request_id] for w in run])[:sum(lens)]
            return h.clone() if keep else h
        meta = varlen_meta(self.tables, [w.start_position for w in run], lens, [w.block_ids for w in run],
                           self.block_size, prefill=True, device=self.device, paged_history=self.attention == "triton")
        ids = self._index([t for w in run for t in w.token_ids])
        return self.model.run_loops(self.model.embed(ids), meta, self.pool, 1, self.total_ut_steps)[-1]

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

    # ------------------------------------------------------------------ startup

    def graph_calls(self, mode: str, deep_interval: int, shallow_loops: int) -> list[GraphCall]:
        """The graphed calls a scheduler of this mode plans (engine/graph_calls.py)."""
        return mode_calls(mode, self.total_ut_steps, deep_interval, shallow_loops)

    @torch.inference_mode()
    def capture_graphs(self, calls: list[GraphCall], should_stop: Callable[[], bool] | None = None) -> int:
        """Capture every batch-size bucket of `calls` now (startup), not during the first requests."""
        if self.graphs is None:
            return 0
        return self.graphs.capture_all(calls, should_stop)

    # ------------------------------------------------------------------ weights and sleep

    def update_weights(self, named_tensors) -> list[str]:
        """Copy (HF name, tensor) pairs into the model in place; WeightUpdateError on a bad one."""
        if self.sleep_level:
            raise RuntimeError("the engine is asleep: wake_up() first")
        return weights.copy_named_tensors(self.model, named_tensors)

    def sleep(self, level: int) -> None:
        """Free the device: weights to pinned CPU memory (level 1) or dropped (level 2); the KV pool, the
        retained rows and the CUDA graphs freed (pool and buffers keep the geometry they wake up with)."""
        if self.sleep_level:
            return
        self.sleeping_state = weights.cpu_copy(self.model, pin=self.device.type == "cuda") if level == 1 else None
        self.sleep_level = level
        self.model = None  # type: ignore[assignment]
        if self.graphs is not None:
            self.graphs.close()
        self.pool.release()
        self.kept_rows.release()
        weights.free_device_memory(self.device)

    def wake_up(self) -> None:
        """Rebuild the weights (from the pinned copy, or zeroed after level 2), the KV pool and the buffers;
        graphs are captured again lazily."""
        if not self.sleep_level:
            return
        model = weights.rebuild_model(self.model_config, self.sleeping_state, self.dtype, self.device)
        model.set_attention_backend(self.attention)
        self.model = model
        self.sleeping_state = None
        self.sleep_level = 0
        self.pool.reallocate()
        self.kept_rows.reallocate()
        if self.graphs is not None:
            self.graphs = self._new_graph_cache()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Drop the weights, the KV pool, CUDA graphs (and their memory pool) and every buffer, so an
        engine that closes gives its device memory back (RL loops open and close engines in one process).
        The executor is unusable afterwards."""
        if self.graphs is not None:
            self.graphs.close()
        self.graphs = None
        self.model = None  # type: ignore[assignment]
        self.sleeping_state = None
        self.pool = None  # type: ignore[assignment]
        self.tables = None  # type: ignore[assignment]
        self.kept_rows.release()
        self.fault_hook = None
        weights.free_device_memory(self.device, clear_cublas=True)
