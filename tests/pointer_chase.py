"""An independent checker for the pointer-chase task files that examples/train_looped_model.py writes:
decode the prompt with the checkpoint's tokenizer.json vocabulary and follow the pairs by hand."""

from __future__ import annotations

import json
from pathlib import Path


def id_to_word(checkpoint: Path) -> dict[int, str]:
    vocab = json.loads((Path(checkpoint) / "tokenizer.json").read_text())["model"]["vocab"]
    return {i: w for w, i in vocab.items()}


def expected_answer_words(words: list[str], hops: int, answers: int) -> list[str]:
    """words: `<|im_start|> ns>nd ... ? nq`. Returns the nodes hops, 2*hops, ... steps after q."""
    assert words[0] == "<|im_start|>" and words[-2] == "?", words
    succ = dict(w.split(">") for w in words[1:-2])
    assert len(succ) == len(words) - 3 and sorted(succ.values()) == sorted(succ), "pairs must form a permutation"
    cur, out = words[-1], []
    for _ in range(answers):
        for _ in range(hops):
            cur = succ[cur]
        out.append(cur)
    return out


def check_task_file(checkpoint: Path, hops: int, answers: int) -> int:
    """Asserts every task's target is the hop chain of its prompt; returns the number of tasks."""
    vocab = id_to_word(checkpoint)
    n = 0
    for line in (Path(checkpoint) / "heldout_tasks.jsonl").read_text().splitlines():
        task = json.loads(line)
        words = [vocab[i] for i in task["prompt_token_ids"]]
        assert [vocab[i] for i in task["target_token_ids"]] == expected_answer_words(words, hops, answers)
        n += 1
    return n
