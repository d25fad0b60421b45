"""The command line, ``python -m ourobatch generate``, on a tiny checkpoint (CPU, seconds)."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.cli import main
from ourobatch.testing import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
T = 4  # total_ut_steps of the tiny checkpoint
SHALLOW = 2
B = 3
PROMPTS = [[1, 5, 7], [2, 3], [4, 4, 4, 4], [9]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("cli") / "model", seed=3)


@pytest.fixture(scope="module")
def tok_ckpt(tmp_path_factory, ckpt) -> Path:
    """The same checkpoint with a tiny WordLevel tokenizer.json beside it (31 tokens, like the vocab)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    path = tmp_path_factory.mktemp("cli-tok") / "model"
    shutil.copytree(ckpt, path)
    vocab = {"<eos>": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, 31)}}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


def engine_args(model: Path, **extra: object) -> list[str]:
    args = ["generate", "--model", str(model), "--dtype", "float64", "--deep-interval", str(B),
            "--shallow-loops", str(SHALLOW), "--block-size", "4", "--num-kv-blocks", "64",
            "--max-model-len", "128", "--no-progress"]
    for key, value in extra.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args


def engine_config(model: Path) -> EngineConfig:
    return EngineConfig(model=str(model), dtype="float64", deep_interval=B, shallow_loops=SHALLOW, block_size=4,
                        num_kv_blocks=64, max_model_len=128)


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def expected_loops(n: int) -> list[int]:
    return [T if j == 1 or (j - 1) % B == 0 else SHALLOW for j in range(1, n + 1)]


def run(tmp_path: Path, rows: list[object], args: list[str]) -> tuple[int, Path]:
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    dst = tmp_path / "out.jsonl"
    return main(args + ["--input", str(src), "--output", str(dst)]), dst


# ------------------------------------------------------------------ happy paths


def test_generate_file_order_schedule_and_same_tokens_as_sync_engine(tmp_path, ckpt, capsys):
    rows = [{"prompt_token_ids": p} for p in PROMPTS]
    rows[1]["request_id"] = "custom"
    rows.insert(2, "")  # a blank line is skipped
    rc, dst = run(tmp_path, rows, engine_args(ckpt, max_tokens=10, temperature=0.9, seed=5, ignore_eos=True))
    err = capsys.readouterr().err
    assert rc == 0, err
    out = read_jsonl(dst)
    assert [o["request_id"] for o in out] == ["line-1", "custom", "line-4", "line-5"]
    assert [o["prompt_token_ids"] for o in out] == PROMPTS
    for o in out:
        (c,) = o["outputs"]
        assert set(c) == {"index", "token_ids", "logprobs", "readout_loops", "cumulative_logprob",
                          "finish_reason", "seed"}  # no text without a tokenizer, no top_logprobs
        assert c["index"] == 0 and c["seed"] == 5 and c["finish_reason"] == "length"
        assert len(c["token_ids"]) == len(c["logprobs"]) == 10
        assert c["readout_loops"] == expected_loops(10)
        assert c["cumulative_logprob"] == pytest.approx(sum(c["logprobs"]))
    # The final summary line on stderr carries the engine's counters.
    summary = err.strip().splitlines()[-1]
    for key in ("deep_calls=", "deep_rows=", "shallow_steps=", "40 tokens", "tokens/s"):
        assert key in summary

    params = SamplingParams(max_tokens=10, temperature=0.9, seed=5, ignore_eos=True)
    with SyncEngine(engine_config(ckpt)) as llm:
        direct = llm.generate_batch(PROMPTS, params)
    for o, d in zip(out, direct):
        assert o["outputs"][0]["token_ids"] == d.outputs[0].token_ids
        assert o["outputs"][0]["logprobs"] == pytest.approx(d.outputs[0].logprobs, abs=1e-9)
        assert o["outputs"][0]["readout_loops"] == d.outputs[0].readout_loops


