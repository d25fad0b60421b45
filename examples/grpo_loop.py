"""A small GRPO loop on the shipped pointer-chase model, on the CPU (a few seconds per iteration).

By default collection is continuous (`ourobatch.rollout.Collector`): the engine keeps generating the next
groups while the learner trains on the current batch. Per iteration:
1. rollouts: the collector hands over a batch of `--prompts` groups (tasks drawn from the held-out task
   file, `--n` samples each, full depth by default; `--deep-interval 4 --shallow-loops 3` makes them
   deferred rollouts, read mostly from loop 3). Up to `--max-staleness` weight updates may separate a
   token's drawing from the batch's hand-over (0: on-policy, the collector drains before each update);
   `--on-update` says what an update does to samples in flight: "continue" (keep their KV, later tokens
   under the new weights), "recompute" (re-prefill under the new weights), "abort" (start them again);
2. reward: exact match of the answer (the target nodes, then eos), computed by the collector as each
   sample finishes; advantages normalised per group;
3. replay: the learner's own float32 copy of the model (loaded separately, requires_grad) recomputes the
   log-prob of every sampled token with `ourobatch.training.readout_logprobs`, one dense forward, each
   token from the loop that produced it (`readout_loops`), processed with the same SamplingParams the
   engine sampled with (`logprobs_mode="processed"` on both sides; with temperature 1 and no filters,
   "raw" gives the same numbers);
4. `--epochs` clipped policy-gradient steps (PPO-style ratio, GRPO's group advantages, no KL term), on a
   worker thread so the event loop keeps feeding the engine meanwhile;
5. `collector.update_weights(learner.named_parameters())`: the new weights go into the running engine in
   place (the names are the Hugging Face checkpoint's), between two of its steps.

`--sync` is the control: the synchronous loop (generate a batch with `engine.generate_batch`, train,
`engine.update_weights`, repeat), every token drawn under the learner's current weights.

It prints, per iteration, the mean reward, the share of the batch's tokens drawn under older weights
(`stale_share`), and max|ratio - 1| at the first replay separately for tokens drawn under the current
version (engine against learner: float32 rounding, ~1e-5, because the engine serves exactly the learner's
weights) and for stale tokens (the importance ratio PPO's clip is there for), then how far the steps
moved the policy on that batch (max |new - old log-prob|) and the weight versions the rollouts ran on.
Current tokens of a sample that was in flight across an update (its weight_versions switch) are
reported on their own (`mixed`): with "continue" they attended to KV the old weights computed, so a
dense replay on the new weights differs from what they were drawn with (docs/semantics.md); with
"recompute" they are at rounding level too. On this CPU the next batch usually finishes generating
while the learner trains, so mixed samples are rare and a batch after the first is mostly stale.

On a small shared CPU run it with OMP_NUM_THREADS=1 (the tests do): the engine's stepping thread and the
learner's thread each start an intra-op pool, and two pools spinning on two busy cores crawl.

    python examples/grpo_loop.py --iterations 20
    python examples/grpo_loop.py --iterations 5 --max-staleness 0          # on-policy, still collected
    python examples/grpo_loop.py --iterations 5 --on-update recompute
    python examples/grpo_loop.py --iterations 5 --sync                     # the synchronous control
    python examples/grpo_loop.py --iterations 5 --deep-interval 4 --shallow-loops 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from pathlib import Path
from typing import Any, Sequence

import anyio
import torch

from ourobatch import Engine, EngineConfig, SamplingParams
from engine.loader import load_model
from ourobatch.rollout import Collector
from ourobatch.training import readout_logprobs

ROOT = Path(__file__).resolve().parents[1]
EOS = 0  # <|endoftext|> in the pointer-chase vocabulary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "pointer-chase")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8, help="tasks (groups) per iteration")
    ap.add_argument("--n", type=int, default=4, help="samples per task (the GRPO group)")
    ap.add_argument("--temperature", type=float, default=1.5)
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--deep-interval", type=int, default=1, help="1: full depth; > 1: deferred rollouts")
    ap.add_argument("--shallow-loops", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=1, help="policy-gradient steps per batch")
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--max-staleness", type=int, default=1,
                    help="weight updates a consumed token may lag behind (0: on-policy)")
    ap.add_argument("--on-update", choices=("continue", "recompute", "abort"), default="continue",
                    help="what a weight update does to samples in flight")
    ap.add_argument("--sync", action="store_true", help="the synchronous control loop (no collector)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.max_staleness < 0:
        ap.error(f"--max-staleness must be >= 0, got {args.max_staleness}")
    return args


def exact_match(task: dict, completion: Any) -> float:
    """1.0 when the completion is the target nodes then eos (a Sample or a CompletionOutput)."""
    return float(completion.finish_reason == "stop" and completion.token_ids == task["target_token_ids"] + [EOS])


def make_batch(groups: list[tuple[list[int], list[Any], list[float]]], version: int) -> tuple[dict, float]:
    """Group-normalised advantages and padded tensors for the replay. `groups`: (prompt, completions,
    rewards) per task; a completion has token_ids, logprobs, readout_loops and weight_versions.
    `version` is the learner's current weight version."""
    ids, loops, prompt_len, old, current, mixed, rewards, advantages = [], [], [], [], [], [], [], []
    for prompt, completions, group in groups:
        mean, std = sum(group) / len(group), torch.tensor(group).std().item() if len(group) > 1 else 0.0
        for c, r in zip(completions, group):
            ids.append(list(prompt) + list(c.token_ids))
            loops.append(c.readout_loops)
            prompt_len.append(len(prompt))
            old.append(c.logprobs)
            # a token is current when drawn under the learner's weights; a sample is mixed when it has
            # both (on_update="continue"/"recompute": it was in flight across an update)
            current.append([float(v == version) for v in c.weight_versions])
            mixed.append(len(set(c.weight_versions)) > 1)
            rewards.append(r)
            advantages.append((r - mean) / (std + 1e-6))
    width = max(len(o) for o in old)

    def pad(rows: list[list[float]]) -> torch.Tensor:  # [b, C]
        return torch.tensor([row + [0.0] * (width - len(row)) for row in rows])

    mask, current_t = pad([[1.0] * len(o) for o in old]), pad(current)
    mixed_t = torch.tensor(mixed, dtype=torch.float32)[:, None]  # [b, 1]
    batch = dict(input_ids=ids, readout_loops=loops, prompt_len=prompt_len, old_logprobs=pad(old), mask=mask,
                 current=current_t * (1 - mixed_t), mixed=current_t * mixed_t, stale=mask - current_t,
                 advantages=torch.tensor(advantages))
    return batch, sum(rewards) / len(rewards)


