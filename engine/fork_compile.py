"""Triton compiles in forked child processes, for the startup warm-up (engine/kernel_warmup.py).

Theory of operation. A Triton compile holds the GIL for much of its time, so threads reach only ~4x (8
threads: 30 s of compiles in 6.5-8.5 s on the H200), and fresh worker processes lose 4-6 s each to the
interpreter, torch and a CUDA context before their first compile (docs/benchmarks.md, session 6). A forked
child starts in milliseconds with everything imported. Triton (>= 3.5) routes the compiles of a
thread that is inside ``triton.AsyncCompileMode(executor)`` through ``executor.submit(compile_fn)``;
`ForkCompiler` is that executor: ``submit`` forks a child that runs ``compile_fn`` (which writes the
kernel into Triton's on-disk cache) and builds the kernel's launcher module (gcc, cached on disk too),
waits for it (the GIL is free while it waits), then runs ``compile_fn`` itself, which now finds the
kernel on disk and only loads it (milliseconds). The child never touches CUDA: a compile needs only the
target, which the parent's Triton already resolved, and the child leaves with ``os._exit`` (no
finalizers, no CUDA teardown). It runs with the garbage collector and Triton's compilation listener off,
so it takes no lock a parent thread may have held at the fork. A child that fails or outlives
`CHILD_TIMEOUT_S` only costs the compile in the parent, as before.

Counting: the parent's re-run is a disk-cache hit, so ourobatch/compile_cache.py's counter asks
`child_result()` and counts a kernel its child compiled as compiled (with the child's time).

``OUROBATCH_FORK_COMPILE=0`` turns it off (threads only). Nothing here imports Triton or torch until
`compiles_in_children` is entered with it on.
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterator

ENV = "OUROBATCH_FORK_COMPILE"
CHILD_TIMEOUT_S = 120.0  # a compile past this is stuck: killed, and compiled in the parent instead
CHILD_NICENESS = 5  # children yield the cores to the parent (its weight load runs beside them)

_FORK_LOCK = threading.Lock()  # one fork at a time (and one warnings filter change at a time)
_LOCAL = threading.local()  # .child: (compiled, seconds) while the parent loads what its child compiled;
# .slot: the semaphore this thread holds for its work in the parent (parent_slot), let go while a child runs;
# .record: the list `recording` gives this thread's children to (None: not recording); .on_fork: its callback


@dataclass
class ForkStats:
    """What the children did in this process."""

    children: int = 0  # forked
    compiled: int = 0  # children that compiled their kernel (the others found it on disk)
    failed: int = 0  # children that raised, died or timed out (the parent compiled instead)
    child_seconds: float = 0.0  # the children's compile time summed
    fork_seconds: float = 0.0  # the forks themselves (serialized: one at a time)
    on_disk: int = 0  # compiles that found the kernel on disk already: loaded here, no child


STATS = ForkStats()
_STATS_LOCK = threading.Lock()
_IN_FLIGHT: dict[str, threading.Event] = {}  # cache key -> set when the thread compiling it is done (_STATS_LOCK)


def enabled() -> bool:
    """Fork compiles where the OS can fork and the user did not turn them off."""
    return hasattr(os, "fork") and os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def available() -> bool:
    """enabled(), and this Triton routes compiles through AsyncCompileMode (3.5 and later)."""
    if not enabled():
        return False
    try:
        import triton
    except ImportError:
        return False
    return hasattr(triton, "AsyncCompileMode") and hasattr(triton, "FutureKernel")


def child_result() -> tuple[bool, float] | None:
    """(the child compiled it, its seconds) while this thread loads a kernel its child compiled, else None."""
    return getattr(_LOCAL, "child", None)


def triton_child(fn: Callable[[], Any]) -> bool:
    """A Triton compile in the child: run it, build its launcher (gcc; cached on disk too); whether it
    compiled (False: it was on disk already). Triton's listener is replaced: the parent's counter has a
    lock a parent thread may have held at the fork."""
    import triton

    hits: list[bool] = []
    triton.knobs.compilation.listener = lambda **kw: hits.append(bool(kw.get("cache_hit")))
    kernel = fn()
    triton.runtime.driver.active.launcher_cls(kernel.src, kernel.metadata)
    return bool(hits) and not all(hits)


def _child(report: Callable[[], str], write_fd: int, niceness: int) -> None:
    """In the child: report() written whole to the pipe, then leave (exit 1 where it raised). Never returns."""
    code = 1
    try:
        gc.disable()  # a finalizer could take a lock (the CUDA allocator's) a parent thread held at the fork
        if niceness:
            os.nice(niceness)
        data = memoryview(report().encode())
        while data:
            data = data[os.write(write_fd, data):]
        code = 0
    except BaseException:  # noqa: BLE001 - the parent does the work instead
        code = 1
    finally:
        os._exit(code)


def _fork(report: Callable[[], str], niceness: int = 0) -> tuple[int, int, float] | None:
    """A forked child running _child(report): (its pid, the pipe's read end, the fork's seconds), or None where no
    process could be had. Under the lock from the pipe to closing its write end here: a child forked by another
    thread in between would inherit that write end and hold this child's EOF until it exits too."""
    with _FORK_LOCK, warnings.catch_warnings():
        # Python 3.12 warns on fork in a threaded process: the child runs no other thread's code
        warnings.simplefilter("ignore", DeprecationWarning)
        read_fd, write_fd = os.pipe()
        started = time.perf_counter()
        try:
            pid = os.fork()
        except OSError:  # no process to be had (memory, limits)
            os.close(read_fd)
            os.close(write_fd)
            return None
        if pid == 0:
            os.close(read_fd)
            _child(report, write_fd, niceness)
        os.close(write_fd)
        return pid, read_fd, time.perf_counter() - started


