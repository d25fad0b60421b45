"""Prompt log-probs in the server's JSON shapes: OpenAI's `echo` (vLLM's serving_completion), vLLM's
`prompt_logprobs` extra, and SGLang's `input_token_logprobs` / `input_top_logprobs`.

Each takes a RequestOutput.prompt_logprobs list (None for position 0, then {token id: Logprob} with the
prompt token first and the k best after it; None as a whole when the request ended before its prefill
did) and writes what those clients parse:

- OpenAI `echo` with `logprobs`: the prompt's tokens come first in `logprobs.tokens`, `token_logprobs`
  (null for position 0), `top_logprobs` (null for position 0, else the prompt token and the k best:
  vLLM's "k + 1") and `text_offset` (each token's string length, running on into the completion's).
- vLLM's `choices[i].prompt_logprobs`: the list itself, {"<id>": {"logprob", "rank", "decoded_token"}}.
- SGLang (``logprob_start_len`` = L >= 0): one [logprob, token_id, text] triple per prompt position from
  L, the first one's logprob null (SGLang's scheduler always writes None there); with
  `top_logprobs_num` k, `input_top_logprobs`: null, then per position its k best triples.
-inf (a token the processed filters exclude) is written -9999.0, as vLLM does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .sglang_shapes import finite

PromptLogprobs = list  # RequestOutput.prompt_logprobs: [None, {token_id: Logprob}, ...]


def echo_logprobs(prompt_ids: list[int], prompt_logprobs: PromptLogprobs | None, k: int,
                  token_str: Callable[[int], str], completion: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI's logprobs object of an echoed choice: the prompt's tokens, then `completion`'s (the
    choice's own logprobs object, None with max_tokens=0), whose text offsets move past the prompt's."""
    tokens = [token_str(t) for t in prompt_ids]
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for i, t in enumerate(prompt_ids):
        entry = prompt_logprobs[i] if prompt_logprobs is not None else None
        if entry is None:  # position 0, or no prompt log-probs (the request ended before its prefill did)
            lps.append(None)
            tops.append(None)
            continue
        lps.append(finite(entry[t].logprob))
        ranked = list(entry.items())
        tops.append({token_str(tok): finite(lp.logprob) for tok, lp in (ranked if k < 0 else ranked[:k + 1])})
    offsets, at = [], 0
    for s in tokens:
        offsets.append(at)
        at += len(s)
    out = {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
    if completion is not None:
        out["tokens"] += completion["tokens"]
        out["token_logprobs"] += completion["token_logprobs"]
        out["top_logprobs"] += completion["top_logprobs"]
        out["text_offset"] += [at + o for o in completion["text_offset"]]
    return out


def vllm_prompt_logprobs(prompt_logprobs: PromptLogprobs | None,
                         text_of: Callable[[int], str] | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `choices[i].prompt_logprobs` JSON (its Logprob dataclass, -inf clamped to -9999.0)."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": finite(lp.logprob), "rank": lp.rank,
                      "decoded_token": text_of(t) if text_of is not None else None} for t, lp in entry.items()}
            for entry in prompt_logprobs]


def sglang_input_logprobs(prompt_ids: list[int], prompt_logprobs: PromptLogprobs | None, start: int, k: int,
                          text_of: Callable[[int], str] | None) -> dict[str, Any]:
    """meta_info's input_token_logprobs (and input_top_logprobs with k > 0) from position `start`."""
    def text(t: int) -> str | None:
        return text_of(t) if text_of is not None else None

    entries = prompt_logprobs if prompt_logprobs is not None else [None] * len(prompt_ids)
    tokens: list[list[Any]] = []
    tops: list[list[list[Any]] | None] = []
    for i in range(start, len(prompt_ids)):
        t, entry = prompt_ids[i], entries[i]
        if i == start or entry is None:  # SGLang: the first entry has no log-prob, whatever `start` is
            tokens.append([None, t, text(t)])
            tops.append(None)
            continue
        tokens.append([finite(entry[t].logprob), t, text(t)])
        best = sorted((lp.rank, tok, lp.logprob) for tok, lp in entry.items() if lp.rank is not None)[:k]
        tops.append([[finite(lp), tok, text(tok)] for _, tok, lp in best])
    out: dict[str, Any] = {"input_token_logprobs": tokens}
    if k:
        out["input_top_logprobs"] = tops
    return out


def prompt_texts(prompt: Any, prompts: list[list[int]], tokenizer: Any) -> list[str]:
    """The text echo puts before each choice's: the prompt as sent, or its token ids decoded (every token,
    special ones too, as vLLM's echo does); "" for token ids without a tokenizer (completions have no text
    then either)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else "" for ids in prompts]


def echo_into(choice: dict[str, Any], prompt_ids: list[int], prompt_text: str, prompt_logprobs: PromptLogprobs | None,
              k: int | None, token_str: Callable[[int], str]) -> None:
    """Put the prompt before a choice's (first chunk's) text, and with `logprobs` k its log-probs before the
    completion's."""
    choice["text"] = prompt_text + choice["text"]
    if k is not None:
        choice["logprobs"] = echo_logprobs(prompt_ids, prompt_logprobs, k, token_str, choice["logprobs"])


def without_generation(produce: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """vLLM's echo with max_tokens=0: the engine draws one token (its max_tokens is at least 1), which every
    delta leaves out, so a choice holds the prompt only, finish_reason "length" (usage counts no token)."""
    async def wrapped(send: Any) -> None:
        class _Strip:
            async def send(self, d: Any) -> None:
                finish = "length" if d.finish_reason in ("stop", "length") else d.finish_reason
                await send.send(dataclasses.replace(
                    d, token_ids=[], logprobs=[], top_logprobs=[] if d.top_logprobs is not None else None,
                    readout_loops=[], text="", finish_reason=finish, stop_reason=None, num_tokens=0))

        await produce(_Strip())

    return wrapped
