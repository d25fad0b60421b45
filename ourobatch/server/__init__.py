"""The HTTP server: ``python -m ourobatch serve --model DIR`` (docs/server.md).

Needs the ``server`` extra (``pip install 'ourobatch[server]'``: fastapi, uvicorn, prometheus_client);
``import ourobatch`` never imports it. ``create_app(config, ...)`` builds the ASGI app for other hosts.
"""

from __future__ import annotations

from typing import Any

from ourobatch._extras import require

for _package in ("fastapi", "uvicorn", "prometheus_client"):  # one line naming the pip install, if missing
    require(_package, "server", "the HTTP server (ourobatch.server, python -m ourobatch serve)")
del _package


def create_app(*args: Any, **kwargs: Any) -> Any:
    """ourobatch.server.app.create_app (imported on first use: it needs fastapi)."""
    from .app import create_app as build

    return build(*args, **kwargs)


__all__ = ["create_app"]
