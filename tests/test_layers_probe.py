"""benchmarks/layers_probe.py's reading of the measuring build's stamps (trace_table), on hand-made traces whose
phase spans are known: each phase's span runs from the grid's end of the phase before (its slowest CTA) to the
grid's end of this one, and the spans add up to the layer."""

from __future__ import annotations

import random

import torch

from tests.benchmark_scripts import load_benchmark

lp = load_benchmark("layers_probe")


def hand_made(ctas: int, layers: int, phases_ns: list[int], slow_cta: int, slow_ns: int, seed: int = 0):
    """Stamps where each layer's five phases take phases_ns on the critical path: every CTA ends each phase at the
    grid's end but `slow_cta`, which ends it slow_ns later (so the grid's end is that CTA's); stager stamps a
    little after the grid end they wait for."""
    rng = random.Random(seed)
    t = torch.zeros(ctas, layers, 16, dtype=torch.int64)
    now = 1_000_000
    ends = [lp.QKV_DONE, lp.ATTENDED, lp.O_DONE, lp.GU_DONE, lp.DOWN_DONE]
    seen = {lp.QKV_DONE: lp.QKV_SEEN, lp.ATTENDED: lp.ATTN_SEEN, lp.O_DONE: lp.O_SEEN, lp.GU_DONE: lp.GU_SEEN}
    for layer in range(layers):
        t[:, layer, lp.DOWN_SEEN] = now + 100
        t[:, layer, lp.SAND_A] = now + 600
        for event, ns in zip(ends, phases_ns):
            now += ns
            t[:, layer, event] = now - slow_ns + torch.tensor([rng.randrange(0, slow_ns) for _ in range(ctas)])
            t[slow_cta, layer, event] = now
            if event in seen:
                t[:, layer, seen[event]] = now + 200
        t[:, layer, lp.ATTN_STAGED] = t[:, layer, lp.ATTN_SEEN] + 300
        t[:, layer, lp.SAND_B] = t[:, layer, lp.O_SEEN] + 700
        t[:, layer, lp.ACT_STAGED] = t[:, layer, lp.GU_SEEN] + 400
    t[:, -1, lp.READOUT] = now + 900
    return t


def test_phase_spans_on_a_hand_made_trace():
    phases = [3_000, 11_000, 2_500, 12_000, 6_000]
    table = lp.trace_table(hand_made(8, 4, phases, slow_cta=5, slow_ns=700))
    names = ["qkv (sandwich, qkv GEMM)", "attention", "o (stage, o GEMM)", "gate_up (sandwich, GEMM)",
             "down (stage, GEMM)"]
    for name, ns in zip(names, phases):
        assert abs(table[name] - ns / 1e3) < 1e-9, (name, table[name])
    assert abs(table["layer (down to down)"] - sum(phases) / 1e3) < 1e-9
    assert abs(table["  down count seen"] - 0.1) < 1e-9 and abs(table["  sandwich A"] - 0.5) < 1e-9
    assert abs(table["  o count seen"] - 0.2) < 1e-9 and abs(table["  sandwich B"] - 0.7) < 1e-9
    assert abs(table["  attention rows staged"] - 0.3) < 1e-9 and abs(table["  act rows staged"] - 0.4) < 1e-9
    assert abs(table["launch (first stamp to last readout)"] - (4 * sum(phases) + 900 - 100) / 1e3) < 1e-9


def test_the_stamps_inside_read_from_the_event_before():
    t = hand_made(6, 3, [3_000, 11_000, 2_500, 12_000, 6_000], slow_cta=2, slow_ns=300)
    t = torch.cat([t, torch.zeros(6, 3, 16, dtype=torch.int64)], dim=2)
    for k in range(4):
        t[:, :, lp.SAND_A_SUB + k] = t[:, :, lp.DOWN_SEEN] + 100 * (k + 1)
        t[:, :, lp.SAND_B_SUB + k] = t[:, :, lp.O_SEEN] + 50 * (k + 1)
    t[:, :, lp.ATTEND_SUB] = t[:, :, lp.QKV_SEEN] + 1_000
    t[:, :, lp.ATTEND_SUB + 1] = t[:, :, lp.ATTEND_SUB] + 7_000
    table = lp.trace_table(t)
    assert abs(table["    sandwich A: chunk 0 out"] - 0.3) < 1e-9
    assert abs(table["    sandwich B: every chunk out"] - 0.2) < 1e-9
    assert (abs(table["    attend: RoPE, new key / value"] - 1.0) < 1e-9
            and abs(table["    attend: the pages"] - 7.0) < 1e-9)


def test_spans_add_up_to_the_layer_on_random_traces():
    rng = random.Random(3)
    for seed in range(20):
        phases = [rng.randrange(1_000, 20_000) for _ in range(5)]
        table = lp.trace_table(hand_made(rng.randrange(2, 20), rng.randrange(2, 6), phases, 1, 500, seed))
        spans = [v for k, v in table.items() if not k.startswith((" ", "layer", "launch"))]
        assert abs(sum(spans) - table["layer (down to down)"]) < 1e-6
