"""The host cost of an eager mixed step: N decode rows beside C prefill chunks of k tokens each.

A ModelExecutor over a random checkpoint runs hand-built StepPlans (no scheduler): N requests decode one
token each (full depth, a ShallowWork through loops 1..T; on CUDA the decode call replays its graph) while
C requests prefill one chunk of k tokens, fresh (from position 0) or after a history of --history tokens
already in the pool (the prefill-with-history path: the paged kernel up to 64 rows on CUDA, gathered
history + SDPA past that); ragged / ragged_history: the C chunks have lengths k, k - 1, ..., k - C + 1 (as
in serving, where no two chunks of a step are alike; equal-length fresh chunks share one SDPA call). The
prefill call is eager, so what its host does per layer pass is what this measures. Per row (kind, C, k),
after --warmup untimed steps, --reps timed ones:

- launch_ms: executor.launch(plan) (the host queueing the step; on the CPU it also computes it), step_ms:
  launch + result() (the device synchronized before each step);
- ops / compute_ops: aten ops the step dispatches (TorchDispatchMode, one untimed step), all and without
  the view ops (what runs a kernel or allocates); top_ops: the most frequent;
- on CUDA, launches (cudaLaunchKernel / cuLaunchKernel(Ex) calls under torch.profiler: the Triton and ATen
  kernels; a graph replay counts once) and syncs (calls that synchronize, torch.cuda.set_sync_debug_mode);
- tokens / logprobs: what the step sampled (greedy), so two runs (before / after an engine change) can be
  compared for identical outputs (--compare OLD.json exits 1 on any difference).

    python benchmarks/mixed_host.py --out /tmp/mh                                   # CPU, 4 layers, hidden 256
    python benchmarks/mixed_host.py --device cuda --dtype bfloat16 --shape 1.4b --ns 64 \\
        --ks 64,256,512,1024,2048 --chunks 1,4,10 --history 1024 --out results/mixed_host   # the H200

Output: mixed_host.json (meta, one entry per row) and a table on stdout.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.executor import ModelExecutor  # noqa: E402
from engine.kv_cache import KVPool  # noqa: E402
from engine.loader import load_model  # noqa: E402
from ourobatch.testing import make_tiny_checkpoint  # noqa: E402
from scheduler.params import SamplingParams  # noqa: E402
from scheduler.plan import PrefillWork, SampleSpec, ShallowWork, StepPlan  # noqa: E402

SHAPES = {
    "small": dict(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, total_ut_steps=4),
    "tiny": dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, total_ut_steps=3),
    "1.4b": dict(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=16, head_dim=128, rope_theta=1e6,
                 max_position_embeddings=65536, total_ut_steps=4),
}
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
KINDS = ("fresh", "history", "ragged", "ragged_history")
GREEDY = SamplingParams(temperature=0.0, seed=0)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it (by overload packet), and which of them are views."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        self.views += bool(getattr(func, "is_view", False))
        return func(*args, **(kwargs or {}))


class Rig:
    """One executor over one model; N decoding requests (prefilled once) and the chunk requests of a row."""

    def __init__(self, args: Any, model_dir: str) -> None:
        self.args, self.device = args, torch.device(args.device)
        dtype = getattr(torch, args.dtype)
        model = load_model(model_dir, dtype, self.device)
        model.fuse_projections()
        self.T = model.config.total_ut_steps
        self.model = model
        bs = args.block_size
        self.per = math.ceil((max(args.history, args.decode_prompt) + max(args.ks) + 1) / bs)
        self.slots = max(args.ns) + max(args.chunks) + 1
        pool = KVPool.for_model(model.config, self.slots * self.per, bs, dtype, self.device)
        self.executor = ModelExecutor(model, pool, self.device, logprobs_mode="processed",
                                      max_num_seqs=self.slots + 1, max_blocks_per_seq=self.per)
        self.step_id = 0
        self.released: tuple[str, ...] = ()
        self.vocab = model.config.vocab_size

    def blocks(self, slot: int, length: int) -> tuple[int, ...]:
        return tuple(range(slot * self.per, slot * self.per + math.ceil(length / self.args.block_size)))

    def tokens(self, n: int, salt: int) -> tuple[int, ...]:
        return tuple((7 * i + 3 * salt + 1) % self.vocab for i in range(n))

    def run(self, prefills=(), shallow=()) -> tuple[Any, float, float]:
        """One step; returns its result, launch ms and step ms."""
        self.step_id += 1
        plan = StepPlan(self.step_id, tuple(prefills), tuple(shallow), (), self.released)
        self.released = ()
        self.sync()
        t0 = time.perf_counter()
        pending = self.executor.launch(plan)
        t1 = time.perf_counter()
        result = pending.result()
        t2 = time.perf_counter()
        if result.failures:
            raise RuntimeError(f"step failed: {result.failures}")
        return result, (t1 - t0) * 1e3, (t2 - t0) * 1e3

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def decoders(self, N: int) -> list[ShallowWork]:
        """N requests with a prompt of --decode-prompt tokens in the pool, each fed one token at its end."""
        P = self.args.decode_prompt
        ids = [f"d{i}" for i in range(N)]
        self.run([PrefillWork(rid, self.tokens(P, i), 0, self.blocks(i, P + 1), None) for i, rid in enumerate(ids)])
        spec = SampleSpec(self.T, 2, GREEDY)
        return [ShallowWork(rid, 5, P, self.blocks(i, P + 1), self.T, False, spec) for i, rid in enumerate(ids)]

    def chunks(self, N: int, C: int, k: int, history: int, tag: str, ragged: bool = False) -> list[PrefillWork]:
        """C chunk requests of k tokens (ragged: k - j for chunk j, every length different) from position
        `history` (whose KV is written here first)."""
        ids = [(N + j, f"{tag}-c{j}") for j in range(C)]
        if history:
            self.run([PrefillWork(rid, self.tokens(history, s), 0, self.blocks(s, history + k), None)
                      for s, rid in ids])
        spec = SampleSpec(self.T, 1, GREEDY)
        lens = [max(1, k - j) if ragged else k for j in range(C)]
        return [PrefillWork(rid, self.tokens(n, s + 11), history, self.blocks(s, history + n), spec)
                for (s, rid), n in zip(ids, lens)]


def count_ops(rig: Rig, prefills, shallow) -> dict:
    counter = OpCounter()
    with counter:
        rig.run(prefills, shallow)
    total = sum(counter.ops.values())
    return dict(ops=total, compute_ops=total - counter.views, top_ops=dict(counter.ops.most_common(12)))


def count_launches(rig: Rig, prefills, shallow) -> dict:
    """CUDA only: kernel launches under the profiler, synchronizing calls under the sync debug mode."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        rig.run(prefills, shallow)
    launches = sum(e.count for e in prof.key_averages() if e.key in LAUNCHES)
    rig.step_id += 1
    plan = StepPlan(rig.step_id, tuple(prefills), tuple(shallow))
    rig.sync()
    torch.cuda.set_sync_debug_mode("warn")
    try:  # the launch only: the result's readback synchronizes by design
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pending = rig.executor.launch(plan)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    pending.result()
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return dict(launches=launches, syncs=syncs)


