"""The RL loop's engine operations, timed: sleep / wake_up / load_weights / update_weights, and GPU memory.

Through the public async Engine on an Ouro-1.4B-shaped random checkpoint (written unless --model is
given): generate a batch, sleep(1), wake_up(), generate again (the outputs must be equal), load_weights
from the checkpoint folder, update_weights from in-memory tensors, sleep(2) + wake_up() + load_weights.
Reports seconds per operation and the device memory in use (total - free, the process's whole footprint
including the CUDA context) and torch's allocated / reserved bytes after each. JSON + markdown in --out.

    python benchmarks/rl_ops.py --out results/rl_ops          # on a CUDA machine
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import anyio
import torch
from safetensors.torch import load_file

from ourobatch import Engine, EngineConfig, SamplingParams
from ourobatch.testing import make_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import OURO_1_4B, TINY  # noqa: E402

GiB = 2**30


def memory(device: str) -> dict:
    if not device.startswith("cuda"):
        return {}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return dict(device_used_gib=(total - free) / GiB, allocated_gib=torch.cuda.memory_allocated() / GiB,
                reserved_gib=torch.cuda.memory_reserved() / GiB)


async def run(args, model_dir: str) -> dict:
    cfg = EngineConfig(model=model_dir, device=args.device, dtype=args.dtype, mode="deferred", deep_interval=4,
                       max_num_seqs=64, max_model_len=1024, gpu_memory_utilization=args.gpu_memory_utilization)
    prompts = [[1 + (7 * i + j) % 90 for j in range(128)] for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=3, ignore_eos=True)
    rows: list[dict] = []

    async def timed(name: str, coro) -> None:
        t = time.perf_counter()
        result = await coro
        rows.append(dict(op=name, seconds=time.perf_counter() - t, result=result, **memory(args.device)))
        print(json.dumps(rows[-1]), flush=True)

    async with Engine(cfg) as engine:
        rows.append(dict(op="started", seconds=0.0, result=None, **memory(args.device)))
        before = [o.outputs[0].token_ids for o in await engine.generate_batch(prompts, params)]
        await timed("sleep(1)", engine.sleep(1))
        await timed("wake_up", engine.wake_up())
        after = [o.outputs[0].token_ids for o in await engine.generate_batch(prompts, params)]
        await timed("load_weights", engine.load_weights(model_dir))
        tensors = load_file(str(Path(model_dir) / "model.safetensors"), device=args.device)
        await timed("update_weights (device tensors)", engine.update_weights(tensors.items()))
        del tensors
        await timed("sleep(2)", engine.sleep(2))
        await timed("wake_up (after level 2)", engine.wake_up())
        await timed("load_weights (after level 2)", engine.load_weights(model_dir))
        again = [o.outputs[0].token_ids for o in await engine.generate_batch(prompts, params)]
    return dict(rows=rows, outputs_equal_after_wake=before == after, outputs_equal_after_reload=before == again)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--workdir", default="/tmp/ourobatch-bench")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = ap.parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        model_dir = str(Path(args.workdir) / ("tiny" if args.tiny else "ouro-1.4b-random"))
        if not (Path(model_dir) / "config.json").exists():
            make_tiny_checkpoint(model_dir, seed=0, dtype=torch.bfloat16, **(TINY if args.tiny else OURO_1_4B))
    result = anyio.run(run, args, model_dir)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rl_ops.json").write_text(json.dumps(result, indent=1))
    lines = ["| operation | seconds | device used GiB | torch allocated GiB | torch reserved GiB |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['op']} | {r['seconds']:.2f} | {r.get('device_used_gib', 0):.2f} | "
                     f"{r.get('allocated_gib', 0):.2f} | {r.get('reserved_gib', 0):.2f} |")
    lines.append(f"\noutputs equal after sleep(1)/wake_up: {result['outputs_equal_after_wake']}; after "
                 f"sleep(2)/wake_up/load_weights: {result['outputs_equal_after_reload']}")
    (out / "rl_ops.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if result["outputs_equal_after_wake"] and result["outputs_equal_after_reload"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
