"""One configuration surface (issue 23 item 4): each rule one check with one message, whichever way a bad
value comes in (EngineConfig, SchedulerConfig, the CLIs)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ourobatch import EngineConfig
from ourobatch.engine_args import engine_config_from_args
from scheduler import SchedulerConfig

ROOT = Path(__file__).resolve().parents[1]

SCHEDULER = dict(num_kv_blocks=64, block_size=16, max_num_seqs=8, max_model_len=256, max_num_batched_tokens=512,
                 total_ut_steps=4, shallow_loops=2, deep_interval=4, mode="deferred", vocab_size=32)

# field, bad value, other fields it needs, the exception, the message after "<Owner>." (written out here, so
# a reworded or a second message fails)
RULES = [
    ("mode", "lazy", {}, ValueError, "mode must be one of ('deferred', 'eager', 'verify'), got 'lazy'"),
    ("shallow_loops", 0, {}, ValueError, "shallow_loops must satisfy 1 <= shallow_loops <= total_ut_steps - 1, got 0"),
    ("shallow_loops", 2.0, {}, TypeError, "shallow_loops must be an int, got float 2.0"),
    ("deep_interval", 0, {}, ValueError, "deep_interval must be >= 1, got 0"),
    ("deep_interval", "4", {}, TypeError, "deep_interval must be an int, got str '4'"),
    ("block_size", 0, {"max_num_batched_tokens": 512}, ValueError, "block_size must be >= 1, got 0"),
    ("num_kv_blocks", 0, {}, ValueError, "num_kv_blocks must be >= 1, got 0"),
    ("max_num_batched_tokens", 8, {"block_size": 16}, ValueError,
     "max_num_batched_tokens must be >= block_size (16): a step prefills at least one whole block, got 8"),
    ("max_num_batched_tokens", True, {}, TypeError, "max_num_batched_tokens must be an int, got bool True"),
    ("kv_allocation", "eager", {}, ValueError, "kv_allocation must be one of ('lazy', 'reserve'), got 'eager'"),
    ("kv_watermark", 1.0, {}, ValueError, "kv_watermark must be a number in [0, 1), got 1.0"),
    ("enable_prefix_caching", "yes", {}, TypeError, "enable_prefix_caching must be True or False, got 'yes'"),
    ("max_prefill_tokens_while_decoding", 8, {"block_size": 16}, ValueError,
     "max_prefill_tokens_while_decoding must be None or >= block_size (16): a step prefills at least one whole "
     "block, got 8"),
    ("max_prefill_tokens_while_decoding", 64.0, {}, TypeError,
     "max_prefill_tokens_while_decoding must be an int, got float 64.0"),
]


def _error(build, exc_type):
    with pytest.raises(exc_type) as info:
        build()
    return str(info.value)


@pytest.mark.parametrize("field, value, extra, exc_type, text", RULES)
def test_each_shared_rule_has_one_message_through_engine_and_scheduler_config(field, value, extra, exc_type, text):
    engine = _error(lambda: EngineConfig(model="m", **{**extra, field: value}), exc_type)
    scheduler = _error(lambda: SchedulerConfig(**{**SCHEDULER, **extra, field: value}), exc_type)
    assert engine == f"EngineConfig.{text}"
    assert scheduler == f"SchedulerConfig.{text}"


def test_shallow_loops_names_the_checkpoints_bound_where_it_is_known():
    text = "shallow_loops must satisfy 1 <= shallow_loops <= 3 (total_ut_steps - 1; this checkpoint's total_ut_steps " \
           "is 4), got 4"
    assert _error(lambda: SchedulerConfig(**{**SCHEDULER, "shallow_loops": 4}), ValueError) == f"SchedulerConfig.{text}"
    assert EngineConfig(model="m", shallow_loops=4).shallow_loops == 4  # T is the checkpoint's: checked at build


def test_the_logprobs_modes_are_one_constant_of_the_torch_free_boundary():
    from ourobatch import config
    from scheduler import params

    assert config.CHOICES["logprobs_mode"] is config.LOGPROBS_MODES is params.LOGPROBS_MODES == ("processed", "raw")
    text = r"^EngineConfig\.logprobs_mode must be one of \('processed', 'raw'\), got 'x'$"
    with pytest.raises(ValueError, match=text):
        EngineConfig(model="m", logprobs_mode="x")


def test_one_tokenizer_loader_for_the_front_ends(tmp_path):
    from ourobatch.text import load_tokenizer

    pytest.importorskip("tokenizers")
    shipped = ROOT / "models" / "pointer-chase"
    assert load_tokenizer(tmp_path) is None  # no tokenizer.json beside the checkpoint: token ids only
    for tok in (load_tokenizer(shipped), load_tokenizer(tmp_path, shipped), load_tokenizer(tmp_path,
                                                                                           shipped / "tokenizer.json")):
        assert tok.path == shipped / "tokenizer.json" and tok.encode("n1>n2") == tok.tok.encode("n1>n2").ids
    with pytest.raises(ValueError, match=r"no tokenizer\.json at"):
        load_tokenizer(shipped, tmp_path)  # one that was asked for must be there
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot load .*tokenizer\.json"):
        load_tokenizer(tmp_path)  # one that is there must load


# ------------------------------------------------------------------ the flags


def _serve_parser():
    pytest.importorskip("fastapi")
    from ourobatch.server.cli import build_parser

    return build_parser()


def _engine_flags(parser) -> dict[str, list[str]]:
    """EngineConfig field -> its option strings, for the flags add_engine_arguments made."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    return {a.dest: a.option_strings for a in parser._actions if a.dest in fields and a.option_strings}


