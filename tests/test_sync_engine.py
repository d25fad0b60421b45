"""SyncEngine: the public blocking facade on tiny checkpoints."""

from __future__ import annotations

import pytest

from ourobatch import (
    EngineClosedError,
    EngineConfig,
    RequestRejectedError,
    SamplingParams,
    SyncEngine,
)
from ourobatch.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sync") / "m", seed=5, eos_token_id=None)


@pytest.fixture
def llm(ckpt):
    with SyncEngine(EngineConfig(model=str(ckpt), dtype="float64", deep_interval=4, block_size=4,
                                 num_kv_blocks=64, max_model_len=128)) as engine:
        yield engine


def test_same_seed_same_tokens_whatever_the_batch_and_arrival(ckpt, llm):
    p = SamplingParams(max_tokens=15, temperature=1.0, seed=77, ignore_eos=True)
    alone = llm.generate([1, 2, 3], p).outputs[0]
    others = [[4, 5], [6], [7, 8, 9, 10]]
    crowd = llm.generate_batch([others[0], [1, 2, 3], *others[1:]],
                               [SamplingParams(max_tokens=20, seed=1, ignore_eos=True), p,
                                SamplingParams(max_tokens=9, seed=3, ignore_eos=True),
                                SamplingParams(max_tokens=9, seed=4, ignore_eos=True)])
    assert crowd[1].outputs[0].token_ids == alone.token_ids
    assert crowd[1].outputs[0].logprobs == pytest.approx(alone.logprobs, abs=1e-12)
    # arriving while others are mid-block: the engine core adds it a few steps later
    core = llm.core
    for i, o in enumerate(others):
        core.add(o, SamplingParams(max_tokens=12, seed=i, ignore_eos=True), request_id=f"bg{i}")
    for _ in range(3):
        core.step()
    late = core.add([1, 2, 3], p, request_id="late")
    while core.has_unfinished:
        core.step()
    assert late.output().outputs[0].token_ids == alone.token_ids
    different = llm.generate([1, 2, 3], SamplingParams(max_tokens=15, seed=78, ignore_eos=True)).outputs[0]
    assert different.token_ids != alone.token_ids


def test_outputs_report_seed_loops_logprobs_and_finish(llm):
    out = llm.generate([3, 4], SamplingParams(max_tokens=9, logprobs=3, ignore_eos=True))
    c = out.outputs[0]
    assert out.finished and c.finish_reason == "length" and len(c.token_ids) == 9
    assert isinstance(c.seed, int) and c.readout_loops == [4, 2, 2, 2, 4, 2, 2, 2, 4]
    assert c.cumulative_logprob == pytest.approx(sum(c.logprobs))
    assert len(c.top_logprobs) == 9 and all(c.token_ids[i] in c.top_logprobs[i] for i in range(9))
    again = llm.generate([3, 4], SamplingParams(max_tokens=9, seed=c.seed, ignore_eos=True)).outputs[0]
    assert again.token_ids == c.token_ids  # the reported seed reproduces the request


def test_n_completions_per_prompt(llm):
    out = llm.generate([5, 6, 7], {"n": 3, "max_tokens": 8, "seed": 9, "ignore_eos": True})
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert len({c.seed for c in out.outputs}) == 3
    assert out.outputs[0].seed == 9
    single = llm.generate([5, 6, 7], SamplingParams(max_tokens=8, seed=9, ignore_eos=True)).outputs[0]
    assert single.token_ids == out.outputs[0].token_ids


def test_stop_token_ids_end_the_request_and_are_kept(llm):
    first = llm.generate([1, 1], SamplingParams(max_tokens=12, seed=4, ignore_eos=True)).outputs[0]
    stop = first.token_ids[5]
    k = first.token_ids.index(stop)
    out = llm.generate([1, 1], SamplingParams(max_tokens=12, seed=4, stop_token_ids=[stop])).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == first.token_ids[:k + 1]


def test_checkpoint_eos_stops_unless_ignore_eos(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "eos", seed=5, eos_token_id=None)
    with SyncEngine(EngineConfig(model=str(ckpt), num_kv_blocks=64)) as llm:
        toks = llm.generate([2, 2], SamplingParams(max_tokens=12, seed=1)).outputs[0].token_ids
    eos = toks[3]
    ckpt = make_tiny_checkpoint(tmp_path / "eos", seed=5, eos_token_id=eos)
    with SyncEngine(EngineConfig(model=str(ckpt), num_kv_blocks=64)) as llm:
        stopped = llm.generate([2, 2], SamplingParams(max_tokens=12, seed=1)).outputs[0]
        ignored = llm.generate([2, 2], SamplingParams(max_tokens=12, seed=1, ignore_eos=True)).outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == toks[:toks.index(eos) + 1]
    assert ignored.finish_reason == "length" and ignored.token_ids == toks