def _compiled(fn: Callable[[], Any], in_child: Callable[[Callable[[], Any]], bool]) -> str:
    """The compile child's report: "<compiled> <seconds>" of in_child(fn)."""
    started = time.perf_counter()
    compiled = in_child(fn)
    return f"{int(compiled)} {time.perf_counter() - started:.6f}"


def _wait(pid: int, read_fd: int, timeout: float) -> str | None:
    """The child's report, or None when it failed or timed out; always reaped (killed first unless it
    closed its end: a wait that ends any other way, an error included, never blocks on a stuck child)."""
    chunks, deadline, closed = [], time.monotonic() + timeout, False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_fd], [], [], left)[0]:
                return None
            chunk = os.read(read_fd, 65536)
            if not chunk:  # EOF: the child has exited (or is exiting)
                closed = True
                break
            chunks.append(chunk)
    finally:
        os.close(read_fd)
        if not closed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return b"".join(chunks).decode() or None


def compile_in_child(fn: Callable[[], Any], in_child: Callable[[Callable[[], Any]], bool] = triton_child,
                     timeout: float = CHILD_TIMEOUT_S) -> Any:
    """in_child(fn) in a forked child (for fn's side effects on disk; it returns whether fn compiled), then
    fn() here; returns the latter. A child that fails or times out: fn() here all the same."""
    child = _fork(lambda: _compiled(fn, in_child), CHILD_NICENESS)  # niced: the parent's weight load first
    pid, read_fd, forked = child if child is not None else (-1, -1, 0.0)  # no process: compile here
    report, started = None, time.perf_counter()
    on_fork = getattr(_LOCAL, "on_fork", None)
    if on_fork is not None:
        on_fork()
    if pid > 0:
        with _slot_let_go():  # the wait costs the parent nothing: another thread may work meanwhile
            report = _wait(pid, read_fd, timeout)
    record = getattr(_LOCAL, "record", None)
    if record is not None:  # (forked at, its report read at, the child's seconds or None: it failed)
        record.append((started, time.perf_counter(), None if report is None else float(report.split()[1])))
    with _STATS_LOCK:
        STATS.children += 1
        STATS.fork_seconds += forked
        if report is None:
            STATS.failed += 1
    if report is None:
        return fn()  # compiled here instead
    compiled, seconds = report.split()
    result = (compiled == "1", float(seconds))
    with _STATS_LOCK:
        STATS.compiled += result[0]
        STATS.child_seconds += result[1]
    _LOCAL.child = result
    try:
        return fn()  # a disk-cache hit now
    finally:
        _LOCAL.child = None


