"""The stacked norm way (benchmarks/norm_chain_probe.py, norm_chain_layers.py) as a whole decode loop pass, in the
decode harness: does it pay in the step, attention included, where it paid over the GEMM side alone?

`stacked_run_loops` is engine/fused_pass.py's run_loops with each layer's six GEMM-side launches (o's split-K
partials, add + norm, gate_up + SiLU, down's partials, add + norm, qkv + RoPE + store) replaced by the stacked way's
four: o's whole-K producer (forming the residual the down chain before left), stacked gate_up, down's producer
(forming it from o's), stacked qkv. Attention is the engine's (engine/attention.attend). Each loop's first qkv runs
as today (its input is a formed norm), and each loop's last residual is formed by one add + norm, whose second norm
is the readout.

    python benchmarks/stacked_decode.py [--producer 16x128] [--stages 3] HARNESS [HARNESS ARGS]

runs a decode harness (benchmarks/throughput.py, ...) with engine/fused_pass.run_loops replaced for the calls the
stacked kernels serve (decode, half-precision, up to 64 rows: the rest go to the original) and prints how many
calls each way took; the same harness run with `--stacked-off` is the side-by-side baseline. The stacked kernels are
not in the engine's kernel warm-up, so OUROBATCH_CAPTURE_WARMUP=all gives every graph capture an eager run first
(each bucket's specializations compiled outside the capture), in both runs:

    OUROBATCH_CAPTURE_WARMUP=all python benchmarks/stacked_decode.py benchmarks/throughput.py --out $OUT/s \
        --configs interval1 --scenarios 64x512x256
    OUROBATCH_CAPTURE_WARMUP=all python benchmarks/stacked_decode.py --stacked-off benchmarks/throughput.py \
        --out $OUT/t --configs interval1 --scenarios 64x512x256

Measured on an H100 (session 42, docs/benchmarks.md): the full-depth N = 64 step 20.90 ms GPU with it (producer
16 x 128) against 16.12 ms without, ~50 us a layer and loop, as norm_chain_layers.py's GEMM side alone (+34 to +50 us
a layer at the three producer tiles). The engine keeps its add + norm kernels.

Checked on the CPU in Triton's interpreter against the model's float64 pass (tests/test_stacked_decode.py) and on
the GPU against it and the per-kernel path (tests/gpu/test_gpu_stacked_decode.py).
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import norm_chain_probe as probe  # noqa: E402


def serves(h: torch.Tensor, meta) -> bool:
    """Whether the stacked pass takes this run_loops call: decode rows, half precision, 1..64 rows (one row box)."""
    return not meta.prefill and h.dtype in (torch.bfloat16, torch.float16) and 1 <= h.shape[0] <= 64


def stacked_run_loops(model, h: torch.Tensor, meta, pool, first_loop: int, last_loop: int,
                      producer: tuple[int, int] = probe.PRODUCERS[0], stages: int = 3) -> list[torch.Tensor]:
    """fused_pass.run_loops' readouts (and its key / value stores), the GEMM side the stacked way."""
    from engine import fused_pass
    from engine import triton_fused as fused
    from engine.gemm_dispatch import gemm_config

    cfg, layers = model.config, model.model.layers
    eps, heads = cfg.rms_norm_eps, (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    freqs = fused_pass.inv_freq(model, h.device)
    first_gemm = gemm_config(h.shape[0])  # each loop's first qkv: today's kernel, as fused_pass runs it
    readouts = []
    x = fused.rms_norm(h, layers[0].input_layernorm.weight, eps)
    for loop in range(first_loop, last_loop + 1):
        p_d = before = None
        for i, layer in enumerate(layers):
            k_plane, v_plane = pool.plane(loop, layer.layer)
            if p_d is None:
                q = fused_pass.qkv_rope_store(x, layer.self_attn.qkv_weight, meta, freqs, k_plane, v_plane, *heads,
                                              first_gemm, None)
            else:
                q = probe.stacked_qkv(p_d, layer.self_attn.qkv_weight, meta.positions, meta.slots, freqs, k_plane,
                                      v_plane, *heads, stages=stages)
            w_next = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else model.model.norm.weight
            p_d = _layer_rest(layer, h, q, meta, pool, loop, w_next, before, producer, stages)
            h, before = p_d["h"], {"y": p_d["y"], "stats": p_d["stats"], "wa": layer.post_attention_layernorm_2.weight}
        h, x = fused.add_rms_norm2(h, p_d["y"], before["wa"], model.model.norm.weight, eps)
        readouts.append(x)  # rms(h, model.norm): loop `loop`'s readout and loop+1's input
        if loop < last_loop:
            h = x
            x = fused.rms_norm(h, layers[0].input_layernorm.weight, eps)
    return readouts


def _layer_rest(layer, h: torch.Tensor, q: torch.Tensor, meta, pool, loop: int, w_next: torch.Tensor,
                before: dict | None, producer: tuple[int, int], stages: int) -> dict:
    """A layer after its q: attention, o's producer (forming h from `before`, the down chain before's), stacked
    gate_up, down's producer (forming h from o's). Down's {h, y, stats, ab}: the residual h still lacks down's
    branch, which the next producer (or the loop's last add + norm) adds."""
    from engine.attention import attend

    attn = layer.self_attn
    a = attend(q, None, None, pool, loop, layer.layer, meta, attn.scale, attn.backend).reshape(q.shape[0], -1)
    wa, wb = layer.input_layernorm_2.weight, layer.post_attention_layernorm.weight
    p_o = probe.stacked_stats(a.contiguous(), attn.o_proj.weight, h, wa, wb, *producer, stages=stages, prev=before)
    m = probe.stacked_gate(p_o, layer.mlp.gate_up_weight, stages=stages)
    return probe.stacked_stats(m, layer.mlp.down_proj.weight, p_o["h"], layer.post_attention_layernorm_2.weight,
                               w_next, *producer, stages=stages, prev={"y": p_o["y"], "stats": p_o["stats"], "wa": wa})


def install(producer: tuple[int, int], stages: int) -> dict:
    """engine/fused_pass.run_loops replaced: the calls serves() takes run stacked_run_loops, the rest the original.
    Returns the live call counts {"stacked": n, "original": n}."""
    from engine import fused_pass

    original, calls = fused_pass.run_loops, {"stacked": 0, "original": 0}

    def run_loops(model, h, meta, pool, first_loop, last_loop):
        way = "stacked" if serves(h, meta) else "original"
        calls[way] += 1
        if way == "original":
            return original(model, h, meta, pool, first_loop, last_loop)
        return stacked_run_loops(model, h, meta, pool, first_loop, last_loop, producer, stages)

    fused_pass.run_loops = run_loops
    return calls


def parse_producer(text: str) -> tuple[int, int]:
    """'16x128' -> (16, 128): one of norm_chain_probe.PRODUCERS."""
    try:
        value = tuple(int(v) for v in text.split("x"))
    except ValueError:
        value = ()
    if value not in probe.PRODUCERS:
        allowed = ", ".join(f"{n}x{k}" for n, k in probe.PRODUCERS)
        raise argparse.ArgumentTypeError(f"--producer must be one of {allowed}, got {text!r}")
    return value


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--producer", type=parse_producer, default=probe.PRODUCERS[0],
                    help="the producers' columns a program x K step (norm_chain_probe.PRODUCERS)")
    ap.add_argument("--stages", type=int, choices=(2, 3), default=3,
                    help="every stacked kernel's pipeline depth (gate_up's boxes do not fit at 4)")
    ap.add_argument("--stacked-off", action="store_true", help="the harness unchanged: the baseline run")
    ap.add_argument("harness", type=Path, help="a decode harness script, e.g. benchmarks/throughput.py")
    ap.add_argument("harness_args", nargs=argparse.REMAINDER, help="the harness's own arguments")
    args = ap.parse_args(argv)
    if not args.harness.is_file():
        ap.error(f"harness: no such script {str(args.harness)!r}")
    calls = {} if args.stacked_off else install(args.producer, args.stages)
    sys.argv = [str(args.harness), *args.harness_args]
    try:
        runpy.run_path(str(args.harness), run_name="__main__")
    finally:
        print(f"stacked_decode: run_loops calls {calls or 'unchanged (--stacked-off)'}", flush=True)
    return calls


if __name__ == "__main__":
    main()
