"""ruff's pyflakes and syntax rules (F, E9: undefined names, unused imports, redefinitions, syntax errors) and its
line-length rule (E501: at most 120 characters, pyproject.toml's [tool.ruff] line-length) over every Python file of
the checkout: a name only a rarely taken branch reads (a GPU path, an error message) fails here, not on the H200 or
in a user's run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_no_undefined_name_unused_import_syntax_error_or_line_over_120():
    pytest.importorskip("ruff")  # in the test extra
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F,E9,E501", "--output-format", "concise",
                          "--no-cache", str(ROOT)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_the_check_fails_on_an_undefined_name(tmp_path):
    pytest.importorskip("ruff")
    (tmp_path / "bad.py").write_text("def f():\n    return undefined_name\n")
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F,E9", "--no-cache", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "F821" in run.stdout


def test_the_check_fails_on_a_line_over_120(tmp_path):
    pytest.importorskip("ruff")
    (tmp_path / "long.py").write_text("x = " + repr("a" * 115) + "\n")  # 4 + 117 = 121 characters
    (tmp_path / "ok.py").write_text("x = " + repr("a" * 114) + "\n")  # 120: allowed
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F,E9,E501", "--line-length", "120",
                          "--output-format", "concise", "--no-cache", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "E501" in run.stdout, run.stdout + run.stderr
    assert "long.py" in run.stdout and "ok.py" not in run.stdout, run.stdout
