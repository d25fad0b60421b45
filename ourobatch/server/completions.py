"""OpenAI's /v1/completions (plain or SSE stream) and /v1/models, and the machinery every generation route
runs on (``Generation``: /v1/chat/completions in chat.py and SGLang's /generate in generate.py use it too).

Every route queues every prompt first (a rejected prompt is a 400 and nothing runs), then runs each
prompt's engine stream (runner.run_prompt) concurrently inside one producer, which a client disconnect
cancels. Text is tokenized on a worker thread (the event loop keeps serving /health and the streams),
after a length bound (limits.check_text_length) has refused any text too long to fit max_model_len.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from scheduler.params import SamplingParams
from ourobatch.text import Tokenizer, check_text_params

from . import prompt_logprobs as plp, sglang_shapes
from .errors import BadRequest
from .limits import DEFAULT_MAX_COMPLETIONS, check_completions, check_text_length
from .protocol import CompletionRequest, StreamOptions
from .runner import Delta, open_streams, run_prompt
from .streaming import EventStream, Producer, collect

CLIENT_CLOSED = 499
_finite = sglang_shapes.finite  # -inf (a token the filters exclude) as -9999.0, vLLM's JSON choice


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest) -> Response:
    return await request.app.state.gen.completions(request, body)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    served = request.app.state.served
    max_len = request.app.state.engine.stats()["max_model_len"]  # the engine's (capped at the checkpoint's)
    return {"object": "list", "data": [{"id": served.name, "object": "model", "created": served.created,
                                        "owned_by": "ourobatch", "root": str(served.config.model),
                                        "max_model_len": max_len}]}


class Generation:
    """What the routes share: the engine, the tokenizer and the model's name and eos."""

    def __init__(self, engine: Any, tokenizer: Tokenizer | None, model_name: str, max_model_len: int,
                 max_completions: int = DEFAULT_MAX_COMPLETIONS, prompt_tokens_details: bool = False) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_completions = max_completions  # prompts x n one request may ask for
        self.prompt_tokens_details = prompt_tokens_details  # usage.prompt_tokens_details.cached_tokens

    @property
    def eos(self) -> frozenset[int]:
        return self.engine.core.scheduler.config.eos_token_ids

    async def encode(self, texts: list[str], fields: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, tokenized on a worker thread once every text passed the length bound. A
        word outside the vocabulary is a 400 naming it and the field (ourobatch.text.Tokenizer.encode)."""
        if not texts:
            return []
        if self.tokenizer is None:
            raise BadRequest(f"{fields[0]} is text, but the server has no tokenizer (no tokenizer.json beside "
                             f"the model); send token ids", fields[0])
        for text, field in zip(texts, fields):
            check_text_length(text, self.max_model_len, field)
        encode = self.tokenizer.encode

        def encode_all() -> list[list[int]]:
            out = []
            for text, field in zip(texts, fields):
                try:
                    out.append(encode(text) if add_special_tokens else encode(text, add_special_tokens=False))
                except ValueError as exc:
                    raise BadRequest(f"{field}: {exc}", field) from None
            return out

        return await anyio.to_thread.run_sync(encode_all)

    def token_str(self, token_id: int, as_ids: bool) -> str:
        if as_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.token_text(token_id)

    async def run(self, prompts: list[list[int]], params: list[SamplingParams], request_ids: Any = None):
        """Queue every prompt (bad input raises, nothing stays queued); return the producer's body."""
        check_completions(sum(p.n for p in params), self.max_completions)
        for p in params:
            check_text_params(p, self.tokenizer, "sampling_params")
        streams = await open_streams(self.engine, prompts, params, request_ids)

        async def produce(send: MemoryObjectSendStream) -> None:
            async with anyio.create_task_group() as tg:
                for i, (stream, p) in enumerate(zip(streams, params)):
                    tg.start_soon(run_prompt, self.engine, i, stream, p, self.tokenizer, self.eos, send.send)

        return produce

    # ------------------------------------------------------------------ /v1/completions

    def unknown_model(self, model: str | None) -> Response | None:
        """OpenAI's 404 for a request naming another model (None: the model is ours or not named)."""
        if model is None or model == self.model_name:
            return None
        return JSONResponse({"error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError",
                                       "param": "model", "code": 404}}, status_code=404)

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        if (missing := self.unknown_model(body.model)) is not None:
            return missing
        body.check_stream_options()
        params = body.sampling_params()
        prompts = await self._completion_prompts(body.prompt)
        if body.request_id is not None and len(prompts) > 1:
            raise BadRequest("request_id names one request: send one prompt with it", "request_id")
        produce = await self.run(prompts, [params] * len(prompts),
                                 [body.request_id] if body.request_id is not None else None)
        echo_texts = None
        if body.echo:  # the prompt (and its log-probs) before each choice's first text (prompt_logprobs.py)
            echo_texts = plp.prompt_texts(body.prompt, prompts, self.tokenizer)
            if body.max_tokens == 0:
                produce = plp.without_generation(produce)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        choice = _Choices(self, body, params, prompts, echo_texts)
        num_prompt = sum(len(p) for p in prompts)
        if body.stream:
            return EventStream(_completion_stream(produce, head, choice, num_prompt,
                                                  body.stream_options or StreamOptions()))
        deltas = await collect(request, produce)
        if deltas is None:
            return Response(status_code=CLIENT_CLOSED)
        merged = _merge(deltas)
        choices = [choice(d, 0) for _, d in sorted(merged.items())]
        return JSONResponse({**head, "choices": choices,
                             "usage": _usage(num_prompt, sum(len(d.token_ids) for d in merged.values()),
                                             _cached(self, merged.values()))})

    async def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return await self.encode([prompt], ["prompt"])
        if not prompt:
            raise BadRequest("prompt must not be empty", "prompt")
        if all(isinstance(t, int) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return await self.encode(list(prompt), [f"prompt[{i}]" for i in range(len(prompt))])
        return [list(p) for p in prompt]  # (pydantic allows no mix of texts and token lists)

    def _openai_logprobs(self, d: Delta, k: int, as_ids: bool, offset: int) -> dict[str, Any]:
        tokens = [self.token_str(t, as_ids) for t in d.token_ids]
        tops: list[dict[str, float]] = []
        for i, (tok, lp) in enumerate(zip(d.token_ids, d.logprobs)):
            top = list(d.top_logprobs[i].items()) if d.top_logprobs else []
            # vLLM's entries: the sampled token, then the k best (k + 1 when it is not among them); -1: all
            entries = top if k == -1 else [(tok, lp)] + [(t, v) for t, v in top[:max(k, 0)] if t != tok]
            tops.append({self.token_str(t, as_ids): _finite(v) for t, v in entries})
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [_finite(x) for x in d.logprobs], "top_logprobs": tops,
                "text_offset": offsets}


