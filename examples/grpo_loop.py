"""A small GRPO loop on the shipped pointer-chase model, on the CPU (a few seconds per iteration).

Per iteration:
1. rollouts: `--prompts` held-out tasks, `n` samples each, through the async Engine (full depth by
   default; `--deep-interval 4 --shallow-loops 3` makes them deferred rollouts, read mostly from loop 3);
2. reward: exact match of the answer (the target nodes, then eos); advantages normalised per group;
3. replay: the trainer's own float32 copy of the model (loaded separately, requires_grad) recomputes the
   log-prob of every sampled token with `ourobatch.training.readout_logprobs`, one dense forward, each
   token from the loop that produced it (`readout_loops`), processed with the same SamplingParams the
   engine sampled with (`logprobs_mode="processed"` on both sides; with temperature 1 and no filters,
   "raw" gives the same numbers);
4. `--epochs` clipped policy-gradient steps (PPO-style ratio, GRPO's group advantages, no KL term);
5. `engine.update_weights(trainer.named_parameters(), version=it + 1)`: the new weights go into the
   running engine in place (the names are the Hugging Face checkpoint's).

It prints, per iteration, the mean reward, max|ratio - 1| at the first replay (engine against trainer:
float32 rounding, ~1e-5, when the engine serves exactly the trainer's weights) and how far the steps moved
the policy on that batch (max |new - old log-prob|): the next iteration's max|ratio - 1| stays at rounding
level only because the update reached the engine.

    python examples/grpo_loop.py --iterations 20
    python examples/grpo_loop.py --iterations 5 --deep-interval 4 --shallow-loops 3
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path

import anyio
import torch
from safetensors.torch import save_file

from ourobatch import Engine, EngineConfig, SamplingParams
from ourobatch.engine.loader import load_model
from ourobatch.training import readout_logprobs

ROOT = Path(__file__).resolve().parents[1]
EOS = 0  # <|endoftext|> in the pointer-chase vocabulary


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "pointer-chase")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8, help="tasks per iteration")
    ap.add_argument("--n", type=int, default=4, help="samples per task (the GRPO group)")
    ap.add_argument("--temperature", type=float, default=1.5)
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--deep-interval", type=int, default=1, help="1: full depth; > 1: deferred rollouts")
    ap.add_argument("--shallow-loops", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=1, help="policy-gradient steps per batch")
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def save_checkpoint(model: torch.nn.Module, src: Path, dst: Path) -> Path:
    """The trainer's weights as an HF checkpoint folder (only needed when the engine lacks update_weights)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, dst / "model.safetensors")
    return dst


def grpo_step(trainer, optimizer, batch: dict, params: SamplingParams, epochs: int, clip: float) -> tuple[float, float]:
    """`epochs` clipped policy-gradient steps on one batch. Returns (max|ratio - 1| at the first replay,
    max |log-prob after the steps - behaviour log-prob|)."""
    old = batch["old_logprobs"]  # [b, C] the engine's log-probs (the behaviour policy)
    mask = batch["mask"]  # [b, C] 1 for generated tokens

    def replay() -> torch.Tensor:
        return readout_logprobs(trainer, batch["input_ids"], batch["readout_loops"], prompt_len=batch["prompt_len"],
                                params=params, logprobs_mode="processed")

    first_mismatch = 0.0
    for epoch in range(epochs):
        ratio = torch.exp(replay() - old) * mask + (1 - mask)  # padded entries: ratio 1
        if epoch == 0:
            first_mismatch = (ratio - 1).abs().max().item()
        adv = batch["advantages"][:, None]
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
        loss = -(surrogate * mask).sum() / mask.sum()  # token mean over the batch
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        moved = ((replay() - old).abs() * mask).max().item()
    return first_mismatch, moved


def make_batch(tasks: list[dict], outputs) -> tuple[dict, float]:
    """Rewards, group-normalised advantages and padded tensors for the replay."""
    ids, loops, prompt_len, old, rewards, advantages = [], [], [], [], [], []
    for task, out in zip(tasks, outputs):
        group = [float(c.finish_reason == "stop" and c.token_ids == task["target_token_ids"] + [EOS])
                 for c in out.outputs]
        mean, std = sum(group) / len(group), torch.tensor(group).std().item() if len(group) > 1 else 0.0
        for c, r in zip(out.outputs, group):
            ids.append(task["prompt_token_ids"] + c.token_ids)
            loops.append(c.readout_loops)
            prompt_len.append(len(task["prompt_token_ids"]))
            old.append(c.logprobs)
            rewards.append(r)
            advantages.append((r - mean) / (std + 1e-6))
    width = max(len(o) for o in old)
    mask = torch.tensor([[1.0] * len(o) + [0.0] * (width - len(o)) for o in old])
    old_t = torch.tensor([o + [0.0] * (width - len(o)) for o in old])
    batch = dict(input_ids=ids, readout_loops=loops, prompt_len=prompt_len, old_logprobs=old_t, mask=mask,
                 advantages=torch.tensor(advantages))
    return batch, sum(rewards) / len(rewards)


async def main(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tasks = [json.loads(line) for line in (args.model / "heldout_tasks.jsonl").read_text().splitlines() if line]
    # the trainer's own copy: loaded separately, float32, unfused, every parameter trainable
    trainer = load_model(args.model, torch.float32, "cpu").requires_grad_(True)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=args.lr, weight_decay=0.0)
    params = SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens)

    def engine_config(path: Path) -> EngineConfig:
        return EngineConfig(model=str(path), dtype="float32", deep_interval=args.deep_interval,
                            shallow_loops=args.shallow_loops, logprobs_mode="processed", max_model_len=64,
                            max_num_seqs=args.prompts * args.n, seed=args.seed)

    checkpoint, it, tmp = args.model, 0, Path(tempfile.mkdtemp(prefix="grpo-"))
    try:
        while it < args.iterations:
            async with Engine(engine_config(checkpoint)) as engine:
                while it < args.iterations:
                    batch_tasks = rng.sample(tasks, args.prompts)
                    outputs = await engine.generate_batch([t["prompt_token_ids"] for t in batch_tasks], params)
                    batch, reward = make_batch(batch_tasks, outputs)
                    mismatch, moved = grpo_step(trainer, optimizer, batch, params, args.epochs, args.clip)
                    named = ((name, p.detach()) for name, p in trainer.named_parameters())
                    if hasattr(engine, "update_weights"):
                        version = await engine.update_weights(named, version=it + 1)
                    else:
                        # Engines without in-place updates (older ourobatch): save the trainer's weights and
                        # serve them from a new engine built on that checkpoint. The example runs either way.
                        checkpoint = save_checkpoint(trainer, args.model, tmp / f"it{it + 1}")
                        version = it + 1
                    versions = {v for out in outputs for c in out.outputs for v in getattr(c, "weight_versions", [])}
                    print(f"iter {it + 1}: reward={reward:.3f} max|ratio-1|={mismatch:.2e} policy_change={moved:.2e} "
                          f"rollout_versions={sorted(versions)} version={version}", flush=True)
                    it += 1
                    if not hasattr(engine, "update_weights"):
                        break  # reopen the engine on the new checkpoint
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    anyio.run(main, parse_args())
