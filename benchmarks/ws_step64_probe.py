"""The N = 64 decode loop pass with a warp-specialized launch per layer between the decode attention calls: does
it beat the engine's kernels? (docs/benchmarks.md, session 27). The full-depth decode step at N = 64 is four such
passes; issue 22's row wants it within 1.2x of its bytes floor.

Each way runs one pass of Ouro-1.4B's 24 layers at `rows` requests of `context` keys each, in CUDA graphs, every
way twice in turn, on one pool of keys and values (pages scattered over it), against the pass's floor (the
layers' weights and each layer's keys and values at 4.3 TB/s):
- kernels: the engine's own model (random weights, fused, Triton backend) running the pass: at these rows
  engine/fused_pass.py run_loops' kernels (qkv + RoPE + KV store, the decode attention, o_proj's split-K
  partials + add + norm + norm, gate_up + SiLU, down's partials + add + norm + norm), with PDL as in the engine;
- exact: the same model on the same pool with OUROBATCH_DECODE_LAYERS64 on: engine/layers64.py's launches
  (Ouro's layer exactly: sandwich norms, RoPE, the key / value store) between the same decode attention calls;
  its readout is compared with the kernels way's (`vs_kernels`: same weights, same history, bf16 roundings apart);
- ws, ws_nopdl: per layer the same decode attention launch, then ws_layer64_kernel for that layer alone (its
  qkv, o, gate_up and down phases, o's input the attention's output), with PDL (the layer launch's loader streams
  weights before the wait) and without;
- attention: the attention launches alone; w: the 24 layer launches alone; chain: the 24 layers as one launch
  (ws_layer64_probe.py's way, its counts zeroed as there).
The ws ways time the design, not the model: the layer kernel has no RoPE or KV store, and Ouro's sandwich norms
are plain ones there (its math: ws_layer64_probe.py and tests/test_ws_layer64_emulated.py). Here every way's
output is checked to be finite and the chain way's stages against its torch reference; a way that fails is reported
and left out, a hang ends the process with the earlier ways' results kept. tests/test_ws_step64_emulated.py checks
the per-layer launches' arguments and the engine side's pieces on the CPU.

    python benchmarks/ws_step64_probe.py --out DIR [--rows 64] [--context 640] [--pool-gb 0] [--way 8:4:11]
        [--ways kernels,exact,ws,ws_nopdl,attention,w,chain]
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
from ws_chain64_wg import BOX_K, ROWS, TILE_N, box_layout  # noqa: E402
from ws_layer64_probe import check_way, make_chain  # noqa: E402
from ws_layer64_probe import scratch as layer_scratch  # noqa: E402 - per layer counts: a pass zeroes them once

HEADS, D, PAGE = 16, 128, 16  # Ouro-1.4B's heads; the engine's pages
LAYERS64 = "OUROBATCH_DECODE_LAYERS64"  # engine/layers64_dispatch.ENV
WAYS = ("kernels", "exact", "ws", "ws_nopdl", "attention", "w", "chain")


def floor_ms(chain, context: int, copy_tbps: float) -> float:
    """The pass's bytes floor: its layers' weights and norms, and each layer's keys and values read once."""
    kv = 2 * chain.layers * chain.rows * context * chain.h * 2
    return (chain.weight_bytes + kv) / (copy_tbps * 1e9)


