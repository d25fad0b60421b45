"""The startup warm-up on CPU (ourobatch/warmup.py, engine/kernel_warmup.py, ourobatch/compile_cache.py).

The request pass runs here for real (a scratch EngineCore over the engine's executor, float64 tiny models):
an engine that ran it gives exactly the tokens and log-probs of one that did not, in every mode, and its
scheduler and executor are as new. The kernel enumeration is Triton-free and checked against a brute
force over every call the engine's limits allow. The compile-cache folders follow their precedence.
Launching the kernels and counting compiles needs the GPU: tests/gpu/test_gpu_warmup.py."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ourobatch import EngineConfig, SamplingParams
from ourobatch import compile_cache
from ourobatch.assembly import build_engine_core
from engine import kernel_cases, kernel_warmup
from engine.attention_dispatch import LaunchConfig
from engine.cuda_graphs import BUCKETS
from engine.prefill_graph import prefill_buckets
from engine.gemm_dispatch import GemmConfig
from ourobatch.runtime.engine_core import request_seed
from ourobatch.testing import make_tiny_checkpoint
from ourobatch.warmup import WarmupPlan, warm_up_requests

from .interpreter import run_interpreted

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


# ------------------------------------------------------------------------------------------ kernel enumeration

def shapes(kv_heads=16, mode="deferred", B=1, N=64, budget=8192, L=4096, graphs=True, dtype=torch.bfloat16):
    buckets = tuple([b for b in BUCKETS if b < N] + [N]) if graphs else None
    return kernel_cases.KernelShapes(16, kv_heads, 128, 2048, 5632, 49152, 1e-6, dtype, dtype, 16, L // 16, N,
                                      budget, L, mode, B, 132, buckets, True)


def reachable(s: kernel_cases.KernelShapes):
    """(requests, longest rows, total rows) of every paged-kernel call the engine can make, written out
    from the call sites: graphed decode calls at each bucket (1 row; deferred deep: up to B rows), prefill
    chunks after a history (<= 64 rows each, <= the token budget in all), verify's deep call (<= B + 1)."""
    B = s.deep_interval
    decode = [1] + (list(range(1, B + 1)) if s.mode == "deferred" and B > 1 else [])
    for R in decode:
        for n in s.buckets if s.buckets is not None else range(1, s.max_num_seqs + 1):
            yield n, R, n * R
    longest = min(64, s.max_num_batched_tokens, s.max_model_len - s.block_size)
    deep = B + 1 if s.mode == "verify" else B if s.mode == "deferred" and B > 1 else 0
    for n_max, r_max, cap in ((min(s.max_num_seqs, s.max_num_batched_tokens), longest, s.max_num_batched_tokens),
                              (s.max_num_seqs, deep, 10**9)):
        for n in range(1, n_max + 1):
            for r in range(1, r_max + 1):
                for total in range(r + n - 1, min(n * r, cap, r + n + 40) + 1):
                    yield n, r, total


@pytest.mark.parametrize("kw", [dict(), dict(mode="deferred", B=8), dict(mode="verify", B=4),
                                dict(kv_heads=2, mode="verify", B=3, N=40), dict(kv_heads=4, N=24, graphs=False),
                                dict(N=32, budget=48, L=256, dtype=torch.float32)])
def test_one_launch_per_specialization_covers_every_reachable_call(kw):
    s = shapes(**kw)
    keys = {kernel_cases.attention_key(s, *call) for call in reachable(s)}
    cases = kernel_cases.attention_cases(s)
    assert {kernel_cases.attention_key(s, c.seqs, c.max_rows, c.rows) for c in cases} == keys
    assert len(cases) == len(keys)  # one launch each
    for c in cases:  # a launchable split of the rows: the first request has max_rows, none has more
        counts = kernel_cases._row_counts(c)
        assert len(counts) == c.seqs and sum(counts) == c.rows and max(counts) == c.max_rows and min(counts) >= 1


