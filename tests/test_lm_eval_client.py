"""lm-eval (EleutherAI's lm-evaluation-harness) as a client of a real ``python -m ourobatch serve --model
models/pointer-chase`` on 127.0.0.1: its own model classes send their own requests, over the held-out
pointer-chase tasks (tests/lm_eval_tasks: the documents, with answers followed by hand from each prompt,
and the task YAMLs, read through ``dataset_path: json``; nothing is downloaded).

- local-completions, generate_until (text prompts, no tokenizer): exact match >= 0.95;
- local-completions, multiple_choice (loglikelihood: /v1/completions echo=true, max_tokens=1, token-id
  prompts from the server's own /tokenize via ``tokenizer_backend=remote``): the answer's loglikelihood
  above every wrong hop chain on >= 95% of tasks, and each loglikelihood lm-eval reports equal to the float64
  oracle's (tests/oracle.py) over the continuation's tokens;
- local-chat-completions with --apply_chat_template (/v1/chat/completions, the model's chat template):
  exact match >= 0.95;
- sglang-generate (/generate): generate_until with text; loglikelihood (``input_ids``,
  ``logprob_start_len=0``) needs a Hugging Face tokenizer (lm-eval's remote tokenizer cannot be used with
  the /generate url), so that case runs only where ``transformers`` is installed.

lm-eval runs in a subprocess (tests/lm_eval_tasks/evaluate.py: simple_evaluate on these tasks only) so its
seeding and logging stay out of this process. Installed by ``pip install -e ".[clients]"`` (in ``[test]``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval", reason='lm-eval is not installed: pip install -e ".[clients]" (part of [test])')

from tests.lm_eval_tasks.pointer_chase_data import write_documents  # noqa: E402
from tests.oracle import load_oracle  # noqa: E402
from tests.pointer_chase import id_to_word  # noqa: E402
from tests.server_helpers import MODEL, ROOT, start_subprocess  # noqa: E402

NAME = "pointer-chase"
NUM_DOCS = 200  # the first held-out tasks; the choice and chat tasks use fewer (each choice is a request)
MIN_SCORE = 0.95
WORD_IDS = {w: i for i, w in id_to_word(MODEL).items()}


@pytest.fixture(scope="module")
def server():
    proc, url = start_subprocess("--model", str(MODEL), "--served-model-name", NAME, "--max-num-seqs", "64")
    yield url
    proc.terminate()
    assert proc.wait(120) == 0


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("lm_eval")


def run_lm_eval(docs_dir, model: str, model_args: str, task: str, batch_size: int = 1,
                chat: bool = False, num_docs: int = NUM_DOCS) -> tuple[dict, list[dict]]:
    """lm-eval on `task` over the first `num_docs` documents; its metrics and per-document samples."""
    work = docs_dir / f"{model}-{task}-{num_docs}"
    write_documents(work, limit=num_docs)
    out = work / "results.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(work / "hf"), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "tests.lm_eval_tasks.evaluate", "--model", model, "--model_args",
           f"model={NAME},max_length=512,{model_args}", "--tasks", task, "--batch_size", str(batch_size),
           "--out", str(out)] + (["--apply_chat_template"] if chat else [])
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(out.read_text())
    samples = result["samples"][task]
    assert len(samples) == num_docs
    return result["results"][task], samples


def check_exact_match(metrics: dict, samples: list[dict]) -> None:
    """lm-eval's exact match, recounted from its samples against the documents' answers."""
    hits = [s["filtered_resps"][0] == s["doc"]["answer"] for s in samples]
    assert metrics["exact_match,none"] == pytest.approx(sum(hits) / len(hits))
    assert sum(hits) >= MIN_SCORE * len(hits), [s["filtered_resps"][0] for s in samples if
                                               s["filtered_resps"][0] != s["doc"]["answer"]][:5]


def check_choices(metrics: dict, samples: list[dict]) -> None:
    """The answer's loglikelihood strictly above every distractor's on >= 95%; lm-eval's acc agrees."""
    above = []
    for s in samples:
        scores = [ll for ll, _ in s["filtered_resps"]]
        gold = s["doc"]["gold"]
        assert s["doc"]["choices"][gold] == s["doc"]["answer"] and len(scores) == len(s["doc"]["choices"])
        above.append(all(scores[gold] > x for i, x in enumerate(scores) if i != gold))
    assert sum(above) >= MIN_SCORE * len(above)
    assert metrics["acc,none"] == pytest.approx(sum(above) / len(above))


