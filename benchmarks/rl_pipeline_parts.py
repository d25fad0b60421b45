"""benchmarks/rl_pipeline.py's workload and learner: the tasks (unique prompts, each with its samples' drawn
lengths), the engine as both loops see it (each sample ending at its drawn length), and the simulated learner
that trains for a fixed time and pushes perturbed copies of the checkpoint."""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import anyio
import torch

from ourobatch import Engine, SamplingParams
from engine.config import OuroConfig
from engine.loader import load_state_dict
from scheduler.params import RequestOutputKind

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout import draw_lengths  # noqa: E402


# ---------------------------------------------------------------------- the workload

def make_tasks(args, vocab: int, seed: int, median: float) -> list[dict]:
    """batches x R tasks: a prompt (unique) and the n drawn lengths of its samples."""
    rng = random.Random(seed)
    tasks, seen = [], set()
    while len(tasks) < args.batches * args.prompts:
        prompt = tuple(rng.randrange(1, vocab) for _ in range(args.prompt_len))
        if prompt in seen:  # the length cap finds a sample's target by its prompt
            continue
        seen.add(prompt)
        tasks.append(dict(prompt_token_ids=list(prompt),
                          targets=draw_lengths(rng, args.n, median, args.sigma, args.max_tokens)))
    return tasks


class CappedEngine:
    """The engine as both loops see it, where each sample ends at its drawn length.

    generate() streams the request and aborts it once it holds its target tokens, then reports the
    first `target` tokens with finish_reason "stop" (rollout.py's per-completion abort, seen as an
    EOS). A sample's target is found by (prompt, seed): the k-th distinct seed of a prompt gets its k-th
    length, and the same seed always the same one, so a restarted or regenerated sample keeps its
    length. Everything else is the engine's own call."""

    def __init__(self, engine: Engine, tasks: list[dict]) -> None:
        self._engine = engine
        self._free = {tuple(t["prompt_token_ids"]): list(t["targets"]) for t in tasks}
        self._targets: dict[tuple, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def target(self, prompt: list[int], seed: int | None) -> int:
        key = (tuple(prompt), seed)
        if key not in self._targets:
            free = self._free[key[0]]
            if not free:
                raise RuntimeError(f"more distinct seeds than samples for one prompt (seed {seed}): a task's "
                                   f"samples must keep one seed each")
            self._targets[key] = free.pop(0)
        return self._targets[key]

    async def generate(self, prompt_token_ids, params=None, request_id: str | None = None):
        params = SamplingParams.coerce(params)
        target = self.target(prompt_token_ids, params.seed)
        tokens: list[int] = []
        logprobs: list[float] = []
        loops: list[int] = []
        versions: list[int] = []
        last = None
        cut = False
        delta = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        async with self._engine.stream(prompt_token_ids, delta, request_id=request_id) as stream:
            async for out in stream:
                c = out.outputs[0]
                last = out
                tokens += c.token_ids
                logprobs += c.logprobs
                loops += c.readout_loops
                versions += c.weight_versions
                if not cut and len(tokens) >= target:
                    cut = True  # the sample's "EOS": later tokens of this step and the next are dropped
                    await self._engine.abort(out.request_id)
        assert last is not None, "a stream ends with a final output"
        c = last.outputs[0]
        finish = ("length" if target >= params.max_tokens else "stop") if cut else c.finish_reason
        t = target if cut else len(tokens)
        done = dataclasses.replace(c, token_ids=tokens[:t], logprobs=logprobs[:t], readout_loops=loops[:t],
                                   weight_versions=versions[:t], cumulative_logprob=sum(logprobs[:t]),
                                   finish_reason=finish)
        return dataclasses.replace(last, outputs=[done], finished=True)


def sample_params(args) -> SamplingParams:
    return SamplingParams(n=1, max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)


# ---------------------------------------------------------------------- the learner

def perturbed_copies(model_dir: str, dtype: torch.dtype, device: str, count: int = 2,
                     scale: float = 0.01) -> list[list[tuple[str, torch.Tensor]]]:
    """`count` full sets of (HF name, tensor): the checkpoint's tensors x (1 + scale x noise), on `device`."""
    base = load_state_dict(model_dir, OuroConfig.from_checkpoint(model_dir), dtype, device)
    gen = torch.Generator(device=device).manual_seed(1234)
    copies: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(count)]
    for name, t in base.items():
        for copy in copies:
            noise = torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32)
            copy.append((name, (t.float() * (1 + scale * noise)).to(dtype)))
    del base
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return copies


class Learner:
    """Trains on a batch for train_s seconds (a sleep), then pushes the next weight copy."""

    def __init__(self, copies: list[list[tuple[str, torch.Tensor]]], train_s: float) -> None:
        self.copies, self.train_s = copies, train_s
        self.num_steps = 0
        self.push_s: list[float] = []
        self.ordinals: dict[int, int] = {}  # weight version -> updates before it, in this run
        self.version = 0

    def start(self, version: int) -> None:
        self.ordinals = {version: 0}
        self.version = version
        self.push_s = []

    async def step(self, push: Callable[[list], Awaitable[int]]) -> None:
        await anyio.sleep(self.train_s)
        named = self.copies[self.num_steps % len(self.copies)]
        self.num_steps += 1
        t = time.perf_counter()
        self.version = await push(named)
        self.push_s.append(time.perf_counter() - t)
        self.ordinals[self.version] = len(self.ordinals)

    def staleness(self, version: int) -> int:
        return self.ordinals[self.version] - self.ordinals[version]  # KeyError: a token from outside the run
