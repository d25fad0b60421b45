"""Issue 11 in float64 against the dense oracle: lazy KV, preemption by recompute, shared prompt blocks.

Every output is checked by replaying its own `readout_loops` through tests/oracle.py (which shares no
code with the engine and recomputes every position with no cache): token j's processed log-prob is
loop readout_loops[j-1]'s at the position before it. After every readmission, every KV plane of the
re-prefilled positions equals the oracle's keys and values.
"""

from __future__ import annotations

import random

import pytest
import torch

from ourobatch import EngineConfig, SamplingParams
from ourobatch.assembly import build_engine_core
from ourobatch.runtime.engine_core import child_seed
from scheduler.request import RequestStatus
from tests.oracle import load_oracle, processed_logprobs

TOL = 1e-6


def engine_core(ckpt, **kw):
    base = dict(model=str(ckpt), dtype="float64", block_size=4, max_model_len=64, max_num_seqs=16)
    base.update(kw)
    return build_engine_core(EngineConfig(**base))


def run(core, workload, arrivals, snapshots=None):
    """Add workload[i] at step arrivals[i]; step to the end; snapshot every readmission's KV planes."""
    children: dict[str, list] = {}
    step = 0
    while len(children) < len(workload) or core.has_unfinished:
        for i, at in enumerate(arrivals):
            if at == step:
                prompt, params = workload[i]
                children[f"q{i}"] = core.add(prompt, params, request_id=f"q{i}").children
        core.step()
        if snapshots is not None:
            snapshot_readmitted(core, snapshots)
        step += 1
        assert step < 5000
    return children


def snapshot_readmitted(core, snapshots):
    """Copy the planes of every request re-prefilled in this step (checked against the oracle at the end:
    one oracle forward per completion covers every prefix of it, attention being causal)."""
    pool = core.executor.pool
    for r in core.scheduler.requests.values():
        key = (r.request_id, r.num_preemptions)
        just_prefilled = r.status == RequestStatus.ALIGNING and r.num_output_tokens == r.num_outputs_at_prefill + 1
        if r.num_preemptions == 0 or key in snapshots or not just_prefilled:
            continue
        n = r.num_prompt_tokens + r.num_output_tokens - 1  # prompt + every output before the new one
        planes = {(loop, layer): tuple(t.clone() for t in pool.read(loop, layer, r.block_ids, n))
                  for loop in range(1, len(pool.k) + 1) for layer in range(pool.k.shape[1])}
        assert r.readout_loops[-1] == len(pool.k)  # preemption inserts a boundary: read from loop T
        snapshots[key] = (r, n, planes)


def check_replay(oracle, r, snapshots=()):
    """Tokens and processed log-probs equal the oracle's at each token's own readout loop; every KV plane
    snapshotted at a readmission equals the oracle's."""
    assert r.finish_reason in ("length", "stop"), r.error
    P, toks = r.num_prompt_tokens, r.output_token_ids
    out = oracle.forward(list(r.prompt_token_ids) + toks[:-1])
    p = r.params
    for j, (tok, lp, loop) in enumerate(zip(toks, r.logprobs, r.readout_loops), start=1):
        row = out.logits[loop - 1, P + j - 2]
        ref = processed_logprobs(row, p.temperature, p.top_k, p.top_p, p.min_p)
        if p.is_greedy:
            assert tok == int(row.argmax()), f"{r.request_id} token {j}"
        assert abs(lp - float(ref[tok])) < TOL, f"{r.request_id} token {j}: {lp} vs {float(ref[tok])}"
    for snap_r, n, planes in snapshots:
        if snap_r is not r:
            continue
        for (loop, layer), (k, v) in planes.items():
            torch.testing.assert_close(k, out.keys[loop - 1, layer, :n], atol=TOL, rtol=0)
            torch.testing.assert_close(v, out.values[loop - 1, layer, :n], atol=TOL, rtol=0)


