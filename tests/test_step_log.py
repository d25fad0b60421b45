"""benchmarks/step_log.py: the executor wrapper of serving.py's step log changes nothing a request gets,
keeps async scheduling's overlap, and records every step's composition (checked against the workload)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from ourobatch import EngineConfig, SamplingParams
from ourobatch.assembly import build_engine_core
from ourobatch.runtime.engine_core import EngineCore
from ourobatch.testing import make_tiny_checkpoint
from scheduler.config import SchedulerConfig
from tests.benchmark_scripts import load_benchmark
from tests.scheduler.fakes import FakeExecutor

step_log = load_benchmark("step_log")


def run(core: EngineCore, prompts: list[list[int]], lengths: list[int]) -> dict[str, list[int]]:
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        core.add(p, SamplingParams(max_tokens=n, temperature=1.0, seed=7 + i, ignore_eos=True), request_id=f"r{i}")
    parents = dict(core.parents)
    while core.has_unfinished:
        core.step()
    core.drain()
    return {rid: list(p.children[0].output_token_ids) for rid, p in parents.items()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck") / "m", seed=5)


@pytest.mark.parametrize("mode,B", [("deferred", 1), ("deferred", 4), ("eager", 2)])
def test_wrapped_engine_overlaps_steps_and_logs_every_one(ckpt, mode, B):
    rng = random.Random(B)
    prompts = [[rng.randrange(1, 31) for _ in range(n)] for n in (3, 13, 9, 5, 11)]
    lengths = [rng.randrange(4, 12) for _ in prompts]
    cfg = EngineConfig(model=str(ckpt), device="cpu", dtype="float32", mode=mode, deep_interval=B, block_size=4,
                       max_model_len=64, max_num_seqs=8, num_kv_blocks=64, max_num_batched_tokens=8,
                       async_scheduling=True)
    plain = run(build_engine_core(cfg), prompts, lengths)
    core = build_engine_core(cfg)
    log = step_log.StepLog.attach(core)
    assert step_log.StepLog.attach(core) is log and core.executor.total_ut_steps == 4  # forwarded reads
    assert run(core, prompts, lengths) == plain  # the wrapper changes no token
    steps = log.take()
    assert log.take() == []
    # ignore_eos, max_tokens only: nothing is wasted, so the logged rows are exactly the workload's
    assert sum(s["prefill_tokens"] for s in steps) == sum(map(len, prompts))  # budget 8: prompts > 8 chunk
    chunks = core.scheduler.counters.prefill_chunks  # a prompt's first chunk starts at 0 (nothing shared)
    assert sum(s["prefill_chunks"] for s in steps) == chunks and chunks > len(prompts)
    assert sum(s["history_chunks"] for s in steps) == chunks - len(prompts)
    assert sum(s["prefills_sampled"] for s in steps) == len(prompts)
    assert sum(s["sampled"] for s in steps) == sum(lengths) == core.scheduler.counters.tokens_generated
    assert sum(s["decode_rows"] for s in steps) == core.scheduler.counters.shallow_rows
    assert sum(s["deep_rows"] for s in steps) == core.scheduler.counters.deep_rows
    ahead = [s for s in steps if s["ahead"]]
    assert ahead and not steps[0]["ahead"]  # launched through the wrapper's launch(), as without it
    assert [s["gap_ms"] is None for s in steps] == [True] + [s["ahead"] for s in steps[1:]]
    assert all(s["step_ms"] > 0 and s["launch_ms"] >= 0 and s["gpu_ms"] is None for s in steps)
    assert [s["t"] for s in steps] == sorted(s["t"] for s in steps)
    summary = step_log.summarize_steps(steps)
    assert summary["ahead"] == len(ahead) and summary["num_steps"] == len(steps)
    assert summary["decode"]["count"] + summary["prefill"]["count"] == len(steps)
    assert "steps" in step_log.steps_line(summary)
    core.close()


@dataclass
class CountingGraphs:
    """Stands in for GraphCache on the CPU: a capture on the first call of each kind, then replays."""

    num_captures: int = 0
    seen: set = field(default_factory=set)

    def _replay(self, kind: str) -> None:
        if kind not in self.seen:
            self.seen.add(kind)
            self.num_captures += 1

    def shallow(self, kind: str) -> None:
        self._replay(kind)

    def deep(self) -> None:
        self._replay("deep")


@dataclass
class GraphedFake(FakeExecutor):
    graphs: CountingGraphs = field(default_factory=CountingGraphs)

    def execute(self, plan):
        if plan.shallow:
            self.graphs.shallow(f"shallow{len(plan.shallow)}")
        if plan.deep:
            self.graphs.deep()
        return super().execute(plan)


def test_graph_replays_and_captures_are_counted_per_step():
    config = SchedulerConfig(num_kv_blocks=40, block_size=4, max_num_seqs=8, max_model_len=64,
                             max_num_batched_tokens=64, total_ut_steps=4, shallow_loops=2, deep_interval=2,
                             mode="deferred", vocab_size=50, eos_token_ids=frozenset())
    fake = GraphedFake()
    core = EngineCore(config, fake)
    log = step_log.StepLog.attach(core)
    run(core, [[1, 2, 3], [4, 5, 6, 7, 8]], [5, 3])
    steps = log.take()
    assert [s["graphs"] for s in steps] == [bool(p.shallow) + bool(p.deep) for p in fake.plans]
    assert sum(s["captures"] for s in steps) == fake.graphs.num_captures == len(fake.graphs.seen) >= 2
    assert all(s["compiled"] == 0 and not s["ahead"] for s in steps)  # no counter given; no launch()


def test_buckets():
    assert [step_log.bucket_label(n) for n in (0, 1, 64, 65, 512, 513, 8192, 8193)] == [
        "0", "1-64", "1-64", "65-256", "257-512", "513-1024", "4097-8192", ">8192"]
