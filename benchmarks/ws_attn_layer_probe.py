"""Attention inside the layer-shaped warp-specialized kernel (benchmarks/ws_attn_layer.py): per layer, what
does the whole layer cost with decode attention as one of its phases, against the same kernel without it
(ws_layer.py, o reading qkv's first 2048 columns) and the bytes floor (weights + the layer's keys and values)?

The chain of ws_layer_probe.py plus, per layer, a cache of L keys and values per request and head (contiguous
rows; random bf16) and the attention between qkv and o:

    attn[r, h] = softmax(q[r, h] . K[l, r, :, h] / sqrt(128)) V[l, r, :, h],   q = qkv[:, :2048]
    o = attn @ Wo.T                                                       (the rest as ws_layer_probe.py)

Each way runs twice in turn in CUDA graphs; the first call is checked against the torch reference (rounded
where the kernel stores) per stage of the first and last layers. The engine's kernels for the same work are
not run here: graph_timeline.py measures them in the decode step (N = 8: ~55 us per layer and loop).

    python benchmarks/ws_attn_layer_probe.py --out DIR [--layers 24] [--context 640] [--stages 10]
    python benchmarks/ws_attn_layer_probe.py --compile    # CPU: compile for sm90
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from phase_probe import COPY_TBPS, rel_err, timed  # noqa: E402
from phase_probe_ws import first_call_or_exit  # noqa: E402
from ws_chain import box_type, compile_sm90, smem_layouts  # noqa: E402
from ws_layer_probe import LayerChain, run as run_no_attention  # noqa: E402

_H, _QKV, _BN, _BK, _BM = 2048, 6144, 16, 256, 8
HEADS, HEAD_DIM, PAGE = 16, 128, 16


class AttnLayerChain(LayerChain):
    """LayerChain plus each layer's key / value cache ([layers x 8 x L, 16 x 128]: request r's keys of layer l
    are rows (l x 8 + r) x L ...) and attention slots; five phase counters a layer."""

    def __init__(self, rows: int, layers: int, context: int, device: str = "cuda", seed: int = 0) -> None:
        super().__init__(rows, layers, device, seed)
        if context < PAGE or context % PAGE:
            raise ValueError(f"context must be a positive multiple of {PAGE}, got {context}")
        g = torch.Generator(device=device).manual_seed(seed + 1)
        self.context = context
        self.k, self.v = (torch.randn(layers * _BM * context, HEADS * HEAD_DIM, generator=g, device=device)
                          .to(torch.bfloat16) for _ in range(2))
        self.attn = torch.zeros(layers, _BM, _H, dtype=torch.bfloat16, device=device)
        self.cnt5 = torch.zeros(5 * layers, dtype=torch.int32, device=device)

    @property
    def kv_bytes(self) -> int:
        return 2 * self.layers * self.rows * self.context * HEADS * HEAD_DIM * 2

    def reset(self) -> None:
        super().reset()
        self.attn.zero_()

    def attention(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        r, L = self.rows, self.context
        q = qkv[:, :_H].view(r, HEADS, HEAD_DIM)
        rows = slice(layer * _BM * L, (layer * _BM + r) * L)
        k = self.k[rows].float().view(r, L, HEADS, HEAD_DIM)
        v = self.v[rows].float().view(r, L, HEADS, HEAD_DIM)
        p = torch.softmax(torch.einsum("rhd,rlhd->rhl", q, k) / math.sqrt(HEAD_DIM), dim=-1)
        return torch.einsum("rhl,rlhd->rhd", p, v).reshape(r, _H).bfloat16().float()

    def reference(self) -> torch.Tensor:
        def rms(h, n):
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * n.float()).bfloat16().float()

        def mm(x, w):
            return x @ w.float().T

        hm, d = self.hm[0, :self.rows].float(), torch.zeros(self.rows, _H, device=self.wq.device)
        self.ref_steps = []
        for layer in range(self.layers):
            h = (hm + d).bfloat16().float()
            qkv = mm(rms(h, self.n1[layer]), self.wq[layer * _QKV:(layer + 1) * _QKV]).bfloat16().float()
            attn = self.attention(layer, qkv)
            o = mm(attn, self.wo[layer * _H:(layer + 1) * _H]).bfloat16().float()
            hm = (h + o).bfloat16().float()
            x2 = rms(hm, self.n2[layer])
            gu = self.wgu[layer * 2 * 5632:(layer + 1) * 2 * 5632]
            gate, up = mm(x2, gu[:5632]), mm(x2, gu[5632:])
            act = (gate * torch.sigmoid(gate) * up).bfloat16().float()
            d = mm(act, self.wd[layer * _H:(layer + 1) * _H]).bfloat16().float()
            self.ref_steps.append({"qkv": qkv, "attn": attn, "o": o, "hm": hm, "act": act, "d": d})
        return (hm + d).bfloat16()

    def stage_errors(self, layer: int) -> dict[str, float]:
        errors = super().stage_errors(layer)
        errors["attn"] = round(rel_err(self.attn[layer, :self.rows], self.ref_steps[layer]["attn"]), 5)
        return errors


def kv_layout():
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


def run(chain: AttnLayerChain, sms: int, stages: int = 10) -> None:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ws_attn_layer import ws_attn_layer_kernel

    w_layout, x_layout = smem_layouts(_BM)
    descs = [TensorDescriptor.from_tensor(w, [_BN, _BK], w_layout) for w in (chain.wq, chain.wo, chain.wgu, chain.wd)]
    kv = [TensorDescriptor.from_tensor(t, [PAGE, HEAD_DIM], kv_layout()) for t in (chain.k, chain.v)]
    chain.cnt5.zero_()
    ws_attn_layer_kernel[(sms,)](*descs, *kv, chain.hm, chain.d, chain.hq, chain.qkv, chain.o, chain.act, chain.attn,
                                 chain.n1, chain.n2, chain.cnt5, chain.layers, chain.rows, chain.context,
                                 HEAD_DIM**-0.5 * 1.4426950408889634, x_layout=x_layout, STAGES=stages, num_warps=4)


def compile_for_sm90(stages: int = 10) -> dict:
    """ws_attn_layer_kernel compiled for sm90 without a GPU (ws_chain.compile_sm90)."""
    from ws_attn_layer import ws_attn_layer_kernel

    w_layout, x_layout = smem_layouts(_BM)
    signature = {name: box_type(w_layout) for name in ("wq", "wo", "wgu", "wd")}
    signature.update({name: f"tensordesc<bf16[{PAGE}, {HEAD_DIM}],{kv_layout()!r}>" for name in ("k_desc", "v_desc")})
    pointers = ("hm_ptr", "d_ptr", "hq_ptr", "qkv_ptr", "o_ptr", "act_ptr", "attn_ptr", "n1_ptr", "n2_ptr")
    signature.update({name: "*bf16" for name in pointers})
    signature.update({"cnt_ptr": "*i32", "num_layers": "i32", "M": "i32", "L": "i32", "qk_scale": "fp32"})
    constexprs = {"x_layout": x_layout, "STAGES": stages, "num_warps": 4}
    return compile_sm90(ws_attn_layer_kernel, signature, constexprs, (*pointers, "cnt_ptr"))


def measure(chain: AttnLayerChain, ways: dict, ref: torch.Tensor, floors: dict, result: dict, out: Path) -> None:
    for _ in range(2):  # twice in turn: the spread between rounds is the noise
        for name, fn in ways.items():
            chain.reset()
            ms = timed(fn)
            err = rel_err(chain.output(), ref) if name.startswith("attn") else None
            per_layer = ms * 1e3 / chain.layers
            above = (ms - floors[name]) * 1e3 / chain.layers
            result["ways"].setdefault(name, []).append({"ms": ms, "us_per_layer": per_layer,
                                                         "us_above_floor_per_layer": above, "rel_err": err})
            print(f"rows={chain.rows} {name:24s} {ms:7.3f} ms = {per_layer:6.2f} us/layer ({above:5.2f} above its "
                  f"floor {floors[name]:.3f} ms), rel err {err}", flush=True)
            (out / "ws_attn_layer.json").write_text(json.dumps(result, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--context", type=int, default=640, help="keys per request and layer (a multiple of 16)")
    ap.add_argument("--stages", default="10", help="ring slots (8 KB each), one way per value")
    ap.add_argument("--compile", action="store_true", help="CPU: compile for sm90 and print what it built")
    args = ap.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    if args.compile:
        for s in stages:
            print({"stages": s, **compile_for_sm90(s)}, flush=True)
        return 0
    if not args.out:
        ap.error("--out is required to measure")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    chain = AttnLayerChain(args.rows, args.layers, args.context)
    ref = chain.reference()
    w_floor = chain.weight_bytes / (COPY_TBPS * 1e9)
    kv_floor = chain.kv_bytes / (COPY_TBPS * 1e9)
    result = {"device": torch.cuda.get_device_name(0), "sms": sms, "rows": args.rows, "layers": args.layers,
              "context": args.context, "weights_floor_ms": w_floor, "kv_floor_ms": kv_floor, "ways": {}}
    ways = {f"attn_s{s}": (lambda s=s: run(chain, sms, s)) for s in stages}
    floors = {name: w_floor + kv_floor for name in ways}
    ways["no_attention_s10"] = lambda: run_no_attention(chain, sms, 10, 0, True)
    floors["no_attention_s10"] = w_floor
    for name, fn in ways.items():
        chain.reset()
        first_call_or_exit(fn, f"ws_attn_layer {name}")
        if name.startswith("attn"):
            errors = {layer: chain.stage_errors(layer) for layer in sorted({0, args.layers - 1})}
            result.setdefault("stage_errors", {})[name] = errors
            print(f"{name}: first call, rel err {rel_err(chain.output(), ref):.1e}; per stage {errors}", flush=True)
    measure(chain, ways, ref, floors, result, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
