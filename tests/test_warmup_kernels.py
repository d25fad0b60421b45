"""The startup warm-up's kernel enumeration on CPU (engine/kernel_cases.py, engine/kernel_warmup.py).

The enumeration is Triton-free and checked against a brute force over every call the engine's limits allow:
one launch per specialization of the paged attention (decode override and graphed prefill included), the
decode kernel's, o_proj's and the MLP's folds, the loop pass and the skinny GEMMs; the forked compiles'
stages and order, and the report's timeline. Every launch also runs in Triton's interpreter. The request
pass and the compile-cache folders: tests/test_warmup.py; launching on the GPU: tests/gpu/test_gpu_warmup.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import kernel_cases, kernel_warmup
from engine.attention_dispatch import LaunchConfig
from engine.cuda_graphs import BUCKETS
from engine.prefill_graph import prefill_buckets
from engine.gemm_dispatch import GemmConfig

from .interpreter import run_interpreted


# ------------------------------------------------------------------------------------------ kernel enumeration

def shapes(kv_heads=16, mode="deferred", B=1, N=64, budget=8192, L=4096, graphs=True, dtype=torch.bfloat16):
    buckets = tuple([b for b in BUCKETS if b < N] + [N]) if graphs else None
    return kernel_cases.KernelShapes(16, kv_heads, 128, 2048, 5632, 49152, 1e-6, dtype, dtype, 16, L // 16, N,
                                      budget, L, mode, B, 132, buckets, True)


def reachable(s: kernel_cases.KernelShapes):
    """(requests, longest rows, total rows) of every paged-kernel call the engine can make, written out
    from the call sites: graphed decode calls at each bucket (1 row; deferred deep: up to B rows), prefill
    chunks after a history (<= 64 rows each, <= the token budget in all), verify's deep call (<= B + 1)."""
    B = s.deep_interval
    decode = [1] + (list(range(1, B + 1)) if s.mode == "deferred" and B > 1 else [])
    for R in decode:
        for n in s.buckets if s.buckets is not None else range(1, s.max_num_seqs + 1):
            yield n, R, n * R
    longest = min(64, s.max_num_batched_tokens, s.max_model_len - s.block_size)
    deep = B + 1 if s.mode == "verify" else B if s.mode == "deferred" and B > 1 else 0
    for n_max, r_max, cap in ((min(s.max_num_seqs, s.max_num_batched_tokens), longest, s.max_num_batched_tokens),
                              (s.max_num_seqs, deep, 10**9)):
        for n in range(1, n_max + 1):
            for r in range(1, r_max + 1):
                for total in range(r + n - 1, min(n * r, cap, r + n + 40) + 1):
                    yield n, r, total


@pytest.mark.parametrize("kw", [dict(), dict(mode="deferred", B=8), dict(mode="verify", B=4),
                                dict(kv_heads=2, mode="verify", B=3, N=40), dict(kv_heads=4, N=24, graphs=False),
                                dict(N=32, budget=48, L=256, dtype=torch.float32)])
def test_one_launch_per_specialization_covers_every_reachable_call(kw):
    s = shapes(**kw)
    keys = {kernel_cases.attention_key(s, *call) for call in reachable(s)}
    cases = kernel_cases.attention_cases(s)
    assert {kernel_cases.attention_key(s, c.seqs, c.max_rows, c.rows) for c in cases} == keys
    assert len(cases) == len(keys)  # one launch each
    for c in cases:  # a launchable split of the rows: the first request has max_rows, none has more
        counts = kernel_cases._row_counts(c)
        assert len(counts) == c.seqs and sum(counts) == c.rows and max(counts) == c.max_rows and min(counts) >= 1


@pytest.mark.parametrize("kw", [dict(), dict(mode="deferred", B=8), dict(kv_heads=4, N=24, graphs=False)])
def test_the_paged_decode_override_is_what_the_warm_up_compiles(kw, monkeypatch):
    """OUROBATCH_PAGED_DECODE's launch (a measuring knob) replaces the table's for one-row calls only: the warm-up's
    cases still cover every reachable call once, and its one-row calls compile the override, order included."""
    from engine.attention_dispatch import paged_decode

    monkeypatch.setenv("OUROBATCH_PAGED_DECODE", "n16/w2/s3/head")
    paged_decode.cache_clear()
    try:
        s = shapes(**kw)
        keys = {kernel_cases.attention_key(s, *call) for call in reachable(s)}
        cases = kernel_cases.attention_cases(s)
        assert {kernel_cases.attention_key(s, c.seqs, c.max_rows, c.rows) for c in cases} == keys
        assert len(cases) == len(keys)
        for c in cases:
            config = kernel_cases.case_config(s, c)
            assert (config == LaunchConfig(16, 2, 3, 1, head_major=True)) == (c.max_rows == 1)
            assert kernel_cases.attention_key(s, c.seqs, c.max_rows, c.rows)[0][7] == (c.max_rows == 1)  # the order
    finally:
        paged_decode.cache_clear()