def measure_row(rig: Rig, N: int, C: int, k: int, kind: str, decode: list[ShallowWork]) -> dict:
    args = rig.args
    tag = f"{kind}{C}x{k}"
    history = args.history if kind.endswith("history") else 0
    prefills = rig.chunks(N, C, k, history, tag, kind.startswith("ragged")) if C else []
    for _ in range(args.warmup):
        rig.run(prefills, decode)
    launch, step, sampled = [], [], None
    for _ in range(args.reps):
        result, l_ms, s_ms = rig.run(prefills, decode)
        launch.append(l_ms)
        step.append(s_ms)
        sampled = sorted(result.sampled, key=lambda t: t.request_id)
    row = dict(kind=kind, N=N, chunks=C, k=k, prefill_tokens=sum(len(p.token_ids) for p in prefills), history=history,
               launch_ms=statistics.median(launch), step_ms=statistics.median(step), launch_samples=launch,
               step_samples=step, tokens={t.request_id: t.token_id for t in sampled},
               logprobs={t.request_id: t.logprob for t in sampled}, **count_ops(rig, prefills, decode))
    if rig.device.type == "cuda":
        row.update(count_launches(rig, prefills, decode))
    rig.released = tuple(p.request_id for p in prefills)
    return row


def table(rows: list[dict]) -> str:
    cuda = any("launches" in r for r in rows)
    head = (["kind", "N", "C", "k", "launch ms", "step ms", "ops", "compute ops"]
            + (["launches", "syncs"] if cuda else []))
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        cells = [r["kind"], r["N"], r["chunks"], r["k"], f"{r['launch_ms']:.2f}", f"{r['step_ms']:.2f}", r["ops"],
                 r["compute_ops"]] + ([r.get("launches"), r.get("syncs")] if cuda else [])
        lines.append(" | ".join(map(str, cells)))
    return "\n".join(lines)


