"""Issue 12, the engine-control half: weights in place with versions, pause / resume, sleep / wake.

References are independent of the update path: a fresh engine built from the updated checkpoint, and the
float64 oracle (tests/oracle.py) for the KV planes of requests that ran after an update.
"""

from __future__ import annotations

import anyio
import pytest
import torch
from safetensors.torch import load_file

from ourobatch import (
    Engine,
    EngineBusyError,
    EngineConfig,
    InconsistentWeightsError,
    SamplingParams,
    SyncEngine,
    WeightUpdateError,
)
from ourobatch.testing import make_tiny_checkpoint
from tests.oracle import load_oracle

from .helpers import GatedExecutor, until

MODES = [("deferred", 1), ("deferred", 4), ("eager", 3), ("verify", 3)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    return (make_tiny_checkpoint(root / "a", seed=1, eos_token_id=None),
            make_tiny_checkpoint(root / "b", seed=2, eos_token_id=None))


def config(ckpt, mode="deferred", B=4, **kw) -> EngineConfig:
    base = dict(model=str(ckpt), dtype="float64", mode=mode, deep_interval=B, block_size=4, num_kv_blocks=256,
                max_model_len=64)
    base.update(kw)
    return EngineConfig(**base)


def sp(seed, max_tokens=10) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)


PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11]]


def tensors_of(ckpt):
    return load_file(str(ckpt / "model.safetensors"))


def fresh(ckpt, mode, B):
    with SyncEngine(config(ckpt, mode, B)) as llm:
        return [llm.generate(p, sp(i)).outputs[0] for i, p in enumerate(PROMPTS)]


@pytest.mark.asyncio
@pytest.mark.parametrize("mode,B", MODES)
async def test_update_then_generate_equals_a_fresh_engine_on_the_new_weights(ckpts, mode, B):
    a, b = ckpts
    expected = fresh(b, mode, B)
    async with Engine(config(a, mode, B)) as engine:
        before = await engine.generate(PROMPTS[0], sp(0))
        assert before.outputs[0].weight_versions == [0] * 10
        gen = ((name, t) for name, t in tensors_of(b).items())  # a generator, consumed on the worker
        assert await engine.update_weights(gen) == 1
        outs = [(await engine.generate(p, sp(i))).outputs[0] for i, p in enumerate(PROMPTS)]
        for got, ref in zip(outs, expected):
            assert got.token_ids == ref.token_ids and got.readout_loops == ref.readout_loops
            assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-9)
            assert got.weight_versions == [1] * len(got.token_ids)
        assert engine.stats()["weight_version"] == 1
        assert await engine.load_weights(a, version=7) == 7  # and back, from a folder
        again = await engine.generate(PROMPTS[0], sp(0))
        assert again.outputs[0].token_ids == before.outputs[0].token_ids
        assert again.outputs[0].weight_versions == [7] * 10


