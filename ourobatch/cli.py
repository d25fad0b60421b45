"""The command line: ``python -m ourobatch generate --model DIR [options] < prompts.jsonl > out.jsonl``.

Reads JSONL prompts, validates every line before the model loads, generates them all with
``SyncEngine.generate_batch`` and writes one JSONL output per input line, in input order.
``main(argv)`` returns the exit code (0 ok, 2 bad input or a library error) so tests can call it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence, TextIO

from ourobatch._logging import DEFAULT_LOG_LEVEL, LOG_LEVELS, console_logging
from ourobatch.engine_args import add_engine_arguments, engine_config_from_args
from ourobatch.scheduler.errors import CheckpointError, OurobatchError, RequestRejectedError
from ourobatch.scheduler.log import get_logger
from ourobatch.scheduler.params import SamplingParams

log = get_logger("ourobatch.cli")
EXIT_OK = 0
EXIT_USAGE = 2

#: SamplingParams fields a line's "sampling_params" may set (output_kind only matters for streaming).
SAMPLING_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "output_kind")
LINE_KEYS = ("prompt_token_ids", "prompt", "request_id", "sampling_params")
MAX_REPORTED_ERRORS = 20

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

Output: one JSON object per input line, in input order: request_id, prompt_token_ids and outputs, a
list of {index, token_ids, logprobs, readout_loops, cumulative_logprob, finish_reason, seed[, text]
[, top_logprobs][, error]}. logprobs are the processed log-probs of the sampled tokens; top_logprobs
(with --logprobs k) maps token ids (as strings) to log-probs; -inf (an excluded token) is written null.
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


class InputError(Exception):
    """One or more bad input lines (or a bad input file): reported with line numbers, exit code 2."""


# --------------------------------------------------------------------------- argument parsing


def _token_id_list(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {text!r}")
    return ids


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ourobatch",
                                     description="ourobatch: rollout generation for looped language models (Ouro).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (python -m ourobatch serve --help)")
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
                     help="also report the top-K processed log-probs of every position")
    smp.add_argument("--ignore-eos", action="store_true", help="the checkpoint's eos does not end a request")
    smp.add_argument("--stop-token-ids", type=_token_id_list, default=(), metavar="IDS",
                     help="comma-separated extra stop tokens, e.g. 1,2")
    return parser


def _default_sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "n": args.n, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
        "min_p": args.min_p, "seed": args.sampling_seed, "stop_token_ids": tuple(args.stop_token_ids),
        "ignore_eos": args.ignore_eos, "max_tokens": args.max_tokens, "logprobs": args.logprobs,
    }


# --------------------------------------------------------------------------- tokenizer


class _LazyTokenizer:
    """tokenizer.json beside the checkpoint, loaded on first use (ourobatch.text.Tokenizer)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.path = model_dir / "tokenizer.json"
        self._tok: Any = None
        self._error: str | None = None

    @property
    def exists(self) -> bool:
        return self.path.is_file()

    def get(self) -> Any:
        """The loaded tokenizer; raises RuntimeError saying why when there is none."""
        if self._tok is None and self._error is None:
            from ourobatch.text import load_tokenizer

            try:
                self._tok = load_tokenizer(self.model_dir)
            except (ImportError, ValueError) as exc:  # `tokenizers` missing (its extra named), a bad file
                self._error = str(exc)
            if self._tok is None and self._error is None:
                self._error = f"there is no tokenizer.json beside the checkpoint ({self.path})"
        if self._tok is None:
            raise RuntimeError(self._error)
        return self._tok

    def available(self) -> bool:
        if not self.exists:
            return False
        try:
            self.get()
        except RuntimeError:
            return False
        return True


# --------------------------------------------------------------------------- input