def test_no_paged_kernel_without_the_triton_backend():
    s = shapes()
    assert kernel_cases.attention_cases(kernel_cases.KernelShapes(**{**s.__dict__, "triton_attention": False})) == []


@pytest.mark.parametrize("kv_heads,N,budget,dtype", [(16, 64, 8192, torch.bfloat16), (2, 256, 512, torch.bfloat16),
                                                      (4, 8, 2048, torch.float32), (16, 300, 100, torch.bfloat16)])
def test_one_tiled_launch_per_specialization_of_the_graphed_prefill(kv_heads, N, budget, dtype):
    """Every bucket's tiled call (the forward of engine/prefill_graph.py: the bucket's rows, its layout's
    chunks + 1 sequences and tile map) maps to one launched case, and no two cases share a specialization."""
    from engine.prefill_graph import layouts_for

    s = kernel_cases.KernelShapes(**{**shapes(kv_heads=kv_heads, N=N, budget=budget, dtype=dtype).__dict__,
                                      "prefill_buckets": tuple(prefill_buckets(budget))})
    mc = type("Cfg", (), dict(num_attention_heads=16, num_key_value_heads=kv_heads, head_dim=128))
    keys = {kernel_cases.attention_key(s, layout.chunks + 1, layout.tokens, layout.tokens, layout.tiles)
            for layout in layouts_for(budget, N, mc, dtype)}
    cases = kernel_cases.prefill_cases(s)
    assert {kernel_cases.attention_key(s, c.seqs, c.max_rows, c.rows, c.tiles) for c in cases} == keys
    assert len(cases) == len(keys)
    assert all(c.tiles > 0 and c.rows == c.max_rows for c in cases)
    untiled = kernel_cases.attention_cases(kernel_cases.KernelShapes(**{**s.__dict__, "prefill_buckets": ()}))
    assert kernel_cases.attention_cases(s) == untiled + cases


def test_graphed_shapes_list_the_decode_and_prefill_buckets():
    """With graphs, the shapes name the buckets both graphed calls are captured at; without, none."""
    from engine.config import OuroConfig
    from engine.cuda_graphs import batch_buckets

    mc = OuroConfig.from_dict(dict(model_type="ouro", vocab_size=67, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    common = dict(block_size=16, table_width=8, max_num_seqs=40, max_num_batched_tokens=600, max_model_len=128,
                  mode="deferred", deep_interval=4, num_sms=132)
    on = kernel_cases.kernel_shapes(mc, torch.bfloat16, None, attention="triton", cuda_graphs=True, **common)
    assert on.buckets == (1, 2, 4, 8, 16, 24, 32, 40) == tuple(batch_buckets(40)) and on.triton_attention
    assert on.prefill_buckets == (16, 32, 64, 128, 256, 384, 512, 600)
    off = kernel_cases.kernel_shapes(mc, torch.bfloat16, torch.float32, attention="torch", cuda_graphs=False, **common)
    assert off.buckets is None and off.prefill_buckets == () and off.logits_dtype == torch.float32


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sets(st.sampled_from("abc")), st.sets(st.integers(0, 5))), min_size=1, max_size=12))
def test_staged_launches_never_compile_one_specialization_twice_at_once(spec):
    """kernel_warmup.staged: the first launch alone; the first launch of every specialization and of every
    kernel in an earlier stage than its other launches (two launches of one stage may share one only once
    it is compiled); every launch once, in order."""
    tasks = [kernel_warmup.Task(f"t{i}", i, frozenset(kernels), tuple(keys)) for i, (kernels, keys) in enumerate(spec)]
    stages = kernel_warmup.staged(tasks)
    where = {t.launch: n for n, stage in enumerate(stages) for t in stage}
    assert sorted(where) == list(range(len(tasks))) and len(stages[0]) == 1 and stages[0][0].launch == 0
    assert all(stage for stage in stages) and all(where[i] >= 1 for i in range(1, len(tasks)))
    for i, task in enumerate(tasks):
        for k in (*task.kernels, *task.keys):
            first = min(j for j, t in enumerate(tasks) if k in t.kernels or k in t.keys)
            assert first == i or where[first] < where[i]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sets(st.sampled_from(["gluon_layers", "gluon_mlp", "gluon_o", "paged", "gemm"])), max_size=12))