def test_kv_planes_of_new_requests_are_the_new_models(ckpts):
    a, b = ckpts
    oracle = load_oracle(b)

    async def main():
        async with Engine(config(a, "deferred", 4)) as engine:
            await engine.update_weights(tensors_of(b).items())
            core = engine.core
            parent = core.add(PROMPTS[2], sp(3, 9), request_id="r")
            await until(lambda: parent.finished)
            r = parent.children[0]
            fed = list(r.prompt_token_ids) + r.output_token_ids[:-1]
            out = oracle.forward(fed)
            deep = r.num_prompt_tokens + 4 * ((r.num_output_tokens - 1) // 4)
            for loop in range(1, 5):
                n = len(fed) if loop <= 2 else deep
                for layer in range(oracle.num_layers):
                    k, v = core.executor.pool.read(loop, layer, r.block_ids, n)
                    torch.testing.assert_close(k, out.keys[loop - 1, layer, :n], atol=1e-6, rtol=0)
                    torch.testing.assert_close(v, out.values[loop - 1, layer, :n], atol=1e-6, rtol=0)

    anyio.run(main)


@pytest.mark.asyncio
@pytest.mark.parametrize("bad,match", [
    ([("model.layers.0.self_attn.q_proj.weightx", None)], "unknown tensor name"),
    ([("lm_head.weight", torch.zeros(3, 3))], "has shape"),
    ([("model.norm.weight", torch.zeros(32, dtype=torch.int32))], "floating point"),
    ([("model.norm.weight", torch.ones(32)), ("model.norm.weight", torch.ones(32))], "twice"),
    ([("model.norm.weight", torch.full((32,), float("nan")))], "NaN"),
    ("model.norm.weight", "iterable of"),
])
async def test_bad_tensors_are_rejected_and_change_nothing_or_block_serving(ckpts, bad, match):
    a, _ = ckpts
    async with Engine(config(a)) as engine:
        ref = (await engine.generate(PROMPTS[1], sp(5))).outputs[0].token_ids
        with pytest.raises((WeightUpdateError, TypeError), match=match):
            await engine.update_weights(bad)
        assert engine.stats()["weight_version"] == 0
        if match == "twice":  # the first copy went in: half-updated, refused until a full update
            with pytest.raises(InconsistentWeightsError, match="half-updated"):
                await engine.generate(PROMPTS[1], sp(5))
            assert await engine.load_weights(a) == 1
        assert (await engine.generate(PROMPTS[1], sp(5))).outputs[0].token_ids == ref


@pytest.mark.asyncio
async def test_update_while_requests_run_needs_a_pause(ckpts):
    a, b = ckpts
    async with Engine(config(a)) as engine:
        gate = GatedExecutor(engine.core.executor)
        engine.core.executor = gate
        gate.hold(2)
        stream = engine.stream(PROMPTS[0], sp(1, 30))
        await gate.wait_entered()
        with pytest.raises(EngineBusyError, match="pause"):
            await engine.update_weights(tensors_of(b).items())
        gate.open()
        async for _ in stream:
            pass


@pytest.mark.asyncio
@pytest.mark.parametrize("mode,B,held", [(m, b, 3) for m, b in MODES]
                         + [("deferred", 4, 4), ("verify", 3, 2), ("eager", 3, 1), ("deferred", 3, 1)])
async def test_pause_modes_mid_block(ckpts, mode, B, held):
    a, b = ckpts
    async with Engine(config(a, mode, B)) as engine:
        core = engine.core
        gate = GatedExecutor(core.executor)
        core.executor = gate
        # held=3: prefill + 2 decode steps run, the 3rd decode step (mid-block, verify: drafts pending) is in
        # flight when pause() is called; held=4 with B=4: the step in flight is the cohort's boundary;
        # held=1 with B=3: the 1st decode step, mid-block, where eager (no deep work pending) must flush
        # as deferred does, or its last token before the update reads loop s
        gate.hold(held)
        running = [engine.stream(p, sp(i, 24)) for i, p in enumerate(PROMPTS)]
        await gate.wait_entered()
        # "keep" while a step is in flight: it returns only after the flush, with requests frozen
        pause = anyio.Event()

        async def pauser():
            await engine.pause("keep")
            pause.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(pauser)
            while core.control.state == "running":  # the pause lands while the held step is in flight
                await anyio.lowlevel.checkpoint()
            gate.open()
        assert engine.is_paused and not core.scheduler.needs_flush()
        frozen = {r.request_id: r.num_output_tokens for r in core.scheduler.requests.values()}
        late = engine.stream([3, 3], sp(9, 5))  # queues while paused
        await engine.update_weights(tensors_of(b).items())
        await anyio.lowlevel.checkpoint()
        assert {r.request_id: r.num_output_tokens for r in core.scheduler.requests.values()
                if r.request_id in frozen} == frozen
        await engine.resume()
        outs = []
        for s in running + [late]:
            last = None
            async for o in s:
                last = o
            outs.append(last.outputs[0])
        for c in outs[:-1]:
            k = c.weight_versions.index(1)  # first token of the new weights
            assert set(c.weight_versions[:k]) == {0} and set(c.weight_versions[k:]) == {1}
            assert c.readout_loops[k - 1] == 4  # the flush was a forced boundary: its token read loop T
            assert len(c.token_ids) == 24 and c.finish_reason == "length"
        assert outs[-1].weight_versions == [1] * 5
        # "abort": partial outputs come back at once
        gate.hold(2)
        s = engine.stream(PROMPTS[2], sp(4, 40))
        await gate.wait_entered()
        gate.open()
        await engine.pause("abort")
        final = None
        async for o in s:
            final = o
        assert final.outputs[0].finish_reason == "abort" and 0 < len(final.outputs[0].token_ids) < 40
        await engine.resume()
        assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.asyncio
async def test_pause_wait_lets_running_finish_and_queues_new_ones(ckpts):
    a, _ = ckpts
    async with Engine(config(a)) as engine:
        gate = GatedExecutor(engine.core.executor)
        engine.core.executor = gate
        gate.hold(1)
        results = {}

        async def run(name, prompt, n):
            results[name] = await engine.generate(prompt, sp(1, n))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "running", PROMPTS[0], 12)
            await gate.wait_entered()
            gate.open()
            await engine.pause("wait")
            assert "running" in results and results["running"].outputs[0].finish_reason == "length"
            tg.start_soon(run, "queued", PROMPTS[1], 4)
            await until(lambda: engine.stats()["num_waiting"] == 1)
            assert engine.stats()["num_running"] == 0
            await engine.resume()
        assert results["queued"].outputs[0].finish_reason == "length"


