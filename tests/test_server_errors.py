"""The HTTP server's refusals (issue 19, items 9 and 13), against a real uvicorn on 127.0.0.1 and the real
engine: every named engine error answers its status with the JSON error body on a connection that stays
open, a bad weight_version aborts nothing, an engine that dies mid-stream ends the stream with an error
event, a body over --max-request-bytes is a 413, a text too long for max_model_len is refused untokenized,
and tokenizing runs off the event loop (/health answers while the tokenizer is provably blocked)."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time

import httpx
import openai
import pytest

import scheduler.errors as named
from ourobatch import EngineConfig, SamplingParams
from ourobatch.runtime.engine_core import check_new_request
from ourobatch.server.app import create_app
from ourobatch.server.cli import build_parser
from ourobatch.server.errors import STATUS, BadRequest, error_response, field_of, status_of
from ourobatch.server.limits import DEFAULT_MAX_COMPLETIONS, DEFAULT_MAX_REQUEST_BYTES, MAX_CHARS_PER_TOKEN
from ourobatch.server.runner import in_prompt
from ourobatch.text import Tokenizer
from tests.helpers import GatedExecutor
from tests.server_helpers import MODEL, ThreadServer, metric_values

NAME = "pointer-chase"
CONFIG = EngineConfig(model=str(MODEL), max_model_len=64, max_num_seqs=16)
LIMIT = 64 * 1024  # this module's --max-request-bytes
PROMPT = json.loads((MODEL / "heldout_tasks.jsonl").read_text().splitlines()[0])["prompt_token_ids"]
LONG = {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True,
                                                                  "temperature": 1.0}}


class GatedTokenizer:
    """The model's tokenizer, recording the length of each text it encodes; after hold(), encode() waits
    (on whatever thread calls it) until release()."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.lengths: list[int] = []
        self.held = False
        self.entered = threading.Event()
        self.released = threading.Event()

    def hold(self) -> None:
        self.entered.clear()
        self.released.clear()
        self.held = True

    def release(self) -> None:
        self.held = False
        self.released.set()

    def encode(self, text: str, **kw) -> list[int]:
        self.lengths.append(len(text))
        if self.held:
            self.entered.set()
            assert self.released.wait(60), "the tokenizer was never released"
        return self.inner.encode(text, **kw)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _serve(tokenizer=None):
    app = create_app(CONFIG, served_model_name=NAME, tokenizer=tokenizer or Tokenizer.from_path(MODEL),
                     max_request_bytes=LIMIT)
    return ThreadServer(app)


@pytest.fixture(scope="module")
def tok():
    return GatedTokenizer(Tokenizer.from_path(MODEL))


@pytest.fixture(scope="module")
def server(tok):
    with _serve(tok) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _gate(server) -> GatedExecutor:
    core = server.server.config.app.state.engine.core
    gated = GatedExecutor(core.executor)
    core.executor = gated
    return gated


@pytest.fixture
def gate(server):
    """Holds engine steps on the worker thread (tests/helpers.py), so a request is provably mid-flight."""
    gated = _gate(server)
    yield gated
    gated.open()
    server.server.config.app.state.engine.core.executor = gated.inner


