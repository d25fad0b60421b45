"""The checkpoint load, side by side: the engine's reads (engine/weight_stream.py) against copies out of
safetensors' memory map (the loader before session 22), alone and beside what an engine start runs next
to it.

Each repeat loads the whole checkpoint once per path (in turn, so the page cache is warm for both: the
file was read before the first timed load), on `--device`, under each `--contention`:

- none: nothing else runs;
- gil: `--threads` Python threads that hold the GIL as much as they can (a second process's kernel pass
  loads its cached kernels in 14 threads, mostly Python);
- forks: one thread that forks children which exit at once, back to back (a cold start's kernel pass
  forks ~50 compile children; a fork holds the parent's mmap lock for writing while it copies the page
  tables, and a page fault of the mapped copy waits for it).

Output: weight_load.json (every load's seconds and GB/s) and weight_load.md (the median per path and
contention, and mapped / read).

    python benchmarks/weight_load.py --out results/load                                   # H200: Ouro-1.4B shape
    python benchmarks/weight_load.py --device cpu --tiny --repeats 2 --out /tmp/load      # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from throughput import ensure_checkpoint  # noqa: E402

from engine.config import OuroConfig  # noqa: E402
from engine.loader import checkpoint_files, load_state_dict  # noqa: E402

STAGE = 64 << 20


def load_mapped(path: str, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """The loader before session 22: each tensor a view of safetensors' map, copied through two pinned
    buffers on CUDA (each 64 MiB piece: one host copy, one queued device copy, an event), converted where
    it lands, a queued aminmax each, one sync at the end."""
    buffers = [torch.empty(STAGE, dtype=torch.uint8, pin_memory=device.type == "cuda") for _ in range(2)]
    events: list = [None, None]
    turn, out, ends = 0, {}, []
    by_file: dict[Path, list[str]] = {}
    for name, file in checkpoint_files(Path(path)).items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in names:
                t = f.get_tensor(name)
                dst = torch.empty(t.shape, dtype=t.dtype, device=device)
                s, d = t.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
                for start in range(0, s.numel(), STAGE):
                    if events[turn] is not None:
                        events[turn].synchronize()
                    n = min(STAGE, s.numel() - start)
                    buffers[turn][:n].copy_(s[start:start + n])
                    d[start:start + n].copy_(buffers[turn][:n], non_blocking=True)
                    if device.type == "cuda":
                        events[turn] = torch.cuda.Event()
                        events[turn].record()
                    turn = 1 - turn
                out[name] = dst if dst.dtype == dtype else dst.to(dtype)
                if out[name].numel():
                    ends.append(torch.stack(torch.aminmax(out[name])))
    assert bool(torch.isfinite(torch.stack(ends)).all())
    return out


def load_read(path: str, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    return load_state_dict(path, OuroConfig.from_checkpoint(path), dtype, device)


@contextmanager
def contention(kind: str, threads: int):
    """Run `kind`'s background load while the body runs (module docstring)."""
    stop = threading.Event()
    work = {"none": [], "gil": [_gil_hog] * threads, "forks": [_forker]}[kind]
    started = [threading.Thread(target=fn, args=(stop,), daemon=True) for fn in work]
    for t in started:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in started:
            t.join()


def _gil_hog(stop: threading.Event) -> None:
    blob = {str(i): list(range(20)) for i in range(200)}
    while not stop.is_set():
        json.loads(json.dumps(blob))


def _forker(stop: threading.Event) -> None:
    while not stop.is_set():
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)


def timed(fn, path: str, dtype: torch.dtype, device: torch.device) -> float:
    started = time.perf_counter()
    state = fn(path, dtype, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    del state
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return seconds


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: a random one under --workdir)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random checkpoint instead of the Ouro-1.4B shape")
    ap.add_argument("--workdir", default="/tmp/ourobatch_bench")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--contention", default="none,gil,forks")
    ap.add_argument("--threads", type=int, default=14, help="GIL-holding threads of --contention gil")
    ap.add_argument("--out", default="results/weight_load")
    args = ap.parse_args(argv)
    kinds = args.contention.split(",")
    for kind in kinds:
        if kind not in ("none", "gil", "forks"):
            ap.error(f"--contention: {kind!r} is not one of none, gil, forks")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    path, device, dtype = ensure_checkpoint(args), torch.device(args.device), getattr(torch, args.dtype)
    size = sum(f.stat().st_size for f in set(checkpoint_files(Path(path)).values()))
    paths = {"read": load_read, "mapped": load_mapped}
    timed(load_read, path, dtype, device)  # the page cache, the CUDA context, the allocators: warm for both
    runs = []
    for kind in kinds:
        for repeat in range(args.repeats):
            for name, fn in paths.items():
                with contention(kind, args.threads):
                    seconds = timed(fn, path, dtype, device)
                runs.append(dict(contention=kind, path=name, repeat=repeat, seconds=round(seconds, 4),
                                 gb_per_s=round(size / 1e9 / seconds, 2)))
                print(json.dumps(runs[-1]), flush=True)
    result = dict(device=_device_name(device), model=path, bytes=size, dtype=args.dtype, threads=args.threads,
                  runs=runs, summary=summarize(runs, kinds))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_load.json").write_text(json.dumps(result, indent=1))
    (out / "weight_load.md").write_text(report(result))
    print(report(result))
    return result


def summarize(runs: list[dict], kinds: list[str]) -> list[dict]:
    rows = []
    for kind in kinds:
        med = {p: statistics.median(r["seconds"] for r in runs if r["contention"] == kind and r["path"] == p)
               for p in ("read", "mapped")}
        rows.append(dict(contention=kind, read_s=round(med["read"], 4), mapped_s=round(med["mapped"], 4),
                         mapped_over_read=round(med["mapped"] / med["read"], 2)))
    return rows


def report(result: dict) -> str:
    lines = [f"Checkpoint load on {result['device']}: {result['bytes'] / 1e9:.2f} GB to {result['dtype']}, "
             f"median seconds over the repeats (gil: {result['threads']} threads).", "",
             "| contention | read (engine) s | mapped (before) s | mapped / read |", "|---|---|---|---|"]
    for row in result["summary"]:
        lines.append(f"| {row['contention']} | {row['read_s']} | {row['mapped_s']} | {row['mapped_over_read']}x |")
    return "\n".join(lines) + "\n"


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"


if __name__ == "__main__":
    main()
