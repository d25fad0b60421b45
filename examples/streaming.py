"""Streaming: DELTA outputs as they are generated, and a stream closed early (which aborts its request).

Two requests stream concurrently. The first runs to the end; the second is abandoned with `break` after
a few tokens: leaving `async with engine.stream(...)` aborts the request and frees its KV at once.
"""

import tempfile

import anyio

from ourobatch import Engine, EngineConfig, RequestOutputKind, SamplingParams
from ourobatch.testing import make_tiny_checkpoint


async def stream_all(engine: Engine) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    async with engine.stream([1, 5, 7], params, request_id="full") as s:
        async for delta in s:
            c = delta.outputs[0]
            print(f"[full]  +{c.token_ids} loops={c.readout_loops} finish={c.finish_reason}")


async def stream_and_stop_early(engine: Engine, stop_after: int = 3) -> None:
    params = SamplingParams(max_tokens=64, temperature=0.8, seed=2, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    received = 0
    async with engine.stream([2, 3], params, request_id="early") as s:
        async for delta in s:
            received += len(delta.outputs[0].token_ids)
            print(f"[early] +{delta.outputs[0].token_ids}")
            if received >= stop_after:
                print(f"[early] got {received} tokens, closing the stream")
                break  # leaving the `async with` block aborts the request


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_checkpoint(tmp)
        async with Engine(EngineConfig(model=tmp, deep_interval=4, shallow_loops=2)) as engine:
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream_all, engine)
                tg.start_soon(stream_and_stop_early, engine)
            stats = engine.stats()
            print(f"early-closed request aborted: finished_abort={stats['finished_abort']} "
                  f"(finished_length={stats['finished_length']})")


if __name__ == "__main__":
    anyio.run(main)
