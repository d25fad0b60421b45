"""Prompt log-probs over HTTP: a real uvicorn on 127.0.0.1 serving the shipped pointer-chase model in float64
(logprobs_mode "processed", so the request's temperature / top-k reach the prompt's log-probs), checked
against the float64 oracle (tests/oracle.py). /v1/completions with echo (lm-eval local-completions'
loglikelihood request exactly as it sends it, max_tokens=0, streaming) through the official `openai` SDK,
vLLM's prompt_logprobs extra, and /generate with SGLang's logprob_start_len / top_logprobs_num (lm-eval
sglang-generate's request) through httpx."""

from __future__ import annotations

import json

import pytest
import torch

from ourobatch import EngineConfig
from ourobatch.server.app import create_app
from ourobatch.text import Tokenizer
from tests.oracle import load_oracle, processed_logprobs
from tests.server_helpers import API_KEY, MODEL, http_client, openai_client, serve

NAME = "pointer-chase"
CONFIG = EngineConfig(model=str(MODEL), dtype="float64", max_model_len=64, max_num_seqs=16, block_size=4,
                      max_num_batched_tokens=8, logprobs_mode="processed")  # chunked prefills too
TASKS = [json.loads(line) for line in (MODEL / "heldout_tasks.jsonl").read_text().splitlines()[:4]]
TOL = 1e-9
TOK = Tokenizer.from_path(MODEL)


@pytest.fixture(scope="module")
def server():
    yield from serve(create_app(CONFIG, served_model_name=NAME, api_key=API_KEY, tokenizer=TOK))


@pytest.fixture(scope="module")
def client(server):
    with http_client(server, API_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def oracle():
    return load_oracle(MODEL)


def reference(oracle, ids: list[int], temperature: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """[P - 1, vocab]: the processed log-probs at readout positions 0..P-2, loop T (greedy: temperature 1)."""
    logits = oracle.forward(ids).logits[-1]
    return torch.stack([processed_logprobs(logits[i], temperature, top_k) for i in range(len(ids) - 1)])


def loglikelihood(choice, ctxlen: int) -> tuple[float, bool]:
    """What lm-eval's local-completions parse_logprobs reads of a choice (openai_completions.py): the sum of
    token_logprobs[ctxlen:-1] (the last entry is the generated token's) and whether each of those tokens
    is the most likely one of its top_logprobs."""
    lps = choice.logprobs.token_logprobs[ctxlen:-1]
    tops = choice.logprobs.top_logprobs[ctxlen:-1]
    return sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))


def test_lm_eval_loglikelihood_request(oai, oracle):
    """lm-eval's request: temperature 0, max_tokens 1, logprobs 1, seed, echo, a batch of token-id prompts
    (context + continuation); its parse equals the oracle's log-likelihood of each continuation."""
    batch, ctxlens = [], []
    for i, task in enumerate(TASKS[:3]):
        context, continuation = task["prompt_token_ids"], task["target_token_ids"]
        if i == 2:  # a distractor: another task's answer
            continuation = TASKS[0]["target_token_ids"]
        batch.append(context + continuation)
        ctxlens.append(len(context))
    r = oai.completions.create(model=NAME, prompt=batch, temperature=0, max_tokens=1, logprobs=1, seed=1234,
                               echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice, ids, ctxlen in zip(sorted(r.choices, key=lambda c: c.index), batch, ctxlens):
        ref = reference(oracle, ids)
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 1 and lp.tokens[:len(ids)] == [TOK.token_text(t) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(ids)):
            assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=TOL)
            best = int(ref[i - 1].argmax())
            assert set(lp.top_logprobs[i]) == {TOK.token_text(ids[i]), TOK.token_text(best)}  # k + 1 at most
        offsets = [0]
        for t in lp.tokens[:-1]:
            offsets.append(offsets[-1] + len(t))
        assert lp.text_offset == offsets
        assert choice.text.startswith(TOK.decode(ids, skip_special_tokens=False))
        total, greedy = loglikelihood(choice, ctxlen)
        cont = range(ctxlen, len(ids))
        assert total == pytest.approx(sum(float(ref[i - 1, ids[i]]) for i in cont), abs=1e-8)
        assert greedy == all(int(ref[i - 1].argmax()) == ids[i] for i in cont)
    scores = [loglikelihood(c, n) for c, n in zip(r.choices, ctxlens)]
    assert scores[0][1]  # the trained model: its answer is greedy ...
    assert scores[2][0] < scores[0][0] and not scores[2][1]  # ... and the distractor less likely