def make_workload(rng, V, count, stop_token):
    work = []
    for i in range(count):
        prompt = [rng.randrange(V) for _ in range(rng.randint(2, 9))]
        kind = i % 4
        if kind == 0:
            params = SamplingParams(max_tokens=rng.randint(18, 30), temperature=0.0, ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(max_tokens=rng.randint(18, 30), temperature=0.9, seed=rng.randrange(999),
                                    n=2, ignore_eos=True)
        elif kind == 2:  # stop tokens, ending anywhere in a block
            params = SamplingParams(max_tokens=30, temperature=1.2, seed=rng.randrange(999),
                                    stop_token_ids=(stop_token,), ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=rng.randint(10, 28), temperature=1.0, top_k=6, top_p=0.9,
                                    seed=rng.randrange(999), ignore_eos=True)
        work.append((prompt, params))
    return work


# (mode, B, s, shape): every mode, several B and s, on two model shapes (the oracle is slow: one shape each)
CONFIGS = [
    ("deferred", 1, 2, "kv1-L2-T4"), ("deferred", 2, 1, "kv2-L2-T5"), ("deferred", 4, 2, "kv1-L2-T4"),
    ("deferred", 3, 3, "kv2-L2-T5"), ("eager", 4, 2, "kv2-L2-T5"), ("verify", 4, 2, "kv1-L2-T4"),
    ("verify", 2, 3, "kv2-L2-T5"),
]


@pytest.mark.parametrize("mode,B,s,shape", CONFIGS)
def test_preemption_keeps_every_output_exact(checkpoints, mode, B, s, shape):
    ckpt = checkpoints[shape]
    oracle = load_oracle(ckpt)
    rng = random.Random(f"{shape}/{mode}/{B}/{s}")
    work = make_workload(rng, oracle.vocab_size, 7, stop_token=3)
    # 16 blocks of 4 positions: any request fits alone (<= 10 blocks), seven at once do not
    core = engine_core(ckpt, mode=mode, deep_interval=B, shallow_loops=s, num_kv_blocks=16)
    snapshots: dict = {}
    children = run(core, work, arrivals=[0, 0, 1, 2, 2, 4, 7], snapshots=snapshots)
    stats = core.stats()
    assert stats["preemptions"] > 0 and stats["recomputed_tokens"] > 0 and len(snapshots) > 0
    for kids in children.values():
        for r in kids:
            check_replay(oracle, r, snapshots.values())
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


def test_greedy_full_depth_is_identical_with_and_without_preemption(checkpoints):
    ckpt = checkpoints["kv2-L3-T4-hd16"]
    rng = random.Random(5)
    V = load_oracle(ckpt).vocab_size
    work = [([rng.randrange(V) for _ in range(rng.randint(2, 9))],
             SamplingParams(max_tokens=rng.randint(15, 30), temperature=0.0, ignore_eos=True)) for _ in range(10)]
    outs = {}
    for blocks in (512, 14):
        core = engine_core(ckpt, deep_interval=1, num_kv_blocks=blocks)
        children = run(core, work, arrivals=[0, 0, 0, 1, 1, 2, 3, 3, 5, 8])
        outs[blocks] = {rid: kids[0].output_token_ids for rid, kids in children.items()}
        assert (core.stats()["preemptions"] > 0) == (blocks == 14)
    assert outs[512] == outs[14]


@pytest.mark.parametrize("mode,B,P", [("deferred", 1, 13), ("deferred", 4, 12), ("verify", 3, 13), ("eager", 2, 12)])
def test_shared_prompt_blocks_produce_what_unshared_runs_produce(checkpoints, mode, B, P):
    ckpt = checkpoints["kv1-L2-T4"]
    oracle = load_oracle(ckpt)
    rng = random.Random(B)
    V = oracle.vocab_size
    base = [rng.randrange(V) for _ in range(P)]
    # n = 4 samples of one prompt, the same prompt again later, and a prompt sharing its first 8 tokens
    work = [(base, SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=21, ignore_eos=True)),
            (base, SamplingParams(max_tokens=12, temperature=1.0, seed=22, ignore_eos=True)),
            (base[:8] + [1, 2, 3], SamplingParams(max_tokens=12, temperature=0.7, seed=23, ignore_eos=True))]
    core = engine_core(ckpt, mode=mode, deep_interval=B, num_kv_blocks=256)
    shared = run(core, work, arrivals=[0, 3, 5])
    stats = core.stats()
    # P = 13: the prompt's 3 full blocks are computed once for the 4 samples (the block of the last token
    # never is shared), then found in the cache by the repeat and, for 2 blocks, by the third prompt.
    # P = 12: the prompt ends at a block boundary: samples 1-3 fork from sample 0's prefill (all 3 blocks,
    # nothing computed); the later repeat cannot fork (no prefill of it in its step): 2 blocks from the cache
    assert stats["prefix_cache_hits"] == {13: 3 * 3 * 4 + 3 * 4 + 2 * 4, 12: 3 * 3 * 4 + 2 * 4 + 2 * 4}[P]
    assert stats["prefill_tokens_computed"] == stats["prefill_tokens_requested"] - stats["prefix_cache_hits"]
    # unshared reference: every completion alone, in its own engine without prefix caching
    for i, (prompt, params) in enumerate(work):
        for c, r in enumerate(shared[f"q{i}"]):
            alone = engine_core(ckpt, mode=mode, deep_interval=B, num_kv_blocks=256, enable_prefix_caching=False)
            p = SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature,
                               seed=child_seed(params.seed, c), ignore_eos=True)
            (ref,) = run(alone, [(prompt, p)], [0])["q0"]
            assert alone.stats()["prefix_cache_hits"] == 0
            assert r.output_token_ids == ref.output_token_ids
            assert r.logprobs == pytest.approx(ref.logprobs, abs=1e-9)
            check_replay(oracle, r)
    assert core.stats()["kv_blocks_used"] == 0
    assert core.scheduler.reset_prefix_cache() > 0 and core.stats()["prefix_cache_blocks"] == 0
