"""Checks of a new request against the engine's limits (torch-free): the prompt's token ids, its length
with max_tokens against max_model_len and the KV pool, its stop token ids. Each raises, naming the field."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Container, Iterable

from .errors import RequestRejectedError
from .params import SamplingParams, field_error

if TYPE_CHECKING:
    from .block_manager import BlockManager
    from .config import SchedulerConfig


def check_prompt(prompt_token_ids: Iterable[int], vocab: int) -> tuple[int, ...]:
    """The prompt as a tuple of ints in [0, vocab); TypeError / ValueError naming the bad position."""
    if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__iter__"):
        raise field_error(TypeError, "prompt", f"prompt_token_ids must be a list of ints, got "
                          f"{type(prompt_token_ids).__name__}")
    prompt = tuple(prompt_token_ids)
    if not prompt:
        raise field_error(ValueError, "prompt", "prompt_token_ids must hold at least one token, got an empty prompt")
    ids = []
    for i, tok in enumerate(prompt):
        # ints and integer scalars (numpy, torch) are fine; bools and floats are not
        if isinstance(tok, bool) or not hasattr(tok, "__index__"):
            raise field_error(TypeError, "prompt",
                              f"prompt_token_ids[{i}] must be an int, got {type(tok).__name__} {tok!r}")
        tok = operator.index(tok)
        if not 0 <= tok < vocab:
            raise field_error(ValueError, "prompt",
                              f"prompt_token_ids[{i}] = {tok} is outside the vocabulary [0, {vocab})")
        ids.append(tok)
    return tuple(ids)


def check_fits(cfg: "SchedulerConfig", blocks: "BlockManager", prompt_len: int, params: SamplingParams) -> None:
    """prompt + max_tokens within max_model_len and the whole KV pool; stop token ids in the vocabulary."""
    total_len = prompt_len + params.max_tokens
    if total_len > cfg.max_model_len:
        raise field_error(RequestRejectedError, "max_tokens",
                          f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = {total_len} exceeds "
                          f"max_model_len={cfg.max_model_len}")
    need = blocks.blocks_for(prompt_len + params.max_tokens - 1)
    if need > cfg.num_kv_blocks:
        raise field_error(
            RequestRejectedError, "max_tokens",
            f"request needs {need} KV blocks ({prompt_len} + {params.max_tokens} - 1 positions at "
            f"block_size={cfg.block_size}) but the pool has only {cfg.num_kv_blocks}; lower max_tokens "
            f"or raise num_kv_blocks"
        )
    for tok in params.stop_token_ids:
        if tok >= cfg.vocab_size:
            raise field_error(ValueError, "stop_token_ids",
                              f"stop_token_ids holds {tok}, outside the vocabulary [0, {cfg.vocab_size})")


def check_ids_free(request_ids: Iterable[str], live: Container[str]) -> None:
    """The one "id in use" rule: every id must be a non-empty str no live request holds."""
    for request_id in request_ids:
        if not isinstance(request_id, str) or not request_id:
            raise field_error(TypeError, "request_id",
                              f"request_id must be a non-empty str or None, got {request_id!r}")
        if request_id in live:
            raise field_error(ValueError, "request_id",
                              f"request_id {request_id!r} is already in use by a live request")