def test_per_line_sampling_params_override_the_defaults(tmp_path, ckpt):
    rows = [
        {"prompt_token_ids": [1, 5, 7]},
        {"prompt_token_ids": [2, 3], "sampling_params": {"max_tokens": 4, "temperature": 0, "seed": 11,
                                                          "logprobs": 2}},
        {"prompt_token_ids": [4, 4], "sampling_params": {"n": 2, "stop_token_ids": [], "max_tokens": 5}},
    ]
    rc, dst = run(tmp_path, rows, engine_args(ckpt, max_tokens=7, temperature=0.8, seed=1, ignore_eos=True))
    assert rc == 0
    a, b, c = read_jsonl(dst)
    assert len(a["outputs"][0]["token_ids"]) == 7 and a["outputs"][0]["seed"] == 1
    assert "top_logprobs" not in a["outputs"][0]
    bo = b["outputs"][0]
    assert len(bo["token_ids"]) == 4 and bo["seed"] == 11 and bo["readout_loops"] == expected_loops(4)
    assert len(bo["top_logprobs"]) == 4
    for tok, top in zip(bo["token_ids"], bo["top_logprobs"]):
        assert str(tok) in top and all(isinstance(k, str) for k in top)
        assert max(v for v in top.values() if v is not None) == pytest.approx(top[str(tok)])  # greedy
    assert [o["index"] for o in c["outputs"]] == [0, 1]
    assert all(len(o["token_ids"]) == 5 for o in c["outputs"])
    assert c["outputs"][0]["seed"] == 1 and c["outputs"][1]["seed"] != 1  # each completion its own seed

    with SyncEngine(engine_config(ckpt)) as llm:
        greedy = llm.generate([2, 3], SamplingParams(max_tokens=4, temperature=0, seed=11, ignore_eos=True))
    assert bo["token_ids"] == greedy.outputs[0].token_ids


def test_eager_mode_gives_the_same_tokens_as_deferred(tmp_path, ckpt):
    rows = [{"prompt_token_ids": p} for p in PROMPTS]
    common = dict(max_tokens=9, temperature=1.0, seed=3, ignore_eos=True)
    rc1, d1 = run(tmp_path, rows, engine_args(ckpt, mode="deferred", **common))
    out1 = read_jsonl(d1)
    rc2, d2 = run(tmp_path, rows, engine_args(ckpt, mode="eager", **common))
    out2 = read_jsonl(d2)
    assert rc1 == rc2 == 0
    for x, y in zip(out1, out2):
        assert x["outputs"][0]["token_ids"] == y["outputs"][0]["token_ids"]
        assert x["outputs"][0]["readout_loops"] == y["outputs"][0]["readout_loops"] == expected_loops(9)
        assert x["outputs"][0]["logprobs"] == pytest.approx(y["outputs"][0]["logprobs"], abs=1e-9)


def test_verify_mode_greedy_equals_interval_one(tmp_path, ckpt):
    rows = [{"prompt_token_ids": p} for p in PROMPTS]
    common = dict(max_tokens=9, temperature=0, ignore_eos=True)
    rc1, d1 = run(tmp_path, rows, engine_args(ckpt, mode="deferred", deep_interval=1, **common))
    out1 = read_jsonl(d1)
    rc2, d2 = run(tmp_path, rows, engine_args(ckpt, mode="verify", deep_interval=4, **common))
    out2 = read_jsonl(d2)
    assert rc1 == rc2 == 0
    for x, y in zip(out1, out2):
        assert x["outputs"][0]["token_ids"] == y["outputs"][0]["token_ids"]
        assert y["outputs"][0]["readout_loops"] == [4] * 9


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_stdin_to_stdout_with_a_progress_bar_only_on_a_terminal(ckpt, monkeypatch, capsys, terminal):
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"prompt_token_ids": [1, 2]}\n{"prompt_token_ids": [3]}\n'))
    if terminal:
        monkeypatch.setattr(sys, "stderr", _Terminal())
    args = [a for a in engine_args(ckpt, max_tokens=5, ignore_eos=True) if a != "--no-progress"]
    assert main(args) == 0
    captured = capsys.readouterr()
    err = sys.stderr.getvalue() if terminal else captured.err
    out = [json.loads(line) for line in captured.out.splitlines()]
    assert [o["prompt_token_ids"] for o in out] == [[1, 2], [3]]
    assert all(len(o["outputs"][0]["token_ids"]) == 5 for o in out)
    # The tqdm bar ("generate: ... 2/2") on a terminal; in a pipe or a log file only the startup line
    # (issue 21 item 11: the console log's generate_ready) and the summary line.
    assert ("2/2" in err and "generate" in err) is terminal
    assert "tokens/s" in err.strip().splitlines()[-1]
    if not terminal:
        lines = err.strip().splitlines()
        assert len(lines) == 2 and "generate_ready" in lines[0] and "\r" not in err


def test_text_prompts_with_a_tokenizer(tmp_path, tok_ckpt):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_ckpt / "tokenizer.json"))
    rows = [{"prompt": "w3 w4 w5", "request_id": "t"}, {"prompt_token_ids": [2, 3]}]
    rc, dst = run(tmp_path, rows, engine_args(tok_ckpt, max_tokens=6, seed=0, ignore_eos=True))
    assert rc == 0
    t, ids = read_jsonl(dst)
    assert t["request_id"] == "t" and t["prompt_token_ids"] == [3, 4, 5]
    for o in (t, ids):
        c = o["outputs"][0]
        assert c["text"] == tok.decode(c["token_ids"])
        assert len(c["token_ids"]) == 6

    with SyncEngine(engine_config(tok_ckpt)) as llm:
        direct = llm.generate([3, 4, 5], SamplingParams(max_tokens=6, seed=0, ignore_eos=True))
    assert t["outputs"][0]["token_ids"] == direct.outputs[0].token_ids


