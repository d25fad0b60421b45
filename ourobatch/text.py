"""Text for the front ends that hold a tokenizer (ourobatch.LLM, the HTTP server): encoding prompts,
decoding completions, and stop strings. The engines themselves work in token ids only.

Stop strings follow vLLM: generation stops at the first token whose text completes a stop string; the
token ids keep every token up to that one, the text is cut before the stop string (after it with
``include_stop_str_in_output``), ``finish_reason`` is "stop" and ``stop_reason`` the string. A completion
that ends on a stop token (eos or ``stop_token_ids``) leaves that token's text out unless
``include_stop_str_in_output``; ``stop_reason`` is the token id, or None for eos (vLLM's convention).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ourobatch.scheduler.params import SamplingParams


class Tokenizer:
    """A tokenizer.json (Hugging Face `tokenizers`), with the calls the front ends need."""

    def __init__(self, tok: Any, path: Path | None = None) -> None:
        self.tok = tok
        self.path = path

    @classmethod
    def from_path(cls, path: str | Path) -> "Tokenizer":
        """`path`: a tokenizer.json file or a folder holding one. Raises ValueError saying why not."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"no tokenizer.json at {path}")
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise ValueError("the `tokenizers` package is not installed (pip install tokenizers, or "
                             "pip install 'ourobatch[text]')") from None
        try:
            return cls(HFTokenizer.from_file(str(path)), path)
        except Exception as exc:  # noqa: BLE001 - any parse failure of the file
            raise ValueError(f"cannot load {path}: {exc}") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens included), e.g. for top log-probs."""
        return self.tok.decode([token_id], skip_special_tokens=False)


def check_text_params(params: SamplingParams, tokenizer: Tokenizer | None, where: str = "SamplingParams") -> None:
    """Stop strings need a tokenizer and detokenize=True (as in vLLM)."""
    if params.stop and tokenizer is None:
        raise ValueError(f"{where}.stop={list(params.stop)!r} needs a tokenizer, and none is loaded; give "
                         f"stop_token_ids instead, or a model folder with tokenizer.json")
    if params.stop and not params.detokenize:
        raise ValueError(f"{where}.stop strings need detokenize=True")


@dataclass
class StopMatch:
    num_tokens: int  # tokens kept: the one that completed the stop string is the last
    stop: str  # the stop string
    text: str  # the completion's text, cut as the params say


class StopChecker:
    """Watches one completion's growing token list for the params' stop strings.

    The whole text is decoded and searched after each step (O(length) per step), and when it holds a stop
    string, each prefix since the last check is decoded to find the token that completed it."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.num_checked = 0  # tokens already known not to complete a stop string

    def check(self, token_ids: Sequence[int]) -> StopMatch | None:
        """The first stop string completed by the tokens after the checked ones, or None."""
        n = len(token_ids)
        if n <= self.num_checked:
            return None
        skip = self.params.skip_special_tokens
        if self._find(self.tokenizer.decode(token_ids[:n], skip)) is not None:
            for k in range(self.num_checked + 1, n + 1):  # the first token that completes one
                text = self.tokenizer.decode(token_ids[:k], skip)
                found = self._find(text)
                if found is not None:
                    at, stop = found
                    end = at + len(stop) if self.params.include_stop_str_in_output else at
                    return StopMatch(k, stop, text[:end])
        self.num_checked = n
        return None

    def _find(self, text: str) -> tuple[int, str] | None:
        """(where, which) of the earliest stop string in text."""
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            at = text.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return best


def completion_text(tokenizer: Tokenizer | None, token_ids: Sequence[int], finish_reason: str | None,
                    params: SamplingParams) -> str:
    """The text of a completion that did not end on a stop string: a final stop token's text (eos or a
    stop_token_ids token) is left out unless include_stop_str_in_output; "" without a tokenizer or with
    detokenize=False."""
    if tokenizer is None or not params.detokenize:
        return ""
    ids = list(token_ids)
    if finish_reason == "stop" and ids and not params.include_stop_str_in_output:
        ids = ids[:-1]
    return tokenizer.decode(ids, params.skip_special_tokens)
