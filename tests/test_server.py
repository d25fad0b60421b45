"""The HTTP server, started for real on 127.0.0.1 (one per module) on the shipped pointer-chase model:
the official `openai` client, httpx for /generate and the control routes, outputs compared with an
in-process engine for the same seeds, disconnects, bad input, /metrics and the API key."""

from __future__ import annotations

import asyncio
import json
import socket
import struct

import httpx
import openai
import pytest

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.server.app import create_app
from ourobatch.text import Tokenizer
from tests.server_helpers import API_KEY, MODEL, auth, gated_engine, http_client, metric_values, openai_client, serve

NAME = "pointer-chase"
CONFIG = EngineConfig(model=str(MODEL), max_model_len=64, max_num_seqs=128)
TASKS = [json.loads(line) for line in (MODEL / "heldout_tasks.jsonl").read_text().splitlines()[:80]]
TOL = 1e-4  # float32, different batch compositions


@pytest.fixture(scope="module")
def server():
    yield from serve(create_app(CONFIG, served_model_name=NAME, api_key=API_KEY, tokenizer=Tokenizer.from_path(MODEL)))


@pytest.fixture(scope="module")
def client(server):
    with http_client(server, API_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def reference():
    """The in-process engine the server's outputs must equal (same checkpoint, same seeds)."""
    with SyncEngine(CONFIG) as engine:
        yield engine


def _tokens(logprobs) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs.tokens]


def test_openai_client_completions_match_the_engine(oai, reference):
    ids = [t["prompt_token_ids"] for t in TASKS[:2]]
    params = SamplingParams(n=2, temperature=1.3, seed=11, max_tokens=8, logprobs=2)
    ref = reference.generate_batch(ids, params)
    r = oai.completions.create(model=NAME, prompt=ids, n=2, temperature=1.3, seed=11, max_tokens=8, logprobs=2,
                               extra_body={"return_tokens_as_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.prompt_tokens == sum(map(len, ids))
    for choice, expected in zip(r.choices, [c for o in ref for c in o.outputs]):
        assert _tokens(choice.logprobs) == expected.token_ids
        assert choice.logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=TOL)
        assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs)
        assert choice.finish_reason == expected.finish_reason
    assert r.usage.completion_tokens == sum(len(c.token_ids) for o in ref for c in o.outputs)
    # text in, text out (the model's tokenizer.json), greedy = the model's answer
    tok = Tokenizer.from_path(MODEL)
    text = tok.decode(ids[0], skip_special_tokens=False)
    answer = oai.completions.create(model=NAME, prompt=text, max_tokens=8, temperature=0)
    assert answer.choices[0].text == tok.decode(TASKS[0]["target_token_ids"])
    assert answer.choices[0].finish_reason == "stop"


def test_openai_streaming_equals_the_plain_response(oai):
    prompt = TASKS[2]["prompt_token_ids"]
    plain = oai.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=1.0, seed=5, stop=["n7"])
    chunks = list(oai.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=1.0, seed=5,
                                         stop=["n7"], stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == plain.choices[0].text and finals == [plain.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_continuous_usage_nulls_and_stream_options_without_stream(oai, client):
    prompt = TASKS[2]["prompt_token_ids"]
    chunks = list(oai.completions.create(model=NAME, prompt=prompt, max_tokens=6, n=2, seed=5, stream=True,
                                         extra_body={"ignore_eos": True},
                                         stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counted = [c.usage.completion_tokens for c in chunks if c.choices]
    assert all(c.usage is not None and c.usage.prompt_tokens == len(prompt) for c in chunks)
    assert counted == sorted(counted) and counted[-1] == 12 == chunks[-1].usage.completion_tokens  # 2 x 6
    r = client.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 2, "n": None,
                                             "stream": None, "echo": None})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text  # null: the default
    r = client.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 2,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "n1"}],
                                                  "max_tokens": 1, "n": None, "stream": None, "logprobs": None})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text


