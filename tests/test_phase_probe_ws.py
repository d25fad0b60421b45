"""benchmarks/phase_probe_ws.py, the warp-specialized Gluon chain kernel, compiled for sm90 on the CPU (Triton
builds the PTX and ptxas the cubin without a GPU; where Triton is installed, CI installs it). Triton's interpreter
cannot run Gluon, so its results are checked against torch on the H200 only (every run of the probe, and its
first call has a deadline). Here: every SPLIT compiles, the weights come in as TMA boxes, the kernel's MMA count
is the tile's (each K step of 16 once per 8 activation rows), the diagnostic without MMA has none,
the default ways fit the H200's shared memory, and bad --ways name the field."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark

pytest.importorskip("triton.experimental.gluon")
ws = load_benchmark("phase_probe_ws")

H200_SHARED = 232448  # bytes of shared memory one CTA may use on the H200 (sm90)


@pytest.mark.parametrize("split", [0, 1, 2, 3])
@pytest.mark.parametrize("block_m", [8, 16])
def test_each_split_compiles_with_tma_boxes_and_one_mma_per_k_step(split, block_m):
    built = ws.compile_for_sm90(stages=12, block_m=block_m, chains=4, split=split)
    assert built["tma_loads"] > 0 and built["cubin_bytes"] > 0
    # [16 weight rows] x [K] x [block_m rows] as m16n8k16 MMAs, written once in the kernel (static K loop)
    assert built["mma"] == (ws.K // 16) * (block_m // 8), built
    assert built["shared"] <= H200_SHARED, built


def test_staging_more_columns_takes_their_shared_memory_and_no_more_mma():
    base, wide = (ws.compile_for_sm90(stages=6, block_m=8, split=2, stage_k=k) for k in (0, 2 * ws.K))
    assert wide["shared"] - base["shared"] == 2 * 8 * ws.K * 2  # two buffers of 8 rows x K more bf16
    assert wide["mma"] == base["mma"]


def test_the_no_mma_diagnostic_multiplies_nothing():
    assert ws.compile_for_sm90(stages=12, block_m=8, skip=1, split=2)["mma"] == 0


def test_more_ring_slots_take_more_shared_memory():
    small, large = (ws.compile_for_sm90(stages=s, block_m=8, split=2)["shared"] for s in (6, 12))
    assert large - small == 6 * ws.BLOCK_N * ws.BLOCK_K_WS * 2 + 6 * 2 * 8  # 8 KB boxes and two mbarriers each


def test_ways_parse_and_reject_what_the_kernel_does_not_have():
    assert ws.parse_ways("12:4:0:2,10:1:2:0:4,6:4:0:2:0:4096") == [(12, 4, 0, 2, 0, 0), (10, 1, 2, 0, 4, 0),
                                                                  (6, 4, 0, 2, 0, 4096)]
    for bad in ("12:3:0:2", "12:4:0:5", "40:4:0:2", "12:4:0", "12:4:0:2:3", "12:4:0:2:0:5632", "12:4:0:1:0:4096",
                "12:4:0:4"):
        with pytest.raises(ValueError, match="stages:chains:skip:split"):
            ws.parse_ways(bad)
    with pytest.raises(ValueError, match="rows must be <= 16"):
        ws.ws_block_m(64)


def test_the_64_row_kernel_streams_its_activations_and_multiplies_every_tile_once():
    ws64 = load_benchmark("ws_chain64")
    built = ws64.compile64_for_sm90(stages=12, xstages=3)
    # the K loop is a loop (not unrolled): per chunk, T_MAX tiles x 256 / 16 steps x 2 MMAs of 8 rows per warp
    # (4 warps split the 64 batch rows), each written once
    assert built["mma"] == ws64.T_MAX * (ws.BLOCK_K_WS // 16) * 2, built
    assert built["cp_async"] == 64 * ws.BLOCK_K_WS * 2 // (16 * 32)  # one 64 x 256 chunk, 16 B per copy, 1 warp
    assert built["tma_loads"] > 0 and built["shared"] <= H200_SHARED, built
    assert ws64.compile64_for_sm90(stages=12, xstages=3, skip=1)["mma"] == 0
    assert ws64.parse_ways64("12:3:0,10:4:2") == [(12, 3, 0), (10, 4, 2)]
    for bad in ("12:3", "12:5:0", "30:3:0", "12:3:3"):
        with pytest.raises(ValueError, match="stages:xstages:skip"):
            ws64.parse_ways64(bad)


def test_the_layer_kernel_compiles_with_its_phases_and_refuses_a_diagnostic_that_would_hang():
    layer = load_benchmark("ws_layer_probe")
    for epilogue_norm in (True, False):
        built = layer.compile_for_sm90(stages=10, epilogue_norm=epilogue_norm)
        # MMAs as written: 4 quarter chains x 4 steps of 16 per box, one box in qkv, o and down, two in gate_up
        assert built["mma"] == 16 * 5, built
        assert built["shared"] <= H200_SHARED and built["tma_loads"] > 0, built
    with pytest.raises(Exception, match="publish no row scales"):
        layer.compile_for_sm90(stages=10, diag=2, epilogue_norm=True)


def test_the_layer_reference_and_its_diagnosis_find_a_wrong_tile():
    """The torch reference the GPU run checks against, and the per-tile diagnosis that found session 14's bug
    (a CTA with no tile in a phase skipped its chunk signals): fed the reference itself, nothing is off; with
    one 16-column tile of act changed, exactly that tile is named."""
    import torch

    layer = load_benchmark("ws_layer_probe")
    chain = layer.LayerChain(rows=3, layers=2, device="cpu")
    final = chain.reference()
    for i, steps in enumerate(chain.ref_steps):  # the kernel's buffers, as if it had computed the reference
        chain.qkv[i, :3], chain.o[i, :3], chain.act[i, :3] = steps["qkv"], steps["o"], steps["act"]
        chain.hm[i + 1, :3], chain.d[i + 1, :3] = steps["hm"], steps["d"]
    assert torch.equal(chain.output(), final)
    assert max(chain.stage_errors(1).values()) < 5e-3
    clean = chain.act_diagnosis(0)
    assert clean["num_bad_tiles"] == 0 and clean["silu(g)*u n2"] < 5e-3 < clean["silu(u)*g n2"]
    chain.act[0, :3, 130 * 16:131 * 16] *= -1
    assert chain.act_diagnosis(0)["bad_tiles"] == [130]


def test_the_persistent_kernels_refuse_a_chain_where_a_cta_would_have_no_tile():
    phase_probe = load_benchmark("phase_probe")
    chain = phase_probe.Chain(3, [64, 128], "cpu", dtype=__import__("torch").float32)
    chain.check_whole_waves(4)  # 64 and 128 columns: 1 and 2 waves of 4 x 16
    with pytest.raises(ValueError, match="whole waves of 16-column tiles on 3 programs"):
        chain.check_whole_waves(3)


@pytest.mark.parametrize("stages,splits", [(8, 4), (6, 2)])
def test_the_split_k_64_row_kernel_multiplies_with_wgmma_and_stages_its_k_range_once(stages, splits):
    wg = load_benchmark("ws_chain64_wg")
    built = wg.compile_wg_for_sm90(stages=stages, splits=splits)
    chunks = ws.K // splits // wg.BOX_K
    # per staged chunk one box of the unit's weights: BOX_K / 16 wgmma m64n64k16 each, written once (static loop)
    assert built["wgmma"] == chunks * wg.BOX_K // 16 and built["mma"] == 0, built
    assert built["tma_loads"] > 0 and built["cp_async"] == 0, built  # weights and activations both through TMA
    assert built["proxy_fence"] == 2, built  # the tiles' writer before its count, the stager after its poll
    # the staged K range and the ring exactly, plus the barriers and the scalar atomic's broadcast word
    staged = (chunks + stages) * wg.ROWS * wg.BOX_K * 2
    assert staged <= built["shared"] <= staged + 1024 and built["shared"] <= H200_SHARED, built
    assert wg.compile_wg_for_sm90(stages=stages, splits=splits, skip=1)["wgmma"] == 0
    nosum = wg.compile_wg_for_sm90(stages=stages, splits=splits, skip=3)  # the diagnostic: no count, no L2 sum
    assert nosum["wgmma"] == built["wgmma"] and nosum["atomics"] < built["atomics"], (nosum, built)
    # group 1: no count per unit (no acq_rel atomic in the unit loop), the group's count and poll instead
    group = wg.compile_wg_for_sm90(stages=stages, splits=splits, group=1)
    assert group["wgmma"] == built["wgmma"] and group["shared"] == built["shared"], (group, built)
    assert group["acquire_loads"] > built["acquire_loads"] and group["atomics"] == built["atomics"], (group, built)


def test_the_split_k_kernel_names_what_a_way_or_a_chain_lacks():
    wg = load_benchmark("ws_chain64_wg")
    assert wg.parse_ways_wg("8:4:0,6:2:2:1") == [(8, 4, 0, 0), (6, 2, 2, 1)]
    assert wg.parse_ways_wg("") == []  # the probe without this kernel
    for bad in ("8:4", "8:4:0:1:0", "8:4:0,"):
        with pytest.raises(ValueError, match="stages:splits:skip"):
            wg.parse_ways_wg(bad)
    for bad, field in [("8:3:0", "splits must be"), ("16:4:0", "stages must"), ("8:4:4", "skip 0..3"),
                       ("8:4:0:2", "group must be")]:
        with pytest.raises(ValueError, match=field):
            wg.parse_ways_wg(bad)
    cols = [2112, 6336]
    wg.check_chain(2048, cols, 132, 4)
    for args, field in [((2048, cols, 130, 4), "multiple of splits"), ((2048, [2100], 132, 4), "multiple of 64"),
                        ((1600, cols, 132, 4), "K \\(1600\\)")]:
        with pytest.raises(ValueError, match=field):
            wg.check_chain(*args)
