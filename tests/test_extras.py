"""Install paths (ourobatch._extras): with an optional package missing, what needs no extra still runs
(token-id prompts through LLM), and each feature that does stops with one line naming the pip install.
A missing package is simulated in a fresh interpreter by ``sys.modules[name] = None`` (its import then
raises ModuleNotFoundError), so nothing is uninstalled."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib

import pytest

from ourobatch._extras import EXTRAS, MissingExtraError, missing_extra, require
from tests.server_helpers import MODEL, ROOT

SERVER_HINT = 'pip install "ourobatch[server]"'
TEXT_HINT = 'pip install "ourobatch[text]"'


def run_without(blocked: list[str], code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`code` in a fresh python in which importing any of `blocked` fails as if it were not installed."""
    prelude = f"import sys\nfor _name in {blocked!r}:\n    sys.modules[_name] = None\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def check(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_token_id_prompts_run_without_tokenizers():
    # the README's LLM example (token-id prompts) on a plain `pip install -e .`
    out = check(run_without(["tokenizers"], f"""
        import json
        from ourobatch import LLM
        from ourobatch.llm import SamplingParams
        from ourobatch._extras import MissingExtraError

        llm = LLM(model={str(MODEL)!r}, dtype="float32", max_model_len=64, seed=0)
        tasks = [json.loads(line) for line in open({str(MODEL / "heldout_tasks.jsonl")!r})][:4]
        outs = llm.generate([{{"prompt_token_ids": t["prompt_token_ids"]}} for t in tasks],
                            SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [t["target_token_ids"] + [0] for t in tasks]
        assert [o.outputs[0].text for o in outs] == [""] * 4 and llm.get_tokenizer() is None
        for call in (lambda: llm.generate("n1>n2 ? n1", use_tqdm=False),
                     lambda: llm.generate([1, 2], SamplingParams(stop=["n1"]), use_tqdm=False),
                     lambda: llm.chat([{{"role": "user", "content": "n1"}}], use_tqdm=False)):
            try:
                call()
            except MissingExtraError as exc:
                print(exc)
            else:
                raise AssertionError("no error")
    """))
    lines = out.splitlines()
    assert len(lines) == 3 and all(TEXT_HINT in line and "`tokenizers`" in line for line in lines), out
    assert lines[0].startswith("prompts[0] is text") and lines[2].startswith("LLM.chat")


def test_an_asked_for_tokenizer_must_load():
    done = run_without(["tokenizers"], f"""
        from ourobatch import LLM
        LLM(model={str(MODEL)!r}, max_model_len=64, tokenizer={str(MODEL)!r})
    """)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == (
        "ourobatch._extras.MissingExtraError: reading tokenizer.json (text prompts, output text) needs the "
        f"`tokenizers` package, which is not installed: {TEXT_HINT}")


def test_chat_without_jinja2_names_the_extra():
    out = check(run_without(["jinja2"], f"""
        from ourobatch import LLM
        from ourobatch._extras import MissingExtraError
        llm = LLM(model={str(MODEL)!r}, max_model_len=64)
        assert llm.generate("n1>n2 ? n1", use_tqdm=False)[0].outputs  # text prompts need no jinja2
        try:
            llm.chat([{{"role": "user", "content": "n1>n2 ? n1"}}], use_tqdm=False)
        except MissingExtraError as exc:
            print(exc)
    """))
    assert out.strip() == f"rendering a chat template needs the `jinja2` package, which is not installed: {TEXT_HINT}"


@pytest.mark.parametrize("package", ["fastapi", "uvicorn", "prometheus_client", "starlette"])
def test_serve_without_a_server_package_is_one_line(package):
    done = run_without([package], f"""
        import sys
        from ourobatch.cli import main
        sys.exit(main(["serve", "--model", {str(MODEL)!r}]))
    """)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == (f"ourobatch serve: error: the HTTP server (ourobatch.server, python -m ourobatch "
                                   f"serve) needs the `{package}` package, which is not installed: {SERVER_HINT}")


def test_serve_without_tokenizers_is_one_line():
    done = run_without(["tokenizers"], f"""
        import sys
        from ourobatch.cli import main
        sys.exit(main(["serve", "--model", {str(MODEL)!r}]))
    """)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "`tokenizers`" in line and TEXT_HINT in line


def test_the_ray_pool_without_ray():
    out = check(run_without(["ray"], """
        import ourobatch.ray
        from ourobatch._extras import MissingExtraError
        assert ourobatch.ray.ReplicaDiedError  # the package itself needs no Ray
        try:
            from ourobatch.ray import EnginePool
        except MissingExtraError as exc:
            print(exc)
    """))
    assert out.strip() == ('ourobatch.ray.EnginePool needs the `ray` package, which is not installed: '
                           'pip install "ourobatch[ray]"')


def test_the_extras_table_matches_pyproject():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def names(requirements: list[str]) -> set[str]:
        import re

        return {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0].lower().replace("-", "_") for r in requirements}

    for extra, packages in EXTRAS.items():
        assert set(packages) <= names(declared[extra]), extra
        assert set(packages) <= names(declared["test"]), extra  # the test suite runs every feature


def test_require_and_its_error():
    assert require("json", "text", "x").dumps([1]) == "[1]"
    with pytest.raises(MissingExtraError, match='feature needs the `no_such_module_ourobatch` package.*"ourobatch'
                                                r'\[ray\]"'):
        require("no_such_module_ourobatch", "ray", "feature")
    assert issubclass(MissingExtraError, ImportError)
    with pytest.raises(ValueError, match="unknown extra 'gpu'"):
        missing_extra("x", "gpu", "y")
