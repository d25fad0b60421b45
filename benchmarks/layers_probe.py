"""engine/gluon_layers.py's loop-pass launch alone, at Ouro-1.4B's shape: us per layer against the bytes floor
(weights + the layer's keys and values at 4.3 TB/s), with the history's pages contiguous in a small pool or
scattered over a large one (as the engine's pool fills the GPU). docs/benchmarks.md (session 18) compares it with
the probe it grew from (the same work without RoPE, the key / value write, paged tables and two of Ouro's norms).

    python benchmarks/layers_probe.py --out DIR [--rows 8] [--context 640] [--pool-gb 0,60] [--trace]

--trace also runs the measuring build (gluon_layers_stage.stamp: each CTA's global timer at its phase events) and
prints where a layer's time goes: each phase's span on the critical path (from the grid's end of the phase
before to the grid's end of this one) and, inside it, how long CTAs take to see a count, stage and attend.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

H, INTER, HEADS, D, PAGE, LAYERS = 2048, 5632, 16, 128, 16, 24
# gluon_layers_stage.stamp's events: the stager's (0-9, 14 after the readout) and the consumer's (10-13)
DOWN_SEEN, SAND_A, QKV_SEEN, ATTENDED, ATTN_SEEN, ATTN_STAGED, O_SEEN, SAND_B, GU_SEEN, ACT_STAGED = range(10)
QKV_DONE, O_DONE, GU_DONE, DOWN_DONE, READOUT = 10, 11, 12, 13, 14
SAND_A_SUB, SAND_B_SUB, ATTEND_SUB = 16, 20, 24  # inside: 4 stamps a staging, 2 in the attention


def trace_table(t) -> dict[str, float]:
    """A measuring launch's stamps [CTAs, layers, events] (ns, int64 tensor) -> us a layer, the mean over layers 1..:
    each phase's span on the critical path (grid end of the phase before -> grid end of this one), the span's parts
    (the CTAs' median time to see the count, stage, attend; the slowest CTA's attention) and the whole launch."""
    t = t.double()
    end = {k: t[:, :, k].max(dim=0).values for k in (QKV_DONE, ATTENDED, O_DONE, GU_DONE, DOWN_DONE)}
    prev_down = end[DOWN_DONE][:-1]  # layer l's start: layer l - 1's down, complete

    def span(a, b):
        return a[1:] - b

    def med(a, b):  # the CTAs' median of stamp a - stamp b, per layer from 1
        return (t[:, 1:, a] - t[:, 1:, b]).median(dim=0).values

    def seen(a, grid_end):  # how long after the grid's end a CTA sees it (median)
        return (t[:, 1:, a] - grid_end[None, :]).median(dim=0).values

    rows = {
        "qkv (sandwich, qkv GEMM)": span(end[QKV_DONE], prev_down),
        "  down count seen": seen(DOWN_SEEN, prev_down),
        "  sandwich A": med(SAND_A, DOWN_SEEN),
        "attention": span(end[ATTENDED], end[QKV_DONE][1:]),
        "  qkv count seen": seen(QKV_SEEN, end[QKV_DONE][1:]),
        "  attend (median CTA)": med(ATTENDED, QKV_SEEN),
        "o (stage, o GEMM)": span(end[O_DONE], end[ATTENDED][1:]),
        "  attention count seen": seen(ATTN_SEEN, end[ATTENDED][1:]),
        "  attention rows staged": med(ATTN_STAGED, ATTN_SEEN),
        "gate_up (sandwich, GEMM)": span(end[GU_DONE], end[O_DONE][1:]),
        "  o count seen": seen(O_SEEN, end[O_DONE][1:]),
        "  sandwich B": med(SAND_B, O_SEEN),
        "down (stage, GEMM)": span(end[DOWN_DONE], end[GU_DONE][1:]),
        "  gate_up count seen": seen(GU_SEEN, end[GU_DONE][1:]),
        "  act rows staged": med(ACT_STAGED, GU_SEEN),
    }
    if t.shape[2] > ATTEND_SUB + 1:  # the stamps inside the stagings and the attention (from the event before)
        for name, first, seen_event in (("sandwich A", SAND_A_SUB, DOWN_SEEN), ("sandwich B", SAND_B_SUB, O_SEEN)):
            for k, what in enumerate(("copies issued", "rms(y) ready", "chunk 0 out", "every chunk out")):
                rows[f"    {name}: {what}"] = med(first + k, seen_event)
        rows["    attend: RoPE, new key / value"] = med(ATTEND_SUB, QKV_SEEN)
        rows["    attend: the pages"] = med(ATTEND_SUB + 1, ATTEND_SUB)
    out = {name: float(v.mean()) / 1e3 for name, v in rows.items()}
    out["layer (down to down)"] = float((end[DOWN_DONE][1:] - prev_down).mean()) / 1e3
    out["launch (first stamp to last readout)"] = float(t[:, -1, READOUT].max() - t[:, 0, DOWN_SEEN].min()) / 1e3
    return out


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


def traced(fn, path: Path, launches: int = 5) -> dict[str, float]:
    """`launches` measuring launches (fn(trace=...)): each one's trace_table, the mean printed; stamps saved."""
    from engine import layers_dispatch as ld

    traces, tables = [], []
    for _ in range(launches):
        t = torch.zeros(torch.cuda.get_device_properties(0).multi_processor_count, LAYERS, ld.TRACE_EVENTS,
                        dtype=torch.int64, device="cuda")
        fn(trace=t)
        torch.cuda.synchronize()
        traces.append(t.cpu())
        tables.append(trace_table(traces[-1]))
    torch.save(torch.stack(traces), path)
    mean = {k: sum(tb[k] for tb in tables[1:]) / (launches - 1) for k in tables[0]}  # the first: a cold launch
    steps = torch.stack(traces)[..., :14].diff(dim=-1).abs().flatten()
    mean["timer step (smallest nonzero difference), ns"] = float(steps[steps > 0].min())
    print("| where a layer's time goes (measuring build) | us |\n|---|---|")
    for name, v in mean.items():
        print(f"| {name} | {v:.2f} |", flush=True)
    return mean