def oracle_loglikelihood(oracle, context: str, continuation: str) -> tuple[float, bool]:
    """log p(continuation | context) at full depth (loop T) in float64, raw log-probs (the server's default,
    as vLLM's), and whether every continuation token is the argmax; the words mapped by tokenizer.json."""
    ctx, cont = [WORD_IDS[w] for w in context.split()], [WORD_IDS[w] for w in continuation.split()]
    ids = ctx + cont
    logprobs = torch.log_softmax(oracle.forward(ids).logits[-1], dim=-1)  # [P, vocab]
    rows = range(len(ctx) - 1, len(ids) - 1)  # position i predicts token i + 1
    total = sum(float(logprobs[i, ids[i + 1]]) for i in rows)
    return total, all(int(logprobs[i].argmax()) == ids[i + 1] for i in rows)


def check_against_oracle(samples: list[dict], num_docs: int = 3, check_greedy: bool = True) -> None:
    oracle = load_oracle(MODEL)
    for s in samples[:num_docs]:
        for choice, (ll, greedy) in zip(s["doc"]["choices"], s["filtered_resps"]):
            want, want_greedy = oracle_loglikelihood(oracle, s["doc"]["prompt"], choice)
            assert ll == pytest.approx(want, rel=1e-4, abs=2e-3), (choice, ll, want)  # the server runs float32
            assert greedy == want_greedy or not check_greedy, choice


def test_local_completions_generate(server, docs_dir):
    metrics, samples = run_lm_eval(docs_dir, "local-completions",
                                   f"base_url={server}/v1/completions,tokenizer_backend=None",
                                   "pointer_chase_generate", batch_size=32)
    assert samples[0]["arguments"][0][0] == samples[0]["doc"]["prompt"]  # the prompt went as text
    check_exact_match(metrics, samples)


def test_local_completions_loglikelihood(server, docs_dir):
    metrics, samples = run_lm_eval(docs_dir, "local-completions",
                                   f"base_url={server}/v1/completions,tokenizer_backend=remote",
                                   "pointer_chase_choice", batch_size=32, num_docs=100)
    check_choices(metrics, samples)
    check_against_oracle(samples)


def test_local_chat_completions_generate(server, docs_dir):
    metrics, samples = run_lm_eval(docs_dir, "local-chat-completions", f"base_url={server}/v1/chat/completions",
                                   "pointer_chase_chat", chat=True, num_docs=50)
    messages = json.loads(samples[0]["arguments"][0][0][0])  # lm-eval's JsonChatStr, a 1-tuple
    assert messages == [{"role": "user", "content": samples[0]["doc"]["task"]}]  # no bos: the template adds it
    check_exact_match(metrics, samples)


def test_sglang_generate(server, docs_dir):
    metrics, samples = run_lm_eval(docs_dir, "sglang-generate", f"base_url={server}/generate,tokenizer_backend=None",
                                   "pointer_chase_generate", batch_size=8, num_docs=50)
    check_exact_match(metrics, samples)


def test_sglang_generate_loglikelihood(server, docs_dir):
    pytest.importorskip("transformers", reason="lm-eval's sglang-generate scores token ids from a Hugging Face "
                        "tokenizer: pip install transformers (not in [clients]: ~1 min more to install)")
    metrics, samples = run_lm_eval(docs_dir, "sglang-generate",
                                   f"base_url={server}/generate,tokenizer_backend=huggingface,tokenizer={MODEL}",
                                   "pointer_chase_choice", batch_size=8, num_docs=50)
    check_choices(metrics, samples)
    check_against_oracle(samples, check_greedy=False)  # lm-eval 0.4.13's sglang is_greedy is inverted
