"""ourobatch/import_roots.py: `scheduler` and `engine` are generic top-level names, so a foreign package of
that name first on sys.path makes `import ourobatch` stop with an ImportError naming the foreign file and
what to do, before any of that package's code runs, and with no torch loaded on the way."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(code: str, cwd: Path, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    path = [str(p) for p in (extra_path, ROOT) if p is not None]  # the foreign folder first, then ours
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def fake_package(tmp_path: Path, name: str) -> Path:
    """A package `name` whose import would leave a trace (it must never run)."""
    folder = tmp_path / "elsewhere" / name
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(f"import sys\nsys.stdout.write('FOREIGN {name} RAN\\n')\n")
    return folder


@pytest.mark.parametrize("name", ["scheduler", "engine"])
def test_a_foreign_package_first_on_the_path_is_named_and_never_run(tmp_path, name):
    foreign = fake_package(tmp_path, name)
    done = run("""
        import sys
        try:
            import ourobatch
        except ImportError as exc:
            print("ImportError:", exc)
            print("name:", exc.name, "path:", exc.path)
            print("torch loaded:", "torch" in sys.modules)
    """, cwd=tmp_path, extra_path=foreign.parent)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "FOREIGN" not in out  # its __init__ never ran
    assert f"ourobatch needs its own top-level `{name}` package ({ROOT / name})" in out
    assert f"finds {foreign / '__init__.py'}" in out and "take its folder off sys.path" in out
    assert f"name: {name} path: {foreign / '__init__.py'}" in out
    assert "torch loaded: False" in out


def test_a_foreign_package_in_the_current_directory_is_refused(tmp_path):
    """The likeliest case: a script run from a project that has its own `scheduler/` folder."""
    fake_package(tmp_path, "scheduler")
    project = tmp_path / "elsewhere"
    done = run("import ourobatch", cwd=project)  # `python -c` puts the current directory first
    assert done.returncode == 1
    assert "ImportError: ourobatch needs its own top-level `scheduler` package" in done.stderr
    assert str(project / "scheduler" / "__init__.py") in done.stderr and "FOREIGN" not in done.stdout


def test_a_foreign_module_already_imported_is_refused_by_its_missing_marker(tmp_path):
    done = run("""
        import sys, types
        sys.modules["engine"] = types.ModuleType("engine")  # someone else's `engine`, imported first
        try:
            import ourobatch
        except ImportError as exc:
            print("ImportError:", exc)
    """, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "ImportError: ourobatch needs its own top-level `engine` package" in done.stdout
    assert "finds <module 'engine'>" in done.stdout


def test_ours_pass_whether_imported_before_or_not(tmp_path):
    done = run("""
        import sys
        import ourobatch  # neither imported yet: found beside ourobatch/, nothing imported
        assert "torch" not in sys.modules and "engine" not in sys.modules
        import engine, scheduler
        from ourobatch.import_roots import check_import_roots
        check_import_roots()  # both imported now: the markers
        print(engine.__ourobatch_layer__, scheduler.__ourobatch_layer__)
    """, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["engine", "scheduler"]
