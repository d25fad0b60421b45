"""engine/triton_key.py: Triton's own key kept beside its cache. On a Triton-shaped tree whose ``triton_key`` hashes
its files as Triton's does (and counts its calls): the first process hashes and stores, a later one takes the
stored key without hashing, and the key it takes is the one a fresh hash gives; any change to what the hash reads
(content, size, a new file, a replaced file, the key function's module) makes the next process hash again and get
the new key; a broken or unwritable store costs only the hash. fork_compile.prime_key end to end in subprocesses,
and, where Triton is installed, on the real one."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine import fork_compile
from engine import triton_key as tk

REPO = Path(__file__).resolve().parents[2]

CACHE_PY = textwrap.dedent('''
    import functools
    import hashlib
    import os

    __version__ = "0.0-fake"
    CALLS = []


    @functools.lru_cache()
    def triton_key():
        CALLS.append(1)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        digest = hashlib.sha256(__version__.encode())
        for folder in ("compiler", "backends", "language", "_C"):
            for parent, dirs, names in sorted(os.walk(os.path.join(root, folder))):
                for name in sorted(names):
                    with open(os.path.join(parent, name), "rb") as f:
                        digest.update(name.encode() + f.read())
        with open(__file__, "rb") as f:
            digest.update(f.read())
        return digest.hexdigest()


    def get_cache_key(src):
        return f"{triton_key()}-{src}"
''')

_names = itertools.count()


def fake_triton(root: Path) -> Path:
    """A package laid out as Triton's: runtime/cache.py, compiler/, backends/, language/, _C/libtriton.so."""
    files = {"__init__.py": "", "runtime/__init__.py": "", "runtime/cache.py": CACHE_PY,
             "compiler/__init__.py": "", "compiler/compiler.py": "x = 1\n",
             "backends/__init__.py": "", "backends/nvidia/__init__.py": "", "backends/nvidia/compiler.py": "y = 2\n",
             "language/__init__.py": "", "language/core.py": "z = 3\n", "_C/libtriton.so": "\0" * 4096}
    for rel, text in files.items():
        (root / "triton" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "triton" / rel).write_text(text)
    return root / "triton"


def child(fork: bool):
    """What fork_compile.prime_key gives prime: a forked child's runner, or None (here)."""
    return fork_compile.value_in_child if fork else None


def process(tree: Path):
    """runtime/cache.py as a new process would import it (its own in-memory cache, no calls yet)."""
    spec = importlib.util.spec_from_file_location(f"fake_triton_cache_{next(_names)}", tree / "runtime/cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fresh_hash(tree: Path) -> str:
    return process(tree).triton_key()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return fake_triton(tmp_path / "site")


@pytest.mark.parametrize("fork", [True, False], ids=["hashed in a child", "hashed here"])
def test_the_first_process_hashes_and_stores_a_later_one_reads(tree, tmp_path, fork):
    store = tmp_path / "cache"
    first = process(tree)
    assert tk.prime(first, store, in_child=child(fork)) == "hashed" and len(first.CALLS) == (0 if fork else 1)
    saved = json.loads((store / tk.FILE).read_text())
    assert saved["key"] == first.triton_key() == fresh_hash(tree)
    second = process(tree)
    assert tk.prime(second, store) == "stored"
    assert second.triton_key() == saved["key"] and second.get_cache_key("src") == f"{saved['key']}-src"
    assert second.CALLS == []  # nothing hashed
    assert tk.prime(second, store) == "memory" and tk.prime(first, store) == "memory"


def test_a_process_that_has_the_key_already_stores_nothing(tree, tmp_path):
    module = process(tree)
    module.triton_key()
    assert tk.prime(module, tmp_path / "cache") == "memory" and not (tmp_path / "cache").exists()


def _edit(tree: Path):
    path = tree / "language/core.py"
    st = path.stat()
    path.write_text("z = 4\n")  # same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def _same_stat_new_inode(tree: Path):
    path = tree / "compiler/compiler.py"
    st = path.stat()
    other = path.with_name("new.tmp")
    other.write_text("x = 9\n")  # same size, same mtime below: only the inode tells
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)


CHANGES = {
    "content, same size": _edit,
    "replaced, same size and mtime": _same_stat_new_inode,
    "libtriton grows": lambda t: (t / "_C/libtriton.so").write_text("\0" * 8192),
    "a new backend file": lambda t: (t / "backends/amd.py").write_text("w = 5\n"),
    "the key function's module": lambda t: (t / "runtime/cache.py").write_text(CACHE_PY.replace("0.0-fake", "0.1")),
}


