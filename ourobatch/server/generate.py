"""SGLang's ``POST /generate``: token ids (or text) in, token ids and their log-probs out, in SGLang's
request and response shapes (sglang_shapes.py: finish reasons and [logprob, id, text] triples), on the
machinery /v1/completions runs on (completions.Generation: queueing all prompts first, stop strings, n,
disconnects).

A body is checked whole before anything is queued, in this order: SGLang fields ourobatch cannot honour,
``logprob_start_len``, the prompt (``input_ids`` or ``text``), ``sampling_params``, ``rid``,
``return_text_in_logprobs``; each refusal is a 400 naming its field.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Any, Callable

import anyio
from anyio.streams.memory import MemoryObjectSendStream
from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from ourobatch.compat import from_sglang
from scheduler.params import SamplingParams

from . import prompt_logprobs as plp, sglang_shapes
from .completions import CLIENT_CLOSED, Generation, _close_after, _sse
from .errors import BadRequest
from .protocol import GenerateRequest
from .runner import Delta
from .streaming import EventStream, Producer, collect

router = APIRouter()


@router.post("/generate")
async def generate(request: Request, body: GenerateRequest) -> Response:
    gen: Generation = request.app.state.gen
    started = time.perf_counter()  # meta_info.e2e_latency: seconds from here to the completion's end
    refused = body.refused_field()
    if refused is not None:
        raise BadRequest(refused[1], refused[0])
    start = _logprob_start(body)
    prompts, single = await _prompts(gen, body)
    params = _sampling_params(body, prompts, start)
    rids = _request_ids(body, len(prompts))
    text_of = _text_of(gen, body)
    produce = await gen.run(prompts, params, rids)
    outputs = _Outputs(body, prompts, params, rids, start, text_of, started)
    if body.stream:
        return EventStream(_stream(produce, outputs))
    deltas = await collect(request, produce)
    if deltas is None:
        return Response(status_code=CLIENT_CLOSED)
    ordered = outputs.final(deltas)
    flat = not (single and params[0].n == 1)  # one prompt, one completion: the object itself, else a list
    return JSONResponse(ordered if flat else ordered[0])


def _logprob_start(body: GenerateRequest) -> int:
    """SGLang's logprob_start_len: -1 (None) asks for no prompt log-probs, L >= 0 for those from position L."""
    start = -1 if body.logprob_start_len is None else body.logprob_start_len
    if start < -1:
        raise BadRequest(f"logprob_start_len must be -1 (no prompt log-probs) or a prompt position >= 0, got "
                         f"{start}", "logprob_start_len")
    return start


async def _prompts(gen: Generation, body: GenerateRequest) -> tuple[list[list[int]], bool]:
    """The prompts' token ids, and whether the body sent one prompt (a flat id list or one text)."""
    if (body.input_ids is None) == (body.text is None):
        raise BadRequest("give exactly one of input_ids (token ids) or text", "input_ids")
    if body.input_ids is not None:
        ids = body.input_ids
        if not ids:
            raise BadRequest("input_ids must not be empty", "input_ids")
        single = all(isinstance(t, int) for t in ids)
        return ([list(ids)] if single else [list(p) for p in ids]), single
    single = isinstance(body.text, str)
    texts = [body.text] if single else list(body.text or [])
    return await gen.encode(texts, ["text" if single else f"text[{i}]" for i in range(len(texts))]), single


def _sampling_params(body: GenerateRequest, prompts: list[list[int]], start: int) -> list[SamplingParams]:
    """One SamplingParams per prompt from SGLang's sampling_params (one dict for all, or one each)."""
    raw = (body.sampling_params if isinstance(body.sampling_params, list)
           else [body.sampling_params or {}] * len(prompts))
    if len(raw) != len(prompts):
        raise BadRequest(f"got {len(raw)} sampling_params for {len(prompts)} prompts", "sampling_params")
    try:
        params = [from_sglang(p) for p in raw]
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc), "sampling_params") from None
    if body.top_logprobs_num:
        params = [dataclasses.replace(p, logprobs=body.top_logprobs_num) for p in params]
    if body.return_logprob and start >= 0:  # meta_info.input_token_logprobs from position `start`
        for i, ids in enumerate(prompts):
            if start >= len(ids):
                raise BadRequest(f"logprob_start_len={start} must be less than the prompt's length ({len(ids)}"
                                 f"{'' if len(prompts) == 1 else f', prompt {i}'})", "logprob_start_len")
        params = [dataclasses.replace(p, prompt_logprobs=body.top_logprobs_num) for p in params]
    return params


