"""The on-disk compile caches (Triton's, Inductor's) and the count of kernels compiled vs loaded from them.

Triton compiles a kernel once per specialization and keeps the binary on disk; a later process that
needs the same kernel loads it in milliseconds instead of compiling it (hundreds of milliseconds to
seconds). ``configure(EngineConfig.compile_cache_dir)`` picks the folders, before the first compile:

    TRITON_CACHE_DIR          (if the user set it)  >  compile_cache_dir/triton  >  Triton's default
    TORCHINDUCTOR_CACHE_DIR   (if the user set it)  >  compile_cache_dir/inductor >  Inductor's default

A variable the user exported wins, so an engine never redirects a cache other code of the process relies
on (a warning says when compile_cache_dir is therefore not used). The variables are process-wide and
Triton reads them at every compile: a later engine with another compile_cache_dir moves what this module
set, never what the user set. Triton's default is ``$TRITON_HOME/.triton/cache`` (``~/.triton/cache``).
Triton's folder also keeps Triton's own key (engine/triton_key.py), so a later process skips hashing libtriton.

``install_compile_counter()`` chains a listener onto ``triton.knobs.compilation.listener`` (Triton >=
3.4), which Triton calls for every kernel it had not in memory: ``cache_hit`` says whether the binary came
from the disk cache or was compiled; a kernel a forked child compiled for this process
(engine/fork_compile.py) reaches it as a cache hit and is counted as compiled. Nothing here imports Triton
unless asked (CUDA engines only).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ourobatch.log import get_logger

log = get_logger()

TRITON_VAR = "TRITON_CACHE_DIR"
INDUCTOR_VAR = "TORCHINDUCTOR_CACHE_DIR"
_SET_HERE: dict[str, str] = {}  # variable -> the value this module set (a value the user set is never replaced)


@dataclass(frozen=True)
class CacheSetting:
    triton_dir: str  # where Triton reads and writes compiled kernels
    inductor_dir: str | None  # Inductor's folder (None: its own default, unchanged)
    source: str  # "TRITON_CACHE_DIR" (the user's variable) | "compile_cache_dir" | "default"


def _set(var: str, value: str | None) -> str | None:
    """Point `var` at `value` unless the user set it; returns the folder in force (None: unset, default)."""
    current = os.environ.get(var)
    if current is not None and _SET_HERE.get(var) != current:
        return current  # the user's
    if value is None:
        if current is not None:  # ours, from an earlier engine: leave it (kernels are already there)
            return current
        return None
    os.environ[var] = value
    _SET_HERE[var] = value
    return value


def configure(compile_cache_dir: str | os.PathLike | None) -> CacheSetting:
    """Set the cache folders for this process (before the first compile) and log where they are."""
    user_triton = os.environ.get(TRITON_VAR)
    user_triton = None if user_triton is None or _SET_HERE.get(TRITON_VAR) == user_triton else user_triton
    base = None if compile_cache_dir is None else Path(compile_cache_dir).expanduser().resolve()
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    triton_dir = _set(TRITON_VAR, None if base is None else str(base / "triton"))
    inductor_dir = _set(INDUCTOR_VAR, None if base is None else str(base / "inductor"))
    if user_triton is not None:
        source = "TRITON_CACHE_DIR"
        if base is not None:
            log.warning("compile_cache_dir_ignored", compile_cache_dir=str(base), TRITON_CACHE_DIR=user_triton,
                        reason="TRITON_CACHE_DIR is set in the environment; it wins")
    else:
        source = "compile_cache_dir" if base is not None else "default"
    from engine.triton_key import default_dir  # Triton's own default folder (the key's store uses it too)

    setting = CacheSetting(triton_dir or default_dir(), inductor_dir, source)
    log.info("compile_cache", triton_dir=setting.triton_dir, inductor_dir=setting.inductor_dir, source=source)
    return setting


@dataclass(frozen=True)
class CompileCounts:
    compiled: int  # kernels compiled in this process
    loaded: int  # kernels loaded from the disk cache
    seconds: float  # time Triton spent in both (its own timer)

    def __sub__(self, other: "CompileCounts") -> "CompileCounts":
        return CompileCounts(self.compiled - other.compiled, self.loaded - other.loaded,
                             self.seconds - other.seconds)


class CompileCounter:
    """Triton's compilation listener: counts what it compiled and what it loaded (thread-safe: the startup
    warm-up compiles in threads)."""

    def __init__(self, previous: Any = None) -> None:
        self._lock = threading.Lock()
        self._previous = previous  # the listener installed before this one (called first)
        self.compiled = self.loaded = 0
        self.microseconds = 0
        self.names: dict[str, int] = {}  # kernel name -> compiles + loads

    def __call__(self, *, src: Any = None, metadata: Any = None, metadata_group: Any = None, times: Any = None,
                 cache_hit: bool = False, **extra: Any) -> None:
        if self._previous is not None:
            self._previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                           cache_hit=cache_hit, **extra)
        name = getattr(src, "name", None) or "?"
        microseconds = int(getattr(times, "total", 0) or 0)
        from engine import fork_compile

        child = fork_compile.child_result()  # this load is of what a forked child just compiled for us
        if cache_hit and child is not None and child[0]:
            cache_hit, microseconds = False, microseconds + int(child[1] * 1e6)
        with self._lock:
            if cache_hit:
                self.loaded += 1
            else:
                self.compiled += 1
            self.microseconds += microseconds
            self.names[name] = self.names.get(name, 0) + 1

    def snapshot(self) -> CompileCounts:
        with self._lock:
            return CompileCounts(self.compiled, self.loaded, self.microseconds / 1e6)


_COUNTER: CompileCounter | None = None


def install_compile_counter() -> CompileCounter | None:
    """The process's counter, installed on first call; None where Triton (>= 3.4, with knobs) is missing."""
    global _COUNTER
    try:
        import triton
    except ImportError:
        return None
    compilation = getattr(getattr(triton, "knobs", None), "compilation", None)
    if compilation is None or not hasattr(compilation, "listener"):
        return None
    if _COUNTER is not None and compilation.listener is _COUNTER:
        return _COUNTER
    _COUNTER = CompileCounter(previous=compilation.listener)  # chained: a listener set before ours still runs
    compilation.listener = _COUNTER
    return _COUNTER


def compile_counts() -> CompileCounts | None:
    """Kernels compiled / loaded so far in this process (None before install_compile_counter, or without it)."""
    return _COUNTER.snapshot() if _COUNTER is not None else None


class StartupCompiles:
    """An engine's startup compiles (CUDA): the cache folders set, the counter installed, and one
    ``kernels_compiled`` event at ready: how many kernels were compiled and loaded from the cache, in how long."""

    def __init__(self, compile_cache_dir: str | os.PathLike | None, device: str) -> None:
        """Sets the folders (no import); count() installs the counter (imports Triton)."""
        self.setting = self.counter = self.before = None
        if device.startswith("cuda"):
            self.setting = configure(compile_cache_dir)

    def count(self) -> "CompileCounter | None":
        """Install the counter (CUDA) and take the count from here; returns it (None: nothing counts)."""
        if self.setting is not None and self.counter is None:
            self.counter = install_compile_counter()
            self.before = self.counter.snapshot() if self.counter is not None else None
        return self.counter

    def log(self) -> CompileCounts | None:
        if self.counter is None or self.before is None:
            return None
        delta = self.counter.snapshot() - self.before
        log.info("kernels_compiled", compiled=delta.compiled, loaded=delta.loaded, seconds=round(delta.seconds, 2),
                 triton_dir=self.setting.triton_dir if self.setting is not None else None)
        return delta
