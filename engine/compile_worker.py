"""One compile worker process: launches a share of the kernel warm-up's tasks, one after another.

Run as ``python -m engine.compile_worker`` by engine/compile_workers.py, which writes the job to its stdin
(pickled: the KernelShapes, the device, the task names the parent listed and this worker's indices into
them) and reads one JSON report line from its stdout. The worker rebuilds the task list from the shapes
(engine/kernel_warmup.task_list is a function of them alone) and refuses a job whose names differ, so a
parent and a worker of different versions never compile the wrong kernels. Each compile lands in Triton's
on-disk cache (TRITON_CACHE_DIR, inherited), where the parent's own pass then loads it.
"""

from __future__ import annotations

import json
import pickle
import sys
import time
from typing import Any


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Launch the job's tasks; a failing launch is reported, the others still run."""
    import torch

    from . import kernel_warmup

    device = torch.device(job["device"])
    tasks = kernel_warmup.task_list(job["shapes"], device)
    names = [t.name for t in tasks]
    if names != job["names"]:
        return dict(tasks=0, seconds=0.0, failures=[f"the task list differs from the parent's ({len(names)} "
                                                    f"tasks here, {len(job['names'])} there)"])
    compiled = _count_compiles()
    ready = time.time() - job.get("spawned_at", time.time())  # interpreter, imports, the task list
    started, failures, times = time.perf_counter(), [], []
    for i in job["indices"]:
        name, seconds, error = kernel_warmup._run(tasks[i].name, tasks[i].launch, device)
        times.append(round(seconds, 3))
        if error is not None:
            failures.append(error)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return dict(tasks=len(job["indices"]), seconds=time.perf_counter() - started, failures=failures,
                compiled=compiled.get("compiled"), loaded=compiled.get("loaded"), ready_s=round(ready, 3),
                task_seconds=times)


def _count_compiles() -> dict[str, int]:
    """Triton's compilation listener (Triton >= 3.4), counting compiles and disk-cache loads in this worker."""
    counts: dict[str, int] = {}
    try:
        import triton
    except ImportError:
        return counts
    compilation = getattr(getattr(triton, "knobs", None), "compilation", None)
    if compilation is None or not hasattr(compilation, "listener"):
        return counts
    counts.update(compiled=0, loaded=0)

    def listener(*, cache_hit: bool = False, **_: Any) -> None:
        counts["loaded" if cache_hit else "compiled"] += 1

    compilation.listener = listener
    return counts


def main() -> int:
    job = pickle.load(sys.stdin.buffer)
    try:
        report = run_job(job)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which compiles the rest itself
        report = dict(tasks=0, seconds=0.0, failures=[f"worker: {type(exc).__name__}: {exc}"])
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
