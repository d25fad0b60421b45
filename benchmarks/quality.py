"""Quality harness: accuracy, agreement with full depth and readout divergence of every mode, on a checkpoint.

    python benchmarks/quality.py --model DIR --tasks tasks.jsonl --out results/ [--device cuda] [--limit 200]

`--tasks` is JSONL, one task a line: {"prompt_token_ids": [...], "target_token_ids": [...]}. Every
configuration generates for every task (one SyncEngine per configuration, all sharing one loaded model)
and is scored on:

- accuracy: a completion is correct iff its generated tokens, without a trailing eos/stop token
  (finish_reason "stop"), equal target_token_ids exactly. Reported with a 95% Wilson score interval
  (z = 1.96), which stays inside [0, 1] and behaves at accuracy 0 or 1 and for few tasks.
- agreement with interval 1 (full-depth decoding, always run first as the reference): `agree_exact` is
  the fraction of tasks whose generated token ids equal interval 1's exactly; `agree_prefix` is the mean
  over tasks of (length of the common leading run) / max(both lengths), which is 1 iff they are equal.
  With temperature 0 this is greedy agreement; with temperature > 0 both use the same per-task seed.
- KL: for generated token j read from loop r_j (CompletionOutput.readout_loops) at position
  len(prompt) + j - 2 of prompt + generated[:-1], KL(softmax(loop-T logits) || softmax(loop-r_j logits)),
  from a dense no-cache recomputation of every loop over the sequence with the served model's modules
  (raw logits, no temperature; float64 softmax). It measures how far the distribution a token was read
  from is from the full-depth one at the same prefix. Tokens read from loop T contribute exactly 0.
  `kl_all` is the mean over all generated tokens, `kl_shallow` the mean over tokens not read from loop T.
- loop_fractions: the fraction of generated tokens read from each loop.
- acceptance_rate (verify): stats()["accepted_tokens"] / stats()["drafted_tokens"] of the measured call,
  the share of all drafts kept; acceptance_per_position: accepted / stats()["tested_drafts"], the
  probability that a draft the test reaches is accepted (drafts after a rejection are never tested).
- throughput: generated tokens / wall seconds of the whole generate_batch call (prefill included), and
  its ratio to interval 1 in the same run. On CPU (and for small task sets anywhere) indicative only;
  benchmarks/throughput.py is the throughput benchmark.

Configurations (`--configs`, comma-separated): interval1 (deferred, B = 1), eagerB, deferredB, verifyB,
each optionally with sS for shallow_loops S (default min(2, T - 1)), e.g. deferred4s1. Output in --out:
results.json (meta + one row per configuration), results.md (a table), pareto.png (accuracy vs throughput
ratio, 95% CI error bars) and completions.jsonl (every completion, for inspection).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is a folder of scripts, not a package
from bench_plot import accuracy_plot  # noqa: E402

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.assembly import resolve_dtype
from engine.config import OuroConfig
from engine.loader import load_model
from engine.model import OuroForCausalLM

Z95 = 1.959963984540054
DEFAULT_CONFIGS = ("interval1,eager4," + ",".join(f"deferred{b}s{s}" for b in (2, 4, 8) for s in (1, 2, 3))
                   + ",verify4")
CONFIG_RE = re.compile(r"^(?:interval1|(eager|deferred|verify)(\d+)(?:s(\d+))?)$")
CPU_NOTE = "throughput on CPU is indicative only"


# ---------------------------------------------------------------------------------------------- metrics

def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion; (0, 1) for n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # the interval always contains p (its score statistic is 0 there); min/max only undo rounding at 0 and 1
    return min(p, max(0.0, center - half)), max(p, min(1.0, center + half))


def strip_stop(token_ids: Sequence[int], finish_reason: str | None) -> list[int]:
    """Generated tokens without the trailing eos/stop token (kept in the output when finish_reason == 'stop')."""
    toks = list(token_ids)
    return toks[:-1] if finish_reason == "stop" and toks else toks


def prefix_fraction(a: Sequence[int], b: Sequence[int]) -> float:
    """Length of the common leading run of a and b over the longer length (1.0 for two empty lists)."""
    n = max(len(a), len(b))
    if n == 0:
        return 1.0
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k / n


@torch.inference_mode()
def dense_loop_readouts(model: OuroForCausalLM, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """Every loop's normed readout at `positions` of `token_ids`: [T, len(positions), hidden].

    The model's no-cache forward (OuroForCausalLM.dense_loops: causal attention over the whole sequence in
    every layer of every loop, the math of tests/oracle.py, in the model's dtype)."""
    device = model.lm_head.weight.device
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64, device=device)[None]
    keep = torch.as_tensor(list(positions), dtype=torch.int64, device=device)
    return torch.stack([h[0].index_select(0, keep) for h in model.dense_loops(ids)])


