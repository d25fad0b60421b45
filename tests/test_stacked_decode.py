"""benchmarks/stacked_decode.py: the stacked norm way as a whole decode loop pass, in Triton's interpreter (where
Triton is installed; CI installs it) against the model's own float64 pass (OuroForCausalLM.run_loops, the torch path
the CPU tests hold to the dense float64 oracle) on a paged history: every loop's readout and every layer's stored
keys and values, at 64 rows and below the row box. And its harness wrapper's routing and argument errors."""

from __future__ import annotations

import types

import pytest
import torch

from tests.benchmark_scripts import load_benchmark
from tests.interpreter import run_interpreted

INTERPRETED = """
import tempfile
import torch
from engine.kv_cache import KVPool
from engine.loader import load_model
from ourobatch.testing import make_tiny_checkpoint
from tests.benchmark_scripts import load_benchmark
from tests.paged_decode import scattered_meta
sd = load_benchmark("stacked_decode")
PAGE = 16
def err(got, want):
    return float((got.double() - want).norm() / want.norm())
def decode(cfg, contexts, seed):
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-c // PAGE) for c in contexts) + 4
    pool = KVPool.for_model(cfg, blocks, PAGE, torch.float32, "cpu")
    pool.k.copy_(torch.randn(pool.shape, generator=g))
    pool.v.copy_(torch.randn(pool.shape, generator=g))
    ref = KVPool.for_model(cfg, blocks, PAGE, torch.float64, "cpu")
    ref.k.copy_(pool.k)
    ref.v.copy_(pool.v)
    meta, _ = scattered_meta(contexts, pool, seed)
    return pool, ref, meta, torch.randn(len(contexts), cfg.hidden_size, generator=g)
shape = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128, intermediate_size=128,
             num_hidden_layers=2, total_ut_steps=2, vocab_size=97)
ckpt = make_tiny_checkpoint(tempfile.mkdtemp() + "/m", seed=3, eos_token_id=None, **shape)
fast, want_model = load_model(ckpt, torch.float32, "cpu"), load_model(ckpt, torch.float64, "cpu")
fast.fuse_projections()
for contexts, producer in [([1 + (7 * i) % 40 for i in range(64)], (16, 128)), ([5, 33, 16, 17, 2, 70, 9], (32, 128))]:
    pool, ref, meta, h = decode(fast.config, contexts, seed=len(contexts))
    got = sd.stacked_run_loops(fast, h, meta, pool, 1, 2, producer)
    want = want_model.run_loops(h.double(), meta, ref, 1, 2)
    for loop in range(2):
        assert err(got[loop], want[loop]) < 1e-4, ("readout", len(contexts), loop, err(got[loop], want[loop]))
    for name in ("k", "v"):
        for loop in (1, 2):
            for layer in range(2):
                g_kv = pool.plane(loop, layer)[name == "v"][meta.slots]
                w_kv = ref.plane(loop, layer)[name == "v"][meta.slots]
                assert err(g_kv, w_kv) < 1e-4, (name, len(contexts), loop, layer, err(g_kv, w_kv))
print("ok")
"""


def test_the_stacked_loop_pass_matches_the_models_float64_pass_in_tritons_interpreter():
    run_interpreted(INTERPRETED)


def meta(prefill: bool) -> types.SimpleNamespace:
    return types.SimpleNamespace(prefill=prefill)


@pytest.mark.parametrize(("rows", "dtype", "prefill", "served"), [
    (64, torch.bfloat16, False, True), (1, torch.float16, False, True), (65, torch.bfloat16, False, False),
    (64, torch.bfloat16, True, False), (64, torch.float32, False, False), (64, torch.float64, False, False)])
def test_serves_takes_half_precision_decode_calls_of_one_row_box(rows, dtype, prefill, served):
    sd = load_benchmark("stacked_decode")
    assert sd.serves(torch.zeros(rows, 8, dtype=dtype), meta(prefill)) is served


def test_install_routes_the_calls_it_serves_and_leaves_the_rest_to_the_original(monkeypatch):
    from engine import fused_pass

    sd = load_benchmark("stacked_decode")
    seen = []
    monkeypatch.setattr(fused_pass, "run_loops", lambda *a: seen.append(("original", a[1].shape[0])) or ["o"])
    monkeypatch.setattr(sd, "stacked_run_loops", lambda *a: seen.append(("stacked", a[1].shape[0], a[6:])) or ["s"])
    calls = sd.install((32, 128), 2)
    h64, h80 = torch.zeros(64, 8, dtype=torch.bfloat16), torch.zeros(80, 8, dtype=torch.bfloat16)
    assert fused_pass.run_loops(None, h64, meta(False), None, 1, 4) == ["s"]
    assert fused_pass.run_loops(None, h80, meta(False), None, 1, 4) == ["o"]
    assert fused_pass.run_loops(None, h64, meta(True), None, 1, 4) == ["o"]
    assert seen == [("stacked", 64, ((32, 128), 2)), ("original", 80), ("original", 64)]
    assert calls == {"stacked": 1, "original": 2}


@pytest.mark.parametrize(("argv", "message"), [
    (["--producer", "16x64", "benchmarks/throughput.py"], "--producer must be one of 16x128, 16x256, 32x128"),
    (["--producer", "wide", "benchmarks/throughput.py"], "got 'wide'"),
    (["--stages", "4", "benchmarks/throughput.py"], "invalid choice: 4"),
    (["benchmarks/no_such_harness.py"], "no such script 'benchmarks/no_such_harness.py'")])
def test_bad_arguments_are_refused_naming_the_field(argv, message, capsys):
    sd = load_benchmark("stacked_decode")
    with pytest.raises(SystemExit):
        sd.main(argv)
    assert message in capsys.readouterr().err


def test_stacked_off_runs_the_harness_unchanged(tmp_path, capsys):
    from engine import fused_pass

    sd = load_benchmark("stacked_decode")
    before = fused_pass.run_loops
    script = tmp_path / "harness.py"
    script.write_text("import sys\nprint('harness ran with', sys.argv[1:])\n")
    assert sd.main(["--stacked-off", str(script), "--out", "x"]) == {}
    assert fused_pass.run_loops is before
    assert "harness ran with ['--out', 'x']" in capsys.readouterr().out
