"""Console logging for the command-line entry points (``python -m ourobatch generate`` and ``serve``).

The library configures nothing (ourobatch/log.py: events go through structlog only once the host has
configured it); an entry point is the host, and runs its main() inside console_logging(): structlog's console
renderer on stderr at ``--log-level`` (default info), so a warning such as ``max_model_len_capped`` and the
startup line are seen. Events the engine emits per request or per step (NOISY_EVENTS) are shown only at
``--log-level debug``: a run of 10,000 prompts prints its startup line and its warnings, not 10,000 lines.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Iterator, TextIO

import structlog

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_LEVEL = "info"
# info events shown on a console only at debug: one line per request, per step or per replica call
# (ourobatch/runtime/engine_core.py, ourobatch/ray), and engine_ready, which the entry points' own ready line
# (generate_ready, server_ready) repeats with the KV capacity in tokens and the address
NOISY_EVENTS = frozenset({"request_finished", "request_failed", "request_aborted", "completion_aborted",
                          "deep_boundary", "request_retried", "replica_call", "engine_ready"})


def _demote_noisy(level: int) -> Any:
    """A processor that drops NOISY_EVENTS unless the console shows debug."""
    def processor(logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        if level > logging.DEBUG and event_dict.get("event") in NOISY_EVENTS:
            raise structlog.DropEvent
        return event_dict
    return processor


@contextlib.contextmanager
def console_logging(level: str = DEFAULT_LOG_LEVEL, stream: TextIO | None = None) -> Iterator[None]:
    """configure_logging for the length of an entry point's main(), then structlog as it was: a main()
    called in-process (tests, a host's script) leaves no global configuration behind."""
    was_configured, previous = structlog.is_configured(), structlog.get_config()
    configure_logging(level, stream)
    try:
        yield
    finally:
        if was_configured:
            structlog.configure(**previous)
        else:
            structlog.reset_defaults()


def configure_logging(level: str = DEFAULT_LOG_LEVEL, stream: TextIO | None = None) -> None:
    """structlog to `stream` (stderr) at `level` (one of LOG_LEVELS); colours only on a terminal."""
    if level not in LOG_LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    stream = stream if stream is not None else sys.stderr
    number = logging.getLevelName(level.upper())
    structlog.configure(
        processors=[_demote_noisy(number), structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S"),
                    structlog.dev.ConsoleRenderer(colors=stream.isatty())],
        wrapper_class=structlog.make_filtering_bound_logger(number),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False)