def test_every_engine_config_field_is_a_serve_flag_with_help_from_config_py():
    parser = _serve_parser()
    flags = _engine_flags(parser)
    assert sorted(flags) == sorted(f.name for f in dataclasses.fields(EngineConfig))
    helps = {a.dest: a.help for a in parser._actions if a.dest in flags}
    for name, text in helps.items():
        assert text and not text.startswith(f"EngineConfig.{name}"), f"{name} has no help: comment it in config.py"
    assert "positions per KV block" in helps["block_size"]  # the comment beside the field in config.py
    assert flags["seed"] == ["--engine-seed", "--seed"] and flags["deep_interval"] == ["--deep-interval"]


def test_serve_flags_to_engine_config():
    from ourobatch.server.cli import build_config

    parser = _serve_parser()
    config = build_config(parser.parse_args(["--model", "m"]))
    # serve's defaults: vLLM's raw log-probs, and a step budget of 512 tokens of which at most 192 prefill
    # while requests decode (steady latency under arrivals)
    expected = dataclasses.replace(EngineConfig(model="m"), logprobs_mode="raw", max_num_batched_tokens=512,
                                   max_prefill_tokens_while_decoding=192)
    assert config == expected and EngineConfig(model="m").max_num_batched_tokens == 8192
    assert EngineConfig(model="m").max_prefill_tokens_while_decoding is None
    off = build_config(parser.parse_args(["--model", "m", "--max-prefill-tokens-while-decoding", "none"]))
    assert off.max_prefill_tokens_while_decoding is None
    args = ["--model", "m", "--mode", "verify", "--deep-interval", "4", "--num-kv-blocks", "12", "--cuda-graphs",
            "false", "--enable-prefix-caching", "off", "--kv-watermark", "0.5", "--engine-seed", "9", "--logprobs-mode",
            "processed", "--kv-allocation", "reserve", "--max-num-batched-tokens", "8192"]
    assert build_config(parser.parse_args(args)) == EngineConfig(
        model="m", mode="verify", deep_interval=4, num_kv_blocks=12, cuda_graphs=False, enable_prefix_caching=False,
        kv_watermark=0.5, seed=9, logprobs_mode="processed", kv_allocation="reserve", max_num_batched_tokens=8192,
        max_prefill_tokens_while_decoding=192)
    assert build_config(parser.parse_args(["--model", "m", "--seed", "7"])).seed == 7  # serve's --seed: the engine's
    assert build_config(parser.parse_args(["--model", "m", "--num-kv-blocks", "none", "--cuda-graphs",
                                           "auto"])).num_kv_blocks is None


def _generate_parser():
    from ourobatch.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["generate"]