@dataclass
class PromptLine:
    lineno: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _parse_line(lineno: int, text: str, defaults: dict[str, Any], tokenizer: _LazyTokenizer) -> PromptLine:
    """One input line -> PromptLine; raises ValueError with a message (the caller adds the line number)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(LINE_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; allowed keys: {list(LINE_KEYS)}")
    has_ids, has_text = "prompt_token_ids" in obj, "prompt" in obj
    if has_ids == has_text:
        raise ValueError('give exactly one of "prompt_token_ids" (list of ints) or "prompt" (text)')
    if has_ids:
        ids = obj["prompt_token_ids"]
        if not _is_token_list(ids):
            raise ValueError(f'"prompt_token_ids" must be a list of ints, got {ids!r:.80}')
    else:
        prompt = obj["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f'"prompt" must be a string, got {type(prompt).__name__}')
        try:
            tok = tokenizer.get()
        except RuntimeError as exc:
            raise ValueError(f'a text "prompt" needs a tokenizer, but {exc}; '
                             f'give "prompt_token_ids" instead') from None
        try:
            ids = tok.encode(prompt)  # a word outside the vocabulary is refused (ourobatch.text, one rule)
        except ValueError as exc:
            raise ValueError(f'"prompt": {exc}') from None
    if not ids:
        raise ValueError("the prompt is empty (it must hold at least one token)")

    request_id = obj.get("request_id", f"line-{lineno}")
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f'"request_id" must be a non-empty string, got {request_id!r}')

    overrides = obj.get("sampling_params", {})
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, dict):
        raise ValueError(f'"sampling_params" must be a JSON object, got {type(overrides).__name__}')
    unknown = sorted(set(overrides) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f'unknown sampling_params key(s) {unknown}; allowed: {list(SAMPLING_KEYS)}')
    try:
        params = SamplingParams(**{**defaults, **overrides})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad sampling_params: {exc}") from None
    return PromptLine(lineno, request_id, list(ids), params)


def read_lines(stream: TextIO, defaults: dict[str, Any], tokenizer: _LazyTokenizer) -> list[PromptLine]:
    """Parse and check every line; raise InputError listing the bad ones (with line numbers)."""
    lines: list[PromptLine] = []
    errors: list[str] = []
    seen: dict[str, int] = {}
    for lineno, text in enumerate(stream, start=1):
        if not text.strip():
            continue
        try:
            line = _parse_line(lineno, text, defaults, tokenizer)
        except ValueError as exc:
            errors.append(f"input line {lineno}: {exc}")
            continue
        if line.request_id in seen:
            errors.append(f"input line {lineno}: request_id {line.request_id!r} is already used on line "
                          f"{seen[line.request_id]}")
            continue
        seen[line.request_id] = lineno
        lines.append(line)
    if errors:
        raise InputError(_join_errors(errors))
    if not lines:
        raise InputError("the input holds no prompts")
    return lines


def _join_errors(errors: list[str]) -> str:
    shown = errors[:MAX_REPORTED_ERRORS]
    more = len(errors) - len(shown)
    return "\n".join(shown + ([f"... and {more} more bad line(s)"] if more > 0 else []))


def check_requests(scheduler_config: Any, lines: Iterable[PromptLine]) -> None:
    """Run every request through the engine's own admission checks (vocabulary, max_model_len, KV pool,
    n <= max_num_seqs) on a throwaway EngineCore that never steps, so a rejected request is reported with
    its line number and nothing runs. Needs only the checkpoint's config.json, not its weights."""
    from ourobatch.scheduler.frontend import EngineCore

    probe = EngineCore(scheduler_config, executor=None)  # type: ignore[arg-type]  # add() never executes
    errors = []
    for line in lines:
        try:
            probe.add(line.prompt_token_ids, line.params, line.request_id)
        except (TypeError, ValueError) as exc:
            errors.append(f"input line {line.lineno}: {exc}")
    if errors:
        raise InputError(_join_errors(errors))


