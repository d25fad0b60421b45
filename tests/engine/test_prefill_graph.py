"""Graphed prefill's forward (engine/prefill_graph.py), run eagerly on the CPU in float64 with the torch
attention, against the dense float64 oracle: chunks from position 0 and chunks after a history written by
an earlier call, padded to a bucket, in every model shape; the padding rows write only the scratch block;
and whole engines whose prefills (and, at full depth, decode rows beside them: engine/phases.py _merged)
take that path. On CUDA the same forward is captured per bucket (tests/gpu/test_gpu_prefill_graph.py)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.batch import BlockTables
from ourobatch import EngineConfig, SamplingParams
from ourobatch.assembly import build_engine_core
from engine.kv_cache import KVPool
from engine.loader import load_model
from engine.prefill_graph import (MAX_GRAPH_CHUNKS, PREFILL_BUCKETS, PrefillLayout, forward,
                                  prefill_buckets)
from tests.oracle import load_oracle

from .conftest import SHAPES
from .test_generation_vs_oracle import check_against_oracle, run_staggered

BLOCK = 4


class Rig:
    """A float64 model, a pool and block tables; requests get disjoint shuffled blocks."""

    def __init__(self, ckpt, seed: int) -> None:
        self.model = load_model(ckpt, torch.float64, "cpu")
        self.model.fuse_projections()
        self.model.set_attention_backend("torch")
        cfg = self.model.config
        self.pool = KVPool.for_model(cfg, 64, BLOCK, torch.float64, "cpu")
        self.pool.k.fill_(7.0)  # a sentinel: blocks nobody owns must still hold it at the end
        self.pool.v.fill_(7.0)
        self.tables = BlockTables(8, 16, self.pool.scratch_block, torch.device("cpu"))
        self.free = list(range(64))
        random.Random(seed).shuffle(self.free)
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads
        self.rows: dict[str, int] = {}

    def blocks(self, rid: str, length: int) -> int:
        known = self.tables.block_ids_of.get(rid, ())
        need = -(-length // BLOCK) - len(known)
        row = self.tables.row(rid, known + tuple(self.free.pop() for _ in range(need)))
        self.tables.flush()
        return row

    def prefill(self, chunks: dict[str, tuple[int, list[int]]], bucket: int) -> torch.Tensor:
        """chunks: request id -> (first position, token ids); returns the bucket's loop-T readouts."""
        rows = [self.blocks(rid, start + len(ids)) for rid, (start, ids) in chunks.items()]
        cfg = self.model.config
        layout = PrefillLayout.for_bucket(bucket, 8, self.group, cfg.head_dim, fp32=False)
        values = layout.pack([ids for _, ids in chunks.values()], [s for s, _ in chunks.values()], rows,
                             self.tables.scratch_row)
        assert len(values) == layout.length
        with torch.inference_mode():
            return forward(self.model, self.pool, self.tables, layout, torch.tensor(values, dtype=torch.int64))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("seed", [0, 1])
def test_chunks_fresh_and_after_a_history_match_the_oracle(checkpoints, shape, seed):
    rnd = random.Random(f"{shape}{seed}")
    oracle = load_oracle(checkpoints[shape])
    rig = Rig(checkpoints[shape], seed)
    seqs = {f"r{i}": [rnd.randrange(oracle.vocab_size) for _ in range(rnd.randint(2, 13))] for i in range(4)}
    split = {rid: rnd.randint(1, len(s) - 1) for rid, s in seqs.items()}
    # call 1: the first part of r0..r2 from position 0; call 2: their rest (after a history) and r3 whole
    first = {rid: (0, s[:split[rid]]) for rid, s in seqs.items() if rid != "r3"}
    second = {rid: (split[rid], s[split[rid]:]) for rid, s in seqs.items() if rid != "r3"} | {"r3": (0, seqs["r3"])}
    readouts = {}
    for chunks in (first, second):
        total = sum(len(ids) for _, ids in chunks.values())
        bucket = next(b for b in (16, 32, 64) if b > total)  # always some padding rows
        h = rig.prefill(chunks, bucket)
        assert h.shape == (bucket, rig.model.config.hidden_size)
        row = 0
        for rid, (start, ids) in chunks.items():
            readouts.setdefault(rid, {}).update({start + i: h[row + i] for i in range(len(ids))})
            row += len(ids)
    for rid, s in seqs.items():
        ref = oracle.forward(s).hidden[-1]  # [S, H], loop T's normed readout, recomputed densely
        got = torch.stack([readouts[rid][p] for p in range(len(s))])
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)
    used = {b for ids in rig.tables.block_ids_of.values() for b in ids} | {rig.pool.scratch_block}
    untouched = [b for b in range(rig.pool.num_blocks) if b not in used]
    assert untouched and (rig.pool.k[:, :, untouched] == 7.0).all() and (rig.pool.v[:, :, untouched] == 7.0).all()


