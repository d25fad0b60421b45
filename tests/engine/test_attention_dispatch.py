"""The paged kernel's launch table and dispatch rule (engine/attention_dispatch.py; no Triton needed)."""

from __future__ import annotations

import inspect
import math

import pytest

from engine.attention_dispatch import (
    LAUNCH_TABLE,
    LaunchConfig,
    choose_config,
    max_tiles,
    query_tiling,
    tile_map,
)

H200_SMS = 132


def test_the_table_ends_with_a_row_for_everything_and_its_configs_are_valid():
    assert LAUNCH_TABLE[-1][:2] == (math.inf, math.inf)
    for max_per_sm, max_tile, config in LAUNCH_TABLE:
        assert max_per_sm > 0 and max_tile >= 1
        LaunchConfig(config.block_n, config.num_warps, config.num_stages, config.splits)  # validates


def test_few_requests_split_the_keys_and_many_do_not():
    # Ouro-1.4B heads on an H200: 1-16 requests leave SMs idle with one program per (request, kv head)
    # (the sweep may move the thresholds; these ends hold for any sensible table)
    splits = [choose_config(n, 16, 1, 128, H200_SMS).splits for n in (1, 2, 4, 8, 16, 64, 256)]
    assert splits[-1] == 1
    assert all(s > 1 for s in splits[:3])
    assert splits == sorted(splits, reverse=True)  # fewer requests, at least as many splits
    for n in (1, 8, 64):  # every request's programs together stay within a few waves
        config = choose_config(n, 16, 1, 128, H200_SMS)
        assert n * 16 * config.splits <= 8 * H200_SMS or config.splits == 1


def test_the_rule_reads_only_graph_fixed_host_ints():
    # no context length: a captured launch must stay valid while contexts grow
    assert list(inspect.signature(choose_config).parameters) == ["seqs", "kv_heads", "tile", "head_dim", "num_sms",
                                                                 "table"]
    a = choose_config(8, 16, 4, 128, H200_SMS)
    assert a == choose_config(8, 16, 4, 128, H200_SMS)


def test_first_matching_row_wins_and_big_heads_get_narrow_key_tiles():
    table = ((1.0, 16, LaunchConfig(64, 4, 2, 4)), (math.inf, 16, LaunchConfig(128, 8, 3, 1)),
             (math.inf, math.inf, LaunchConfig(32, 4, 2, 1)))
    assert choose_config(8, 16, 16, 128, 128, table) == LaunchConfig(64, 4, 2, 4)  # per_sm = 1.0
    assert choose_config(9, 16, 16, 128, 128, table) == LaunchConfig(128, 8, 3, 1)
    assert choose_config(1, 16, 17, 128, 128, table) == LaunchConfig(32, 4, 2, 1)  # tile past 16
    assert choose_config(9, 16, 16, 256, 128, table).block_n == 32
    with pytest.raises(ValueError, match="LAUNCH_TABLE has no row"):
        choose_config(1, 1, 17, 128, 128, table[:2])


@pytest.mark.parametrize("kwargs,field", [(dict(block_n=48), "block_n"), (dict(block_n=8), "block_n"),
                                          (dict(num_warps=3), "num_warps"), (dict(num_stages=0), "num_stages"),
                                          (dict(splits=0), "splits"), (dict(splits=65), "splits")])
def test_bad_launch_configs_name_the_field(kwargs, field):
    base = dict(block_n=64, num_warps=4, num_stages=2, splits=1) | kwargs
    with pytest.raises(ValueError, match=f"LaunchConfig.{field}"):
        LaunchConfig(**base)


@pytest.mark.parametrize("rows,group,d,expect", [
    (1, 1, 128, (16, 1)),  # tl.dot needs 16 rows: one decode row is padded
    (8, 1, 128, (16, 1)),
    (4, 4, 128, (16, 1)),
    (5, 4, 128, (32, 1)),
    (64, 1, 128, (64, 1)),
    (40, 4, 128, (64, 3)),  # past MAX_BLOCK_M: M tiles
    (40, 4, 64, (128, 2)),  # small heads hold larger tiles
])
def test_query_tiling(rows, group, d, expect):
    block_m, m_tiles = query_tiling(rows, group, d)
    assert (block_m, m_tiles) == expect
    assert block_m * m_tiles >= rows * group


@pytest.mark.parametrize("rows,group,expect", [(1, 1, (16, 1)), (4, 4, (16, 1)), (5, 4, (16, 2)), (40, 4, (16, 10))])
def test_float32_tiles_stay_at_16_rows(rows, group, expect):
    block_m, m_tiles = query_tiling(rows, group, 128, fp32=True)
    assert (block_m, m_tiles) == expect
    assert block_m * m_tiles >= rows * group


