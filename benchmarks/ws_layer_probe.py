"""A layer-shaped chain in one warp-specialized Gluon kernel (benchmarks/ws_layer.py): does session 14's
boundary cost hold with norms, a residual stream, SiLU x up and down's 5632-wide activations?

benchmarks/phase_probe_ws.py timed GEMM phases whose input is the last phase's output. Here every layer has
Ouro-1.4B's four GEMMs and what joins them, attention aside (its input stands in for attention's output):

    x   = rms(h) * n1                    qkv = x @ Wqkv.T              (6144 columns)
    o   = qkv[:, :2048] @ Wo.T           hm  = h + o                    (the residual after "attention")
    x2  = rms(hm) * n2                   act = silu(x2 @ Wg.T) * (x2 @ Wu.T)   (5632 columns)
    d   = act @ Wd.T                     h'  = hm + d                   (K = 5632)

bf16 everywhere stored, fp32 inside; the torch reference rounds where the kernel stores. Each way runs twice in
turn in CUDA graphs, checked against the reference (the first call per stage of the first and last layers,
and the act of layer 0 per 16-column tile), timed against the weights' bytes floor at 4.3 TB/s.

    python benchmarks/ws_layer_probe.py --out DIR [--layers 24] [--stages 10,6] [--diag 2]
    python benchmarks/ws_layer_probe.py --compile    # CPU: compile for sm90
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from phase_probe import COPY_TBPS, out_and_sms, rel_err, timed  # noqa: E402
from phase_probe_ws import first_call_or_exit  # noqa: E402
from ws_chain import box_type, compile_sm90, smem_layouts  # noqa: E402
from ws_layer import _EPS, SIZES, ws_layer_kernel  # noqa: E402

_H, _QKV, _INTER, _BN, _BK, _BM = (SIZES[k] for k in ("H", "QKV", "INTER", "BN", "BK", "BM"))


class LayerChain:
    """Weights and activation slots of `layers` layer-shaped steps at `rows` <= block_m batch rows (hidden size
    h, qkv 3 h, intermediate inter; Ouro-1.4B's and 8 rows by default: ws_layer.py's kernel; ws_layer64_probe.py
    makes 64-row ones). hm and d have layers + 1 slots: hm[0] is the input, d[0] zeros; layer l adds
    hm[l + 1] = h_l + o_l and d[l + 1]."""

    def __init__(self, rows: int, layers: int, device: str = "cuda", seed: int = 0, h: int = _H,
                 inter: int = _INTER, block_m: int = _BM) -> None:
        if not 1 <= rows <= block_m:
            raise ValueError(f"rows must be 1..{block_m}, got {rows}")
        g = torch.Generator(device=device).manual_seed(seed)
        self.rows, self.layers, self.block_m = rows, layers, block_m
        self.h, self.qkv_cols, self.inter = h, 3 * h, inter

        def weight(n, k):
            return (torch.randn(n, k, generator=g, device=device) / k**0.5).to(torch.bfloat16)

        self.wq, self.wo = weight(layers * self.qkv_cols, self.h), weight(layers * self.h, self.h)
        self.wgu, self.wd = weight(layers * 2 * self.inter, self.h), weight(layers * self.h, self.inter)
        self.n1, self.n2 = ((1 + 0.1 * torch.randn(layers, self.h, generator=g, device=device)).to(torch.bfloat16)
                            for _ in range(2))

        def slots(n, width):
            return torch.zeros(n, block_m, width, dtype=torch.bfloat16, device=device)

        self.hm, self.d, self.hq = slots(layers + 1, self.h), slots(layers + 1, self.h), slots(layers, self.h)
        self.qkv, self.o, self.act = slots(layers, self.qkv_cols), slots(layers, self.h), slots(layers, self.inter)
        self.hm[0, :rows] = torch.randn(rows, self.h, generator=g, device=device).to(torch.bfloat16)
        self.cnt = torch.zeros(4 * layers, dtype=torch.int32, device=device)

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * 2 for w in (self.wq, self.wo, self.wgu, self.wd, self.n1, self.n2))

    def reset(self) -> None:
        for t in (self.hm[1:], self.d[1:], self.hq, self.qkv, self.o, self.act):
            t.zero_()

    def reference(self) -> torch.Tensor:
        """The last layer's h' from torch in float32, rounded to bf16 wherever the kernel stores; the layers'
        intermediates go to self.ref_steps (qkv, o, hm, act, d per layer) for stage_errors()."""
        def rms(h, n):
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + _EPS) * n.float()).bfloat16().float()

        def mm(x, w):
            return x @ w.float().T

        hm, d = self.hm[0, :self.rows].float(), torch.zeros(self.rows, self.h, device=self.wq.device)
        self.ref_steps = []
        for layer in range(self.layers):
            h = (hm + d).bfloat16().float()
            wq = self.wq[layer * self.qkv_cols:(layer + 1) * self.qkv_cols]
            qkv = mm(rms(h, self.n1[layer]), wq).bfloat16().float()
            o = mm(qkv[:, :self.h], self.wo[layer * self.h:(layer + 1) * self.h]).bfloat16().float()
            hm = (h + o).bfloat16().float()
            x2 = rms(hm, self.n2[layer])
            gu = self.wgu[layer * 2 * self.inter:(layer + 1) * 2 * self.inter]
            gate, up = mm(x2, gu[:self.inter]), mm(x2, gu[self.inter:])
            act = (gate * torch.sigmoid(gate) * up).bfloat16().float()
            d = mm(act, self.wd[layer * self.h:(layer + 1) * self.h]).bfloat16().float()
            self.ref_steps.append({"qkv": qkv, "o": o, "hm": hm, "act": act, "d": d})
        return (hm + d).bfloat16()

    def act_diagnosis(self, layer: int = 0) -> dict:
        """Which hypothesis the kernel's act of `layer` matches, and which 16-column tiles are off."""
        r, ref = self.rows, self.ref_steps[layer]
        got = self.act[layer, :r].float()
        hm = ref["hm"]
        gu = self.wgu[layer * 2 * self.inter:(layer + 1) * 2 * self.inter].float()

        def rms(h, n):
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + _EPS) * n).bfloat16().float()

        out = {}
        for name, x2 in (("n2", rms(hm, self.n2[layer].float())), ("n1", rms(hm, self.n1[layer].float())),
                         ("no_n", rms(hm, torch.ones_like(hm[0])))):
            gate, up = x2 @ gu[:self.inter].T, x2 @ gu[self.inter:].T
            out[f"silu(g)*u {name}"] = rel_err(got, gate * torch.sigmoid(gate) * up)
            out[f"silu(u)*g {name}"] = rel_err(got, up * torch.sigmoid(up) * gate)
        tile_err = ((got - ref["act"]).norm(dim=0).reshape(-1, _BN).norm(dim=1)
                    / ref["act"].norm(dim=0).reshape(-1, _BN).norm(dim=1).clamp_min(1e-30))
        bad = (tile_err > 0.05).nonzero().flatten().tolist()
        out["bad_tiles"] = bad[:40]
        out["num_bad_tiles"] = len(bad)
        return out

    def stage_errors(self, layer: int) -> dict[str, float]:
        """Relative error of each of the layer's stored intermediates against reference()'s."""
        r, ref = self.rows, self.ref_steps[layer]
        got = {"qkv": self.qkv[layer, :r], "o": self.o[layer, :r], "hm": self.hm[layer + 1, :r],
               "act": self.act[layer, :r], "d": self.d[layer + 1, :r]}
        return {k: round(rel_err(got[k], ref[k]), 5) for k in got}

    def output(self) -> torch.Tensor:
        return (self.hm[self.layers, :self.rows].float() + self.d[self.layers, :self.rows].float()).bfloat16()