def grpo_step(learner, optimizer, batch: dict, params: SamplingParams, epochs: int, clip: float) -> dict:
    """`epochs` clipped policy-gradient steps on one batch. Returns max|ratio - 1| at the first replay for
    each kind of token (None when the batch has none) and `moved`, max |log-prob after the steps -
    behaviour log-prob|."""
    old = batch["old_logprobs"]  # [b, C] the engine's log-probs (the behaviour policy)
    mask = batch["mask"]  # [b, C] 1 for generated tokens

    def replay() -> torch.Tensor:
        return readout_logprobs(learner, batch["input_ids"], batch["readout_loops"], prompt_len=batch["prompt_len"],
                                params=params, logprobs_mode="processed")

    report: dict[str, float | None] = {}
    for epoch in range(epochs):
        ratio = torch.exp(replay() - old) * mask + (1 - mask)  # padded entries: ratio 1
        if epoch == 0:
            deviation = (ratio - 1).abs().detach()
            for kind in ("current", "mixed", "stale"):
                selected = batch[kind] > 0
                report[kind] = deviation[selected].max().item() if selected.any() else None
        adv = batch["advantages"][:, None]
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
        loss = -(surrogate * mask).sum() / mask.sum()  # token mean over the batch
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        report["moved"] = ((replay() - old).abs() * mask).max().item()
    return report


