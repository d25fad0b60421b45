"""Every example script runs on the CPU and prints what it promises."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.text import Tokenizer
from tests.pointer_chase import check_task_file

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_async_generate():
    out = run_example("async_generate.py")
    assert re.search(r"generated 4 requests: deep_calls=[1-9]\d* deep_rows=\d+", out), out
    assert out.count("finish=length") == 4


def test_streaming():
    out = run_example("streaming.py")
    # at least 3: a consumer slower than the engine (a busy machine) gets deltas of several tokens at once
    got = re.search(r"\[early\] got (\d+) tokens, closing the stream", out)
    assert got and int(got.group(1)) >= 3, out
    assert "early-closed request aborted: finished_abort=1" in out
    assert "[full]" in out and "finish=length" in out


def test_rl_collector():
    out = run_example("rl_collector.py")
    assert re.search(r"episodes=16 turns=48 tokens=\d+ mean_logprob=-?\d+\.\d+", out), out
    assert re.search(r"readout loops: loop 2: [\d.]+%, loop 4: [\d.]+%", out), out
    assert re.search(r"engine: deep_calls=[1-9]\d* deep_rows=\d+", out), out


def test_multi_turn_collector():
    out = run_example("multi_turn_collector.py")
    episodes = re.findall(r"batch (\d) task (\d) episode (\d): turns=3 policy_tokens=\[(\d+), (\d+), (\d+)\] "
                          r"tool_tokens=6 versions=\[(\d), (\d), (\d)\] reward=(0\.00|0\.50|1\.00)", out)
    assert sorted((int(m[1]), int(m[2])) for m in episodes) == [(t, e) for t in range(6) for e in range(2)], out
    num_policy_tokens = 0
    for m in episodes:
        batch, tokens, versions = int(m[0]), [int(x) for x in m[3:6]], [int(x) for x in m[6:9]]
        assert all(1 <= k <= 6 for k in tokens)
        # each turn starts after the one before: never under older weights, never past the batch's version
        assert versions == sorted(versions) and versions[-1] <= batch, out
        num_policy_tokens += sum(tokens)
    assert f"episodes=12 turns=36 policy_tokens={num_policy_tokens} tool_tokens=72 mean_reward=" in out, out
    assert re.search(r"collector: batches=3 updates=3 groups_stale=\d+ first_turn_tokens=\d+ "
                     r"staleness_histogram=\{0: \d+(, 1: \d+)?\}", out), out


@pytest.mark.parametrize("name", ["quickstart.py"])
def test_other_examples_run(name):
    assert run_example(name).strip()


def test_train_looped_model_toy(tmp_path):
    """The training script at toy size: it trains, evaluates every loop and writes a checkpoint that the
    engine loads and serves, with a tokenizer, a model card and a held-out task file whose targets are right."""
    out = tmp_path / "toy"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_looped_model.py"), "--out", str(out),
                           "--toy", "--max-steps", "30", "--minutes", "5", "--device", "cpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"per-loop exact match: loop1=[\d.]+ loop2=[\d.]+ loop3=[\d.]+ loop4=[\d.]+", proc.stdout)
    info = json.loads((out / "training.json").read_text())
    assert info["steps"] == 30 and len(info["accuracy_per_loop"]) == 4
    card = (out / "README.md").read_text()
    assert all(f"| {t + 1} | {a:.4f} |" in card for t, a in enumerate(info["accuracy_per_loop"]))
    assert check_task_file(out, info["task"]["hops"], info["task"]["answers"]) == 50
    task = json.loads((out / "heldout_tasks.jsonl").read_text().splitlines()[0])
    with SyncEngine(EngineConfig(model=str(out), deep_interval=2)) as llm:
        (result,) = llm.generate_batch([task["prompt_token_ids"]], SamplingParams(max_tokens=3, temperature=0.0))
    assert 1 <= len(result.outputs[0].token_ids) <= 3
    # the tokenizer marks eos and bos special and the chat template renders a task to its trained prompt
    specials = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    assert {t["content"]: t["id"] for t in specials if t["special"]} == {"<|endoftext|>": 0, "<|im_start|>": 1}
    tok = Tokenizer.from_path(out)
    message = [{"role": "user", "content": tok.decode(task["prompt_token_ids"][1:])}]
    assert tok.encode(tok.chat_template.render(message), add_special_tokens=False) == task["prompt_token_ids"]


@pytest.mark.parametrize("args, field", [(["--answers", "4", "--hops", "2", "--nodes", "8"], "--nodes"),
                                         (["--loop-weights", "1,1,1"], "--loop-weights"),
                                         (["--hidden", "200"], "--hidden"), (["--batch", "0"], "--batch")])
def test_train_looped_model_rejects_bad_arguments(tmp_path, args, field):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_looped_model.py"), "--out",
                           str(tmp_path / "x"), "--device", "cpu", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and field in proc.stderr, proc.stderr
    assert not (tmp_path / "x").exists()
