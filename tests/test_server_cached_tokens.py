"""OpenAI's usage.prompt_tokens_details.cached_tokens (`ourobatch serve --enable-prompt-tokens-details`, vLLM's
flag) on a real uvicorn on 127.0.0.1 serving the shipped pointer-chase model, through the `openai` SDK: the prompt
tokens the prefix cache served, per request and summed over a request's prompts, in answers and in streams'
usage chunks, checked against the engine's own count of prefix-cache hits and the block size (whole blocks only).
Without the flag the field is absent, as in vLLM."""

from __future__ import annotations

import json

import pytest

from ourobatch.server.cli import build_app, build_config, build_parser, load_tokenizer
from tests.pointer_chase import id_to_word
from tests.server_helpers import MODEL, openai_client, serve

NAME = "pc"
FLAGS = ["--model", str(MODEL), "--max-model-len", "64", "--served-model-name", NAME]
TASKS = [json.loads(line) for line in (MODEL / "heldout_tasks.jsonl").read_text().splitlines()[:8]]
WORDS = id_to_word(MODEL)


def _app(*extra: str):
    args = build_parser().parse_args([*FLAGS, *extra])
    return build_app(args, build_config(args), load_tokenizer(args))


@pytest.fixture(scope="module")
def server():
    yield from serve(_app("--enable-prompt-tokens-details"))


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server, api_key="none") as c:
        yield c


def _core(server):
    return server.server.config.app.state.engine.core


def _whole_blocks(server, prompt: list[int]) -> int:
    block = _core(server).scheduler.config.block_size
    return len(prompt) // block * block


def _hits(server) -> int:
    return _core(server).stats()["prefix_cache_hits"]


def test_completions_report_the_blocks_the_prefix_cache_served_summed_over_prompts(server, client):
    one, two = TASKS[0]["prompt_token_ids"][::-1], TASKS[1]["prompt_token_ids"][::-1]  # sent by no other test
    assert _whole_blocks(server, one) > 0 and _whole_blocks(server, two) > 0
    hits = _hits(server)
    first = client.completions.create(model=NAME, prompt=one, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.prompt_tokens == len(one)
    both = client.completions.create(model=NAME, prompt=[one, two], max_tokens=1, temperature=0)
    assert both.usage.prompt_tokens_details.cached_tokens == _whole_blocks(server, one)  # two's first time
    again = client.completions.create(model=NAME, prompt=[one, two], max_tokens=1, temperature=0, n=2)
    cached = _whole_blocks(server, one) + _whole_blocks(server, two)
    assert again.usage.prompt_tokens_details.cached_tokens == cached  # per prompt, not per completion
    # the engine's own count is per sample (each of n = 2 reads the cached blocks); usage's is per prompt
    assert _hits(server) - hits == _whole_blocks(server, one) + 2 * cached


def test_a_completions_streams_usage_chunk_carries_them(server, client):
    prompt = TASKS[2]["prompt_token_ids"][::-1]
    client.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0)
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == _whole_blocks(server, prompt)
    assert all(c.usage.prompt_tokens_details.cached_tokens == _whole_blocks(server, prompt) for c in chunks)


def test_chat_reports_them_in_answers_and_streams(server, client):
    task = TASKS[3]["prompt_token_ids"]
    messages = [{"role": "user", "content": " ".join(WORDS[i] for i in task[1:][::-1])}]
    first = client.chat.completions.create(model=NAME, messages=messages, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.chat.completions.create(model=NAME, messages=messages, max_tokens=1, temperature=0)
    blocks = _whole_blocks(server, [0] * first.usage.prompt_tokens)
    assert blocks > 0 and second.usage.prompt_tokens_details.cached_tokens == blocks
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == blocks


def test_without_the_flag_usage_has_no_details():
    for server in serve(_app()):
        with openai_client(server, api_key="none") as client:
            prompt = TASKS[4]["prompt_token_ids"]
            for _ in range(2):
                out = client.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0)
                assert out.usage.prompt_tokens_details is None
            assert _hits(server) > 0  # the second was served from the cache: not reported without the flag


def test_the_flag_must_be_a_bool():
    args = build_parser().parse_args(FLAGS)
    from ourobatch.server.app import create_app

    with pytest.raises(TypeError, match="enable_prompt_tokens_details must be a bool"):
        create_app(build_config(args), enable_prompt_tokens_details="yes")
