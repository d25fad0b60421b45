"""Do two half-layers on two CUDA streams hide the kernel boundaries' latency of the N = 64 decode pass?

At 64 requests of 640 positions a layer and loop spends ~82 us in the decode attention (bound by HBM) and ~44 us on
its GEMM side against ~24 us of weights: each dependent kernel costs ~3.35 us beyond its bytes (session 35), and
fewer boundaries has cost as much as it saved every time it was measured (sessions 10-36). This probe keeps every
boundary but lets two independent chains fill each other's: the layer is head-local from qkv through the attention
to o_proj's K split, and column-local from gate_up to down_proj's K split; only the two add + norms need whole rows.
So each block runs as two halves, each reading half of the block's weights (no byte read twice):
    attention block, half j   qkv + RoPE + store for heads j (their q, k, v rows of w_qkv), the paged decode attention
                              on those heads, o_proj's split-K partials over their K columns, into partials 2j, 2j+1
    MLP block, half j         gate_up + SiLU for intermediate columns j, down_proj's partials over those columns
and the add + norm sums the four partials as it does today. With o_proj's and down_proj's four K splits falling on
the halves' boundaries, every value is the engine's to the bit (checked: each way's readout against `kernels`).

Ways (a block's mode for the attention block, then the MLP block, `A:M`; one loop pass of the engine's model, its
kernels, PDL, a CUDA graph, twice in turn):
    kernels     the engine's loop pass (fused_pass.run_loops)
    full        the block as the engine runs it (full:full is `kernels` through this probe's code)
    serial      both halves on the main stream, one after the other (what splitting costs by itself)
    par         half 1 on a second stream, both forked at the block's start and joined before the add + norm
    lag         the same, half 1's first kernel waiting for half 0's first (so half 1's qkv / gate_up runs beside half
                0's attention / down_proj)

    python benchmarks/head_split_probe.py --out DIR [--rows 64] [--context 640] [--ways kernels,serial:serial,...]

Measured on an H100 (session 37, docs/benchmarks.md): par ties the engine's pass (+1 us a layer), lag loses 6-39 us a
layer (a half attention's 512 one-warp programs read far below the whole one's rate), serial 38.5.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("full", "serial", "par", "lag")
DEFAULT_WAYS = ("kernels", "full:full", "serial:serial", "par:par", "lag:lag", "lag:full", "full:lag", "par:lag")
COPY_TBPS = 4.3  # the floor's rate (shared/GPU.md: the H200's copy bandwidth)


@dataclass(frozen=True)
class Half:
    """One half of a layer's weights: qkv rows of its heads [3 Hh d, H], o_proj's columns of those heads [H, Hh d],
    gate_up's rows of its intermediate columns (gate, then up) [I, H], down_proj's columns of them [H, I / 2]."""
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def split_layer(w_qkv: torch.Tensor, w_o: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                heads: int, kv_heads: int, head_dim: int) -> tuple[Half, Half]:
    """A fused layer's weights (w_qkv: q rows, then k, then v; w_gate_up: gate rows, then up) as two halves, each
    contiguous. Heads and kv heads split evenly (a half's kv heads serve exactly its q heads); so does the MLP."""
    inter = w_down.shape[1]
    if heads % 2 or kv_heads % 2 or inter % 2:
        raise ValueError(f"split_layer: heads ({heads}), kv_heads ({kv_heads}) and the intermediate size ({inter}) "
                         "must be even")
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    q, k, v = w_qkv.split([q_rows, kv_rows, kv_rows])
    gate, up = w_gate_up.split([inter, inter])
    halves = []
    for j in range(2):
        qs, ks, cs = (slice(j * n // 2, (j + 1) * n // 2) for n in (q_rows, kv_rows, inter))
        halves.append(Half(qkv=torch.cat([q[qs], k[ks], v[ks]]).contiguous(), o=w_o[:, qs].contiguous(),
                           gate_up=torch.cat([gate[cs], up[cs]]).contiguous(), down=w_down[:, cs].contiguous()))
    return halves[0], halves[1]


def check_ways(names: list[str]) -> list[str]:
    """The --ways list, each `kernels` or `A:M` with A, M among MODES."""
    for name in names:
        parts = name.split(":")
        if name != "kernels" and (len(parts) != 2 or not set(parts) <= set(MODES)):
            raise ValueError(f"--ways: {name!r} is neither 'kernels' nor A:M with A and M among {', '.join(MODES)}")
    if not names:
        raise ValueError("--ways: none given")
    return names


def check_splits(splits_o: int, splits_down: int, inter: int, block_k: int) -> None:
    """The halves reproduce the engine's partials to the bit only where each half takes half of the K splits and
    down_proj's split boundaries fall on the halves' (o_proj's K, heads x head_dim, is a power of two here)."""
    import math

    per_split = math.ceil(math.ceil(inter / splits_down) / block_k) * block_k
    if splits_o % 2 or splits_down % 2 or per_split * splits_down // 2 != inter // 2:
        raise ValueError(f"head_split_probe: splits_o={splits_o} and splits_down={splits_down} must be even, with "
                         f"down's K splits ({per_split} columns) meeting at intermediate / 2 ({inter // 2})")


class SplitPass:
    """One loop pass (loop 1) of the engine's model over a decode batch, each block in a mode (MODES)."""

    def __init__(self, rows: int, context: int) -> None:
        from ws_step64_probe import D, HEADS, decode_batch, engine_model

        from engine.attention_dispatch import choose_config
        from engine.fused_pass import inv_freq
        from engine.gemm_dispatch import gemm_config

        self.model = engine_model()
        cfg = self.model.config
        self.gemm = gemm_config(rows)
        check_splits(self.gemm.splits_o, self.gemm.splits_down, cfg.intermediate_size, self.gemm.block_k)
        self.pool, self.meta = decode_batch(cfg, rows, context, 0.0)
        g = torch.Generator(device="cuda").manual_seed(3)
        self.h = torch.randn(rows, HEADS * D, generator=g, device="cuda").to(torch.bfloat16)
        self.freqs = inv_freq(self.model, self.h.device)
        self.halves = [split_layer(layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up_weight,
                                   layer.mlp.down_proj.weight, cfg.num_attention_heads, cfg.num_key_value_heads,
                                   cfg.head_dim) for layer in self.model.model.layers]
        # the whole call's launch (the table's row at all kv heads), so each half's programs are the whole's
        self.attention_launch = choose_config(rows, cfg.num_key_value_heads, 1, cfg.head_dim,
                                              torch.cuda.get_device_properties(0).multi_processor_count)
        self.side = torch.cuda.Stream()
        self.keep: list[torch.Tensor] = []
        self.outs: dict[str, torch.Tensor] = {}

    def kernels(self) -> None:
        self.outs["kernels"] = self.model.run_loops(self.h, self.meta, self.pool, 1, 1)[-1]

    def run(self, name: str, attention: str, mlp: str) -> None:
        """The pass with the attention block in mode `attention` and the MLP block in `mlp`; its readout kept."""
        from engine import triton_fused as fused

        layers, eps = self.model.model.layers, self.model.config.rms_norm_eps
        self.keep = []  # every tensor a side-stream kernel touches lives until the pass ends
        h, x = self.h, fused.rms_norm(self.h, layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(layers):
            w_next = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else self.model.model.norm.weight
            part = self._block(attention, lambda j, out, x=x, i=i: self._attention_half(i, j, x, out), "o", i, x)
            h, x = self._add_norm(h, part, layer.input_layernorm_2.weight, layer.post_attention_layernorm.weight)
            part = self._block(mlp, lambda j, out, x=x, i=i: self._mlp_half(i, j, x, out), "down", i, x)
            h, x = self._add_norm(h, part, layer.post_attention_layernorm_2.weight, w_next)
        self.outs[name] = x

    def _add_norm(self, h, part, w_branch, w_next):
        from engine import triton_gemm

        return triton_gemm.add_rms_norm2_partials(h, part, w_branch, w_next, self.model.config.rms_norm_eps)

    def _block(self, mode: str, half, which: str, i: int, x: torch.Tensor) -> torch.Tensor:
        """The block's float32 partials [splits, rows, H]: whole (mode full) or as two halves; `half(j, out)` runs
        half j's kernels with its partials into `out` and returns a callable for its later kernels, where the
        first kernel is split off (lag)."""
        splits = self.gemm.splits_o if which == "o" else self.gemm.splits_down
        part = torch.empty(splits, x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        self.keep += [part, x]
        if mode == "full":
            self._whole(which, i, x, part)
            return part
        outs, main = (part[: splits // 2], part[splits // 2:]), torch.cuda.current_stream()
        if mode == "serial":
            for j in range(2):
                half(j, outs[j])()
            return part
        self.side.wait_stream(main)
        rest = half(0, outs[0])  # half 0's first kernel
        if mode == "lag":
            self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            half(1, outs[1])()
        rest()
        main.wait_stream(self.side)
        return part

    def _whole(self, which: str, i: int, x: torch.Tensor, part: torch.Tensor) -> None:
        from engine import fused_pass, triton_gemm
        from engine.attention import attend

        layer, m, cfg = self.model.model.layers[i], self.meta, self.model.config
        if which == "o":
            k_plane, v_plane = self.pool.plane(1, layer.layer)
            q = fused_pass.qkv_rope_store(x, layer.self_attn.qkv_weight, m, self.freqs, k_plane, v_plane,
                                          cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, self.gemm,
                                          None)
            a = attend(q, None, None, self.pool, 1, layer.layer, m, layer.self_attn.scale, layer.self_attn.backend)
            y, w = a.reshape(x.shape[0], -1), layer.self_attn.o_proj.weight
        else:
            y, w = fused_pass.gate_up_silu(x, layer.mlp.gate_up_weight, self.gemm, None), layer.mlp.down_proj.weight
        triton_gemm.linear_partials(y, w, part.shape[0], self.gemm, part)
        self.keep.append(y)

    def _attention_half(self, i: int, j: int, x: torch.Tensor, out: torch.Tensor):
        """Half j of layer i's attention block: launches its qkv now, returns the rest (attention, o's partials)."""
        from engine import triton_gemm
        from engine.triton_attention import launch_paged_attention

        layer, m, cfg, w = self.model.model.layers[i], self.meta, self.model.config, self.halves[i][j]
        hq, hkv = cfg.num_attention_heads // 2, cfg.num_key_value_heads // 2
        heads = slice(j * hkv, (j + 1) * hkv)
        k_plane, v_plane = self.pool.plane(1, layer.layer)
        q = triton_gemm.qkv_rope_store(x, w.qkv, m.positions, m.slots, self.freqs, k_plane[:, heads],
                                       v_plane[:, heads], hq, hkv, cfg.head_dim, self.gemm)
        self.keep.append(q)

        def rest() -> None:
            kb, vb = self.pool.block_plane(1, layer.layer)
            a = launch_paged_attention(q, kb[:, :, heads], vb[:, :, heads], m.block_tables, m.context_lens,
                                       m.query_start, 1, layer.self_attn.scale, self.attention_launch)
            triton_gemm.linear_partials(a.reshape(x.shape[0], -1), w.o, out.shape[0], self.gemm, out)
            self.keep.append(a)

        return rest

    def _mlp_half(self, i: int, j: int, x: torch.Tensor, out: torch.Tensor):
        """Half j of layer i's MLP block: launches its gate_up + SiLU now, returns the rest (down's partials)."""
        from engine import triton_gemm

        w = self.halves[i][j]
        act = triton_gemm.gate_up_silu(x, w.gate_up, self.gemm)
        self.keep.append(act)
        return lambda: triton_gemm.linear_partials(act, w.down, out.shape[0], self.gemm, out)

    def ways(self, names: list[str]) -> dict:
        table = {}
        for name in check_ways(names):
            if name == "kernels":
                table[name] = self.kernels
            else:
                a, m = name.split(":")
                table[name] = lambda name=name, a=a, m=m: self.run(name, a, m)
        return table

    def floor_ms(self, context: int) -> float:
        """The pass's bytes floor: its layers' weights read once and each layer's keys and values, at COPY_TBPS."""
        cfg, rows = self.model.config, self.h.shape[0]
        weights = sum(t.numel() * t.element_size() for half in self.halves[0] for t in
                      (half.qkv, half.o, half.gate_up, half.down)) * cfg.num_hidden_layers
        kv = 2 * cfg.num_hidden_layers * rows * context * cfg.num_key_value_heads * cfg.head_dim * 2
        return (weights + kv) / (COPY_TBPS * 1e9)


def check_then_time(outs: dict, ways: dict, result: dict, path: Path, note=lambda ms: "", before=None,
                    extra=None) -> dict:
    """Every way's first call checked against outs["kernels"] (finite, equal to the bit, relative error, and the
    fields `extra(name)` adds), `before()` ahead of each; then all of them timed twice in turn (phase_probe.timed:
    phase_probe.time_in_turn), result["checks"] and result["ways"] filled and written to `path` as they come."""
    from phase_probe import rel_err, time_in_turn

    for name, fn in ways.items():
        if before is not None:
            before()
        fn()
        torch.cuda.synchronize()
        ref, got = outs.get("kernels"), outs[name]
        result["checks"][name] = {"finite": bool(torch.isfinite(got.float()).all()), **(extra(name) if extra else {}),
                                  "equal": None if ref is None else bool(torch.equal(got, ref)),
                                  "rel_err": None if ref is None else rel_err(got, ref)}
        print(f"{name}: {result['checks'][name]}", flush=True)
    return time_in_turn(ways, result, path, note)


def measure(p: SplitPass, ways: dict, context: int, out: Path) -> dict:
    """Every way's first call (checked against `kernels` to the bit), then all of them twice in turn."""
    floor = p.floor_ms(context)
    result = {"device": torch.cuda.get_device_name(0), "rows": p.h.shape[0], "context": context, "floor_ms": floor,
              "ways": {}, "checks": {}}
    return check_then_time(p.outs, ways, result, out / "head_split.json",
                           lambda ms: f" ({ms / floor:.3f}x the {floor:.3f} ms floor)")


def table(result: dict) -> str:
    floor, base = result["floor_ms"], min(result["ways"].get("kernels", [float("nan")]))
    lines = [f"| way ({result['rows']} rows x {result['context']} positions, {result['device']}) | ms a pass (two "
             f"rounds) | x the floor ({floor:.3f} ms) | us a layer vs kernels | equal to kernels |",
             "|---|---|---|---|---|"]
    for name, ms in result["ways"].items():
        delta = (min(ms) - base) * 1e3 / 24
        lines.append(f"| {name} | {' / '.join(f'{v:.3f}' for v in ms)} | {min(ms) / floor:.3f} | {delta:+.2f} | "
                     f"{result['checks'][name]['equal']} |")
    return "\n".join(lines) + "\n"


def pass_parser(doc: str, ways: tuple[str, ...]) -> argparse.ArgumentParser:
    """The loop-pass probes' arguments: --out, --rows, --context, --ways (default `ways`)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--ways", default=",".join(ways))
    return ap


def main(argv=None) -> int:
    args = pass_parser(__doc__, DEFAULT_WAYS).parse_args(argv)
    names = check_ways(args.ways.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    p = SplitPass(args.rows, args.context)
    result = measure(p, p.ways(names), args.context, out)
    (out / "head_split.json").write_text(json.dumps(result, indent=1))
    (out / "head_split.md").write_text(table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