def test_a_stop_string_ends_each_completion_at_once(oai, client):
    tok = Tokenizer.from_path(MODEL)
    words = tok.decode(TASKS[7]["target_token_ids"]).split()
    keys = [f"ourobatch_requests_finished_total{{finish_reason={reason}}}" for reason in ("stop", "abort")]
    before = [metric_values(client)[k] for k in keys]
    r = oai.completions.create(model=NAME, prompt=TASKS[7]["prompt_token_ids"], max_tokens=8, temperature=0, n=2,
                               stop=[words[2]], logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    for c in r.choices:
        assert c.text == " ".join(words[:2]) + " " and c.finish_reason == "stop"
        assert c.model_extra["stop_reason"] == words[2]
        assert _tokens(c.logprobs) == TASKS[7]["target_token_ids"][:3]  # up to the token that completed it
    # both ended in the engine at once (not run on to eos), and counted as the stops they are, not as aborts
    assert [metric_values(client)[k] for k in keys] == [before[0] + 2, before[1]]


def test_64_concurrent_streams_match_the_in_process_engine(server, reference):
    prompts = [t["prompt_token_ids"] for t in TASKS[:64]]
    ref = reference.generate_batch(prompts, [SamplingParams(temperature=2.0, seed=100 + i, max_tokens=6)
                                             for i in range(64)])
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)

    async def one(i: int) -> tuple[list[int], list[float]]:
        stream = await client.completions.create(model=NAME, prompt=prompts[i], max_tokens=6, temperature=2.0,
                                                 seed=100 + i, stream=True, logprobs=0,
                                                 extra_body={"return_tokens_as_token_ids": True})
        toks, lps = [], []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs:
                toks += _tokens(chunk.choices[0].logprobs)
                lps += chunk.choices[0].logprobs.token_logprobs
        return toks, lps

    async def all_streams():
        async with client:
            return await asyncio.gather(*(one(i) for i in range(64)))

    results = asyncio.run(all_streams())
    for (toks, lps), out in zip(results, ref):
        assert toks == out.outputs[0].token_ids
        assert lps == pytest.approx(out.outputs[0].logprobs, abs=TOL)
    assert len({tuple(t) for t, _ in results}) > 32  # temperature 2: the seeds, not the model, decide


