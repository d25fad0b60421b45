"""Does asking the L2 for part of the next decode attention's keys and values, while the GEMM side streams its
weights, shorten the N = 64 loop pass? (docs/benchmarks.md, session 28; engine/kv_prefetch.py's kernel.)

At 64 requests of 640 positions a layer spends ~44 us on its GEMM side against 23.9 us of weights, so half of the
HBM bandwidth is idle there, and ~80 us in the decode attention, bound by HBM. Every way runs one loop pass of the
engine's own model (ws_step64_probe's setup: Ouro-1.4B's layers, random weights, the engine's kernels, PDL) in
CUDA graphs, twice in turn, against the pass's bytes floor:
- kernels: the pass as the engine runs it;
- P:AT[:normal|:end]: the same pass with OUROBATCH_KV_PREFETCH at that value (engine/kv_prefetch_dispatch.py):
  engine/kv_prefetch.py's launch asks for P pages (of 16 positions) of every request's keys and values of each
  attention, before that layer's qkv kernel (AT=qkv), before the add + norm that ends the layer before (norm) or
  before the layer before's gate_up (gate_up); normal: the lines marked evict_normal instead of evict_last;
  end: the requests' last P pages instead of their first;
- attention / attention_pf{P}: the 24 attention launches alone, and each right after its prefetch (the L2's
  best case: no weights streamed between).
Every way's readout is compared with the kernels way's: a prefetch changes no value, so they must be equal to
the bit.

    python benchmarks/kv_prefetch_probe.py --out DIR [--rows 64] [--context 640] [--pages 1,2,3,4]
        [--at qkv,norm,gate_up] [--suffixes ,:normal,:end]   # :line: line prefetches instead of bulk ones
        [--persist-mb 0]   # first set aside this much L2 for evict_last lines (l2_reuse_probe.py's question)
    python benchmarks/kv_prefetch_probe.py --out DIR --pages 0 --persist-mb 16   # no prefetch way: the kernels'
        # pass and the attention alone, so nothing marks a line evict_last (what the set-aside alone costs)
    python benchmarks/kv_prefetch_probe.py --out DIR --best N   # the N fastest settings that beat kernels
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

AT = ("qkv", "norm", "gate_up")
ENV = "OUROBATCH_KV_PREFETCH"  # engine/kv_prefetch_dispatch.ENV
SUFFIXES = ("", ":normal", ":end")


class Probe:
    def __init__(self, rows: int, context: int) -> None:
        from ws_step64_probe import D, HEADS, decode_batch, engine_model  # Triton: imported where it measures

        self.model = engine_model()
        self.pool, self.meta = decode_batch(self.model.config, rows, context, 0.0)
        g = torch.Generator(device="cuda").manual_seed(3)
        self.h = torch.randn(rows, HEADS * D, generator=g, device="cuda").to(torch.bfloat16)
        self.q = torch.randn(rows, HEADS, D, generator=g, device="cuda").to(torch.bfloat16)
        self.outs: dict[str, torch.Tensor] = {}

    def kernels(self, name: str, setting: str = "0") -> None:
        """The engine's loop pass (engine/fused_pass.py) with OUROBATCH_KV_PREFETCH at `setting` for the call."""
        os.environ[ENV] = setting
        try:
            self.outs[name] = self.model.run_loops(self.h, self.meta, self.pool, 1, 1)[-1]
        finally:
            os.environ[ENV] = "0"

    def attention(self, name: str, pages: int = 0, line: bool = False) -> None:
        from engine.kv_prefetch import prefetch_pages
        from engine.triton_attention import triton_paged_attention

        m, scale = self.meta, self.q.shape[-1] ** -0.5
        for layer in range(self.pool.shape[1]):
            k, v = self.pool.block_plane(1, layer)
            if pages:
                prefetch_pages(k, v, m.block_tables, m.context_lens, pages, line=line)
            out = triton_paged_attention(self.q, k, v, m.block_tables, m.context_lens, m.query_start, 1, scale)
        self.outs[name] = out

    def ways(self, pages: list[int], ats: list[str], suffixes: tuple[str, ...] = SUFFIXES) -> dict:
        ways = {"kernels": lambda: self.kernels("kernels"), "attention": lambda: self.attention("attention")}
        for p in pages:
            ways[f"attention_pf{p}"] = lambda p=p: self.attention(f"attention_pf{p}", p)
            if any("line" in s for s in suffixes):
                ways[f"attention_pf{p}:line"] = lambda p=p: self.attention(f"attention_pf{p}:line", p, True)
            for at in ats:
                for suffix in suffixes:
                    setting = f"{p}:{at}{suffix}"
                    ways[setting] = lambda setting=setting: self.kernels(setting, setting)
        return ways

    def check(self, name: str) -> dict:
        base = "attention" if name.startswith("attention") else "kernels"
        out, ref = self.outs[name], self.outs.get(base)
        return {"finite": bool(torch.isfinite(out.float()).all()),
                "equal_to_" + base: None if ref is None else bool(torch.equal(out, ref))}