@pytest.mark.parametrize("fork", [True, False], ids=["hashed in a child", "hashed here"])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_to_what_the_hash_reads_is_hashed_again(tree, tmp_path, change, fork):
    store = tmp_path / "cache"
    assert tk.prime(process(tree), store, in_child=child(fork)) == "hashed"
    old = json.loads((store / tk.FILE).read_text())["key"]
    CHANGES[change](tree)
    later = process(tree)
    assert tk.prime(later, store, in_child=child(fork)) == "hashed" and len(later.CALLS) == (0 if fork else 1)
    new = fresh_hash(tree)
    assert later.triton_key() == new != old
    again = process(tree)  # and the store now holds the new one
    assert tk.prime(again, store) == "stored" and again.triton_key() == new


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"fingerprint": "x", "key": "k"}', ""])
def test_a_broken_store_costs_the_hash_and_is_rewritten(tree, tmp_path, content):
    store = tmp_path / "cache"
    store.mkdir()
    (store / tk.FILE).write_text(content)
    module = process(tree)
    assert tk.prime(module, store) == "hashed" and module.triton_key() == fresh_hash(tree)
    assert tk.prime(process(tree), store) == "stored"


def test_a_stored_key_of_the_wrong_type_is_not_taken(tree, tmp_path):
    store = tmp_path / "cache"
    assert tk.prime(process(tree), store) == "hashed"
    saved = json.loads((store / tk.FILE).read_text())
    (store / tk.FILE).write_text(json.dumps({**saved, "key": 7}))
    module = process(tree)
    assert tk.prime(module, store) == "hashed" and module.triton_key() == fresh_hash(tree)


def test_an_unwritable_store_costs_only_the_hash(tree, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    module = process(tree)
    assert tk.prime(module, blocker / "cache") == "hashed" and module.triton_key() == fresh_hash(tree)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "site"]  # nothing left behind


def test_a_key_function_without_source_is_hashed_by_triton_itself(tree, tmp_path):
    module = process(tree)
    calls = []
    module.triton_key = functools.lru_cache()(eval("lambda: calls.append(1) or 'k'", {"calls": calls}))
    assert tk.prime(module, tmp_path / "cache") == "hashed" and calls == [1]  # inspect finds no source
    assert module.triton_key() == "k" and not (tmp_path / "cache").exists()


PRIME = "from engine import fork_compile; s, how = fork_compile.prime_key(); import triton.runtime.cache as c; " \
        "print(how, c.triton_key(), len(getattr(c, 'CALLS', [])))"


def _prime_in_a_process(pythonpath: str, cache_dir: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": pythonpath, "TRITON_CACHE_DIR": str(cache_dir)}
    out = subprocess.run([sys.executable, "-c", PRIME], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_prime_key_in_two_processes(tree, tmp_path):
    path = f"{tree.parent}{os.pathsep}{REPO}"
    how, key, calls = _prime_in_a_process(path, tmp_path / "cache")
    assert (how, calls) == ("hashed", "0") and key == fresh_hash(tree)  # hashed in a forked child
    assert _prime_in_a_process(path, tmp_path / "cache") == ["stored", key, "0"]
    assert _prime_in_a_process(path, tmp_path / "other") == ["hashed", key, "0"]  # another cache: its own store


def test_prime_key_without_triton(tmp_path):
    (tmp_path / "triton.py").write_text("raise ImportError('no triton here')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    out = subprocess.run([sys.executable, "-c", "from engine import fork_compile; print(fork_compile.prime_key())"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "(0.0, 'none')", out.stderr


def test_the_real_triton_key_is_stored_and_read_back(tmp_path):
    pytest.importorskip("triton")  # where Triton is installed (CI installs it): the real tree and key function
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)
    how, key, _ = _prime_in_a_process(path, tmp_path / "cache")
    assert how == "hashed"
    assert _prime_in_a_process(path, tmp_path / "cache")[:2] == ["stored", key]
    env = {**os.environ, "PYTHONPATH": path}
    plain = subprocess.run([sys.executable, "-c", "from triton.runtime.cache import triton_key; print(triton_key())"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert plain.stdout.strip() == key


def test_a_child_that_fails_or_hangs_costs_only_the_hash_here(tree, tmp_path, monkeypatch):
    for broken in ("raise RuntimeError('boom')", "os._exit(3)", "time.sleep(30)"):
        module = process(tree)
        original = module.triton_key
        here = []

        def key_fn(broken=broken, original=original):
            if os.getpid() != parent:  # only in the child: it fails, or outlives the timeout
                exec(broken, {"os": os, "time": __import__("time")})
            here.append(1)
            return original()

        parent = os.getpid()
        module.triton_key = functools.lru_cache()(key_fn)
        monkeypatch.setattr(tk, "CHILD_TIMEOUT_S", 2.0)
        monkeypatch.setattr(tk, "fingerprint", lambda cache: "mark")  # key_fn has no Triton-shaped source
        assert tk.prime(module, tmp_path / broken[:5], in_child=fork_compile.value_in_child) == "hashed"
        assert here == [1] and module.triton_key() == fresh_hash(tree)  # hashed here, once, after the child
    assert fork_compile.value_in_child(lambda: "k" * 100_000, 10.0) == "k" * 100_000  # past a pipe's buffer
    assert fork_compile.value_in_child(lambda: "", 10.0) == ""
