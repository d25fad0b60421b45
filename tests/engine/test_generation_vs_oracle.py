"""End-to-end generation in float64 against the dense oracle (tests/oracle.py), which shares no code
with the engine and recomputes every loop at every position with no cache."""

from __future__ import annotations

import random

import pytest
import torch

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.assembly import build_engine_core
from ourobatch.runtime.engine_core import EngineCore
from tests.oracle import expected_readout_loops, load_oracle, processed_logprobs, readout_position

from .conftest import SHAPES

TOL = 1e-6


def run_staggered(core: EngineCore, prompts, params_list, arrival_steps):
    """Add request i at step arrival_steps[i]; run until all finish; return the scheduler Requests."""
    children = {}
    step = 0
    while len(children) < len(prompts) or core.has_unfinished:
        for i, at in enumerate(arrival_steps):
            if at == step:
                children[i] = core.add(prompts[i], params_list[i], request_id=f"q{i}").children[0]
        core.step()
        step += 1
        assert step < 10_000
    return [children[i] for i in range(len(prompts))]


def check_against_oracle(core: EngineCore, oracle, requests, B: int, s: int, mode: str):
    T = oracle.total_ut_steps
    pool = core.executor.pool
    for r in requests:
        P, toks = r.num_prompt_tokens, r.output_token_ids
        assert r.finish_reason in ("length", "stop")
        assert r.readout_loops == expected_readout_loops(len(toks), B, s, T)
        fed = list(r.prompt_token_ids) + toks[:-1]  # the last sampled token is never fed
        out = oracle.forward(fed)
        for j, (tok, lp, loop) in enumerate(zip(toks, r.logprobs, r.readout_loops), start=1):
            row = out.logits[loop - 1, readout_position(P, j)]
            p = r.params
            ref = processed_logprobs(row, p.temperature, p.top_k, p.top_p, p.min_p)
            if p.is_greedy:
                assert tok == int(row.argmax()), f"token {j}"
            assert torch.isfinite(ref[tok]), f"token {j} sampled outside the support"
            assert abs(lp - float(ref[tok])) < TOL, f"token {j}: {lp} vs {float(ref[tok])}"
        # Every populated KV plane equals the oracle's keys and values.
        num_fed = len(fed)
        if mode == "eager":
            deep_filled = num_fed
        else:  # deep planes filled up to the last boundary: token 1 + B * (boundaries) tokens
            deep_filled = P + B * ((len(toks) - 1) // B)
        for loop in range(1, T + 1):
            n = num_fed if loop <= s else deep_filled
            for layer in range(oracle.num_layers):
                k, v = pool.read(loop, layer, r.block_ids, n)
                torch.testing.assert_close(k, out.keys[loop - 1, layer, :n], atol=TOL, rtol=0)
                torch.testing.assert_close(v, out.values[loop - 1, layer, :n], atol=TOL, rtol=0)


# every shape with every shallow_loops it allows (s <= T - 1)
SHAPE_LOOPS = [(shape, s) for shape, cfg in SHAPES.items() for s in (1, 2, 3) if s < cfg["total_ut_steps"]]


@pytest.mark.parametrize("shape,s", SHAPE_LOOPS)
@pytest.mark.parametrize("B", [1, 2, 4, 8])
def test_generation_matches_oracle(checkpoints, shape, B, s):
    ckpt = checkpoints[shape]
    oracle = load_oracle(ckpt)
    rng = random.Random(hash((shape, B, s)) & 0xFFFF)
    V = oracle.vocab_size
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 7))] for _ in range(4)]
    params_list = [
        SamplingParams(max_tokens=18, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=18, temperature=0.8, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=13, temperature=1.3, top_k=5, top_p=0.9, seed=12, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=1.0, min_p=0.05, seed=13, ignore_eos=True),
    ]
    # block_size 4 and a pool large enough that no block is reused within the test, so the planes
    # of finished requests can still be read back.
    core = build_engine_core(EngineConfig(model=str(ckpt), dtype="float64", mode="deferred", deep_interval=B,
                                   shallow_loops=s, block_size=4, num_kv_blocks=512))
    requests = run_staggered(core, prompts, params_list, arrival_steps=[0, 0, 1, 3])
    check_against_oracle(core, oracle, requests, B, s, "deferred")
    assert core.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("shape", ["kv1-L2-T4", "kv2-L2-T5"])
@pytest.mark.parametrize("B", [1, 3, 4])
def test_eager_matches_oracle_and_deferred(checkpoints, shape, B):
    ckpt = checkpoints[shape]
    oracle = load_oracle(ckpt)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    params_list = [SamplingParams(max_tokens=14, temperature=t, seed=100 + i, ignore_eos=True)
                   for i, t in enumerate([0.0, 1.0, 0.7])]
    results = {}
    for mode in ("eager", "deferred"):
        core = build_engine_core(EngineConfig(model=str(ckpt), dtype="float64", mode=mode, deep_interval=B,
                                       shallow_loops=2, block_size=4, num_kv_blocks=256))
        reqs = run_staggered(core, prompts, params_list, arrival_steps=[0, 2, 2])
        check_against_oracle(core, oracle, reqs, B, 2, mode)
        results[mode] = reqs
        if mode == "eager":
            assert core.stats()["deep_calls"] == 0
    for e, d in zip(results["eager"], results["deferred"]):
        assert e.output_token_ids == d.output_token_ids
        assert e.readout_loops == d.readout_loops
        assert e.logprobs == pytest.approx(d.logprobs, abs=1e-12)


def test_interval_one_is_full_depth_decoding(checkpoints):
    ckpt = checkpoints["kv1-L2-T4"]
    oracle = load_oracle(ckpt)
    with SyncEngine(EngineConfig(model=str(ckpt), dtype="float64", deep_interval=1, num_kv_blocks=64)) as llm:
        out = llm.generate([3, 1, 4, 1, 5], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    c = out.outputs[0]
    assert c.readout_loops == [4] * 20
    # Plain full-depth greedy decoding with the oracle, one token at a time.
    seq = [3, 1, 4, 1, 5]
    for _ in range(20):
        seq.append(int(oracle.forward(seq).logits[-1, -1].argmax()))
    assert c.token_ids == seq[5:]


def test_loops_readouts_differ_so_the_schedule_is_observable(checkpoints):
    """The tiny checkpoints must make loop-s and loop-T readouts disagree, or the tests above prove little."""
    for name, ckpt in checkpoints.items():
        oracle = load_oracle(ckpt)
        out = oracle.forward(list(range(20)))
        argmax = out.logits.argmax(-1)  # [T, S]
        T = oracle.total_ut_steps
        for s in range(1, T):
            disagree = (argmax[s - 1] != argmax[T - 1]).float().mean().item()
            assert disagree > 0.2, f"{name}: loop {s} agrees with loop {T} at {1 - disagree:.0%} of positions"


def test_float32_engine_is_close_to_the_float64_oracle(checkpoints):
    ckpt = checkpoints["kv2-L3-T4-hd16"]
    oracle = load_oracle(ckpt)
    core = build_engine_core(EngineConfig(model=str(ckpt), dtype="float32", deep_interval=4, num_kv_blocks=64))
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    (r,) = run_staggered(core, [[2, 7, 1]], [params], [0])
    out = oracle.forward([2, 7, 1] + r.output_token_ids[:-1])
    for j, (tok, lp, loop) in enumerate(zip(r.output_token_ids, r.logprobs, r.readout_loops), start=1):
        ref = processed_logprobs(out.logits[loop - 1, readout_position(3, j)], 1.0)
        assert abs(lp - float(ref[tok])) < 1e-4
