"""Graphed prefill on CUDA (engine/prefill_graph.py): an engine whose prefills replay the bucket graphs gives
the tokens, log-probs and prompt log-probs of one whose prefills run eagerly (SDPA, gathered histories),
with fresh chunks, chunks after cached blocks, chunked prompts past the step budget and more chunks than a
layout holds (eager fallback), in float32 where both paths are exact up to summation order. At full depth
(deep_interval 1) the steps that prefill beside decode rows run both in one call (engine/phases.py _merged)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.testing import make_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module", params=[(4, 2, 32), (8, 8, 64)], ids=["gqa2-d32", "mha-d64"])
def ckpt(tmp_path_factory, request):
    heads, kv_heads, d = request.param
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pg") / "m", seed=5, eos_token_id=None, hidden_size=128,
                                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d,
                                intermediate_size=256, vocab_size=211)


def workload(seed: int, n: int = 24):
    rnd = random.Random(seed)
    base = [rnd.randrange(1, 211) for _ in range(400)]
    prompts = []
    for i in range(n):
        kind = i % 4
        if kind == 0:  # a fresh prompt of any length
            prompts.append([rnd.randrange(1, 211) for _ in range(rnd.randint(1, 300))])
        elif kind == 1:  # a shared prefix (cached blocks: the rest is a chunk after a history) plus a tail
            prompts.append(base[:rnd.choice([16, 32, 100, 256])]
                           + [rnd.randrange(1, 211) for _ in range(rnd.randint(1, 40))])
        else:  # short prompts: many chunks in one step
            prompts.append([rnd.randrange(1, 211) for _ in range(rnd.randint(1, 12))])
    params = [SamplingParams(max_tokens=rnd.randint(4, 12), temperature=rnd.choice([0.0, 0.9]), seed=i,
                             ignore_eos=True, logprobs=1, prompt_logprobs=1 if i % 5 == 0 else None)
              for i in range(n)]
    return prompts, params


def run(ckpt, graphs: bool, budget: int, mode: str, B: int, seed: int):
    cfg = EngineConfig(model=str(ckpt), device="cuda", dtype="float32", mode=mode, deep_interval=B, block_size=16,
                       num_kv_blocks=1024, max_num_seqs=96, max_model_len=512, max_num_batched_tokens=budget,
                       cuda_graphs=graphs)
    with SyncEngine(cfg) as llm:
        ex = llm.core.executor
        replays = []
        if graphs:
            prefill = ex.graphs.prefill

            def counted(layout, *args):
                replays.append(layout.tokens)
                return prefill(layout, *args)

            ex.graphs.prefill = counted
        prompts, params = workload(seed)
        outs = llm.generate_batch(prompts, params)
    return outs, replays


@pytest.mark.parametrize("budget", [64, 512, 8192])
@pytest.mark.parametrize("mode,B", [("deferred", 1), ("deferred", 4)])
def test_graphed_prefill_equals_eager_prefill(ckpt, budget, mode, B):
    graphed, replays = run(ckpt, True, budget, mode, B, seed=budget + B)
    eager, _ = run(ckpt, False, budget, mode, B, seed=budget + B)
    assert replays, "no prefill went through a graph"
    for g, e in zip(graphed, eager):
        for cg, ce in zip(g.outputs, e.outputs):
            assert cg.token_ids == ce.token_ids
            torch.testing.assert_close(torch.tensor(cg.logprobs), torch.tensor(ce.logprobs), atol=1e-3, rtol=0)
        if e.prompt_logprobs is not None:
            got = [None if p is None else max(p.values(), key=lambda x: x.logprob).logprob for p in g.prompt_logprobs]
            ref = [None if p is None else max(p.values(), key=lambda x: x.logprob).logprob for p in e.prompt_logprobs]
            assert got[0] is None and ref[0] is None
            torch.testing.assert_close(torch.tensor(got[1:]), torch.tensor(ref[1:]), atol=1e-3, rtol=0)


def test_steps_past_a_layout_run_eagerly(ckpt):
    # 300 one-token prompts admitted in one step: more chunks than MAX_GRAPH_CHUNKS, so that step is eager
    from engine.prefill_graph import MAX_GRAPH_CHUNKS

    cfg = EngineConfig(model=str(ckpt), device="cuda", dtype="float32", num_kv_blocks=1024, max_num_seqs=300,
                       max_model_len=64, max_num_batched_tokens=512)
    prompts = [[i % 200 + 1] for i in range(300)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with SyncEngine(cfg) as llm:
        ex = llm.core.executor
        seen = []
        rows = ex._prefill_rows

        def spy(run_, lens, keep):
            seen.append((len(run_), ex._layout(sum(lens), len(run_)) is not None))
            return rows(run_, lens, keep)

        ex._prefill_rows = spy
        outs = llm.generate_batch(prompts, params)
    assert any(n > MAX_GRAPH_CHUNKS and not graphed for n, graphed in seen)
    with SyncEngine(dataclasses.replace(cfg, cuda_graphs=False)) as llm:
        ref = llm.generate_batch(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