def test_stats_count_deep_calls_and_rows_on_the_real_engine(ckpt):
    N, M, B = 5, 14, 4
    with SyncEngine(EngineConfig(model=str(ckpt), deep_interval=B, num_kv_blocks=64, block_size=4)) as llm:
        llm.generate_batch([[1, 2]] * N, SamplingParams(max_tokens=M, ignore_eos=True))
        stats = llm.stats()
    assert stats["deep_calls"] == (M - 1) // B
    assert stats["deep_rows"] == N * B * ((M - 1) // B)
    assert stats["shallow_steps"] == M - 1
    assert stats["prefill_tokens"] == 2 * N
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_total"] == 64


@pytest.mark.parametrize("prompt,params,exc,match", [
    ([], {}, ValueError, "at least one token"),
    ([1, 31], {}, ValueError, "outside the vocabulary"),
    ([1, 2], {"max_tokens": 0}, ValueError, "max_tokens must satisfy max_tokens >= 1"),
    ([1, 2], {"temperature": -0.1}, ValueError, "temperature must be >= 0"),
    ([1, 2], {"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
    ([1, 2], {"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\]"),
    ([1, 2], {"top_k": -2}, ValueError, "top_k"),
    ([1, 2], {"min_p": 2.0}, ValueError, "min_p"),
    ([1, 2], {"max_tokens": 127}, RequestRejectedError, "exceeds max_model_len=128"),
    ([1, 2], {"max_tokens": "5"}, TypeError, "max_tokens must be an int"),
    ([1, 2], {"temprature": 1.0}, ValueError, "unknown SamplingParams field"),
])
def test_bad_input_gets_a_clear_error_and_changes_nothing(llm, prompt, params, exc, match):
    before = llm.stats()
    with pytest.raises(exc, match=match):
        llm.generate_batch([[1, 2], prompt], params)  # the good first prompt is not left behind
    after = llm.stats()
    assert after["kv_blocks_used"] == 0 and after["num_waiting"] == 0 and after["num_running"] == 0
    assert after["steps"] == before["steps"]
    # every prompt was checked before any was queued: the good one was never added, so never aborted either
    assert (after["requests_added"], after["finished_abort"]) == (before["requests_added"], before["finished_abort"])
    assert llm.generate([1, 2], SamplingParams(max_tokens=3)).finished  # still serving


def test_request_that_could_never_fit_the_pool(ckpt):
    with SyncEngine(EngineConfig(model=str(ckpt), num_kv_blocks=2, block_size=4, max_model_len=128)) as llm:
        with pytest.raises(RequestRejectedError, match="pool has only 2"):
            llm.generate([1] * 5, SamplingParams(max_tokens=5))
        assert llm.generate([1] * 5, SamplingParams(max_tokens=4)).outputs[0].finish_reason in ("length", "stop")


def test_more_requests_than_the_pool_holds_wait_and_all_finish(ckpt):
    with SyncEngine(EngineConfig(model=str(ckpt), num_kv_blocks=6, block_size=4)) as llm:
        outs = llm.generate_batch([[1, 2, 3]] * 10, SamplingParams(max_tokens=6, ignore_eos=True))
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("field,value,match", [
    ("mode", "lazy", "mode must be one of"),
    ("deep_interval", 0, "deep_interval must be >= 1"),
    ("shallow_loops", 4, r"shallow_loops must satisfy 1 <= shallow_loops <= 3"),
    ("dtype", "int8", "dtype must be one of"),
    ("block_size", 0, "block_size must be >= 1"),
])
def test_bad_engine_config(ckpt, field, value, match):
    with pytest.raises(ValueError, match=match):
        SyncEngine(EngineConfig(**{"model": str(ckpt), field: value}))


def test_calls_after_close_raise(ckpt):
    llm = SyncEngine(EngineConfig(model=str(ckpt), num_kv_blocks=8))
    llm.close()
    with pytest.raises(EngineClosedError):
        llm.generate([1], SamplingParams(max_tokens=2))
