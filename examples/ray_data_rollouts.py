"""Offline rollouts with Ray Data: a dataset of prompts, `map_batches` over N engine replicas.

Each replica is a Ray Data actor holding one SyncEngine (one GPU each with --device cuda); Ray Data feeds
it batches of prompts and collects token ids, log-probs and readout loops into a dataset. Needs Ray Data:

    pip install "ray[data]"
    python examples/ray_data_rollouts.py                                   # CPU: a tiny random model, 2 replicas
    python examples/ray_data_rollouts.py --model DIR --device cuda --replicas 8 --prompts 4096 --max-tokens 512

For online use (streams, aborts, weight updates between batches) use ourobatch.ray.EnginePool instead
(examples/ray_pool.py).
"""

from __future__ import annotations

import argparse
import random
import tempfile

import numpy as np
import ray

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.testing import make_tiny_checkpoint


class Rollout:
    """One engine replica: built once per Ray Data actor, then called with batch after batch."""

    def __init__(self, model: str, device: str, max_tokens: int, n: int, deep_interval: int) -> None:
        self.llm = SyncEngine(EngineConfig(model=model, device=device, deep_interval=deep_interval,
                                           mode="deferred"))
        self.max_tokens, self.n = max_tokens, n

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        prompts = [[int(t) for t in p] for p in batch["prompt_token_ids"]]
        params = [SamplingParams(n=self.n, max_tokens=self.max_tokens, temperature=1.0, seed=int(s))
                  for s in batch["seed"]]
        outs = self.llm.generate_batch(prompts, params)
        rows: dict[str, list] = {"prompt_index": [], "sample": [], "token_ids": [], "logprobs": [],
                                 "readout_loops": [], "finish_reason": []}
        for index, out in zip(batch["prompt_index"], outs):
            for c in out.outputs:
                rows["prompt_index"].append(int(index))
                rows["sample"].append(c.index)
                rows["token_ids"].append(c.token_ids)
                rows["logprobs"].append(c.logprobs)
                rows["readout_loops"].append(c.readout_loops)
                rows["finish_reason"].append(c.finish_reason)
        return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder (default: a tiny random one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--replicas", type=int, default=2, help="engine replicas (Ray Data actors): concurrency=N")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=6)
    ap.add_argument("--n", type=int, default=2, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=10)
    ap.add_argument("--deep-interval", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8, help="prompts per map_batches call")
    args = ap.parse_args()
    if not ray.is_initialized():
        ray.init(**({"num_cpus": args.replicas + 1} if args.device == "cpu" else {}),
                 include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_tiny_checkpoint(tmp))
        rng = random.Random(0)
        items = [{"prompt_index": i, "seed": i,
                  "prompt_token_ids": [rng.randrange(1, 31) for _ in range(args.prompt_len)]}
                 for i in range(args.prompts)]
        results = ray.data.from_items(items).map_batches(
            Rollout, fn_constructor_kwargs=dict(model=model, device=args.device, max_tokens=args.max_tokens,
                                                n=args.n, deep_interval=args.deep_interval),
            concurrency=args.replicas, num_gpus=1 if args.device.startswith("cuda") else 0, num_cpus=1,
            batch_size=args.batch_size).take_all()
    tokens = sum(len(r["token_ids"]) for r in results)
    print(f"{len(results)} completions of {args.prompts} prompts x n={args.n} on {args.replicas} replicas: "
          f"{tokens} tokens")
    first = min(results, key=lambda r: (r["prompt_index"], r["sample"]))
    print(f"prompt 0 sample 0: tokens={list(first['token_ids'])} loops={list(first['readout_loops'])} "
          f"finish={first['finish_reason']}")


if __name__ == "__main__":
    main()
