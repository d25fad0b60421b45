"""Async generation: several prompts awaited concurrently on one Engine (CPU, a few seconds).

The engine batches whatever is in flight: the four requests below share prefill, shallow and deep calls.
"""

import asyncio
import tempfile

from ourobatch import Engine, EngineConfig, SamplingParams
from ourobatch.testing import make_tiny_checkpoint

PROMPTS = [[1, 5, 7], [2, 3], [4, 4, 4, 4], [9]]


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_checkpoint(tmp)  # random weights, the real HF tensor names and config.json
        config = EngineConfig(model=tmp, mode="deferred", deep_interval=4, shallow_loops=2)
        async with Engine(config) as engine:
            outs = await asyncio.gather(*(
                engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True))
                for i, prompt in enumerate(PROMPTS)))
            for out in outs:
                c = out.outputs[0]
                print(f"{out.request_id}: prompt={out.prompt_token_ids} tokens={c.token_ids} "
                      f"loops={c.readout_loops} logprob={c.cumulative_logprob:.3f} finish={c.finish_reason}")
            stats = engine.stats()
            print(f"generated {len(outs)} requests: deep_calls={stats['deep_calls']} "
                  f"deep_rows={stats['deep_rows']} shallow_steps={stats['shallow_steps']}")


if __name__ == "__main__":
    asyncio.run(main())
