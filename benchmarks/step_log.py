"""benchmarks/serving.py's step log: every engine step's time and composition, and its per-round summary.

The hook is a wrapper around the engine's executor (``StepLog.attach(engine.core)``, as the server's
TimedExecutor): the StepPipeline launches and reads every step through it, with async scheduling too (the
wrapper has ``launch``), so nothing of the engine changes but a few clock reads per step. Per step, times
from time.perf_counter on the stepping thread:

- ``launch_ms``: host time of executor.launch (queueing the step's work; a synchronizing op inside it,
  or an eager call's kernel launches, shows here);
- ``step_ms``: from when the step became the one waited for (its launch, or the previous step's result
  when it was launched ahead of it) to its result: back-to-back steps' step_ms add up to the wall time,
  and a step's step_ms is the gap its decode rows add to their streams;
- ``gap_ms``: host time from the previous step's result to this launch (update + schedule when the
  pipeline drained; idle time when the engine had nothing to do);
- ``gpu_ms``: the executor's CUDA events, from the step's launch to the end of its last queued kernel
  (CUDA only; eager launches slower than the GPU count here as well);
- composition: ``decode_rows`` (shallow rows), ``deep_rows``, ``prefill_tokens``, ``prefill_chunks``
  (prefill items that compute tokens), ``history_chunks`` (of those, chunks that start after a history
  in the pool: the prefill-with-history path) and ``history_rows_max``, ``prefills_sampled`` (last chunks),
  ``sampled`` (rows the step samples a token from);
- ``ahead``: launched while another step was in flight (async scheduling overlapped it; with it on, a
  step not ahead is one for which the pipeline drained);
- ``graphs``: CUDA graph replays in the step (GraphCache.shallow / deep calls), ``captures``: graphs
  captured in it, ``compiled``: Triton kernels compiled or loaded from the disk cache during its launch.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_report import percentiles  # noqa: E402

# prefill-token buckets of the summary: (low, high] per bucket, the last one open
TOKEN_EDGES = (0, 64, 256, 512, 1024, 2048, 4096, 8192)
SLOWEST = 8  # steps listed whole in the summary


def bucket_label(tokens: int) -> str:
    """'0', '1-64', '65-256', ..., '4097-8192', '>8192'."""
    if tokens <= 0:
        return "0"
    for lo, hi in zip(TOKEN_EDGES, TOKEN_EDGES[1:]):
        if tokens <= hi:
            return f"{lo + 1}-{hi}"
    return f">{TOKEN_EDGES[-1]}"


def composition(plan: Any) -> dict[str, int]:
    """What a StepPlan runs: rows, prompt tokens and chunks (history chunks: start_position > 0)."""
    chunks = [p for p in plan.prefills if p.token_ids]
    history = [len(p.token_ids) for p in chunks if p.start_position > 0]
    return dict(decode_rows=len(plan.shallow), deep_rows=sum(d.num_rows for d in plan.deep),
                prefill_tokens=sum(len(p.token_ids) for p in chunks), prefill_chunks=len(chunks),
                history_chunks=len(history), history_rows_max=max(history, default=0),
                prefills_sampled=sum(p.sample is not None for p in plan.prefills),
                sampled=sum(w.sample is not None for w in (*plan.prefills, *plan.shallow, *plan.deep)))


class StepLog:
    """The executor wrapper: launch() / execute() are the wrapped executor's, timed; every other attribute
    (read or set) is the wrapped one's, so code reaching through ``core.executor`` sees the real one."""

    def __init__(self, inner: Any, compile_counts: Any = None) -> None:
        d = self.__dict__  # plain attributes of the wrapper (setattr forwards to the executor)
        d["_inner"], d["_compile_counts"] = inner, compile_counts
        d["_lock"], d["_steps"], d["_in_flight"] = threading.Lock(), [], 0
        d["_last_result"] = None  # perf_counter at the previous step's result
        d["_replays"] = 0
        d["_wrapped_graphs"] = None
        if getattr(inner, "device", None) is not None and inner.device.type == "cuda":
            inner.timing = []  # PendingStep records each step's GPU ms here (one entry, popped per step)

    @classmethod
    def attach(cls, core: Any, compile_counts: Any = None) -> "StepLog":
        """Wrap core.executor (call with no step running: before the first request, or between rounds)."""
        if not isinstance(core.executor, StepLog):
            core.executor = cls(core.executor, compile_counts)
        return core.executor

    def _count_graph_calls(self) -> None:
        """Count replays of the executor's GraphCache (wrapped once per cache: wake_up builds a new one)."""
        graphs = getattr(self._inner, "graphs", None)
        if graphs is None or graphs is self._wrapped_graphs:
            return
        for name in ("shallow", "deep"):
            call = getattr(graphs, name)

            def counted(*args: Any, _call: Any = call, **kwargs: Any) -> Any:
                self.__dict__["_replays"] += 1
                return _call(*args, **kwargs)

            setattr(graphs, name, counted)  # an instance attribute: shadows the method for this cache only
        self.__dict__["_wrapped_graphs"] = graphs

    def launch(self, plan: Any) -> "_LoggedStep":
        from ourobatch.runtime import pipeline

        self._count_graph_calls()
        graphs = getattr(self._inner, "graphs", None)
        before = (self._replays, graphs.num_captures if graphs is not None else 0, self._compiled())
        ahead = self._in_flight > 0
        start = time.perf_counter()
        pending = pipeline.launch(self._inner, plan)
        launched = time.perf_counter()
        graphs = getattr(self._inner, "graphs", None)
        record = dict(composition(plan), ahead=ahead, launch_ms=1e3 * (launched - start),
                      graphs=self._replays - before[0],
                      captures=(graphs.num_captures if graphs is not None else 0) - before[1],
                      compiled=self._compiled() - before[2])
        self.__dict__["_in_flight"] += 1
        return _LoggedStep(self, pending, record, start)

    def execute(self, plan: Any) -> Any:
        """launch(plan).result(): what ModelExecutor.execute is, so the pipeline without lookahead is timed alike."""
        return self.launch(plan).result()

    def _compiled(self) -> int:
        counts = self._compile_counts() if self._compile_counts is not None else None
        return 0 if counts is None else counts.compiled + counts.loaded

    def _finish(self, record: dict, start: float) -> None:
        end = time.perf_counter()
        last = self._last_result
        timing = getattr(self._inner, "timing", None)
        record.update(t=end, step_ms=1e3 * (end - max(start, last if last is not None else start)),
                      gap_ms=None if last is None or record["ahead"] else 1e3 * max(0.0, start - last),
                      gpu_ms=timing.pop() if timing else None)
        d = self.__dict__
        d["_last_result"], d["_in_flight"] = end, d["_in_flight"] - 1
        with self._lock:
            self._steps.append(record)

    def take(self) -> list[dict]:
        """The steps read since the last take(), in order; the log restarts empty."""
        with self._lock:
            steps, self.__dict__["_steps"] = self._steps, []
        return steps

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_inner"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)


