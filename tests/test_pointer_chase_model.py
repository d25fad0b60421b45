"""The shipped trained test bed, models/pointer-chase: it loads through the normal loader, meets its model
card through the engine, and reading tokens from a shallower loop is measurably worse (so the quality
harness has something to measure). The card's numbers come from the training script's own dense
evaluation on fresh samples; here they are re-measured on the held-out file through the engine, and a
sample is checked against the float64 oracle, which shares no code with either."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from engine.config import OuroConfig
from engine.loader import load_model
from tests.oracle import load_oracle
from tests.pointer_chase import check_task_file

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "pointer-chase"
Z = 3.29  # two-sided 99.9% normal quantile: the card and the held-out set are independent samples


@pytest.fixture(scope="module")
def card() -> dict:
    """The model card's per-loop exact match, from training.json, checked against the README table."""
    info = json.loads((MODEL / "training.json").read_text())
    table = dict(re.findall(r"^\| (\d) \| ([0-9.]+) \|$", (MODEL / "README.md").read_text(), flags=re.M))
    assert [float(table[str(t)]) for t in range(1, 5)] == pytest.approx(info["accuracy_per_loop"], abs=1e-4)
    return info


@pytest.fixture(scope="module")
def tasks() -> list[dict]:
    return [json.loads(line) for line in (MODEL / "heldout_tasks.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def full_depth(tasks) -> list:
    """Interval 1 (full-depth greedy decoding) on every held-out task."""
    return _generate(MODEL, [t["prompt_token_ids"] for t in tasks], deep_interval=1)


def _generate(model_dir: Path, prompts: list[list[int]], **engine_kw) -> list:
    config = EngineConfig(model=str(model_dir), max_num_seqs=256, max_model_len=64, **engine_kw)
    with SyncEngine(config) as llm:
        outs = llm.generate_batch(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    return [o.outputs[0] for o in outs]


def _accuracy(completions, tasks) -> float:
    ok = [c.finish_reason == "stop" and c.token_ids[:-1] == t["target_token_ids"] for c, t in zip(completions, tasks)]
    return sum(ok) / len(ok)


def _consistent(measured: float, n: int, claimed: float, claimed_n: int) -> bool:
    """Two independent binomial estimates agree within Z standard errors (with a floor for p near 0 or 1)."""
    var = sum(max(p * (1 - p), 1.0 / m) / m for p, m in ((measured, n), (claimed, claimed_n)))
    return abs(measured - claimed) <= Z * var ** 0.5


def test_checkpoint_files_and_loader(card):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md",
                 "heldout_tasks.jsonl"):
        assert (MODEL / name).is_file(), name
    assert (MODEL / "model.safetensors").stat().st_size < 25 * 2**20
    cfg = OuroConfig.from_checkpoint(MODEL)
    assert cfg.total_ut_steps == 4 and json.loads((MODEL / "config.json").read_text())["eos_token_id"] == 0
    model = load_model(str(MODEL), torch.float32, "cpu")
    params = sum(p.numel() for p in model.parameters())
    assert params == card["params"] and 1e6 < params < 10e6


def test_tokenizer_round_trips_the_tasks(tasks, card):
    from tokenizers import Tokenizer  # in the test extra

    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    assert tok.get_vocab_size() == OuroConfig.from_checkpoint(MODEL).vocab_size
    for t in tasks[:20]:
        text = tok.decode(t["prompt_token_ids"], skip_special_tokens=False)
        words = text.split()
        assert words[0] == "<|im_start|>" and words[-2] == "?" and len(words) == card["task"]["nodes"] + 3
        assert all(re.fullmatch(r"n\d+>n\d+", w) for w in words[1:-2])
        assert tok.encode(text).ids == t["prompt_token_ids"]


def test_the_tasks_are_what_the_card_says(tasks, card):
    """Independent of the model: every target really is the 4-hop chain through the prompt's pair tokens."""
    assert check_task_file(MODEL, card["task"]["hops"], card["task"]["answers"]) == len(tasks) == 500
    assert len(tasks[0]["prompt_token_ids"]) == card["task"]["nodes"] + 3


def test_full_depth_meets_the_card(tasks, card, full_depth):
    outs = full_depth
    assert all(c.readout_loops == [4] * len(c.token_ids) for c in outs)
    acc = _accuracy(outs, tasks)
    assert acc >= 0.9
    assert _consistent(acc, len(tasks), card["accuracy_per_loop"][3], card["eval_n"]), (acc, card)


@pytest.mark.parametrize("loops", [2, 3])
def test_truncated_models_meet_the_card(tmp_path, tasks, card, loops):
    """The same weights with total_ut_steps = t through the engine at full depth: the card's loop-t row."""
    for name in ("model.safetensors", "generation_config.json"):
        shutil.copy(MODEL / name, tmp_path / name)
    raw = json.loads((MODEL / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "total_ut_steps": loops}))
    outs = _generate(tmp_path, [t["prompt_token_ids"] for t in tasks], deep_interval=1, shallow_loops=1)
    acc = _accuracy(outs, tasks)
    assert _consistent(acc, len(tasks), card["accuracy_per_loop"][loops - 1], card["eval_n"]), (loops, acc, card)


def test_loop2_readout_is_clearly_worse(tasks, full_depth):
    """deferred with shallow_loops=2 reads answer tokens 2.. from loop 2: the test bed must show that, and
    reading them from loop 3 instead must cost less."""
    prompts = [t["prompt_token_ids"] for t in tasks]
    full = _accuracy(full_depth, tasks)
    acc = {}
    for B, s in ((2, 2), (4, 2), (4, 3)):
        outs = _generate(MODEL, prompts, mode="deferred", deep_interval=B, shallow_loops=s)
        assert all(c.readout_loops[0] == 4 and s in c.readout_loops for c in outs)
        acc[B, s] = _accuracy(outs, tasks)
    assert acc[2, 2] <= full - 0.10 and acc[4, 2] <= full - 0.10, acc
    assert acc[4, 2] < acc[4, 3] <= full, acc


def test_engine_matches_the_float64_oracle(tasks):
    """Greedy tokens from loop T (interval 1) and from the mixed schedule (deferred B=4, s=2) equal the oracle's
    greedy decoding with the same readout schedule on a sample of held-out tasks."""
    oracle = load_oracle(MODEL)
    sample = tasks[:12]
    prompts = [t["prompt_token_ids"] for t in sample]
    for kw, schedule in ((dict(deep_interval=1), lambda j: 4),
                         (dict(deep_interval=4, shallow_loops=2), lambda j: 4 if j == 1 or (j - 1) % 4 == 0 else 2)):
        outs = _generate(MODEL, prompts, dtype="float64", **kw)
        for prompt, c in zip(prompts, outs):
            seq, want = list(prompt), []
            for j in range(1, len(c.token_ids) + 1):
                nxt = int(oracle.forward(seq).logits[schedule(j) - 1, -1].argmax())
                want.append(nxt)
                seq.append(nxt)
                if nxt == 0:
                    break
            assert c.token_ids == want, kw
