"""The startup warm-up: everything the first requests would compile or capture, done before ready.

Theory of operation. On CUDA a cold engine pays, on its first requests, for every Triton kernel
specialization and every lazily loaded CUDA module the startup captures did not touch (prefill chunks
after a history, verify's deep call, the sampler's variants, ...). ``warm_up`` runs, after the KV pool
exists and before the engine reports ready:

1. ``kernels`` (CUDA): one launch of every kernel specialization the configured limits reach
   (engine/kernel_warmup.py), in threads. Their shapes need only the config, so ourobatch/kernel_prefetch.py
   starts them before the weights load and the compiles overlap the load (assembly.py); the pass here,
   once the executor exists, then finds every kernel compiled and only checks (a launch each). The
   graph captures and the request pass after it compile nothing (engine_ready's ``compiled_during``);
2. ``graphs``: the CUDA graph captures of every bucket of the mode's calls (engine/cuda_graphs.py). With
   early capture (kernel_prefetch.py; on unless ``OUROBATCH_EARLY_CAPTURE=0``) the graphs without the loop-pass
   launch come first, while that launch still compiles, then the prefetch's wait, then steps 1-3 as here (the
   graphs step captures only what is left);
3. ``requests``: a few rounds of dummy requests through a scratch EngineCore (its own Scheduler, this
   executor): a prefill of the whole token budget, a prefix-cache hit (a chunk after cached blocks), n = 2,
   decode and deep calls or verify, and every sampling variant (greedy, temperature, top-k / top-p /
   min-p, top log-probs, min_tokens, prompt log-probs; the one-kernel path and the fallback).

The scratch core is dropped afterwards, so the engine's own scheduler starts exactly as new (no
requests, empty prefix cache, every block free, counters zero, the unseeded-request seed sequence
untouched, step ids from 0); the executor is left with no table row and no retained row (checked). Its
requests carry explicit seeds. On CPU nothing compiles or captures, so ``EngineConfig.warmup=True`` does
nothing there (the CPU test suite builds hundreds of engines); ``WarmupPlan.tiny()`` runs the request pass
at small sizes on any device (the tests do). Each phase is logged with its time.
"""

from __future__ import annotations

import contextlib
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from scheduler.config import SchedulerConfig
from scheduler.errors import EngineClosedError
from ourobatch.runtime.engine_core import EngineCore
from ourobatch.kernel_prefetch import log_kernels
from ourobatch.log import get_logger
from scheduler.params import SamplingParams

log = get_logger()

MAX_STEPS = 10_000  # a warm-up that has not finished by then is a bug


@dataclass(frozen=True)
class WarmupPlan:
    """Which warm-up phases run (the graph captures always run when the engine has graphs)."""

    kernels: bool = False  # every Triton kernel specialization (CUDA)
    requests: bool = False  # the request pass through a scratch EngineCore
    tiny: bool = False  # the request pass at small sizes (no whole-budget prefill)

    @classmethod
    def for_engine(cls, warmup: bool, device: str) -> "WarmupPlan":
        """EngineConfig.warmup's plan: all of it on CUDA, nothing on CPU (nothing compiles there)."""
        if not warmup or not device.startswith("cuda"):
            return cls()
        return cls(kernels=True, requests=True)

    @classmethod
    def tiny_requests(cls) -> "WarmupPlan":
        return cls(requests=True, tiny=True)


@dataclass
class StartupClock:
    """Seconds per startup phase (setup, weights, kv_pool, executor, kernels, graphs, requests), in order, and with
    a compile counter (ourobatch/compile_cache.py), the Triton kernels compiled during each (in any thread: the
    kernel prefetch compiles while the weights load)."""

    counter: Any = None  # CompileCounter or None
    seconds: dict[str, float] = field(default_factory=dict)
    compiled: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        counter, t = self.counter, time.perf_counter()  # the counter of the phase's start (setup installs one)
        before = counter.snapshot().compiled if counter is not None else 0
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
            if counter is not None:
                self.compiled[name] = self.compiled.get(name, 0) + counter.snapshot().compiled - before

    def fields(self) -> dict[str, Any]:
        """engine_ready's timing fields: startup_s, <phase>_s and (with a counter) compiled_during."""
        out: dict[str, Any] = {f"{k}_s": round(v, 3) for k, v in self.seconds.items()}
        out["startup_s"] = round(time.perf_counter() - self.started, 3)
        if self.counter is not None:
            out["compiled_during"] = dict(self.compiled)
        return out


