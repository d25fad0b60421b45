"""The loop-pass launch's compile (engine/gluon_layers.py) started ahead of the startup's compile pass, in a forked
child that needs no GPU.

Theory of operation. In every cold process of session 24 (H200; docs/benchmarks.md) the pass ended with that
compile, 3.95-5.40 s long, whose child forked 0.76-1.04 s into the pass, and the pass starts after the setup's
0.41-0.70 s: the pass's forks wait for Triton's driver (a gcc build on an empty cache) and Triton's key. A compile
needs neither. Triton compiles for a target (the GPU's capability), and a forked child can make the key known
itself. So the startup forks this child as soon as the checkpoint's config is checked (ourobatch/assembly.py,
through warmup_pass.PassSetup, before its threads start: the child inherits no lock a thread held). The child:
- puts in place a Triton driver that only names the target and the launcher's class (`_Target`: nothing of CUDA);
- makes Triton's key known (read back where a process before stored it, else hashed; engine/triton_key.py);
- compiles gluon_layers.warm_compile: the pass's launch's own arguments on CPU stand-ins, so its own
  specialization and cache key;
- builds its launcher (gcc; cached on disk too).
The pass's launch of that kernel first waits for the child (`AheadCompile.wrap`), then finds it on disk and only
loads it; the compile counter counts it as compiled, with the child's seconds (fork_compile.child_result). A child
that fails, or outlives fork_compile.CHILD_TIMEOUT_S, costs only the wait: the launch compiles as before.

``OUROBATCH_AHEAD_COMPILE=1`` turns it on (off by default until measured on the GPU; ``OUROBATCH_FORK_COMPILE=0``
turns it off too).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass

import torch

from . import fork_compile
from .warmup_order import Task

ENV = "OUROBATCH_AHEAD_COMPILE"
DEFAULT = "0"  # off until measured on the GPU: a child whose key missed the launch's would cost its wait, then the
# compile all the same (tests/gpu/test_gpu_warmup.py checks that it does not miss)
KERNEL = "gluon_layers"  # the kernel compiled ahead: its launches wait for the child


def enabled() -> bool:
    """OUROBATCH_AHEAD_COMPILE: 1 / true / yes / on, or 0 / false / no / off (empty or unset: DEFAULT); on only where
    fork_compile is too."""
    value = os.environ.get(ENV, "").strip().lower() or DEFAULT
    if value not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ValueError(f"{ENV} must be 1 (on) or 0 (off; the default), got {value!r}")
    return value in ("1", "true", "yes", "on") and fork_compile.enabled()


class _Target:
    """The child's Triton driver: the GPU's target and the launcher's class (no device is touched)."""

    def __init__(self, target, launcher_cls) -> None:
        self.target, self.launcher_cls = target, launcher_cls

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target


@dataclass
class AheadResult:
    """What the child did: compiled the kernel (False: it was on disk already, or the child failed), its seconds
    from the fork to its report, how Triton's key came ("stored", "hashed"), whether its launcher was built, how
    long the pass's launch waited for it, and when it was forked and reported (perf_counter)."""

    ok: bool
    compiled: bool = False
    seconds: float = 0.0
    key: str = ""
    launcher: bool = False
    waited: float = 0.0
    forked_at: float = 0.0
    reported_at: float = 0.0


def _in_child(s, rows: int, layers: int, capability: int, num_sms: int, launch_kwargs: dict, folder: str) -> str:
    """The child's work (see the module's docstring); its report: "<compiled> <seconds> <key> <launcher>"."""
    started = time.perf_counter()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.runtime import cache

    from . import gluon_layers, triton_key

    triton.runtime.driver.set_active(_Target(GPUTarget("cuda", capability, 32), CudaLauncher))
    how = triton_key.prime(cache, folder)  # here: this child runs no other thread
    hits: list[bool] = []
    triton.knobs.compilation.listener = lambda **kw: hits.append(bool(kw.get("cache_hit")))
    kernel = gluon_layers.warm_compile(s, rows, layers, num_sms, launch_kwargs)
    try:
        CudaLauncher(kernel.src, kernel.metadata)
        launcher = True
    except Exception:  # noqa: BLE001 - no CUDA library to link (a machine without a GPU): the parent builds it
        launcher = False
    compiled = bool(hits) and not all(hits)
    return f"{int(compiled)} {time.perf_counter() - started:.6f} {how} {int(launcher)}"