def layer_args(chain, layer: int, o_in: torch.Tensor, scratch, stages: int, s_in: int,
               s_down: int) -> tuple[tuple, dict]:
    """ws_layer64_kernel's arguments for `layer` alone (num_layers 1): descriptors over that layer's weights, its
    slots and counts from `layer` on, o's input `o_in` ([ROWS rows, >= hidden columns], read through TMA)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    h, qkv, inter, sms = chain.h, chain.qkv_cols, chain.inter, scratch[2].shape[1]
    check_way(h, inter, sms, stages, s_in, s_down)
    if o_in.dim() != 2 or o_in.shape[0] != ROWS or o_in.shape[1] < h or o_in.stride(1) != 1:
        raise ValueError(f"o_in must be [{ROWS}, >= {h}] with unit column stride, got {tuple(o_in.shape)}")

    def weights(w, rows):
        return TensorDescriptor.from_tensor(w[layer * rows:(layer + 1) * rows], [TILE_N, BOX_K], box_layout())

    def rows_box(t):
        return TensorDescriptor.from_tensor(t, [ROWS, BOX_K], box_layout())

    part, rowsq, gcnt = scratch
    q = 4 * layer
    args = (weights(chain.wq, qkv), weights(chain.wo, h), weights(chain.wgu, 2 * inter), weights(chain.wd, h),
            rows_box(o_in), rows_box(chain.act[layer]), chain.hm[layer:], chain.d[layer:], chain.qkv[layer:],
            chain.o[layer:], chain.act[layer:], chain.n1[layer:], chain.n2[layer:], part, rowsq[q:], chain.cnt[q:],
            gcnt[q:], 1, chain.rows)
    return args, dict(H=h, QKV=qkv, INTER=inter, PW=part.shape[2], S_IN=s_in, S_DOWN=s_down, STAGES=stages,
                      num_warps=4)


def engine_model(layers: int = 24, device: str = "cuda", heads: int = HEADS, inter: int = 5632,
                 dtype: torch.dtype = torch.bfloat16, backend: str = "triton", seed: int = 2):
    """The engine's model (Ouro-1.4B's layer shapes by default; heads of 128, a small vocabulary: no head runs
    here), random weights (norms near 1, projections at unit output scale) in `dtype`, fused and on `backend` as an
    engine builds it (the probe runs its loop 1 only)."""
    from engine.config import OuroConfig
    from engine.model import OuroForCausalLM

    cfg = OuroConfig.from_dict(dict(model_type="ouro", vocab_size=256, hidden_size=heads * D, intermediate_size=inter,
                                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                    head_dim=D, total_ut_steps=2))
    with torch.device(device):
        model = OuroForCausalLM(cfg, init_weights=False)
    g = torch.Generator(device=device).manual_seed(seed)
    for t in model.parameters():
        t.data = (1 + 0.1 * torch.randn(t.shape, generator=g, device=device) if t.dim() == 1
                  else torch.randn(t.shape, generator=g, device=device) / t.shape[-1] ** 0.5)
    model = model.to(dtype)
    model.fuse_projections()
    model.set_attention_backend(backend)
    return model


def decode_batch(cfg, rows: int, context: int, pool_gb: float, seed: int = 1, device: str = "cuda"):
    """A one-loop pool of random keys and values and decode metadata: `rows` requests of `context` positions (the
    newest the step's row) on pages scattered over the pool (`pool_gb`: its size; 0: just the pages read)."""
    import random

    from engine.batch import BlockTables, SeqSpan, uniform_meta
    from engine.kv_cache import KVPool

    pages = -(-context // PAGE)
    blocks = max(rows * pages, int(pool_gb * 2**30 / KVPool.bytes_per_block(cfg, PAGE, torch.bfloat16)))
    pool = KVPool(1, cfg.num_hidden_layers, blocks, PAGE, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16,
                  device)  # loop 1's planes only
    g = torch.Generator(device=device).manual_seed(seed)
    for t in (pool.k, pool.v):
        t.copy_(torch.randn(t.shape, generator=g, device=device))
    free = list(range(blocks))
    random.Random(seed).shuffle(free)
    tables = BlockTables(rows, pages, pool.scratch_block, torch.device(device))
    spans = []
    for i in range(rows):
        ids = tuple(free.pop() for _ in range(pages))
        tables.row(f"r{i}", ids)
        spans.append(SeqSpan(i, 1, context, ids))
    row_ids = torch.tensor([tables.row_of[f"r{i}"] for i in range(rows)], device=device)
    starts = torch.full((rows,), context - 1, dtype=torch.int64, device=device)
    return pool, uniform_meta(tables, row_ids, starts, 1, PAGE, spans)


class Pass:
    """One loop pass on one pool: the engine's model through its kernels (kernels) or through engine/layers64.py's
    launches (exact), and the layer kernel's weights (ws_layer64_probe's chain: 64-row slots) with the engine's
    decode attention launches between its layers (ws, attention, w) or alone (chain)."""

    def __init__(self, rows: int, context: int, pool_gb: float, sms: int, way: tuple[int, int, int]) -> None:
        from engine import pdl

        self.model = engine_model()
        self.chain = make_chain(rows, self.model.config.num_hidden_layers)
        self.pool, self.meta = decode_batch(self.model.config, rows, context, pool_gb)
        self.sms, self.way, self.pdl = sms, way, pdl.launch_kwargs(torch.device("cuda"))
        self.scratch = layer_scratch(self.chain, sms, way[1], way[2])
        self.h = self.chain.hm[0, :rows].clone()
        self._attention_launches()

    def _attention_launches(self) -> None:
        """Per layer the engine's decode attention as it dispatches the call (triton_paged_attention: at 64
        requests of Ouro-1.4B's heads, Triton's paged kernel), its q the layer before's qkv slot (the last layer's
        for layer 0), its rows into the layer launch's o input."""
        from engine.triton_attention import triton_paged_attention

        c, m = self.chain, self.meta
        self.attention, self.layers, self.o_in = [], [], []
        for layer in range(c.layers):
            q = c.qkv[layer - 1, :c.rows, :c.h].view(c.rows, HEADS, D)
            o_in = torch.zeros(ROWS, c.h, dtype=q.dtype, device="cuda")  # 64 rows for the layer's TMA box
            k, v = self.pool.block_plane(1, layer)
            out = o_in[:c.rows].view(c.rows, HEADS, D)
            self.attention.append(lambda q=q, k=k, v=v, out=out: triton_paged_attention(
                q, k, v, m.block_tables, m.context_lens, m.query_start, 1, D**-0.5, None, out))
            self.o_in.append(o_in)
            self.layers.append(layer_args(c, layer, o_in, self.scratch, *self.way))

    def run_attention(self, layer: int) -> None:
        self.attention[layer]()

    def run_layer(self, layer: int, use_pdl: bool) -> None:
        from ws_layer64 import ws_layer64_kernel

        args, constexprs = self.layers[layer]
        pdl = self.pdl if use_pdl else {"USE_PDL": False}
        ws_layer64_kernel[(self.sms,)](*args, **constexprs, **pdl)

    def ws(self, attention: bool = True, layers: bool = True, use_pdl: bool = True) -> None:
        self.chain.cnt.zero_()
        self.scratch[2].zero_()
        for layer in range(self.chain.layers):
            if attention:
                self.run_attention(layer)
            if layers:
                self.run_layer(layer, use_pdl)

    def kernels(self) -> None:
        """The engine's loop pass: its model's run_loops for loop 1 (at these rows, fused_pass.run_loops' kernels)."""
        os.environ[LAYERS64] = "0"
        self.out = self.model.run_loops(self.h, self.meta, self.pool, 1, 1)[-1]

    def exact(self) -> None:
        """The same with engine/layers64.py's launches (OUROBATCH_DECODE_LAYERS64 on for the call)."""
        os.environ[LAYERS64] = "1"
        try:
            self.exact_out = self.model.run_loops(self.h, self.meta, self.pool, 1, 1)[-1]
        finally:
            os.environ[LAYERS64] = "0"

    def chain_launch(self) -> None:
        from ws_layer64_probe import run

        run(self.chain, self.sms, *self.way)

    def ways(self, names: list[str]) -> dict:
        table = {"kernels": self.kernels, "exact": self.exact, "ws": self.ws,
                 "ws_nopdl": lambda: self.ws(use_pdl=False),
                 "attention": lambda: self.ws(layers=False), "w": lambda: self.ws(attention=False),
                 "chain": self.chain_launch}
        return {n: table[n] for n in check_ways(names)}

    def check(self, name: str) -> dict:
        """After a way's first call: whether its last output is finite (the readout for kernels, the last
        attention's rows, the last layer's residual) and, for chain, every stage of its first and last layers
        and its output against the chain's torch reference (ws_layer64_probe's check: within bf16's rounding)."""
        from phase_probe import rel_err

        c = self.chain
        outs = {"kernels": lambda: self.out, "attention": lambda: self.o_in[-1][:c.rows],
                "exact": lambda: self.exact_out}
        out = outs.get(name, lambda: c.hm[-1, :c.rows])()
        result = {"finite": bool(torch.isfinite(out.float()).all())}
        if name == "exact" and getattr(self, "out", None) is not None:
            result["vs_kernels"] = rel_err(out, self.out)
        if name == "chain":
            ref = c.reference()
            result.update(output=rel_err(c.output(), ref), first=c.stage_errors(0), last=c.stage_errors(c.layers - 1))
        return result


def check_ways(names: list[str]) -> list[str]:
    unknown = [n for n in names if n not in WAYS]
    if unknown or not names:
        raise ValueError(f"--ways: {unknown or 'none'} not among {', '.join(WAYS)}")
    return names


def parse_way(text: str) -> tuple[int, int, int]:
    values = [int(v) for v in text.split(":")] if text.strip() else []
    if len(values) != 3:
        raise ValueError(f"--way {text!r}: stages:s_in:s_down (16 KB weight slots, the K splits of qkv / o / gate_up "
                         "and of down)")
    return values[0], values[1], values[2]


def measure(p: Pass, ways: dict, floor: float, out: Path) -> dict:
    """Every way's first call under a deadline, then all of them twice in turn: ms per pass and x the floor."""
    from phase_probe import time_in_turn
    from phase_probe_ws import first_call_or_exit

    result = {"device": torch.cuda.get_device_name(0), "rows": p.chain.rows, "layers": p.chain.layers,
              "floor_ms": floor, "way": p.way, "ways": {}, "checks": {}}
    for name, fn in list(ways.items()):
        try:
            first_call_or_exit(fn, f"ws_step64 {name}")
            result["checks"][name] = p.check(name)
        except Exception as e:  # a way that cannot run is reported and left out; the others still run
            result["checks"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            del ways[name]
        print(f"{name}: {result['checks'][name]}", flush=True)
        (out / "ws_step64.json").write_text(json.dumps(result, indent=1))  # kept if a later way hangs
    return time_in_turn(ways, result, out / "ws_step64.json",
                        lambda ms: f" ({ms / floor:.3f}x the {floor:.3f} ms floor)")


def table(result: dict) -> str:
    floor = result["floor_ms"]
    lines = [f"| way ({result['rows']} rows, {result['layers']} layers) | ms a pass (two rounds) | x the floor "
             f"({floor:.3f} ms) | check |", "|---|---|---|---|"]
    for name, check in result["checks"].items():
        ms = result["ways"].get(name)
        times = (" / ".join(f"{v:.3f}" for v in ms), f"{min(ms) / floor:.3f}") if ms else ("-", "-")
        lines.append(f"| {name} | {times[0]} | {times[1]} | {check} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from phase_probe import COPY_TBPS, out_and_sms

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--pool-gb", type=float, default=0.0, help="0: just the pages read, contiguous")
    ap.add_argument("--way", default="8:4:11", help="the layer kernel's stages:s_in:s_down")
    ap.add_argument("--ways", default=",".join(WAYS))
    args = ap.parse_args(argv)
    out, sms = out_and_sms(ap, args.out)
    p = Pass(args.rows, args.context, args.pool_gb, sms, parse_way(args.way))
    result = measure(p, p.ways(args.ways.split(",")), floor_ms(p.chain, args.context, COPY_TBPS), out)
    result.update(context=args.context, pool_gb=args.pool_gb)
    (out / "ws_step64.json").write_text(json.dumps(result, indent=1))
    (out / "ws_step64.md").write_text(table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