def measure_layers(chain: LayerChain, runs: dict, path: Path, sms: int, after_first=lambda name: None) -> dict:
    """Each way's first call (checked per stage of the first and last layers against chain.reference(), with a
    deadline), then every way timed twice in turn in CUDA graphs against the weights' bytes floor; the JSON to
    `path` after every timing. runs: name -> a call of one launch on `chain`."""
    ref = chain.reference()
    floor_ms = chain.weight_bytes / (COPY_TBPS * 1e9)
    phases = 4 * chain.layers
    result = {"device": torch.cuda.get_device_name(0), "sms": sms, "rows": chain.rows, "layers": chain.layers,
              "phases": phases, "floor_ms": floor_ms, "ways": {}, "stage_errors": {}}
    for name, fn in runs.items():
        chain.reset()
        first_call_or_exit(fn, f"{path.stem} {name}")
        errors = {layer: chain.stage_errors(layer) for layer in sorted({0, chain.layers - 1})}
        result["stage_errors"][name] = errors
        print(f"{name}: first call done, rel err {rel_err(chain.output(), ref):.1e}; per stage {errors}", flush=True)
        after_first(name)
    for _ in range(2):  # twice in turn: the spread between rounds is the noise
        for name, fn in runs.items():
            chain.reset()
            ms = timed(fn)
            err = rel_err(chain.output(), ref)
            per_phase = (ms - floor_ms) * 1e3 / phases
            result["ways"].setdefault(name, []).append(
                {"ms": ms, "us_above_floor_per_phase": per_phase, "rel_err": err})
            print(f"rows={chain.rows} {name:28s} {ms:7.3f} ms (floor {floor_ms:.3f}) {per_phase:5.2f} us/phase "
                  f"above the floor, rel err {err:.1e}", flush=True)
            path.write_text(json.dumps(result, indent=1))
    return result


