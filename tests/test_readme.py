"""The README's first example runs as written, from the repository root, and prints the shipped model's
answer (the held-out task's target, read from the task file, not from the engine)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_first_readme_example_prints_the_tasks_answer():
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert 'LLM("models/pointer-chase")' in code
    task = json.loads((ROOT / "models/pointer-chase/heldout_tasks.jsonl").read_text().splitlines()[0])
    vocab = json.loads((ROOT / "models/pointer-chase/tokenizer.json").read_text())["model"]["vocab"]
    words = {i: w for w, i in vocab.items()}
    expected = " ".join(words[i] for i in task["target_token_ids"])
    prompt = " ".join(words[i] for i in task["prompt_token_ids"])
    assert prompt in code  # the example's prompt is held-out task 0
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == expected, (out.stdout, out.stderr[-2000:])
