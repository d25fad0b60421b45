"""SGLang's /generate output shapes: its finish_reason objects and its [logprob, token_id, text] triples.

SGLang's finish reasons (``srt/managers/schedule_batch.py``), as ourobatch's map onto them:

    stop at eos or a stop token   {"type": "stop", "matched": token_id}    (SGLang's FINISH_MATCHED_TOKEN)
    stop at a stop string         {"type": "stop", "matched": "the string"} (FINISH_MATCHED_STR)
    max_new_tokens                {"type": "length", "length": k}          (FINISH_LENGTH)
    aborted                       {"type": "abort", "message": ...}        (FINISH_ABORT)
    failed in the engine          {"type": "abort", "message": ..., "status_code": 500,
                                   "err_type": "InternalServerError"}      (FINISH_ABORT of an internal error)
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

NEG_INF_LOGPROB = -9999.0  # JSON has no -inf (vLLM's choice, kept for every route: completions, chat, /generate)
ABORTED = "aborted (/abort_request, /pause_generation mode abort, or the client left)"
FAILED = "the engine failed on this request (finish_reason error); see the server log"


def finite(x: float) -> float:
    return x if math.isfinite(x) else NEG_INF_LOGPROB


def finish_reason(finish: str | None, stop_reason: int | str | None, output_ids: list[int]) -> dict[str, Any] | None:
    """SGLang's finish_reason for a completion that ended with ourobatch's `finish` (None: still running).
    `stop_reason` is the stop string or stop token (None at eos, vLLM's convention); `output_ids` the
    completion's tokens, whose last one is the eos it matched."""
    if finish is None:
        return None
    if finish == "stop":
        matched = stop_reason if stop_reason is not None else (output_ids[-1] if output_ids else None)
        return {"type": "stop", "matched": matched}
    if finish == "length":
        return {"type": "length", "length": len(output_ids)}
    if finish == "abort":
        return {"type": "abort", "message": ABORTED}
    return {"type": "abort", "message": FAILED, "status_code": 500, "err_type": "InternalServerError"}


def triples(pairs: Iterable[tuple[int, float]], text_of: Callable[[int], str] | None) -> list[list[Any]]:
    """[[logprob, token_id, text], ...] of (token_id, logprob) pairs; text None unless `text_of` is given
    (SGLang's return_text_in_logprobs: each token decoded on its own)."""
    return [[finite(lp), tok, text_of(tok) if text_of is not None else None] for tok, lp in pairs]
