"""Online scale-out: an EnginePool of 2 replicas on Ray, used like one async Engine (CPU, under a minute).

Needs the `ray` extra (pip install -e ".[ray]"). On a GPU cluster: ray.init(address="auto") first, then
EnginePool(EngineConfig(model=DIR, device="cuda"), num_replicas=8) places one replica per GPU.
"""

import asyncio
import tempfile

import ray

from ourobatch import EngineConfig, SamplingParams
from ourobatch.ray import EnginePool
from ourobatch.testing import make_tiny_checkpoint

SYSTEM = [3, 1, 4, 1, 5, 9, 2, 6]  # a shared prompt prefix: the router keeps it on one replica


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_checkpoint(tmp)
        config = EngineConfig(model=tmp, mode="deferred", deep_interval=4, block_size=4)
        async with EnginePool(config, num_replicas=2, num_cpus_per_replica=1) as pool:
            # n samples of one prompt are one Engine request: they run together on one replica. Prompts
            # that share SYSTEM (two full KV blocks) follow the first of them to its replica (prefix
            # affinity); the others go to the replica with the least work outstanding.
            shared = [SYSTEM + [i] for i in range(4)]
            distinct = [[10 + i, 20 - i, 5 + i, 9] for i in range(4)]
            outs = await asyncio.gather(*(
                pool.generate(prompt, SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=i, ignore_eos=True))
                for i, prompt in enumerate(shared + distinct)))
            for out in outs:
                print(f"prompt {out.prompt_token_ids}: " + " | ".join(
                    f"{c.token_ids} loops={c.readout_loops}" for c in out.outputs))
            async with pool.stream([7, 7, 7], {"max_tokens": 8, "output_kind": "DELTA", "seed": 1,
                                               "ignore_eos": True}) as stream:
                async for delta in stream:
                    print("stream delta:", delta.outputs[0].token_ids)
            stats = pool.stats()
            per_replica = ", ".join(f"replica {r['replica']}: {r['requests_routed']} requests, "
                                    f"{r['tokens_generated']} tokens" for r in stats["replicas"])
            print(f"pool: {stats['num_replicas_ready']}/{stats['num_replicas']} replicas ready, "
                  f"tokens_generated={stats['tokens_generated']} ({per_replica})")


if __name__ == "__main__":
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    asyncio.run(main())