def test_forked_compiles_start_with_the_slowest_kernels(spec):
    """kernel_warmup.longest_first: every launch once; one using a slower kernel of SLOWEST before any that uses
    only faster ones; launches of one rank in the list's order."""
    tasks = [kernel_warmup.Task(f"t{i}", i, frozenset(kernels), ()) for i, kernels in enumerate(spec)]
    order = kernel_warmup.longest_first(tasks)
    slow = kernel_warmup.SLOWEST
    rank = [min([slow.index(k) for k in t.kernels if k in slow] + [len(slow)]) for t in order]
    assert sorted(t.launch for t in order) == list(range(len(tasks)))
    assert rank == sorted(rank)
    assert all(a.launch < b.launch for a, b, ra, rb in zip(order, order[1:], rank, rank[1:]) if ra == rb)


def test_one_gemm_launch_per_config_and_tile():
    # the skinny GEMMs' row counts are not specialized (engine/triton_gemm.py): one launch per (config, tile height)
    table = ((8, GemmConfig(splits_o=2)), (48, GemmConfig(block_n=128)))
    rows = kernel_cases.gemm_rows(shapes(), table)
    tiles = {(r <= 8, min(64, max(16, 1 << (r - 1).bit_length()))) for r in range(1, 49)}
    assert len(rows) == len(tiles) == 4 and rows == [1, 9, 17, 33]  # the first row count of each
    found = {k for r in rows for k in kernel_cases.gemm_keys(r, table)}
    assert {k for r in range(1, 49) for k in kernel_cases.gemm_keys(r, table)} == found  # every row count's keys
    # partials per config and tile (the two configs' block_n differ), gate_up per tile (the same block_n_gate),
    # the norm per split count: rows 1-8 split o_proj 2 ways and down_proj 4, rows 9-48 both 4
    assert sum(k[0] == "partials" for k in found) == len(tiles)
    assert sum(k[0] == "gate_up" for k in found) == len({bm for _, bm in tiles})
    assert {k for k in found if k[0] == "norm_partials"} == {("norm_partials", 2), ("norm_partials", 4)}
    assert kernel_cases.gemm_keys(49, table) == set()  # past the table: cuBLAS, nothing to compile
    assert kernel_cases.gemm_rows(shapes(dtype=torch.float32), table) == []  # fp32 keeps cuBLAS


def test_gate_ups_own_k_step_and_tma_are_their_own_specializations():
    base = GemmConfig(block_n=32)
    for other in (dataclasses.replace(base, block_k_gate=64), dataclasses.replace(base, tma=2),
                  dataclasses.replace(base, stages_gate=3)):
        a, b = (kernel_cases.gemm_keys(8, ((16, cfg),)) for cfg in (base, other))
        gate_a, gate_b = ({k for k in keys if k[0] == "gate_up"} for keys in (a, b))
        assert gate_a != gate_b  # a second compile of gate_up, which the warm-up must launch too
        if other.tma == base.tma:  # block_k_gate and stages_gate leave the partials' specialization alone
            assert {k for k in a if k[0] == "partials"} == {k for k in b if k[0] == "partials"}
    assert {k for k in kernel_cases.gemm_keys(8, ((16, dataclasses.replace(base, stages_gate=4)),))} == \
        kernel_cases.gemm_keys(8, ((16, base),)), "stages_gate equal to num_stages is the same compile"


