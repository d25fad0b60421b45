"""``GET /metrics``: Prometheus metrics of one engine, read from ``engine.stats()`` at scrape time, plus a
histogram of engine step times (a thin wrapper around the engine's executor times each step on the
worker thread; the driver is untouched) and the HTTP requests by route and status (counted by app.Gate).

Every app gets its own CollectorRegistry, so several servers (or tests) in one process never collide.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ourobatch.runtime import pipeline

PREFIX = "ourobatch"
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
FINISH_REASONS = ("stop", "length", "abort", "error")

# stats() counter -> (metric name without prefix and _total, help)
COUNTERS = {
    "tokens_generated": ("generation_tokens", "Tokens sampled"),
    "prefill_tokens": ("prefill_tokens", "Prompt tokens prefilled (a preempted request's recompute counts again)"),
    "requests_added": ("requests_added", "Completions queued (a request with n > 1 counts n)"),
    "deep_calls": ("deep_calls", "Batched deep-loop calls"),
    "deep_rows": ("deep_rows", "Retained rows carried by deep calls"),
    "shallow_steps": ("shallow_steps", "Shallow calls"),
    "boundaries": ("boundaries", "Cohort boundary events"),
    "steps": ("scheduler_steps", "Steps planned by the scheduler"),
}
# stats() value -> (metric name without prefix, help)
GAUGES = {
    "num_running": ("num_requests_running", "Completions prefilling or decoding"),
    "num_waiting": ("num_requests_waiting", "Completions waiting for admission"),
    "kv_blocks_used": ("kv_blocks_used", "KV pool blocks in use"),
    "kv_blocks_total": ("kv_blocks_total", "KV pool blocks in all"),
    "weight_version": ("weight_version", "Version of the weights new requests run with"),
    "num_streams": ("num_streams", "Open output streams"),
}


class StatsCollector(Collector):
    """Reads engine.stats() at each scrape."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except Exception:  # noqa: BLE001 - the engine is closed or not started: no engine metrics
            return
        for key, (name, doc) in COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=stats[key])
        finished = CounterMetricFamily(f"{PREFIX}_requests_finished", "Completions ended, by finish reason",
                                       labels=["finish_reason"])
        for reason in FINISH_REASONS:
            finished.add_metric([reason], stats.get(f"finished_{reason}", 0))
        yield finished
        for key, (name, doc) in GAUGES.items():
            value = stats.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        used, total = stats.get("kv_blocks_used"), stats.get("kv_blocks_total")
        if isinstance(used, int) and isinstance(total, int) and total > 0:
            yield GaugeMetricFamily(f"{PREFIX}_kv_cache_usage", "Share of the KV pool in use (0..1)",
                                    value=used / total)


class TimedExecutor:
    """Wraps an executor: execute() is timed into a histogram; every other attribute (read or set) is
    the wrapped executor's, so code that reaches through ``core.executor`` sees the real one."""

    def __init__(self, inner: Any, histogram: Histogram) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_histogram", histogram)

    def execute(self, plan: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._inner.execute(plan)
        finally:
            self._histogram.observe(time.perf_counter() - start)

    def launch(self, plan: Any) -> Any:
        """The wrapped launch (so the engine keeps its async scheduling under the server), timed from the
        launch to the end of its result(): with a step in flight ahead of it, that includes the wait."""
        start = time.perf_counter()
        return _TimedPending(pipeline.launch(self._inner, plan), self._histogram, start)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_inner"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)


class _TimedPending:
    """A launched step whose result() observes the time since its launch into the step histogram."""

    def __init__(self, inner: Any, histogram: Histogram, start: float) -> None:
        self._inner, self._histogram, self._start = inner, histogram, start

    def result(self) -> Any:
        try:
            return self._inner.result()
        finally:
            self._histogram.observe(time.perf_counter() - self._start)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class ServerMetrics:
    """The registry of one app: engine stats, step times, HTTP requests by route and status."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.step_seconds = Histogram(f"{PREFIX}_step_seconds", "Wall time of one engine step (the executor's "
                                      "part, on the worker thread)", buckets=STEP_BUCKETS, registry=self.registry)
        self.http_requests = Counter(f"{PREFIX}_http_requests", "HTTP requests answered, by route and status",
                                     ["route", "status"], registry=self.registry)
        self._collector: StatsCollector | None = None

    def attach(self, engine: Any) -> None:
        """Start reading `engine` (running): its stats at each scrape, and the time of each step."""
        self._collector = StatsCollector(engine.stats)
        self.registry.register(self._collector)
        core = engine.core
        if not isinstance(core.executor, TimedExecutor):
            core.executor = TimedExecutor(core.executor, self.step_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


router = APIRouter()


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