# --------------------------------------------------------------------------- output


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def output_record(out: Any, tokenizer: Any | None) -> dict[str, Any]:
    completions = []
    for c in out.outputs:
        rec: dict[str, Any] = {
            "index": c.index,
            "token_ids": list(c.token_ids),
            "logprobs": [_finite(lp) for lp in c.logprobs],
            "readout_loops": list(c.readout_loops),
            "cumulative_logprob": _finite(c.cumulative_logprob),
            "finish_reason": c.finish_reason,
            "seed": c.seed,
        }
        if tokenizer is not None:
            rec["text"] = tokenizer.decode(list(c.token_ids))
        if c.top_logprobs is not None:
            rec["top_logprobs"] = [{str(tok): _finite(lp) for tok, lp in pos.items()} for pos in c.top_logprobs]
        if getattr(c, "error", None):
            rec["error"] = c.error
        completions.append(rec)
    return {"request_id": out.request_id, "prompt_token_ids": list(out.prompt_token_ids), "outputs": completions}


# --------------------------------------------------------------------------- main


def _open_input(name: str) -> TextIO:
    if name == "-":
        return sys.stdin
    return open(name, encoding="utf-8")


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


def _generate(args: argparse.Namespace) -> int:
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise CheckpointError(f"--model {args.model}: no such checkpoint folder")
    # Engine options first: a bad option fails before the input is read or the weights are loaded.
    config = engine_config_from_args(args, model=str(model_dir))
    defaults = _default_sampling(args)
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad sampling option: {exc}") from None

    # Everything that needs no weights, before the (slow) load: the machine, config.json, every line.
    from ourobatch._core import (  # torch loads here, not for --help
        auto_num_blocks,
        check_before_loading,
        effective_max_model_len,
        make_scheduler_config,
    )

    model_config, dtype = check_before_loading(config)
    tokenizer = _LazyTokenizer(model_dir)
    source = _open_input(args.input)
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
        print(f"ourobatch: warning: not decoding text: {tokenizer._error}", file=sys.stderr)

    from ourobatch.sync_engine import SyncEngine

    t0 = time.perf_counter()
    with SyncEngine(config) as llm:
        load_s = time.perf_counter() - t0
        stats = llm.stats()
        log.info("generate_ready", model=str(config.model), mode=config.mode, deep_interval=config.deep_interval,
                 shallow_loops=config.shallow_loops, dtype=str(dtype).removeprefix("torch."), device=config.device,
                 max_model_len=stats.get("max_model_len"), kv_blocks=stats.get("kv_blocks_total"),
                 kv_tokens=stats.get("kv_capacity_tokens"), requests=len(lines), load_s=round(load_s, 2))
        if pool_unknown:
            check_requests(llm.core.scheduler.config, lines)
        sink = _open_output(args.output)
        try:
            t1 = time.perf_counter()
            # A progress bar only on a terminal: in a log file or a pipe its frames are noise.
            outputs = llm.generate_batch([ln.prompt_token_ids for ln in lines], [ln.params for ln in lines],
                                         use_tqdm=not args.no_progress and sys.stderr.isatty(),
                                         request_ids=[ln.request_id for ln in lines])
            wall = time.perf_counter() - t1
            for out in outputs:
                sink.write(json.dumps(output_record(out, decoder), allow_nan=False) + "\n")
            sink.flush()
        finally:
            if sink is not sys.stdout:
                sink.close()
        print(_summary(llm.stats(), outputs, wall, load_s), file=sys.stderr)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the HTTP server has its own options (ourobatch.server.cli)
        from ourobatch._extras import MissingExtraError

        try:
            from ourobatch.server.cli import main as serve

            return serve(argv[1:])
        except MissingExtraError as exc:  # one line naming the pip install, not a traceback
            print(f"ourobatch serve: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, already printed)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    with console_logging(args.log_level):  # the entry point is the host: the library configures nothing
        return _generate_and_report(args)


def _generate_and_report(args: argparse.Namespace) -> int:
    """_generate, its errors as messages and exit codes."""
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
