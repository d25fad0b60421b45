"""The layers stay honest: scheduler/ is torch-free, engine/ has no async code and imports only the
scheduler's boundary modules (plan, params, errors)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOUNDARY = {"scheduler.plan", "scheduler.params", "scheduler.errors"}


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
        top = module.split(".")[0]
        if top == "ourobatch" or (top == "scheduler" and module not in BOUNDARY):
            bad.append((path.name, module))
    assert bad == []


def test_importing_the_scheduler_does_not_load_torch():
    code = "import sys, scheduler; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_rollout_collector_is_torch_free_and_drives_the_engine_through_its_public_calls():
    bad = [(p.name, m) for p, m, _ in imports("ourobatch/rollout")
           if m.split(".")[0] in {"torch", "numpy", "safetensors", "asyncio"}
           or m.split(".")[0] == "engine" or m.startswith(("ourobatch.async_engine", "ourobatch.runtime.driver"))]
    assert bad == []
    code = "import sys, ourobatch.rollout; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# The scheduler's helpers get narrow inputs (the request, the KV manager, the config, a protocol), never
# the Scheduler: it is the one owner of the scheduling state (issue 23), and they form no cycle with it.
SCHEDULER_HELPERS = ("admission", "block_manager", "cohort", "config", "counters", "decode_plan", "kv_manager",
                     "plan", "params", "prefill", "request", "validate", "verify_plan")


def test_no_scheduler_helper_imports_the_scheduler_not_even_for_type_checking():
    names = {"scheduler", "scheduler.scheduler", "frontend", "ourobatch.runtime.engine_core"}
    bad = [(p.name, m) for p, m, _ in imports("scheduler")
           if p.stem in SCHEDULER_HELPERS and (m.lstrip(".") in names or m in names)]
    relative = [(p.name, alias.name) for p, m, node in imports("scheduler")
                if p.stem in SCHEDULER_HELPERS and isinstance(node, ast.ImportFrom) and node.level and not m
                for alias in node.names if alias.name in {"scheduler", "frontend"}]
    assert bad + relative == []
    assert {p.stem for p in (ROOT / "scheduler").glob("*.py")} >= set(SCHEDULER_HELPERS)


def engine_import_graph() -> dict[str, set[str]]:
    """engine module -> the engine modules it imports: at the top, inside functions and under TYPE_CHECKING."""
    modules = {p.stem for p in (ROOT / "engine").glob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for path, module, node in imports("engine"):
        if isinstance(node, ast.Import):
            targets = [a.name.removeprefix("engine.") for a in node.names
                       if a.name.startswith("engine.")]
        elif isinstance(node, ast.ImportFrom) and (node.level == 1 or module.split(".")[0] == "engine"):
            rest = module.removeprefix("engine").lstrip(".") if not node.level else module
            targets = [rest] if rest else [a.name for a in node.names]  # `from . import weights`
        else:
            continue
        for target in targets:
            name = target.split(".")[0]
            graph[path.stem].add(name if name in modules else "__init__")  # a name the package exports
    return graph


def test_engine_modules_import_no_cycle_not_even_for_type_checking():
    graph = engine_import_graph()
    assert {"cuda_graphs", "retained", "weights"} <= graph["executor"]  # the parse sees relative imports
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, "import cycle in engine/: " + " -> ".join(path[path.index(module):] + (module,))
        if module not in done:
            for target in sorted(graph[module]):
                visit(target, path + (module,))
            done.add(module)

    for module in sorted(graph):
        visit(module, ())
