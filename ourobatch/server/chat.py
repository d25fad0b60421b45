"""OpenAI's ``/v1/chat/completions`` (plain or SSE stream), in vLLM's request and response shapes.

The messages are rendered with the tokenizer's chat template (ourobatch.chat_template: the checkpoint's,
or ``--chat-template``) on a worker thread, the text is tokenized without the tokenizer's own special
tokens (the template writes them; vLLM's ``add_special_tokens`` default), and the prompt runs through the
same machinery as ``/v1/completions`` (completions.Generation: queueing, stop strings, n, disconnects);
only the request fields and the response shapes differ:

- request: ``messages``, ``max_completion_tokens`` (or the older ``max_tokens``; neither: up to
  ``max_model_len``, as vLLM), ``logprobs`` (bool) + ``top_logprobs`` (k), ``n``, ``stop``, ``stream`` +
  ``stream_options``, the sampling fields of /v1/completions (their rules are CompletionRequest's),
  ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``, ``documents``;
  refused (400): tools, structured output, ``echo`` and a per-request ``chat_template``;
- response: ``chat.completion`` with ``choices[].message`` {role, content} and ``logprobs.content[]``
  entries {token, logprob, bytes, top_logprobs}; a stream sends ``chat.completion.chunk`` events: first
  ``delta.role`` for each choice, then ``delta.content`` pieces, the last with ``finish_reason``, then
  (``include_usage``) a chunk with ``usage`` and no choices, then ``data: [DONE]``.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream
from fastapi import APIRouter
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ourobatch.chat_template import no_template_error

from .completions import CLIENT_CLOSED, Generation, _cached, _close_after, _finite, _merge, _sse, _usage
from .errors import BadRequest
from .protocol import CompletionRequest, SamplingExtras, StreamOptions
from .runner import Delta
from .streaming import EventStream, collect


class ChatCompletionRequest(SamplingExtras):
    """OpenAI's chat completions request, with vLLM's extra fields (the shared sampling ones: SamplingExtras)."""

    NULL_IS_DEFAULT = ("n", "stream", "logprobs")
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    max_tokens: int | None = None  # OpenAI's older name; max_completion_tokens wins
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None  # only {"type": "text"}
    tools: list[dict[str, Any]] | None = None  # refused when non-empty (no tool-call parser)
    tool_choice: Any = None  # only "none" / "auto" without tools
    parallel_tool_calls: bool | None = None  # no effect without tools
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the tokenizer's own (a BOS its post-processor adds) on top of the template's
    echo: bool = False  # refused when true
    chat_template: str | None = None  # refused: the server's template (--chat-template) is used
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    return_tokens_as_token_ids: bool = False
    request_id: str | None = None


# the sampling fields with the same name and meaning in both requests: CompletionRequest.sampling_params
# applies its rules to them (max_tokens and logprobs are mapped by _sampling_params)
SHARED_FIELDS = ("n", "temperature", "top_p", *SamplingExtras.model_fields)


def _refuse_unsupported(body: ChatCompletionRequest) -> None:
    body.check_stream_options()
    if body.tools:
        raise BadRequest("tools are not supported (this server has no tool-call parser); leave tools out", "tools")
    if body.tool_choice not in (None, "none", "auto"):
        raise BadRequest(f"tool_choice={body.tool_choice!r} needs tools, which are not supported; use 'none' or "
                         f"leave it out", "tool_choice")
    if body.response_format not in (None, {"type": "text"}):
        raise BadRequest("response_format: structured output is not supported; only {\"type\": \"text\"}",
                         "response_format")
    if body.echo:
        raise BadRequest("echo=true is not supported; leave echo false", "echo")
    if body.chat_template is not None:
        raise BadRequest("a per-request chat_template is not accepted; the server uses the model's, or the one "
                         "given with --chat-template", "chat_template")
    if body.top_logprobs is not None and not body.logprobs and body.top_logprobs > 0:
        raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
    if body.top_logprobs is not None and body.top_logprobs < 0:
        raise BadRequest(f"top_logprobs must be >= 0, got {body.top_logprobs}", "top_logprobs")


async def _chat_prompt(gen: Generation, body: ChatCompletionRequest) -> tuple[str, list[int]]:
    """The rendered conversation and its token ids."""
    if gen.tokenizer is None:
        raise BadRequest("chat needs a tokenizer, and the server has none (no tokenizer.json beside the model); "
                         "use /v1/completions with token ids", "messages")
    template = gen.tokenizer.chat_template
    if template is None:
        folder = gen.tokenizer.path.parent if gen.tokenizer.path is not None else None
        raise BadRequest(str(no_template_error(folder, "start the server with --chat-template FILE")), "messages")

    def render() -> str:
        try:
            return template.render(body.messages, add_generation_prompt=body.add_generation_prompt,
                                   continue_final_message=body.continue_final_message, documents=body.documents,
                                   chat_template_kwargs=body.chat_template_kwargs)
        except (TypeError, ValueError) as exc:
            raise BadRequest(str(exc), "messages") from None

    text = await anyio.to_thread.run_sync(render)
    ids = await gen.encode([text], ["messages"], add_special_tokens=body.add_special_tokens)
    return text, ids[0]


def _sampling_params(gen: Generation, body: ChatCompletionRequest, num_prompt: int) -> Any:
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(body, field)
    if max_tokens is None:  # vLLM: whatever room the context has left
        max_tokens = max(1, gen.max_model_len - num_prompt)
    elif max_tokens < 1:  # named as the client sent it (pydantic has made it an int)
        raise BadRequest(f"{field} must be an int >= 1 (a chat completion has at least one token), got "
                         f"{max_tokens!r}", field)
    k = (body.top_logprobs or 0) if body.logprobs else None
    shared = {name: getattr(body, name) for name in SHARED_FIELDS}
    return CompletionRequest(prompt=[0], max_tokens=max_tokens, logprobs=k, **shared).sampling_params()


def _token_entry(gen: Generation, token_id: int, logprob: float, as_ids: bool) -> dict[str, Any]:
    token = gen.token_str(token_id, as_ids)
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8", errors="replace"))}


def _chat_logprobs(gen: Generation, d: Delta, k: int, as_ids: bool) -> dict[str, Any]:
    """OpenAI's chat log-probs of one delta's tokens: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for i, (tok, lp) in enumerate(zip(d.token_ids, d.logprobs)):
        top = list(d.top_logprobs[i].items())[:k] if (k > 0 and d.top_logprobs) else []
        content.append({**_token_entry(gen, tok, lp, as_ids),
                        "top_logprobs": [_token_entry(gen, t, v, as_ids) for t, v in top]})
    return {"content": content}


