"""The documents of the lm-eval tasks in this folder, built from the shipped model's held-out tasks.

    python -m tests.lm_eval_tasks.pointer_chase_data OUT_DIR [--model models/pointer-chase] [--limit N]

writes OUT_DIR/pointer_chase.jsonl, one document per held-out task:

- ``prompt``: the task's prompt as text (bos, the 20 pairs, ``?``, the start node), what /v1/completions gets;
- ``task``: the same without bos, the user message of the chat task (the chat template writes bos);
- ``answer``: the target (4 nodes, 4 hops apart), checked against the prompt by following the pairs by hand
  (tests/pointer_chase.py), independent of any engine;
- ``choices`` / ``gold``: the answer among wrong hop chains of the same task (3 and 5 hops, 4 hops from the
  start node's successor, the answer with its last node one hop too far), distinct, the answer at position
  ``gold`` = the document's index modulo the number of choices, so "always the first" scores ~1/5.

The task YAMLs name the file relatively (``data_files: pointer_chase.jsonl``): run lm-eval from OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tests.pointer_chase import expected_answer_words, id_to_word

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "pointer-chase"
FILE_NAME = "pointer_chase.jsonl"


def distractors(words: list[str], hops: int, answers: int) -> list[list[str]]:
    """Wrong hop chains of one task (`words` as in expected_answer_words), in a fixed order."""
    succ = dict(w.split(">") for w in words[1:-2])
    correct = expected_answer_words(words, hops, answers)
    shifted_start = words[:-1] + [succ[words[-1]]]
    return [expected_answer_words(words, hops - 1, answers), expected_answer_words(words, hops + 1, answers),
            expected_answer_words(shifted_start, hops, answers), correct[:-1] + [succ[correct[-1]]]]


def build_documents(model: Path = MODEL, limit: int | None = None) -> list[dict]:
    task_config = json.loads((model / "training.json").read_text())["task"]
    hops, answers = task_config["hops"], task_config["answers"]
    vocab = id_to_word(model)
    docs = []
    for line in (model / "heldout_tasks.jsonl").read_text().splitlines()[:limit]:
        task = json.loads(line)
        words = [vocab[i] for i in task["prompt_token_ids"]]
        answer = expected_answer_words(words, hops, answers)
        assert [vocab[i] for i in task["target_token_ids"]] == answer, "the task file disagrees with its prompt"
        wrong = []
        for chain in distractors(words, hops, answers):
            if chain != answer and chain not in wrong:
                wrong.append(chain)
        assert wrong, f"task {len(docs)}: every wrong chain equals the answer"
        gold = len(docs) % (len(wrong) + 1)
        choices = wrong[:gold] + [answer] + wrong[gold:]
        docs.append({"prompt": " ".join(words), "task": " ".join(words[1:]), "answer": " ".join(answer),
                     "choices": [" ".join(c) for c in choices], "gold": gold})
    return docs


def write_documents(out_dir: Path, model: Path = MODEL, limit: int | None = None) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / FILE_NAME
    path.write_text("".join(json.dumps(d) + "\n" for d in build_documents(model, limit)))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--limit", type=int, default=None, help="the first N held-out tasks (default: all)")
    args = parser.parse_args()
    print(write_documents(args.out_dir, args.model, args.limit))


if __name__ == "__main__":
    main()
