"""Does o_proj starting on each K split as soon as its heads' attention is done shorten the N = 64 decode pass?

With programmatic dependent launch every kernel's programs wait for the whole kernel before (engine/pdl.py), so
o_proj's split-K partials start only after the decode attention's last program, though split s reads only its
heads' outputs, and the attention's grid runs a head's requests together (sequence-fastest order). Here
(benchmarks/flow_kernels.py) the attention counts its finished programs per kv head and o_proj's programs wait for
their split's counts instead of the grid: a dataflow edge, the rest of the pass as the engine runs it. The counts
are zeroed once a pass (one memset); each layer has its own. Measured on an H100 (session 38, docs/benchmarks.md):
a tie, since the heads end within ~1 us of each other (--trace); the fold ways lose 0.9-2.3 us a layer.

Ways (one loop pass of the engine's model, its kernels, PDL, a CUDA graph, twice in turn; every readout compared
with `kernels`):
    kernels       the engine's loop pass (fused_pass.run_loops)
    mirror:S      this probe's pass with the engine's attention and o_proj in S K splits (mirror:4 is `kernels`)
    flow:S        the same with the counted attention and o_proj waiting on the counts
    flow:hA-B-..  o_proj's splits uneven, starting at kv heads 0, A, B, ... (a small last split: the heads the
                  attention finishes last)
    fold:o|d|od   o_proj's (o), down_proj's (d) or both split-K launches with the add + norm after them in the same
                  launch (flow_kernels.partials_norm_kernel: the last programs to finish run the rows' norms)
--trace also replays each flow way once with both kernels stamping the GPU's timer (flow_kernels' STAMP): when
each kv head's last attention program ends, and when o_proj's programs start, see their counts and end, against
the attention's end (medians over the layers).

    python benchmarks/flow_probe.py --out DIR [--rows 64] [--context 640] [--ways kernels,flow:4,...] [--trace]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_WAYS = ("kernels", "mirror:4", "flow:4", "fold:o", "fold:d", "fold:od")


def parse_way(name: str) -> tuple[str, int, tuple[int, ...]]:
    """A --ways entry: ("kernels", 0, ()), (mirror | flow, S, ()) with S a power of two from 1 to 64,
    ("flow", S, (A, B, ...)) for flow:hA-B-... (S - 1 increasing kv heads past 0), or ("fold", 0, ("o", "d"))
    for fold:od (o, d or both)."""
    if name == "kernels":
        return name, 0, ()
    kind, _, splits = name.partition(":")
    if kind == "fold" and splits in ("o", "d", "od"):
        return kind, 0, tuple(splits)
    if kind == "flow" and splits.startswith("h"):
        heads = tuple(int(v) for v in splits[1:].split("-") if v.isdigit())
        if len(heads) == len(splits[1:].split("-")) and all(a < b for a, b in zip((0, *heads), heads)):
            return kind, len(heads) + 1, heads
    elif kind in ("mirror", "flow") and splits.isdigit() and int(splits) in (1, 2, 4, 8, 16, 32, 64):
        return kind, int(splits), ()
    raise ValueError(f"--ways: {name!r} is none of 'kernels', mirror:S / flow:S with S a power of two, 1-64, or "
                     "flow:hA-B-... with increasing kv heads past 0, or fold:o, fold:d, fold:od")


class FlowPass:
    """One loop pass (loop 1) of the engine's model over a decode batch, o_proj's input edge as a way says."""

    def __init__(self, rows: int, context: int) -> None:
        from ws_step64_probe import D, HEADS, decode_batch, engine_model

        from engine.attention_dispatch import choose_config
        from engine.fused_pass import inv_freq
        from engine.gemm_dispatch import gemm_config

        self.model = engine_model()
        cfg = self.model.config
        self.gemm = gemm_config(rows)
        self.pool, self.meta = decode_batch(cfg, rows, context, 0.0)
        g = torch.Generator(device="cuda").manual_seed(3)
        self.h = torch.randn(rows, HEADS * D, generator=g, device="cuda").to(torch.bfloat16)
        self.freqs = inv_freq(self.model, self.h.device)
        self.launch = choose_config(rows, cfg.num_key_value_heads, 1, cfg.head_dim,
                                    torch.cuda.get_device_properties(0).multi_processor_count)
        self.counts = torch.zeros(cfg.num_hidden_layers, cfg.num_key_value_heads, dtype=torch.int32, device="cuda")
        self.tickets = torch.zeros(cfg.num_hidden_layers, 2, dtype=torch.int32, device="cuda")
        self.head_cols = cfg.head_dim * (cfg.num_attention_heads // cfg.num_key_value_heads)
        self.outs: dict[str, torch.Tensor] = {}
        self.starts: dict[tuple, torch.Tensor] = {}

    def kernels(self) -> None:
        self.outs["kernels"] = self.model.run_loops(self.h, self.meta, self.pool, 1, 1)[-1]

    def run(self, name: str, flow: bool, splits: int, heads: tuple[int, ...] = (), stamps=None,
            fold: tuple[str, ...] = ()) -> None:
        """The pass, o_proj in `splits` K splits (starting at kv heads `heads` where given), through the counted
        edge where `flow`; stamps: (attention [layers, programs, 2], o_proj [layers, programs, 3]) int64 or None;
        fold: the split-K GEMMs ("o", "d") whose add + norm runs in their own launch (splits: the engine's)."""
        from engine import fused_pass
        from engine import triton_fused as fused

        layers, eps, cfg = self.model.model.layers, self.model.config.rms_norm_eps, self.model.config
        h, x = self.h, fused.rms_norm(self.h, layers[0].input_layernorm.weight, eps)
        starts = self._starts(splits, heads) if flow else None
        if flow:
            self.counts.zero_()
        if fold:
            self.tickets.zero_()
        for i, layer in enumerate(layers):
            k_plane, v_plane = self.pool.plane(1, layer.layer)
            q = fused_pass.qkv_rope_store(x, layer.self_attn.qkv_weight, self.meta, self.freqs, k_plane, v_plane,
                                          cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, self.gemm,
                                          None)
            w_attn = (layer.input_layernorm_2.weight, layer.post_attention_layernorm.weight)
            if "o" in fold:
                h, x = self._folded(i, 0, self._attention(i, q), layer.self_attn.o_proj.weight, h, *w_attn)
            else:
                part = self._attention_o(i, q, splits, starts, None if stamps is None else (stamps[0][i], stamps[1][i]))
                h, x = self._add_norm(h, part, *w_attn)
            w_next = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else self.model.model.norm.weight
            act = fused_pass.gate_up_silu(x, layer.mlp.gate_up_weight, self.gemm, None)
            w_mlp = (layer.post_attention_layernorm_2.weight, w_next)
            if "d" in fold:
                h, x = self._folded(i, 1, act, layer.mlp.down_proj.weight, h, *w_mlp)
            else:
                h, x = fused_pass.linear_add_norm(h, act, layer.mlp.down_proj.weight, self.gemm, "down", *w_mlp, eps)
        self.outs[name] = x

    def _starts(self, splits: int, heads: tuple[int, ...]) -> torch.Tensor:
        """o_proj's split starts (flow_kernels.partials_after_counts), kept per setting (a graph holds them)."""
        from flow_kernels import split_starts

        key = (splits, heads)
        if key not in self.starts:
            K = self.model.model.layers[0].self_attn.o_proj.weight.shape[1]
            values = [0, *(g * self.head_cols for g in heads), K] if heads else split_starts(K, splits,
                                                                                             self.gemm.block_k)
            self.starts[key] = torch.tensor(values, dtype=torch.int32, device="cuda")
        return self.starts[key]

    def _attention_o(self, i: int, q: torch.Tensor, splits: int, starts, stamps) -> torch.Tensor:
        """Layer i's attention and o_proj's float32 partials [splits, rows, hidden] (the counted edge where starts is
        given)."""
        from flow_kernels import attention_count, partials_after_counts

        from engine import triton_gemm
        from engine.triton_attention import launch_paged_attention

        layer, m, rows = self.model.model.layers[i], self.meta, q.shape[0]
        kb, vb = self.pool.block_plane(1, layer.layer)
        w_o, scale = layer.self_attn.o_proj.weight, layer.self_attn.scale
        if starts is None:
            a = launch_paged_attention(q, kb, vb, m.block_tables, m.context_lens, m.query_start, 1, scale,
                                       self.launch)
            return triton_gemm.linear_partials(a.reshape(rows, -1), w_o, splits, self.gemm)
        a = attention_count(q, kb, vb, m.block_tables, m.context_lens, m.query_start, scale, self.counts[i],
                            self.launch, None if stamps is None else stamps[0])
        seqs = m.context_lens.shape[0]
        return partials_after_counts(a.reshape(rows, -1), w_o, starts, self.gemm, self.counts[i], seqs, self.head_cols,
                                     None, None if stamps is None else stamps[1])

    def _attention(self, i: int, q: torch.Tensor) -> torch.Tensor:
        """Layer i's attention as the engine launches it at this batch, [rows, hidden]."""
        from engine.triton_attention import launch_paged_attention

        layer, m = self.model.model.layers[i], self.meta
        kb, vb = self.pool.block_plane(1, layer.layer)
        return launch_paged_attention(q, kb, vb, m.block_tables, m.context_lens, m.query_start, 1,
                                      layer.self_attn.scale, self.launch).reshape(q.shape[0], -1)

    def _folded(self, i: int, which: int, y, w, h, w_branch, w_next):
        """(h + rms(y @ w.T) w_branch, its rms times w_next) from one flow_kernels.partials_norm launch."""
        from flow_kernels import partials_norm

        splits = self.gemm.splits_o if which == 0 else self.gemm.splits_down
        return partials_norm(y, w, splits, self.gemm, self.tickets[i, which], h, w_branch, w_next,
                             self.model.config.rms_norm_eps)

    def _add_norm(self, h, part, w_branch, w_next):
        from engine import triton_gemm

        return triton_gemm.add_rms_norm2_partials(h, part, w_branch, w_next, self.model.config.rms_norm_eps)

    def ways(self, names: list[str]) -> dict:
        table = {}
        for name in names:
            kind, splits, heads = parse_way(name)
            if kind == "fold":
                table[name] = lambda name=name, fold=heads: self.run(name, False, self.gemm.splits_o, (), None, fold)
            else:
                table[name] = self.kernels if kind == "kernels" else \
                    (lambda name=name, kind=kind, splits=splits, heads=heads: self.run(name, kind == "flow", splits,
                                                                                       heads))
        return table

    def trace(self, name: str) -> dict:
        """Flow way `name` replayed once from a graph with both kernels stamping the timer: times (us) against
        the attention's last program end, medians over the layers (flow_trace.summarize)."""
        from flow_trace import summarize

        _, splits, heads = parse_way(name)
        layers, kv_heads, seqs = len(self.model.model.layers), self.counts.shape[1], self.meta.context_lens.shape[0]
        n_tiles = -(-self.model.model.layers[0].self_attn.o_proj.weight.shape[0] // self.gemm.block_n)
        stamps = (torch.zeros(layers, seqs * kv_heads, 2, dtype=torch.int64, device="cuda"),
                  torch.zeros(layers, n_tiles * splits, 3, dtype=torch.int64, device="cuda"))
        self.run(name, True, splits, heads, stamps)  # compiles
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.run(name, True, splits, heads, stamps)
        graph.replay()
        torch.cuda.synchronize()
        return summarize(stamps[0].cpu(), stamps[1].cpu(), seqs, kv_heads, n_tiles, splits)


def measure(p: FlowPass, ways: dict, out: Path) -> dict:
    """Every way's first call (checked against `kernels`, and the counts against the request count), then all of
    them twice in turn."""
    from head_split_probe import check_then_time

    seqs = p.meta.context_lens.shape[0]
    result = {"device": torch.cuda.get_device_name(0), "rows": p.h.shape[0], "context": int(p.meta.context_lens.max()),
              "ways": {}, "checks": {}}
    counted = lambda name: {"counts_complete": bool((p.counts == seqs).all()) if name.startswith("flow")  # noqa: E731
                            else None}
    return check_then_time(p.outs, ways, result, out / "flow.json", before=lambda: p.counts.fill_(-1), extra=counted)


def table(result: dict) -> str:
    base = min(result["ways"].get("kernels", [float("nan")]))
    lines = [f"| way ({result['rows']} rows x {result['context']} positions, {result['device']}) | ms a pass (two "
             "rounds) | us a layer vs kernels | equal to kernels | rel. error | counts complete |",
             "|---|---|---|---|---|---|"]
    for name, ms in result["ways"].items():
        check = result["checks"][name]
        lines.append(f"| {name} | {' / '.join(f'{v:.3f}' for v in ms)} | {(min(ms) - base) * 1e3 / 24:+.2f} | "
                     f"{check['equal']} | {check['rel_err']} | {check['counts_complete']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from head_split_probe import pass_parser

    ap = pass_parser(__doc__, DEFAULT_WAYS)
    ap.add_argument("--trace", action="store_true", help="also each flow way's timer stamps (flow_trace.py)")
    args = ap.parse_args(argv)
    names = args.ways.split(",")
    for name in names:
        parse_way(name)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    p = FlowPass(args.rows, args.context)
    result = measure(p, p.ways(names), out)
    (out / "flow.json").write_text(json.dumps(result, indent=1))
    text = table(result)
    if args.trace:
        from flow_trace import trace_table

        result["traces"] = {name: p.trace(name) for name in names if name.startswith("flow")}
        (out / "flow.json").write_text(json.dumps(result, indent=1))
        text += "\n" + trace_table(result["traces"])
    (out / "flow.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