def _request_ids(body: GenerateRequest, num_prompts: int) -> list[str]:
    rids = [body.rid] if isinstance(body.rid, str) else body.rid
    if rids is not None and len(rids) != num_prompts:
        raise BadRequest(f"got {len(rids)} rid for {num_prompts} prompts", "rid")
    return rids or [uuid.uuid4().hex for _ in range(num_prompts)]  # SGLang's: a fresh id each (for /abort_request)


def _text_of(gen: Generation, body: GenerateRequest) -> Callable[[int], str] | None:
    """Each token's text for the log-prob triples (return_text_in_logprobs), or None."""
    if not (body.return_logprob and body.return_text_in_logprobs):
        return None
    if gen.tokenizer is None:
        raise BadRequest("return_text_in_logprobs needs a tokenizer, and the server has none (no "
                         "tokenizer.json beside the model)", "return_text_in_logprobs")
    return gen.tokenizer.token_text


class _Outputs:
    """One /generate request's response objects: each completion's state, grown by its deltas."""

    def __init__(self, body: GenerateRequest, prompts: list[list[int]], params: list[SamplingParams],
                 rids: list[str], start: int, text_of: Callable[[int], str] | None, started: float) -> None:
        self.body, self.prompts, self.params, self.rids = body, prompts, params, rids
        self.start, self.text_of, self.started = start, text_of, started
        self.with_input = body.return_logprob and start >= 0
        self.states: dict[tuple[int, int], dict[str, Any]] = {}

    def index(self, d: Delta) -> int:
        return d.prompt_index * self.params[d.prompt_index].n + d.index

    def final(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        """Every completion's last response object, in (prompt, completion) order."""
        results = {}
        for d in deltas:
            results[(d.prompt_index, d.index)] = self.record(d)
        return [results[k] for k in sorted(results)]

    def _state(self, d: Delta) -> dict[str, Any]:
        rid = self.rids[d.prompt_index]
        rid = rid if self.params[d.prompt_index].n == 1 else f"{rid}:{d.index}"
        return self.states.setdefault((d.prompt_index, d.index), {"id": rid, "output_ids": [], "text": "",
                                                                  "lps": [], "loops": [], "tops": []})

    def record(self, d: Delta) -> dict[str, Any]:
        """Fold `d` into its completion's state; the completion's response object so far."""
        body, text_of, state = self.body, self.text_of, self._state(d)
        state["output_ids"] += d.token_ids
        state["text"] += d.text
        state["lps"] += sglang_shapes.triples(zip(d.token_ids, d.logprobs), text_of)
        state["loops"] += d.readout_loops
        k = body.top_logprobs_num
        if k and d.top_logprobs is not None:
            state["tops"] += [sglang_shapes.triples(list(top.items())[:k if k > 0 else None], text_of)  # -1: all
                              for top in d.top_logprobs]
        finish = sglang_shapes.finish_reason(d.finish_reason, d.stop_reason, state["output_ids"])
        meta = {"id": state["id"], "finish_reason": finish, "prompt_tokens": len(self.prompts[d.prompt_index]),
                "completion_tokens": len(state["output_ids"]), "cached_tokens": d.num_cached_tokens,
                "readout_loops": state["loops"], "weight_version": d.weight_version, "seed": d.seed}
        if finish is not None:
            meta["e2e_latency"] = time.perf_counter() - self.started
        out = {"text": state["text"], "output_ids": state["output_ids"], "meta_info": meta}
        if self.with_input:
            if "input" not in state:  # a completion's first delta carries the prompt log-probs
                state["input"] = plp.sglang_input_logprobs(self.prompts[d.prompt_index], d.prompt_logprobs,
                                                           self.start, body.top_logprobs_num, text_of)
            meta.update(state["input"])
        if body.return_logprob:
            meta["output_token_logprobs"] = out["output_token_logprobs"] = state["lps"]
            if body.top_logprobs_num:
                meta["output_top_logprobs"] = state["tops"]  # per token: the k best [logprob, id, text]
        return out


def _stream(produce: Producer, outputs: _Outputs) -> Producer:
    """The SSE producer: one event per delta (the completion's response so far), then [DONE]."""
    async def stream_produce(send: MemoryObjectSendStream) -> None:
        inner_send, inner_receive = anyio.create_memory_object_stream[Delta](math.inf)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_close_after, produce, inner_send)
            async with inner_receive:
                async for d in inner_receive:
                    out = outputs.record(d)
                    out["index"] = outputs.index(d)
                    await send.send(_sse(out))
        await send.send(b"data: [DONE]\n\n")

    return stream_produce