def warm_up(executor, scheduler_config: SchedulerConfig, plan: WarmupPlan, clock: StartupClock, *,
            seed: int = 0, async_scheduling: bool = False,
            should_stop: Callable[[], bool] | None = None, prefetch=None) -> None:
    """The startup phases after the KV pool: kernels, graph captures, requests (see the module docstring);
    the request pass steps as the engine will (`async_scheduling`). `prefetch` (ourobatch/kernel_prefetch.py)
    with its loop-pass launch still compiling (`pending`): the graphs without that launch are captured first,
    then its wait, then the rest as usual. Raises EngineClosedError when `should_stop()` turns true (the executor
    is closed)."""
    graphs = executor.graphs is not None
    phases = []
    if prefetch is not None and prefetch.pending:
        phases += [("graphs", graphs, lambda: _capture_graphs(executor, scheduler_config, should_stop,
                                                              lambda c, b: not loop_pass_graph(c, b), early=True)),
                   ("", True, prefetch.finish)]  # (it counts its wait as "kernels" itself)
    elif prefetch is not None:
        prefetch.finish()
    phases += [("kernels", plan.kernels, lambda: _warm_kernels(executor, scheduler_config, should_stop)),
               ("graphs", graphs, lambda: _capture_graphs(executor, scheduler_config, should_stop)),
               ("requests", plan.requests,
                lambda: warm_up_requests(executor, scheduler_config, seed, tiny=plan.tiny,
                                         async_scheduling=async_scheduling, should_stop=should_stop))]
    for name, wanted, run in phases:
        if _stopped(should_stop, executor):
            raise EngineClosedError("the engine was closed while it warmed up")
        if wanted:
            with clock.phase(name) if name else contextlib.nullcontext():
                run()
    if _stopped(should_stop, executor):
        raise EngineClosedError("the engine was closed while it warmed up")


def loop_pass_graph(call, bucket: int) -> bool:
    """Whether the graph of (call, bucket) may hold the loop-pass launch (engine/layers_dispatch.call_fits: one
    row per request, at most ROWS requests): a shallow call's small buckets (where the model has no layer stack,
    this only orders them later)."""
    from engine.graph_calls import ShallowCall
    from engine.layers_dispatch import ROWS

    return isinstance(call, ShallowCall) and bucket <= ROWS


def _stopped(should_stop: Callable[[], bool] | None, executor) -> bool:
    if should_stop is not None and should_stop():
        if executor.model is not None:
            executor.close()
        return True
    return False


def _warm_kernels(executor, sc: SchedulerConfig, should_stop: Callable[[], bool] | None) -> None:
    from engine import kernel_cases, kernel_warmup

    shapes = kernel_cases.shapes_of(executor, sc.max_num_batched_tokens, sc.max_model_len, sc.mode, sc.deep_interval)
    log_kernels("warmup_kernels", kernel_warmup.warm_kernels(shapes, executor.device, should_stop=should_stop))


def _capture_graphs(executor, sc: SchedulerConfig, should_stop: Callable[[], bool] | None,
                    which: Callable[[Any, int], bool] | None = None, early: bool = False) -> None:
    """Every bucket of the mode's calls now (`which`: those it selects, and those not captured already), so no
    request pays a capture; `early`: while the compile pass still runs in another thread (captures in
    thread-local mode)."""
    started = time.perf_counter()
    calls = executor.graph_calls(sc.mode, sc.deep_interval, sc.shallow_loops)
    before = dict(executor.graphs.capture_seconds)
    captured = executor.capture_graphs(calls, should_stop, which=which, thread_local=early)
    log.info("cuda_graphs_captured", graphs=captured, buckets=len(executor.graphs.buckets),
             calls=[str(c) for c in calls], seconds=round(time.perf_counter() - started, 2), early=early)
    timings = {k: t for k, t in executor.graphs.capture_seconds.items() if k not in before}
    log.debug("cuda_graph_timings", seconds={f"{c}@{b}": round(t, 3) for (c, b), t in timings.items()}, early=early)


# ------------------------------------------------------------------------------------------ the request pass

@dataclass
class RequestPass:
    """What the request pass ran."""

    requests: int = 0
    steps: int = 0
    errors: list[str] = field(default_factory=list)