def report_line(it: int, reward: float, batch: dict, step: dict, versions: set[int], version: int) -> str:
    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.2e}"

    stale_share = (batch["stale"].sum() / batch["mask"].sum()).item()
    return (f"iter {it}: reward={reward:.3f} stale_share={stale_share:.3f} max|ratio-1| current={fmt(step['current'])} "
            f"mixed={fmt(step['mixed'])} stale={fmt(step['stale'])} policy_change={step['moved']:.2e} "
            f"rollout_versions={sorted(versions)} version={version}")


async def train_step(learner, optimizer, batch: dict, params: SamplingParams, args: argparse.Namespace) -> dict:
    # on a worker thread: the event loop keeps delivering finished samples and starting new groups
    return await anyio.to_thread.run_sync(grpo_step, learner, optimizer, batch, params, args.epochs, args.clip)


async def run_sync(engine: Engine, learner, optimizer, params: SamplingParams, tasks: list[dict],
                   args: argparse.Namespace) -> None:
    """The control: generate a batch, train on it, push the weights, repeat."""
    rng = random.Random(args.seed)
    params = dataclasses.replace(params, n=args.n)  # one request per task, its n samples the group
    version = engine.stats()["weight_version"]
    for it in range(args.iterations):
        batch_tasks = rng.sample(tasks, args.prompts)
        outputs = await engine.generate_batch([t["prompt_token_ids"] for t in batch_tasks], params)
        groups = [(t["prompt_token_ids"], out.outputs, [exact_match(t, c) for c in out.outputs])
                  for t, out in zip(batch_tasks, outputs)]
        batch, reward = make_batch(groups, version)
        step = await train_step(learner, optimizer, batch, params, args)
        version = await engine.update_weights(learner.named_parameters())
        versions = {v for out in outputs for c in out.outputs for v in c.weight_versions}
        print(report_line(it + 1, reward, batch, step, versions, version), flush=True)


async def run_continuous(engine: Engine, learner, optimizer, params: SamplingParams, tasks: list[dict],
                         args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    # the same task draws as the control: `prompts` tasks per iteration, `iterations` batches in all
    stream = [t for _ in range(args.iterations) for t in rng.sample(tasks, args.prompts)]
    async with Collector(engine, stream, n=args.n, params=params, reward=exact_match,
                         groups_per_batch=args.prompts, max_staleness=args.max_staleness,
                         on_update=args.on_update, on_reward_error="raise", seed=args.seed) as collector:
        async for rollouts in collector:
            groups = [(g.samples[0].prompt_token_ids, g.samples, [s.reward for s in g.samples])
                      for g in rollouts.groups]
            batch, reward = make_batch(groups, rollouts.weight_version)
            step = await train_step(learner, optimizer, batch, params, args)
            version = await collector.update_weights(learner.named_parameters())
            versions = {v for s in rollouts.samples for v in s.weight_versions}
            print(report_line(rollouts.index + 1, reward, batch, step, versions, version), flush=True)
        stats = collector.stats()
    print(f"collector: batches={stats['batches']} groups_stale={stats['groups_stale']} "
          f"mixed_version_samples={stats['mixed_version_samples']} samples_restarted={stats['samples_restarted']} "
          f"staleness_histogram={stats['staleness_histogram']}", flush=True)


async def main(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    tasks = [json.loads(line) for line in (args.model / "heldout_tasks.jsonl").read_text().splitlines() if line]
    # the learner's own copy: loaded separately, float32, unfused, every parameter trainable
    learner = load_model(args.model, torch.float32, "cpu").requires_grad_(True)
    optimizer = torch.optim.AdamW(learner.parameters(), lr=args.lr, weight_decay=0.0)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)  # n=1: one per sample
    config = EngineConfig(model=str(args.model), dtype="float32", deep_interval=args.deep_interval,
                          shallow_loops=args.shallow_loops, logprobs_mode="processed", max_model_len=64,
                          max_num_seqs=args.prompts * args.n, seed=args.seed)
    async with Engine(config) as engine:
        run = run_sync if args.sync else run_continuous
        await run(engine, learner, optimizer, params, tasks, args)


if __name__ == "__main__":
    anyio.run(main, parse_args())
