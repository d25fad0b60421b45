"""SamplingParams(prompt_logprobs=k) against the float64 oracle (tests/oracle.py) on fresh random prompts
and three model shapes: each prompt token's log-prob is loop T's readout at the position before it, raw
(log_softmax) or processed (the request's temperature / min-p / top-k / top-p) per logprobs_mode, with
ranks and the top k in the sampler's tie order; chunked prefill, n > 1, prefix-cache hits and preemption
give the same numbers; the async Engine's streams carry them (DELTA: once); an executor that drops them
fails the request instead of passing silently."""

from __future__ import annotations

import dataclasses
import random

import anyio
import pytest
import torch

from ourobatch import Engine, EngineConfig, SamplingParams, SyncEngine
from scheduler.params import RequestOutputKind
from ourobatch.testing import make_tiny_checkpoint
from tests.oracle import load_oracle, processed_logprobs

TOL = 1e-9  # float64 engine against the float64 oracle
SHAPES = {
    "kv1-L2-T4": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                      total_ut_steps=4),
    "kv2-L3-T5-hd16": dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           total_ut_steps=5, hidden_size=48, intermediate_size=80, vocab_size=53),
    "kv4-L2-T3": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=None,
                      total_ut_steps=3, vocab_size=37),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("plp")
    return {name: make_tiny_checkpoint(root / name, seed=40 + i, eos_token_id=None, **shape)
            for i, (name, shape) in enumerate(SHAPES.items())}


@pytest.fixture(scope="module")
def oracles(checkpoints):
    return {name: load_oracle(path) for name, path in checkpoints.items()}


def engine(ckpt, **kw) -> SyncEngine:
    base = dict(model=str(ckpt), dtype="float64", max_model_len=128, max_num_seqs=16, block_size=4,
                num_kv_blocks=256)
    base.update(kw)
    return SyncEngine(EngineConfig(**base))


def oracle_rows(oracle, prompt: list[int], p: SamplingParams, mode: str) -> torch.Tensor:
    """[P - 1, vocab]: the reported distribution at readout positions 0..P-2 (loop T), raw or processed."""
    logits = oracle.forward(prompt).logits[-1]  # loop T
    rows = [torch.log_softmax(logits[i], -1) if mode == "raw" else
            processed_logprobs(logits[i], p.temperature, p.top_k, p.top_p, p.min_p) for i in range(len(prompt) - 1)]
    return torch.stack(rows) if rows else torch.zeros(0, logits.shape[-1], dtype=torch.float64)


def close(a: float, b: float) -> bool:
    return a == b or abs(a - b) < TOL  # -inf == -inf (a token processed away)