INTERPRETED = """
import dataclasses
import torch
from engine import gemm_dispatch, kernel_cases as kc, kernel_warmup as kw
# the table with qkv + RoPE + store in every bucket (the shipped one skips 17-32 rows), so every kernel
# variant launches here
gemm_dispatch.GEMM_TABLE = tuple((r, dataclasses.replace(c, block_d_qkv=16)) for r, c in gemm_dispatch.GEMM_TABLE)
for dtype in (torch.float32, torch.bfloat16):
    s = kc.KernelShapes(4, 2, 32, 64, 128, 67, 1e-6, dtype, torch.float32, 8, 8, 4, 24, 64, "verify", 2, 132,
                        (1, 2, 4), True, (16, 24))
    assert kc.prefill_cases(s)  # the graphed prefill's tiled launches too
    report = kw.warm_kernels(s, torch.device("cpu"), threads=1)  # the interpreter is not thread-safe
    assert not report.failures, report.failures
    tasks = kw.task_list(s, torch.device("cpu"))
    keys = {k for t in tasks for k in t.keys}
    firsts = [t.keys[0] for t in tasks]  # each launch exists for a specialization no earlier one compiles
    assert len(set(firsts)) == len(firsts)
    cases = kc.attention_cases(s)
    assert {("paged",) + kc.attention_key(s, c.seqs, c.max_rows, c.rows, c.tiles)[0] for c in cases} <= keys
    assert report.cases["attention"] == sum(t.name == "attention" for t in tasks) and report.cases["fused"] == 4
    gemm = {k for r in kc.gemm_rows(s) for k in kc.gemm_keys(r, head_dim=s.head_dim)}
    assert report.cases.get("gemm", 0) == len(gemm) and any(k[0] == "qkv" for k in gemm) == (dtype != torch.float32)
print("ok")
"""


def test_every_launch_runs_in_tritons_interpreter():
    """The launches' shapes and arguments, on CPU tensors (TRITON_INTERPRET=1), where Triton is installed."""
    run_interpreted(INTERPRETED)


@pytest.mark.parametrize("kw", [dict(), dict(N=8), dict(kv_heads=4, N=24, graphs=False), dict(mode="deferred", B=8)])
def test_one_decode_kernel_launch_per_specialization_of_the_calls_sent_there(kw):
    """kernel_cases.decode_keys: every one-row-per-request call (graphed buckets or every eager count, and
    one-row chunks after a history) that the device's rule sends to the Gluon kernel maps to one key, each
    key's request count reaches it, and a GQA model sends none there."""
    from engine.attention_dispatch import decode_config

    s = shapes(**kw)

    def config_of(seqs):
        return decode_config(seqs, s.num_kv_heads, s.num_sms)

    def key(seqs):
        c = config_of(seqs)
        split = c.splits > 1
        extra = (kernel_cases.int_class(seqs * s.num_heads * s.head_dim), kernel_cases.int_class(seqs * s.num_heads))
        return ("gluon", c.block_n, c.stages, c.ctas_per_sm > 0, split) + (extra if split else ())

    reach = {n for n, r, total in reachable(s) if r == 1 and total == n and config_of(n) is not None}
    found = kernel_cases.decode_keys(s, config_of)
    if s.group != 1:
        assert found == {}
        return
    assert set(found) == {key(n) for n in reach} and found
    assert all(key(n) == k and n in reach for k, n in found.items())
    assert kernel_cases.decode_keys(s, lambda n: None) == {}


@pytest.mark.parametrize("kw", [dict(), dict(N=8), dict(graphs=False, N=12)])
def test_decode_calls_that_fold_o_proj_get_their_own_key(kw):
    """decode_keys with fold_of: a request count whose calls fold o_proj (attention_dispatch.o_fold_applies at
    Ouro-1.4B's shapes on 132 SMs: 8 requests, one CTA per (request, head), 128 output tiles) adds the folded
    kernel's key, and keeps the plain kernel's (one-row prompt chunks of that count do not fold)."""
    from engine.attention_dispatch import decode_config, o_fold_applies

    s = shapes(**kw)

    def config_of(seqs):
        return decode_config(seqs, s.num_kv_heads, s.num_sms)

    def fold_of(seqs, c):
        return o_fold_applies(c, seqs, seqs, s.num_heads, s.head_dim, s.hidden_size, s.num_sms)

    plain = kernel_cases.decode_keys(s, config_of)
    found = kernel_cases.decode_keys(s, config_of, fold_of)
    folded = {k: n for k, n in found.items() if k[0] == "gluon_o"}
    assert {k: n for k, n in found.items() if k[0] != "gluon_o"} == plain
    assert folded == {("gluon_o", 32, 6, ""): 8}
    assert kernel_cases.decode_keys(s, config_of, lambda n, c: False) == plain


