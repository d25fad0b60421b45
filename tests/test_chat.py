"""/v1/chat/completions on a real uvicorn on 127.0.0.1, through the official `openai` SDK, on the shipped
pointer-chase model and its chat template: held-out tasks sent as chat messages get exactly their answers
(the task files' targets, checked independently by tests/pointer_chase.py), streaming equals the plain
response, n=2 and log-probs match an in-process engine, stop strings cut as the task text says; bad chat
input is a 400 naming the problem; ``--chat-template`` replaces the checkpoint's template."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.server.app import create_app
from ourobatch.text import Tokenizer
from tests.pointer_chase import id_to_word
from tests.server_helpers import API_KEY, MODEL, ThreadServer, http_client, openai_client, serve, start_subprocess

NAME = "pointer-chase"
CONFIG = EngineConfig(model=str(MODEL), max_model_len=64, max_num_seqs=64)
TASKS = [json.loads(line) for line in (MODEL / "heldout_tasks.jsonl").read_text().splitlines()[:48]]
WORDS = id_to_word(MODEL)
TOL = 1e-4  # float32, different batch compositions


def task_message(task: dict) -> list[dict]:
    """A task as one user message: the prompt's words after bos (the template writes bos)."""
    return [{"role": "user", "content": " ".join(WORDS[i] for i in task["prompt_token_ids"][1:])}]


def answer_text(task: dict) -> str:
    return " ".join(WORDS[i] for i in task["target_token_ids"])


@pytest.fixture(scope="module")
def server():
    yield from serve(create_app(CONFIG, served_model_name=NAME, api_key=API_KEY, tokenizer=Tokenizer.from_path(MODEL)))


@pytest.fixture(scope="module")
def oai(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def client(server):
    with http_client(server, API_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    with SyncEngine(CONFIG) as engine:
        yield engine


def test_chat_answers_held_out_tasks_exactly(oai):
    import concurrent.futures

    def ask(task: dict):
        return oai.chat.completions.create(model=NAME, messages=task_message(task), temperature=0,
                                           max_completion_tokens=8)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, TASKS))
    for task, r in zip(TASKS, answers):
        choice = r.choices[0]
        assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == NAME
        assert choice.message.role == "assistant" and choice.finish_reason == "stop"
        assert r.usage.prompt_tokens == len(task["prompt_token_ids"])  # the template rendered the trained prompt
        assert r.usage.completion_tokens == len(task["target_token_ids"]) + 1  # the answer and eos
    matches = [r.choices[0].message.content == answer_text(t) for t, r in zip(TASKS, answers)]
    assert sum(matches) == len(TASKS)  # exact match on every held-out task (the model scores 1.0 on these)


def test_streaming_equals_the_plain_response_with_n_2(oai):
    msg = task_message(TASKS[1])
    kwargs = dict(model=NAME, messages=msg, n=2, temperature=1.5, seed=7, max_tokens=6)
    plain = oai.chat.completions.create(**kwargs)
    chunks = list(oai.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == [(0, "assistant"), (1, "assistant")]
    texts, finish = {0: "", 1: ""}, {}
    for c in chunks[2:-1]:
        (choice,) = c.choices
        assert choice.delta.role is None
        texts[choice.index] += choice.delta.content
        if choice.finish_reason is not None:
            finish[choice.index] = choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()
    assert texts == {c.index: c.message.content for c in plain.choices}
    assert finish == {c.index: c.finish_reason for c in plain.choices}


def test_n_2_and_logprobs_match_the_in_process_engine(oai, reference):
    task = TASKS[2]
    # temperature 1 with no top-k/top-p: the processed log-probs are the raw ones, whichever the server reports
    r = oai.chat.completions.create(model=NAME, messages=task_message(task), n=2, temperature=1.0, seed=11,
                                    max_tokens=8, logprobs=True, top_logprobs=3,
                                    extra_body={"return_tokens_as_token_ids": True})
    ref = reference.generate(task["prompt_token_ids"], SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=8,
                                                                      logprobs=3))
    assert [c.index for c in r.choices] == [0, 1]
    for choice, expected in zip(r.choices, ref.outputs):
        content = choice.logprobs.content
        assert [int(e.token.removeprefix("token_id:")) for e in content] == expected.token_ids
        assert [e.logprob for e in content] == pytest.approx(expected.logprobs, abs=TOL)
        for e, top in zip(content, expected.top_logprobs):
            assert e.bytes == list(e.token.encode())
            assert [int(t.token.removeprefix("token_id:")) for t in e.top_logprobs] == list(top)[:3]
            assert [t.logprob for t in e.top_logprobs] == pytest.approx(list(top.values())[:3], abs=TOL)
    # with token text: the words themselves, their UTF-8 bytes
    named = oai.chat.completions.create(model=NAME, messages=task_message(task), temperature=0, max_tokens=8,
                                        logprobs=True)
    content = named.choices[0].logprobs.content
    assert [e.token for e in content] == answer_text(task).split() + ["<|endoftext|>"]
    assert all(e.bytes == list(e.token.encode()) and e.top_logprobs == [] for e in content)
    assert oai.chat.completions.create(model=NAME, messages=task_message(task),
                                       max_tokens=2).choices[0].logprobs is None