def test_echo_without_generation_and_the_request_params(oai, client, oracle):
    """max_tokens=0 with echo: the prompt only, its log-probs processed with the request's temperature and
    top_k; text prompts; logprobs=0 gives the prompt token alone."""
    text = TOK.decode(TASKS[3]["prompt_token_ids"], skip_special_tokens=False)
    ids = TOK.encode(text)
    r = oai.completions.create(model=NAME, prompt=text, max_tokens=0, echo=True, logprobs=2, temperature=0.7,
                               extra_body={"top_k": 4})
    c = r.choices[0]
    assert c.text == text and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert c.logprobs.tokens == [TOK.token_text(t) for t in ids]
    ref = reference(oracle, ids, 0.7, 4)
    for i in range(1, len(ids)):
        ranked = sorted(range(ref.shape[1]), key=lambda t: (-float(ref[i - 1, t]), t))
        want = {TOK.token_text(t): max(float(ref[i - 1, t]), -9999.0) for t in [ids[i], *ranked[:2]]}
        got = c.logprobs.top_logprobs[i]
        assert list(got) == list(dict.fromkeys([TOK.token_text(ids[i]), *[TOK.token_text(t) for t in ranked[:2]]]))
        assert all(got[k] == pytest.approx(v, abs=TOL) for k, v in want.items())
        assert c.logprobs.token_logprobs[i] == pytest.approx(want[TOK.token_text(ids[i])], abs=TOL)
    body = client.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 0, "echo": True,
                                                 "logprobs": 0, "temperature": 0.7, "top_k": 4}).json()
    zero = body["choices"][0]["logprobs"]
    assert zero["token_logprobs"] == c.logprobs.token_logprobs
    assert zero["top_logprobs"][1:] == [{tok: lp} for tok, lp in zip(zero["tokens"][1:], zero["token_logprobs"][1:])]
    plain = client.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 0, "echo": True}).json()
    assert plain["choices"][0]["text"] == text and plain["choices"][0]["logprobs"] is None


def test_echo_streams_the_prompt_in_each_choices_first_chunk(oai):
    ids = TASKS[1]["prompt_token_ids"]
    kwargs = dict(model=NAME, prompt=ids, max_tokens=6, temperature=1.0, seed=3, n=2, logprobs=1, echo=True)
    plain = oai.completions.create(**kwargs)
    chunks = list(oai.completions.create(stream=True, **kwargs))
    for choice in plain.choices:
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == choice.index]
        assert mine[0].text.startswith(TOK.decode(ids, skip_special_tokens=False))
        assert mine[0].logprobs.token_logprobs[0] is None
        assert "".join(m.text for m in mine) == choice.text
        assert [t for m in mine for t in m.logprobs.tokens] == choice.logprobs.tokens
        assert [x for m in mine for x in m.logprobs.token_logprobs] == choice.logprobs.token_logprobs
    assert plain.choices[0].logprobs.token_logprobs[:len(ids)] == plain.choices[1].logprobs.token_logprobs[:len(ids)]


