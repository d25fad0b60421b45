"""One prompt's run through the async Engine, as the HTTP routes need it: per-completion deltas with text,
and stop strings cut the way vLLM cuts them (ourobatch.text): a completion that meets one is aborted in
the engine at once (its KV freed; its siblings run on), and it reports finish_reason "stop".

Text is streamed conservatively: while a completion runs, the last len(longest stop string) - 1
characters and a trailing incomplete character (U+FFFD) are held back, so no part of a stop string is
ever sent."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import anyio

from ourobatch.outputs import CompletionOutput
from scheduler.params import RequestOutputKind, SamplingParams
from ourobatch.text import StopChecker, Tokenizer, completion_text


@dataclass
class Delta:
    """What is new in one completion since the previous delta."""

    prompt_index: int
    index: int  # which of the prompt's n completions
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None
    readout_loops: list[int]
    text: str
    finish_reason: str | None  # set on the last delta
    stop_reason: int | str | None
    seed: int
    weight_version: int
    num_tokens: int  # the completion's tokens so far (after a stop-string cut: the tokens it keeps)
    prompt_logprobs: list | None = None  # the first delta of each completion: RequestOutput.prompt_logprobs
    num_cached_tokens: int = 0  # RequestOutput.num_cached_tokens: prompt tokens the prefix cache served


class _Completion:
    """The delivery state of one completion."""

    def __init__(self, tokenizer: Tokenizer | None, params: SamplingParams, eos: frozenset[int]) -> None:
        self.tokenizer = tokenizer if params.detokenize else None
        self.params = params
        self.eos = eos
        self.checker = StopChecker(tokenizer, params) if params.stop and tokenizer is not None else None
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.num_sent_tokens = 0
        self.num_sent_chars = 0
        self.done = False

    def update(self, prompt_index: int, c: CompletionOutput) -> Delta | None:
        stop_terminated = c.finish_reason == "stop"  # eos or a stop token: its text is left out first (vLLM)
        match = self.checker.check(c.token_ids, stop_terminated) if self.checker is not None else None
        keep = match.num_tokens if match is not None else len(c.token_ids)
        finish, reason = c.finish_reason, None
        if match is not None:
            finish, reason, text = "stop", match.stop, match.text
        elif finish is not None:
            if finish == "stop" and c.token_ids:
                last = c.token_ids[-1]
                reason = None if last in self.eos and not self.params.ignore_eos else last
            text = completion_text(self.tokenizer, c.token_ids, finish, self.params)
        elif self.tokenizer is not None:
            text = self.tokenizer.decode(c.token_ids, self.params.skip_special_tokens)
            text = text[:max(0, len(text) - self.holdback)].rstrip("\ufffd")
        else:
            text = ""
        start = self.num_sent_tokens
        text_delta = text[self.num_sent_chars:]
        if keep <= start and not text_delta and finish is None:
            return None
        self.num_sent_tokens = max(start, keep)
        self.num_sent_chars = max(self.num_sent_chars, len(text))
        self.done = finish is not None
        top = c.top_logprobs[start:keep] if c.top_logprobs is not None else None
        return Delta(prompt_index, c.index, list(c.token_ids[start:keep]), list(c.logprobs[start:keep]), top,
                     list(c.readout_loops[start:keep]), text_delta, finish, reason, c.seed, c.weight_version,
                     keep)


def in_prompt(exc: TypeError | ValueError, index: int, num_prompts: int) -> TypeError | ValueError:
    """`exc` again, of its own class, its message naming the prompt when there are several; the field it
    names as data (its ``field`` attribute, errors.field_of) stays on it."""
    again = type(exc)(f"prompt {index}: {exc}" if num_prompts > 1 else str(exc))
    field = getattr(exc, "field", None)  # optional, as errors.field_of reads it
    if field is not None:
        again.field = field
    return again


QUEUE_SLICE = 256  # prompts queued between two turns of the event loop (~70 ms on the CI machine's CPU)


async def open_streams(engine: Any, prompts: list[list[int]], params: list[SamplingParams],
                 request_ids: list[str | None] | None = None) -> list[Any]:
    """Queue every prompt now (all or nothing: a rejected prompt raises and nothing stays queued). A request
    of many prompts lets the event loop run between every QUEUE_SLICE of them, so /health, other requests'
    streams and a shutdown do not wait for the whole list (tens of thousands of prompts take seconds)."""
    streams: list[Any] = []
    ids = request_ids or [None] * len(prompts)
    engine_params = [dataclasses.replace(p, stop=(), output_kind=RequestOutputKind.CUMULATIVE) for p in params]
    for i, (ids_i, p, rid) in enumerate(zip(prompts, engine_params, ids)):  # every prompt checked before any
        if i and i % QUEUE_SLICE == 0:  # is queued: a rejected request leaves no trace in the engine
            await anyio.lowlevel.checkpoint()
        try:
            engine.check_request(ids_i, p, rid)
        except (TypeError, ValueError) as exc:
            raise in_prompt(exc, i, len(prompts)) from None
    try:
        for i, (ids_i, p, rid) in enumerate(zip(prompts, engine_params, ids)):
            if i and i % QUEUE_SLICE == 0:
                await anyio.lowlevel.checkpoint()
            try:
                streams.append(engine.stream(ids_i, p, request_id=rid))
            except (TypeError, ValueError) as exc:
                raise in_prompt(exc, i, len(prompts)) from None
    except BaseException:
        for s in streams:
            await s.aclose()  # aborts the request
        raise
    return streams


async def run_prompt(engine: Any, prompt_index: int, stream: Any, params: SamplingParams,
                     tokenizer: Tokenizer | None, eos: frozenset[int],
                     emit: Callable[[Delta], Awaitable[None]]) -> None:
    """Deliver one queued prompt's deltas to `emit` until each completion ends. A completion cut by a stop
    string is aborted in the engine at once (its siblings run on); leaving the stream aborts the rest."""
    completions = [_Completion(tokenizer, params, eos) for _ in range(params.n)]
    first = [True] * params.n  # each completion's first delta carries the prompt log-probs
    async with stream:
        async for out in stream:
            for c in out.outputs:
                state = completions[c.index]
                if state.done:
                    continue
                delta = state.update(prompt_index, c)
                if delta is None:
                    continue
                if delta.finish_reason is not None and c.finish_reason is None:  # cut by a stop string
                    await engine.abort(stream.request_id if params.n == 1 else f"{stream.request_id}:{c.index}",
                                       stop_string=True)
                delta.num_cached_tokens = out.num_cached_tokens
                if first[c.index]:
                    delta.prompt_logprobs, first[c.index] = out.prompt_logprobs, False
                await emit(delta)
            if all(state.done for state in completions):
                break
