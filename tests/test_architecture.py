"""The layers stay honest: scheduler/ is torch-free, engine/ has no async code and imports only the
scheduler's boundary modules (plan, params, errors)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOUNDARY = {"ourobatch.scheduler.plan", "ourobatch.scheduler.params", "ourobatch.scheduler.errors"}


def imports(folder: str):
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield path, alias.name, node
            elif isinstance(node, ast.ImportFrom):
                yield path, node.module or "", node
            elif isinstance(node, (ast.AsyncFunctionDef, ast.Await)):
                yield path, "<async>", node


def test_scheduler_imports_no_torch():
    bad = [(p.name, m) for p, m, _ in imports("scheduler") if m.split(".")[0] in {"torch", "numpy", "safetensors"}]
    assert bad == []


def test_engine_has_no_async_and_only_the_boundary_of_the_scheduler():
    bad = []
    for path, module, _ in imports("engine"):
        if module in {"asyncio", "anyio", "trio", "<async>"}:
            bad.append((path.name, module))
        if module.startswith("ourobatch.") and not module.startswith("ourobatch.engine"):
            if module not in BOUNDARY:
                bad.append((path.name, module))
    assert bad == []


def test_importing_the_scheduler_does_not_load_torch():
    code = "import sys, ourobatch.scheduler; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_rollout_collector_is_torch_free_and_drives_the_engine_through_its_public_calls():
    bad = [(p.name, m) for p, m, _ in imports("ourobatch/rollout")
           if m.split(".")[0] in {"torch", "numpy", "safetensors", "asyncio"}
           or m.startswith(("ourobatch.engine", "ourobatch.async_engine", "ourobatch.scheduler.driver"))]
    assert bad == []
    code = "import sys, ourobatch.rollout; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# The scheduler's helpers get narrow inputs (the request, the KV manager, the config, a protocol), never
# the Scheduler: it is the one owner of the scheduling state (issue 23), and they form no cycle with it.
SCHEDULER_HELPERS = ("admission", "block_manager", "cohort", "config", "counters", "decode_plan", "kv_manager",
                     "plan", "params", "prefill", "request", "validate", "verify_plan")


def test_no_scheduler_helper_imports_the_scheduler_not_even_for_type_checking():
    names = {"scheduler", "ourobatch.scheduler.scheduler", "frontend", "ourobatch.scheduler.frontend"}
    bad = [(p.name, m) for p, m, _ in imports("scheduler")
           if p.stem in SCHEDULER_HELPERS and (m.lstrip(".") in names or m in names)]
    relative = [(p.name, alias.name) for p, m, node in imports("scheduler")
                if p.stem in SCHEDULER_HELPERS and isinstance(node, ast.ImportFrom) and node.level and not m
                for alias in node.names if alias.name in {"scheduler", "frontend"}]
    assert bad + relative == []
    assert {p.stem for p in (ROOT / "scheduler").glob("*.py")} >= set(SCHEDULER_HELPERS)
