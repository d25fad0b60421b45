"""The startup warm-up on CPU (ourobatch/warmup.py, ourobatch/compile_cache.py).

The request pass runs here for real (a scratch EngineCore over the engine's executor, float64 tiny models):
an engine that ran it gives exactly the tokens and log-probs of one that did not, in every mode, and its
scheduler and executor are as new. The compile-cache folders follow their precedence, and the cold-start
benchmark runs its CPU smoke mode. The kernel enumeration (Triton-free, checked against a brute force over
every call the engine's limits allow): tests/test_warmup_kernels.py. Launching the kernels and counting
compiles needs the GPU: tests/gpu/test_gpu_warmup.py."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from ourobatch import EngineConfig, SamplingParams
from ourobatch import compile_cache
from ourobatch.assembly import build_engine_core
from engine import kernel_cases
from ourobatch.runtime.engine_core import request_seed
from ourobatch.testing import make_tiny_checkpoint
from ourobatch.warmup import WarmupPlan, warm_up_requests

SHAPES = {
    "gqa": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, total_ut_steps=4),
    "mha-T3": dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16, total_ut_steps=3,
                   vocab_size=37),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("warmup")
    return {name: make_tiny_checkpoint(root / name, seed=i + 3, **shape)
            for i, (name, shape) in enumerate(SHAPES.items())}


def config(ckpt, mode="deferred", B=1, s=2, **kw) -> EngineConfig:
    return EngineConfig(model=str(ckpt), dtype="float64", mode=mode, deep_interval=B, shallow_loops=s, block_size=4,
                        num_kv_blocks=160, max_model_len=96, max_num_batched_tokens=24, max_num_seqs=8, **kw)


def workload(vocab: int):
    """Prompts with shared prefixes (prefix cache) and longer than the step budget (chunked), and every
    sampling option; one request without a seed (it takes the engine's first unseeded seed)."""
    base = [(7 * i + 3) % vocab for i in range(40)]
    prompts = [base[:9], base[:30], base[:13] + [1, 2], [5], base[:8] + [4] * 3, base[:17], base[:36]]
    params = [SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=1.0, seed=4, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=10, temperature=0.8, top_k=5, top_p=0.9, seed=5, ignore_eos=True, n=2),
              SamplingParams(max_tokens=7, temperature=0.9, min_p=0.1, seed=6, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True),  # unseeded
              SamplingParams(max_tokens=12, temperature=0.7, seed=8, min_tokens=3, prompt_logprobs=2),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)]
    return prompts, params


def run(core, prompts, params) -> list:
    """Requests arriving over the first steps; every completion's outputs, in order."""
    parents = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        parents.append(core.add(p, sp, request_id=f"r{i}"))
        core.step()
    steps = 0
    while core.has_unfinished:
        core.step()
        steps += 1
        assert steps < 5000
    outs = []
    for parent in parents:
        out = parent.output()
        for c in out.outputs:
            outs.append((c.token_ids, c.logprobs, c.readout_loops, c.top_logprobs, c.seed, c.finish_reason))
        outs.append(out.prompt_logprobs)
    return outs


# (shape, mode, B, s, tiny: the request pass at its small sizes, else at the engine's token budget, async
# scheduling: the engine's and the pass's)
CASES = [("gqa", "deferred", 1, 2, False, False), ("gqa", "deferred", 4, 2, True, False),
         ("gqa", "eager", 3, 1, True, False), ("gqa", "verify", 3, 2, False, False),
         ("mha-T3", "deferred", 2, 1, False, False), ("mha-T3", "verify", 2, 2, True, False),
         ("gqa", "deferred", 4, 2, False, True), ("mha-T3", "eager", 2, 1, True, True)]


@pytest.mark.parametrize("shape,mode,B,s,tiny,asyn", CASES)
def test_a_warmed_engine_gives_exactly_the_outputs_of_a_cold_one(ckpts, shape, mode, B, s, tiny, asyn):
    cfg = config(ckpts[shape], mode, B, s, async_scheduling=asyn)
    prompts, params = workload(37 if shape == "mha-T3" else 31)
    cold = build_engine_core(cfg)
    expected = run(cold, prompts, params)
    cold.close()
    warm = build_engine_core(cfg)
    ran = warm_up_requests(warm.executor, warm.scheduler.config, cfg.seed, tiny=tiny, async_scheduling=asyn)
    assert ran.requests >= 9 and not ran.errors
    assert run(warm, prompts, params) == expected  # float64, same kernels: bitwise equal
    warm.close()


