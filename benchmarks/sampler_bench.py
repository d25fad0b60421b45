"""The sampler's fast path (engine/triton_sampler.py) alone: microseconds per call at several row counts,
captured in a CUDA graph of back-to-back calls (as a decode step runs it; gemm_sweep.timed), Ouro's
vocabulary, temperature 1. A call is what the readout runs: the kernels and the logits' finite flags (readout_pass:
a torch.isfinite pass beside a revision whose kernels do not return them).
With ``--against REV`` the same file at git revision REV (or a .py file) runs beside it, in turn (A, B, A, B), with the
share of rows where the two drew the same token.

    python benchmarks/sampler_bench.py --out DIR [--rows 8,64,256] [--against 9e1f2a0~1]
    TRITON_INTERPRET=1 python benchmarks/sampler_bench.py --out DIR --smoke      # CPU, seconds

Beside it, the torch path's race (rows with top-k / top-p / min-p or top log-probs; engine/sampler.race) on
processed log-probs of the same rows: the torch race (counter uniforms, float64 keys) against the fast
path's kernels at temperature 1, and processed_logprobs itself (top-k 50, top-p 0.95; eager, CUDA events:
its host copies are not graph-safe), with the share of rows where the two races drew the same token.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from engine import sampler, triton_sampler  # noqa: E402
from scheduler.params import SamplingParams  # noqa: E402
from gemm_sweep import COPIES, timed  # noqa: E402  (graph-replayed timing of COPIES back-to-back calls)


def sampler_at(rev: str):
    """engine/triton_sampler.py as of git revision `rev` (or the .py file at that path: a device copy may carry
    no git history), imported as a module of its own."""
    if rev.endswith(".py") and Path(rev).is_file():
        src = Path(rev).read_text()
    else:
        src = subprocess.run(["git", "show", f"{rev}:engine/triton_sampler.py"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "sampler_at_rev.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"sampler_at_{abs(hash(rev))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def inputs(rows: int, vocab: int, device: str) -> tuple:
    g = torch.Generator(device=device).manual_seed(rows)
    logits = (torch.randn(rows, vocab, generator=g, device=device) * 3).to(torch.bfloat16)
    return (logits, torch.ones(rows, device=device), torch.arange(rows, device=device) * 7919,
            torch.arange(rows, device=device) + 1, torch.zeros(rows, dtype=torch.bool, device=device))


def eager_us(fn, calls: int = 20) -> float:
    """us per call of fn, CUDA events around `calls` calls after one warm-up call."""
    fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / calls


def readout_pass(mod, x: tuple) -> tuple:
    """What engine/readout.launch_sample runs for fast-path rows: sample_plain, and the logits' finite flags
    (from the kernels since they return them; before, a torch.isfinite(...).all(-1) pass of its own)."""
    out = mod.sample_plain(*x)
    return out if len(out) == 3 else (*out, torch.isfinite(x[0]).all(-1))


def processed_path(x: tuple, smoke: bool) -> dict:
    """sampler.race both ways on processed log-probs of these logits (top-k 50, top-p 0.95), and the
    processed_logprobs pass before it."""
    logits, _, seeds, counters, greedy = x
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=int(s)) for s in seeds.tolist()]
    js = counters.tolist()
    lp = sampler.processed_logprobs(logits, params, js)
    torch_race = sampler.race(lp, greedy, seeds, counters)
    kernel_race = sampler.race(lp, greedy, seeds, counters, triton_kernel=True)
    result = dict(same_tokens=float((torch_race == kernel_race).float().mean()))
    if not smoke:
        result["us"] = dict(
            race_torch=timed(lambda: [sampler.race(lp, greedy, seeds, counters) for _ in range(COPIES)]),
            race_kernels=timed(lambda: [sampler.race(lp, greedy, seeds, counters, triton_kernel=True)
                                        for _ in range(COPIES)]),
            processed_logprobs_eager=eager_us(lambda: sampler.processed_logprobs(logits, params, js)))
        topk_max, sampler.TOPK_MAX = sampler.TOPK_MAX, 0  # top-k's threshold from a full sort, as before
        try:
            result["us"]["processed_logprobs_full_sort_eager"] = eager_us(
                lambda: sampler.processed_logprobs(logits, params, js))
        finally:
            sampler.TOPK_MAX = topk_max
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="8,64,256")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--against", default=None,
                    help="a git revision (or a .py file) whose triton_sampler.py runs beside this one")
    ap.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): tokens only, no timing")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.smoke else "cuda"
    samplers = {"this": triton_sampler} | ({args.against: sampler_at(args.against)} if args.against else {})
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        x = inputs(rows, args.vocab, device)
        tokens = {name: mod.sample_plain(*x)[0] for name, mod in samplers.items()}
        row = dict(rows=rows, vocab=args.vocab, us={})
        if args.against:
            row["same_tokens"] = float((tokens["this"] == tokens[args.against]).float().mean())
        for turn in ("", "#2") if not args.smoke else ():
            for name, mod in samplers.items():
                row["us"][name + turn] = timed(lambda mod=mod: [readout_pass(mod, x) for _ in range(COPIES)])
        row["processed"] = processed_path(x, args.smoke)
        results.append(row)
        print(json.dumps(row), flush=True)
    (out / "sampler_bench.json").write_text(json.dumps(dict(device=device, against=args.against, results=results),
                                                       indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
