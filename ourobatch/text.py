"""Text for the front ends that hold a tokenizer (ourobatch.LLM, the HTTP server): encoding prompts,
decoding completions, and stop strings. The engines themselves work in token ids only.

Stop strings follow vLLM: generation stops at the first token whose text completes a stop string; the
token ids keep every token up to that one, the text is cut before the stop string (after it with
``include_stop_str_in_output``), ``finish_reason`` is "stop" and ``stop_reason`` the string. A completion
that ends on a stop token (eos or ``stop_token_ids``) leaves that token's text out unless
``include_stop_str_in_output``; ``stop_reason`` is the token id, or None for eos (vLLM's convention).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from scheduler.params import SamplingParams

from ._extras import require
from .chat_template import ChatTemplate, load_chat_template


class Tokenizer:
    """A tokenizer.json (Hugging Face `tokenizers`, the `text` extra), with the calls the front ends need."""

    def __init__(self, tok: Any, path: Path | None = None) -> None:
        self.tok = tok
        self.path = path
        # the checkpoint's chat template(s), read beside tokenizer.json as Hugging Face does (None: none);
        # the server's --chat-template replaces it
        self.chat_template: ChatTemplate | None = None

    @classmethod
    def from_path(cls, path: str | Path) -> "Tokenizer":
        """`path`: a tokenizer.json file or a folder holding one, with the chat template beside it if any.
        Raises ValueError saying why not, MissingExtraError without the `tokenizers` package."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"no tokenizer.json at {path}")
        tokenizers = require("tokenizers", "text", f"reading {path.name} (text prompts, output text)")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - any parse failure of the file
            raise ValueError(f"cannot load {path}: {exc}") from None
        tokenizer = cls(tok, path)
        tokenizer.chat_template = load_chat_template(path.parent)  # ValueError for a malformed one
        return tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. A word the vocabulary lacks is a ValueError naming it: a word-level (or
        WordPiece) tokenizer would map it to its unk token without a word, and for the shipped model that
        token is eos. `add_special_tokens`: the tokenizer's post-processor (a BOS it adds); a chat prompt
        rendered from a template has its own and is encoded without (as vLLM does)."""
        encoding = self.tok.encode(text, add_special_tokens=add_special_tokens)
        unknown, unk = self.unknown_words(text, encoding)
        if unknown:
            shown = ", ".join(repr(w) for w in unknown[:10]) + (", ..." if len(unknown) > 10 else "")
            raise ValueError(f"{len(unknown)} word(s) not in the vocabulary of {self.name}: {shown} (the tokenizer "
                             f"would silently read each as {unk!r}); send token ids for other text")
        return list(encoding.ids)

    @property
    def name(self) -> str:
        return self.path.name if self.path is not None else "the tokenizer"

    def unknown_words(self, text: str, encoding: Any) -> tuple[list[str], str]:
        """The words of `text` that `encoding` maps to the tokenizer's unk token, and that token; ([], "")
        for a tokenizer without one (byte-level BPE encodes every text)."""
        unk = getattr(self.tok.model, "unk_token", None)
        unk_id = self.tok.token_to_id(unk) if unk else None
        if unk_id is None:
            return [], ""
        words = [text[a:b] for tid, (a, b) in zip(encoding.ids, encoding.offsets)
                 if tid == unk_id and text[a:b] != unk]  # the unk token written out is a real token
        return list(dict.fromkeys(words)), unk

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens included), e.g. for top log-probs."""
        return self.tok.decode([token_id], skip_special_tokens=False)

    # ------------------------------------------------------------------ the Hugging Face names ported code reads

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    @property
    def vocab_size(self) -> int:
        return int(self.tok.get_vocab_size(with_added_tokens=True))

    def __len__(self) -> int:
        return self.vocab_size

    @functools.cached_property
    def _special_tokens(self) -> dict[str, Any]:
        """bos_token, eos_token, ... of tokenizer_config.json (or special_tokens_map.json) beside it, read once."""
        from .chat_template import read_special_tokens

        return read_special_tokens(self.path.parent) if self.path is not None else {}

    def _special_id(self, name: str) -> int | None:
        text = self._special_tokens.get(name)
        return self.tok.token_to_id(text) if isinstance(text, str) else None

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")


def load_tokenizer(model: str | Path, tokenizer: str | Path | None = None) -> Tokenizer | None:
    """The front ends' one tokenizer loader: `tokenizer` (a tokenizer.json or its folder) when given, else
    the tokenizer.json beside the checkpoint folder `model` if it has one, else None (token ids only).
    A file that is there must load: ValueError saying why not, MissingExtraError without `tokenizers`."""
    if tokenizer is not None:
        return Tokenizer.from_path(tokenizer)
    if (Path(model) / "tokenizer.json").is_file():
        return Tokenizer.from_path(model)
    return None


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
    """Watches one completion's growing token list for the params' stop strings, in vLLM's order
    (vllm/v1/engine/detokenizer.py): the engine's own stop first, then stop strings on the text.

    A completion the engine ended on its last token (eos, or a stop_token_ids token: ``stop_terminated``)
    has that token's text left out before stop strings are searched, unless include_stop_str_in_output,
    so a stop string that is the eos token's text ("<|endoftext|>", lm-eval's default ``until``) never
    matches it: the answer ends with eos, its text with the last real word. A stop string counts only
    where it ends after the text of the first min_tokens tokens (vLLM). Of the stop strings a token
    completes, the one that ends first in the text wins (ties: the order of ``stop``).

    The whole text is decoded and searched after each step (O(length) per step), and when it holds a stop
    string, each prefix since the last check is decoded to find the token that completed it."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.num_checked = 0  # tokens already known not to complete a stop string

    def check(self, token_ids: Sequence[int], stop_terminated: bool = False) -> StopMatch | None:
        """The first stop string completed by the tokens after the checked ones, or None.
        `stop_terminated`: the engine ended the completion on the last of `token_ids`."""
        ids = list(token_ids)
        if stop_terminated and ids and not self.params.include_stop_str_in_output:
            ids = ids[:-1]  # the stop token has no text (vLLM does not detokenize it)
        n = len(ids)
        first = max(self.num_checked, self.params.min_tokens) + 1  # a match needs a token after min_tokens
        if n < first:
            return None
        skip = self.params.skip_special_tokens
        floor = len(self.tokenizer.decode(ids[:self.params.min_tokens], skip)) if self.params.min_tokens else 0
        if self._find(self.tokenizer.decode(ids, skip), floor) is not None:
            for k in range(first, n + 1):  # the first token that completes one
                text = self.tokenizer.decode(ids[:k], skip)
                found = self._find(text, floor)
                if found is not None:
                    at, stop = found
                    end = at + len(stop) if self.params.include_stop_str_in_output else at
                    return StopMatch(k, stop, text[:end])
        self.num_checked = n
        return None

    def _find(self, text: str, floor: int) -> tuple[int, str] | None:
        """(where, which) of the stop string in text that ends first after `floor` characters."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.params.stop:
            at = text.find(stop, max(0, floor - len(stop) + 1))
            if at >= 0 and (best is None or at + len(stop) < best[0]):
                best = (at + len(stop), at, stop)
        return (best[1], best[2]) if best is not None else None


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