@pytest.mark.parametrize("seed", range(6))
def test_tile_map_covers_every_row_once_and_fits_max_tiles(seed):
    # random chunk lengths (1-token decode rows up to long prompt chunks), GQA groups and tile heights:
    # the tiles' rows, expanded, are exactly every (sequence, query row x head) once; padding names pad_seq
    import random

    rnd = random.Random(seed)
    rows = [rnd.choice([1, 2, 15, 16, 17, 63, 64, 65, 200]) for _ in range(rnd.randint(1, 9))]
    group, block_m = rnd.choice([1, 2, 4]), rnd.choice([16, 64, 128])
    cap = max_tiles(sum(rows), len(rows), group, block_m)
    flat = tile_map(rows, group, block_m, cap, pad_seq=len(rows))
    pairs = list(zip(flat[::2], flat[1::2]))
    assert len(pairs) == cap
    covered = []
    for seq, m in pairs:
        if seq == len(rows):
            assert m == 0
            continue
        covered += [(seq, i) for i in range(m * block_m, (m + 1) * block_m) if i < rows[seq] * group]
    assert sorted(covered) == [(s, i) for s, n in enumerate(rows) for i in range(n * group)]
    assert len(covered) == len(set(covered))


def test_tile_map_refuses_more_tiles_than_its_capacity():
    assert max_tiles(64, 1, 1, 64) == 2
    with pytest.raises(ValueError, match="3 M tiles, more than the map's capacity of 2"):
        tile_map([64, 1, 1], 1, 64, 2, pad_seq=3)


# ------------------------------------------------------------------ the Gluon decode kernel's launch rule

def test_decode_config_fills_the_sms_and_hands_large_batches_to_the_triton_kernel():
    from engine.attention_dispatch import (DECODE_MAX_PER_SM, DECODE_PERSIST_MAX_PER_SM, PERSISTENT_RING,
                                           DecodeConfig, decode_config)

    for sms in (78, 114, 132):
        for kv_heads in (1, 8, 16):
            for seqs in range(1, 80):
                c = decode_config(seqs, kv_heads, sms)
                pairs = seqs * kv_heads
                if pairs > DECODE_PERSIST_MAX_PER_SM * sms:
                    assert c is None and decode_config(seqs, kv_heads, sms, persistent=None) is None
                    continue
                if pairs > DECODE_MAX_PER_SM * sms:
                    assert c == PERSISTENT_RING and decode_config(seqs, kv_heads, sms, persistent=None) is None
                    continue
                # shares only where one CTA per pair leaves 3/4 of the SMs idle, then as many as fill them
                assert c.splits == 1 or 4 * pairs <= sms
                assert c.splits == 1 or pairs * c.splits <= sms < pairs * (c.splits + 1) or c.splits == 16
                assert (c.block_n, c.stages) == (DecodeConfig().block_n, DecodeConfig().stages)
    assert decode_config(8, 16, 132).splits == 1 and decode_config(1, 16, 132).splits == 8
    assert decode_config(4, 16, 132).splits == 1 and decode_config(9, 16, 132).ctas_per_sm == 1
    assert decode_config(16, 16, 132).ctas_per_sm == 1 and decode_config(17, 16, 132) is None
    late = DecodeConfig(early=False)  # the measuring control reaches the persistent launches too
    assert not decode_config(16, 16, 132, late).early and not decode_config(8, 16, 132, late).early


@pytest.mark.parametrize("text,block_n,stages,per_sm", [("32x6", 32, 6, 0), ("64X3", 64, 3, 0), ("16x12", 16, 12, 0),
                                                        ("32x6p2", 32, 6, 2)])
def test_parse_ring(text, block_n, stages, per_sm):
    from engine.attention_dispatch import decode_config, parse_ring

    c = parse_ring(text)
    assert (c.block_n, c.stages, c.splits, c.ctas_per_sm) == (block_n, stages, 1, per_sm)
    if per_sm:  # a persistent ring takes every request count, unsplit
        assert decode_config(1, 16, 132, c) == c and decode_config(256, 16, 132, c) == c


@pytest.mark.parametrize("text,match", [("32", "BLOCK_NxSTAGES"), ("ax6", "BLOCK_NxSTAGES"),
                                        ("24x6", "block_n must be a power of two"), ("32x1", "stages must satisfy"),
                                        ("32x6pq", "BLOCK_NxSTAGES"), ("32x6p", "BLOCK_NxSTAGES"),
                                        ("32x6p9", "ctas_per_sm must satisfy")])
def test_bad_rings_are_refused_naming_the_variable_or_field(text, match):
    from engine.attention_dispatch import parse_ring

    with pytest.raises(ValueError, match=match):
        parse_ring(text)