def check_against_oracle(prompt_logprobs, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    """vLLM's shape: None, then per position {prompt token: Logprob, then the k best in rank order}."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    vocab = ref.shape[1]
    for i in range(1, len(prompt)):
        row, tok, entry = ref[i - 1], prompt[i], prompt_logprobs[i]
        ranked = sorted(range(vocab), key=lambda t: (-float(row[t]), t))  # ties: the lower id first
        best = ranked[:vocab if k == -1 else k]
        assert list(entry) == list(dict.fromkeys([tok, *best])), i  # the prompt token first, then the k best
        assert entry[tok].rank == ranked.index(tok) + 1, i
        for t, lp in entry.items():
            assert close(lp.logprob, float(row[t])), (i, t, lp.logprob, float(row[t]))
            assert lp.decoded_token is None
            if t != tok or tok in best:
                assert lp.rank == ranked.index(t) + 1


PARAMS = [
    SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=0, ignore_eos=True),
    SamplingParams(max_tokens=4, temperature=0.7, top_k=6, seed=1, prompt_logprobs=3, ignore_eos=True),
    SamplingParams(max_tokens=2, temperature=1.3, top_p=0.8, min_p=0.02, seed=2, prompt_logprobs=5, ignore_eos=True),
    SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=3, prompt_logprobs=1, ignore_eos=True),
]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("logprobs_mode", ["raw", "processed"])
def test_prompt_logprobs_equal_the_oracle(checkpoints, oracles, shape, logprobs_mode):
    oracle = oracles[shape]
    rng = random.Random(f"{shape}-{logprobs_mode}")
    V = oracle.vocab_size
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (1, 2, 19, 33)]
    params = [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]
    with engine(checkpoints[shape], logprobs_mode=logprobs_mode) as llm:
        outs = llm.generate_batch(prompts, params)
        plain = llm.generate_batch(prompts, [dataclasses.replace(p, prompt_logprobs=None) for p in params])
    moved = 0.0
    for prompt, p, out, base in zip(prompts, params, outs, plain):
        ref = oracle_rows(oracle, prompt, p, logprobs_mode)
        check_against_oracle(out.prompt_logprobs, prompt, ref, p.prompt_logprobs)
        assert base.prompt_logprobs is None
        # asking for them changes no generated token or log-prob
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in base.outputs]
        for c, b in zip(out.outputs, base.outputs):  # (the second run reads cached blocks: ulp-level sums)
            assert c.logprobs == pytest.approx(b.logprobs, abs=TOL)
        raw = oracle_rows(oracle, prompt, p, "raw")
        for i in range(1, len(prompt)):
            moved = max(moved, abs(float(torch.nan_to_num(ref[i - 1, prompt[i]] - raw[i - 1, prompt[i]], 0.0))))
    if logprobs_mode == "processed":
        assert moved > 0.05  # processed differs from raw here, so the test tells them apart
    assert outs[0].prompt_logprobs == [None]  # a one-token prompt has no prompt log-prob


def test_the_whole_vocabulary_and_full_depth_in_every_mode(checkpoints, oracles):
    """prompt_logprobs=-1 reports every token; deferred and verify engines prefill at full depth too."""
    oracle = oracles["kv4-L2-T3"]
    rng = random.Random(5)
    prompt = [rng.randrange(oracle.vocab_size) for _ in range(14)]
    p = SamplingParams(max_tokens=6, temperature=0.9, seed=4, prompt_logprobs=-1, ignore_eos=True)
    ref = oracle_rows(oracle, prompt, p, "processed")
    for mode, B in (("deferred", 1), ("deferred", 3), ("eager", 2), ("verify", 2)):
        with engine(checkpoints["kv4-L2-T3"], mode=mode, deep_interval=B, shallow_loops=1) as llm:
            out = llm.generate(prompt, p)
        check_against_oracle(out.prompt_logprobs, prompt, ref, -1)
        assert all(len(d) == oracle.vocab_size for d in out.prompt_logprobs[1:])


@pytest.mark.parametrize("budget", [4, 8])
def test_chunked_prefill_gives_the_unchunked_prompt_logprobs(checkpoints, oracles, budget):
    shape = "kv2-L3-T5-hd16"
    oracle = oracles[shape]
    rng = random.Random(budget)
    V = oracle.vocab_size
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (37, 9, 26, 41)]
    params = [dataclasses.replace(PARAMS[i % len(PARAMS)], max_tokens=5) for i in range(len(prompts))]
    runs, stats = {}, {}
    for b in (budget, 8192):
        with engine(checkpoints[shape], logprobs_mode="processed", max_num_batched_tokens=b) as llm:
            runs[b] = llm.generate_batch(prompts, params)
            stats[b] = llm.stats()
    assert stats[budget]["prefill_chunks"] > 2 * stats[budget]["prefills"]  # really chunked
    for prompt, p, chunked, whole in zip(prompts, params, runs[budget], runs[8192]):
        check_against_oracle(chunked.prompt_logprobs, prompt, oracle_rows(oracle, prompt, p, "processed"),
                             p.prompt_logprobs)
        for a, b in zip(chunked.prompt_logprobs[1:], whole.prompt_logprobs[1:]):
            assert list(a) == list(b) and all(close(a[t].logprob, b[t].logprob) and a[t].rank == b[t].rank for t in a)
        assert [c.token_ids for c in chunked.outputs] == [c.token_ids for c in whole.outputs]


def test_n_samples_report_the_prompt_once_and_share_its_blocks(checkpoints, oracles):
    shape = "kv1-L2-T4"
    oracle = oracles[shape]
    rng = random.Random(11)
    prompt = [rng.randrange(oracle.vocab_size) for _ in range(24)]  # ends on a block boundary: forks
    p = SamplingParams(n=4, max_tokens=4, temperature=1.0, seed=9, prompt_logprobs=2, ignore_eos=True)
    with engine(checkpoints[shape], logprobs_mode="raw", enable_prefix_caching=False) as llm:
        out = llm.generate(prompt, p)
        computed = llm.stats()["prefill_tokens_computed"]
        alone = llm.generate(prompt, dataclasses.replace(p, n=1))
        plain = llm.generate(prompt, dataclasses.replace(p, prompt_logprobs=None))
    assert computed == len(prompt)  # completion 0 prefills the prompt; its samples share every block
    check_against_oracle(out.prompt_logprobs, prompt, oracle_rows(oracle, prompt, p, "raw"), 2)
    assert out.prompt_logprobs == alone.prompt_logprobs
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in plain.outputs]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # the samples differ


def test_prefix_cache_hits_never_skip_requested_positions(checkpoints, oracles):
    """A request asking for prompt log-probs reuses no cached block (its positions' readouts must be
    computed); it still fills the cache for later requests, which reuse it as before."""
    shape = "kv2-L3-T5-hd16"
    oracle = oracles[shape]
    rng = random.Random(12)
    V = oracle.vocab_size
    a = [rng.randrange(V) for _ in range(30)]
    b = a[:20] + [rng.randrange(V) for _ in range(7)]  # shares 5 blocks of 4 with a
    p = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=4, ignore_eos=True)
    with engine(checkpoints[shape], logprobs_mode="processed") as llm:
        llm.generate(a, dataclasses.replace(p, prompt_logprobs=None))  # fills the cache
        hits = llm.stats()["prefix_cache_hits"]
        outs = llm.generate_batch([a, b], p)  # both would hit the cache
        assert llm.stats()["prefix_cache_hits"] == hits
        computed = llm.stats()["prefill_tokens_computed"]
        llm.generate(b, dataclasses.replace(p, prompt_logprobs=None))
        assert llm.stats()["prefix_cache_hits"] == hits + 24  # b's 6 full blocks (one registered by b)
        assert llm.stats()["prefill_tokens_computed"] == computed + len(b) - 24
    for prompt, out in zip([a, b], outs):
        check_against_oracle(out.prompt_logprobs, prompt, oracle_rows(oracle, prompt, p, "processed"), 4)


def test_preempted_prefills_keep_their_prompt_logprobs(checkpoints, oracles):
    """A pool too small for all requests preempts prefills under way and decoding requests; a restart
    computes only the positions still missing (none twice, none skipped), also after a preemption that
    came between two chunks of a prefill whose prompt log-probs were half done."""
    shape = "kv4-L2-T3"
    oracle = oracles[shape]
    rng = random.Random(13)
    V = oracle.vocab_size
    work = [([rng.randrange(V) for _ in range(rng.randint(20, 40))],
             SamplingParams(max_tokens=rng.randint(20, 28), temperature=1.0, seed=i, prompt_logprobs=i % 3,
                            ignore_eos=True)) for i in range(6)]
    arrivals = [0, 1, 1, 3, 5, 6]
    half_done = 0
    # 20 blocks of 4: any request fits alone (<= 17 blocks), six at once do not
    with engine(checkpoints[shape], logprobs_mode="raw", num_kv_blocks=20, max_num_batched_tokens=8,
                kv_watermark=0.0) as llm:
        core, parents, step = llm.core, {}, 0
        while len(parents) < len(work) or core.has_unfinished:
            for i, at in enumerate(arrivals):
                if at == step:
                    parents[i] = core.add(*work[i], request_id=f"q{i}")
            core.step()
            step += 1
            half_done += sum(r.num_preemptions > 0 and 0 < len(r.prompt_logprobs) < r.num_prompt_tokens - 1
                             for r in core.scheduler.waiting)
            assert step < 5000
        stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["prefill_chunks"] > 2 * stats["prefills"]
    assert half_done > 0
    for i, (prompt, p) in enumerate(work):
        out = parents[i].output()
        check_against_oracle(out.prompt_logprobs, prompt, oracle_rows(oracle, prompt, p, "raw"), p.prompt_logprobs)


def test_bad_values_name_the_field():
    for bad in (-2, -100):
        with pytest.raises(ValueError, match=r"SamplingParams\.prompt_logprobs must satisfy prompt_logprobs >= 0"):
            SamplingParams(prompt_logprobs=bad)
    for bad in ("3", 1.5, [1]):
        with pytest.raises(TypeError, match=r"SamplingParams\.prompt_logprobs must be an int"):
            SamplingParams(prompt_logprobs=bad)
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 1  # as logprobs: bool is an int
    assert SamplingParams.coerce({"prompt_logprobs": 2}).prompt_logprobs == 2


class _DropPromptLogprobs:
    """An executor that loses the prompt log-probs: the request must fail, not finish without them."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def execute(self, plan):
        return dataclasses.replace(self.inner.execute(plan), prompt_logprobs=())

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_missing_prompt_logprobs_fail_the_request(checkpoints):
    with engine(checkpoints["kv1-L2-T4"]) as llm:
        llm.core.executor = _DropPromptLogprobs(llm.core.executor)
        out = llm.generate([1, 2, 3, 4, 5], SamplingParams(max_tokens=2, prompt_logprobs=0))
        ok = llm.generate([1, 2, 3], SamplingParams(max_tokens=2))  # others are not affected
        assert llm.stats()["kv_blocks_used"] == 0
    assert out.outputs[0].finish_reason == "error" and "prompt log-probs" in out.outputs[0].error
    assert out.prompt_logprobs is None
    assert ok.outputs[0].finish_reason == "length"


def test_async_engine_streams_carry_them(checkpoints, oracles):
    shape = "kv1-L2-T4"
    oracle = oracles[shape]
    prompt = [random.Random(14).randrange(oracle.vocab_size) for _ in range(21)]
    p = SamplingParams(n=2, max_tokens=5, temperature=0.8, seed=6, prompt_logprobs=2, ignore_eos=True)
    ref = oracle_rows(oracle, prompt, p, "processed")
    config = EngineConfig(model=str(checkpoints[shape]), dtype="float64", max_model_len=64, block_size=4,
                          num_kv_blocks=64, max_num_batched_tokens=8, logprobs_mode="processed")

    async def main():
        async with Engine(config) as e:
            final = await e.generate(prompt, p)
            deltas = [o async for o in e.stream(prompt, dataclasses.replace(p, output_kind=RequestOutputKind.DELTA))]
            cumulative = [o async for o in e.stream(prompt, p)]
        return final, deltas, cumulative

    final, deltas, cumulative = anyio.run(main)
    check_against_oracle(final.prompt_logprobs, prompt, ref, 2)
    assert len(deltas) > 1 and deltas[0].prompt_logprobs == final.prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])  # vLLM: DELTA outputs carry them once
    assert all(c.prompt_logprobs == final.prompt_logprobs for c in cumulative)


def test_non_finite_prompt_logits_fail_the_prefill(checkpoints):
    """A NaN logit at a prompt position (here in a chunk that samples nothing) fails the request with an
    error naming it: no NaN prompt log-prob is reported, and its blocks are freed."""
    with engine(checkpoints["kv1-L2-T4"], dtype="float32", max_num_batched_tokens=4) as llm:
        llm.core.executor.model.lm_head.weight[7, 0] = float("nan")  # every readout's logit of token 7
        out = llm.generate(list(range(1, 13)), SamplingParams(max_tokens=2, prompt_logprobs=0))
        assert llm.stats()["kv_blocks_used"] == 0
    c = out.outputs[0]
    assert c.finish_reason == "error" and "non-finite logits" in c.error and c.error.startswith("prefill failed")
    assert c.token_ids == [] and out.prompt_logprobs is None
