"""How often async scheduling plans a step ahead, and why it waits when it does not, by workload and pool size.

Torch-free: the scheduler over tests/scheduler/fakes.py's executor (each request stops on an eos at a drawn token,
as tests/test_async_scheduling.py's workloads do), events on tests/lookahead_harness.py's clock of useful updates.
Two RL-shaped workloads, rounds of 16 requests added together with prefix caching on:
- `groups`: one 12-token prompt a round, its 16 samples sharing it, up to 44 tokens each;
- `unique`: a 40-token prompt each, up to 20 tokens: prompt blocks (cached, evictable once their request ends) are
  most of what each request holds, so a full pool's new blocks come from evicting them.
A row: the useful steps, the steps planned ahead, each drain reason's count (scheduler/lookahead.py's rules),
preemptions. The `evict` rule (session 42) drains where the next step's new blocks would evict a cached prefix
while a request of the step in flight may end.

    python benchmarks/lookahead_drains.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.params import SamplingParams  # noqa: E402
from tests.lookahead_harness import Event, run_async  # noqa: E402
from tests.test_async_scheduling import fake_core  # noqa: E402

WORKLOADS = {"groups": dict(prompt=12, shared=True, max_tokens=44, every=60, model_len=64),
             "unique": dict(prompt=40, shared=False, max_tokens=20, every=40, model_len=128)}
POOLS = (60, 100, 200, 400)


def workload(name: str, rounds: int, seed: int = 0) -> tuple[list[Event], dict[str, int]]:
    """(events, each request's eos token index) of `rounds` rounds of 16 requests."""
    w, rng = WORKLOADS[name], random.Random(seed)
    events, stop_at = [], {}
    for r in range(rounds):
        shared = tuple(rng.randrange(1, 49) for _ in range(w["prompt"]))
        for i in range(16):
            prompt = shared if w["shared"] else tuple(rng.randrange(1, 49) for _ in range(w["prompt"]))
            rid = f"r{r}q{i}"
            events.append(Event(r * w["every"], "add", rid, prompt, SamplingParams(max_tokens=w["max_tokens"], seed=i)))
            stop_at[rid] = rng.randrange(w["max_tokens"] // 2, w["max_tokens"])
    return events, stop_at


def measure(name: str, blocks: int, rounds: int) -> dict:
    events, stop_at = workload(name, rounds)
    core = fake_core(True, stop_at, num_kv_blocks=blocks, max_num_seqs=16, block_size=4,
                     max_model_len=WORKLOADS[name]["model_len"], max_num_batched_tokens=256, enable_prefix_caching=True)
    rec, _ = run_async(core, events)
    sched = core.scheduler
    return {"workload": name, "kv_blocks": blocks, "useful_steps": len(rec.steps),
            "planned_ahead": sched.counters.lookahead_steps, "drains": dict(sorted(sched.drain_reasons.items())),
            "preemptions": sched.counters.preemptions}


def markdown(rows: list[dict]) -> str:
    reasons = sorted({k for r in rows for k in r["drains"]})
    head = ["workload", "KV blocks", "useful steps", "planned ahead", *reasons, "preemptions"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["workload"], r["kv_blocks"], r["useful_steps"], r["planned_ahead"],
                 *(r["drains"].get(k, 0) for k in reasons), r["preemptions"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="folder for lookahead_drains.json and .md")
    ap.add_argument("--workloads", default="groups,unique", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    ap.add_argument("--pools", default=",".join(map(str, POOLS)), help="comma-separated KV block counts")
    ap.add_argument("--rounds", type=int, default=10, help="rounds of 16 requests (>= 1)")
    args = ap.parse_args(argv)
    names = args.workloads.split(",")
    if any(n not in WORKLOADS for n in names):
        ap.error(f"--workloads: each of {', '.join(WORKLOADS)}, got {args.workloads!r}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    rows = [measure(n, int(b), args.rounds) for n in names for b in args.pools.split(",")]
    table = markdown(rows)
    print(table, end="")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lookahead_drains.json").write_text(json.dumps(rows, indent=1))
        (args.out / "lookahead_drains.md").write_text(table)
    return rows


if __name__ == "__main__":
    main()
