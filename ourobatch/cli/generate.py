"""``python -m ourobatch generate --model DIR [options] < prompts.jsonl > out.jsonl``.

Reads JSONL prompts, validates every line before the model loads (jsonl.py), generates them all with
``SyncEngine.generate_batch`` and writes one JSONL output per input line, in input order. The engine's
flags are ourobatch.engine_args' (the same as serve's); the sampling flags set every prompt's defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, TextIO

from ourobatch._logging import DEFAULT_LOG_LEVEL, LOG_LEVELS
from ourobatch.config import EngineConfig
from ourobatch.engine_args import add_engine_arguments, engine_config_from_args
from scheduler.errors import CheckpointError, OurobatchError, RequestRejectedError
from ourobatch.log import get_logger
from scheduler.params import SamplingParams

from .jsonl import CheckpointTokenizer, InputError, PromptLine, check_requests, output_record, read_lines

log = get_logger("ourobatch.cli")
EXIT_OK = 0
EXIT_USAGE = 2

DESCRIPTION = """\
Generate completions for JSONL prompts with an Ouro (looped) checkpoint.

The default (--deep-interval 1) is ordinary full-depth decoding: the checkpoint's own policy.
--deep-interval B > 1 opts into a mode below; deferred and eager trade quality for speed (the tokens
between deep calls are read from loop s: on the shipped pointer-chase model --shallow-loops 2 loses
nearly every answer, 3 costs 1-2 points; docs/quality.md), verify does not.

Modes (--mode):
  deferred  Every decoded token runs only the shallow loops (1..s, --shallow-loops) and is read out
            from loop s; the deep loops (s+1..T) are deferred and run batched every B tokens
            (--deep-interval) for all retained positions of every request at once. The token right
            after each deep call is read from loop T. Lossy for B > 1.
  eager     The same readout schedule, but the deep loops run for every token as soon as it is fed
            (no batching): the control that isolates the batching effect. Same tokens and log-probs.
  verify    Lossless: tokens between deep calls are drafts from loop s; each deep call verifies them
            against loop T by speculative rejection sampling and rolls back from the first rejection.
            The output follows full-depth decoding exactly (greedy: the same tokens as interval 1).

Input: one JSON object per line, with "prompt_token_ids" (list of ints) or "prompt" (text; needs a
tokenizer.json beside the checkpoint and the `tokenizers` package; a word outside its vocabulary is an
error), an optional "request_id" (default "line-N") and an optional "sampling_params" object whose fields
override the command-line defaults. Blank lines are skipped. Every line is checked (against config.json
and the tokenizer) before the model loads; a bad line exits with code 2.

Output: one JSON object per input line, in input order: request_id, prompt_token_ids[,
prompt_logprobs] and outputs, a list of {index, token_ids, logprobs, readout_loops, cumulative_logprob,
finish_reason, seed[, text][, top_logprobs][, error]}. logprobs are the sampled tokens' log-probs,
processed (under the distribution each was drawn from) unless --logprobs-mode raw; top_logprobs (with
--logprobs k) maps token ids (as strings) to log-probs; -inf (an excluded token) is written null. text
(with a tokenizer) follows vLLM: "" with detokenize false, special tokens per skip_special_tokens, a final
eos / stop token's text only with include_stop_str_in_output. prompt_logprobs (a line's
sampling_params.prompt_logprobs k): null for position 0, then per prompt position token id (as a string)
-> {logprob, rank}, the prompt token first, then the k best.
"""

EPILOG = """\
example:
  printf '%s\\n' '{"prompt_token_ids": [1, 5, 7]}' \\
                 '{"prompt_token_ids": [2, 3], "sampling_params": {"temperature": 0, "max_tokens": 8}}' \\
    | python -m ourobatch generate --model ./ouro-1.4b --mode deferred --deep-interval 4 \\
        --max-tokens 32 --temperature 0.8 --seed 0 > out.jsonl