def compare(rows: list[dict], old_path: str) -> list[str]:
    """Rows whose sampled tokens or log-probs differ from an earlier run's (same arguments)."""
    old = {(r["kind"], r["N"], r["chunks"], r["k"]): r for r in json.loads(Path(old_path).read_text())["rows"]}
    diffs = []
    for r in rows:
        o = old.get((r["kind"], r["N"], r["chunks"], r["k"]))
        if o is not None and (o["tokens"] != r["tokens"] or o["logprobs"] != r["logprobs"]):
            diffs.append(f"{r['kind']} N={r['N']} C={r['chunks']} k={r['k']}")
    return diffs


def parse_ints(text: str, flag: str, low: int) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if any(v < low for v in values):
        raise ValueError(f"{flag} takes integers >= {low}, got {text!r}")
    return values


def parse_args(argv: list[str] | None) -> Any:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES), help="the random checkpoint's shape")
    ap.add_argument("--model", help="a checkpoint folder instead of a random one")
    ap.add_argument("--workdir", default="/tmp/ourobatch-mixed-host", help="where the random checkpoint is written")
    ap.add_argument("--ns", default="16", help="decoding rows per step (comma-separated)")
    ap.add_argument("--ks", default="64,256,1024", help="tokens per prefill chunk")
    ap.add_argument("--chunks", default="1,4", help="prefill chunks per step")
    ap.add_argument("--kinds", default="fresh,history,ragged",
                    help="of " + ", ".join(KINDS) + " (ragged: the C chunks have C different lengths)")
    ap.add_argument("--history", type=int, default=512, help="tokens before a history chunk")
    ap.add_argument("--decode-prompt", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compare", help="an earlier mixed_host.json: exit 1 when a row's tokens or log-probs differ")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        args.ns, args.ks = parse_ints(args.ns, "--ns", 1), parse_ints(args.ks, "--ks", 1)
        args.chunks = parse_ints(args.chunks, "--chunks", 1)
        args.kinds = args.kinds.split(",")
        bad = [k for k in args.kinds if k not in KINDS]
        if bad:
            raise ValueError(f"--kinds takes some of {', '.join(KINDS)}, got {bad}")
        if args.history < 1 or args.history % args.block_size:
            raise ValueError(f"--history must be a positive multiple of --block-size ({args.block_size}), "
                             f"got {args.history}")
    except ValueError as exc:
        ap.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        model_dir = str(Path(args.workdir) / args.shape)
        if not (Path(model_dir) / "config.json").exists():
            make_tiny_checkpoint(model_dir, seed=0, eos_token_id=None, **SHAPES[args.shape])
    torch.manual_seed(0)
    rig = Rig(args, model_dir)
    rows = []
    with torch.inference_mode():
        for N in args.ns:
            decode = rig.decoders(N)
            rows.append(measure_row(rig, N, 0, 0, "decode", decode))
            for kind in args.kinds:
                for C in args.chunks:
                    for k in args.ks:
                        if kind.startswith("ragged") and C == 1:
                            continue  # one chunk: the same as fresh / history
                        rows.append(measure_row(rig, N, C, k, kind, decode))
            rig.released = tuple(w.request_id for w in decode)
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), torch=torch.__version__,
                python=platform.python_version(), device=args.device, dtype=args.dtype, model=model_dir,
                shape=args.shape if args.model is None else None, layers=rig.model.config.num_hidden_layers,
                loops=rig.T, attention=rig.executor.attention, cuda_graphs=rig.executor.graphs is not None,
                block_size=args.block_size, warmup=args.warmup, reps=args.reps,
                torch_threads=torch.get_num_threads())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mixed_host.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(table(rows))
    if args.compare:
        diffs = compare(rows, args.compare)
        print("outputs identical to " + args.compare if not diffs else f"outputs differ: {diffs}")
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
