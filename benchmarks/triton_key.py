"""What Triton's own key costs a process whose kernels are on disk, with and without the stored key
(engine/triton_key.py). Needs Triton, not a GPU: the engine's three skinny-GEMM kernels are compiled for sm90
(Triton builds the PTX, ptxas the cubin; tests/engine/test_pdl_ptx.py's signatures), two specializations each.

`--processes` fresh processes share one empty Triton cache folder, in turn: the first hashes the key and compiles,
each later one finds the kernels on disk. With `--no-store` the key is hashed in every process, as before
session 23. Each process reports how its key came (`hashed`, `stored`), the seconds to make it known, and each
compile's seconds (a cache hit after the first process).

`--busy N` runs N pure-Python threads while each process makes its key known, as the engine's startup has its
weight load and launch list beside it: a hash in this process then waits for the GIL between its ~700 reads and
digests. The key is hashed in a forked child (the engine's way since session 24) unless `--hash-here`.

Output: triton_key.json and triton_key.md.

    python benchmarks/triton_key.py --out /tmp/key                     # stored (the engine's way)
    python benchmarks/triton_key.py --out /tmp/key_plain --no-store    # hashed in every process
    python benchmarks/triton_key.py --out /tmp/key_busy --no-store --busy 2 [--hash-here]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import json, os, sys, tempfile, time
sys.path.insert(0, {repo!r})
started = time.perf_counter()
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import cache
from engine import fork_compile, triton_key
runner = fork_compile.value_in_child if {fork!r} else None
from tests.engine.test_pdl_ptx import KERNELS, _source
imported = time.perf_counter() - started
import threading
stop = threading.Event()
def spin():
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i
busy = [threading.Thread(target=spin, daemon=True) for _ in range({busy!r})]
for b in busy:
    b.start()
t = time.perf_counter()
if {store!r}:
    how = triton_key.prime(cache, os.environ["TRITON_CACHE_DIR"], in_child=runner)
else:
    with tempfile.TemporaryDirectory() as nowhere:  # an empty store each time: hashed
        how = triton_key.prime(cache, nowhere, in_child=runner)
key_s = time.perf_counter() - t
stop.set()
for b in busy:
    b.join()
compiles = []
for name in sorted(KERNELS):
    for tma in (0, 2):
        t = time.perf_counter()
        triton.compile(_source(name, True, tma), target=GPUTarget("cuda", 90, 32))
        compiles.append(round(time.perf_counter() - t, 4))
print(json.dumps(dict(key=how, key_s=round(key_s, 4), compiles_s=compiles, import_s=round(imported, 3),
                      busy={busy!r}, hashed_in="child" if {fork!r} else "here")))
"""


def run(processes: int, store: bool, busy: int = 0, fork: bool = True) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="ourobatch-triton-key-") as folder:
        env = {**os.environ, "TRITON_CACHE_DIR": folder}
        for process in range(1, processes + 1):
            code = CHILD.format(repo=str(REPO), store=store, busy=busy, fork=fork)
            out = subprocess.run([sys.executable, "-c", code], env=env,
                                 capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                raise RuntimeError(f"process {process} failed:\n{out.stderr[-3000:]}")
            rows.append(dict(process=process, **json.loads(out.stdout.strip().splitlines()[-1])))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(rows: list[dict], store: bool, busy: int = 0, fork: bool = True) -> str:
    lines = [f"Triton's key {'stored (engine/triton_key.py)' if store else 'hashed in every process'}, hashed "
             f"{'in a forked child' if fork else 'in the process'}, {busy} busy Python thread(s) beside it; "
             f"one empty cache folder, processes in turn:", "",
             "| process | key | key s | compiles s (first .. last) | compiles summed s |", "|---|---|---|---|---|"]
    for r in rows:
        c = r["compiles_s"]
        lines.append(f"| {r['process']} | {r['key']} | {r['key_s']:.4f} | {c[0]:.4f} .. {c[-1]:.4f} | {sum(c):.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for triton_key.json and triton_key.md")
    ap.add_argument("--processes", type=int, default=3, help="fresh processes, in turn (>= 2)")
    ap.add_argument("--no-store", action="store_true", help="hash the key in every process (before session 23)")
    ap.add_argument("--busy", type=int, default=0, help="pure-Python threads running beside the key (default 0)")
    ap.add_argument("--hash-here", action="store_true", help="hash in the process, not a forked child (before "
                    "session 24)")
    args = ap.parse_args(argv)
    if args.busy < 0:
        ap.error(f"--busy must be >= 0, got {args.busy}")
    if args.processes < 2:
        ap.error(f"--processes must be >= 2 (one compiles, the next finds the kernels on disk), got {args.processes}")
    try:
        import triton  # noqa: F401
    except ImportError:
        ap.error("needs Triton (pip install triton); no GPU is needed")
    rows = run(args.processes, not args.no_store, args.busy, not args.hash_here)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=time.strftime("%Y-%m-%d"), store=not args.no_store, cpus=os.cpu_count(), busy=args.busy,
                hashed_in="here" if args.hash_here else "child")
    (out / "triton_key.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    md = markdown(rows, not args.no_store, args.busy, not args.hash_here)
    (out / "triton_key.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
