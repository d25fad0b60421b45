"""One configuration surface (issue 23 item 4): each rule one check with one message, whichever way a bad
value comes in (EngineConfig, SchedulerConfig, the CLIs)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ourobatch import EngineConfig
from ourobatch.scheduler import SchedulerConfig

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
    from ourobatch.scheduler import params

    assert config.CHOICES["logprobs_mode"] is config.LOGPROBS_MODES is params.LOGPROBS_MODES == ("processed", "raw")
    with pytest.raises(ValueError, match=r"^EngineConfig\.logprobs_mode must be one of \('processed', 'raw'\), got 'x'$"):
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
    expected = dataclasses.replace(EngineConfig(model="m"), logprobs_mode="raw")  # vLLM's, serve's default
    assert config == expected
    args = ["--model", "m", "--mode", "verify", "--deep-interval", "4", "--num-kv-blocks", "12", "--cuda-graphs",
            "false", "--enable-prefix-caching", "off", "--kv-watermark", "0.5", "--engine-seed", "9", "--logprobs-mode",
            "processed", "--kv-allocation", "reserve"]
    assert build_config(parser.parse_args(args)) == EngineConfig(
        model="m", mode="verify", deep_interval=4, num_kv_blocks=12, cuda_graphs=False, enable_prefix_caching=False,
        kv_watermark=0.5, seed=9, logprobs_mode="processed", kv_allocation="reserve")
    assert build_config(parser.parse_args(["--model", "m", "--seed", "7"])).seed == 7  # serve's --seed: the engine's
    assert build_config(parser.parse_args(["--model", "m", "--num-kv-blocks", "none", "--cuda-graphs",
                                           "auto"])).num_kv_blocks is None
