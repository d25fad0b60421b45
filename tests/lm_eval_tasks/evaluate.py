"""Runs lm-eval's simple_evaluate on this folder's tasks only, and writes its results and samples as JSON.

    python -m tests.lm_eval_tasks.evaluate --model local-completions \
        --model_args model=pointer-chase,base_url=http://127.0.0.1:8000/v1/completions,tokenizer_backend=remote \
        --tasks pointer_chase_choice --batch_size 32 --out results.json

The flags are lm-eval's CLI flags of the same names. The difference from ``lm-eval run --include_path
tests/lm_eval_tasks`` (which works the same, docs/server.md) is ``TaskManager(include_defaults=False)``:
the CLI indexes lm-eval's ~15,000 built-in task configs first (~40 s on a busy 2-core machine), these
tasks do not need them. Run it from the folder pointer_chase_data.py wrote (the YAMLs name their data
file relatively), with HF_DATASETS_OFFLINE=1 and HF_HUB_OFFLINE=1 so nothing is fetched.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent


def main() -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an lm-eval model type, e.g. local-completions")
    parser.add_argument("--model_args", required=True, help="k=v,k=v as lm-eval's CLI takes them")
    parser.add_argument("--tasks", required=True, help="comma-separated task names of this folder")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--apply_chat_template", action="store_true")
    parser.add_argument("--out", type=Path, required=True, help="JSON file: {results, samples}")
    args = parser.parse_args()
    result = lm_eval.simple_evaluate(
        model=args.model, model_args=args.model_args, tasks=args.tasks.split(","), batch_size=args.batch_size,
        apply_chat_template=args.apply_chat_template, log_samples=True,
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False))
    args.out.write_text(json.dumps({"results": result["results"], "samples": result["samples"]}, default=str))


if __name__ == "__main__":
    main()
