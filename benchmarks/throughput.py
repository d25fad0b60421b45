"""Decode throughput of ourobatch's modes, side by side in one process and one run.

Interval 1 (full depth: `deferred` with deep_interval 1, as in benchmarks/quality.py), `eager` B=4 (same
work, mixed readout: the control), `deferred` B = 2, 4, 8, for each scenario N requests x prompt P x
output M (ignore_eos, temperature 1). Writes an Ouro-1.4B-shaped random-weight checkpoint in the real
HF format unless --model is given. For each run: decode tokens/s, mean wall and GPU time per decode
step (CUDA events around the step's work), host overhead, deep calls and rows, peak memory, and the
ratio to interval 1 of the same scenario. Output: JSON, a markdown table and a PNG plot in --out.

    python benchmarks/throughput.py --out results/            # on a CUDA machine
    python benchmarks/throughput.py --device cpu --tiny --scenarios 4x16x16 --out /tmp/b   # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import random
import re
import sys
import time
from pathlib import Path

import torch

from ourobatch import EngineConfig, SamplingParams
from ourobatch.assembly import build_engine_core, resolve_dtype
from engine.loader import load_model
from ourobatch.testing import make_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance  # noqa: E402

OURO_1_4B = dict(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=16, head_dim=128, rope_theta=1e6,
                 max_position_embeddings=65536, bos_token_id=0, eos_token_id=0)
TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32)
CONFIG_RE = re.compile(r"^(?:interval1|(eager|deferred|verify)(\d+)(?:s(\d+))?)$")
CONFIG_HELP = ("interval1 (full depth: deferred, B = 1), eagerB, deferredB or verifyB, each optionally with sS for "
               "shallow_loops S (default --shallow-loops), e.g. deferred4s3")


def parse_config(name: str, default_s: int) -> tuple[str, int, int]:
    """'deferred4s3' -> ('deferred', 4, 3); 'interval1' -> ('deferred', 1, default_s), as in quality.py."""
    m = CONFIG_RE.match(name)
    if m is None:
        raise ValueError(f"unknown config {name!r}: {CONFIG_HELP}")
    if m.group(1) is None:
        return "deferred", 1, default_s
    return m.group(1), int(m.group(2)), int(m.group(3)) if m.group(3) else default_s


def add_checkpoint_args(ap: argparse.ArgumentParser) -> None:
    """--model / --workdir / --tiny, shared by the benchmarks (see ensure_checkpoint)."""
    ap.add_argument("--model", help="checkpoint folder (default: write a random Ouro-1.4B-shaped one)")
    ap.add_argument("--workdir", default="/tmp/ourobatch-bench", help="where the random checkpoint is written")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model instead of 1.4B (smoke tests)")


def ensure_checkpoint(args) -> str:
    """--model, or the random checkpoint under --workdir (tiny or Ouro-1.4B-shaped), written once."""
    if args.model is not None:
        return args.model
    model_dir = str(Path(args.workdir) / ("tiny" if args.tiny else "ouro-1.4b-random"))
    if not (Path(model_dir) / "config.json").exists():
        t = time.perf_counter()
        make_tiny_checkpoint(model_dir, seed=0, dtype=torch.bfloat16, **(TINY if args.tiny else OURO_1_4B))
        print(f"wrote {model_dir} in {time.perf_counter() - t:.0f}s", file=sys.stderr)
    return model_dir


def check_configs(ap: argparse.ArgumentParser, configs: str, default_s: int) -> list[str]:
    """The comma-separated config names; exits through ap.error on an unknown one."""
    names = configs.split(",")
    for name in names:
        try:
            parse_config(name, default_s)
        except ValueError as exc:
            ap.error(str(exc))
    return names


def step_to_end(core) -> tuple[float, float, int, int, int, float]:
    """Step the core until every request is done: the decode steps' wall and GPU seconds, their count and
    tokens, the most requests in one step and the total seconds."""
    ex = core.executor
    decode_wall = decode_gpu = 0.0
    decode_steps = decode_tokens = max_running = 0
    t_start = time.perf_counter()
    while core.has_unfinished:
        generated = core.scheduler.counters.tokens_generated
        t0 = time.perf_counter()
        plan = core.schedule()
        result = ex.execute(plan)
        core.update(plan, result)
        t1 = time.perf_counter()
        max_running = max(max_running, len(plan.shallow))
        if not plan.prefills and (plan.shallow or plan.deep):
            decode_steps += 1
            decode_wall += t1 - t0
            decode_tokens += core.scheduler.counters.tokens_generated - generated  # verified tokens only
            if ex.timing:
                decode_gpu += ex.timing[-1] / 1e3
    return decode_wall, decode_gpu, decode_steps, decode_tokens, max_running, time.perf_counter() - t_start


def run_one(model_dir: str, model, args, name: str, N: int, P: int, M: int) -> dict:
    mode, B, s = parse_config(name, args.shallow_loops)
    cfg = EngineConfig(model=model_dir, device=args.device, dtype=args.dtype, mode=mode, deep_interval=B,
                       shallow_loops=s, max_num_seqs=N, max_model_len=P + M,
                       max_num_batched_tokens=max(8192, 8 * P), gpu_memory_utilization=args.gpu_memory_utilization)
    core = build_engine_core(cfg, model=model)
    ex = core.executor
    rng = random.Random(0)
    vocab = core.scheduler.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(P)] for _ in range(N)]
    # warm-up: capture the graphs of this batch size (shallow and deep calls), compile kernels
    for i, p in enumerate(prompts):
        core.add(p, SamplingParams(max_tokens=min(M, 2 * B + 2), seed=10_000 + i, ignore_eos=True))
    while core.has_unfinished:
        core.step()
    for i, p in enumerate(prompts):
        core.add(p, SamplingParams(max_tokens=M, temperature=args.temperature, seed=i, ignore_eos=True))
    ex.timing = [] if args.device.startswith("cuda") else None
    before = dict(core.stats())
    decode_wall, decode_gpu, decode_steps, decode_tokens, max_running, total = step_to_end(core)
    after = core.stats()
    row = dict(
        config=name, mode=mode, deep_interval=B, shallow_loops=s, N=N, prompt=P, output=M,
        decode_tokens=decode_tokens, decode_steps=decode_steps, decode_seconds=decode_wall,
        decode_tokens_per_s=decode_tokens / decode_wall if decode_wall else 0.0,
        wall_ms_per_step=1e3 * decode_wall / max(decode_steps, 1),
        gpu_ms_per_step=1e3 * decode_gpu / max(decode_steps, 1) if ex.timing is not None else None,
        deep_calls=after["deep_calls"] - before["deep_calls"], deep_rows=after["deep_rows"] - before["deep_rows"],
        max_concurrent=max_running, kv_capacity_tokens=after["kv_capacity_tokens"], total_seconds=total,
        peak_memory_gib=after.get("peak_memory_bytes", 0) / 2**30,
        graph_captures=ex.graphs.num_captures if ex.graphs is not None else 0,
    )
    drafted = after["drafted_tokens"] - before["drafted_tokens"]
    if mode == "verify":
        accepted = after["accepted_tokens"] - before["accepted_tokens"]
        row["acceptance_rate"] = accepted / max(drafted, 1)  # share of all drafts kept
        # per-position acceptance probability: the a of E = (1 - a^B) / (1 - a) (docs/benchmarks.md)
        row["acceptance_per_position"] = accepted / max(after["tested_drafts"] - before["tested_drafts"], 1)
    if row["gpu_ms_per_step"] is not None:
        row["host_overhead_pct"] = 100 * (1 - row["gpu_ms_per_step"] / row["wall_ms_per_step"])
    del core, ex
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Measured {meta['date']} on {meta['device_name']}, commit {meta['commit']}, torch {meta['torch']}, "
             f"{meta['dtype']}, temperature {meta['temperature']}.", "",
             "| N | prompt | output | config | tok/s | x interval 1 | wall ms/step | GPU ms/step | host % | "
             "deep calls | deep rows | max conc. | peak GiB | accepted (all / per position) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gpu = f"{r['gpu_ms_per_step']:.2f}" if r.get("gpu_ms_per_step") is not None else "-"
        host = f"{r['host_overhead_pct']:.1f}" if r.get("host_overhead_pct") is not None else "-"
        lines.append(f"| {r['N']} | {r['prompt']} | {r['output']} | {r['config']} | {r['decode_tokens_per_s']:.0f} | "
                     f"{r.get('ratio', float('nan')):.2f} | {r['wall_ms_per_step']:.2f} | {gpu} | {host} | "
                     f"{r['deep_calls']} | {r['deep_rows']} | {r['max_concurrent']} | {r['peak_memory_gib']:.1f} | "
                     + (f"{r['acceptance_rate']:.2f} / {r['acceptance_per_position']:.2f} |"
                        if "acceptance_rate" in r else "- |"))
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    scen = sorted({(r["N"], r["prompt"]) for r in rows})
    names = list(dict.fromkeys(r["config"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ys = [next((r.get("ratio", 0) for r in rows if r["config"] == name and (r["N"], r["prompt"]) == s), 0)
              for s in scen]
        ax.bar([j + i * width for j in range(len(scen))], ys, width, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(scen))], [f"N={n}, P={p}" for n, p in scen])
    ax.set_ylabel("decode tokens/s relative to interval 1")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(ap)
    ap.add_argument("--out", required=True, help="folder for results.json, results.md, ratios.png")
    ap.add_argument("--scenarios", default="8x512x512,64x512x512,256x512x512,64x3584x512",
                    help="comma-separated NxPROMPTxOUTPUT")
    ap.add_argument("--configs", default="interval1,eager4,deferred2,deferred4,deferred8",
                    help=f"comma-separated: {CONFIG_HELP}")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shallow-loops", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--branch-scale", type=float, default=1.0,
                    help="multiply every layer's branch-output norm weights (input_layernorm_2, "
                         "post_attention_layernorm_2) by this after loading and set model.norm's weight to 1. A "
                         "speed-only knob for verify: with a small scale consecutive loops' readouts nearly agree, "
                         "so random weights reach a high acceptance rate; every kernel and shape, hence the cost "
                         "of a step, is unchanged")
    args = ap.parse_args(argv)
    if not args.branch_scale > 0:
        ap.error(f"--branch-scale must be > 0, got {args.branch_scale}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = check_configs(ap, args.configs, args.shallow_loops)
    scenarios = [tuple(int(x) for x in s.split("x")) for s in args.scenarios.split(",")]
    model_dir = ensure_checkpoint(args)
    dtype = resolve_dtype(EngineConfig(model=model_dir, device=args.device, dtype=args.dtype))
    model = load_model(model_dir, dtype, args.device)
    if args.branch_scale != 1.0:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.input_layernorm_2.weight.mul_(args.branch_scale)
                layer.post_attention_layernorm_2.weight.mul_(args.branch_scale)
            model.model.norm.weight.fill_(1.0)  # else every loop multiplies the state by it once more
    model.fuse_projections()
    meta = dict(date=datetime.date.today().isoformat(), device=args.device, dtype=args.dtype,
                branch_scale=args.branch_scale,
                device_name=torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
                torch=torch.__version__, temperature=args.temperature,
                commit=provenance.commit())
    rows = []
    for N, P, M in scenarios:
        base = None
        for name in names:
            row = run_one(model_dir, model, args, name, N, P, M)
            if name == "interval1":
                base = row["decode_tokens_per_s"]
            if base:
                row["ratio"] = row["decode_tokens_per_s"] / base
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (out / "results.md").write_text(markdown(rows, meta))
    plot(rows, out / "ratios.png")
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