class _Choices:
    """The choice objects of one /v1/completions request: a response's, or a stream chunk's."""

    def __init__(self, gen: Generation, body: CompletionRequest, params: SamplingParams,
                 prompts: list[list[int]], echo_texts: list[str] | None) -> None:
        self.gen, self.body, self.params, self.prompts, self.echo_texts = gen, body, params, prompts, echo_texts

    def __call__(self, d: Delta, offset: int, with_prompt: bool = True) -> dict[str, Any]:
        gen, body, params = self.gen, self.body, self.params
        out = {"index": d.prompt_index * params.n + d.index, "text": d.text, "logprobs": None,
               "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
        if params.logprobs is not None:
            out["logprobs"] = gen._openai_logprobs(d, params.logprobs, body.return_tokens_as_token_ids, offset)
        if body.return_token_ids:  # vLLM's: the prompt's ids (a stream: in a choice's first chunk only), and
            out["prompt_token_ids"] = list(self.prompts[d.prompt_index]) if with_prompt else None  # the new ids
            out["token_ids"] = list(d.token_ids)
        if body.echo and with_prompt:
            plp.echo_into(out, self.prompts[d.prompt_index], self.echo_texts[d.prompt_index], d.prompt_logprobs,
                          params.logprobs, lambda t: gen.token_str(t, body.return_tokens_as_token_ids))
        if params.prompt_logprobs is not None and not body.stream:  # vLLM's choices[i].prompt_logprobs
            out["prompt_logprobs"] = plp.vllm_prompt_logprobs(
                d.prompt_logprobs, gen.tokenizer.token_text if gen.tokenizer is not None else None)
        return out


def _completion_stream(produce: Producer, head: dict[str, Any], choice: _Choices, num_prompt: int,
                       options: StreamOptions) -> Producer:
    """The SSE producer: one chunk per delta (with continuous_usage_stats, each carries the usage so far),
    then (include_usage) the usage chunk, then [DONE]."""
    continuous = options.include_usage and options.continuous_usage_stats
    cached: dict[int, int] | None = {} if choice.gen.prompt_tokens_details else None

    async def stream_produce(send: MemoryObjectSendStream) -> None:
        inner_send, inner_receive = anyio.create_memory_object_stream[Delta](math.inf)
        offsets: dict[tuple[int, int], int] = {}
        total = 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(_close_after, produce, inner_send)
            async with inner_receive:
                async for d in inner_receive:
                    key = (d.prompt_index, d.index)
                    first = key not in offsets
                    total += len(d.token_ids)
                    if cached is not None:
                        cached[d.prompt_index] = d.num_cached_tokens
                    out = {**head, "choices": [choice(d, offsets.get(key, 0), first)]}
                    if continuous:  # vLLM's: the request's prompt tokens and its completion tokens so far
                        out["usage"] = _usage(num_prompt, total, cached)
                    await send.send(_sse(out))
                    offsets[key] = offsets.get(key, 0) + len(d.text)
        if options.include_usage:
            await send.send(_sse({**head, "choices": [], "usage": _usage(num_prompt, total, cached)}))
        await send.send(b"data: [DONE]\n\n")

    return stream_produce


async def _close_after(produce: Any, send: MemoryObjectSendStream) -> None:
    async with send:
        await produce(send)


def _merge(deltas: list[Delta]) -> dict[tuple[int, int], Delta]:
    """Each completion's deltas joined into one."""
    merged: dict[tuple[int, int], Delta] = {}
    for d in deltas:
        key = (d.prompt_index, d.index)
        m = merged.get(key)
        if m is None:
            merged[key] = Delta(d.prompt_index, d.index, list(d.token_ids), list(d.logprobs),
                                list(d.top_logprobs) if d.top_logprobs is not None else None, list(d.readout_loops),
                                d.text, d.finish_reason, d.stop_reason, d.seed, d.weight_version, d.num_tokens,
                                d.prompt_logprobs, d.num_cached_tokens)
            continue
        m.token_ids += d.token_ids
        m.logprobs += d.logprobs
        if m.top_logprobs is not None and d.top_logprobs is not None:
            m.top_logprobs += d.top_logprobs
        m.readout_loops += d.readout_loops
        m.text += d.text
        m.finish_reason, m.stop_reason, m.weight_version, m.num_tokens = (d.finish_reason, d.stop_reason,
                                                                          d.weight_version, d.num_tokens)
    return merged


def _usage(prompt_tokens: int, completion_tokens: int, cached: dict[int, int] | None = None) -> dict[str, Any]:
    """OpenAI's usage; `cached` (prompt index -> the prompt tokens the prefix cache served; None: not
    reported) adds prompt_tokens_details.cached_tokens, their sum."""
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": sum(cached.values())}
    return usage


def _cached(gen: Generation, deltas: Any) -> dict[int, int] | None:
    """Each prompt's cached tokens, read off its deltas, where the server reports them (else None)."""
    return {d.prompt_index: d.num_cached_tokens for d in deltas} if gen.prompt_tokens_details else None

