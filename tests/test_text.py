"""The shipped model's tokenizer and ourobatch.text's rules: its control tokens are special (so
skip_special_tokens works, through LLM and the server, both ways) with every token id as the training
script assigned it, and a word outside the vocabulary is refused, naming it, instead of being read as
the unk token (the shipped model's unk token is its eos)."""

from __future__ import annotations

import json

import httpx
import pytest

from ourobatch import EngineConfig
from ourobatch.llm import LLM, SamplingParams
from ourobatch.server.app import create_app
from ourobatch.text import Tokenizer
from tests.pointer_chase import id_to_word
from tests.server_helpers import MODEL, ThreadServer

NAME = "pointer-chase"
TASK = json.loads((MODEL / "heldout_tasks.jsonl").read_text().splitlines()[0])
WORDS = id_to_word(MODEL)
ANSWER = " ".join(WORDS[i] for i in TASK["target_token_ids"])
NODES = 20  # training.json's task


def training_vocab() -> dict[str, int]:
    """The ids examples/train_looped_model.py gives each word, from its documented layout."""
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "?": 2, **{f"n{i}": 3 + i for i in range(NODES)}}
    vocab.update({f"n{s}>n{d}": 3 + NODES + s * NODES + d for s in range(NODES) for d in range(NODES)})
    return vocab


def test_control_tokens_are_special_and_no_id_moved():
    raw = json.loads((MODEL / "tokenizer.json").read_text())
    config = json.loads((MODEL / "config.json").read_text())
    generation = json.loads((MODEL / "generation_config.json").read_text())
    assert raw["model"]["vocab"] == training_vocab() and len(training_vocab()) == config["vocab_size"]
    special = {t["content"]: t["id"] for t in raw["added_tokens"] if t["special"]}
    assert special == {"<|endoftext|>": config["eos_token_id"], "<|im_start|>": config["bos_token_id"]}
    assert generation["eos_token_id"] == config["eos_token_id"] and generation["bos_token_id"] == config["bos_token_id"]
    assert all(raw["model"]["vocab"][t["content"]] == t["id"] for t in raw["added_tokens"])
    tok = Tokenizer.from_path(MODEL)
    assert tok.tok.get_vocab(with_added_tokens=True) == training_vocab()
    text = tok.decode(TASK["prompt_token_ids"], skip_special_tokens=False)
    assert text == " ".join(WORDS[i] for i in TASK["prompt_token_ids"]) and tok.encode(text) == TASK["prompt_token_ids"]
    assert tok.decode(TASK["prompt_token_ids"][:3]) == " ".join(WORDS[i] for i in TASK["prompt_token_ids"][1:3])


def test_unknown_words_are_refused_by_name():
    tok = Tokenizer.from_path(MODEL)
    with pytest.raises(ValueError, match=r"2 word\(s\) not in the vocabulary of tokenizer.json: 'hello', 'world'"):
        tok.encode("hello n1>n2 world ? n1 hello")
    assert tok.encode("n1 <|endoftext|>") == [4, 0]  # the unk token written out is itself a word


def test_an_unk_token_of_its_own_is_no_excuse(tmp_path):
    """A word-level vocabulary with a dedicated [UNK] token: the text is still refused (one rule)."""
    from tokenizers import Tokenizer as HF
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    hf = HF(WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = WhitespaceSplit()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_path(tmp_path)
    assert tok.encode("a b [UNK]") == [1, 2, 0] and tok.chat_template is None
    with pytest.raises(ValueError, match=r"'c'.*'\[UNK\]'"):
        tok.encode("a c")


@pytest.fixture(scope="module")
def llm():
    with LLM(str(MODEL), dtype="float32", max_model_len=64) as llm:
        yield llm


def test_llm_skip_special_tokens_both_ways(llm):
    def text(skip: bool) -> str:
        params = SamplingParams(temperature=0, max_tokens=8, include_stop_str_in_output=True, skip_special_tokens=skip)
        return llm.generate({"prompt_token_ids": TASK["prompt_token_ids"]}, params, use_tqdm=False)[0].outputs[0].text

    assert text(False) == ANSWER + " <|endoftext|>"
    assert text(True) == ANSWER  # (before the tokenizer marked eos special, eos stayed in the text)


def test_llm_refuses_unknown_words(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\]: 1 word\(s\) not in the vocabulary.*'hello'"):
        llm.generate(["n1>n2 ? n1", "hello n1>n2 ? n1"], use_tqdm=False)


@pytest.fixture(scope="module")
def client():
    app = create_app(EngineConfig(model=str(MODEL), max_model_len=64), served_model_name=NAME,
                     tokenizer=Tokenizer.from_path(MODEL))
    with ThreadServer(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


@pytest.mark.parametrize("skip, expected", [(False, ANSWER + " <|endoftext|>"), (True, ANSWER)])
def test_server_skip_special_tokens_both_ways(client, skip, expected):
    fields = {"temperature": 0, "max_tokens": 8, "include_stop_str_in_output": True, "skip_special_tokens": skip}
    r = client.post("/v1/completions", json={"prompt": TASK["prompt_token_ids"], **fields})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text
    r = client.post("/v1/completions", json={"prompt": TASK["prompt_token_ids"], "stream": True, **fields})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    r = client.post("/generate", json={"input_ids": TASK["prompt_token_ids"], "sampling_params": {
        "temperature": 0, "max_new_tokens": 8, "no_stop_trim": True, "skip_special_tokens": skip}})
    assert r.status_code == 200 and r.json()["text"] == expected, r.text
    messages = [{"role": "user", "content": " ".join(WORDS[i] for i in TASK["prompt_token_ids"][1:])}]
    r = client.post("/v1/chat/completions", json={"messages": messages, **fields})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected, r.text


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": "hello n1>n2 ? n1"}, "prompt"),
    ("/v1/completions", {"prompt": ["n1>n2 ? n1", "n1>n2 wat ? n1"]}, "prompt[1]"),
    ("/generate", {"text": "hello n1>n2 ? n1"}, "text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello n1>n2 ? n1"}]}, "messages"),
])
def test_server_refuses_unknown_words_by_name(client, route, body, param):
    r = client.post(route, json={**body, "max_tokens": 2} if route != "/generate" else body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    word = "'wat'" if param == "prompt[1]" else "'hello'"
    assert error["param"] == param and word in error["message"] and "vocabulary" in error["message"], error
