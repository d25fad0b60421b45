"""vLLM's server extras (issue 21 item 4) and vLLM's log-prob default in vLLM's surfaces (item 6), on a
real uvicorn on 127.0.0.1 serving the shipped pointer-chase model with the configuration `ourobatch serve`
builds: /tokenize (text and chat form), /detokenize, /tokenizer_info in vLLM 0.32's shapes;
return_token_ids; logprobs=-1 (the whole vocabulary) against the float64 oracle; vLLM's extra fields
accepted at their neutral value and a 400 naming the field otherwise; max_tokens null as vLLM 0.32 reads
it. References are the task files, the tokenizer.json vocabulary and the oracle, not the code under test."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from ourobatch.compat import VLLM_LOGPROBS_MODE
from ourobatch.llm import LLM, SamplingParams
from ourobatch.server.app import create_app
from ourobatch.server.cli import build_config, build_parser, load_tokenizer
from ourobatch.testing import make_tiny_checkpoint
from tests.oracle import load_oracle, processed_logprobs, readout_position
from tests.pointer_chase import id_to_word
from tests.server_helpers import MODEL, http_client, serve

NAME = "pc"
ARGS = build_parser().parse_args(["--model", str(MODEL), "--max-model-len", "64", "--served-model-name", NAME])
TASKS = [json.loads(line) for line in (MODEL / "heldout_tasks.jsonl").read_text().splitlines()[:4]]
WORDS = id_to_word(MODEL)
IDS = {w: i for i, w in WORDS.items()}
VOCAB = len(WORDS)


def _text(ids: list[int]) -> str:
    return " ".join(WORDS[i] for i in ids)


@pytest.fixture(scope="module")
def server():
    yield from serve(create_app(build_config(ARGS), served_model_name=NAME, tokenizer=load_tokenizer(ARGS)))


@pytest.fixture(scope="module")
def client(server):
    with http_client(server) as c:
        yield c


@pytest.fixture(scope="module")
def oracle():
    return load_oracle(MODEL)


# --------------------------------------------------------------------------- /tokenize, /detokenize, /tokenizer_info


def test_tokenize_text_and_chat_forms(client):
    task = TASKS[0]
    r = client.post("/tokenize", json={"model": NAME, "prompt": _text(task["prompt_token_ids"]),
                                       "return_token_strs": True})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": len(task["prompt_token_ids"]), "max_model_len": 64,
                        "tokens": task["prompt_token_ids"], "token_strs": [WORDS[i] for i in task["prompt_token_ids"]]}
    plain = client.post("/tokenize", json={"prompt": "n1 n2", "add_special_tokens": False}).json()
    assert (plain["tokens"], plain["token_strs"]) == ([IDS["n1"], IDS["n2"]], None)
    # the chat form renders the checkpoint's template (bos + " " + the task) before it encodes
    chat = client.post("/tokenize",
                       json={"messages": [{"role": "user", "content": _text(task["prompt_token_ids"][1:])}]})
    assert chat.status_code == 200, chat.text
    assert chat.json()["tokens"] == task["prompt_token_ids"]


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "n1 hello"}, 400, "prompt"),  # a word outside the vocabulary, named
    ({"prompt": "n1", "messages": []}, 400, "prompt"),
    ({"prompt": "n1", "model": "other"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "n1"}], "chat_template": "{{ 1 }}"}, 400, "chat_template"),
    ({"prompt": "n1", "bogus": 1}, 400, "bogus"),
])
def test_tokenize_refuses_what_it_cannot_do(client, body, status, param):
    r = client.post("/tokenize", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_detokenize_keeps_special_tokens_and_refuses_unknown_ids(client):
    ids = TASKS[1]["prompt_token_ids"] + [0]
    r = client.post("/detokenize", json={"model": NAME, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": _text(ids)}
    bad = client.post("/detokenize", json={"tokens": [3, VOCAB]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens" and str(VOCAB) in bad.text


def test_tokenizer_info_is_the_checkpoints_config(client):
    info = client.get("/tokenizer_info").json()
    config = json.loads((MODEL / "tokenizer_config.json").read_text())
    assert {k: info[k] for k in config} == config
    assert info["chat_template"] == (MODEL / "chat_template.jinja").read_text()


# --------------------------------------------------------------------------- /v1/completions extras


def test_return_token_ids_plain_and_streamed(server):
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompts = [t["prompt_token_ids"] for t in TASKS[:2]]
    r = oai.completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=0,
                               extra_body={"return_token_ids": True})
    for c in r.choices:
        extra = c.model_extra
        assert extra["prompt_token_ids"] == prompts[c.index]
        assert extra["token_ids"] == TASKS[c.index]["target_token_ids"] + [0]  # the answer, then eos
        assert c.text == _text(TASKS[c.index]["target_token_ids"])
    seen_prompt: dict[int, list] = {}
    tokens: dict[int, list] = {0: [], 1: []}
    for chunk in oai.completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=0, stream=True,
                                        extra_body={"return_token_ids": True}):
        for c in chunk.choices:
            got = c.model_extra["prompt_token_ids"]
            if c.index in seen_prompt:
                assert got is None  # vLLM: the prompt's ids in a choice's first chunk only
            else:
                seen_prompt[c.index] = got
            tokens[c.index] += c.model_extra["token_ids"]
    assert seen_prompt == {0: prompts[0], 1: prompts[1]}
    assert tokens == {i: r.choices[i].model_extra["token_ids"] for i in (0, 1)}
    assert "token_ids" not in oai.completions.create(model=NAME, prompt=prompts[0], max_tokens=2).choices[0].model_extra


def test_logprobs_minus_one_is_the_whole_raw_vocabulary(client, oracle):
    """vLLM's logprobs=-1: every token's log-prob at every position; raw (the server's default, as
    vLLM's) at temperature 0.6 with top_k 5, so processed would differ."""
    task = TASKS[2]
    body = {"prompt": task["prompt_token_ids"], "max_tokens": 2, "temperature": 0.6, "top_k": 5, "seed": 3,
            "logprobs": -1, "return_tokens_as_token_ids": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    tokens = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    logits = oracle.forward(task["prompt_token_ids"] + tokens[:-1]).logits
    for j, (tok, top, token_lp) in enumerate(zip(tokens, lp["top_logprobs"], lp["token_logprobs"]), 1):
        row = logits[-1, readout_position(len(task["prompt_token_ids"]), j)]  # full depth: loop T
        raw = torch.log_softmax(row, -1)
        assert len(top) == VOCAB
        got = torch.tensor([top[f"token_id:{i}"] for i in range(VOCAB)], dtype=torch.float64)
        assert torch.allclose(got, raw, atol=2e-4), (got - raw).abs().max()
        assert token_lp == pytest.approx(float(raw[tok]), abs=2e-4)
        # processed log-probs would be -inf (written -9999) outside the top 5: this row tells the modes apart
        assert int(torch.isinf(processed_logprobs(row, 0.6, top_k=5)).sum()) == VOCAB - 5


def test_the_server_default_is_raw_and_the_engine_default_processed():
    assert build_config(ARGS).logprobs_mode == VLLM_LOGPROBS_MODE == "raw"
    assert build_config(build_parser().parse_args(["--model", str(MODEL), "--logprobs-mode", "processed"])
                        ).logprobs_mode == "processed"
    from ourobatch import EngineConfig

    assert EngineConfig(model=str(MODEL)).logprobs_mode == "processed"


# vLLM 0.32 CompletionRequest extras at their defaults (as its Python client would send them)
VLLM_DEFAULTS = {
    "use_beam_search": False, "length_penalty": 1.0, "watermarking": None, "truncate_prompt_tokens": None,
    "truncation_side": None, "allowed_token_ids": None, "logprob_token_ids": None, "bad_words": [],
    "prompt_embeds": None, "add_special_tokens": True, "response_format": {"type": "text"},
    "structured_outputs": None, "priority": 0, "session_id": "s-1", "return_tokens_as_token_ids": None,
    "return_token_ids": None, "routed_experts_prompt_start": 0, "return_token_offsets": False,
    "mm_payload": "tensors", "return_mm_kwargs": None, "cache_salt": None, "kv_transfer_params": None,
    "ec_transfer_params": None, "vllm_xargs": None, "repetition_detection": None, "thinking_token_budget": -1,
    "stream_interval": 4, "stop_token_ids": [], "stop": [], "presence_penalty": None, "frequency_penalty": None,
    "repetition_penalty": None, "top_k": None, "min_p": None,
}
NOT_NEUTRAL = {
    "use_beam_search": True, "length_penalty": 0.5, "watermarking": True, "truncate_prompt_tokens": 8,
    "allowed_token_ids": [3], "logprob_token_ids": [3], "bad_words": ["n3"], "prompt_embeds": "AAAA",
    "add_special_tokens": False, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "n"},
    "priority": 1, "routed_experts_prompt_start": 2, "cache_salt": "salt", "kv_transfer_params": {"a": 1},
    "ec_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "repetition_detection": {"max_pattern_size": 2},
    "thinking_token_budget": 16,
}


def test_vllm_extras_at_their_defaults_are_accepted(client):
    base = {"prompt": TASKS[3]["prompt_token_ids"], "max_tokens": 8, "temperature": 0}
    plain = client.post("/v1/completions", json=base).json()["choices"][0]
    r = client.post("/v1/completions", json={**base, **VLLM_DEFAULTS})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == plain["text"] == _text(TASKS[3]["target_token_ids"])


@pytest.mark.parametrize("name", sorted(NOT_NEUTRAL))
def test_a_vllm_extra_that_would_change_the_result_is_a_400_naming_it(client, name):
    r = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, name: NOT_NEUTRAL[name]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == name and name in r.json()["error"]["message"]


def test_max_tokens_null_is_vllm_0_32s_default(client):
    """vLLM 0.32 reads an explicit null as the default, 16 (CompletionRequest.normalize_null_max_tokens)."""
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": None, "ignore_eos": True,
                                              "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


# --------------------------------------------------------------------------- ourobatch.LLM's default (item 6)


def test_llm_reports_raw_logprobs_by_default_as_vllm(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "m", seed=3, eos_token_id=None)
    oracle = load_oracle(ckpt)
    params = SamplingParams(max_tokens=6, temperature=0.6, top_k=5, seed=9, logprobs=2, ignore_eos=True)
    prompt = [1, 2, 3]
    with LLM(str(ckpt), dtype="float64", num_kv_blocks=32) as llm:
        assert llm.config.logprobs_mode == "raw"
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    with LLM(str(ckpt), dtype="float64", num_kv_blocks=32, logprobs_mode="processed") as llm:
        processed_out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert processed_out.token_ids == out.token_ids  # the mode changes what is reported, never the draws
    logits = oracle.forward(prompt + out.token_ids[:-1]).logits
    moved = 0.0
    for j, (tok, lp, plp, loop, top) in enumerate(zip(out.token_ids, out.token_logprobs, processed_out.token_logprobs,
                                                      out.readout_loops, out.logprobs), 1):
        row = logits[loop - 1, readout_position(len(prompt), j)]
        raw, processed = torch.log_softmax(row, -1), processed_logprobs(row, 0.6, top_k=5)
        assert lp == pytest.approx(float(raw[tok]), abs=1e-9)
        assert plp == pytest.approx(float(processed[tok]), abs=1e-9)
        assert all(e.logprob == pytest.approx(float(raw[t]), abs=1e-9) for t, e in top.items())
        moved = max(moved, abs(lp - plp))
    assert moved > 0.05


def test_logprobs_k_gives_the_sampled_token_and_the_k_best_as_vllm(client):
    """vLLM's /v1/completions top_logprobs: the sampled token first, then the k best, so k + 1 entries where
    the sampled token is not among them (vllm/entrypoints/openai/completion/serving.py)."""
    k = 1
    r = client.post("/v1/completions", json={"prompt": TASKS[0]["prompt_token_ids"], "max_tokens": 8, "n": 4,
                                              "temperature": 3.0, "seed": 0, "logprobs": k,
                                              "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    beyond = 0
    for choice in r.json()["choices"]:
        lp = choice["logprobs"]
        for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert top[tok] == pytest.approx(value) and len(top) <= k + 1
            best = [v for t, v in top.items() if t != tok]
            assert all(v >= value for v in best)  # the others are the k best
            beyond += len(top) == k + 1
    assert beyond > 0  # at temperature 3 some sampled tokens were not the best one