def test_layout_packs_every_field_and_pads_to_the_bucket():
    layout = PrefillLayout.for_bucket(32, 256, 2, 64, fp32=False)
    assert layout.chunks == min(MAX_GRAPH_CHUNKS, 32) and layout.block_m == 64
    values = layout.pack([[5, 6, 7], [9]], [4, 0], [3, 1], scratch_row=99)
    f, at = {}, 0
    for name, size in layout.sizes.items():
        f[name], at = values[at:at + size], at + size
    assert at == layout.length == len(values)
    assert f["ids"] == [5, 6, 7, 9] + [0] * 28
    assert f["positions"] == [4, 5, 6, 0] + [0] * 28
    assert f["chunk_of_row"] == [0, 0, 0, 1] + [layout.chunks] * 28
    assert f["table_rows"] == [3, 1] + [99] * (layout.chunks - 1)
    assert f["context_lens"] == [7, 1] + [0] * (layout.chunks - 1)
    assert f["query_start"] == [0, 3, 4] + [4] * (layout.chunks - 1)
    assert f["tiles"][:4] == [0, 0, 1, 0] and set(f["tiles"][4::2]) == {layout.chunks}


def test_layout_refuses_what_it_cannot_hold():
    layout = PrefillLayout.for_bucket(16, 3, 1, 64, fp32=False)  # 3 decode rows + 1 chunk
    assert layout.holds(16, 4) and not layout.holds(17, 1) and not layout.holds(5, 5)
    with pytest.raises(ValueError, match="5 chunks of 5 tokens do not fit a layout of 4 x 16"):
        layout.pack([[1]] * 5, [0] * 5, [0] * 5, scratch_row=9)


@pytest.mark.parametrize("budget,expect", [(16, [16]), (100, [16, 32, 64, 100]), (512, [b for b in PREFILL_BUCKETS
                                                                                          if b <= 512]),
                                           (8192, list(PREFILL_BUCKETS))])
def test_buckets_end_at_the_step_budget_or_the_graph_cap(budget, expect):
    assert prefill_buckets(budget) == expect


@pytest.mark.parametrize("k,decode,merged", [(64, 64, 128), (256, 64, 384), (512, 64, 768), (1024, 64, None),
                                             (1000, 24, 1024), (1536, 64, None), (1400, 64, 1536),
                                             (2000, 64, None), (8, 8, 16)])
def test_a_merged_call_adds_little_padding_over_the_prefill_alone(k, decode, merged):
    """k prompt tokens in one chunk beside `decode` decode rows: one call when its bucket is at most
    MAX_MERGE_PADDING rows above the chunk's own (the H200's 1,024 + 64 case padded to 1,536 ran slower
    than two calls), two calls otherwise, and two when no bucket holds both."""
    from engine.prefill_graph import MAX_MERGE_PADDING, layouts_for, merged_layout

    assert MAX_MERGE_PADDING == 256
    mc = type("Cfg", (), dict(num_attention_heads=16, num_key_value_heads=16, head_dim=128))
    layouts = layouts_for(2048, 256, mc, torch.bfloat16)
    got = merged_layout(layouts, k, 1, decode)
    assert (got.tokens if got is not None else None) == merged
    if got is not None:
        assert got.holds(k + decode, 1 + decode)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mode,B,budget", [("deferred", 1, 16), ("deferred", 1, 64), ("deferred", 4, 16),
                                           ("eager", 3, 32)])
def test_engine_with_fixed_shape_prefill_and_merged_steps_matches_the_oracle(checkpoints, shape, mode, B, budget):
    # the executor's graphed-prefill logic run eagerly (static_prefill): prompts chunked by a small budget,
    # staggered arrivals so steps prefill beside decode rows; at full depth those steps are one merged call
    # (counted), in deferred mode separate calls. Tokens, log-probs and every KV plane vs the oracle.
    ckpt = checkpoints[shape]
    oracle = load_oracle(ckpt)
    rnd = random.Random(f"{shape}{mode}{B}{budget}")
    prompts = [[rnd.randrange(oracle.vocab_size) for _ in range(rnd.randint(1, 40))] for _ in range(6)]
    params = [SamplingParams(max_tokens=rnd.randint(6, 16), temperature=rnd.choice([0.0, 0.9]), seed=i,
                             ignore_eos=True) for i in range(6)]
    core = build_engine_core(EngineConfig(model=str(ckpt), dtype="float64", mode=mode, deep_interval=B,
                                          shallow_loops=2, block_size=4, num_kv_blocks=512,
                                          max_num_batched_tokens=budget))
    ex = core.executor
    ex.static_prefill = True
    calls = {"merged": 0, "static": 0}
    merged, static = ex._merged, ex._static

    def count_merged(*args):
        calls["merged"] += 1
        return merged(*args)

    def count_static(*args):
        calls["static"] += 1
        return static(*args)

    ex._merged, ex._static = count_merged, count_static
    requests = run_staggered(core, prompts, params, arrival_steps=[0, 0, 2, 3, 5, 9])
    check_against_oracle(core, oracle, requests, B, 2, mode)
    assert calls["static"] > 0
    if B == 1:  # full depth: a step that prefills beside decode rows is one call
        assert calls["merged"] > 0
    elif mode == "deferred":  # shallow rows run loops 1..2 only: never merged
        assert calls["merged"] == 0
    # (eager mode merges its boundary steps: loops 1..T, read from loop T)
    assert core.stats()["kv_blocks_used"] == 0