@pytest.mark.parametrize("kw", [dict(), dict(mode="deferred", B=8), dict(kv_heads=4, N=24, graphs=False)])
def test_the_paged_decode_override_is_what_the_warm_up_compiles(kw, monkeypatch):
    """OUROBATCH_PAGED_DECODE's launch (a measuring knob) replaces the table's for one-row calls only: the warm-up's
    cases still cover every reachable call once, and its one-row calls compile the override, order included."""
    from engine.attention_dispatch import paged_decode

    monkeypatch.setenv("OUROBATCH_PAGED_DECODE", "n16/w2/s3/head")
    paged_decode.cache_clear()
    try:
        s = shapes(**kw)
        keys = {kernel_cases.attention_key(s, *call) for call in reachable(s)}
        cases = kernel_cases.attention_cases(s)
        assert {kernel_cases.attention_key(s, c.seqs, c.max_rows, c.rows) for c in cases} == keys
        assert len(cases) == len(keys)
        for c in cases:
            config = kernel_cases.case_config(s, c)
            assert (config == LaunchConfig(16, 2, 3, 1, head_major=True)) == (c.max_rows == 1)
            assert kernel_cases.attention_key(s, c.seqs, c.max_rows, c.rows)[0][7] == (c.max_rows == 1)  # the order
    finally:
        paged_decode.cache_clear()


def test_no_paged_kernel_without_the_triton_backend():
    s = shapes()
    assert kernel_cases.attention_cases(kernel_cases.KernelShapes(**{**s.__dict__, "triton_attention": False})) == []


@pytest.mark.parametrize("kv_heads,N,budget,dtype", [(16, 64, 8192, torch.bfloat16), (2, 256, 512, torch.bfloat16),
                                                      (4, 8, 2048, torch.float32), (16, 300, 100, torch.bfloat16)])
def test_one_tiled_launch_per_specialization_of_the_graphed_prefill(kv_heads, N, budget, dtype):
    """Every bucket's tiled call (the forward of engine/prefill_graph.py: the bucket's rows, its layout's
    chunks + 1 sequences and tile map) maps to one launched case, and no two cases share a specialization."""
    from engine.prefill_graph import layouts_for

    s = kernel_cases.KernelShapes(**{**shapes(kv_heads=kv_heads, N=N, budget=budget, dtype=dtype).__dict__,
                                      "prefill_buckets": tuple(prefill_buckets(budget))})
    mc = type("Cfg", (), dict(num_attention_heads=16, num_key_value_heads=kv_heads, head_dim=128))
    keys = {kernel_cases.attention_key(s, layout.chunks + 1, layout.tokens, layout.tokens, layout.tiles)
            for layout in layouts_for(budget, N, mc, dtype)}
    cases = kernel_cases.prefill_cases(s)
    assert {kernel_cases.attention_key(s, c.seqs, c.max_rows, c.rows, c.tiles) for c in cases} == keys
    assert len(cases) == len(keys)
    assert all(c.tiles > 0 and c.rows == c.max_rows for c in cases)
    untiled = kernel_cases.attention_cases(kernel_cases.KernelShapes(**{**s.__dict__, "prefill_buckets": ()}))
    assert kernel_cases.attention_cases(s) == untiled + cases


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


def test_graphed_shapes_list_the_decode_and_prefill_buckets():
    """With graphs, the shapes name the buckets both graphed calls are captured at; without, none."""
    from engine.config import OuroConfig
    from engine.cuda_graphs import batch_buckets

    mc = OuroConfig.from_dict(dict(model_type="ouro", vocab_size=67, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    common = dict(block_size=16, table_width=8, max_num_seqs=40, max_num_batched_tokens=600, max_model_len=128,
                  mode="deferred", deep_interval=4, num_sms=132)
    on = kernel_cases.kernel_shapes(mc, torch.bfloat16, None, attention="triton", cuda_graphs=True, **common)
    assert on.buckets == (1, 2, 4, 8, 16, 24, 32, 40) == tuple(batch_buckets(40)) and on.triton_attention
    assert on.prefill_buckets == (16, 32, 64, 128, 256, 384, 512, 600)
    off = kernel_cases.kernel_shapes(mc, torch.bfloat16, torch.float32, attention="torch", cuda_graphs=False, **common)
    assert off.buckets is None and off.prefill_buckets == () and off.logits_dtype == torch.float32


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sets(st.sampled_from("abc")), st.sets(st.integers(0, 5))), min_size=1, max_size=12))
def test_staged_launches_never_compile_one_specialization_twice_at_once(spec):
    """kernel_warmup.staged: the first launch alone; the first launch of every specialization and of every
    kernel in an earlier stage than its other launches (two launches of one stage may share one only once
    it is compiled); every launch once, in order."""
    tasks = [kernel_warmup.Task(f"t{i}", i, frozenset(kernels), tuple(keys)) for i, (kernels, keys) in enumerate(spec)]
    stages = kernel_warmup.staged(tasks)
    where = {t.launch: n for n, stage in enumerate(stages) for t in stage}
    assert sorted(where) == list(range(len(tasks))) and len(stages[0]) == 1 and stages[0][0].launch == 0
    assert all(stage for stage in stages) and all(where[i] >= 1 for i in range(1, len(tasks)))
    for i, task in enumerate(tasks):
        for k in (*task.kernels, *task.keys):
            first = min(j for j, t in enumerate(tasks) if k in t.kernels or k in t.keys)
            assert first == i or where[first] < where[i]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sets(st.sampled_from(["gluon_layers", "gluon_mlp", "gluon_o", "paged", "gemm"])), max_size=12))