def warm_up_requests(executor, scheduler_config: SchedulerConfig, seed: int = 0, *, tiny: bool = False,
                     async_scheduling: bool = False, should_stop: Callable[[], bool] | None = None) -> RequestPass:
    """Rounds of dummy requests (explicit seeds) through a scratch EngineCore over `executor`; leaves the
    executor with no table row and no retained row. Requests that fail are logged, not raised."""
    started = time.perf_counter()
    core = EngineCore(scheduler_config, executor, seed=seed, async_scheduling=async_scheduling)
    result = RequestPass()
    for round_ in warmup_rounds(scheduler_config, tiny):
        if should_stop is not None and should_stop():
            break
        parents = [core.add(prompt, params, request_id=f"warmup-{result.requests + i}")
                   for i, (prompt, params) in enumerate(round_)]
        result.requests += len(parents)
        while core.has_unfinished:
            if result.steps >= MAX_STEPS:
                raise RuntimeError(f"the warm-up's requests did not finish in {MAX_STEPS} steps")
            if should_stop is not None and should_stop():
                for p in parents:
                    core.abort(p.request_id)
            core.step()
            result.steps += 1
        result.errors += [c.error or "error" for p in parents for c in p.children if c.finish_reason == "error"]
    core.step()  # the last plan: the finished requests' ids, so the executor drops their rows
    core.drain()  # (async scheduling: that step's result read)
    result.steps += 1
    left = sorted(executor.tables.row_of) + sorted(executor.retained)
    if left:
        raise RuntimeError(f"the warm-up left engine state behind for {left[:4]}")
    if result.errors:
        log.warning("warmup_request_failed", requests=len(result.errors), error=result.errors[0])
    log.info("warmup_requests", requests=result.requests, steps=result.steps,
             seconds=round(time.perf_counter() - started, 2))
    return result


def warmup_rounds(sc: SchedulerConfig, tiny: bool) -> list[list[tuple[list[int], SamplingParams]]]:
    """The request pass's rounds: (prompt, params) pairs. Round 1 samples with temperature only (the
    sampler's one-kernel path): prefills of equal length that fill a step's token budget exactly, a prompt
    sharing the first one's full blocks, n = 2. Round 2 uses every other sampling option (the fallback path)."""
    rng = random.Random(0)
    bs, B = sc.block_size, sc.deep_interval
    # deferred and eager: two boundaries; verify: a few checks (a rejection leaves one token per check)
    M = min(2 * B + 2 if B > 1 and sc.mode != "verify" else 3, sc.max_model_len - 1)
    longest = max(1, min(sc.max_model_len - M, sc.num_kv_blocks * bs // 4))  # fits any pool that fits one

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, sc.vocab_size) for _ in range(max(1, min(n, longest)))]

    def params(i: int, **kw) -> SamplingParams:
        return SamplingParams(max_tokens=M, seed=1000 + i, ignore_eos=True, **kw)

    L = min(longest, 2 * bs + 1 if tiny else sc.max_num_batched_tokens)
    # enough prompts of whole blocks to fill the first step to exactly the token budget (the last one is
    # chunked, at a block boundary): the size a busy engine's prefill steps have, so the GEMM kernels
    # cuBLAS picks for that row count are loaded before the first requests (the first round's extra time
    # measured in sessions 5-6 was cuDNN's attention plans, not this: engine/attention.py)
    L = L if tiny or L < bs else L // bs * bs
    k = 1 if tiny else max(1, min(-(-sc.max_num_batched_tokens // L), sc.max_num_seqs - 3,
                                  sc.num_kv_blocks * bs // (4 * (L + M))))
    big = [prompt(L) for _ in range(k)]
    plain = [(p, params(i, temperature=0.0)) for i, p in enumerate(big)]
    shared = big[0][:L // bs * bs] + prompt(bs // 2 + 1)  # a chunk after cached blocks: the paged kernel
    plain.append((shared[:longest], params(k, temperature=1.0)))
    plain.append((prompt(bs + 3), params(k + 1, temperature=0.8, n=min(2, sc.max_num_seqs))))
    options = [dict(temperature=0.9, top_k=3), dict(top_p=0.8), dict(min_p=0.05), dict(logprobs=2),
               dict(min_tokens=2, temperature=0.7), dict(temperature=0.0, prompt_logprobs=2)]
    processed = [(prompt(bs + 2 + i), params(k + 2 + i, **kw)) for i, kw in enumerate(options)]
    return [plain, processed]

