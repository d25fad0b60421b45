"""What the SGLang-route tests share (tests/test_server_sglang.py, tests/test_server_sglang_generate.py): the
shipped pointer-chase model's held-out tasks, the tolerance for log-probs from other batch compositions,
readers of the served engine's stats and of a named error, and the fixtures each of those modules imports:
its own uvicorn serving the model (module scope), an httpx client, the in-process reference engine and a
gate on the served engine's steps (the names the tests take: server, client, reference, gate)."""

from __future__ import annotations

import json

import httpx
import pytest

from ourobatch import EngineConfig, SyncEngine
from ourobatch.server.app import create_app
from ourobatch.text import Tokenizer
from tests.server_helpers import MODEL, gated_engine, http_client, serve

CONFIG = EngineConfig(model=str(MODEL), max_model_len=64, max_num_seqs=64)
TASKS = [json.loads(line) for line in (MODEL / "heldout_tasks.jsonl").read_text().splitlines()[:8]]
PROMPT = TASKS[0]["prompt_token_ids"]
HEALTH_TIMEOUT = 2.0  # seconds: this app's health_check_timeout
TOL = 1e-4  # float32, different batch compositions


@pytest.fixture(scope="module", name="server")
def server_fixture():
    yield from serve(create_app(CONFIG, tokenizer=Tokenizer.from_path(MODEL), health_check_timeout=HEALTH_TIMEOUT))


@pytest.fixture(scope="module", name="client")
def client_fixture(server):
    with http_client(server) as c:
        yield c


@pytest.fixture(scope="module", name="reference")
def reference_fixture():
    with SyncEngine(CONFIG) as engine:
        yield engine


@pytest.fixture(name="gate")
def gate_fixture(server):
    with gated_engine(server) as gated:
        yield gated


def _stats(server) -> dict:
    return server.server.config.app.state.engine.stats()


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and (param is None or err["param"] == param), err
    return err
