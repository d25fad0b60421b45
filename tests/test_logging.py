"""What the entry points say on stderr (issue 21 item 11): `python -m ourobatch serve` and `generate`
configure structlog's console output (ourobatch._logging), so a capped max_model_len is a visible warning
and each prints one startup line (model, mode, dtype, KV capacity in blocks and tokens, and the server's
address); --log-level picks what shows. The library itself configures nothing and stays silent. Each run
is a real subprocess whose stderr is read."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest

from tests.server_helpers import MODEL, ROOT, bound_socket

PROMPT = json.dumps({"prompt_token_ids": [1, 5, 7]}) + "\n"
CAPPED = re.compile(r"\[warning\s*\] max_model_len_capped .*effective=512 .*requested=100000")


def _fields(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", line))


def _generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ourobatch", "generate", "--model", str(MODEL), "--max-tokens", "4",
                           *args], input=PROMPT, capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_serve_logs_the_cap_warning_and_one_ready_line_with_its_address():
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()  # the child binds it
    proc = subprocess.Popen([sys.executable, "-m", "ourobatch", "serve", "--model", str(MODEL), "--port", str(port),
                             "--max-model-len", "100000"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stderr:  # the default --log-level (info); pytest's timeout bounds the wait
            lines.append(line)
            if "server_ready" in line:
                break
        else:
            raise AssertionError("the server exited before its ready line:\n" + "".join(lines))
    finally:
        proc.send_signal(signal.SIGTERM)  # drains and exits 0
        rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, "".join(lines)
    assert any(CAPPED.search(line) for line in lines), "".join(lines)
    ready = _fields(lines[-1])
    assert ready["url"] == f"http://127.0.0.1:{port}"
    assert (ready["model"], ready["mode"], ready["dtype"], ready["max_model_len"], ready["logprobs_mode"]) == \
        (str(MODEL), "deferred", "float32", "512", "raw")
    assert int(ready["kv_tokens"]) == 16 * int(ready["kv_blocks"]) > 0  # block_size 16
    assert sum("engine_ready" in line for line in lines) == 0  # the ready line says it once


def test_generate_logs_by_level():
    default = _generate("--max-model-len", "100000")
    assert default.returncode == 0, default.stderr
    assert CAPPED.search(default.stderr), default.stderr
    ready = [line for line in default.stderr.splitlines() if "generate_ready" in line]
    assert len(ready) == 1 and _fields(ready[0])["requests"] == "1" and "kv_tokens=" in ready[0]
    assert "request_finished" not in default.stderr  # per-request events only at debug
    assert json.loads(default.stdout)["outputs"][0]["token_ids"]  # the output is untouched

    warning = _generate("--max-model-len", "100000", "--log-level", "warning")
    assert CAPPED.search(warning.stderr) and "generate_ready" not in warning.stderr
    quiet = _generate("--max-model-len", "100000", "--log-level", "error")
    assert "max_model_len_capped" not in quiet.stderr and "generate_ready" not in quiet.stderr
    assert "ourobatch: 1 requests" in quiet.stderr  # the run's summary is not a log event
    debug = _generate("--log-level", "debug")
    assert "request_finished" in debug.stderr and "request_added" in debug.stderr


def test_a_bad_log_level_is_a_usage_error():
    bad = _generate("--log-level", "loud")
    assert bad.returncode == 2 and "--log-level" in bad.stderr and "invalid choice" in bad.stderr
    from ourobatch._logging import configure_logging

    with pytest.raises(ValueError, match="--log-level must be one of debug, info, warning, error"):
        configure_logging("loud")


def test_the_library_configures_nothing_and_stays_silent():
    code = ("import structlog, ourobatch, ourobatch.server.app\n"
            "from ourobatch.llm import LLM\n"
            f"llm = LLM({str(MODEL)!r}, max_model_len=100000)\n"
            "assert llm.stats()['max_model_len'] == 512\n"
            "print(structlog.is_configured())\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False" and run.stderr == ""
