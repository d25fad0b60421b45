"""Quickstart: write a tiny random-weight Ouro checkpoint and generate from it on the CPU in seconds."""

import tempfile

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.testing import make_tiny_checkpoint

with tempfile.TemporaryDirectory() as tmp:
    model = make_tiny_checkpoint(tmp)  # config.json + model.safetensors, the real HF tensor names
    config = EngineConfig(model=tmp, mode="deferred", deep_interval=4, shallow_loops=2)
    with SyncEngine(config) as llm:
        outs = llm.generate_batch([[1, 5, 7], [2, 3]], SamplingParams(max_tokens=12, temperature=0.8, seed=0))
        for out in outs:
            c = out.outputs[0]
            print(out.request_id, c.token_ids, c.readout_loops, [round(lp, 3) for lp in c.logprobs], c.finish_reason)
        print({k: v for k, v in llm.stats().items() if k in ("deep_calls", "deep_rows", "shallow_steps")})
