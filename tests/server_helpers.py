"""A real uvicorn server on 127.0.0.1 for the server tests: in this process (a thread with its own event
loop, on a socket bound before it starts, so there is no port race) or as a subprocess."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "pointer-chase"
API_KEY = "test-key"


def bound_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class ThreadServer:
    """uvicorn serving `app` in a thread; `url` once started."""

    def __init__(self, app: Any, drain_timeout: float = 5.0) -> None:
        from ourobatch.server.cli import make_server

        self.sock = bound_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(app, "127.0.0.1", self.port, drain_timeout)
        self.started = threading.Event()
        startup = self.server.startup

        async def startup_then_signal(sockets: Any = None) -> None:
            await startup(sockets=sockets)
            self.started.set()

        self.server.startup = startup_then_signal
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ThreadServer":
        self.thread.start()
        assert self.started.wait(300), "the server did not start"
        assert self.server.started, "the app failed to start (see the log)"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(120)
        self.sock.close()


def start_subprocess(*args: str) -> tuple[subprocess.Popen, str]:
    """`python -m ourobatch serve ARGS --port P` on a port found free; returns once the app is up
    (uvicorn's startup line on stderr, read without polling) and the base url."""
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()  # the child binds it; nothing else on this machine races for a fresh ephemeral port
    proc = subprocess.Popen([sys.executable, "-m", "ourobatch", "serve", *args, "--port", str(port),
                             "--log-level", "info"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:  # blocks until the child writes; pytest's timeout bounds it
        lines.append(line)
        if "Application startup complete" in line:
            break
    else:
        raise AssertionError("the server exited during startup:\n" + "".join(lines))
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining the pipe
    return proc, f"http://127.0.0.1:{port}"


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def metric_values(client: httpx.Client) -> dict[str, float]:
    """Every sample of /metrics, parsed with prometheus_client's parser: name{labels} -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get("/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def serve(app: Any) -> Iterator[ThreadServer]:
    """A module fixture's body: ``yield from serve(create_app(...))``."""
    with ThreadServer(app) as srv:
        yield srv


def http_client(server: ThreadServer, api_key: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else None
    return httpx.Client(base_url=server.url, headers=headers, timeout=120)


def openai_client(server: ThreadServer, api_key: str = API_KEY) -> Any:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0)


@contextlib.contextmanager
def gated_engine(server: ThreadServer) -> Iterator[Any]:
    """Hold the served engine's steps on its worker thread (tests/helpers.GatedExecutor) while the block
    runs, so a request is provably mid-flight; the steps flow again after it."""
    from tests.helpers import GatedExecutor

    core = server.server.config.app.state.engine.core
    gated = GatedExecutor(core.executor)
    core.executor = gated
    try:
        yield gated
    finally:
        gated.open()
        core.executor = gated.inner
