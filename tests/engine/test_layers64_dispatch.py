"""engine/layers64_dispatch.py's rules (when a decode loop pass of 9..64 requests runs gluon_layers64.py's launches)
and layer_stack.layers64_run's refusals where the launches cannot run (no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import layers64_dispatch as d64
from engine.attention_dispatch import HOPPER_SMEM_PER_CTA
from engine.layer_stack import layers64_run


def test_ouro_1_4b_tiles_on_132_sms_in_4_and_11_splits():
    assert d64.splits(2048, 5632) == (4, 11)
    assert d64.shape_fits(2048, 5632, 16, 16, 128, 132)
    assert d64.smem_bytes() <= HOPPER_SMEM_PER_CTA


@pytest.mark.parametrize("shape,why", [
    ((2048, 5632, 16, 8, 128, 132), "grouped-query heads"),
    ((2048, 5632, 32, 32, 64, 132), "head_dim 64: RoPE pairs two 64-column tiles"),
    ((2048, 5632, 16, 16, 128, 130), "130 SMs: not a multiple of 4 and 11 splits"),
    ((2048, 5000, 16, 16, 128, 132), "intermediate not a multiple of 512"),
    ((1536, 4096, 12, 12, 128, 132), "132 SMs not a multiple of 8 down splits"),
])
def test_shapes_it_cannot_tile(shape, why):
    assert not d64.shape_fits(*shape), why


def test_the_calls_it_serves_are_decode_rows_of_9_to_64_requests():
    assert d64.call_fits(9, 1, False, False) and d64.call_fits(64, 1, False, False)
    for rows, max_rows, prefill, tiles in [(8, 1, False, False), (65, 1, False, False), (40, 4, False, False),
                                           (40, 1, True, False), (40, 1, False, True)]:
        assert not d64.call_fits(rows, max_rows, prefill, tiles), (rows, max_rows, prefill, tiles)


def test_the_switch_is_off_by_default_and_names_its_values(monkeypatch):
    monkeypatch.delenv(d64.ENV, raising=False)
    assert not d64.switch_on()
    monkeypatch.setenv(d64.ENV, "1")
    assert d64.switch_on()
    with pytest.raises(ValueError, match="OUROBATCH_DECODE_LAYERS64 must be 1 .* or 0"):
        d64.parse_switch("yes")


def test_no_stack_or_the_switch_off_keeps_the_call_on_the_kernels(monkeypatch):
    h = torch.zeros(40, 2048, dtype=torch.bfloat16)
    meta = SimpleNamespace(max_rows=1, prefill=False, tiles=None, context_lens=torch.ones(40, dtype=torch.int32))
    pool = SimpleNamespace(k=torch.zeros(1), block_size=16)
    monkeypatch.setenv(d64.ENV, "1")
    assert not layers64_run(None, h, meta, pool)
    monkeypatch.setenv(d64.ENV, "0")
    assert not layers64_run(SimpleNamespace(wq=torch.zeros(1, dtype=torch.bfloat16)), h, meta, pool)