def test_forked_compiles_start_with_the_slowest_kernels(spec):
    """kernel_warmup.longest_first: every launch once; one using a slower kernel of SLOWEST before any that uses
    only faster ones; launches of one rank in the list's order."""
    tasks = [kernel_warmup.Task(f"t{i}", i, frozenset(kernels), ()) for i, kernels in enumerate(spec)]
    order = kernel_warmup.longest_first(tasks)
    slow = kernel_warmup.SLOWEST
    rank = [min([slow.index(k) for k in t.kernels if k in slow] + [len(slow)]) for t in order]
    assert sorted(t.launch for t in order) == list(range(len(tasks)))
    assert rank == sorted(rank)
    assert all(a.launch < b.launch for a, b, ra, rb in zip(order, order[1:], rank, rank[1:]) if ra == rb)


def test_one_gemm_launch_per_config_and_tile():
    # the skinny GEMMs' row counts are not specialized (engine/triton_gemm.py): one launch per (config, tile height)
    table = ((8, GemmConfig(splits_o=2)), (48, GemmConfig(block_n=128)))
    rows = kernel_cases.gemm_rows(shapes(), table)
    tiles = {(r <= 8, min(64, max(16, 1 << (r - 1).bit_length()))) for r in range(1, 49)}
    assert len(rows) == len(tiles) == 4 and rows == [1, 9, 17, 33]  # the first row count of each
    found = {k for r in rows for k in kernel_cases.gemm_keys(r, table)}
    assert {k for r in range(1, 49) for k in kernel_cases.gemm_keys(r, table)} == found  # every row count's keys
    # partials per config and tile (the two configs' block_n differ), gate_up per tile (the same block_n_gate),
    # the norm per split count: rows 1-8 split o_proj 2 ways and down_proj 4, rows 9-48 both 4
    assert sum(k[0] == "partials" for k in found) == len(tiles)
    assert sum(k[0] == "gate_up" for k in found) == len({bm for _, bm in tiles})
    assert {k for k in found if k[0] == "norm_partials"} == {("norm_partials", 2), ("norm_partials", 4)}
    assert kernel_cases.gemm_keys(49, table) == set()  # past the table: cuBLAS, nothing to compile
    assert kernel_cases.gemm_rows(shapes(dtype=torch.float32), table) == []  # fp32 keeps cuBLAS


def test_gate_ups_own_k_step_and_tma_are_their_own_specializations():
    base = GemmConfig(block_n=32)
    for other in (dataclasses.replace(base, block_k_gate=64), dataclasses.replace(base, tma=2),
                  dataclasses.replace(base, stages_gate=3)):
        a, b = (kernel_cases.gemm_keys(8, ((16, cfg),)) for cfg in (base, other))
        gate_a, gate_b = ({k for k in keys if k[0] == "gate_up"} for keys in (a, b))
        assert gate_a != gate_b  # a second compile of gate_up, which the warm-up must launch too
        if other.tma == base.tma:  # block_k_gate and stages_gate leave the partials' specialization alone
            assert {k for k in a if k[0] == "partials"} == {k for k in b if k[0] == "partials"}
    assert {k for k in kernel_cases.gemm_keys(8, ((16, dataclasses.replace(base, stages_gate=4)),))} == \
        kernel_cases.gemm_keys(8, ((16, base),)), "stages_gate equal to num_stages is the same compile"


