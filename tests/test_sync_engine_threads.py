"""Issue 10.9 and 10.11: one SyncEngine shared by threads; SyncEngine(model="path") like Engine."""

from __future__ import annotations

import threading

import pytest

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from engine.loader import load_model
from ourobatch.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("threads") / "m", seed=12)


def settings(ckpt) -> dict:
    return dict(model=str(ckpt), dtype="float64", mode="deferred", deep_interval=3, block_size=4,
                num_kv_blocks=512, max_model_len=64, max_num_seqs=64)


def workload(thread: int) -> list[tuple[list[int], SamplingParams]]:
    return [([1 + (thread * 7 + i) % 20, 2 + i % 5], SamplingParams(max_tokens=3 + (i % 6), temperature=0.9,
                                                                    seed=1000 * thread + i))
            for i in range(50)]


def test_four_threads_sharing_one_sync_engine_get_single_threaded_outputs(ckpt):
    with SyncEngine(**settings(ckpt)) as llm:
        expected = {t: [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                        for o in llm.generate_batch([p for p, _ in workload(t)], [s for _, s in workload(t)])]
                    for t in range(4)}
        got: dict[int, list] = {}
        errors: list[BaseException] = []
        start = threading.Barrier(4)

        def worker(t: int) -> None:
            try:
                start.wait()
                outs = []
                for prompt, params in workload(t):  # one request per call, interleaved with other threads
                    o = llm.generate(prompt, params)
                    outs.append((o.outputs[0].token_ids, o.outputs[0].logprobs))
                got[t] = outs
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not any(th.is_alive() for th in threads), "a thread never returned"
        assert not errors, errors
        for t in range(4):
            assert [tok for tok, _ in got[t]] == [tok for tok, _ in expected[t]]
            flat = [x for _, lp in got[t] for x in lp]
            assert flat == pytest.approx([x for _, lp in expected[t] for x in lp], abs=1e-9)
        assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["num_running"] == 0


def test_threads_with_batches_share_steps(ckpt):
    with SyncEngine(**settings(ckpt)) as llm:
        results: dict[int, list] = {}

        def worker(t: int) -> None:
            results[t] = llm.generate_batch([p for p, _ in workload(t)], [s for _, s in workload(t)])

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert sorted(results) == [0, 1, 2, 3]
    with SyncEngine(**settings(ckpt)) as alone:
        for t in range(4):
            ref = alone.generate_batch([p for p, _ in workload(t)], [s for _, s in workload(t)])
            assert [o.outputs[0].token_ids for o in results[t]] == [o.outputs[0].token_ids for o in ref]


def test_sync_engine_takes_a_model_path_like_engine(ckpt):
    with SyncEngine(**settings(ckpt)) as by_path:  # before: TypeError (model= meant a loaded model)
        a = by_path.generate([3, 4], SamplingParams(max_tokens=5, seed=2))
    import torch

    model = load_model(ckpt, torch.float64)
    with SyncEngine(EngineConfig(**settings(ckpt)), loaded_model=model) as shared:
        b = shared.generate([3, 4], SamplingParams(max_tokens=5, seed=2))
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    with pytest.raises(TypeError, match="either an EngineConfig or keyword arguments"):
        SyncEngine(EngineConfig(**settings(ckpt)), model=str(ckpt))
