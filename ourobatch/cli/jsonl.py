"""The generate CLI's JSONL: input lines -> checked PromptLines (every line before the model loads, bad
ones reported with their line numbers), and outputs -> JSON records."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, TextIO

from scheduler.params import SamplingParams

#: SamplingParams fields a line's "sampling_params" may set (output_kind only matters for streaming).
SAMPLING_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams)
                      if f.name != "output_kind" and not f.name.startswith("_"))
LINE_KEYS = ("prompt_token_ids", "prompt", "request_id", "sampling_params")
MAX_REPORTED_ERRORS = 20


class InputError(Exception):
    """One or more bad input lines (or a bad input file): reported with line numbers, exit code 2."""



class CheckpointTokenizer:
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

    @property
    def error(self) -> str | None:
        """Why there is no tokenizer, once get() or available() found none."""
        return self._error

    def available(self) -> bool:
        if not self.exists:
            return False
        try:
            self.get()
        except RuntimeError:
            return False
        return True



@dataclass
class PromptLine:
    lineno: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _parse_line(lineno: int, text: str, defaults: dict[str, Any], tokenizer: CheckpointTokenizer) -> PromptLine:
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


def read_lines(stream: TextIO, defaults: dict[str, Any], tokenizer: CheckpointTokenizer) -> list[PromptLine]:
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
    from ourobatch.runtime.engine_core import EngineCore

    probe = EngineCore(scheduler_config, executor=None)  # type: ignore[arg-type]  # add() never executes
    errors = []
    for line in lines:
        try:
            probe.add(line.prompt_token_ids, line.params, line.request_id)
        except (TypeError, ValueError) as exc:
            errors.append(f"input line {line.lineno}: {exc}")
    if errors:
        raise InputError(_join_errors(errors))



def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def output_record(out: Any, tokenizer: Any | None, params: SamplingParams) -> dict[str, Any]:
    """One output line: each completion's tokens, log-probs and loops; its text when a tokenizer is loaded
    (as vLLM's: per detokenize, skip_special_tokens and include_stop_str_in_output); the prompt's
    log-probs when asked for."""
    from ourobatch.text import completion_text

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
            rec["text"] = completion_text(tokenizer, c.token_ids, c.finish_reason, params)
        if c.top_logprobs is not None:
            rec["top_logprobs"] = [{str(tok): _finite(lp) for tok, lp in pos.items()} for pos in c.top_logprobs]
        if getattr(c, "error", None):
            rec["error"] = c.error
        completions.append(rec)
    record = {"request_id": out.request_id, "prompt_token_ids": list(out.prompt_token_ids), "outputs": completions}
    if out.prompt_logprobs is not None:  # vLLM's order: the prompt token first, then the k best
        record["prompt_logprobs"] = [None if pos is None else {
            str(tok): {"logprob": _finite(lp.logprob), "rank": lp.rank} for tok, lp in pos.items()}
            for pos in out.prompt_logprobs]
    return record