@torch.inference_mode()
def completion_kl(model: OuroForCausalLM, prompt: Sequence[int], token_ids: Sequence[int],
                  readout_loops: Sequence[int], chunk: int = 64) -> list[float]:
    """KL(softmax(loop T) || softmax(loop r_j)) for each generated token j (0.0 where r_j == T)."""
    T = model.config.total_ut_steps
    kl = [0.0] * len(token_ids)
    shallow = [j for j, r in enumerate(readout_loops) if r != T]  # 0-based j: token j+1
    if not shallow:
        return kl
    P = len(prompt)
    seq = list(prompt) + list(token_ids[:-1])
    readouts = dense_loop_readouts(model, seq, [P + j - 1 for j in shallow])  # position P + (j+1) - 2
    for c in range(0, len(shallow), chunk):
        idx = shallow[c:c + chunk]
        rows = torch.arange(c, c + len(idx), device=readouts.device)
        loops = torch.as_tensor([readout_loops[j] - 1 for j in idx], device=readouts.device)
        log_t = torch.log_softmax(model.logits(readouts[T - 1, rows]).double(), dim=-1)
        log_r = torch.log_softmax(model.logits(readouts[loops, rows]).double(), dim=-1)
        vals = (log_t.exp() * (log_t - log_r)).sum(-1).clamp_min(0.0)
        for j, v in zip(idx, vals.tolist()):
            kl[j] = v
    return kl


# ---------------------------------------------------------------------------------------------- inputs

def load_tasks(path: str | Path, limit: int | None = None) -> list[dict]:
    tasks = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, target = row["prompt_token_ids"], row["target_token_ids"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: need a JSON object with prompt_token_ids and "
                             f"target_token_ids ({exc})") from None
        if not (isinstance(prompt, list) and isinstance(target, list) and prompt
                and all(isinstance(t, int) for t in prompt + target)):
            raise ValueError(f"{path}:{lineno}: prompt_token_ids (non-empty) and target_token_ids must be "
                             f"lists of ints")
        tasks.append({"prompt_token_ids": prompt, "target_token_ids": target})
        if limit is not None and len(tasks) >= limit:
            break
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks


def parse_configs(text: str, T: int, explicit: bool) -> list[dict]:
    """Names -> [{name, mode, deep_interval, shallow_loops}]; interval1 first (added when missing).

    Default list: configurations with shallow_loops >= T are skipped; given explicitly they are an error."""
    default_s = min(2, T - 1)
    configs, seen = [], set()
    for name in [n.strip() for n in text.split(",") if n.strip()]:
        m = CONFIG_RE.match(name)
        if m is None:
            raise ValueError(f"bad config {name!r}: use interval1, eagerB, deferredB, verifyB, optionally "
                             f"with sS (e.g. deferred4s1)")
        mode, B = (m.group(1), int(m.group(2))) if m.group(1) else ("deferred", 1)
        s = int(m.group(3)) if m.group(3) else default_s
        if B < 1 or not 1 <= s <= T - 1:
            if explicit:
                raise ValueError(f"config {name!r}: need deep_interval >= 1 and 1 <= shallow_loops <= {T - 1}")
            continue
        if name not in seen:
            seen.add(name)
            configs.append(dict(name=name, mode=mode, deep_interval=B, shallow_loops=s))
    ref = [c for c in configs if c["name"] == "interval1"] or [
        dict(name="interval1", mode="deferred", deep_interval=1, shallow_loops=default_s)]
    return ref + [c for c in configs if c["name"] != "interval1"]


# ---------------------------------------------------------------------------------------------- running