@pytest.mark.asyncio
async def test_resume_with_recompute_kv_reprefills_kept_requests(ckpts):
    a, b = ckpts
    async with Engine(config(a, "deferred", 4)) as engine:
        gate = GatedExecutor(engine.core.executor)
        engine.core.executor = gate
        gate.hold(4)
        s = engine.stream(PROMPTS[0], sp(2, 20))
        await gate.wait_entered()
        gate.open()
        await engine.pause("keep")
        await engine.update_weights(tensors_of(b).items())
        await engine.resume(recompute_kv=True)
        last = None
        async for o in s:
            last = o
        c = last.outputs[0]
        assert c.num_preemptions == 1 and engine.stats()["recomputed_tokens"] > 0
        k = c.weight_versions.index(1)
        assert c.readout_loops[k] == 4 and len(c.token_ids) == 20


@pytest.mark.asyncio
async def test_sleep_and_wake_give_the_same_outputs(ckpts):
    a, _ = ckpts
    async with Engine(config(a, "deferred", 4)) as engine:
        before = [(await engine.generate(p, sp(i))).outputs[0].token_ids for i, p in enumerate(PROMPTS)]
        await engine.sleep(1)
        assert engine.is_sleeping and engine.core.executor.model is None and engine.core.executor.pool.k is None
        got = {}

        async def later():
            got["out"] = await engine.generate(PROMPTS[0], sp(0))

        async with anyio.create_task_group() as tg:
            tg.start_soon(later)  # waits while asleep
            await until(lambda: engine.stats()["num_waiting"] == 1)
            await engine.wake_up()
        assert got["out"].outputs[0].token_ids == before[0]
        after = [(await engine.generate(p, sp(i))).outputs[0].token_ids for i, p in enumerate(PROMPTS)]
        assert after == before
        await engine.sleep(2)  # weights dropped: nothing is served until they are loaded again
        await engine.wake_up()
        with pytest.raises(InconsistentWeightsError):
            await engine.generate(PROMPTS[0], sp(0))
        await engine.load_weights(a)
        assert (await engine.generate(PROMPTS[0], sp(0))).outputs[0].token_ids == before[0]


def test_sync_engine_updates_sleeps_and_pauses_like_the_async_one(ckpts):
    a, b = ckpts
    expected = fresh(b, "deferred", 4)
    with SyncEngine(config(a, "deferred", 4)) as llm:
        before = llm.generate(PROMPTS[0], sp(0)).outputs[0]
        assert llm.update_weights(tensors_of(b).items()) == 1
        outs = [llm.generate(p, sp(i)).outputs[0] for i, p in enumerate(PROMPTS)]
        assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
        assert all(o.weight_versions == [1] * len(o.token_ids) for o in outs)
        assert llm.load_weights(a, version=3) == 3
        llm.sleep(1)
        llm.wake_up()
        again = llm.generate(PROMPTS[0], sp(0)).outputs[0]
        assert again.token_ids == before.token_ids and again.weight_versions == [3] * 10
        llm.pause("keep")
        assert llm.is_paused
        llm.update_weights(tensors_of(b).items(), version=4)  # allowed while paused
        for reused in (4, 2):  # a version is never given twice: staleness counts them
            match = rf"version must be an int > the current weight_version \(4\).*got {reused}"
            with pytest.raises(ValueError, match=match):
                llm.update_weights(tensors_of(b).items(), version=reused)
        with pytest.raises(TypeError, match="version must be an int or None"):
            llm.update_weights(tensors_of(b).items(), version=True)
        assert llm.stats()["weight_version"] == 4
        llm.resume()
        assert llm.generate(PROMPTS[1], sp(1)).outputs[0].token_ids == expected[1].token_ids
