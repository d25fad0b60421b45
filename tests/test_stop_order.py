"""Stop strings and eos in vLLM's order (issue 21 item 7), on the shipped pointer-chase model: eos ends a
completion and its text is left out before stop strings are matched (vllm/v1/engine/detokenizer.py), so
lm-eval's `until` (the eos token's text, "<|endoftext|>") gives answers with no trailing space, through
ourobatch.LLM and through /v1/completions (plain and streamed) on a real server. The expected answers come
from the task files' own hop chains (tests/pointer_chase.py), not from the code under test."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from ourobatch import EngineConfig, SamplingParams
from ourobatch.llm import LLM
from ourobatch.server.app import create_app
from ourobatch.text import StopChecker, Tokenizer
from tests.pointer_chase import expected_answer_words, id_to_word
from tests.server_helpers import MODEL, ThreadServer

EOS_TEXT = "<|endoftext|>"
TASKS = [json.loads(line) for line in (MODEL / "heldout_tasks.jsonl").read_text().splitlines()[:8]]
VOCAB = id_to_word(MODEL)
# lm-eval's generate_until request: the eos text as `until`, greedy; the text keeps special tokens so the
# eos text would be there to match if eos were not dropped first
UNTIL = dict(stop=[EOS_TEXT], temperature=0.0, max_tokens=8)


def _prompt(task: dict) -> str:
    return " ".join(VOCAB[i] for i in task["prompt_token_ids"])


def _expected(task: dict) -> str:
    return " ".join(expected_answer_words(_prompt(task).split(), hops=4, answers=4))


def _check_answers(texts: list[str]) -> None:
    assert all(t and not t.endswith(" ") and EOS_TEXT not in t for t in texts), texts
    right = sum(t == _expected(task) for t, task in zip(texts, TASKS))
    assert right >= len(TASKS) - 1, (texts, [_expected(t) for t in TASKS])  # the model card: 0.9985 greedy


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_path(MODEL)


def test_llm_until_eos_text_gives_answers_without_a_trailing_space():
    with LLM(str(MODEL), max_model_len=64, dtype="float32") as llm:
        for skip in (True, False):
            outs = llm.generate([_prompt(t) for t in TASKS], SamplingParams(**UNTIL, skip_special_tokens=skip),
                                use_tqdm=False)
            comps = [o.outputs[0] for o in outs]
            _check_answers([c.text for c in comps])
            for c in comps:  # eos ended it: vLLM's stop_reason None, the eos token kept in token_ids
                assert (c.finish_reason, c.stop_reason, c.token_ids[-1]) == ("stop", None, 0), c
        kept = llm.generate(_prompt(TASKS[0]), SamplingParams(**UNTIL, skip_special_tokens=False,
                                                              include_stop_str_in_output=True),
                            use_tqdm=False)[0].outputs[0]
    # with include_stop_str_in_output vLLM decodes the eos token, and the stop string then matches its text
    assert (kept.text, kept.stop_reason, kept.finish_reason) == (_expected(TASKS[0]) + " " + EOS_TEXT, EOS_TEXT,
                                                                 "stop")


@pytest.fixture(scope="module")
def server(tok):
    app = create_app(EngineConfig(model=str(MODEL), max_model_len=64), served_model_name="pc", tokenizer=tok)
    with ThreadServer(app) as srv:
        yield srv


def test_completions_until_eos_text_plain_and_streamed(server):
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompts = [_prompt(t) for t in TASKS]
    for extra in ({}, {"skip_special_tokens": False}):
        r = oai.completions.create(model="pc", prompt=prompts, extra_body=extra, **UNTIL)
        _check_answers([c.text for c in sorted(r.choices, key=lambda c: c.index)])
        assert {(c.finish_reason, c.model_extra.get("stop_reason")) for c in r.choices} == {("stop", None)}
        streamed = [""] * len(prompts)
        for chunk in oai.completions.create(model="pc", prompt=prompts, stream=True, extra_body=extra, **UNTIL):
            for c in chunk.choices:
                streamed[c.index] += c.text
        _check_answers(streamed)


def test_generate_route_keeps_its_eos_rules(server):
    """SGLang's /generate with the same `stop`: the text has no eos text either (no_stop_trim false)."""
    body = {"text": _prompt(TASKS[0]), "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                          "stop": [EOS_TEXT], "skip_special_tokens": False}}
    out = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    assert out["text"] == _expected(TASKS[0]) and out["output_ids"][-1] == 0


def test_stop_checker_order_unit(tok):
    ids = tok.encode("n1 n2 n3") + [0]
    keep_special = SamplingParams(stop=(EOS_TEXT,), skip_special_tokens=False)
    assert StopChecker(tok, keep_special).check(ids, stop_terminated=True) is None  # eos first: no match
    m = StopChecker(tok, keep_special).check(ids)  # not a stop token (ignore_eos): its text is matched
    assert (m.num_tokens, m.stop, m.text) == (4, EOS_TEXT, "n1 n2 n3 ")
    # vLLM: a stop string counts only where it ends after the first min_tokens tokens' text
    ids = tok.encode("n1 n2 n1 n3")
    m = StopChecker(tok, SamplingParams(stop=("n1",), min_tokens=1, max_tokens=8)).check(ids)
    assert (m.num_tokens, m.text) == (3, "n1 n2 ")
    # of the stop strings one token completes, the one that ends first wins (ties: the order of stop)
    ids = tok.encode("n5 n1>n2")  # two tokens: the second completes both stop strings
    assert len(ids) == 2
    m = StopChecker(tok, SamplingParams(stop=("n5 n1>n2", "n1"))).check(ids)
    assert (m.num_tokens, m.stop, m.text) == (2, "n1", "n5 ")
    m = StopChecker(tok, SamplingParams(stop=("n1>", "1>"))).check(ids)
    assert (m.num_tokens, m.stop) == (2, "n1>")