def generate_timed(cfg: dict, model, args, tasks: list[dict], max_tokens: int) -> tuple[list, float, dict, dict]:
    """The config's outputs for every task, the wall seconds of that batch (warm-up excluded) and the engine's
    stats before and after it."""
    prompts = [t["prompt_token_ids"] for t in tasks]
    max_len = max(len(p) for p in prompts) + max_tokens
    econf = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, mode=cfg["mode"],
                         deep_interval=cfg["deep_interval"], shallow_loops=cfg["shallow_loops"],
                         max_num_seqs=args.max_num_seqs, max_model_len=max(max_len, 2),
                         gpu_memory_utilization=args.gpu_memory_utilization)
    stops = tuple(args.stop_token_ids)
    params = [SamplingParams(max_tokens=max_tokens, temperature=args.temperature, seed=args.seed + i,
                             stop_token_ids=stops) for i in range(len(tasks))]
    with SyncEngine(econf, loaded_model=model) as llm:
        if args.warmup:  # first-call costs (allocations, kernels, CUDA graphs) stay out of the timing
            n = min(len(prompts), args.max_num_seqs)
            llm.generate_batch(prompts[:n], SamplingParams(max_tokens=min(max_tokens, 2 * cfg["deep_interval"] + 2),
                                                           temperature=0.0, ignore_eos=True))
        before = dict(llm.stats())
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate_batch(prompts, params, use_tqdm=True)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        after = dict(llm.stats())
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return outs, wall, before, after


