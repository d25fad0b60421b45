"""Import a script of benchmarks/ (a folder of scripts, not a package) as a module, for its tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """load_benchmark("quality") -> benchmarks/quality.py, imported under a private module name."""
    spec = importlib.util.spec_from_file_location(f"ourobatch_benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
