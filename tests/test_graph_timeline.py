"""benchmarks/graph_timeline.py's reading of a kernel timeline: advances and idle stretches add up to the span,
and a kernel that runs inside another's time adds nothing (checked on hand-made timelines)."""

from __future__ import annotations

import random

import pytest

from tests.benchmark_scripts import load_benchmark

gt = load_benchmark("graph_timeline")


def test_advance_idle_and_early_on_a_hand_made_timeline():
    spans = [("a", 0.0, 10.0), ("b", 8.0, 15.0), ("c", 20.0, 22.0), ("d", 21.0, 21.5), ("a", 30.0, 31.0)]
    per, span = gt.timeline(list(reversed(spans)))  # any input order: read in start order
    assert span == 31.0
    assert per["a"] == dict(calls=2, dur=11.0, advance=11.0, idle=8.0, early=0.0)
    assert per["b"] == dict(calls=1, dur=7.0, advance=5.0, idle=0.0, early=2.0)
    assert per["c"] == dict(calls=1, dur=2.0, advance=2.0, idle=5.0, early=0.0)
    assert per["d"] == dict(calls=1, dur=0.5, advance=0.0, idle=0.0, early=1.0)


def test_advances_and_idles_sum_to_the_span_on_random_timelines():
    rng = random.Random(7)
    for _ in range(50):
        spans = []
        for i in range(rng.randrange(1, 40)):
            start = rng.uniform(0, 100)
            spans.append((f"k{i % 5}", start, start + rng.uniform(0, 10)))
        per, span = gt.timeline(spans)
        union = _union_length(spans)  # an independent reading: the covered time, by sweeping merged intervals
        assert sum(r["advance"] for r in per.values()) == pytest.approx(union)
        assert sum(r["advance"] + r["idle"] for r in per.values()) == pytest.approx(span)
        assert span == pytest.approx(max(e for _, _, e in spans) - min(s for _, s, _ in spans))


def _union_length(spans):
    total, cur_s, cur_e = 0.0, None, None
    for _, s, e in sorted(spans, key=lambda x: x[1]):
        if cur_e is None or s > cur_e:
            total += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s)


def test_table_is_per_call_and_per_step_sorted_by_advance():
    per, span = gt.timeline([("x", 0.0, 4.0), ("y", 4.0, 5.0), ("x", 5.0, 9.0), ("y", 9.0, 10.0)])
    rows = gt.table(per, steps=2)
    assert [r["name"] for r in rows] == ["x", "y"]
    assert rows[0]["calls_per_step"] == 1 and rows[0]["advance_us"] == 4.0 and rows[0]["advance_ms_per_step"] == 0.004
    text = gt.markdown("N=1 interval1", rows, span / 2 / 1e3)
    assert "| x | 1 | 4.00 | 4.00 | 0.00 | 0.00 | 0.004 |" in text and "0.005 ms per step" in text


def test_a_span_ending_before_it_starts_is_refused():
    with pytest.raises(ValueError, match="ends"):
        gt.timeline([("bad", 5.0, 4.0)])


def test_after_predecessor_splits_one_kernel_by_the_kernel_before_it():
    spans = [("attn", 0.0, 10.0), ("partials", 2.0, 14.0), ("norm", 14.5, 16.0), ("gate", 15.0, 30.0),
             ("partials", 25.0, 36.0), ("norm", 36.5, 38.0)]
    renamed = gt.after_predecessor(list(reversed(spans)))
    assert [n for n, _, _ in renamed] == ["attn < -", "partials < attn", "norm < partials", "gate < norm",
                                          "partials < gate", "norm < partials"]
    per, span = gt.timeline(renamed)
    assert span == 38.0 and per["partials < attn"]["advance"] == 4.0 and per["partials < gate"]["advance"] == 6.0
    assert per["norm < partials"]["calls"] == 2
    deeper = [n for n, _, _ in gt.after_predecessor(spans, 2)]
    assert deeper[0] == "attn < - < -" and deeper[2] == "norm < partials < attn"
    assert deeper[5] == "norm < partials < gate"