def run_config(cfg: dict, model, args, tasks: list[dict], max_tokens: int, T: int) -> tuple[dict, list, list]:
    outs, wall, before, after = generate_timed(cfg, model, args, tasks, max_tokens)
    comps = [o.outputs[0] for o in outs]
    n_tokens = sum(len(c.token_ids) for c in comps)
    row = dict(config=cfg["name"], mode=cfg["mode"], deep_interval=cfg["deep_interval"],
               shallow_loops=cfg["shallow_loops"], num_tasks=len(tasks), num_tokens=n_tokens,
               wall_seconds=wall, tokens_per_s=n_tokens / wall if wall > 0 else 0.0)
    correct = [strip_stop(c.token_ids, c.finish_reason) == t["target_token_ids"] for c, t in zip(comps, tasks)]
    row["correct"] = sum(correct)
    row["accuracy"] = row["correct"] / len(tasks)
    row["accuracy_ci95"] = list(wilson_interval(row["correct"], len(tasks)))
    reasons: dict[str, int] = {}
    for c in comps:
        reasons[str(c.finish_reason)] = reasons.get(str(c.finish_reason), 0) + 1
    row["finish_reasons"] = reasons
    if reasons.get("error"):
        print(f"warning: {cfg['name']}: {reasons['error']} completion(s) failed: "
              f"{next(c.error for c in comps if c.finish_reason == 'error')}", file=sys.stderr)
    counts = {loop: 0 for loop in range(1, T + 1)}
    for c in comps:
        for r in c.readout_loops:
            counts[r] += 1
    row["loop_fractions"] = {str(k): v / max(n_tokens, 1) for k, v in counts.items()}
    kls = [completion_kl(model, t["prompt_token_ids"], c.token_ids, c.readout_loops)
           for t, c in tqdm(list(zip(tasks, comps)), desc=f"KL {cfg['name']}", unit="req")]
    flat = [(v, r) for kl, c in zip(kls, comps) for v, r in zip(kl, c.readout_loops)]
    shallow = [v for v, r in flat if r != T]
    row["kl_all"] = sum(v for v, _ in flat) / len(flat) if flat else 0.0
    row["kl_shallow"] = sum(shallow) / len(shallow) if shallow else None
    drafted = after["drafted_tokens"] - before["drafted_tokens"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    tested = after["tested_drafts"] - before["tested_drafts"]
    is_verify = cfg["mode"] == "verify"
    row["acceptance_rate"] = accepted / drafted if is_verify and drafted else None
    row["acceptance_per_position"] = accepted / tested if is_verify and tested else None
    details = [dict(config=cfg["name"], task=i, token_ids=c.token_ids, readout_loops=c.readout_loops,
                    finish_reason=c.finish_reason, correct=ok, kl=kl)
               for i, (c, ok, kl) in enumerate(zip(comps, correct, kls))]
    return row, comps, details


def add_reference_metrics(row: dict, comps: list, ref_comps: list, ref_row: dict) -> None:
    row["agree_exact"] = sum(c.token_ids == r.token_ids for c, r in zip(comps, ref_comps)) / len(comps)
    row["agree_prefix"] = sum(prefix_fraction(c.token_ids, r.token_ids)
                              for c, r in zip(comps, ref_comps)) / len(comps)
    base = ref_row["tokens_per_s"]
    row["throughput_ratio"] = row["tokens_per_s"] / base if base > 0 else None


# ---------------------------------------------------------------------------------------------- output

def _f(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _accepted(r: dict) -> str:
    if r["acceptance_rate"] is None:
        return "-"
    return f"{r['acceptance_rate']:.3f} / {_f(r.get('acceptance_per_position'))}"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Quality of ourobatch modes on `{meta['model']}`: {meta['num_tasks']} tasks, {meta['device']}, "
             f"{meta['dtype']}, temperature {meta['temperature']}, max_tokens {meta['max_tokens']}, {meta['date']}.",
             "", f"Agreement and throughput are relative to interval 1 (full depth) in the same run; "
             f"{'**' + CPU_NOTE + '**' if meta['device'] == 'cpu' else 'throughput from a quality run is indicative'}."
             " KL: mean per-token KL(loop T || readout loop) over all tokens / over tokens not read from loop T.",
             "", "| config | mode | B | s | accuracy [95% CI] | agree exact | agree prefix | KL all | KL shallow "
             "| tokens per loop | accepted (all / per position) | tok/s | x interval 1 |", "|" + "---|" * 13]
    for r in rows:
        lo, hi = r["accuracy_ci95"]
        loops = " ".join(f"{k}:{v:.2f}" for k, v in r["loop_fractions"].items() if v > 0)
        lines.append(f"| {r['config']} | {r['mode']} | {r['deep_interval']} | {r['shallow_loops']} | "
                     f"{r['accuracy']:.3f} [{lo:.3f}, {hi:.3f}] | {_f(r['agree_exact'])} | {_f(r['agree_prefix'])} | "
                     f"{_f(r['kl_all'], '.4g')} | {_f(r['kl_shallow'], '.4g')} | {loops} | "
                     f"{_accepted(r)} | {r['tokens_per_s']:.1f} | {_f(r['throughput_ratio'], '.2f')} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path: Path) -> bool:
    note = f" ({CPU_NOTE})" if meta["device"] == "cpu" else ""
    return accuracy_plot(rows, "throughput_ratio", path, xlabel=f"decode tokens/s relative to interval 1{note}",
                         ylabel="accuracy (95% Wilson CI)",
                         title=f"{Path(meta['model']).name}: {meta['num_tasks']} tasks, T={meta['total_ut_steps']}, "
                               f"temperature {meta['temperature']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Ouro checkpoint folder (config.json + safetensors)")
    ap.add_argument("--tasks", required=True, help="JSONL: prompt_token_ids, target_token_ids per line")
    ap.add_argument("--out", required=True, help="folder for results.json, results.md, pareto.png")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="default: longest target + 1 (room for the eos; for targets that end without one, "
                         "pass the target length)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    ap.add_argument("--configs", default=None, help=f"comma-separated (default: {DEFAULT_CONFIGS})")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--seed", type=int, default=0, help="task i samples with seed + i")
    ap.add_argument("--stop-token-ids", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                    help="extra stop tokens, comma-separated (the checkpoint's eos always stops)")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="requests decoding at once")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="skip the short untimed generate_batch before each timed one")
    args = ap.parse_args(argv)
    try:
        tasks = load_tasks(args.tasks, args.limit)
        mc = OuroConfig.from_checkpoint(args.model)
        configs = parse_configs(args.configs or DEFAULT_CONFIGS, mc.total_ut_steps, args.configs is not None)
    except ValueError as exc:
        ap.error(str(exc))
    T = mc.total_ut_steps
    max_tokens = args.max_tokens or max(len(t["target_token_ids"]) for t in tasks) + 1
    dtype = resolve_dtype(EngineConfig(model=args.model, device=args.device, dtype=args.dtype))
    model = load_model(args.model, dtype, args.device)
    model.fuse_projections()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), model=str(args.model),
                device=args.device, dtype=str(dtype).removeprefix("torch."), num_tasks=len(tasks),
                temperature=args.temperature, seed=args.seed, max_tokens=max_tokens, total_ut_steps=T,
                torch=torch.__version__, configs=[c["name"] for c in configs],
                throughput_note=CPU_NOTE if args.device == "cpu" else
                "tokens/s of whole generate_batch calls of a quality run; use benchmarks/throughput.py")
    rows: list[dict] = []
    ref_row = ref_comps = None
    with open(out / "completions.jsonl", "w") as details_file:
        for cfg in configs:
            print(f"== {cfg['name']} (mode={cfg['mode']}, B={cfg['deep_interval']}, s={cfg['shallow_loops']})",
                  file=sys.stderr, flush=True)
            row, comps, details = run_config(cfg, model, args, tasks, max_tokens, T)
            if ref_row is None:  # interval 1 runs first
                ref_row, ref_comps = row, comps
            add_reference_metrics(row, comps, ref_comps, ref_row)
            rows.append(row)
            details_file.writelines(json.dumps(d) + "\n" for d in details)
            print(json.dumps(row), flush=True)
            (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (out / "results.md").write_text(markdown(rows, meta))
    plot(rows, meta, out / "pareto.png")
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
