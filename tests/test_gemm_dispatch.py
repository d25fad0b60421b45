"""engine/gemm_dispatch.py: which rows the fused skinny GEMMs serve (the kernels themselves: tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from engine import gemm_dispatch
from engine.gemm_dispatch import (GEMM_TABLE, GemmConfig, gate_block_k, gate_stages, gemm_block_m, gemm_config,
                                  qkv_stream_stages)


def test_the_table_is_ascending_and_every_config_is_a_valid_tile():
    limits = [rows for rows, _ in GEMM_TABLE]
    assert limits == sorted(set(limits)), "ascending, no duplicate bucket"
    for _, cfg in GEMM_TABLE:
        for tile in (cfg.block_n, cfg.block_k, cfg.block_n_gate, gate_block_k(cfg)):
            assert tile >= 16 and tile & (tile - 1) == 0, "tl.dot tiles are powers of two >= 16"
        assert cfg.splits_o >= 1 and cfg.splits_down >= 1


@pytest.mark.parametrize("rows", [1, 7, 16, 31, 32, 33, 63, 64, 65, 512])
def test_a_call_gets_the_first_bucket_that_holds_its_rows(rows):
    table = ((16, GemmConfig(block_n=32)), (64, GemmConfig(block_n=64)))
    got = gemm_config(rows, table)
    if rows <= 16:
        assert got == table[0][1]
    elif rows <= 64:
        assert got == table[1][1]
    else:
        assert got is None  # past the table: cuBLAS
    assert gemm_config(rows, ()) is None
    assert gemm_config(10_000) is None  # the shipped table ends well below a prefill chunk


def test_gate_up_takes_its_own_block_k_where_the_config_sets_one():
    assert gate_block_k(GemmConfig(block_k=128)) == 128
    assert gate_block_k(GemmConfig(block_k=256, block_k_gate=64)) == 64


@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 4096])
def test_a_tile_holds_the_rows_in_a_power_of_two_between_16_and_64(rows):
    bm = gemm_block_m(rows)
    assert bm in (16, 32, 64)
    assert bm >= rows or bm == 64, "all rows in one tile up to 64; past it, tiles of 64"
    assert bm == 16 or bm // 2 < rows, "the smallest such tile"


def _refused_then_unset(monkeypatch, name: str, setting, bad: tuple[str, ...], match: str, table) -> None:
    """Each bad value of the switch `name` refused by gemm_config with `match`; then the switch unset."""
    for value in bad:
        monkeypatch.setenv(name, value)
        setting.cache_clear()
        with pytest.raises(ValueError, match=match):
            gemm_config(64, table)
    monkeypatch.delenv(name)
    setting.cache_clear()


def test_the_stream_k_switch_sets_every_rows_choice_and_refuses_other_values(monkeypatch):
    table = ((16, GemmConfig(block_n=32)), (64, GemmConfig(block_n=64, stream_gate=True)))
    try:
        for value, gate, qkv in (("gate,qkv", True, True), ("qkv", False, True), (" gate ", True, False),
                                 ("none", False, False)):
            monkeypatch.setenv("OUROBATCH_STREAM_K", value)
            gemm_dispatch.stream_k_setting.cache_clear()
            got = [gemm_config(r, table) for r in (8, 64)]
            assert [(c.stream_gate, c.stream_qkv) for c in got] == [(gate, qkv)] * 2, value
            assert got[1].block_n == 64  # only the switch's fields change
        _refused_then_unset(monkeypatch, "OUROBATCH_STREAM_K", gemm_dispatch.stream_k_setting, ("yes", "gate,up", "1"),
                            "OUROBATCH_STREAM_K must be 'none' or a comma list of gate, qkv", table)
        assert gemm_config(8, table) is table[0][1] and gemm_config(64, table) is table[1][1]  # unset: the table's
    finally:
        gemm_dispatch.stream_k_setting.cache_clear()


def test_gate_up_takes_its_own_stages_where_the_config_or_the_switch_sets_them(monkeypatch):
    assert gate_stages(GemmConfig(num_stages=4)) == 4
    assert gate_stages(GemmConfig(num_stages=4, stages_gate=3)) == 3
    table = ((16, GemmConfig(block_n=32)), (64, GemmConfig(block_n=64, stages_gate=5)))
    try:
        monkeypatch.setenv("OUROBATCH_GATE_STAGES", "3")
        gemm_dispatch.gate_stages_setting.cache_clear()
        got = [gemm_config(r, table) for r in (8, 64)]
        assert [gate_stages(c) for c in got] == [3, 3] and [c.num_stages for c in got] == [4, 4]
        assert got[1].block_n == 64  # only the switch's field changes
        _refused_then_unset(monkeypatch, "OUROBATCH_GATE_STAGES", gemm_dispatch.gate_stages_setting,
                            ("1", "7", "three", "3.0"), "OUROBATCH_GATE_STAGES must be an integer from 2 to 6", table)
        assert gemm_config(64, table) is table[1][1] and gate_stages(table[1][1]) == 5  # unset: the table's
    finally:
        gemm_dispatch.gate_stages_setting.cache_clear()


def test_the_stream_k_qkv_pipeline_fits_the_shared_memory():
    # a stage at 64 rows, K step 128, bf16: (2 x 16 + 64) x 128 x 2 = 24 KB (block_d 16), 32 KB (block_d 32)
    cfg = GemmConfig(block_k_qkv=128, stages_qkv_stream=8)
    assert qkv_stream_stages(cfg, 16, 64) == 8  # 192 KB
    assert qkv_stream_stages(cfg, 32, 64) == 6  # 8 would be 256 KB
    assert qkv_stream_stages(GemmConfig(stages_qkv_stream=0, num_stages=3), 16, 64) == 3  # 0: num_stages
    assert qkv_stream_stages(GemmConfig(block_k_qkv=1024, stages_qkv_stream=8), 64, 64) == 2  # never below 2


def test_a_stream_k_launch_needs_the_configs_ask_and_one_row_tile():
    cfg = GemmConfig(stream_gate=True)
    assert gemm_dispatch.stream_k(cfg, "gate", 1) and gemm_dispatch.stream_k(cfg, "gate", 64)
    assert not gemm_dispatch.stream_k(cfg, "gate", 65)  # two row tiles: the one-tile kernel
    assert not gemm_dispatch.stream_k(cfg, "qkv", 8)  # only the op the config names
    assert gemm_dispatch.stream_k(GemmConfig(stream_qkv=True), "qkv", 8)
    assert not gemm_dispatch.stream_k(None, "gate", 8)  # cuBLAS
    flags = gemm_dispatch.new_stream_flags("cpu")
    assert flags.dtype == torch.int32 and flags.numel() >= 132 and not flags.any()
