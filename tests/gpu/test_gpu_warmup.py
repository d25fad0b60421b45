"""The startup warm-up on the GPU: after ready, a first round of mixed requests compiles no Triton kernel
(counted by the compilation listener ourobatch/compile_cache.py installs) and captures no CUDA graph
(GraphCache.num_captures), in every mode, and its tokens equal an engine's without the warm-up; the
startup's graph captures and request pass compile nothing either (the kernel passes compiled it all); a
second process with the same compile_cache_dir loads every kernel from the disk cache instead of compiling it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ourobatch import EngineConfig, SamplingParams, SyncEngine, compile_cache
from ourobatch.testing import make_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("warmup"), vocab_size=257, hidden_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                intermediate_size=256, dtype=torch.bfloat16)


def first_round():
    """Odd and even batch sizes, prompts from 1 token to past the step budget (chunked), shared prefixes
    (a chunk after cached blocks), and every sampling option."""
    base = [(11 * i + 5) % 250 + 1 for i in range(120)]
    prompts = [base[:1], base[:7], base[:33], base[:40] + [9, 9], base[:100], base[:16] + [3], base[:64],
               base[:5] + [2] * 20, base[:48], base[:90] + [4]]
    options = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=8), dict(top_p=0.9),
               dict(min_p=0.05), dict(logprobs=3), dict(temperature=0.0, prompt_logprobs=2),
               dict(temperature=0.9, n=2), dict(min_tokens=4, temperature=0.8), dict(temperature=0.0, logprobs=1)]
    params = [SamplingParams(max_tokens=14 + i % 5, seed=i, ignore_eos=True, **kw) for i, kw in enumerate(options)]
    return prompts, params


CONFIG = dict(device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=160, num_kv_blocks=256, block_size=8,
              max_num_batched_tokens=96)


@pytest.mark.parametrize("mode,B", [("deferred", 1), ("deferred", 4), ("eager", 4), ("verify", 4)])
def test_after_startup_a_first_round_compiles_and_captures_nothing(ckpt, mode, B):
    counter = compile_cache.install_compile_counter()
    assert counter is not None, "Triton without knobs.compilation.listener (Triton >= 3.4 has it)"
    prompts, params = first_round()
    cfg = EngineConfig(model=str(ckpt), mode=mode, deep_interval=B, **CONFIG)
    with SyncEngine(cfg) as engine:
        graphs = engine.core.executor.graphs
        names, captures = dict(counter.names), graphs.num_captures
        before = counter.snapshot()
        outs = engine.generate_batch(prompts, params)
        after = counter.snapshot()
        new = {k: v - names.get(k, 0) for k, v in counter.names.items() if v != names.get(k, 0)}
        assert (after.compiled - before.compiled, after.loaded - before.loaded) == (0, 0), f"compiled in round 1: {new}"
        assert graphs.num_captures == captures
        warmed = [c.token_ids for o in outs for c in o.outputs]
    with SyncEngine(EngineConfig(model=str(ckpt), mode=mode, deep_interval=B, warmup=False, **CONFIG)) as engine:
        cold = [c.token_ids for o in engine.generate_batch(prompts, params) for c in o.outputs]
    assert warmed == cold


# a shape the loop-pass launch (engine/gluon_layers.py) serves: heads of 128, no GQA, pages of 16
LAUNCH_SHAPE = dict(vocab_size=257, hidden_size=1024, num_hidden_layers=2, num_attention_heads=8,
                    num_key_value_heads=8, head_dim=128, intermediate_size=2816)


@pytest.mark.parametrize("mode,B", [("deferred", 1), ("deferred", 4)])
def test_a_first_round_through_the_loop_pass_launch_compiles_nothing(tmp_path, mode, B, monkeypatch):
    # the startup's compile pass launches it (kernel_cases.layers_keys, gluon_layers.warm_launch): its first
    # decode calls of up to 8 requests must not compile it again (nor anything else), and they must run it
    from engine import gluon_layers, layers_dispatch

    if not layers_dispatch.switch_on() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the loop-pass launch runs on Hopper with OUROBATCH_DECODE_LAYERS on")
    ckpt = make_tiny_checkpoint(tmp_path / "m", dtype=torch.bfloat16, **LAUNCH_SHAPE)
    launches = []
    real = gluon_layers.launch_layers
    monkeypatch.setattr(gluon_layers, "launch_layers", lambda *a, **k: launches.append(1) or real(*a, **k))
    counter = compile_cache.install_compile_counter()
    prompts, params = first_round()
    cfg = EngineConfig(model=str(ckpt), mode=mode, deep_interval=B, **{**CONFIG, "block_size": 16})
    with SyncEngine(cfg) as engine:
        names, before = dict(counter.names), counter.snapshot()
        captured = len(launches)  # the startup's graphs of decode calls hold it; the round replays them
        engine.generate_batch(prompts[:6], params[:6])  # 6 requests: every decode call is the launch's
        after = counter.snapshot()
    new = {k: v - names.get(k, 0) for k, v in counter.names.items() if v != names.get(k, 0)}
    assert captured > 0, "the engine's decode calls go through the launch"
    assert (after.compiled - before.compiled, after.loaded - before.loaded) == (0, 0), f"compiled in round 1: {new}"


CHILD = """
import json, sys
from structlog.testing import capture_logs
from ourobatch import EngineConfig, SyncEngine, compile_cache
cfg = EngineConfig(model=sys.argv[1], compile_cache_dir=sys.argv[2], mode="verify", deep_interval=3,
                   **json.loads(sys.argv[3]))