def test_generate_token_in_token_out(client, reference):
    ids = TASKS[3]["prompt_token_ids"]
    ref = reference.generate(ids, SamplingParams(temperature=1.0, seed=9, max_tokens=8, stop_token_ids=(5,)))
    r = client.post("/generate", json={"input_ids": ids, "return_logprob": True, "rid": "g1", "sampling_params": {
        "max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 9, "stop_token_ids": [5], "no_stop_trim": True}})
    assert r.status_code == 200, r.text
    out, c = r.json(), ref.outputs[0]
    assert out["output_ids"] == c.token_ids
    assert [t for _, t, _ in out["output_token_logprobs"]] == c.token_ids
    assert [lp for lp, _, _ in out["output_token_logprobs"]] == pytest.approx(c.logprobs, abs=TOL)
    meta = out["meta_info"]
    assert meta["output_token_logprobs"] == out["output_token_logprobs"] and meta["id"] == "g1"
    assert meta["finish_reason"]["type"] == c.finish_reason and meta["readout_loops"] == [4] * len(c.token_ids)
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (len(ids), len(c.token_ids), 0)
    top = client.post("/generate", json={"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
                                         "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()
    tops = top["meta_info"]["output_top_logprobs"]
    assert len(tops) == 2 and all(len(t) == 2 and t[0][0] >= t[1][0] for t in tops)
    assert [t[0][1] for t in tops] == top["output_ids"]  # greedy: the best is the token
    # a batch with n = 2 in vLLM's names: a flat list, prompt-major
    batch = client.post("/generate", json={"input_ids": [ids, TASKS[4]["prompt_token_ids"]], "sampling_params": {
        "max_tokens": 3, "temperature": 0, "n": 2}}).json()
    assert len(batch) == 4 and all(b["meta_info"]["finish_reason"]["type"] == "length" for b in batch)
    assert batch[0]["output_ids"] == c.token_ids[:3] or batch[0]["output_ids"] == batch[1]["output_ids"]


def test_abort_request_and_the_control_routes(client):
    async def abort_mid_stream() -> list[dict]:
        async with httpx.AsyncClient(base_url=str(client.base_url), headers=auth(), timeout=120) as ac:
            body = {"input_ids": TASKS[5]["prompt_token_ids"], "rid": "long", "stream": True,
                    "sampling_params": {"max_new_tokens": 40, "ignore_eos": True, "temperature": 1.0}}
            events = []
            async with ac.stream("POST", "/generate", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    events.append(json.loads(line[6:]))
                    if len(events) == 1:
                        abort = await ac.post("/abort_request", json={"rid": "long"})
                        assert abort.json()["success"] is True
            return events

    events = asyncio.run(abort_mid_stream())
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort" and len(events[-1]["output_ids"]) < 40
    assert client.post("/abort_request", json={"abort_all": True}).json() == {"success": True, "aborted": 0}
    assert client.post("/abort_request", json={}).status_code == 400
    assert client.get("/get_weight_version").json() == {"weight_version": 0}
    # The RL-contract routes, each onto its Engine method.
    routes = [("/pause_generation", {"mode": "wait"}, "pause"), ("/continue_generation", None, "resume"),
              ("/flush_cache", None, "reset_prefix_cache"), ("/sleep", {"level": 1}, "sleep"),
              ("/wake_up", None, "wake_up"),
              ("/update_weights_from_disk", {"model_path": str(MODEL), "weight_version": 1}, "load_weights")]
    for route, body, method in routes:
        r = client.post(route, json=body) if body is not None else client.post(route)
        assert r.status_code == 200 and r.json()["success"] is True, (route, method, r.text)
    assert client.post("/pause_generation", json={"mode": "sometimes"}).status_code == 400
    assert client.get("/health").status_code == 200  # still serving


@pytest.fixture
def gate(server):
    """Holds engine steps on the worker thread (tests/helpers.py), so a request is provably mid-flight."""
    with gated_engine(server) as gated:
        yield gated


def _abort_count_and_kv(client) -> tuple[float, float]:
    values = metric_values(client)
    return values["ourobatch_requests_finished_total{finish_reason=abort}"], values["ourobatch_kv_blocks_used"]


def _until_aborted(client, expected_aborts: float) -> None:
    for _ in range(10_000):  # each scrape is a round trip (no sleep); the abort lands at once
        aborts, used = _abort_count_and_kv(client)
        if aborts >= expected_aborts and used == 0:
            break
    assert (aborts, used) == (expected_aborts, 0)


def test_a_client_that_disconnects_mid_stream_frees_its_kv_at_once(server, client, gate):
    before, _ = _abort_count_and_kv(client)
    body = {"model": NAME, "prompt": TASKS[6]["prompt_token_ids"], "max_tokens": 40, "ignore_eos": True,
            "stream": True}
    gate.hold(after=2)  # the prefill and one decode step run, the third is held in flight
    with httpx.Client(base_url=server.url, headers=auth(), timeout=120) as other:
        with other.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()  # (keep it: a dropped line iterator closes the response)
            next(lines)  # token 1 arrived
            assert gate.entered.wait(60)
            assert _abort_count_and_kv(client)[1] > 0  # mid-flight: it holds KV blocks
        # leaving the block closes the connection mid-stream
    _until_aborted(client, before + 1)  # freed while the step is still held


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": TASKS[6]["prompt_token_ids"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "n1>n2 ? n1"}]}),
])
def test_a_stream_whose_client_resets_before_the_first_chunk_is_aborted(server, client, gate, route, body):
    # The chat route sent its role chunks before starting the task that owns the engine stream: a client gone
    # by then left its request running to max_tokens (and its stream open) instead of aborting it.
    def counts() -> tuple[float, ...]:
        m = metric_values(client)
        return (m["ourobatch_requests_added_total"], m["ourobatch_requests_finished_total{finish_reason=abort}"],
                m["ourobatch_num_streams"], m["ourobatch_kv_blocks_used"])

    added, aborted, _, _ = counts()
    data = json.dumps({"model": NAME, **body, "max_tokens": 40, "ignore_eos": True, "stream": True}).encode()
    gate.hold(after=0)  # a step that starts is held in flight: the request cannot run to its end meanwhile
    raw = socket.create_connection(("127.0.0.1", server.port))
    raw.sendall(f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
                f"{API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    raw.close()  # a reset, before the response's first byte
    for _ in range(10_000):  # scrapes (round trips, no sleep) until the request is added and aborted
        now = counts()
        if now == (added + 1, aborted + 1, 0, 0):
            break
    assert now == (added + 1, aborted + 1, 0, 0)  # added, aborted, no stream left open, its KV freed


def test_a_client_that_gives_up_on_a_plain_request_frees_its_kv(server, client, gate):
    before, _ = _abort_count_and_kv(client)
    body = json.dumps({"model": NAME, "prompt": TASKS[6]["prompt_token_ids"], "max_tokens": 40}).encode()
    gate.hold(after=0)  # the request's prefill is held in flight
    with socket.create_connection(("127.0.0.1", server.port)) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: "
                    + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert gate.entered.wait(60)  # the request is in the engine
    _until_aborted(client, before + 1)
    assert metric_values(client)["ourobatch_num_requests_running"] == 0


@pytest.mark.parametrize("body, param", [
    ({"model": NAME, "prompt": [1, 2], "max_tokens": "many"}, "max_tokens"),
    ({"model": NAME, "prompt": [1, 2], "top_p": 3}, "top_p"),
    ({"model": NAME, "prompt": [1, 2], "repetition_penalty": 1.3}, "repetition_penalty"),
    ({"model": NAME, "prompt": [1, 2], "temprature": 1}, "temprature"),
    ({"model": NAME, "prompt": [1, 10**6]}, "prompt"),  # the engine's own checks name their field too
    ({"model": NAME, "prompt": [1, 2], "max_tokens": 100}, "max_tokens"),
    ({"model": NAME, "prompt": [], "max_tokens": 2}, "prompt"),
    ({"model": NAME, "prompt": [1, 2], "max_tokens": 0},  # without echo (tests/test_prompt_logprobs_server.py)
     "max_tokens"),
    ({"model": NAME, "prompt": [1, 2], "logprobs": -2}, "logprobs"),  # -1 is the whole vocabulary (vLLM)
    ({"model": NAME, "prompt": [1, 2], "suffix": "x"}, "suffix"),
    ({"model": NAME, "prompt": [1, 2], "logit_bias": {"3": 5.0}}, "logit_bias"),
    ({"model": NAME, "prompt": [1, 2], "n": 2, "best_of": 3}, "best_of"),
    ({"model": NAME, "prompt": [1, 2], "n": 129, "max_tokens": 1}, "n"),  # above max_num_seqs=128 (the engine's check)
])
def test_bad_input_is_a_400_naming_the_field_and_the_server_keeps_serving(client, body, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["param"] == param, err
    assert param in err["message"]
    assert client.post("/v1/completions", json={"model": NAME, "prompt": [1, 2], "max_tokens": 1}).status_code == 200


def test_more_bad_input(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"regex": "a+"}})
    assert r.status_code == 400 and "regex" in r.json()["error"]["message"]
    r = client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "max_tokens": 2}})
    assert r.status_code == 400 and "twice" in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"model": "gpt-5", "prompt": [1]}).status_code == 404
    assert httpx.get(str(client.base_url) + "/v1/models").status_code == 401  # no key
    assert httpx.get(str(client.base_url) + "/health").status_code == 200  # health needs none


def test_models_and_metrics(oai, client, server):
    assert [m.id for m in oai.models.list().data] == [NAME]
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert families["ourobatch_step_seconds"].type == "histogram"
    steps = {s.name: s.value for s in families["ourobatch_step_seconds"].samples}
    assert steps["ourobatch_step_seconds_count"] > 0
    assert {s.labels["finish_reason"] for s in families["ourobatch_requests_finished"].samples} == \
        {"stop", "length", "abort", "error"}
    values = metric_values(client)
    stats = server.server.config.app.state.engine.stats()  # the engine behind the app (no request runs now)
    assert values["ourobatch_generation_tokens_total"] == stats["tokens_generated"]
    assert values["ourobatch_kv_blocks_total"] == stats["kv_blocks_total"]
    assert values["ourobatch_weight_version"] == stats["weight_version"]
    assert values["ourobatch_scheduler_steps_total"] == stats["steps"]
    assert values['ourobatch_http_requests_total{route=/v1/completions,status=400}'] >= 9