def test_every_engine_config_field_is_a_generate_flag_too():
    serve_flags = _engine_flags(_serve_parser())
    flags = _engine_flags(_generate_parser())
    assert sorted(flags) == sorted(f.name for f in dataclasses.fields(EngineConfig))
    assert all(flags[name] == serve_flags[name] for name in flags if name != "seed")  # one spelling
    assert flags["seed"] == ["--engine-seed"]  # generate's --seed is the prompts' seed (below)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_help_lists_every_engine_flag(command):
    if command == "serve":
        pytest.importorskip("fastapi")
    proc = subprocess.run([sys.executable, "-m", "ourobatch", command, "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for f in dataclasses.fields(EngineConfig):
        flag = "--engine-seed" if f.name == "seed" else "--" + f.name.replace("_", "-")
        assert f"  {flag} " in proc.stdout, flag  # the flag's own line in the options list
    assert "--mode {deferred,eager,verify}" in proc.stdout and "(default: 1)" in proc.stdout


CLI_RULES = [(f, str(v), {k: str(x) for k, x in extra.items()}, text) for f, v, extra, exc, text in RULES
             if exc is ValueError]


@pytest.mark.parametrize("field, value, extra, text", CLI_RULES)
def test_a_bad_flag_gets_the_rules_one_message_from_both_clis(tmp_path, capsys, field, value, extra, text):
    from ourobatch.cli import main

    flags = [x for k, v in {**extra, field: value}.items() for x in ("--" + k.replace("_", "-"), v)]
    assert main(["generate", "--model", str(tmp_path), *flags]) == 2
    assert capsys.readouterr().err.strip() == f"ourobatch: error: EngineConfig.{text}"
    pytest.importorskip("fastapi")
    assert main(["serve", "--model", str(tmp_path), *flags]) == 2
    assert capsys.readouterr().err.strip() == f"ourobatch serve: error: EngineConfig.{text}"


def test_the_two_seeds_of_generate_and_serves_seed():
    gen = _generate_parser()
    args = gen.parse_args(["--model", "m", "--seed", "5"])  # generate's documented --seed: every prompt's
    assert args.sampling_seed == 5 and engine_config_from_args(args).seed == 0
    args = gen.parse_args(["--model", "m", "--sampling-seed", "6", "--engine-seed", "7"])
    assert args.sampling_seed == 6 and engine_config_from_args(args).seed == 7
    assert gen.parse_args(["--model", "m"]).sampling_seed is None
    serve = _serve_parser()  # serve's documented --seed: the engine's (vLLM's meaning)
    assert engine_config_from_args(serve.parse_args(["--model", "m", "--seed", "5"])).seed == 5
    assert engine_config_from_args(serve.parse_args(["--model", "m", "--engine-seed", "5"])).seed == 5
    with pytest.raises(SystemExit):
        serve.parse_args(["--model", "m", "--sampling-seed", "5"])  # serve's prompts carry their own seeds


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    from ourobatch.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("engine-args") / "model", seed=4)


def test_generate_seeds_end_to_end(tmp_path, ckpt):
    from ourobatch import SamplingParams, SyncEngine
    from ourobatch.cli import main

    prompts = [[1, 2, 3], [4, 5], [6]]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    common = ["generate", "--model", str(ckpt), "--dtype", "float64", "--block-size", "4", "--num-kv-blocks", "32",
              "--max-model-len", "32", "--max-tokens", "4", "--ignore-eos", "--no-progress", "--input", str(src)]

    def seeds(*flags: str) -> list[int]:
        dst = tmp_path / "out.jsonl"
        assert main([*common, "--output", str(dst), *flags]) == 0
        return [json.loads(line)["outputs"][0]["seed"] for line in dst.read_text().splitlines()]

    assert seeds("--seed", "5") == seeds("--sampling-seed", "5") == [5, 5, 5]
    config = EngineConfig(model=str(ckpt), dtype="float64", block_size=4, num_kv_blocks=32, max_model_len=32, seed=9)
    with SyncEngine(config) as llm:  # an unseeded request's seed derives from the engine seed (and its order)
        direct = [o.outputs[0].seed for o in llm.generate_batch(prompts, SamplingParams(max_tokens=4, ignore_eos=True))]
    assert seeds("--engine-seed", "9") == direct
    assert seeds() != direct  # the default engine seed, 0, derives others