with capture_logs() as logs, SyncEngine(cfg) as engine:
    counts = compile_cache.compile_counts()
ready = [e for e in logs if e["event"] == "engine_ready"][0]
key = [e["key_source"] for e in logs if e["event"] == "warmup_kernels_prefetch"]
print(json.dumps(dict(compiled=counts.compiled, loaded=counts.loaded, during=ready["compiled_during"], key=key)))
"""


def test_a_second_process_with_the_same_cache_dir_compiles_nothing(ckpt, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    runs = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), str(tmp_path / "cache"), json.dumps(CONFIG)],
                             capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        runs.append(json.loads(run.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["compiled"] > 0
    # every kernel compiles in the kernel passes (the prefetch beside the weight load, then the check after
    # it), none inside the graph captures or the request pass, where they would compile one at a time
    assert first["during"]["graphs"] == 0 and first["during"]["requests"] == 0, first["during"]
    assert sum(first["during"].values()) == first["compiled"]
    assert second["compiled"] == 0 and second["loaded"] >= first["compiled"] > 0
    assert (tmp_path / "cache" / "triton").is_dir()
    # Triton's own key (engine/triton_key.py): hashed by the first process, read back by the second
    assert first["key"] == ["hashed"] and second["key"] == ["stored"], (first["key"], second["key"])


EARLY_CHILD = """
import json, sys, threading
import torch
from structlog.testing import capture_logs
from engine import gluon_layers, prefill_graph
from ourobatch import EngineConfig, SamplingParams, SyncEngine, compile_cache

capturing, launched = threading.Event(), threading.Event()
real_launch, real_forward = gluon_layers.warm_launch, prefill_graph.forward
held = {"forward": False, "launch_during_capture": None}

def warm_launch(*a, **k):  # the loop-pass launch: compiled, loaded and launched while a capture is open
    if held["launch_during_capture"] is None:
        held["launch_during_capture"] = capturing.wait(120)
    try:
        return real_launch(*a, **k)
    finally:
        launched.set()

def forward(*a, **k):  # the first prefill capture stays open until that launch has been made
    if torch.cuda.is_current_stream_capturing() and not held["forward"]:
        held["forward"] = True
        capturing.set()
        launched.wait(120)
    return real_forward(*a, **k)

if sys.argv[4] == "1":
    gluon_layers.warm_launch, prefill_graph.forward = warm_launch, forward
cfg = EngineConfig(model=sys.argv[1], compile_cache_dir=sys.argv[2], **json.loads(sys.argv[3]))
counter = compile_cache.install_compile_counter()
with capture_logs() as logs, SyncEngine(cfg) as engine:
    graphs = engine.core.executor.graphs
    before, captures = counter.snapshot(), graphs.num_captures
    prompts = [[(7 * i + j) % 250 + 1 for j in range(5 + 3 * i)] for i in range(6)]
    params = [SamplingParams(max_tokens=12, seed=i, temperature=0.0 if i % 2 else 1.0, ignore_eos=True)
              for i in range(6)]
    outs = engine.generate_batch(prompts, params)
    after = counter.snapshot()
    captured = graphs.num_captures - captures
print(json.dumps(dict(tokens=[c.token_ids for o in outs for c in o.outputs], compiled=after.compiled - before.compiled,
                      loaded=after.loaded - before.loaded, captures=captured, held=held,
                      early=[e["late_launches"] for e in logs if e["event"] == "warmup_kernels_early"],
                      failed=[e["error"] for e in logs if e["event"] in ("warmup_kernel_failed",
                                                                         "warmup_kernels_prefetch_failed")],
                      graphs=[(e["graphs"], e["early"]) for e in logs if e["event"] == "cuda_graphs_captured"])))
"""


def test_early_capture_with_the_loop_pass_launch_loaded_and_launched_inside_a_capture(tmp_path):
    # OUROBATCH_EARLY_CAPTURE=1 (ourobatch/kernel_prefetch.py): the graphs without the loop-pass launch are
    # captured while its compile runs; here its load and launch are held until a prefill capture is open, and
    # that capture until they are done (a fresh process each, an empty compile cache each); the engine must then
    # give the tokens of the plain order, and its first round compile and capture nothing
    from engine import layers_dispatch

    if not layers_dispatch.switch_on() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the loop-pass launch runs on Hopper with OUROBATCH_DECODE_LAYERS on")
    ckpt = make_tiny_checkpoint(tmp_path / "m", dtype=torch.bfloat16, **LAUNCH_SHAPE)
    config = json.dumps(dict(mode="deferred", deep_interval=4, **{**CONFIG, "block_size": 16}))
    runs = {}
    for early in ("1", "0"):
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
        env["OUROBATCH_EARLY_CAPTURE"] = early
        run = subprocess.run([sys.executable, "-c", EARLY_CHILD, str(ckpt), str(tmp_path / f"cache{early}"), config,
                              early], capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        runs[early] = json.loads(run.stdout.strip().splitlines()[-1])
    early, plain = runs["1"], runs["0"]
    assert early["early"] == [1] and early["held"]["launch_during_capture"] is True, early
    assert early["graphs"][0][1] is True and early["graphs"][0][0] > 0 and early["graphs"][-1] == [4, False]
    assert plain["early"] == [] and [e for _, e in plain["graphs"]] == [False]
    for r in (early, plain):
        assert r["failed"] == [], r["failed"]  # the held launch itself worked (not compiled later instead)
        assert (r["compiled"], r["loaded"], r["captures"]) == (0, 0, 0), r
    assert early["tokens"] == plain["tokens"]