INTERPRETED = """
import dataclasses
import torch
from engine import gemm_dispatch, kernel_cases as kc, kernel_warmup as kw
# the table with qkv + RoPE + store in every bucket (the shipped one skips 17-32 rows), so every kernel
# variant launches here
gemm_dispatch.GEMM_TABLE = tuple((r, dataclasses.replace(c, block_d_qkv=16)) for r, c in gemm_dispatch.GEMM_TABLE)
for dtype in (torch.float32, torch.bfloat16):
    s = kc.KernelShapes(4, 2, 32, 64, 128, 67, 1e-6, dtype, torch.float32, 8, 8, 4, 24, 64, "verify", 2, 132,
                        (1, 2, 4), True, (16, 24))
    assert kc.prefill_cases(s)  # the graphed prefill's tiled launches too
    report = kw.warm_kernels(s, torch.device("cpu"), threads=1)  # the interpreter is not thread-safe
    assert not report.failures, report.failures
    tasks = kw.task_list(s, torch.device("cpu"))
    keys = {k for t in tasks for k in t.keys}
    firsts = [t.keys[0] for t in tasks]  # each launch exists for a specialization no earlier one compiles
    assert len(set(firsts)) == len(firsts)
    cases = kc.attention_cases(s)
    assert {("paged",) + kc.attention_key(s, c.seqs, c.max_rows, c.rows, c.tiles)[0] for c in cases} <= keys
    assert report.cases["attention"] == sum(t.name == "attention" for t in tasks) and report.cases["fused"] == 4
    gemm = {k for r in kc.gemm_rows(s) for k in kc.gemm_keys(r, head_dim=s.head_dim)}
    assert report.cases.get("gemm", 0) == len(gemm) and any(k[0] == "qkv" for k in gemm) == (dtype != torch.float32)
print("ok")
"""


def test_every_launch_runs_in_tritons_interpreter():
    """The launches' shapes and arguments, on CPU tensors (TRITON_INTERPRET=1), where Triton is installed."""
    run_interpreted(INTERPRETED)


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


@pytest.mark.parametrize("kw", [dict(), dict(N=8), dict(kv_heads=4, N=24, graphs=False), dict(mode="deferred", B=8)])
def test_one_decode_kernel_launch_per_specialization_of_the_calls_sent_there(kw):
    """kernel_cases.decode_keys: every one-row-per-request call (graphed buckets or every eager count, and
    one-row chunks after a history) that the device's rule sends to the Gluon kernel maps to one key, each
    key's request count reaches it, and a GQA model sends none there."""
    from engine.attention_dispatch import decode_config

    s = shapes(**kw)

    def config_of(seqs):
        return decode_config(seqs, s.num_kv_heads, s.num_sms)

    def key(seqs):
        c = config_of(seqs)
        split = c.splits > 1
        extra = (kernel_cases.int_class(seqs * s.num_heads * s.head_dim), kernel_cases.int_class(seqs * s.num_heads))
        return ("gluon", c.block_n, c.stages, c.ctas_per_sm > 0, split) + (extra if split else ())

    reach = {n for n, r, total in reachable(s) if r == 1 and total == n and config_of(n) is not None}
    found = kernel_cases.decode_keys(s, config_of)
    if s.group != 1:
        assert found == {}
        return
    assert set(found) == {key(n) for n in reach} and found
    assert all(key(n) == k and n in reach for k, n in found.items())
    assert kernel_cases.decode_keys(s, lambda n: None) == {}


@pytest.mark.parametrize("kw", [dict(), dict(N=8), dict(graphs=False, N=12)])
def test_decode_calls_that_fold_o_proj_get_their_own_key(kw):
    """decode_keys with fold_of: a request count whose calls fold o_proj (attention_dispatch.o_fold_applies at
    Ouro-1.4B's shapes on 132 SMs: 8 requests, one CTA per (request, head), 128 output tiles) adds the folded
    kernel's key, and keeps the plain kernel's (one-row prompt chunks of that count do not fold)."""
    from engine.attention_dispatch import decode_config, o_fold_applies

    s = shapes(**kw)

    def config_of(seqs):
        return decode_config(seqs, s.num_kv_heads, s.num_sms)

    def fold_of(seqs, c):
        return o_fold_applies(c, seqs, seqs, s.num_heads, s.head_dim, s.hidden_size, s.num_sms)

    plain = kernel_cases.decode_keys(s, config_of)
    found = kernel_cases.decode_keys(s, config_of, fold_of)
    folded = {k: n for k, n in found.items() if k[0] == "gluon_o"}
    assert {k: n for k, n in found.items() if k[0] != "gluon_o"} == plain
    assert folded == {("gluon_o", 32, 6, ""): 8}
    assert kernel_cases.decode_keys(s, config_of, lambda n, c: False) == plain