def run(chain: LayerChain, sms: int, stages: int = 10, diag: int = 0, epilogue_norm: bool = True) -> None:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    w_layout, x_layout = smem_layouts(_BM)
    descs = [TensorDescriptor.from_tensor(w, [_BN, _BK], w_layout) for w in (chain.wq, chain.wo, chain.wgu, chain.wd)]
    chain.cnt.zero_()
    ws_layer_kernel[(sms,)](*descs, chain.hm, chain.d, chain.hq, chain.qkv, chain.o, chain.act, chain.n1, chain.n2,
                            chain.cnt, chain.layers, chain.rows, x_layout=x_layout, STAGES=stages, DIAG=diag,
                            EPILOGUE_NORM=epilogue_norm, num_warps=4)


def compile_for_sm90(stages: int = 10, diag: int = 0, epilogue_norm: bool = True) -> dict:
    """ws_layer_kernel compiled for sm90 without a GPU (ws_chain.compile_sm90)."""
    w_layout, x_layout = smem_layouts(_BM)
    signature = {name: box_type(w_layout) for name in ("wq", "wo", "wgu", "wd")}
    pointers = ("hm_ptr", "d_ptr", "hq_ptr", "qkv_ptr", "o_ptr", "act_ptr", "n1_ptr", "n2_ptr")
    signature.update({name: "*bf16" for name in pointers})
    signature.update({"cnt_ptr": "*i32", "num_layers": "i32", "M": "i32"})
    constexprs = {"x_layout": x_layout, "STAGES": stages, "DIAG": diag, "EPILOGUE_NORM": epilogue_norm,
                  "num_warps": 4}
    return compile_sm90(ws_layer_kernel, signature, constexprs, (*pointers, "cnt_ptr"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--stages", default="10,6", help="weight ring slots (8 KB each), one run per value")
    ap.add_argument("--diag", default="2", choices=("2", ""), help="2 (default): also the diagnostic way with the "
                    "norm phases staged as plain copies (wrong output); '' for none")
    ap.add_argument("--compile", action="store_true", help="CPU: compile for sm90 and print what it built")
    args = ap.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    if args.compile:
        for s in stages:
            print({"stages": s, **compile_for_sm90(s)}, flush=True)
        return 0
    out, sms = out_and_sms(ap, args.out)
    chain = LayerChain(args.rows, args.layers)
    # (stages, diag, epilogue_norm) per way: the epilogue norm at every ring size, the norm before the GEMM
    # (every chunk signalled once the rows are normalized) and the diagnostics at the first
    ways = {f"ws_layer_s{s}": (s, 0, True) for s in stages}
    ways[f"ws_layer_s{stages[0]}_norm_first"] = (stages[0], 0, False)
    if args.diag:
        ways[f"ws_layer_s{stages[0]}_norms_as_copies"] = (stages[0], 2, False)
    runs = {name: (lambda way=way: run(chain, sms, *way)) for name, way in ways.items()}

    def diagnose(name: str) -> None:
        if ways[name][1] == 0:
            print(f"{name}: act of layer 0: {chain.act_diagnosis(0)}", flush=True)

    measure_layers(chain, runs, out / "ws_layer.json", sms, diagnose)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