def value_in_child(fn: Callable[[], str], timeout: float) -> str | None:
    """fn() in a forked child, for a CPU-bound job that takes the GIL often (Triton's key: ~300 file reads and
    ~400 chunks of libtriton): the child's interpreter has no other thread to hand the GIL to, while here the
    weight load and the launch list would take it between every two steps. Returns fn()'s string, or None where
    the fork, the child or its time (`timeout`) failed (the caller then runs fn itself)."""
    child = _fork(lambda: f"{len(value := fn())}:{value}")
    if child is None:
        return None
    pid, read_fd, _ = child
    size, _, value = (_wait(pid, read_fd, timeout) or "").partition(":")
    return value if size.isdigit() and int(size) == len(value) else None  # a child cut short says nothing


class ForkCompiler:
    """The executor triton.AsyncCompileMode takes: ``submit(fn)`` returns a finished Future (the calling
    thread waits for its child; each warm-up thread compiles one kernel at a time)."""

    def submit(self, fn: Callable[[], Any], fork: bool = True) -> Future:
        future: Future = Future()
        try:
            future.set_result(compile_in_child(fn) if fork else fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the launch that waits on it
            future.set_exception(exc)
        return future


def prime_key() -> tuple[float, str]:
    """Triton's own key (triton.runtime.cache.triton_key: a hash of its ~400 MB libtriton and its Python files,
    0.3 s on a quiet core, 0.70-0.94 s in the H200 host's startup beside the other threads), made known before
    the compiles that need it (read back or hashed in a forked child: engine/triton_key.py): every compile's cache key
    starts with it, its cache is not shared by threads that miss it at once (session 20's timeline: the first
    four launches each hashed it at the same time, ~1.1 s before their children could fork), and a forked child
    inherits it. engine/triton_key.py keeps it beside Triton's cache, so a later process reads it instead.
    Returns its seconds and how it came ("hashed", "stored", "memory"; "none" where this Triton has no such key)."""
    started = time.perf_counter()
    try:
        import triton
        from triton.runtime import cache
    except ImportError:
        return 0.0, "none"
    if not callable(getattr(cache, "triton_key", None)):
        return 0.0, "none"
    from . import triton_key

    knobs = getattr(getattr(triton, "knobs", None), "cache", None)
    folder = getattr(knobs, "dir", None) or os.environ.get("TRITON_CACHE_DIR") or triton_key.default_dir()
    import pkgutil  # noqa: F401 - what triton_key imports: here, so a child never waits on an import lock
    import sysconfig  # noqa: F401

    how = triton_key.prime(cache, folder, in_child=value_in_child if enabled() else None)
    return time.perf_counter() - started, how


def on_disk(cache_key: str) -> bool:
    """Whether Triton's file cache holds the kernel of `cache_key` (Triton's key before hashing, as
    compile() and AsyncCompileMode.submit get it): its group file, written last, is there. False where the
    cache is not the file cache (a remote one): then a child compiles it (or loads it) all the same."""
    import hashlib

    from triton.runtime.cache import FileCacheManager, get_cache_manager

    manager = get_cache_manager(hashlib.sha256(cache_key.encode("utf-8")).hexdigest())
    folder = getattr(manager, "cache_dir", None)
    if not isinstance(manager, FileCacheManager) or not folder or not os.path.isdir(folder):
        return False
    return any(name.startswith("__grp__") for name in os.listdir(folder))


@contextlib.contextmanager
def recording(on_fork: Callable[[], None] | None = None) -> Iterator[list[tuple[float, float, float | None]]]:
    """The children this thread forks within the block, one (forked at, report read at, the child's compile
    seconds or None where it failed) each, perf_counter times: where the startup's compile pass spends its
    wall time (warmup_pass's timeline). `on_fork()` runs in this thread right after each fork (or the
    attempt, where none could be had)."""
    record: list[tuple[float, float, float | None]] = []
    _LOCAL.record, _LOCAL.on_fork = record, on_fork
    try:
        yield record
    finally:
        _LOCAL.record = _LOCAL.on_fork = None


@contextlib.contextmanager
def parent_slot(slots: threading.Semaphore | None) -> Iterator[None]:
    """Hold one of `slots` for the block's work in this process, except while a child compiles for it
    (compile_in_child lets it go): many threads can wait on children while few run Python here, where
    they would slow each other and the weight load through the GIL. None: no limit."""
    if slots is None:
        yield
        return
    with slots:
        _LOCAL.slot = slots
        try:
            yield
        finally:
            _LOCAL.slot = None


@contextlib.contextmanager
def _slot_let_go() -> Iterator[None]:
    """This thread's parent slot (if it holds one) let go for the block, taken back after it."""
    slot = getattr(_LOCAL, "slot", None)
    if slot is not None:
        slot.release()
    try:
        yield
    finally:
        if slot is not None:
            slot.acquire()


@contextlib.contextmanager
def one_at_a_time(key: str) -> Iterator[None]:
    """The block runs for one thread per `key` at a time (a kernel compiles once across the threads: the
    next one then finds it on disk). A holder stuck past CHILD_TIMEOUT_S is no longer waited for. A waiting
    thread lets its parent slot go: the holder may need one to finish (after its child), and threads that
    held every slot while waiting would wait for it forever."""
    while True:
        with _STATS_LOCK:
            other = _IN_FLIGHT.get(key)
            if other is None:
                _IN_FLIGHT[key] = mine = threading.Event()
                break
        with _slot_let_go():
            done = other.wait(CHILD_TIMEOUT_S)
        if not done:
            break  # run beside it
    try:
        yield
    finally:
        if other is None:
            with _STATS_LOCK:
                del _IN_FLIGHT[key]
            mine.set()


def _fork_mode() -> Any:
    """triton.AsyncCompileMode over a ForkCompiler that loads a kernel already on disk without a child."""
    import triton

    class ForkCompileMode(triton.AsyncCompileMode):
        def submit(self, key, compile_fn, finalize_fn):  # Triton's signature (3.5, 3.6)
            if key in self.future_kernels:
                return self.future_kernels[key]
            with one_at_a_time(key):  # a second thread with this kernel waits, then loads it from disk
                try:
                    fork = not on_disk(key)
                except Exception:  # noqa: BLE001 - a cache layout we do not know: the child finds out
                    fork = True
                if not fork:
                    with _STATS_LOCK:
                        STATS.on_disk += 1
                future = self.executor.submit(compile_fn, fork=fork)
            future._key = key
            self.raw_futures.append(future)
            self.future_kernels[key] = kernel = triton.FutureKernel(finalize_fn, future)
            return kernel

    return ForkCompileMode(ForkCompiler())


@contextlib.contextmanager
def compiles_in_children(on: bool = True) -> Iterator[bool]:
    """Within the block, this thread's Triton compiles run in forked children (yields whether they do:
    not where it is off, the OS cannot fork, or Triton has no AsyncCompileMode)."""
    mode = None
    if on and available():
        try:
            mode = _fork_mode()
        except (ImportError, AttributeError):
            mode = None
    if mode is None:
        yield False
        return
    with mode:
        yield True
