"""Library-safe structured logging.

ourobatch never configures logging. When the host application has configured structlog
(``structlog.configure(...)``), events go through its processors; otherwise they go to the standard
library logger ``"ourobatch"`` as ``event key=value ...`` lines, silent unless the host enables them.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _Logger:
    def __init__(self, name: str) -> None:
        self._name = name
        self._stdlib = logging.getLogger(name)

    def _log(self, level: str, event: str, **fields: Any) -> None:
        if structlog.is_configured():
            getattr(structlog.get_logger(self._name), level)(event, **fields)
            return
        if self._stdlib.isEnabledFor(_LEVELS[level]):
            text = " ".join(f"{k}={v}" for k, v in fields.items())
            self._stdlib.log(_LEVELS[level], "%s %s", event, text)

    def debug(self, event: str, **fields: Any) -> None:
        self._log("debug", event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log("info", event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log("warning", event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self._log("error", event, **fields)


# A library attaches a NullHandler and nothing else: without it, a host that configured no logging at
# all would get our warnings on stderr through Python's last-resort handler.
logging.getLogger("ourobatch").addHandler(logging.NullHandler())


def get_logger(name: str = "ourobatch") -> _Logger:
    return _Logger(name)
