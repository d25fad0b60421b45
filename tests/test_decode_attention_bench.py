"""benchmarks/decode_attention.py on the CPU: its float64 reference against the engine's paged reference (an
independent gather through engine/kv_cache.py's slot rule), its candidate list (every ring with the dispatch's
split count marked, the persistent rings once) and its table (the best Gluon entry among the correct ones).
Its timings need the H200 and are never asserted."""

from __future__ import annotations

import pytest
import torch

from engine.attention import SeqSpan, paged_attention
from engine.attention_dispatch import decode_config
from engine.kv_cache import KVPool
from tests.benchmark_scripts import load_benchmark

bench = load_benchmark("decode_attention")


@pytest.mark.parametrize("n,ctx", [(1, 17), (3, 40), (2, 64)])
def test_the_reference_matches_the_engines_paged_reference(n, ctx):
    p = bench.Problem(n, ctx, "cpu", torch.float32, copies=2, seed=n + ctx)
    q, _ = p.inputs(1, seed=ctx)
    pool = KVPool.__new__(KVPool)
    pool.k, pool.v, pool.block_size = p.k.double()[None, None], p.v.double()[None, None], bench.PAGE
    pages = -(-ctx // bench.PAGE)
    spans = [SeqSpan(r, 1, ctx, tuple(p.tables[0][r, :pages].tolist())) for r in range(n)]
    ref = paged_attention(q.double(), pool, 1, 0, spans, bench.HEAD_DIM**-0.5)
    assert torch.allclose(bench.reference(p, q), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n", [1, 4, 8, 64])
def test_candidates_mark_the_dispatchs_split_count_and_try_each_persistent_ring_once(n):
    cands = bench.candidates(n, 132)
    assert cands[0] == ("triton table", None)
    labels = [label for label, _ in cands]
    assert len(labels) == len(set(labels))
    auto = (decode_config(n, 16, 132) or bench.DecodeConfig()).splits
    marked = [c for label, c in cands if label.endswith("(auto)")]
    assert len(marked) == len(bench.GLUON_BASES) and all(c.splits == auto for c in marked)
    persistent = [c for _, c in cands if c is not None and c.ctas_per_sm]
    assert persistent == list(bench.PERSISTENT)


def test_the_table_names_the_fastest_correct_gluon_entry():
    result = {"n": 8, "ctx": 640, "floor_us": 9.75, "candidates": {
        "triton table": {"us": 15.5, "tbps": 2.7, "rel_err": 2e-3, "ok": True},
        "gluon n32/s6/k1 (auto)": {"us": 12.2, "tbps": 3.4, "rel_err": 2e-3, "ok": True},
        "gluon n64/s3/k1 (auto)": {"us": 11.0, "tbps": 3.8, "rel_err": 0.5, "ok": False},  # wrong: not picked
        "gluon n16/s12/k1 (auto)": {"error": "OutOfResources", "ok": False}}}
    row = bench.markdown([result]).splitlines()[-1].split(" | ")
    assert row[4] == "gluon n32/s6/k1 (auto)" and row[5] == "12.2" and row[3] == "15.5"
    assert float(row[-1].rstrip(" |")) == 0.5  # the worst error among the entries that ran


def test_the_triton_grid_tries_every_launch_in_both_orders_and_can_leave_gluon_out():
    cands = bench.candidates(64, 132, triton_grid=True, gluon=False)
    assert cands[0] == ("triton table", None)
    launches = [c for _, c in cands[1:]]
    assert launches == list(bench.TRITON_GRID) and all(isinstance(c, bench.LaunchConfig) for c in launches)
    assert {c.head_major for c in launches} == {False, True}
    assert sum(c.head_major for c in launches) * 2 == len(launches)  # each launch in both orders
    assert [label for label, _ in cands[1:]] == [f"triton {bench.launch_label(c)}" for c in launches]
    with_gluon = bench.candidates(64, 132, triton_grid=True)
    assert with_gluon[: len(cands)] == cands and len(with_gluon) > len(cands)


def _shape(n, us: dict[str, float | None]) -> dict:
    return {"n": n, "ctx": 640, "floor_us": 78.0, "candidates": {
        label: ({"us": t, "tbps": 1.0, "rel_err": 1e-3, "ok": True} if t else {"error": "OutOfResources", "ok": False})
        for label, t in us.items()}}


def test_triton_best_ranks_by_geomean_over_shapes_and_keeps_only_launches_that_beat_the_table():
    results = [_shape(64, {"triton table": 81.0, "triton n16/w2/s3/k1": 76.0, "triton n16/w2/s3/k1/head": 79.0,
                           "triton n32/w2/s2/k1": 81.5, "triton n64/w4/s2/k1": 70.0}),
               _shape(64, {"triton table": 80.0, "triton n16/w2/s3/k1": 77.0, "triton n16/w2/s3/k1/head": 75.0,
                           "triton n32/w2/s2/k1": 80.5, "triton n64/w4/s2/k1": None})]  # failed once: never picked
    # geomeans: n16/w2/s3 76.5, /head 77.0, n32 81.0 (not under the table's 80.5)
    assert bench.triton_best(results, 5) == ["n16/w2/s3/k1", "n16/w2/s3/k1/head"]
    assert bench.triton_best(results, 1) == ["n16/w2/s3/k1"]
    table = bench.triton_markdown(results, {"read_sum_tbps": 4.5, "read_amax_tbps": 4.4, "copy_tbps": 4.1,
                                            "bytes": 2 << 30}).splitlines()
    assert table[0].startswith("Device bandwidth: read 4.50 TB/s")
    first = table[4].split(" | ")
    assert first[3:6] == ["81.0", "n64/w4/s2/k1", "70.0"] and first[7:9] == ["n16/w2/s3/k1/head", "79.0 |"]
    assert table[-1].endswith("n16/w2/s3/k1, n16/w2/s3/k1/head")