@pytest.mark.parametrize("kw", [dict(), dict(N=8), dict(graphs=False, N=12)])
def test_calls_that_run_the_mlp_launch_get_its_keys(kw):
    """mlp_keys: every row class (1, or 2-8) of the calls the rule sends to the MLP launch, each with o_proj's
    partials in one split (from the decode kernel that folds o_proj) and in the GEMM table's split count; none
    where it is off."""
    from engine.gemm_dispatch import gemm_config
    from engine.mlp_dispatch import MLP_ROWS, mlp_fold_applies

    s = shapes(**kw)
    found = kernel_cases.mlp_keys(s, lambda rows: mlp_fold_applies(rows, s.hidden_size, s.intermediate_size))
    rows = [r for r in range(1, MLP_ROWS + 1) if gemm_config(r) is not None]
    assert rows
    want = {("gluon_mlp", kernel_cases.int_class(r), kernel_cases.int_class(n)) for r in rows
            for n in (1, gemm_config(r).splits_o)}
    assert set(found) == want
    for key, (r, n) in found.items():  # each key's call compiles that key
        assert key == ("gluon_mlp", kernel_cases.int_class(r), kernel_cases.int_class(n)) and 1 <= r <= MLP_ROWS
    assert kernel_cases.mlp_keys(s, lambda rows: False) == {}


def test_layers_keys_cover_the_layer_count_class_once_for_every_row_count():
    # the loop-pass launch (engine/gluon_layers.py) does not specialize its rows (do_not_specialize M): one
    # compile serves 1-8 requests; Triton keys its layer count by int class
    # (tests/engine/test_gluon_layers_compile.py checks the kernel's do_not_specialize)
    s = kernel_cases.KernelShapes(**{**shapes(N=64).__dict__, "num_layers": 24})
    found = kernel_cases.layers_keys(s, True)
    assert found == {("gluon_layers", ""): (1, 2)}
    for rows, layers in found.values():  # the warm-up's call has the engine's classes
        assert kernel_cases.int_class(layers) == kernel_cases.int_class(24) and rows <= 8
    deep = kernel_cases.KernelShapes(**{**s.__dict__, "num_layers": 48, "max_num_seqs": 1})
    assert kernel_cases.layers_keys(deep, True) == {("gluon_layers", "16"): (1, 16)}
    assert kernel_cases.layers_keys(s, False) == {}
    assert kernel_cases.layers_keys(kernel_cases.KernelShapes(**{**s.__dict__, "num_layers": 0}), True) == {}


def test_the_warm_up_reports_each_launchs_times_in_order_of_their_end(monkeypatch):
    import threading
    import time

    from engine import kernel_warmup as kw
    from engine.warmup_order import Task

    ended = {i: threading.Event() for i in range(4)}

    def task(i: int, seconds: float, fails: bool = False, after: tuple[int, ...] = ()) -> Task:
        def launch() -> None:
            try:
                for j in after:  # ends last by construction (gates, not a race of sleeps)
                    assert ended[j].wait(60), f"k{j} never ended"
                time.sleep(seconds)
                if fails:
                    raise RuntimeError("no such kernel")
            finally:
                ended[i].set()
        return Task("gemm", launch, frozenset({f"k{i}"}), ((f"k{i}", i),))

    tasks = [task(0, 0.05), task(1, 0.3, after=(0, 2, 3)), task(2, 0.01, fails=True), task(3, 0.1)]
    monkeypatch.setattr(kw, "task_list", lambda s, device: tasks)
    report = kw.warm_kernels(None, torch.device("cpu"), threads=4)
    line = report.timeline  # one entry per launch, by end, queued <= given its slot <= ended, within the pass
    assert [e["key"] for e in line][-1] == "('k1', 1)" and len(report.failures) == 1
    assert sorted(e["key"] for e in line) == sorted(str(t.keys[0]) for t in tasks)
    # (the entries' times are rounded to the millisecond: the last end may round up past the pass's seconds)
    assert [e["end"] for e in line] == sorted(e["end"] for e in line) and line[-1]["end"] <= report.seconds + 5e-4
    assert all(0 <= e["queued"] <= e["slot"] <= e["end"] and e["children"] == [] for e in line)
    slow = next(e for e in line if e["key"] == "('k1', 1)")
    assert slow["end"] - slow["slot"] >= 0.3  # its launch's time
