"""SIGTERM drains a real `python -m ourobatch serve` process: the request in flight finishes, nothing new
is taken, the engine closes and the process exits 0."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from tests.server_helpers import MODEL, start_subprocess


@pytest.mark.timeout(600)
def test_sigterm_lets_the_request_in_flight_finish_then_exits_0():
    proc, url = start_subprocess("--model", str(MODEL), "--max-model-len", "64", "--drain-timeout", "60")
    try:
        prompt = json.loads((MODEL / "heldout_tasks.jsonl").read_text().splitlines()[0])["prompt_token_ids"]
        body = {"prompt": prompt, "max_tokens": 30, "ignore_eos": True, "stream": True, "temperature": 1.0}
        with httpx.Client(base_url=url, timeout=120) as client:
            assert client.get("/health").status_code == 200
            chunks = []
            with client.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                for line in lines:
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        break
                proc.send_signal(signal.SIGTERM)  # mid-stream
                for line in lines:
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                    elif line == "data: [DONE]":
                        chunks.append("DONE")
            # no new work once draining: the socket is closed, or an open connection gets a 503
            try:
                status = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code
            except httpx.TransportError:
                status = None
            assert status in (None, 503)
        assert chunks[-1] == "DONE" and chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
