"""benchmarks/ws_layer64.py's layer-shaped 64-row kernel run on the CPU by tests/gluon_emulator.py: every stage of
every layer (qkv, o, hm, act, d) against the torch reference the GPU probe checks against (ws_layer_probe's
LayerChain, rounded where the kernel stores), on fresh random chains at a small shape. Where Triton is installed
(CI installs it). Proxy fences are checked here too; acquire / release ordering on the GPU only
(benchmarks/ws_layer64_probe.py)."""

from __future__ import annotations

import pytest
import torch

from tests.benchmark_scripts import load_benchmark

pytest.importorskip("triton.experimental.gluon")
emulator = pytest.importorskip("tests.gluon_emulator")
probe = load_benchmark("ws_layer64_probe")
phase_probe = load_benchmark("phase_probe")

H, INTER = 512, 1024  # 1 chunk of 128 per CTA: K / 4 splits for qkv, o, gate_up; 1024 / 8 for down


def run(chain, ctas: int, stages: int = 4, s_in: int = 4, s_down: int = 8, seed: int = 0,
        arrive_lag: tuple[int, float] | None = None) -> None:
    args, constexprs = probe.launch_args(chain, ctas, stages, s_in, s_down)
    chain.reset()
    emulator.emulate(probe.ws_layer64_kernel, ctas, *args, seed=seed, check_global=True, arrive_lag=arrive_lag,
                     **constexprs)


@pytest.mark.parametrize("rows,ctas,seed", [(64, 8, 0), (37, 16, 1)])
def test_every_stage_of_every_layer_matches_the_reference(rows, ctas, seed):
    chain = probe.make_chain(rows, 2, "cpu", seed=seed, h=H, inter=INTER)
    ref = chain.reference()
    run(chain, ctas, seed=seed)
    for layer in range(2):
        errors = chain.stage_errors(layer)
        # the row scale multiplies the fp32 sums of (h n) W, rounded to bf16 before the scale (the reference
        # rounds after): within bf16 of the reference
        assert max(errors.values()) < 2e-2, (layer, errors)
    assert phase_probe.rel_err(chain.output(), ref) < 2e-2
    assert torch.equal(chain.hm[1:, rows:], torch.zeros_like(chain.hm[1:, rows:]))  # rows past M never written


def test_the_stager_signals_a_chunk_only_after_the_row_sums_are_stored():
    # the stager (partition 2) sleeping after each chunk signal: the group sums read every K range's row sums of
    # squares once the group's multiplying partitions have waited for the chunks, so they must be stored before
    chain = probe.make_chain(64, 2, "cpu", seed=6, h=H, inter=INTER)
    ref = chain.reference()
    run(chain, 8, arrive_lag=(2, 0.3))
    assert phase_probe.rel_err(chain.output(), ref) < 2e-2


def test_the_result_does_not_depend_on_the_ctas_timing():
    chain = probe.make_chain(64, 2, "cpu", seed=5, h=H, inter=INTER)
    run(chain, 8, seed=1)
    first = chain.output().clone()
    run(chain, 8, seed=2)
    assert torch.equal(chain.output(), first)


def test_a_way_the_kernel_cannot_run_names_the_field():
    for args, field in [((2048, 5632, 132, 8, 4, 8), "s_in and s_down"), ((2048, 5632, 130, 8, 4, 11), "multiple of"),
                        ((2048, 5632, 132, 16, 4, 11), "stages must")]:
        with pytest.raises(ValueError, match=field):
            probe.check_way(*args)
    with pytest.raises(ValueError, match="rows must be 33..64"):
        probe.make_chain(8, 1, "cpu", h=H, inter=INTER)


def test_the_kernel_compiles_for_sm90_with_its_wgmmas():
    built = probe.compile_for_sm90(8, 4, 11)
    # 4 chunks x 128 / 16 per box: one box a chunk in qkv, o and down, two in gate_up
    assert built["wgmma"] == 4 * 8 * 5 and built["mma"] == 0, built
    assert built["shared"] <= 232448 and built["tma_loads"] > 0, built