def test_stop_strings_cut_the_answer(oai):
    task = TASKS[3]
    words = answer_text(task).split()
    stop = words[2]
    expected = answer_text(task)[:answer_text(task).find(stop)]  # the text before the stop string
    r = oai.chat.completions.create(model=NAME, messages=task_message(task), temperature=0, max_tokens=8,
                                    stop=[stop, "never-there"])
    choice = r.choices[0]
    assert (choice.message.content, choice.finish_reason, choice.model_extra["stop_reason"]) == (expected, "stop", stop)
    assert r.usage.completion_tokens == 3  # the tokens up to the one that completed the stop string
    kept = oai.chat.completions.create(model=NAME, messages=task_message(task), temperature=0, max_tokens=8,
                                       stop=stop, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == expected + stop


def test_max_tokens_defaults_to_the_rest_of_the_context_and_length_is_reported(oai):
    task = TASKS[4]
    r = oai.chat.completions.create(model=NAME, messages=task_message(task), temperature=0,
                                    extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == CONFIG.max_model_len - len(task["prompt_token_ids"])
    short = oai.chat.completions.create(model=NAME, messages=task_message(task), temperature=0, max_tokens=16,
                                        max_completion_tokens=2)  # the newer name wins
    assert (short.usage.completion_tokens == 2
            and short.choices[0].message.content == " ".join(answer_text(task).split()[:2]))


def test_multi_turn_and_text_parts_render_through_the_template(oai, client):
    first, second = TASKS[5], TASKS[6]
    parts = [{"type": "text", "text": part} for part in task_message(second)[0]["content"].split(" ? ")]
    parts[0]["text"] += " ?"
    history = [*task_message(first), {"role": "assistant", "content": answer_text(first)},
               {"role": "user", "content": parts}]
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": history, "max_tokens": 1,
                                                  "temperature": 0})
    assert r.status_code == 200, r.text
    # bos task1 answer1 eos bos task2 ("?" and the start node joined by a newline: whitespace to the tokenizer)
    assert r.json()["usage"]["prompt_tokens"] == len(first["prompt_token_ids"]) + 5 + len(second["prompt_token_ids"])


@pytest.mark.parametrize("body, param, words", [
    ({"messages": [{"role": "system", "content": "be brief"}]}, "messages", ["roles user and assistant", "system"]),
    ({"messages": [{"role": "user", "content": "hello n1>n2 ? n1"}]}, "messages", ["'hello'", "vocabulary"]),
    ({"messages": []}, "messages", []),
    ({"messages": [{"content": "n1"}]}, "messages", ["role"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages",
     ["image_url", "text parts"]),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", ["tool"]),
    ({"response_format": {"type": "json_object"}}, "response_format", ["structured output"]),
    ({"chat_template": "{{ messages }}"}, "chat_template", ["--chat-template"]),
    ({"top_logprobs": 2}, "top_logprobs", ["logprobs=true"]),
    ({"echo": True}, "echo", ["echo"]),
    ({"continue_final_message": True}, "messages", ["add_generation_prompt"]),
    ({"chat_template_kwargs": {"messages": []}}, "messages", ["chat_template_kwargs", "messages"]),
    ({"temperature": -1}, "temperature", ["temperature"]),
    ({"n": 0}, "n", ["n"]),
    ({"flux": 1}, "flux", []),
    ({"max_tokens": 0}, "max_tokens", ["max_tokens must be an int >= 1"]),  # not completions' "needs echo"
    ({"max_completion_tokens": -1}, "max_completion_tokens", ["max_completion_tokens must be an int >= 1"]),
])
def test_bad_chat_input_is_a_400_naming_it(client, body, param, words):
    full = {"model": NAME, "messages": task_message(TASKS[0]), "max_tokens": 2, **body}
    r = client.post("/v1/chat/completions", json=full)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == param, error
    assert all(w in error["message"] for w in words), error["message"]
    assert client.post("/v1/chat/completions", json={"model": NAME, "messages": task_message(TASKS[0]),
                                                     "max_tokens": 1}).status_code == 200  # still serving


def test_another_model_name_is_a_404(oai):
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4", messages=task_message(TASKS[0]))


def test_a_model_without_a_chat_template_is_a_clear_400():
    tok = Tokenizer.from_path(MODEL)
    tok.chat_template = None  # as a checkpoint without tokenizer_config.json's template or chat_template.jinja
    with ThreadServer(create_app(CONFIG, served_model_name=NAME, tokenizer=tok)) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": task_message(TASKS[0])}, timeout=60)
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert "no chat template" in message and "--chat-template" in message
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": TASKS[0]["prompt_token_ids"]}, timeout=60)
        assert r.status_code == 200  # completions do not need one


def test_the_chat_template_option_replaces_the_checkpoints(tmp_path):
    # a template that reads the task from comma-separated words (the checkpoint's would refuse them as one
    # unknown word); chat_template_kwargs pick the separator
    path = tmp_path / "commas.jinja"
    path.write_text("{{ bos_token }} {{ messages[-1]['content'] | replace(sep | default(','), ' ') }}")
    proc, url = start_subprocess("--model", str(MODEL), "--max-model-len", "64", "--chat-template", str(path),
                                 "--served-model-name", NAME)
    try:
        oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        words = task_message(TASKS[7])[0]["content"].split()
        r = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": ",".join(words)}],
                                        temperature=0, max_tokens=8)
        assert r.choices[0].message.content == answer_text(TASKS[7])
        r = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": ";".join(words)}],
                                        temperature=0, max_tokens=8, extra_body={"chat_template_kwargs": {"sep": ";"}})
        assert r.choices[0].message.content == answer_text(TASKS[7])
    finally:
        proc.terminate()
        assert proc.wait(60) == 0


def test_a_missing_chat_template_file_fails_at_startup(tmp_path):
    import subprocess
    import sys

    missing = tmp_path / "nope.jinja"
    done = subprocess.run([sys.executable, "-m", "ourobatch", "serve", "--model", str(MODEL), "--chat-template",
                           str(missing)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and str(missing) in done.stderr and "Traceback" not in done.stderr
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    done = subprocess.run([sys.executable, "-m", "ourobatch", "serve", "--model", str(MODEL), "--chat-template",
                           str(broken)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "does not compile" in done.stderr and "Traceback" not in done.stderr
