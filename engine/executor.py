"""ModelExecutor: runs a StepPlan on the model and the paged pool, returns a StepResult.

Order within a step: prefills (loops 1..T; their loop-T readouts also give the prompt log-probs a
PrefillWork asks for, engine/prompt_logprobs.py), the shallow call (one fed token per decoding request,
loops 1..last_loop), the deep call (retained rows of every boundary request, loops first_loop..T, one
batch), then one batched sampling pass over every work item that carries a SampleSpec.

Retained rows (deferred mode) are the loop-s readouts of fed positions whose deep loops have not run.
They live in one device buffer ``rows[table_row, i]`` (i < deep_interval; engine/retained.py owns it),
written by the shallow call and read by the deep call, so neither needs per-request host work; a
released request's rows are simply forgotten. A failing phase is reported as a StepFailure, never raised:
the scheduler decides who ends with it.

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

from scheduler.plan import DeepWork, Phase, StepFailure, StepPlan, StepResult

from .batch import BlockTables
from .cuda_graphs import GraphCache
from .graph_calls import GraphCall, mode_calls
from .kv_cache import KVPool
from .model import OuroForCausalLM
from .pending import PendingStep, start_timing, without_requests
from .pending import failure as _failure
from .phases import StepPhases
from .prefill_graph import layouts_for
from .readout import PendingSample, Readout, launch_sample
from .retained import RetainedRows, RetainedSpan
from . import weights


def resolve_attention(attention: str, device: torch.device, head_dim: int, dtype: torch.dtype) -> str:
    """The attention backend an executor runs: "auto" is the Triton kernel on CUDA where it supports the
    shapes, else the reference torch path (the startup's kernel prefetch resolves it the same way)."""
    if attention != "auto":
        return attention
    if device.type != "cuda":
        return "torch"
    from .triton_attention import supports

    return "triton" if supports(head_dim, dtype) else "torch"


def resolve_cuda_graphs(cuda_graphs: bool | None, device: torch.device, attention: str) -> bool:
    """Whether the hot calls replay CUDA graphs: None means on CUDA with the Triton backend."""
    return device.type == "cuda" and attention == "triton" if cuda_graphs is None else cuda_graphs


class ModelExecutor(StepPhases):
    def __init__(self, model: OuroForCausalLM, pool: KVPool, device: torch.device | str = "cpu", *,
                 logprobs_mode: str, max_num_seqs: int = 256, max_blocks_per_seq: int = 256,
                 deep_interval: int = 1, attention: str = "auto", cuda_graphs: bool | None = None,
                 head_dtype: torch.dtype | None = None, max_num_batched_tokens: int = 8192,
                 static_prefill: bool = False) -> None:
        self.model = model
        self.logprobs_mode = logprobs_mode  # "processed" | "raw" (EngineConfig's): which log-probs tokens report
        self.head_dtype = head_dtype  # dtype of the lm_head matmul (None: the model's)
        self.pool = pool
        self.device = torch.device(device)
        cfg = model.config
        self.total_ut_steps = cfg.total_ut_steps
        self.block_size = pool.block_size
        attention = resolve_attention(attention, self.device, cfg.head_dim, pool.k.dtype)
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
        cuda_graphs = resolve_cuda_graphs(cuda_graphs, self.device, attention)
        self.max_num_seqs = max_num_seqs
        # fixed-shape prefill calls without graphs too (tests: the graphed path's logic, eagerly on the CPU)
        self.static_prefill = static_prefill
        self.prefill_layouts = layouts_for(max_num_batched_tokens, max_num_seqs, cfg, dtype)
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
                          self.prefill_layouts)

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
        readouts, failed = self._first_phases(plan, step)
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

    def _first_phases(self, plan: StepPlan, step: PendingStep) -> tuple[list[Readout], set[str]]:
        """Prefill and shallow phases: one call at full depth when a bucket holds both (phases.py _merged),
        else each its own. Returns their readouts and the decoding requests that failed."""
        layout = self._merge_layout(plan)
        if layout is not None:
            try:
                self._enter(Phase.PREFILL, plan.prefills)
                self._enter(Phase.SHALLOW, plan.shallow)
                return self._merged(plan, layout, step), set()
            except Exception as exc:  # noqa: BLE001 - one call: both phases fail
                step.failures += [_failure(Phase.PREFILL, plan.prefills, exc),
                                  _failure(Phase.SHALLOW, plan.shallow, exc)]
                step.prompt_job = None
                return [], {w.request_id for w in plan.shallow}
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
        return readouts, failed

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

    # ------------------------------------------------------------------ startup

    def graph_calls(self, mode: str, deep_interval: int, shallow_loops: int) -> list[GraphCall]:
        """The graphed calls a scheduler of this mode plans (engine/graph_calls.py)."""
        return mode_calls(mode, self.total_ut_steps, deep_interval, shallow_loops)

    @torch.inference_mode()
    def capture_graphs(self, calls: list[GraphCall], should_stop: Callable[[], bool] | None = None,
                       which: Callable[[GraphCall, int], bool] | None = None, thread_local: bool = False) -> int:
        """Capture every batch-size bucket of `calls` now (startup), not during the first requests (`which`,
        `thread_local`: GraphCache.capture_all's)."""
        if self.graphs is None:
            return 0
        return self.graphs.capture_all(calls, should_stop, which, thread_local)

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