def test_vllm_prompt_logprobs_field(client, oracle):
    ids = TASKS[2]["prompt_token_ids"]
    body = client.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 2, "temperature": 0,
                                                 "prompt_logprobs": 3}).json()
    pl = body["choices"][0]["prompt_logprobs"]
    ref = reference(oracle, ids)
    assert pl[0] is None and len(pl) == len(ids)
    for i in range(1, len(ids)):
        ranked = sorted(range(ref.shape[1]), key=lambda t: (-float(ref[i - 1, t]), t))
        assert list(pl[i]) == [str(t) for t in dict.fromkeys([ids[i], *ranked[:3]])]
        for t, entry in pl[i].items():
            assert entry["logprob"] == pytest.approx(float(ref[i - 1, int(t)]), abs=TOL)
            assert entry["rank"] == ranked.index(int(t)) + 1 and entry["decoded_token"] == TOK.token_text(int(t))
    assert body["choices"][0]["text"] == TOK.decode(TASKS[2]["target_token_ids"][:2])
    no = client.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 2}).json()
    assert "prompt_logprobs" not in no["choices"][0]


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),  # no echo: nothing to return
    ({"prompt": [1, 2], "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": [1, 2], "prompt_logprobs": -2}, "prompt_logprobs"),
    ({"prompt": [1, 2], "echo": True, "logprobs": -3}, "logprobs"),
])
def test_bad_prompt_logprob_requests_are_400s(client, body, param):
    r = client.post("/v1/completions", json={"model": NAME, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


def test_sglang_generate_input_logprobs(client, oracle):
    """lm-eval sglang-generate's loglikelihood request, then logprob_start_len > 0 with token texts."""
    batch = [t["prompt_token_ids"] + t["target_token_ids"] for t in TASKS[:2]]
    r = client.post("/generate", json={"input_ids": batch, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                                       "logprob_start_len": 0, "top_logprobs_num": 1, "return_logprob": True})
    assert r.status_code == 200, r.text
    for out, ids, task in zip(r.json(), batch, TASKS):
        meta, ref = out["meta_info"], reference(oracle, ids)
        itl, itop = meta["input_token_logprobs"], meta["input_top_logprobs"]
        assert len(itl) == len(itop) == len(ids) and itl[0] == [None, ids[0], None] and itop[0] is None
        for i in range(1, len(ids)):
            assert itl[i][1:] == [ids[i], None]
            assert itl[i][0] == pytest.approx(float(ref[i - 1, ids[i]]), abs=TOL)
            best = int(ref[i - 1].argmax())
            assert itop[i] == [[pytest.approx(float(ref[i - 1, best]), abs=TOL), best, None]]
        ctxlen = len(task["prompt_token_ids"])
        cont = range(ctxlen, len(ids))
        assert sum(x[0] for x in itl[ctxlen:]) == pytest.approx(sum(float(ref[i - 1, ids[i]]) for i in cont), abs=1e-8)
        assert len(out["output_ids"]) == 1 and len(meta["output_token_logprobs"]) == 1
    ids = TASKS[3]["prompt_token_ids"]
    one = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                                         "logprob_start_len": 5, "return_logprob": True,
                                         "return_text_in_logprobs": True}).json()
    itl, ref = one["meta_info"]["input_token_logprobs"], reference(oracle, ids)
    assert one["meta_info"]["prompt_tokens"] == 5 + len(itl) and "input_top_logprobs" not in one["meta_info"]
    assert itl[0] == [None, ids[5], TOK.token_text(ids[5])]  # SGLang: the first entry has no log-prob
    assert [x[2] for x in itl] == [TOK.token_text(t) for t in ids[5:]]
    assert [x[0] for x in itl[1:]] == pytest.approx([float(ref[i - 1, ids[i]]) for i in range(6, len(ids))], abs=TOL)
    without = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2},
                                             "return_logprob": True}).json()
    assert "input_token_logprobs" not in without["meta_info"]  # logprob_start_len -1 (the default): none


def test_sglang_generate_streams_input_logprobs(client):
    ids = TASKS[0]["prompt_token_ids"]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "logprob_start_len": 0,
            "return_logprob": True, "top_logprobs_num": 2}
    plain = client.post("/generate", json=body).json()
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events and all(e["meta_info"]["input_token_logprobs"] == plain["meta_info"]["input_token_logprobs"]
                          for e in events)
    assert events[-1]["meta_info"]["input_top_logprobs"] == plain["meta_info"]["input_top_logprobs"]
    assert all(len(x) == 2 for x in plain["meta_info"]["input_top_logprobs"][1:])


@pytest.mark.parametrize("extra, message", [({"logprob_start_len": -2}, "logprob_start_len must be -1"),
                                            ({"logprob_start_len": 99}, "less than the prompt's length")])
def test_bad_logprob_start_len_is_a_400(client, extra, message):
    r = client.post("/generate", json={"input_ids": [1, 2, 3], "return_logprob": True, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_start_len"
    assert message in r.json()["error"]["message"]