def test_o_fold_applies_where_every_cta_is_resident_and_owns_a_tile():
    from engine.attention_dispatch import HOPPER_SMEM_PER_CTA, O_ROWS, DecodeConfig, decode_config, o_fold_applies

    # Ouro-1.4B on the H200: 16 heads of 128, hidden 2048 -> 128 output tiles of 16 columns
    for seqs in range(1, 65):
        c = decode_config(seqs, 16, 132)
        assert o_fold_applies(c, seqs, seqs, 16, 128, 2048, 132) == (seqs == 8), seqs
    eight = decode_config(8, 16, 132)
    assert not o_fold_applies(eight, 8, 8, 16, 128, 2048, 114)  # 128 CTAs on 114 SMs: not all resident
    assert not o_fold_applies(eight, 8, 0, 16, 128, 2048, 132) and not o_fold_applies(eight, 9, O_ROWS + 1, 16, 128,
                                                                                      2048, 144)
    assert not o_fold_applies(None, 8, 8, 16, 128, 2048, 132)
    assert not o_fold_applies(DecodeConfig(32, 6, splits=2), 8, 8, 16, 128, 2048, 132)
    assert not o_fold_applies(DecodeConfig(32, 6, ctas_per_sm=1), 8, 8, 16, 128, 2048, 132)
    assert not o_fold_applies(eight, 8, 8, 16, 128, 2056, 132)  # hidden not a multiple of 16 columns
    assert not o_fold_applies(eight, 8, 8, 3, 64, 2048, 132)  # K = 192: not whole weight boxes
    # shared memory: ring + 24 rows of K (the o tile and the staged rows) + barriers
    assert o_fold_applies(DecodeConfig(32, 6), 8, 8, 16, 128, 2048, 132)
    big = DecodeConfig(32, 16)
    assert 2 * 16 * 32 * 128 * 2 + 24 * 2048 * 2 > HOPPER_SMEM_PER_CTA
    assert not o_fold_applies(big, 8, 8, 16, 128, 2048, 132)
    assert o_fold_applies(DecodeConfig(32, 6), 8, 8, 2, 128, 256, 132)  # the GPU tests' small model: 16 tiles


def test_fold_env_values():
    from engine.attention_dispatch import FoldConfig, parse_fold

    assert parse_fold("0") is None
    assert parse_fold("1") == FoldConfig() and parse_fold("2:cta") == FoldConfig(norm=True, stager=1)
    assert parse_fold("1:warp") == FoldConfig(norm=False, stager=0)
    for bad in ("3", "1:x", "yes", ""):
        with pytest.raises(ValueError, match="OUROBATCH_DECODE_FOLD_O must be 0, 1 or 2"):
            parse_fold(bad)
    with pytest.raises(ValueError, match="FoldConfig.stager must be 0 or 1"):
        FoldConfig(stager=2)


@pytest.mark.parametrize("text,expect", [("n16/w2/s3", LaunchConfig(16, 2, 3)), ("0", None), (" ", None),
                                         ("N32/W4/S2/K2", LaunchConfig(32, 4, 2, 2)),
                                         ("n16/w2/s3/k1/head", LaunchConfig(16, 2, 3, 1, head_major=True)),
                                         ("w2/s3/n64/head", LaunchConfig(64, 2, 3, head_major=True)),
                                         ("n16/w1/s4/meta", LaunchConfig(16, 1, 4, meta_early=True)),
                                         ("n16/w2/s3/k1/head/meta", LaunchConfig(16, 2, 3, 1, True, True))])
def test_parse_launch_and_its_label(text, expect):
    from engine.attention_dispatch import launch_label, parse_launch

    assert parse_launch(text) == expect
    if expect is not None:
        assert parse_launch(launch_label(expect)) == expect


@pytest.mark.parametrize("text,match", [("n16/w2", "nBLOCK_N/wWARPS/sSTAGES"), ("head", "nBLOCK_N/wWARPS/sSTAGES"),
                                        ("n16/n32/w2/s2", "nBLOCK_N/wWARPS/sSTAGES"),
                                        ("n16/w2/s3/head/head", "nBLOCK_N/wWARPS/sSTAGES"),
                                        ("n16/w2/s3/early", "nBLOCK_N/wWARPS/sSTAGES"),
                                        ("n16/w2/s3/meta/head", "nBLOCK_N/wWARPS/sSTAGES"),
                                        ("n16/w2/s3/meta/meta", "nBLOCK_N/wWARPS/sSTAGES"),
                                        ("n16/w2/sx", "nBLOCK_N/wWARPS/sSTAGES"), ("n16/w2/s3/x1", "nBLOCK_N"),
                                        ("n24/w2/s2", "block_n must be a power of two"),
                                        ("n16/w3/s2", "num_warps must be one of")])
def test_bad_launch_texts_are_refused_naming_the_form_or_field(text, match):
    from engine.attention_dispatch import parse_launch

    with pytest.raises(ValueError, match=match):
        parse_launch(text)


def test_the_paged_decode_override_is_read_from_its_variable(monkeypatch):
    from engine.attention_dispatch import PAGED_DECODE_ENV, paged_decode

    for value, expect in (("n16/w1/s4/head", LaunchConfig(16, 1, 4, head_major=True)), ("", None)):
        monkeypatch.setenv(PAGED_DECODE_ENV, value)
        paged_decode.cache_clear()
        assert paged_decode() == expect
    monkeypatch.setenv(PAGED_DECODE_ENV, "n16")
    paged_decode.cache_clear()
    with pytest.raises(ValueError, match="nBLOCK_N"):
        paged_decode()
    paged_decode.cache_clear()
