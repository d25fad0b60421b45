"""engine/gemm_dispatch.py: which rows the fused skinny GEMMs serve (the kernels themselves: tests/gpu)."""

from __future__ import annotations

import pytest

from engine.gemm_dispatch import GEMM_TABLE, GemmConfig, gate_block_k, gemm_block_m, gemm_config


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


@pytest.fixture
def early_env(monkeypatch):
    """OUROBATCH_GEMM_EARLY set to a value for one test, read afresh (early_override caches the variable)."""
    from engine import gemm_dispatch

    def set_to(value: str | None):
        if value is None:
            monkeypatch.delenv(gemm_dispatch.EARLY_ENV, raising=False)
        else:
            monkeypatch.setenv(gemm_dispatch.EARLY_ENV, value)
        gemm_dispatch.early_override.cache_clear()

    yield set_to
    gemm_dispatch.early_override.cache_clear()


def test_the_early_knob_sets_every_table_rows_early_boxes(early_env):
    early_env("4:2")
    for rows, cfg in GEMM_TABLE:
        got = gemm_config(rows)
        assert (got.early_o, got.early_down) == (4, 2)
        assert got == GemmConfig(**{**cfg.__dict__, "early_o": 4, "early_down": 2})
    assert gemm_config(10_000) is None
    table = ((64, GemmConfig()),)
    assert gemm_config(8, table) is table[0][1]  # a caller's own table is not the knob's
    early_env(None)
    assert all(gemm_config(rows) is cfg for rows, cfg in GEMM_TABLE)


@pytest.mark.parametrize("value", ["4", "5:0", "1:x", "1:2:3", "-1:0"])
def test_the_early_knob_refuses_what_it_cannot_read(early_env, value):
    early_env(value)
    with pytest.raises(ValueError, match="OUROBATCH_GEMM_EARLY must read O:DOWN"):
        gemm_config(64)


@pytest.mark.parametrize("field", ["early_o", "early_down"])
def test_a_config_refuses_more_early_boxes_than_the_kernel_has(field):
    with pytest.raises(ValueError, match=f"GemmConfig.{field} must be 0..4"):
        GemmConfig(**{field: 5})