def test_text_follows_the_lines_params_and_prompt_logprobs_are_written(tmp_path, tok_ckpt):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_ckpt / "tokenizer.json"))
    stop = {"max_tokens": 6, "seed": 0, "stop_token_ids": [7, 8, 9, 10, 11, 12, 13, 14, 15]}
    rows = [{"prompt_token_ids": [2, 3, 4], "sampling_params": {**stop, "prompt_logprobs": 2}},
            {"prompt_token_ids": [2, 3, 4], "sampling_params": {**stop, "include_stop_str_in_output": True}},
            {"prompt_token_ids": [2, 3, 4], "sampling_params": {**stop, "detokenize": False}}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    src.write_bytes(b"\xef\xbb\xbf" + src.read_bytes())  # a BOM before line 1 (some editors write one)
    dst = tmp_path / "out.jsonl"
    assert main(engine_args(tok_ckpt, ignore_eos=True) + ["--input", str(src), "--output", str(dst)]) == 0
    plain, kept, silent = read_jsonl(dst)
    ids = plain["outputs"][0]["token_ids"]
    assert kept["outputs"][0]["token_ids"] == ids and plain["outputs"][0]["finish_reason"] == "stop"
    assert plain["outputs"][0]["text"] == tok.decode(ids[:-1])  # the stop token's text left out, as vLLM
    assert kept["outputs"][0]["text"] == tok.decode(ids)
    assert silent["outputs"][0]["text"] == ""
    with SyncEngine(engine_config(tok_ckpt)) as llm:
        ref = llm.generate([2, 3, 4], SamplingParams(**stop, prompt_logprobs=2)).prompt_logprobs
    assert plain["prompt_logprobs"][0] is None and len(plain["prompt_logprobs"]) == 3
    for got, want in zip(plain["prompt_logprobs"][1:], ref[1:]):
        assert list(got) == [str(t) for t in want]  # the prompt token first, then the 2 best
        assert [v["rank"] for v in got.values()] == [lp.rank for lp in want.values()]
        assert [v["logprob"] for v in got.values()] == pytest.approx([lp.logprob for lp in want.values()])
    assert "prompt_logprobs" not in kept


# ------------------------------------------------------------------ errors


GOOD = {"prompt_token_ids": [1, 2, 3]}


@pytest.fixture
def never_load(monkeypatch) -> list[str]:
    """Records (and refuses) any attempt to load weights: bad input must fail before the slow load."""
    calls: list[str] = []

    def load_model(path, *args, **kwargs):
        calls.append(str(path))
        raise RuntimeError("the weights were loaded although the input is bad")

    monkeypatch.setattr("ourobatch.assembly.load_model", load_model)
    return calls


@pytest.mark.parametrize("rows, line, needle", [
    ([GOOD, '{"prompt_token_ids": [1, 2', GOOD], 2, "not valid JSON"),
    ([GOOD, "[1, 2, 3]"], 2, "JSON object"),
    ([GOOD, GOOD, {"prompt_token_ids": [1], "sampling_params": {"temprature": 0.5}}], 3, "temprature"),
    ([{"prompt": "hello there"}], 1, "tokenizer.json"),
    ([GOOD, {"prompt_token_ids": []}], 2, "empty"),
    ([{"prompt_token_ids": [1, "2"]}], 1, "list of ints"),
    ([GOOD, {"prompt_token_ids": [1], "prompt": "x"}], 2, "exactly one"),
    ([GOOD, {"prompt_token_ids": [1], "sampling_params": {"top_p": 0}}], 2, "top_p"),
    ([{"prompt_token_ids": [1], "request_id": "a"}, {"prompt_token_ids": [1], "request_id": "a"}], 2,
     "already used"),
    ([GOOD, {"prompt_token_ids": [1, 99]}], 2, "vocabulary"),  # the engine's own admission checks
    ([GOOD, GOOD, GOOD, {"prompt_token_ids": [1], "sampling_params": {"max_tokens": 500}}], 4, "max_model_len"),
    ([GOOD, {"prompt_token_ids": [1], "sampling_params": {"n": 300}}], 2, "max_num_seqs=256"),
    ([GOOD, {"prompt_token_ids": [1], "sampling_params": {"stop_token_ids": [31]}}], 2, "stop_token_ids"),
])
def test_bad_input_exits_2_naming_the_line_and_generates_nothing(tmp_path, ckpt, capsys, never_load, rows, line,
                                                                 needle):
    rc, dst = run(tmp_path, rows, engine_args(ckpt, max_tokens=4))
    err = capsys.readouterr().err
    assert rc == 2
    assert f"line {line}" in err and needle in err
    assert "Traceback" not in err
    assert not dst.exists()  # validated before anything ran or was written
    assert never_load == []  # ... and before the weights were loaded


def test_unknown_words_of_a_text_prompt_are_an_error(tmp_path, tok_ckpt, capsys, never_load):
    rows = [{"prompt": "w3 w4"}, {"prompt": "w3 hello w4 wat hello"}, GOOD]
    rc, dst = run(tmp_path, rows, engine_args(tok_ckpt, max_tokens=4))
    err = capsys.readouterr().err
    assert rc == 2 and "line 2" in err and "'hello', 'wat'" in err and "[UNK]" in err
    assert "line 1" not in err and not dst.exists() and never_load == []


def test_unknown_words_with_the_shipped_tokenizer(tmp_path, capsys, never_load):
    # models/pointer-chase/tokenizer.json maps every unknown word to id 0 (its unk token, also its eos).
    rows = [{"prompt": "n12 n4>n3 n2"}, {"prompt": "n12 what n2"}]
    rc, dst = run(tmp_path, rows, ["generate", "--model", str(ROOT / "models" / "pointer-chase"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "input line 2" in err and "'what'" in err and "<|endoftext|>" in err
    assert "line 1" not in err and never_load == []


def test_text_prompt_without_the_tokenizers_package(tmp_path, tok_ckpt, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError
    rc, _ = run(tmp_path, [GOOD, {"prompt": "w3 w4"}], engine_args(tok_ckpt, max_tokens=4))
    err = capsys.readouterr().err
    assert rc == 2 and "line 2" in err and "tokenizers" in err and "not installed" in err


@pytest.mark.parametrize("extra, needle", [
    (["--deep-interval", "0"], "deep_interval"),
    (["--shallow-loops", "4"], "shallow_loops"),
    (["--temperature", "-1"], "temperature"),
])
def test_library_errors_exit_2_without_traceback(tmp_path, ckpt, capsys, extra, needle):
    rc, _ = run(tmp_path, [GOOD], engine_args(ckpt) + extra)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err


def test_missing_checkpoint_exits_2(tmp_path, capsys):
    rc, _ = run(tmp_path, [GOOD], engine_args(tmp_path / "nope"))
    err = capsys.readouterr().err
    assert rc == 2 and "nope" in err and "Traceback" not in err


def test_usage_errors_exit_2(tmp_path, ckpt, capsys):
    assert main([]) == 2
    assert main(["generate"]) == 2  # --model is required
    rc, _ = run(tmp_path, [GOOD], engine_args(ckpt) + ["--stop-token-ids", "1,x"])
    assert rc == 2
    assert "stop-token-ids" in capsys.readouterr().err
    for out, needle in [(tmp_path, "is a folder"), (tmp_path / "no" / "o.jsonl", "does not exist")]:
        src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
        assert main(engine_args(ckpt) + ["--input", str(src), "--output", str(out)]) == 2  # before the load
        assert needle in capsys.readouterr().err


def test_help_explains_the_modes():
    proc = subprocess.run([sys.executable, "-m", "ourobatch", "generate", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "deferred" in text and "eager" in text and "verify" in text
    assert "The default (--deep-interval 1) is ordinary full-depth decoding" in " ".join(text.split())
    assert "example:" in text and "python -m ourobatch generate" in text


def _truncate(ckpt: Path) -> None:
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:len(data) // 2])


def _nan_weight(ckpt: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["lm_head.weight"][3, 1] = float("nan")
    save_file(tensors, str(ckpt / "model.safetensors"))


def _zero_heads(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 0, "head_dim": None}))


@pytest.mark.parametrize("corrupt, file, needle", [
    (_truncate, "model.safetensors", "not a readable safetensors file"),
    (_nan_weight, "model.safetensors", "lm_head.weight has 1 non-finite value"),
    (_zero_heads, "config.json", "num_attention_heads must be an integer >= 1"),
])
def test_a_corrupted_checkpoint_exits_2_with_a_one_line_message(tmp_path, ckpt, capsys, corrupt, file, needle):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    corrupt(bad)
    rc, dst = run(tmp_path, [GOOD], engine_args(bad))
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("ourobatch: error: ") and str(bad / file) in lines[0] and needle in lines[0]
    assert not dst.exists()