def _port(r: httpx.Response) -> int:
    """The client side's port of the connection that carried `r`: equal ports, one kept-alive connection."""
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def _error(r: httpx.Response, status: int, kind: str) -> dict:
    assert r.status_code == status and r.headers["content-type"] == "application/json", (r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == kind and err["code"] == status, err
    return err


def _next_event(lines) -> dict:
    """The next JSON event of an SSE response (the connection's next data line)."""
    for line in lines:
        if line.startswith("data: {"):
            return json.loads(line[6:])
    raise AssertionError("the stream ended first")


def _events(lines) -> list:
    """The rest of an SSE response: each JSON event, and "DONE" for data: [DONE]."""
    out = []
    for line in lines:
        if line.startswith("data: {"):
            out.append(json.loads(line[6:]))
        elif line == "data: [DONE]":
            out.append("DONE")
    return out


def test_every_named_error_has_its_status():
    expected = {"InvalidTransition": 500, "RequestRejectedError": 400, "CheckpointError": 400,
                "EngineClosedError": 503, "EngineDeadError": 503, "ReplicaDiedError": 503, "EngineBusyError": 409,
                "EngineAsleepError": 503, "WeightUpdateError": 400, "InconsistentWeightsError": 503,
                "OurobatchError": 500}
    import ourobatch.ray.errors as pool_errors  # ReplicaDiedError: the pool's, mapped by its base class

    classes = {n: c for module in (named, pool_errors) for n, c in vars(module).items()
               if isinstance(c, type) and issubclass(c, named.OurobatchError)}
    assert set(classes) == set(expected)  # a new named error needs a row (or knowingly inherits one)
    assert {n: status_of(c("x"))[0] for n, c in classes.items()} == expected
    assert status_of(ValueError("x")) == status_of(TypeError("x")) == (400, "BadRequestError")
    assert status_of(KeyError("x"))[0] == 500 and STATUS[named.EngineBusyError] == (409, "ConflictError")


def _with_field(exc: BaseException, field: str) -> BaseException:
    exc.field = field
    return exc


def test_a_bad_input_error_names_its_field_as_data():
    """The body's param is the error's `field` attribute when it has one, whatever its message says; an
    error without one has no param, even when its message names a field (nothing is parsed out of it)."""
    def param(exc: BaseException) -> str | None:
        return json.loads(error_response(exc).body)["error"]["param"]

    assert param(_with_field(ValueError("must be in (0, 1], got 3"), "top_p")) == "top_p"
    assert param(_with_field(TypeError("SamplingParams.top_k must be an int"), "n")) == "n"  # the attribute wins
    assert param(_with_field(named.RequestRejectedError("too long"), "prompt")) == "prompt"
    assert param(BadRequest("give exactly one of input_ids or text", "input_ids")) == "input_ids"
    assert field_of(ValueError("SamplingParams.stop=['x']: stop strings need a tokenizer")) is None
    # the engine front's two checks (ourobatch/runtime/engine_core.py check_new_request) carry theirs as data
    with pytest.raises(ValueError) as stop:
        check_new_request(SamplingParams(stop=["x"]), None, 4, {})
    with pytest.raises(named.RequestRejectedError) as many:
        check_new_request(SamplingParams(n=9), None, 4, {})
    assert (field_of(stop.value), field_of(many.value)) == ("stop", "n")
    assert type(stop.value) is ValueError and param(many.value) == "n"
    assert field_of(ValueError("prompt_token_ids[0] = 99 is outside the vocabulary")) is None
    assert param(BadRequest("no field")) is None


# Every SamplingParams check: a bad value and the field its error must carry, written out here (not read
# from the code under test). The message still names the same field after "SamplingParams.", where the
# server's param was parsed from before the checks set it: every 400's param is unchanged.
BAD_SAMPLING = [
    ({"n": 0}, "n"), ({"n": 1.5}, "n"), ({"temperature": -1}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": float("nan")}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"),
    ({"min_p": float("inf")}, "min_p"), ({"seed": -1}, "seed"), ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids[i]"), ({"stop_token_ids": ["a"]}, "stop_token_ids[i]"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"max_tokens": 0}, "max_tokens"), ({"logprobs": -2}, "logprobs"),
    ({"prompt_logprobs": "x"}, "prompt_logprobs"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"repetition_penalty": 1.3}, "repetition_penalty"), ({"stop": 3}, "stop"), ({"stop": ["a", ""]}, "stop"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"), ({"detokenize": None}, "detokenize"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens"), ({"output_kind": "bogus"}, "output_kind"),
]


@pytest.mark.parametrize("bad, field", BAD_SAMPLING)
def test_every_sampling_params_check_carries_its_field_as_data(bad, field):
    with pytest.raises((ValueError, TypeError)) as info:
        SamplingParams(**bad)
    exc = info.value
    assert type(exc) in (ValueError, TypeError)  # the plain classes callers catch
    assert exc.field == field and field_of(exc) == field
    assert re.search(rf"SamplingParams\.{re.escape(field)}[= ]", str(exc)), str(exc)
    assert json.loads(error_response(exc).body)["error"]["param"] == field


def test_an_error_named_for_its_prompt_keeps_its_class_and_field():
    again = in_prompt(_with_field(ValueError("SamplingParams.n=9 exceeds max_num_seqs"), "n"), 1, 3)
    assert type(again) is ValueError and str(again) == "prompt 1: SamplingParams.n=9 exceeds max_num_seqs"
    assert field_of(again) == "n"
    alone = in_prompt(TypeError("request_id must be a non-empty str"), 0, 1)
    assert type(alone) is TypeError and str(alone) == "request_id must be a non-empty str"
    assert field_of(alone) is None and not hasattr(alone, "field")


