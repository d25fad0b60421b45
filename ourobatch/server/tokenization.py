"""vLLM's tokenizer routes, with vLLM 0.32's request and response shapes
(vllm/entrypoints/serve/tokenize/protocol.py and serving.py):

- ``POST /tokenize``: ``{"prompt": text, "add_special_tokens": true, "return_token_strs": false}`` or the
  chat form ``{"messages": [...], "add_generation_prompt": true, "continue_final_message": false,
  "add_special_tokens": false, "chat_template_kwargs": {...}, "tools": [...]}`` (rendered with the server's
  chat template) -> ``{"count", "max_model_len", "tokens", "token_strs"}``;
- ``POST /detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": text}`` (special tokens kept, as vLLM's
  ``tokenizer.decode`` does);
- ``GET /tokenizer_info``: the tokenizer's configuration (tokenizer_config.json beside tokenizer.json, less
  file paths) with ``tokenizer_class`` and the server's ``chat_template``. vLLM serves it only with
  ``--enable-tokenizer-info-endpoint``; here it is always on (behind the API key like every route).

Text goes through the same encoder as /v1/completions (a word outside the vocabulary is a 400 naming it),
on a worker thread. A token id outside the vocabulary is a 400, never decoded to nothing.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .errors import BadRequest
from .protocol import _Strict

router = APIRouter()
PATH_FIELDS = ("vocab_file", "merges_file", "tokenizer_file")  # vLLM drops file paths from the config


class TokenizeRequest(_Strict):
    """vLLM's TokenizeCompletionRequest (``prompt``) or TokenizeChatRequest (``messages``), as one body."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM's defaults)
    return_token_strs: bool | None = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # only None: the server's template (vLLM needs a trust flag for more)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    media_io_kwargs: dict[str, Any] | None = None  # only None / {}: a text model
    mm_processor_kwargs: dict[str, Any] | None = None  # only None / {}: a text model


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def _generation(request: Request) -> Any:
    return request.app.state.gen


def _check_model(gen: Any, model: str | None) -> Response | None:
    if model is None or model == gen.model_name:
        return None
    return JSONResponse({"error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError",
                                   "param": "model", "code": 404}}, status_code=404)


def _tokenizer(gen: Any, field: str) -> Any:
    if gen.tokenizer is None:
        raise BadRequest("the server has no tokenizer (no tokenizer.json beside the model; give --tokenizer)", field)
    return gen.tokenizer


@router.post("/tokenize")
async def tokenize(request: Request, body: TokenizeRequest) -> Response:
    gen = _generation(request)
    if (missing := _check_model(gen, body.model)) is not None:
        return missing
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("give exactly one of prompt (text) or messages (a chat)", "prompt")
    for name in ("media_io_kwargs", "mm_processor_kwargs"):
        if getattr(body, name):
            raise BadRequest(f"{name} is not supported: Ouro is a text model; leave it out", name)
    if body.chat_template is not None:
        raise BadRequest("chat_template in a request is not supported: the server's template applies "
                         "(python -m ourobatch serve --chat-template FILE)", "chat_template")
    tokenizer = _tokenizer(gen, "prompt" if body.prompt is not None else "messages")
    if body.messages is not None:
        text, field, special = await _render_chat(tokenizer, body), "messages", bool(body.add_special_tokens)
    else:
        text, field = body.prompt, "prompt"
        special = body.add_special_tokens is not False
    if special:
        (ids,) = await gen.encode([text], [field])
    else:
        (ids,) = await gen.encode([text], [field], add_special_tokens=False)
    strs = [tokenizer.tok.id_to_token(i) for i in ids] if body.return_token_strs else None
    max_model_len = request.app.state.engine.stats()["max_model_len"]  # the engine's (capped at the checkpoint's)
    return JSONResponse({"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs})


async def _render_chat(tokenizer: Any, body: TokenizeRequest) -> str:
    """The chat's prompt text, from the server's chat template (ourobatch.chat_template)."""
    template = tokenizer.chat_template
    if template is None:
        raise BadRequest("the model has no chat template (no chat_template in tokenizer_config.json and no "
                         "chat_template.jinja; python -m ourobatch serve --chat-template FILE gives one)", "messages")
    if body.continue_final_message and body.add_generation_prompt:
        raise BadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                         "continue_final_message")
    return await anyio.to_thread.run_sync(lambda: template.render(
        body.messages, add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message, tools=body.tools,
        chat_template_kwargs=body.chat_template_kwargs))


@router.post("/detokenize")
async def detokenize(request: Request, body: DetokenizeRequest) -> Response:
    gen = _generation(request)
    if (missing := _check_model(gen, body.model)) is not None:
        return missing
    tokenizer = _tokenizer(gen, "tokens")
    vocab = tokenizer.tok.get_vocab_size(with_added_tokens=True)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise BadRequest(f"tokens holds id(s) outside the vocabulary (0 <= id < {vocab}): {bad[:10]}", "tokens")
    text = await anyio.to_thread.run_sync(lambda: tokenizer.decode(body.tokens, skip_special_tokens=False))
    return JSONResponse({"prompt": text})


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> Response:
    gen = _generation(request)
    tokenizer = _tokenizer(gen, None)
    return JSONResponse(await anyio.to_thread.run_sync(tokenizer_config, tokenizer))


def tokenizer_config(tokenizer: Any) -> dict[str, Any]:
    """vLLM's TokenizerInfo: tokenizer_config.json (its added tokens as their text, no file paths),
    ``tokenizer_class`` and the chat template the server renders with (a dict of named templates when
    there are several, as Hugging Face stores them)."""
    config: dict[str, Any] = {}
    path = tokenizer.path.parent / "tokenizer_config.json" if tokenizer.path is not None else None
    if path is not None and path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise BadRequest(f"cannot read {path}: {exc}") from None
    for name in PATH_FIELDS:
        config.pop(name, None)
    added = config.get("added_tokens_decoder")
    if isinstance(added, dict):
        config["added_tokens_decoder"] = {k: v.get("content", v) if isinstance(v, dict) else v
                                          for k, v in added.items()}
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")  # what transformers loads tokenizer.json as
    template = tokenizer.chat_template
    if template is not None:
        named = dict(template.templates)
        config["chat_template"] = named["default"] if list(named) == ["default"] else [
            {"name": k, "template": v} for k, v in named.items()]
    return config