class _LoggedStep:
    """A launched step whose result() completes its record."""

    def __init__(self, log: StepLog, inner: Any, record: dict, start: float) -> None:
        self._log, self._inner, self._record, self._start = log, inner, record, start
        self._done = False

    def result(self) -> Any:
        try:
            return self._inner.result()
        finally:
            if not self._done:
                self._done = True
                self._log._finish(self._record, self._start)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


# ---------------------------------------------------------------------- the summary of one round


def _stats(steps: list[dict]) -> dict[str, Any]:
    def pct(key: str) -> dict:
        return percentiles([s[key] for s in steps if s.get(key) is not None])

    return dict(count=len(steps), step_ms=pct("step_ms"), gpu_ms=pct("gpu_ms"), launch_ms=pct("launch_ms"),
                mean_prefill_tokens=sum(s["prefill_tokens"] for s in steps) / len(steps) if steps else None,
                mean_decode_rows=sum(s["decode_rows"] for s in steps) / len(steps) if steps else None,
                with_history=sum(s["history_chunks"] > 0 for s in steps),
                ahead=sum(s["ahead"] for s in steps), with_graphs=sum(s["graphs"] > 0 for s in steps))


def summarize_steps(steps: list[dict]) -> dict[str, Any]:
    """Pure-decode steps vs steps that prefill, steps by prefill-token bucket, and the slowest steps."""
    work = [s for s in steps if s["decode_rows"] or s["deep_rows"] or s["prefill_tokens"]]
    decode = [s for s in work if not s["prefill_tokens"]]
    prefill = [s for s in work if s["prefill_tokens"]]
    buckets: dict[str, list[dict]] = {}
    for s in sorted(prefill, key=lambda s: s["prefill_tokens"]):
        buckets.setdefault(bucket_label(s["prefill_tokens"]), []).append(s)
    gaps = [s["gap_ms"] for s in steps if s["gap_ms"] is not None]
    p_dec, p_pre = percentiles([s["step_ms"] for s in decode]), percentiles([s["step_ms"] for s in prefill])
    return dict(
        num_steps=len(steps), decode=_stats(decode), prefill=_stats(prefill),
        by_prefill_tokens={label: _stats(group) for label, group in buckets.items()},
        prefill_over_decode_p50=p_pre["p50"] / p_dec["p50"] if p_pre["p50"] and p_dec["p50"] else None,
        prefill_step_share=sum(s["step_ms"] for s in prefill) / max(sum(s["step_ms"] for s in work), 1e-9),
        gap_ms=percentiles(gaps), ahead=sum(s["ahead"] for s in steps),
        graph_replays=sum(s["graphs"] for s in steps), captures=sum(s["captures"] for s in steps),
        compiled=sum(s["compiled"] for s in steps), steps_compiling=sum(s["compiled"] > 0 for s in steps),
        slowest=sorted(steps, key=lambda s: -s["step_ms"])[:SLOWEST])


def steps_line(summary: dict | None) -> str:
    """One printed line: decode vs prefill step times and what the slowest step was."""
    if summary is None or not summary["num_steps"]:
        return "    steps: -"
    d, p = summary["decode"], summary["prefill"]

    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.1f}"

    slow = summary["slowest"][0]
    return (f"    steps {summary['num_steps']}: decode {d['count']} p50/p99 {f(d['step_ms']['p50'])}/"
            f"{f(d['step_ms']['p99'])} ms, prefill {p['count']} p50/p99 {f(p['step_ms']['p50'])}/"
            f"{f(p['step_ms']['p99'])} ms (launch p50 {f(p['launch_ms']['p50'])} ms, {p['with_history']} with "
            f"history), ahead {summary['ahead']}, compiled {summary['compiled']} in {summary['steps_compiling']} "
            f"steps, captures {summary['captures']}; slowest {slow['step_ms']:.0f} ms: {slow['prefill_tokens']} "
            f"prefill tok / {slow['prefill_chunks']} chunks, {slow['decode_rows']} decode rows, launch "
            f"{slow['launch_ms']:.0f} ms, compiled {slow['compiled']}")