def parse_pages(text: str) -> list[int] | None:
    """--pages: "0" -> [] (no prefetch way), "1,3" -> [1, 3]; None for anything else (a count under 1 beside others,
    not an integer)."""
    if text.strip() == "0":
        return []
    try:
        pages = [int(v) for v in text.split(",")]
    except ValueError:
        return None
    return pages if pages and min(pages) >= 1 else None


def floor_ms(model, rows: int, context: int, copy_tbps: float) -> float:
    """The pass's bytes floor: its layers' weights and norms, and each layer's keys and values read once."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for layer in model.model.layers for p in layer.parameters())
    kv = 2 * cfg.num_hidden_layers * rows * context * cfg.num_key_value_heads * cfg.head_dim * 2
    return (weights + kv) / (copy_tbps * 1e9)


def best(result: dict, count: int) -> list[str]:
    """The `count` settings of the fastest passes (their best round) that equalled the kernels way's readout and
    beat its best round: gpu_suite.sh kv_prefetch runs the decode harness with them."""
    base = min(result["ways"].get("kernels", [float("inf")]))
    timed = {name: min(ms) for name, ms in result["ways"].items()
             if name[0].isdigit() and result["checks"].get(name, {}).get("equal_to_kernels") and min(ms) < base}
    return sorted(timed, key=timed.get)[:count]


def table(result: dict) -> str:
    """The ways' best rounds against the kernels way's, fastest first."""
    floor, base = result["floor_ms"], min(result["ways"].get("kernels", [float("nan")]))
    lines = [f"| way ({result['rows']} requests x {result['context']} positions) | ms a pass (two rounds) | x the "
             f"floor ({floor:.3f} ms) | us a layer vs kernels | equal |", "|---|---|---|---|---|"]
    layers = result.get("layers", 24)
    for name, ms in sorted(result["ways"].items(), key=lambda kv: min(kv[1])):
        check = result["checks"].get(name, {})
        equal = next((v for k, v in check.items() if k.startswith("equal_to_")), None)
        gain = "-" if name.startswith("attention") else f"{(min(ms) - base) * 1e3 / layers:+.2f}"
        lines.append(f"| {name} | {' / '.join(f'{v:.3f}' for v in ms)} | {min(ms) / floor:.3f} | {gain} | {equal} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--best", type=int, default=0, help="print the N best settings of --out's kv_prefetch.json")
    ap.add_argument("--out")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--pages", default="1,2,3,4", help="pages a prefetch asks for, comma-separated; 0: no prefetch "
                    "way, only the kernels' pass and the attention alone (with --persist-mb: the set-aside's own cost)")
    ap.add_argument("--at", default=",".join(AT))
    ap.add_argument("--suffixes", default=",".join(SUFFIXES),
                    help="each setting's tails, comma-separated (an empty one: none), from :normal, :end, :line")
    ap.add_argument("--persist-mb", type=int, default=0, help="set aside this much L2 for evict_last lines first "
                    "(the CUDA context's persisting L2 limit; l2_reuse_probe.py)")
    args = ap.parse_args(argv)
    if args.best:
        print(" ".join(best(json.loads((Path(args.out or ".") / "kv_prefetch.json").read_text()), args.best)))
        return 0
    pages = parse_pages(args.pages)
    if pages is None:
        ap.error(f"--pages: 0, or a comma list of page counts of at least 1; got {args.pages!r}")
    if args.persist_mb < 0:
        ap.error(f"--persist-mb: 0 (none) or more MB; got {args.persist_mb}")
    ats = [a for a in args.at.split(",") if a]
    if not ats or set(ats) - set(AT):
        ap.error(f"--at: one or more of {', '.join(AT)}")
    suffixes = tuple(args.suffixes.split(","))
    if any(set(s.split(":")[1:]) - {"normal", "end", "line"} or (s and not s.startswith(":")) for s in suffixes):
        ap.error(f"--suffixes: comma-separated tails made of :normal, :end and :line; got {args.suffixes!r}")
    from phase_probe import COPY_TBPS, out_and_sms, time_in_turn  # Triton: after the flags are checked
    from phase_probe_ws import first_call_or_exit

    out, _ = out_and_sms(ap, args.out)
    persisting = 0
    if args.persist_mb:
        from l2_reuse_kernels import set_persisting_l2
        persisting = set_persisting_l2(args.persist_mb << 20)
    p = Probe(args.rows, args.context)
    ways = p.ways(pages, ats, suffixes)
    floor = floor_ms(p.model, args.rows, args.context, COPY_TBPS)
    result = {"device": torch.cuda.get_device_name(0), "rows": args.rows, "context": args.context,
              "layers": p.model.config.num_hidden_layers,
              "floor_ms": floor, "persisting_l2_bytes": persisting, "checks": {}, "ways": {}}
    for name, fn in ways.items():
        first_call_or_exit(fn, f"kv_prefetch {name}")
        result["checks"][name] = p.check(name)
    print(json.dumps(result["checks"]), flush=True)
    time_in_turn(ways, result, out / "kv_prefetch.json", lambda ms: f" ({ms / floor:.3f}x the {floor:.3f} ms floor)")
    (out / "kv_prefetch.md").write_text(table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