@pytest.mark.parametrize("mode,B", [("deferred", 1), ("deferred", 4), ("verify", 3)])
def test_the_engine_after_the_warm_up_is_as_new(ckpts, mode, B):
    cfg = config(ckpts["gqa"], mode, B, seed=12)
    core = build_engine_core(cfg)
    fresh = core.stats()
    ran = warm_up_requests(core.executor, core.scheduler.config, cfg.seed)
    assert ran.steps > 2 * B
    stats = core.stats()
    assert stats == fresh
    assert stats["kv_blocks_used"] == 0 and stats["prefix_cache_blocks"] == 0
    assert stats["num_running"] == stats["num_waiting"] == stats["requests_added"] == stats["steps"] == 0
    assert all(v == 0 for v in core.scheduler.counters.as_dict().values())
    ex = core.executor
    assert ex.tables.row_of == {} and ex.retained == {}
    assert sorted(ex.tables._free) == list(range(ex.tables.capacity))  # every table row free
    out = core.add([1, 2, 3], SamplingParams(max_tokens=2)).children[0]
    assert out.params.seed == request_seed(12, 0)  # the unseeded-request sequence starts where a new one does
    core.close()


def test_the_warm_up_without_graphs_on_cpu_is_small(ckpts):
    core = build_engine_core(config(ckpts["gqa"], "deferred", 4, cuda_graphs=False))
    ran = warm_up_requests(core.executor, core.scheduler.config, tiny=True)
    assert ran.requests <= 12 and ran.steps <= 40  # a few rounds of short requests
    core.close()


def test_warmup_true_on_cpu_does_nothing_and_ready_reports_the_startup_phases(ckpts, caplog):
    assert WarmupPlan.for_engine(True, "cpu") == WarmupPlan() == WarmupPlan.for_engine(False, "cuda")
    assert WarmupPlan.for_engine(True, "cuda:1") == WarmupPlan(kernels=True, requests=True)
    caplog.set_level(logging.INFO, logger="ourobatch")
    core = build_engine_core(config(ckpts["gqa"]))
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine_ready")]
    phases = ("startup", "setup", "setup_checks", "weights", "kv_pool", "executor")
    assert len(ready) == 1 and all(f"{p}_s=" in ready[0] for p in phases)
    assert not any(r.getMessage().startswith("warmup_") for r in caplog.records)
    assert core.stats()["requests_added"] == 0
    core.close()


@pytest.mark.parametrize("kw,error,match", [
    (dict(warmup="yes"), TypeError, "EngineConfig.warmup must be True or False"),
    (dict(warmup=1), TypeError, "EngineConfig.warmup"),
    (dict(compile_cache_dir=5), TypeError, "EngineConfig.compile_cache_dir must be a folder path"),
    (dict(compile_cache_dir=" "), ValueError, "EngineConfig.compile_cache_dir must be a folder path or None"),
])
def test_bad_startup_fields_are_refused_naming_the_field(kw, error, match):
    with pytest.raises(error, match=match):
        EngineConfig(model="m", **kw)


def test_a_compile_cache_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="EngineConfig.compile_cache_dir must be a folder, but .* is a file"):
        EngineConfig(model="m", compile_cache_dir=str(tmp_path / "f"))
    assert EngineConfig(model="m", compile_cache_dir=tmp_path / "new").compile_cache_dir == tmp_path / "new"


# ------------------------------------------------------------------------------------------ compile caches

