"""LLM.chat (vLLM's): conversations rendered with the shipped model's chat template run as the trained
prompts, so the held-out tasks get exactly their answers; one conversation or many, per-conversation
params, a template given by text, and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest

from ourobatch.llm import LLM, SamplingParams
from tests.pointer_chase import id_to_word
from tests.server_helpers import MODEL

TASKS = [json.loads(line) for line in (MODEL / "heldout_tasks.jsonl").read_text().splitlines()[100:164]]
WORDS = id_to_word(MODEL)
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def task_message(task: dict) -> list[dict]:
    return [{"role": "user", "content": " ".join(WORDS[i] for i in task["prompt_token_ids"][1:])}]


def answer_text(task: dict) -> str:
    return " ".join(WORDS[i] for i in task["target_token_ids"])


@pytest.fixture(scope="module")
def llm():
    with LLM(str(MODEL), dtype="float32", max_model_len=64, seed=0) as llm:
        yield llm


def test_chat_answers_held_out_tasks_exactly(llm):
    outs = llm.chat([task_message(t) for t in TASKS], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [t["prompt_token_ids"] for t in TASKS]  # the trained prompts
    assert [o.prompt for o in outs] == [" ".join(WORDS[i] for i in t["prompt_token_ids"]) for t in TASKS]
    assert [o.outputs[0].text for o in outs] == [answer_text(t) for t in TASKS]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_one_conversation_per_conversation_params_and_n(llm):
    (one,) = llm.chat(task_message(TASKS[0]), GREEDY, use_tqdm=False)  # a bare conversation
    assert one.outputs[0].text == answer_text(TASKS[0])
    sampled, greedy = llm.chat([task_message(TASKS[1]), task_message(TASKS[2])],
                               [SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8), GREEDY], use_tqdm=False)
    assert len(sampled.outputs) == 3 and greedy.outputs[0].text == answer_text(TASKS[2])
    again = llm.generate({"prompt_token_ids": TASKS[1]["prompt_token_ids"]},
                         SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8), use_tqdm=False)[0]
    assert [c.token_ids for c in sampled.outputs] == [c.token_ids for c in again.outputs]  # same prompt, same seed
    cut = llm.chat(task_message(TASKS[3]),
                   SamplingParams(temperature=0, max_tokens=8, stop=[answer_text(TASKS[3]).split()[1]]),
                   use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == answer_text(TASKS[3]).split()[0] + " "


def test_a_template_given_as_text_and_template_kwargs(llm):
    template = "{{ bos_token }} {{ messages[-1]['content'] | replace(sep, ' ') }}"
    words = task_message(TASKS[4])[0]["content"].split()
    out = llm.chat([{"role": "user", "content": "|".join(words)}], GREEDY, use_tqdm=False, chat_template=template,
                   chat_template_kwargs={"sep": "|"})[0]
    assert out.prompt_token_ids == TASKS[4]["prompt_token_ids"] and out.outputs[0].text == answer_text(TASKS[4])


def test_continue_final_message(llm):
    task = TASKS[5]
    first = answer_text(task).split()[0]
    chat = [*task_message(task), {"role": "assistant", "content": first}]
    out = llm.chat(chat, GREEDY, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)[0]
    assert out.prompt_token_ids == task["prompt_token_ids"] + [task["target_token_ids"][0]]
    assert out.outputs[0].text == " ".join(answer_text(task).split()[1:])


def test_errors_name_the_problem(llm, tmp_path):
    with pytest.raises(ValueError, match="roles user and assistant, not system"):
        llm.chat([{"role": "system", "content": "x"}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[1\]: .*'hello'"):
        llm.chat([task_message(TASKS[0]), [{"role": "user", "content": "hello"}]], use_tqdm=False)
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(task_message(TASKS[0]), continue_final_message=True, use_tqdm=False)
    with pytest.raises(TypeError, match="lora_request"):
        llm.chat(task_message(TASKS[0]), lora_request=object())
    with pytest.raises(ValueError, match="chat_template_content_format='openai'"):
        llm.chat(task_message(TASKS[0]), chat_template_content_format="openai")
    with pytest.raises(TypeError, match="non-empty list"):
        llm.chat([], use_tqdm=False)
    # a checkpoint without a template
    bare = tmp_path / "bare"
    shutil.copytree(MODEL, bare)
    (bare / "chat_template.jinja").unlink()
    with LLM(str(bare), max_model_len=64) as plain:
        with pytest.raises(ValueError, match="no chat template .*chat_template="):
            plain.chat(task_message(TASKS[0]), use_tqdm=False)
        out = plain.chat(task_message(TASKS[0]), GREEDY, chat_template="{{ bos_token }} {{ messages[0].content }}",
                         use_tqdm=False)[0]  # bos_token still from its tokenizer_config.json
        assert out.outputs[0].text == answer_text(TASKS[0])
    with LLM(str(MODEL), max_model_len=64, skip_tokenizer_init=True) as blind:
        with pytest.raises(ValueError, match="LLM.chat needs a tokenizer"):
            blind.chat(task_message(TASKS[0]), use_tqdm=False)