def main(argv=None) -> int:
    from phase_probe import COPY_TBPS, timed  # Triton: imported here (tests read trace_table without it)
    from phase_probe_ws import first_call_or_exit

    from engine import layers_dispatch as ld
    from engine.gluon_layers import launch_layers

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--pool-gb", default="0,60", help="pool sizes (0: just the pages read, contiguous)")
    ap.add_argument("--trace", action="store_true", help="also the measuring build: where a layer's time goes")
    ap.add_argument("--stages", default="", help="ring slots to compare (layers_dispatch.STAGES; default: its own)")
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
        fn = lambda k=k, v=v, meta=meta, **kw: launch_layers(h, st, k, v, meta, st.inv_freq, 1e-6,  # noqa: E731
                                                              D**-0.5, **kw)
        for stages in [int(x) for x in args.stages.split(",") if x] or [ld.STAGES]:
            ld.STAGES = stages  # launch_layers reads it at each call
            name = f"pool_{gb:g}gb" + (f"_stages{stages}" if args.stages else "")
            first_call_or_exit(fn, f"layers {name}")
            for r in range(2):
                ms = timed(fn)
                result["ways"].setdefault(name, []).append(ms)
                print(f"{name} round {r}: {ms:.3f} ms = {ms * 1e3 / LAYERS:.2f} us/layer (floor "
                      f"{floor_ms * 1e3 / LAYERS:.2f})", flush=True)
            if args.trace:
                result.setdefault("trace", {})[name] = traced(fn, out / f"trace_{name}.pt")
        (out / "layers_probe.json").write_text(json.dumps(result, indent=1))
        del k, v
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