def test_weights_missing_after_sleep_2_is_a_503_on_a_connection_that_stays_open(server, client):
    assert client.post("/sleep", json={"level": 2}).status_code == 200
    first = client.post("/wake_up")
    try:
        assert first.status_code == 200, first.text
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        for stream in (False, True):
            r = client.post("/generate", json={**body, "stream": stream})
            assert _error(r, 503, "ServiceUnavailableError")["message"].startswith("InconsistentWeightsError: ")
            assert _port(r) == _port(first)
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as refused:
            oai.completions.create(model=NAME, prompt=PROMPT, max_tokens=2)
        assert refused.value.status_code == 503 and "InconsistentWeightsError" in refused.value.message
        loaded = client.post("/update_weights_from_disk", json={"model_path": str(MODEL)})
        assert loaded.status_code == 200 and _port(loaded) == _port(first), loaded.text
        again = client.post("/generate", json=body)
        assert again.status_code == 200 and len(again.json()["output_ids"]) == 2 and _port(again) == _port(first)
    finally:  # the weights back for the other tests, whatever happened (on a new connection)
        httpx.post(server.url + "/update_weights_from_disk", json={"model_path": str(MODEL)}, timeout=60)


def test_an_update_while_requests_run_unpaused_is_a_409(server, client, gate):
    gate.hold(after=2)  # the prefill and a decode step run, the next is held in flight
    with httpx.Client(base_url=server.url, timeout=60) as other, other.stream("POST", "/generate", json=LONG) as r:
        lines = r.iter_lines()  # (keep it: a dropped line iterator closes the response)
        _next_event(lines)
        assert gate.entered.wait(60)
        busy = client.post("/update_weights_from_disk", json={"model_path": str(MODEL)})
        assert _error(busy, 409, "ConflictError")["message"].startswith("EngineBusyError: ")
        gate.open()
        events = _events(lines)
    assert events[-1] == "DONE" and len(events[-2]["output_ids"]) == 12
    health = client.get("/health")
    assert health.status_code == 200 and _port(health) == _port(busy)


def test_a_bad_weight_version_or_model_path_aborts_nothing(server, client, gate):
    gate.hold(after=2)
    with httpx.Client(base_url=server.url, timeout=60) as other, other.stream("POST", "/generate", json=LONG) as r:
        lines = r.iter_lines()
        first = [_next_event(lines)]
        assert gate.entered.wait(60)
        for version in ("v7", -1, 1.5, True):
            bad = client.post("/update_weights_from_disk", json={"model_path": str(MODEL), "weight_version": version,
                                                                 "abort_all_requests": True})
            err = _error(bad, 400, "BadRequestError")
            assert err["param"] == "weight_version" and "decimal digits" in err["message"], err
        missing = client.post("/update_weights_from_disk", json={"model_path": str(MODEL / "nope"),
                                                                 "abort_all_requests": True})
        assert _error(missing, 400, "BadRequestError")["message"].startswith("CheckpointError: ")
        gate.open()
        events = first + _events(lines)
    assert events[-1] == "DONE"
    assert events[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}  # not aborted
    numeric = client.post("/update_weights_from_disk", json={"model_path": str(MODEL), "weight_version": "7"})
    assert numeric.status_code == 200 and numeric.json()["weight_version"] == 7, numeric.text
    assert client.get("/get_weight_version").json() == {"weight_version": 7}


class _Broken:
    def execute(self, plan):
        raise RuntimeError("device lost")


def test_an_engine_that_dies_mid_stream_ends_the_stream_with_an_error_event():
    added = "ourobatch_requests_added_total"
    with _serve() as srv, httpx.Client(base_url=srv.url, timeout=60) as client, \
            httpx.Client(base_url=srv.url, timeout=60) as scraper:
        gate = _gate(srv)
        gate.hold(after=2)
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "stream": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool, client.stream("POST", "/v1/completions",
                                                                           json=body) as r:
            try:
                lines = r.iter_lines()
                _next_event(lines)
                assert gate.entered.wait(60)
                before = metric_values(scraper)[added]
                plain = pool.submit(httpx.post, srv.url + "/generate",
                                    json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}},
                                    timeout=60)
                for _ in range(10_000):  # each scrape is a round trip (no sleep): until the plain one is queued
                    if metric_values(scraper)[added] > before:
                        break
                assert metric_values(scraper)[added] == before + 1
                gate.inner = _Broken()
            finally:
                gate.open()
            events = _events(lines)  # ends without a protocol error: the stream closed cleanly
            dead = plain.result()
        assert events[-1] == "DONE" and events[-2]["error"]["code"] == 503, events
        assert events[-2]["error"]["message"].startswith("EngineDeadError: ")
        assert _error(dead, 503, "ServiceUnavailableError")["message"].startswith("EngineDeadError: ")
        later = client.post("/generate", json={"input_ids": PROMPT})  # on the stream's connection
        assert _error(later, 503, "ServiceUnavailableError")["message"].startswith("EngineDeadError: ")
        assert _port(later) == _port(r) and client.get("/health").status_code == 503