router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    gen: Generation = request.app.state.gen
    if (missing := gen.unknown_model(body.model)) is not None:
        return missing
    _refuse_unsupported(body)
    _, prompt = await _chat_prompt(gen, body)
    params = _sampling_params(gen, body, len(prompt))
    produce = await gen.run([prompt], [params], [body.request_id] if body.request_id is not None else None)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": gen.model_name}
    as_ids = body.return_tokens_as_token_ids

    def logprobs_of(d: Delta) -> dict[str, Any] | None:
        return _chat_logprobs(gen, d, params.logprobs, as_ids) if params.logprobs is not None else None

    if body.stream:
        return EventStream(_stream(gen, body, head, produce, len(prompt), logprobs_of))
    deltas = await collect(request, produce)
    if deltas is None:
        return Response(status_code=CLIENT_CLOSED)
    merged = [d for _, d in sorted(_merge(deltas).items())]
    choices = [{"index": d.index, "message": {"role": "assistant", "content": d.text}, "logprobs": logprobs_of(d),
                "finish_reason": d.finish_reason, "stop_reason": d.stop_reason} for d in merged]
    return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                         "usage": _usage(len(prompt), sum(len(d.token_ids) for d in merged), _cached(gen, merged))})


def _stream(gen: Generation, body: ChatCompletionRequest, head: dict[str, Any], produce: Any, num_prompt: int,
            logprobs_of: Any) -> Any:
    """The SSE producer: role chunks, one content chunk per delta, the usage chunk, [DONE]."""
    head = {**head, "object": "chat.completion.chunk"}
    options = body.stream_options or StreamOptions()
    counts = [0] * body.n  # tokens sent per choice
    cached: dict[int, int] | None = {} if gen.prompt_tokens_details else None

    def chunk(choice: dict[str, Any], index: int) -> bytes:
        out = {**head, "choices": [choice]}
        if options.include_usage and options.continuous_usage_stats:
            out["usage"] = _usage(num_prompt, counts[index], cached)
        return _sse(out)

    async def stream_produce(send: MemoryObjectSendStream) -> None:
        inner_send, inner_receive = anyio.create_memory_object_stream[Delta](math.inf)
        async with anyio.create_task_group() as tg:
            # the producer first: it owns the engine streams, so a client gone before the role chunks are
            # out still aborts its requests (a cancel at the first send would otherwise skip it)
            tg.start_soon(_close_after, produce, inner_send)
            async with inner_receive:
                for i in range(body.n):
                    await send.send(chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}, i))
                async for d in inner_receive:
                    counts[d.index] += len(d.token_ids)
                    if cached is not None:
                        cached[0] = d.num_cached_tokens
                    await send.send(chunk({"index": d.index, "delta": {"content": d.text}, "logprobs": logprobs_of(d),
                                           "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}, d.index))
        if options.include_usage:
            await send.send(_sse({**head, "choices": [], "usage": _usage(num_prompt, sum(counts), cached)}))
        await send.send(b"data: [DONE]\n\n")

    return stream_produce