--seed (or --sampling-seed) is the seed of every prompt (a line's sampling_params.seed overrides it), so
identical prompts with the same seed give identical completions; use --n for several samples of a prompt
(each gets its own seed). Without a seed each request gets one derived from the engine seed (--engine-seed,
default 0) and the number of unseeded lines before it, reported in the output's "seed": the same input
gives the same output every run. (serve's --seed is its engine seed, as in vLLM.)
"""


# --------------------------------------------------------------------------- arguments


def _token_id_list(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {text!r}")
    return ids


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The generate subcommand's parser, on the top-level parser's subparsers `sub`."""
    gen = sub.add_parser("generate", help="generate completions for JSONL prompts",
                         description=DESCRIPTION, epilog=EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    io = gen.add_argument_group("input and output")
    io.add_argument("--input", default="-", metavar="FILE", help="JSONL prompts (default: - = stdin)")
    io.add_argument("--output", default="-", metavar="FILE", help="JSONL outputs (default: - = stdout)")
    io.add_argument("--no-progress", action="store_true",
                    help="no progress bar on stderr (there is none when stderr is not a terminal)")
    io.add_argument("--log-level", default=DEFAULT_LOG_LEVEL, choices=LOG_LEVELS,
                    help="what stderr shows: info = the startup line and warnings (a capped max_model_len, ...), "
                         "debug adds per-request events (default: %(default)s)")

    add_engine_arguments(gen)  # --model and every other EngineConfig field (ourobatch.engine_args)

    _add_sampling_arguments(gen)
    return gen


def _add_sampling_arguments(gen: argparse.ArgumentParser) -> None:
    smp = gen.add_argument_group("sampling defaults for every prompt (SamplingParams)")
    s = SamplingParams.__dataclass_fields__
    smp.add_argument("--max-tokens", type=int, default=s["max_tokens"].default, metavar="M",
                     help="generated tokens at most (default: %(default)s)")
    smp.add_argument("--temperature", type=float, default=s["temperature"].default, metavar="T",
                     help="0 = greedy (default: %(default)s)")
    smp.add_argument("--top-p", type=float, default=s["top_p"].default, metavar="P", help="(default: %(default)s)")
    smp.add_argument("--top-k", type=int, default=s["top_k"].default, metavar="K",
                     help="0 or -1 disables (default: %(default)s)")
    smp.add_argument("--min-p", type=float, default=s["min_p"].default, metavar="P", help="(default: %(default)s)")
    smp.add_argument("--sampling-seed", "--seed", dest="sampling_seed", type=int, default=s["seed"].default,
                     metavar="SEED", help="SamplingParams.seed of every prompt; --seed is the same flag here "
                     "(default: each request gets one derived from --engine-seed, reported in the output)")
    smp.add_argument("--n", type=int, default=s["n"].default, metavar="N", help="completions per prompt "
                     "(default: %(default)s)")
    smp.add_argument("--logprobs", type=int, default=s["logprobs"].default, metavar="K",
                     help="also report the top-K log-probs of every position (per --logprobs-mode)")
    smp.add_argument("--ignore-eos", action="store_true", help="the checkpoint's eos does not end a request")
    smp.add_argument("--stop-token-ids", type=_token_id_list, default=(), metavar="IDS",
                     help="comma-separated extra stop tokens, e.g. 1,2")



def _default_sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "n": args.n, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
        "min_p": args.min_p, "seed": args.sampling_seed, "stop_token_ids": tuple(args.stop_token_ids),
        "ignore_eos": args.ignore_eos, "max_tokens": args.max_tokens, "logprobs": args.logprobs,
    }


# --------------------------------------------------------------------------- running


def _open_input(name: str) -> TextIO:
    if name == "-":
        return sys.stdin
    return open(name, encoding="utf-8-sig")  # a BOM some editors write before line 1 is not JSON


def _check_output(name: str) -> None:
    """--output must be writable before the (slow) load: the file itself is opened only after it."""
    if name == "-":
        return
    path = Path(name)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ValueError(f"--output {name}: is a folder; give a file path")
    if not folder.is_dir():
        raise ValueError(f"--output {name}: the folder {folder} does not exist")
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise ValueError(f"--output {name}: not writable")


def _open_output(name: str) -> TextIO:
    if name == "-":
        return sys.stdout
    return open(name, "w", encoding="utf-8")


def _summary(stats: dict[str, Any], outputs: Sequence[Any], wall: float, load_s: float) -> str:
    tokens = stats.get("tokens_generated")
    if tokens is None:
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    rate = tokens / wall if wall > 0 else float("inf")
    return (f"ourobatch: {len(outputs)} requests, {tokens} tokens in {wall:.2f} s ({rate:.1f} tokens/s); "
            f"deep_calls={stats.get('deep_calls')} deep_rows={stats.get('deep_rows')} "
            f"shallow_steps={stats.get('shallow_steps')} (model load {load_s:.2f} s)")


@dataclass
class _Checked:
    """What was checked before the weights load: the input lines and how to read the pool."""

    lines: list[PromptLine]
    decoder: Any  # the tokenizer that decodes the outputs' text, or None
    dtype: Any  # the resolved torch dtype
    pool_unknown: bool  # the automatic CUDA pool: its size is known once the weights are loaded


def _generate(args: argparse.Namespace) -> int:
    config, defaults = _options(args)
    _check_output(args.output)
    checked = _check_before_loading(config, defaults, args.input)
    from ourobatch.sync_engine import SyncEngine

    t0 = time.perf_counter()
    with SyncEngine(config) as llm:
        load_s = time.perf_counter() - t0
        stats = llm.stats()
        log.info("generate_ready", model=str(config.model), mode=config.mode, deep_interval=config.deep_interval,
                 shallow_loops=config.shallow_loops, dtype=str(checked.dtype).removeprefix("torch."),
                 device=config.device, max_model_len=stats.get("max_model_len"), kv_blocks=stats.get("kv_blocks_total"),
                 kv_tokens=stats.get("kv_capacity_tokens"), requests=len(checked.lines), load_s=round(load_s, 2))
        if checked.pool_unknown:
            check_requests(llm.core.scheduler.config, checked.lines)
        outputs, wall = _generate_into(llm, checked, args)
        print(_summary(llm.stats(), outputs, wall, load_s), file=sys.stderr)
    return EXIT_OK


def _options(args: argparse.Namespace) -> tuple[EngineConfig, dict[str, Any]]:
    """The engine config and the prompts' sampling defaults, checked: a bad option fails before the input
    is read or the weights are loaded."""
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise CheckpointError(f"--model {args.model}: no such checkpoint folder")
    config = engine_config_from_args(args, model=str(model_dir))
    defaults = _default_sampling(args)
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad sampling option: {exc}") from None
    return config, defaults


def _check_before_loading(config: EngineConfig, defaults: dict[str, Any], input_name: str) -> _Checked:
    """Everything that needs no weights, before the (slow) load: the machine, config.json, every line."""
    from ourobatch.assembly import (  # torch loads here, not for --help
        auto_num_blocks,
        check_before_loading,
        effective_max_model_len,
        make_scheduler_config,
    )

    model_config, dtype = check_before_loading(config)
    tokenizer = CheckpointTokenizer(Path(config.model))
    source = _open_input(input_name)
    try:
        lines = read_lines(source, defaults, tokenizer)
    finally:
        if source is not sys.stdin:
            source.close()
    # The automatic KV pool on CUDA depends on the memory the weights leave: checked again once loaded.
    num_blocks = config.num_kv_blocks
    if num_blocks is None and not config.device.startswith("cuda"):
        num_blocks = auto_num_blocks(config, model_config, dtype)
    pool_unknown = num_blocks is None
    if pool_unknown:  # room for one request of max_model_len: the pool check passes, the others run
        num_blocks = math.ceil(effective_max_model_len(config, model_config) / config.block_size)
    check_requests(make_scheduler_config(config, model_config, num_blocks), lines)
    decoder = tokenizer.get() if tokenizer.available() else None
    if decoder is None and tokenizer.exists:
        print(f"ourobatch: warning: not decoding text: {tokenizer.error}", file=sys.stderr)
    return _Checked(lines, decoder, dtype, pool_unknown)


def _generate_into(llm: Any, checked: _Checked, args: argparse.Namespace) -> tuple[list[Any], float]:
    """Generate every line and write its record to --output, in input order; (outputs, seconds)."""
    lines = checked.lines
    sink = _open_output(args.output)
    try:
        t1 = time.perf_counter()
        # A progress bar only on a terminal: in a log file or a pipe its frames are noise.
        outputs = llm.generate_batch([ln.prompt_token_ids for ln in lines], [ln.params for ln in lines],
                                     use_tqdm=not args.no_progress and sys.stderr.isatty(),
                                     request_ids=[ln.request_id for ln in lines])
        wall = time.perf_counter() - t1
        for out, line in zip(outputs, lines):
            sink.write(json.dumps(output_record(out, checked.decoder, line.params), allow_nan=False) + "\n")
        sink.flush()
    finally:
        if sink is not sys.stdout:
            sink.close()
    return outputs, wall


def run(args: argparse.Namespace) -> int:
    """The generate command: its errors as messages and exit codes."""
    try:
        return _generate(args)
    except InputError as exc:
        for message in str(exc).splitlines():
            print(f"ourobatch: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except (CheckpointError, RequestRejectedError, ValueError, TypeError, OSError) as exc:
        print(f"ourobatch: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OurobatchError as exc:  # e.g. the engine died: a message, not a traceback
        print(f"ourobatch: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ourobatch: interrupted", file=sys.stderr)
        return 130
