"""Multi-turn, tool-use style episodes through `ourobatch.rollout.Collector` (CPU, a few seconds).

The collector draws one completion per sample from the task's prompt. An episode needs one generate()
per turn, so here the reward runs the rest of the episode: it is async, gets the first turn as
`sample`, and loops (the policy's turn, then a fake tool's answer: a few fixed token ids around a result
computed from the turn) with `await engine.generate(history, params)` for every later turn, then
returns the episode's reward. The alternative, tasks from a generator that yields each follow-up turn
as a new task, does not fit: the collector makes a group of `n` samples per task, so one follow-up per
sample would grow a tree of groups instead of `n` episodes, and the generator would have to be fed the
previous turn's output from the consumer's side.

What this gives, within the current API:
- a group is the `n` episodes of one conversation, so GRPO's advantages compare whole episodes;
- the sample's slot stays taken until its reward returns, so the collector's sample slots still count
  one engine request per episode;
- the staleness bound holds for the whole episode: later turns start after the first, so their tokens
  are never older than the first turn's, which is what the collector checks;
- a weight update pauses ("keep") and resumes the whole engine, so on_update="continue" / "recompute"
  apply to later turns as well.
What it does not give: the collector's Sample (and so its token counters, staleness histogram and
mixed-version count) covers the first turn only; the episode's later turns live in the example's own
record (`EpisodeRunner.episodes`, read by the consumer); and on_update="abort" restarts only the first
turn (the collector knows only its own requests), so later turns behave as "continue".

Per episode it prints the turns, the policy's and the tool's token counts, the weight version each turn
started under, and the reward; then totals and the collector's counters. Weights are pushed after every
batch (two random checkpoints in turn), so some episodes run across an update.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field

import anyio
from safetensors.torch import load_file

from ourobatch import Engine, EngineConfig, SamplingParams
from ourobatch.rollout import Collector, Sample
from ourobatch.testing import make_tiny_checkpoint

NUM_TASKS = 6
EPISODES_PER_TASK = 2  # the collector's n: one group per conversation
GROUPS_PER_BATCH = 2
TURNS = 3
TOKENS_PER_TURN = 6
LEARNER_STEP_S = 0.05  # stands in for a training step: the engine goes on with the next episodes
TOOL_OPEN, TOOL_CLOSE = 29, 30  # the fake tool's answer: [TOOL_OPEN, result, TOOL_CLOSE]


@dataclass
class Turn:
    token_ids: list[int]  # the policy's tokens this turn
    logprobs: list[float]
    readout_loops: list[int]
    weight_versions: list[int]
    weight_version: int  # the version it was admitted under
    tool_token_ids: list[int] = field(default_factory=list)  # the tool's answer after it (empty: last turn)


@dataclass
class Episode:
    prompt_token_ids: list[int]
    turns: list[Turn]
    reward: float

    def trajectory(self) -> dict[str, list]:
        """What a policy-gradient learner trains on: the response after the prompt, policy tokens masked 1,
        tool tokens 0 (context only: no log-prob, no loop, no version)."""
        t: dict[str, list] = {"token_ids": [], "loss_mask": [], "logprobs": [], "readout_loops": [],
                              "weight_versions": []}
        for turn in self.turns:
            t["token_ids"] += turn.token_ids + turn.tool_token_ids
            t["loss_mask"] += [1] * len(turn.token_ids) + [0] * len(turn.tool_token_ids)
            t["logprobs"] += turn.logprobs + [0.0] * len(turn.tool_token_ids)
            t["readout_loops"] += turn.readout_loops + [0] * len(turn.tool_token_ids)
            t["weight_versions"] += turn.weight_versions + [-1] * len(turn.tool_token_ids)
        return t


def tool(action: list[int]) -> list[int]:
    """A fake tool: its result token depends on the policy's last turn."""
    return [TOOL_OPEN, 1 + sum(action) % 28, TOOL_CLOSE]