@pytest.fixture
def clean_env(monkeypatch):
    for var in (compile_cache.TRITON_VAR, compile_cache.INDUCTOR_VAR, "TRITON_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(compile_cache, "_SET_HERE", {})  # what earlier tests' engines set
    return monkeypatch


def test_compile_cache_dir_points_triton_and_inductor_there_and_a_later_engine_moves_it(clean_env, tmp_path):
    import os

    first = compile_cache.configure(tmp_path / "a")
    assert (first.triton_dir, first.source) == (str(tmp_path / "a" / "triton"), "compile_cache_dir")
    assert os.environ["TRITON_CACHE_DIR"] == first.triton_dir
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == first.inductor_dir == str(tmp_path / "a" / "inductor")
    second = compile_cache.configure(tmp_path / "b")  # ours, not the user's: it may move
    assert os.environ["TRITON_CACHE_DIR"] == second.triton_dir == str(tmp_path / "b" / "triton")
    assert compile_cache.configure(None).triton_dir == second.triton_dir  # None keeps what is there


def test_an_exported_triton_cache_dir_wins_over_compile_cache_dir(clean_env, tmp_path, caplog):
    import os

    clean_env.setenv("TRITON_CACHE_DIR", "/users/own/triton")
    caplog.set_level(logging.WARNING, logger="ourobatch")
    setting = compile_cache.configure(tmp_path / "c")
    assert (setting.triton_dir, setting.source) == ("/users/own/triton", "TRITON_CACHE_DIR")
    assert os.environ["TRITON_CACHE_DIR"] == "/users/own/triton"
    assert any("compile_cache_dir_ignored" in r.getMessage() for r in caplog.records)


def test_without_either_triton_keeps_its_default_folder(clean_env, tmp_path):
    import os

    assert compile_cache.configure(None) == compile_cache.CacheSetting(
        os.path.join(os.path.expanduser("~"), ".triton", "cache"), None, "default")
    assert "TRITON_CACHE_DIR" not in os.environ
    clean_env.setenv("TRITON_HOME", str(tmp_path))
    assert compile_cache.configure(None).triton_dir == str(tmp_path / ".triton" / "cache")


def test_the_compile_counter_counts_compiles_and_cache_loads_and_chains_the_listener_before_it():
    seen = []
    counter = compile_cache.CompileCounter(previous=lambda **kw: seen.append(kw["cache_hit"]))

    class Times:
        total = 250_000  # microseconds

    class Src:
        name = "_paged_attention_kernel"

    for hit in (False, True, False):
        counter(src=Src(), metadata={}, metadata_group={}, times=Times(), cache_hit=hit)
    assert counter.snapshot() == compile_cache.CompileCounts(2, 1, 0.75)
    assert seen == [False, True, False] and counter.names == {"_paged_attention_kernel": 3}


def test_a_cpu_engine_imports_no_triton_and_sets_no_cache_folder(ckpts, tmp_path):
    code = ("import os, sys\nfrom ourobatch import EngineConfig\nfrom ourobatch.assembly import build_engine_core\n"
            f"cfg = EngineConfig(model={str(ckpts['gqa'])!r}, compile_cache_dir={str(tmp_path)!r})\n"
            "core = build_engine_core(cfg)\n"
            "assert 'triton' not in sys.modules, 'triton was imported'\n"
            "assert 'TRITON_CACHE_DIR' not in os.environ\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_CACHE_DIR"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


# ------------------------------------------------------------------------------------------ shapes, cold start

def test_the_prefetch_shapes_are_the_built_executors(ckpts):
    """The kernel prefetch builds its shapes from the config before any weight loads: they must be the
    ones the executor, once built, reports (else the prefetch compiles the wrong specializations)."""
    from engine.config import OuroConfig
    from ourobatch.assembly import effective_max_model_len, kernel_shapes_for, resolve_dtype

    for kw in (dict(), dict(mode="verify", B=3), dict(head_dtype="float32", cuda_graphs=False)):
        cfg = config(ckpts["gqa"], **kw)
        core = build_engine_core(cfg)
        sc, mc = core.scheduler.config, OuroConfig.from_checkpoint(cfg.model)
        built = kernel_cases.shapes_of(core.executor, sc.max_num_batched_tokens, sc.max_model_len, sc.mode,
                                        sc.deep_interval, num_sms=132)
        assert kernel_shapes_for(cfg, mc, resolve_dtype(cfg), effective_max_model_len(cfg, mc), num_sms=132) == built
        core.close()


def test_the_cold_start_benchmark_runs_its_cpu_smoke_mode(tmp_path):
    import json
    from pathlib import Path

    N, P, M = 2, 40, 4  # P spans two full 16-token blocks: a round repeating another's prompts would hit the cache
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "cold_start.py"
    run = subprocess.run([sys.executable, str(script), "--device", "cpu", "--dtype", "float32", "--tiny", "-N", str(N),
                          "-P", str(P), "-M", str(M), "--configs", "interval1", "--out", str(tmp_path / "out"),
                          "--workdir", str(tmp_path / "ckpt"), "--early-capture", "both"], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "cold_start.json").read_text())["rows"]
    assert [(r["config"], r["process"], r["early_capture"]) for r in rows] == [
        ("interval1", 1, "0"), ("interval1", 2, "0"), ("interval1+early", 1, "1"), ("interval1+early", 2, "1")]
    for r in rows:
        assert r["tokens"] == N * M and r["ready_s"] > 0 and r["phases"]["weights"] is not None
        # from the spawn: the interpreter and the imports come before the engine's own startup
        assert r["start_to_ready_s"] > r["ready_s"] and r["start_to_ready_s"] > r["import_s"]
        rounds = r["rounds"]
        assert [x["round"] for x in rounds] == [1, 2, 3]
        assert len({x["prompts_sha1"] for x in rounds}) == 3  # each round its own prompts
        for x in rounds:  # so nothing comes from the prefix cache: every round prefills all of its prompts
            assert x["prefix_cache_hits"] == 0 and x["prefill_tokens_computed"] == N * P
            assert x["tokens"] == N * M and x["wall_s"] > 0 and x["captures"] == 0
        assert r["first_round_s"] == rounds[0]["wall_s"] and r["warm_round_s"] == rounds[-1]["wall_s"]
        assert r["first_over_warm"] == r["first_round_s"] / r["warm_round_s"]
    md = (tmp_path / "out" / "cold_start.md").read_text()
    assert "| interval1 | 2 |" in md and "| interval1+early | 2 |" in md


@pytest.mark.parametrize("budget,max_len,bs", [(8192, 640, 16), (512, 100, 8), (96, 160, 8), (2048, 4096, 16)])
def test_the_warm_ups_first_step_fills_the_token_budget(budget, max_len, bs):
    """The request pass's first round, scheduled for real, prefills exactly the step's budget in its first
    step (rounded down to a block, as a busy engine's chunked steps are)."""
    from scheduler import Scheduler, SchedulerConfig
    from ourobatch.warmup import warmup_rounds

    sc = SchedulerConfig(num_kv_blocks=32 * budget // bs, block_size=bs, max_num_seqs=64, max_model_len=max_len,
                         max_num_batched_tokens=budget, total_ut_steps=4, shallow_loops=2, deep_interval=4,
                         mode="deferred", vocab_size=50)
    sched = Scheduler(sc)
    for i, (prompt, params) in enumerate(warmup_rounds(sc, tiny=False)[0]):
        sched.add(f"w{i}", prompt, params)
    plan = sched.schedule()
    assert sum(len(p.token_ids) for p in plan.prefills) == budget // bs * bs


def test_the_cold_start_report_shows_the_compile_passs_tail_and_its_peak():
    from tests.benchmark_scripts import load_benchmark

    cold = load_benchmark("cold_start")
    tasks = [dict(task="gemm", key=f"('qkv', {i})", queued=0.0, slot=0.1 * i, end=1.0 + i,
                  children=[(0.1 * i + 0.01, 0.9 + i, 0.8 + i)]) for i in range(4)]
    tasks.append(dict(task="fused", key="('fused', 'silu_mul')", queued=0.0, slot=0.5, end=6.0,
                      children=[(4.5, 5.9, None)]))  # forked after the others ended: the peak stays 4
    cached = [dict(task="gemm", key="k", queued=0.31, slot=0.31, end=0.9, children=[]),
              dict(task="gemm", key="j", queued=0.35, slot=0.4, end=1.25, children=[])]
    rows = [dict(config="interval1", process=1, prefetch_timeline=tasks),
            dict(config="interval1", process=2, prefetch_timeline=cached,
                 prefetch_kernels=dict(driver_seconds=0.02, key_seconds=0.004, key_source="stored"))]
    lines = cold.timeline_table(rows, last=3)
    head = next(x for x in lines if x.startswith("interval1, process 1"))
    assert "5 children" in head and "last forked at 4.50 s" in head and "at most 4 at once" in head
    assert "summed 9.2" in head  # 0.8 + 1.8 + 2.8 + 3.8; the failed child has no seconds
    body = [x for x in lines if x.startswith("| gemm") or x.startswith("| fused")]
    assert len(body) == 3 and body[-1].startswith("| fused") and "4.50 - 5.90 (-)" in body[-1]
    second = [x for x in lines if "process 2" in x]  # nothing compiled there: one line, no table
    assert second == ["interval1, process 2: driver 0.02 s, key 0.00 s (key stored); 2 launches, no child, the "
                      "first queued at 0.31 s, the last ended at 1.25 s"]
