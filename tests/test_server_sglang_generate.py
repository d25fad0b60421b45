"""SGLang's /generate as slime and AReaL call it, on a real uvicorn on 127.0.0.1 serving the shipped
pointer-chase model, with httpx: SGLang's ids (unique, abortable by the id a response carries) and finish
reasons, AReaL-shaped requests and nulls, the fields ourobatch cannot honour named in a 400, top_p with
custom_params and return_text_in_logprobs, tokens and log-probs equal to an in-process engine's. The control
routes and the slime-shaped client: tests/test_server_sglang.py."""

from __future__ import annotations

import json

import httpx
import pytest

from ourobatch import SamplingParams
from ourobatch.text import Tokenizer
from tests.server_helpers import MODEL
from tests.sglang_helpers import PROMPT, TASKS, TOL, _error
# the module's fixtures server, client, reference and gate
from tests.sglang_helpers import client_fixture, gate_fixture, reference_fixture, server_fixture  # noqa: F401


# ---------------------------------------------------------------------- /generate


def test_generate_ids_are_unique_and_abortable_without_rid(server, client, gate):
    two = {"input_ids": [PROMPT, TASKS[1]["prompt_token_ids"]], "sampling_params": {"max_new_tokens": 2}}
    ids = [o["meta_info"]["id"] for o in client.post("/generate", json=two).json()]
    one = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
    ids += [client.post("/generate", json=one).json()["meta_info"]["id"] for _ in range(2)]
    assert len(set(ids)) == 4 and all(len(i) == 32 for i in ids)  # uuid4 hex, as SGLang makes them
    samples = client.post("/generate", json={**one, "rid": "grp", "sampling_params": {
        "max_new_tokens": 2, "n": 2}}).json()
    assert [s["meta_info"]["id"] for s in samples] == ["grp:0", "grp:1"]  # the engine's ids of the samples
    # the id a response carries is the one /abort_request takes
    gate.hold(after=2)
    body = {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    with httpx.Client(base_url=server.url, timeout=120) as other, other.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        first = next(json.loads(line[6:]) for line in lines if line.startswith("data: {"))
        assert gate.entered.wait(60)
        assert client.post("/abort_request", json={"rid": first["meta_info"]["id"]}).json()["success"] is True
        gate.open()
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    finish = events[-1]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and "aborted" in finish["message"] and len(events[-1]["output_ids"]) < 40
    assert client.post("/abort_request", json={"rid": "", "abort_all": True}).json()["success"] is True  # SGLang's


def test_generate_finish_reasons_are_sglangs(client, reference):
    target = TASKS[2]["target_token_ids"]  # greedy ends at eos (0) after the answer
    eos = client.post("/generate", json={"input_ids": TASKS[2]["prompt_token_ids"], "sampling_params": {
        "max_new_tokens": 30, "temperature": 0}}).json()
    assert eos["output_ids"][-1] == 0 and eos["meta_info"]["finish_reason"] == {"type": "stop", "matched": 0}
    assert eos["output_ids"][:-1] == target[:len(eos["output_ids"]) - 1]
    assert eos["meta_info"]["e2e_latency"] > 0
    token = client.post("/generate", json={"input_ids": TASKS[2]["prompt_token_ids"], "sampling_params": {
        "max_new_tokens": 30, "temperature": 0, "stop_token_ids": [target[1]]}}).json()
    assert token["meta_info"]["finish_reason"] == {"type": "stop", "matched": target[1]}
    tok = Tokenizer.from_path(MODEL)
    word = tok.token_text(target[1]).strip()
    text = client.post("/generate", json={"input_ids": TASKS[2]["prompt_token_ids"], "sampling_params": {
        "max_new_tokens": 30, "temperature": 0, "stop": [word]}}).json()
    assert text["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    length = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}).json()
    assert length["meta_info"]["finish_reason"] == {"type": "length", "length": 1}


def test_generate_accepts_nulls_and_areal_shaped_requests(client, reference):
    ids = TASKS[3]["prompt_token_ids"]
    areal = {"input_ids": ids, "image_data": None, "return_logprob": True, "stream": False, "sampling_params": {
        "top_p": 1.0, "top_k": 100000000, "max_new_tokens": 8, "temperature": 1.0, "stop_token_ids": None,
        "ignore_eos": False, "skip_special_tokens": True, "frequency_penalty": 0.0, "sampling_seed": 5}}
    r = client.post("/generate", json=areal)
    assert r.status_code == 200, r.text
    ref = reference.generate(ids, SamplingParams(max_tokens=8, seed=5)).outputs[0]
    pairs = r.json()["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in pairs] == ref.token_ids and \
        [lp for lp, _, _ in pairs] == pytest.approx(ref.logprobs, abs=TOL)
    nulls = {"input_ids": ids, "return_logprob": None, "top_logprobs_num": None, "stream": None, "rid": None,
             "return_text_in_logprobs": None, "logprob_start_len": None, "lora_path": None,
             "custom_logit_processor": None, "return_hidden_states": False, "sampling_params": {
                 "max_new_tokens": 2, "temperature": None, "top_p": None, "stop": None, "n": None}}
    r = client.post("/generate", json=nulls)
    assert r.status_code == 200 and "output_token_logprobs" not in r.json(), r.text


@pytest.mark.parametrize("field, value", [
    ("custom_logit_processor", "{\"callable\": \"x\"}"), ("image_data", "http://x/cat.png"),
    ("lora_path", "adapter"), ("return_hidden_states", True), ("return_routed_experts", True),
])
def test_generate_fields_that_ask_for_what_ourobatch_cannot_do_are_named(client, field, value):
    err = _error(client.post("/generate", json={"input_ids": PROMPT, field: value}), 400, field)
    assert err["message"].startswith(f"{field}=")


def test_top_p_below_1_with_custom_params_matches_the_engine(client, reference):
    ids = TASKS[4]["prompt_token_ids"]
    ref = reference.generate(ids, SamplingParams(max_tokens=8, top_p=0.8, seed=21, ignore_eos=True)).outputs[0]
    for custom in (None, {}, {"threshold": 0.5}):  # custom_params feeds only a custom logit processor
        r = client.post("/generate", json={"input_ids": ids, "return_logprob": True, "sampling_params": {
            "max_new_tokens": 8, "top_p": 0.8, "sampling_seed": 21, "ignore_eos": True, "custom_params": custom}})
        assert r.status_code == 200, r.text
        pairs = r.json()["output_token_logprobs"]
        assert [t for _, t, _ in pairs] == ref.token_ids
        assert [lp for lp, _, _ in pairs] == pytest.approx(ref.logprobs, abs=TOL)
    err = _error(client.post("/generate", json={"input_ids": ids, "sampling_params": {
        "top_p": 0.8, "custom_params": {"return_top_p_token_ids": True}}}), 400, "sampling_params")
    assert "custom_params.return_top_p_token_ids" in err["message"]
    assert _error(client.post("/generate", json={"input_ids": ids, "sampling_params": {"custom_params": [1]}}),
                  400, "sampling_params")


def test_return_text_in_logprobs_fills_the_triples(client):
    tok = Tokenizer.from_path(MODEL)
    body = {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    plain = client.post("/generate", json=body).json()["meta_info"]
    assert all(text is None for _, _, text in plain["output_token_logprobs"])
    named = client.post("/generate", json={**body, "return_text_in_logprobs": True}).json()["meta_info"]
    assert [text for _, _, text in named["output_token_logprobs"]] == \
        [tok.token_text(t) for _, t, _ in named["output_token_logprobs"]]
    assert all(text == tok.token_text(t) for top in named["output_top_logprobs"] for _, t, text in top)
    assert [lp for lp, _, _ in named["output_token_logprobs"]] == [lp for lp, _, _ in plain["output_token_logprobs"]]


def test_cached_tokens_report_the_prompt_blocks_the_prefix_cache_served(client, server):
    core = server.server.config.app.state.engine.core
    block = core.scheduler.config.block_size
    prompt = TASKS[5]["prompt_token_ids"][::-1]  # not sent by another test of this module
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    hits = core.stats()["prefix_cache_hits"]
    first = client.post("/generate", json=body).json()["meta_info"]["cached_tokens"]
    second = client.post("/generate", json=body).json()["meta_info"]["cached_tokens"]
    assert first == 0 and second == len(prompt) // block * block > 0  # whole blocks only
    assert core.stats()["prefix_cache_hits"] - hits == second
