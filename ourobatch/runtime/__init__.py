"""ourobatch.runtime: the threaded runtime both engines run over the sans-IO scheduler (docs/architecture.md):
engine_core.py (EngineCore: caller requests, n completions, outputs), pipeline.py (the stepping loop),
control.py (pause / sleep / weight-update state), driver.py (the async Engine's worker thread),
streams.py (per-request collectors and output streams) and cursor.py (what a reader was given). Torch-free."""

from .engine_core import EngineCore, ParentRequest, child_seed

__all__ = ["EngineCore", "ParentRequest", "child_seed"]
