"""The served engine keeps its async scheduling: the metrics wrapper (server/metrics.py TimedExecutor)
forwards launch(), so steps are planned ahead under the real server too, with the same outputs."""

from __future__ import annotations

import json

import pytest

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.server.app import create_app
from ourobatch.server.metrics import TimedExecutor
from ourobatch.text import Tokenizer
from tests.server_helpers import MODEL, http_client, metric_values, serve

CONFIG = EngineConfig(model=str(MODEL), max_model_len=64, max_num_seqs=16, async_scheduling=True)
TASKS = [json.loads(line) for line in (MODEL / "heldout_tasks.jsonl").read_text().splitlines()[:6]]


@pytest.fixture(scope="module")
def server():
    yield from serve(create_app(CONFIG, served_model_name="m", tokenizer=Tokenizer.from_path(MODEL)))


def test_served_steps_are_planned_ahead_and_timed(server, monkeypatch):
    engine = server.server.config.app.state.engine
    assert isinstance(engine.core.executor, TimedExecutor)
    inner = object.__getattribute__(engine.core.executor, "_inner")
    calls = {"launch": 0, "execute": 0}
    for name in calls:  # count the real executor's entry points (an execute() is a step run without overlap)
        def spy(plan, _real=getattr(inner, name), _name=name):
            calls[_name] += 1
            return _real(plan)
        monkeypatch.setattr(inner, name, spy)
    before = engine.stats()
    body = {"prompt": [t["prompt_token_ids"] for t in TASKS], "max_tokens": 12, "temperature": 1.0, "seed": 3,
            "ignore_eos": True, "return_token_ids": True}
    with http_client(server) as client:
        r = client.post("/v1/completions", json=dict(body, model="m"))
        assert r.status_code == 200, r.text
        values = metric_values(client)
    after = engine.stats()
    assert after["lookahead_steps"] > before["lookahead_steps"], "no step was planned while the one before ran"
    assert calls["launch"] > 0 and calls["execute"] == 0, calls
    assert values["ourobatch_step_seconds_count"] >= after["steps"] - before["steps"] > 0
    # the same tokens as a blocking engine without lookahead, for the same per-prompt seeds
    with SyncEngine(EngineConfig(model=str(MODEL), max_model_len=64, async_scheduling=False)) as ref:
        params = [SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True) for _ in TASKS]
        want = [o.outputs[0].token_ids for o in ref.generate_batch([t["prompt_token_ids"] for t in TASKS], params)]
    got = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in got] == want
