"""engine/gluon_layers.py's loop-pass launch alone, at Ouro-1.4B's shape: us per layer against the bytes floor
(weights + the layer's keys and values at 4.3 TB/s), with the history's pages contiguous in a small pool or
scattered over a large one (as the engine's pool fills the GPU). docs/benchmarks.md (session 18) compares it with
the probe it grew from (the same work without RoPE, the key / value write, paged tables and two of Ouro's norms).

    python benchmarks/layers_probe.py --out DIR [--rows 8] [--context 640] [--pool-gb 0,60]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from phase_probe import COPY_TBPS, timed  # noqa: E402
from phase_probe_ws import first_call_or_exit  # noqa: E402

H, INTER, HEADS, D, PAGE, LAYERS = 2048, 5632, 16, 128, 16, 24


def stack(seed: int = 0):
    from engine.layer_stack import LayerStack

    g = torch.Generator(device="cuda").manual_seed(seed)

    def w(n, k):
        return (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(torch.bfloat16)

    norms = (1 + 0.1 * torch.randn(4, LAYERS, H, generator=g, device="cuda")).to(torch.bfloat16)
    inv_freq = 1e6 ** (-torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D)
    return LayerStack(w(LAYERS * 3 * H, H), w(LAYERS * H, H), w(LAYERS * 2 * INTER, H), w(LAYERS * H, INTER), norms,
                      norms[0, 0].clone(), inv_freq, LAYERS)


def problem(rows: int, context: int, pool_gb: float, seed: int = 1):
    """A loop's planes [layers, blocks + 1, page, heads, d] and decode meta: `rows` requests at `context`."""
    pages = -(-context // PAGE)
    block_bytes = 2 * LAYERS * PAGE * HEADS * D * 2
    blocks = max(rows * pages, int(pool_gb * 2**30 / block_bytes))
    g = torch.Generator().manual_seed(seed)
    k = torch.empty(LAYERS, blocks + 1, PAGE, HEADS, D, dtype=torch.bfloat16, device="cuda")
    v = torch.empty_like(k)
    ids = torch.randperm(blocks, generator=g)[:rows * pages] if pool_gb else torch.arange(rows * pages)
    tables = ids.view(rows, pages).to(torch.int32).cuda()
    for t in (k, v):  # only the pages read need values
        t[:, ids.cuda()] = torch.randn(LAYERS, rows * pages, PAGE, HEADS, D, device="cuda").to(torch.bfloat16)
    pos = torch.full((rows,), context - 1, dtype=torch.int64, device="cuda")
    slots = tables[:, -1].to(torch.int64) * PAGE + (context - 1) % PAGE
    meta = SimpleNamespace(positions=pos, slots=slots, block_tables=tables,
                           context_lens=torch.full((rows,), context, dtype=torch.int32, device="cuda"))
    return k, v, meta


def main(argv=None) -> int:
    from engine.gluon_layers import launch_layers

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--pool-gb", default="0,60", help="pool sizes (0: just the pages read, contiguous)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    st = stack()
    h = torch.randn(args.rows, H, device="cuda").to(torch.bfloat16)
    weights = sum(t.numel() * 2 for t in (st.wq, st.wo, st.wgu, st.wd))
    kv = 2 * LAYERS * args.rows * args.context * HEADS * D * 2
    floor_ms = (weights + kv) / (COPY_TBPS * 1e9)
    result = {"device": torch.cuda.get_device_name(0), "rows": args.rows, "context": args.context,
              "floor_ms": floor_ms, "ways": {}}
    for gb in (float(x) for x in args.pool_gb.split(",")):
        k, v, meta = problem(args.rows, args.context, gb)
        fn = lambda k=k, v=v, meta=meta: launch_layers(h, st, k, v, meta, st.inv_freq, 1e-6, D**-0.5)  # noqa: E731
        first_call_or_exit(fn, f"layers pool {gb} GB")
        for r in range(2):
            ms = timed(fn)
            result["ways"].setdefault(f"pool_{gb:g}gb", []).append(ms)
            print(f"pool {gb:g} GB round {r}: {ms:.3f} ms = {ms * 1e3 / LAYERS:.2f} us/layer (floor "
                  f"{floor_ms * 1e3 / LAYERS:.2f})", flush=True)
        (out / "layers_probe.json").write_text(json.dumps(result, indent=1))
        del k, v
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