class AheadCompile:
    """The forked child and its result. `start` forks it (or returns None where nothing is to be compiled ahead);
    `join` waits for it once (thread-safe); `close` reaps it, killing it where nobody waited for it."""

    def __init__(self, child: tuple[int, int, float], forked_at: float) -> None:
        self._child, self._lock, self._result = child, threading.Lock(), None
        self.forked_at = forked_at

    @classmethod
    def start(cls, s, device: torch.device) -> "AheadCompile | None":
        """Fork the child for KernelShapes `s` on `device`, where the engine's pass launches the loop-pass kernel:
        a CUDA device, fork compiles available, the switch on, and layer_stack.warm_runs."""
        if device.type != "cuda" or not enabled():
            return None
        try:
            return cls._fork(s, device)
        except Exception:  # noqa: BLE001 - an optimization only: the pass compiles the kernel as before
            return None

    @classmethod
    def _fork(cls, s, device: torch.device) -> "AheadCompile | None":
        if not fork_compile.available():
            return None
        from . import kernel_cases, layer_stack, pdl

        runs = list(kernel_cases.layers_keys(s, layer_stack.warm_runs(s, device)).values())
        if not runs:
            return None
        major, minor = torch.cuda.get_device_capability(device)
        (rows, layers) = runs[0]
        return cls.fork(s, rows, layers, 10 * major + minor, pdl.num_sms(device), pdl.launch_kwargs(device))

    @classmethod
    def fork(cls, s, rows: int, layers: int, capability: int, num_sms: int, launch_kwargs: dict,
             folder: str | None = None) -> "AheadCompile | None":
        """Fork the child: gluon_layers.warm_compile(s, rows, layers, num_sms, launch_kwargs) for sm`capability`,
        Triton's key stored in `folder` (default: Triton's cache folder). None where no process could be had."""
        import pkgutil  # noqa: F401 - what triton_key imports: here, so the child never imports it
        import sysconfig  # noqa: F401

        import triton

        from . import triton_key

        knobs = getattr(getattr(triton, "knobs", None), "cache", None)
        folder = (folder or getattr(knobs, "dir", None) or os.environ.get("TRITON_CACHE_DIR")
                  or triton_key.default_dir())
        forked_at = time.perf_counter()
        child = fork_compile.fork_report(
            lambda: _in_child(s, rows, layers, capability, num_sms, launch_kwargs, folder))
        return None if child is None else cls(child, forked_at)

    def join(self, timeout: float = fork_compile.CHILD_TIMEOUT_S) -> AheadResult:
        """The child's result, waiting at most `timeout` for it (a child past it is killed: not ok)."""
        with self._lock:
            if self._result is None:
                t = time.perf_counter()
                report = fork_compile.read_report(self._child, timeout)
                parts = (report or "").split()
                ok = len(parts) == 4
                self._result = AheadResult(ok, ok and parts[0] == "1", float(parts[1]) if ok else 0.0,
                                           parts[2] if ok else "", ok and parts[3] == "1", time.perf_counter() - t,
                                           self.forked_at, time.perf_counter())
            return self._result

    def close(self) -> None:
        """Reap the child; where no launch waited for it, it is killed (a startup that stopped early)."""
        self.join(timeout=0.0)

    def wrap(self, task: Task) -> Task:
        """`task` whose launch first waits for the child (a task of the ahead kernel; others as they are)."""
        if KERNEL not in task.kernels:
            return task

        def launch() -> None:  # (the pass's head goes on meanwhile: the child is forked)
            with fork_compile.compiled_elsewhere(lambda: (r.compiled, r.seconds) if (r := self.join()).ok else None):
                task.launch()

        return dataclasses.replace(task, launch=launch)

    def entry(self, zero: float) -> dict | None:
        """The child as a line of the pass's timeline (warmup_order.entry's form; times from the pass's start
        `zero`, negative before it), once joined."""
        r = self._result
        if r is None:
            return None
        at = lambda t: round(t - zero, 3)  # noqa: E731
        return dict(task="ahead", key=KERNEL, queued=at(r.forked_at), slot=at(r.forked_at), end=at(r.reported_at),
                    children=[(at(r.forked_at), at(r.reported_at), round(r.seconds, 3) if r.ok else None)])