class EpisodeRunner:
    """The collector's reward: runs turns 2..TURNS of the episode the collector started."""

    def __init__(self, engine: Engine, params: SamplingParams) -> None:
        self.engine, self.params = engine, params
        self.episodes: dict[tuple[int, int], Episode] = {}  # (task id, sample index) -> the latest run

    async def run_episode(self, task: dict, sample: Sample) -> float:
        turn = Turn(sample.token_ids, sample.logprobs, sample.readout_loops, sample.weight_versions,
                    sample.weight_version)
        turns, history = [turn], list(sample.prompt_token_ids) + sample.token_ids
        for t in range(1, TURNS):
            turn.tool_token_ids = tool(turn.token_ids)
            history += turn.tool_token_ids
            params = self.params.with_seed(1_000_000 + 1000 * task["id"] + 10 * sample.index + t)
            out = await self.engine.generate(history, params)
            c = out.outputs[0]
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"turn {t + 1} ended with {c.finish_reason!r}: {c.error}")
            turn = Turn(list(c.token_ids), list(c.logprobs), list(c.readout_loops), list(c.weight_versions),
                        c.weight_version)
            turns.append(turn)
            history += turn.token_ids
        # the toy reward: the share of later turns that use (repeat) the tool's result token
        used = [prev.tool_token_ids[1] in nxt.token_ids for prev, nxt in zip(turns, turns[1:])]
        reward = sum(used) / len(used)
        self.episodes[task["id"], sample.index] = Episode(list(sample.prompt_token_ids), turns, reward)
        return reward


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = [make_tiny_checkpoint(f"{tmp}/a", seed=0), make_tiny_checkpoint(f"{tmp}/b", seed=1)]
        weights = [list(load_file(str(p / "model.safetensors")).items()) for p in ckpts]
        config = EngineConfig(model=str(ckpts[0]), dtype="float32", mode="deferred", deep_interval=4,
                              shallow_loops=2, max_model_len=64, max_num_seqs=8, seed=0)
        params = SamplingParams(max_tokens=TOKENS_PER_TURN, temperature=1.0)
        tasks = [{"id": i, "prompt_token_ids": [1 + i, 2 + i % 5, 3]} for i in range(NUM_TASKS)]
        total = {"episodes": 0, "turns": 0, "policy": 0, "tool": 0, "reward": 0.0}
        async with Engine(config) as engine:
            runner = EpisodeRunner(engine, params)
            async with Collector(engine, tasks, n=EPISODES_PER_TASK, params=params, reward=runner.run_episode,
                                 groups_per_batch=GROUPS_PER_BATCH, max_staleness=1, on_update="continue",
                                 on_reward_error="raise") as collector:
                async for batch in collector:
                    for group in batch.groups:
                        for s in group.samples:
                            ep = runner.episodes[group.task["id"], s.index]
                            traj = ep.trajectory()
                            assert traj["token_ids"][:len(s.token_ids)] == s.token_ids and ep.reward == s.reward
                            policy, tool_tokens = sum(traj["loss_mask"]), traj["loss_mask"].count(0)
                            print(f"batch {batch.index} task {group.task['id']} episode {s.index}: "
                                  f"turns={len(ep.turns)} policy_tokens={[len(t.token_ids) for t in ep.turns]} "
                                  f"tool_tokens={tool_tokens} versions={[t.weight_version for t in ep.turns]} "
                                  f"reward={ep.reward:.2f}")
                            total["episodes"] += 1
                            total["turns"] += len(ep.turns)
                            total["policy"] += policy
                            total["tool"] += tool_tokens
                            total["reward"] += ep.reward
                    await anyio.sleep(LEARNER_STEP_S)  # the learner trains on the trajectories meanwhile
                    # ... and pushes its new weights (here: the other checkpoint's)
                    await collector.update_weights(weights[(batch.index + 1) % 2])
                stats = collector.stats()
    print(f"episodes={total['episodes']} turns={total['turns']} policy_tokens={total['policy']} "
          f"tool_tokens={total['tool']} mean_reward={total['reward'] / total['episodes']:.3f}")
    print(f"collector: batches={stats['batches']} updates={stats['updates']} groups_stale={stats['groups_stale']} "
          f"first_turn_tokens={stats['tokens_consumed']} staleness_histogram={stats['staleness_histogram']}")


if __name__ == "__main__":
    anyio.run(main)
