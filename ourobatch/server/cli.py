"""``python -m ourobatch serve --model DIR [engine options] [--host 127.0.0.1] [--port 8000]``.

Runs the app (ourobatch.server.app) under uvicorn, bound to 127.0.0.1 unless told otherwise. SIGTERM
(or Ctrl-C) drains: the listening socket closes, new requests on open connections get 503, requests in
flight finish (or are aborted after --drain-timeout seconds), the engine closes, and the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from typing import Any, Iterator

from ourobatch._logging import DEFAULT_LOG_LEVEL, LOG_LEVELS, console_logging
from ourobatch.compat import VLLM_LOGPROBS_MODE
from ourobatch.config import EngineConfig
from ourobatch.engine_args import add_engine_arguments, engine_config_from_args
from ourobatch.log import get_logger

from .limits import DEFAULT_MAX_COMPLETIONS, DEFAULT_MAX_REQUEST_BYTES

EXIT_OK, EXIT_USAGE = 0, 2
log = get_logger("ourobatch.server")

# Serving's step budget: at most 512 tokens per step (decode rows included), and at most 192 of them prompt
# tokens while any request decodes, so a step that prefills stays near a decode step. H200, full depth,
# Poisson arrivals at 32 requests/s (docs/benchmarks.md, sessions 4 and 11): p99 / p50 gap between
# deliveries 1.99-2.11 at 512 alone (8192: 2.55), 1.73-1.85 at a total of 256; a fixed total of 256 would
# leave a loaded server (hundreds of decode rows) one block of prefill per step, the cap does not. Batches
# (LLM, Engine, rollouts) keep EngineConfig's 8192 and no cap: prefill-heavy batches ran up to 25% slower at 512.
SERVE_MAX_NUM_BATCHED_TOKENS = 512
SERVE_MAX_PREFILL_TOKENS_WHILE_DECODING = 192

# Where the server's flags differ from EngineConfig's: the OpenAI routes report vLLM's raw log-probs, the step
# budget above, and --seed is the engine seed (vLLM's meaning; the same flag as --engine-seed).
SERVER_DEFAULTS = {"logprobs_mode": VLLM_LOGPROBS_MODE, "max_num_batched_tokens": SERVE_MAX_NUM_BATCHED_TOKENS,
                   "max_prefill_tokens_while_decoding": SERVE_MAX_PREFILL_TOKENS_WHILE_DECODING}
SERVER_ALIASES = {"seed": ("--seed",)}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 0-65535 (0: any free port), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ourobatch serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s; use 0.0.0.0 "
                        "to serve other machines, with --api-key)")
    parser.add_argument("--port", type=_port, default=8000, help="(default: %(default)s)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on every route but "
                        "/health (default: no key)")
    parser.add_argument("--tokenizer", default=None, metavar="PATH", help="tokenizer.json or its folder "
                        "(default: the model folder's, if any; without one, text prompts are refused)")
    parser.add_argument("--chat-template", default=None, metavar="FILE", help="the jinja chat template for "
                        "/v1/chat/completions (or its text), instead of the checkpoint's (tokenizer_config.json's "
                        "chat_template or chat_template.jinja)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="S", help="on SIGTERM, seconds "
                        "in-flight requests get to finish before they are aborted (default: %(default)s)")
    parser.add_argument("--max-request-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                        help="a request body over N bytes is refused (413) before it is parsed "
                        "(default: %(default)s, 8 MiB)")
    parser.add_argument("--max-completions-per-request", type=_positive_int, default=DEFAULT_MAX_COMPLETIONS,
                        metavar="N", help="a request for more than N completions (its prompts x n) is refused "
                        "(400): queueing them holds the event loop (default: %(default)s)")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true", help="add usage."
                        "prompt_tokens_details.cached_tokens to completions and chat answers: the prompt tokens "
                        "the prefix cache served (vLLM's flag; off by default, as there)")
    parser.add_argument("--log-level", default=DEFAULT_LOG_LEVEL, choices=LOG_LEVELS,
                        help="what stderr shows, ourobatch's events and uvicorn's: info = the startup line, "
                        "warnings and uvicorn's access log; debug adds per-request events (default: %(default)s)")
    add_engine_arguments(parser, defaults=SERVER_DEFAULTS, aliases=SERVER_ALIASES)
    return parser


def build_config(args: argparse.Namespace) -> EngineConfig:
    return engine_config_from_args(args)


def build_app(args: argparse.Namespace, config: EngineConfig, tokenizer: Any) -> Any:
    """The app `ourobatch serve ARGS` runs (the tests build theirs here too)."""
    from .app import create_app

    return create_app(config, served_model_name=args.served_model_name, api_key=args.api_key, tokenizer=tokenizer,
                      max_request_bytes=args.max_request_bytes,
                      max_completions_per_request=args.max_completions_per_request,
                      enable_prompt_tokens_details=args.enable_prompt_tokens_details)


def load_tokenizer(args: argparse.Namespace) -> Any:
    from ourobatch.text import load_tokenizer as load

    tokenizer = load(args.model, args.tokenizer)
    if args.chat_template is not None:  # replaces the checkpoint's, checked (compiled) before the model loads
        from ourobatch.chat_template import template_override

        if tokenizer is None:
            raise ValueError("--chat-template needs a tokenizer (chat prompts are text): give --tokenizer, or a "
                             "model folder with tokenizer.json")
        tokenizer.chat_template = template_override(args.chat_template, tokenizer.path.parent)
    return tokenizer


def make_server(app: Any, host: str, port: int, drain_timeout: float, log_level: str = "warning",
                startup_fields: dict[str, Any] | None = None) -> Any:
    """A uvicorn Server whose SIGTERM / SIGINT drain and then let the process exit normally. Once it
    serves it logs ``server_ready`` (url, `startup_fields`, the engine's KV capacity), shown where the
    host configured logging (``python -m ourobatch serve`` does)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                _log_ready(app, host, port, startup_fields or {})

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn re-raises a captured SIGTERM after shutdown (exit status 143); a drain is a clean exit.
            if threading.current_thread() is not threading.main_thread():
                yield
                return

            def drain(sig: int, frame: Any) -> None:
                app.state.draining = True
                self.handle_exit(sig, frame)

            previous = {sig: signal.signal(sig, drain) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout,
                            lifespan="on")
    return DrainingServer(config)


def _log_ready(app: Any, host: str, port: int, fields: dict[str, Any]) -> None:
    stats = app.state.engine.stats()
    address = f"[{host}]" if ":" in host else host
    log.info("server_ready", url=f"http://{address}:{port}", **fields, max_model_len=stats.get("max_model_len"),
             kv_blocks=stats.get("kv_blocks_total"), kv_tokens=stats.get("kv_capacity_tokens"),
             attention=stats.get("attention_backend"))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    with console_logging(args.log_level):  # the entry point is the host: the library configures nothing
        return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
        from ourobatch.assembly import check_before_loading  # fail before binding the port

        _, dtype = check_before_loading(config)
        tokenizer = load_tokenizer(args)
    except (TypeError, ValueError, OSError) as exc:
        print(f"ourobatch serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    app = build_app(args, config, tokenizer)
    startup = {"model": str(config.model), "served_model_name": args.served_model_name or str(config.model),
               "mode": config.mode, "deep_interval": config.deep_interval, "shallow_loops": config.shallow_loops,
               "dtype": str(dtype).removeprefix("torch."), "device": config.device,
               "logprobs_mode": config.logprobs_mode, "tokenizer": tokenizer is not None}
    server = make_server(app, args.host, args.port, args.drain_timeout, args.log_level, startup)
    server.run()
    return EXIT_OK if server.started else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
