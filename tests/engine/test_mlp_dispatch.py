"""Where the decode step's MLP runs as one Gluon launch (engine/mlp_dispatch.py; no Triton needed): the rule, the
staged chunks' buffers and shared memory, the counters and the switch."""

from __future__ import annotations

import pytest
import torch

from engine.mlp_dispatch import (
    HOPPER_SMEM_PER_CTA,
    MLP_BLOCK_K,
    MLP_GROUP_CHUNKS,
    MLP_MAX_GROUPS,
    MLP_ROWS,
    chunk_split,
    mlp_fold_applies,
    mlp_fold_on,
    mlp_folds,
    mlp_smem,
    new_counters,
    parse_fold_mlp,
)


@pytest.mark.parametrize("inter", [256, 512, 1536, 2816, 5632, 8192, 16384])
def test_chunk_buffers_hold_every_chunk_in_two_powers_of_two(inter):
    a, b = chunk_split(inter)
    chunks = inter // MLP_BLOCK_K
    for n in (a, b):
        assert n >= 1 and n & (n - 1) == 0
    assert a <= chunks <= a + b  # every chunk has a slot
    assert a > chunks // 2  # the first buffer is the largest power of two within the chunks
    assert b < 2 * max(1, chunks - a)  # the second is the rest rounded up, no more


def test_ouro_1_4b_fits_one_cta_per_sm():
    # hidden 2048, intermediate 5632: the normed rows (32 KB), 24 chunks (96 KB), 8 ring slots (64 KB)
    assert chunk_split(5632) == (16, 8)
    assert mlp_smem(2048, 5632) == (8 * 2048 + 24 * 8 * 256 + 8 * 16 * 256) * 2 + 8 * (2 * 8 + 1 + 24)
    assert HOPPER_SMEM_PER_CTA // 2 < mlp_smem(2048, 5632) <= HOPPER_SMEM_PER_CTA  # one CTA per SM, no more
    assert all(mlp_fold_applies(rows, 2048, 5632) for rows in range(1, MLP_ROWS + 1))


@pytest.mark.parametrize("rows,hidden,inter,why", [
    (0, 2048, 5632, "no rows"),
    (MLP_ROWS + 1, 2048, 5632, "more rows than the MMA's N holds"),
    (8, 3072, 8192, "hidden not a power of two"),
    (8, 4096, 11008, "hidden past what the stager holds in registers"),
    (8, 128, 512, "hidden below one chunk"),
    (8, 2048, 5600, "intermediate not a whole number of chunks"),
    (8, 2048, (MLP_MAX_GROUPS * MLP_GROUP_CHUNKS + 1) * MLP_BLOCK_K, "more chunk groups than the model's counters"),
])
def test_refused(rows, hidden, inter, why):
    assert not mlp_fold_applies(rows, hidden, inter), why


def test_shared_memory_bounds_the_ring():
    assert mlp_fold_applies(8, 2048, 5632, stages=8)
    too_many = next(s for s in range(8, 64) if mlp_smem(2048, 5632, s) > HOPPER_SMEM_PER_CTA)
    assert not mlp_fold_applies(8, 2048, 5632, stages=too_many)
    assert mlp_fold_applies(8, 2048, 5632, stages=too_many - 1)


def test_counters():
    c = new_counters("cpu")
    assert c.dtype == torch.int32 and c.shape == (2 + MLP_MAX_GROUPS,) and not c.any()


def test_switch_values():
    assert parse_fold_mlp("") is False  # off by default
    assert parse_fold_mlp(" 0 ") is False and parse_fold_mlp("1") is True
    for bad in ("yes", "2", "on"):
        with pytest.raises(ValueError, match="OUROBATCH_DECODE_FOLD_MLP must be 0 .off. or 1 .on., got"):
            parse_fold_mlp(bad)


def test_no_launch_off_a_gpu(monkeypatch):
    # a CPU engine never asks for the switch (its env is not even read) and never folds, whatever it says
    monkeypatch.setenv("OUROBATCH_DECODE_FOLD_MLP", "1")
    h = torch.zeros(8, 2048, dtype=torch.bfloat16)
    assert not mlp_fold_on(h.device)
    assert not mlp_folds(h, torch.zeros(2 * 5632, 2048, dtype=torch.bfloat16), torch.zeros(2048, 5632,
                                                                                          dtype=torch.bfloat16))

