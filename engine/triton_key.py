"""Triton's own key, kept on disk beside its kernel cache, so a process whose kernels are all cached does not
hash ~400 MB of libtriton before its first launch.

Theory of operation. Every Triton compile's cache key starts with ``triton.runtime.cache.triton_key()``: a
sha256 of libtriton and of Triton's compiler, backend and language sources, computed once per process (cached in
memory only). In a second process (session 20, H200) it took 0.53-0.85 s, and the startup's launches, all cache
hits, waited for it: about half of that process's compile pass (1.2-1.8 s). ``prime`` computes it as before the
first time and writes it, with a fingerprint of what it hashed, to ``<Triton's cache dir>/ourobatch-triton-key.json``;
a later process whose fingerprint matches takes the stored key (by replacing the module's ``triton_key``, which
``get_cache_key`` looks up at every compile) and hashes nothing.

The fingerprint: Triton's folder, version and the source of its ``triton_key`` function (a Triton that hashes other
files is another fingerprint), and the path, size, mtime and inode of every file under the folders that function
reads (``compiler``, ``backends``, ``language``), of ``runtime/cache.py`` and of ``_C/libtriton.*``: ~300 stats,
~2 ms. A reinstalled or edited Triton changes one of them, and the key is then hashed again and the file
rewritten. A file that cannot be read or written only costs the hash.

Both the stat fingerprint and the hash take the GIL hundreds of times, and the startup runs them beside its weight
load and launch list, so ``prime`` runs them in a forked child where it is given one (fork_compile.prime_key
gives fork_compile.value_in_child) and takes the key it sends back; a child that fails or hangs only costs doing
it here.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import threading
from pathlib import Path
from types import ModuleType
from typing import Callable

FILE = "ourobatch-triton-key.json"
HASHED = ("compiler", "backends", "language")  # the folders triton_key reads, under Triton's own
CHILD_TIMEOUT_S = 10.0  # a child past this (~0.3-0.5 s is usual) is stuck: killed, and resolved here instead


def default_dir() -> str:
    """Triton's own default cache folder: $TRITON_HOME/.triton/cache, TRITON_HOME defaulting to the home folder."""
    return os.path.join(os.environ.get("TRITON_HOME", os.path.expanduser("~")), ".triton", "cache")


def fingerprint(cache: ModuleType) -> str:
    """A digest of everything `cache.triton_key` (triton.runtime.cache's) reads, by stat, and of its source."""
    key_fn = _original(cache)
    root = Path(cache.__file__).resolve().parent.parent  # triton/runtime/cache.py -> triton/
    files = [Path(cache.__file__).resolve(), *sorted((root / "_C").glob("libtriton.*"))]
    for folder in HASHED:
        for parent, dirs, names in os.walk(root / folder):
            dirs.sort()
            files += [Path(parent) / n for n in sorted(names) if not n.endswith(".pyc")]
    digest = hashlib.sha256()
    digest.update(f"{root}\n{getattr(cache, '__version__', '')}\n{inspect.getsource(key_fn)}\n".encode())
    for path in files:
        st = path.stat()
        digest.update(f"{path.relative_to(root)} {st.st_size} {st.st_mtime_ns} {st.st_ino}\n".encode())
    return digest.hexdigest()


def prime(cache: ModuleType, cache_dir: str | os.PathLike,
          in_child: Callable[[Callable[[], str], float], str | None] | None = None) -> str:
    """Make `cache.triton_key()` known in this process (forked children inherit it): the stored key where the
    fingerprint matches, else hashed and stored. Returns how: "memory" (this process had it), "stored" or "hashed".

    With `in_child` (fork_compile.value_in_child: fn() in a forked child, its string or None), the fingerprint,
    the read and the hash run in a forked child: here the startup's other threads (the weight load, the launch
    list) take the GIL between their ~300 stats and ~700 reads and digests. On the 2-core machine beside two busy
    Python threads: hashed 8.4-9.8 s here, 0.37-0.48 s in a child; stored 0.81-1.13 s here, 0.03-0.05 s in a
    child (benchmarks/triton_key.py --busy 2; quiet, the child adds ~15 ms). Resolved here if the child fails."""
    current = cache.triton_key
    if getattr(current, "ourobatch_stored", False) or _cached(current):
        return "memory"
    found = in_child(lambda: ":".join(_resolve(cache, cache_dir)), CHILD_TIMEOUT_S) if in_child else None
    how, _, key = found.partition(":") if found else ("", "", "")
    if how not in ("stored", "hashed") or not key:
        how, key = _resolve(cache, cache_dir)
    cache.triton_key = _stored(key, current)
    return how


def _resolve(cache: ModuleType, cache_dir: str | os.PathLike) -> tuple[str, str]:
    """("stored", the key) where the store's fingerprint matches, else ("hashed", Triton's own hash), then stored."""
    current = cache.triton_key
    try:
        mark = fingerprint(cache)
    except (OSError, TypeError, ValueError):  # a Triton laid out otherwise: its own hash, nothing stored
        return "hashed", current()
    path = Path(cache_dir) / FILE
    stored = _read(path, mark)
    if stored is not None:
        return "stored", stored
    key = current()
    _write(path, mark, key)
    return "hashed", key


def _original(cache: ModuleType) -> Callable[[], str]:
    fn = cache.triton_key
    fn = getattr(fn, "ourobatch_original", fn)
    return getattr(fn, "__wrapped__", fn)  # under functools.lru_cache


def _cached(fn) -> bool:
    info = getattr(fn, "cache_info", None)
    return info is not None and info().currsize > 0


def _stored(key: str, original: Callable[[], str]) -> Callable[[], str]:
    def triton_key() -> str:
        return key

    triton_key.ourobatch_stored = True
    triton_key.ourobatch_original = original  # what it stands for (a later fingerprint reads its source)
    return triton_key


def _read(path: Path, mark: str) -> str | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("fingerprint") != mark or not isinstance(data.get("key"), str):
        return None
    return data["key"]


def _write(path: Path, mark: str, key: str) -> None:
    """Atomically (a reader sees the old file or the new one); a folder that cannot be written is left alone."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"fingerprint": mark, "key": key}))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