@pytest.mark.parametrize("kw", [dict(), dict(N=8), dict(graphs=False, N=12)])
def test_calls_that_run_the_mlp_launch_get_its_keys(kw):
    """mlp_keys: every row class (1, or 2-8) of the calls the rule sends to the MLP launch, each with o_proj's partials
    in one split (from the decode kernel that folds o_proj) and in the GEMM table's split count; none where it is off."""
    from engine.gemm_dispatch import gemm_config
    from engine.mlp_dispatch import MLP_ROWS, mlp_fold_applies

    s = shapes(**kw)
    found = kernel_cases.mlp_keys(s, lambda rows: mlp_fold_applies(rows, s.hidden_size, s.intermediate_size))
    rows = [r for r in range(1, MLP_ROWS + 1) if gemm_config(r) is not None]
    assert rows
    want = {("gluon_mlp", kernel_cases.int_class(r), kernel_cases.int_class(n)) for r in rows
            for n in (1, gemm_config(r).splits_o)}
    assert set(found) == want
    for key, (r, n) in found.items():  # each key's call compiles that key
        assert key == ("gluon_mlp", kernel_cases.int_class(r), kernel_cases.int_class(n)) and 1 <= r <= MLP_ROWS
    assert kernel_cases.mlp_keys(s, lambda rows: False) == {}



def test_layers_keys_cover_the_layer_count_class_once_for_every_row_count():
    # the loop-pass launch (engine/gluon_layers.py) does not specialize its rows (do_not_specialize M): one
    # compile serves 1-8 requests; Triton keys its layer count by int class
    # (tests/engine/test_gluon_layers_compile.py checks the kernel's do_not_specialize)
    s = kernel_cases.KernelShapes(**{**shapes(N=64).__dict__, "num_layers": 24})
    found = kernel_cases.layers_keys(s, True)
    assert found == {("gluon_layers", ""): (1, 2)}
    for rows, layers in found.values():  # the warm-up's call has the engine's classes
        assert kernel_cases.int_class(layers) == kernel_cases.int_class(24) and rows <= 8
    deep = kernel_cases.KernelShapes(**{**s.__dict__, "num_layers": 48, "max_num_seqs": 1})
    assert kernel_cases.layers_keys(deep, True) == {("gluon_layers", "16"): (1, 16)}
    assert kernel_cases.layers_keys(s, False) == {}
    assert kernel_cases.layers_keys(kernel_cases.KernelShapes(**{**s.__dict__, "num_layers": 0}), True) == {}


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


def test_the_warm_up_reports_each_launchs_times_in_order_of_their_end(monkeypatch):
    import threading
    import time

    from engine import kernel_warmup as kw
    from engine.warmup_order import Task

    ended = {i: threading.Event() for i in range(4)}

    def task(i: int, seconds: float, fails: bool = False, after: tuple[int, ...] = ()) -> Task:
        def launch() -> None:
            try:
                for j in after:  # ends last by construction (gates, not a race of sleeps)
                    assert ended[j].wait(60), f"k{j} never ended"
                time.sleep(seconds)
                if fails:
                    raise RuntimeError("no such kernel")
            finally:
                ended[i].set()
        return Task("gemm", launch, frozenset({f"k{i}"}), ((f"k{i}", i),))

    tasks = [task(0, 0.05), task(1, 0.3, after=(0, 2, 3)), task(2, 0.01, fails=True), task(3, 0.1)]
    monkeypatch.setattr(kw, "task_list", lambda s, device: tasks)
    report = kw.warm_kernels(None, torch.device("cpu"), threads=4)
    line = report.timeline  # one entry per launch, by end, queued <= given its slot <= ended, within the pass
    assert [e["key"] for e in line][-1] == "('k1', 1)" and len(report.failures) == 1
    assert sorted(e["key"] for e in line) == sorted(str(t.keys[0]) for t in tasks)
    # (the entries' times are rounded to the millisecond: the last end may round up past the pass's seconds)
    assert [e["end"] for e in line] == sorted(e["end"] for e in line) and line[-1]["end"] <= report.seconds + 5e-4
    assert all(0 <= e["queued"] <= e["slot"] <= e["end"] and e["children"] == [] for e in line)
    slow = next(e for e in line if e["key"] == "('k1', 1)")
    assert slow["end"] - slow["slot"] >= 0.3  # its launch's time
