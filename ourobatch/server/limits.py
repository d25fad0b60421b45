"""How big a request may be: the body, in bytes (``BodyLimit``), and a text prompt, in characters
(``check_text_length``), both checked before the expensive step (JSON parsing, tokenizing) runs.

``BodyLimit`` reads the body itself: a declared Content-Length over the limit is answered 413 before a
byte of the body is read; otherwise the bytes are counted as they arrive (a chunked body declares no
length) and the 413 goes out as soon as the count passes the limit. Either way uvicorn discards the rest
of the body as it arrives, so the keep-alive connection serves the client's next request. A body within
the limit is handed to the app as one message; later ``receive()`` calls (the disconnect listeners of
streaming.py) go to the server's own.
"""

from __future__ import annotations

from typing import Any

from starlette.types import Message, Receive, Scope, Send

from .errors import BadRequest, error

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024  # 8 MiB: thousands of full-length prompts as token ids
# A text prompt of more than max_model_len * MAX_CHARS_PER_TOKEN characters is refused without being
# tokenized: it cannot fit. Real text averages 3-5 characters per token; 64 leaves room for long special
# tokens and runs of whitespace, so a prompt refused here would need over 64 characters per token on average.
MAX_CHARS_PER_TOKEN = 64
# Completions (prompts x n) one request may ask for: queueing them holds the event loop for ~0.3 ms each on a
# CPU core (in slices, runner.QUEUE_SLICE), and the answer holds them all; more go in several requests.
DEFAULT_MAX_COMPLETIONS = 16384


def check_completions(num_completions: int, limit: int) -> None:
    """Refuse (400) a request for more than `limit` completions."""
    if num_completions > limit:
        raise BadRequest(f"the request asks for {num_completions} completions (prompts x n), more than the "
                         f"server's --max-completions-per-request={limit}; send them in several requests", "prompt")


def check_text_length(text: str, max_model_len: int, field: str) -> None:
    """Refuse (400 naming `field`) a text that is obviously longer than max_model_len tokens."""
    bound = max_model_len * MAX_CHARS_PER_TOKEN
    if len(text) > bound:
        raise BadRequest(f"{field} is {len(text)} characters, more than max_model_len={max_model_len} tokens "
                         f"can hold (text over {max_model_len} x {MAX_CHARS_PER_TOKEN} = {bound} characters is "
                         f"refused before tokenizing)", field)


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # (the HTTP parser refuses a malformed one before the app sees it)
    return None


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 with the JSON error body."""

    def __init__(self, app: Any, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: str) -> Any:
        return error(413, f"the request body is {size} bytes; this server takes at most {self.max_bytes} "
                          f"(--max-request-bytes)", "body", kind="RequestTooLargeError")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._too_large(str(declared))(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body arrived: nobody to answer
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._too_large(f"over {self.max_bytes}")(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)