def test_a_body_over_the_limit_is_a_413_on_a_connection_that_stays_open(client):
    sized = client.post("/generate", content=b"x" * (LIMIT + 1), headers={"content-type": "application/json"})
    assert _error(sized, 413, "RequestTooLargeError")["param"] == "body"
    chunks = (b"y" * 4096 for _ in range(LIMIT // 4096 + 2))  # a generator: sent chunked, no length declared
    chunked = client.post("/generate", content=chunks, headers={"content-type": "application/json"})
    assert "content-length" not in chunked.request.headers
    _error(chunked, 413, "RequestTooLargeError")
    ok = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200, ok.text
    assert _port(sized) == _port(chunked) == _port(ok)
    fits = client.post("/generate", json={"input_ids": [PROMPT[0]] * (LIMIT // 8), "sampling_params": {}})
    assert fits.status_code == 400 and "max_model_len" in fits.json()["error"]["message"]  # read, then refused


def test_the_body_limit_is_a_server_option():
    parser = build_parser()
    assert parser.parse_args(["--model", "m"]).max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == 8 * 1024 * 1024
    assert parser.parse_args(["--model", "m", "--max-request-bytes", "1000"]).max_request_bytes == 1000
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--max-request-bytes", "0"])
    with pytest.raises(ValueError, match="max_request_bytes"):
        create_app(CONFIG, max_request_bytes=0)


def test_a_request_for_more_completions_than_the_limit_is_refused_before_queueing(server, client, monkeypatch):
    parser = build_parser()
    assert parser.parse_args(["--model", "m"]).max_completions_per_request == DEFAULT_MAX_COMPLETIONS == 16384
    assert parser.parse_args(["--model", "m", "--max-completions-per-request", "8"]).max_completions_per_request == 8
    with pytest.raises(ValueError, match="max_completions_per_request"):
        create_app(CONFIG, max_completions_per_request=0)
    assert create_app(CONFIG, max_completions_per_request=7).state.served.max_completions == 7
    monkeypatch.setattr(server.server.config.app.state.gen, "max_completions", 4)
    added = metric_values(client)["ourobatch_requests_added_total"]
    ids = [1, 200, 231, 74]
    for route, body in [("/v1/completions", {"model": NAME, "prompt": [ids] * 3, "n": 2, "max_tokens": 1}),
                        ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "n1"}],
                                                  "n": 5, "max_tokens": 1}),
                        ("/generate", {"input_ids": [ids] * 5, "sampling_params": {"max_new_tokens": 1}})]:
        r = client.post(route, json=body)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"] if "error" in r.json() else r.text
        assert "more than the server's --max-completions-per-request=4" in message
    assert metric_values(client)["ourobatch_requests_added_total"] == added  # nothing was queued
    ok = client.post("/v1/completions", json={"model": NAME, "prompt": [ids] * 2, "n": 2, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_a_request_with_one_bad_prompt_leaves_no_trace_in_the_engine(server, client):
    # every prompt is checked before any is queued: no completion added, none aborted, nothing prefilled, on every
    # route that takes many prompts; the bad one is named by its index. Past QUEUE_SLICE prompts the event loop
    # (and so the engine) runs between slices, which is when queued prompts used to be stepped
    from ourobatch.server.runner import QUEUE_SLICE

    keys = ["ourobatch_requests_added_total", "ourobatch_requests_finished_total{finish_reason=abort}",
            "ourobatch_prefill_tokens_total"]
    engine = server.server.config.app.state.engine
    for _ in range(10_000):  # another test's request still ending would move the counts: start idle
        stats = engine.stats()
        if stats["num_running"] == stats["num_waiting"] == 0:
            break
        time.sleep(0.01)
    before = metric_values(client)
    good, bad = [1, 200, 231, 74], [1, 10**6]
    many = [good] * (QUEUE_SLICE + 3) + [bad]
    for route, body in [("/v1/completions", {"model": NAME, "prompt": many, "max_tokens": 1}),
                        ("/generate", {"input_ids": many, "sampling_params": {"max_new_tokens": 1}})]:
        r = client.post(route, json=body)
        assert r.status_code == 400 and f"prompt {QUEUE_SLICE + 3}:" in r.text, r.text
    after = metric_values(client)
    assert {k: after[k] for k in keys} == {k: before[k] for k in keys}


def test_an_unknown_route_or_method_is_answered_in_openais_error_body(client):
    for method, path, status, kind, detail in [
            ("GET", "/v1/completions", 405, "MethodNotAllowedError", "Method Not Allowed"),
            ("POST", "/v1/nothing", 404, "NotFoundError", "Not Found")]:
        r = client.request(method, path)
        assert r.status_code == status
        assert r.json() == {"error": {"message": f"{method} {path}: {detail}", "type": kind, "param": None,
                                      "code": status}}
    assert "POST" in client.get("/v1/completions").headers["allow"]


def test_the_port_must_be_a_tcp_port(capsys):
    parser = build_parser()
    assert parser.parse_args(["--model", "m", "--port", "0"]).port == 0
    for bad in ("65536", "-1", "http"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--model", "m", "--port", bad])
        assert f"--port: expected a TCP port 0-65535 (0: any free port), got '{bad}'" in capsys.readouterr().err


def test_a_text_too_long_for_max_model_len_is_refused_before_tokenizing(client, tok):
    long = "n1>n2 " * (64 * MAX_CHARS_PER_TOKEN // 6 + 1)
    assert len(long) > 64 * MAX_CHARS_PER_TOKEN
    before = len(tok.lengths)
    r = client.post("/v1/completions", json={"model": NAME, "prompt": long, "max_tokens": 1})
    assert _error(r, 400, "BadRequestError")["param"] == "prompt" and "max_model_len=64" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": NAME, "prompt": ["n1>n2", long], "max_tokens": 1})
    assert _error(r, 400, "BadRequestError")["param"] == "prompt[1]"
    r = client.post("/generate", json={"text": long})
    assert _error(r, 400, "BadRequestError")["param"] == "text"
    assert tok.lengths[before:] == []  # not one text tokenized, not even the short one beside it
    short = client.post("/generate", json={"text": "n1>n2", "sampling_params": {"max_new_tokens": 1}})
    assert short.status_code == 200 and tok.lengths[before:] == [5]


def test_health_answers_while_a_prompt_tokenizes(server, tok):
    body = {"model": NAME, "prompt": "<|im_start|> n1>n2 n2>n3 ? n1", "max_tokens": 2}
    with concurrent.futures.ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server.url, timeout=10) as c:
        tok.hold()
        try:
            pending = pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=60)
            assert tok.entered.wait(30)  # the tokenizer runs, and stays blocked until released
            assert c.get("/health").status_code == 200  # the event loop is free meanwhile
            assert c.get("/metrics").status_code == 200 and not pending.done()
        finally:
            tok.release()
        assert pending.result().status_code == 200


def test_queueing_many_prompts_lets_the_event_loop_run_between_slices(tmp_path):
    # /health and other requests' streams must not wait for one request's whole prompt list to be queued
    import anyio

    from ourobatch import Engine
    from ourobatch.server.runner import QUEUE_SLICE, open_streams
    from ourobatch.testing import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "m", eos_token_id=None)
    num = 2 * QUEUE_SLICE + 5
    seen: list[int] = []

    async def main() -> None:
        async with Engine(EngineConfig(model=str(ckpt), num_kv_blocks=64, max_num_seqs=4)) as engine:
            async def watch() -> None:
                while len(seen) < 1000 and (not seen or seen[-1] < num):
                    seen.append(len(engine.core.parents))
                    await anyio.lowlevel.checkpoint()

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                await anyio.lowlevel.checkpoint()  # the watcher's first look: nothing queued yet
                streams = await open_streams(engine, [[1, 2]] * num, [SamplingParams(max_tokens=1)] * num)
                for s in streams:
                    await s.aclose()
                tg.cancel_scope.cancel()

    anyio.run(main)
    assert seen[0] == 0 and any(0 < k < num for k in seen)  # it looked while the list was half queued
    assert all(k % QUEUE_SLICE == 0 for k in seen if 0 < k < num)  # between whole slices only
