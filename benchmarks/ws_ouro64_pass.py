"""A decode loop pass at up to 64 requests with benchmarks/ws_ouro64.py's launches between the engine's decode
attention calls: the launch sequence the engine's N = 64 step would run (benchmarks/ws_step64_probe.py times it
against the engine's kernels; tests/test_ws_ouro64_emulated.py runs it on the CPU against the model's float64 path).

For one loop over L layers, from the loop's input rows h:
    launch 0         ws_ouro64 without the MLP: x = n0_0 rms(h), layer 0's q, keys and values
    attention l      the engine's Gluon decode attention of layer l (q -> a)
    launch l + 1     ws_ouro64 for layer l: o, sandwich, MLP, sandwich, and layer l + 1's q, keys and values
                     (the last layer's stops at d)
    readout          triton_fused.add_rms_norm2(hm, d, n3_(L-1), model.norm): the residual and the loop's readout
Each launch is (kernel, grid, arguments, keyword arguments), so a GPU launches them and the emulator runs them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ws_ouro64 import Scratch, ouro64_args, ws_ouro64_kernel  # noqa: E402


def attention_launch(q, k_plane, v_plane, tables, lens, starts, scale: float, config, sms: int,
                     o_in: torch.Tensor) -> tuple[tuple, tuple, dict]:
    """The engine's Gluon decode attention launch (one pass: config.splits 1) with its output rows in o_in's first
    rows ([>= rows, heads x d], contiguous): grid, arguments and constexprs but USE_PDL."""
    from engine import gluon_attention

    rows, heads, d = q.shape
    if config.splits != 1:
        raise ValueError(f"config.splits must be 1 (the kernel writes the rows itself), got {config.splits}")
    if not o_in.is_contiguous() or o_in.shape[0] < rows or o_in.shape[1] != heads * d:
        raise ValueError(f"o_in must be contiguous [>= {rows}, {heads * d}], got {tuple(o_in.shape)}")
    grid, args, constexprs, (_, _, out) = gluon_attention.decode_attention_args(
        q, k_plane, v_plane, tables, lens, starts, scale, config, sms)
    rows_out = o_in[:rows].view(rows, heads, d)
    if rows_out.stride() != out.stride():
        raise ValueError(f"o_in's rows must have the kernel's output strides {out.stride()}")
    return grid, tuple(rows_out if a is out else a for a in args), dict(constexprs)


def stacked_weights(stack) -> dict:
    """engine/layer_stack.LayerStack's tensors as ouro64_args takes them (the norms' [4, layers, H] table: the
    tensor LayerStack.norms are views of)."""
    norms = stack.norms[0]._base
    if norms is None or norms.shape != (4, *stack.norms[0].shape) or norms[1].data_ptr() != stack.norms[1].data_ptr():
        raise ValueError("the stack's norms must be views of one [4, layers, hidden] tensor (layer_stack.stack_layers)")
    return {"wq": stack.wq, "wo": stack.wo, "wgu": stack.wgu, "wd": stack.wd, "norms": norms}


class Ouro64Pass:
    """One loop's launches over `pool`'s planes of `loop` for the requests of `meta` (one row each, at most 64):
    rows h -> the loop's readout (self.readout) and the residual (self.h_out), q / a / h buffers of its own."""

    def __init__(self, w: dict, final_norm: torch.Tensor, inv_freq: torch.Tensor, pool, loop: int, meta, sms: int,
                 decode_config, eps: float, stages: int = 8, s_in: int = 4, s_down: int = 11) -> None:
        layers, h = w["norms"].shape[1], w["norms"].shape[2]
        qkv, inter = w["wq"].shape[0] // layers, w["wd"].shape[1]
        rows = meta.context_lens.shape[0]
        k0 = pool.plane(loop, 0)[0]
        hkv, d = k0.shape[1], k0.shape[2]
        hq = (qkv - 2 * hkv * d) // d
        dev, bf16 = k0.device, torch.bfloat16
        self.w, self.final_norm, self.eps, self.layers = w, final_norm, eps, layers
        self.sc = Scratch(h, qkv, inter, layers + 1, sms, s_in, s_down, dev)
        self.h = torch.zeros(rows, h, dtype=bf16, device=dev)  # the loop's input: copy_ into it
        self.h_mid = [torch.zeros(rows, h, dtype=bf16, device=dev) for _ in range(2)]
        self.q = torch.zeros(rows, hq * d, dtype=bf16, device=dev)
        self.a = torch.zeros(rows, h, dtype=bf16, device=dev)
        self.way = (stages, s_in, s_down)
        self.rope = (meta.positions, meta.slots, inv_freq)
        self.pool, self.loop, self.meta, self.sms, self.config = pool, loop, meta, sms, decode_config

    def _layer(self, launch: int, layer: int, h_in, h_out, has_mlp: bool, has_qkv: bool) -> tuple:
        kv = self.pool.plane(self.loop, layer + 1 if has_qkv else layer)
        rows = {"h": h_in, "h_out": h_out, "a": self.a, "q": self.q}
        args, kwargs = ouro64_args(self.w, self.sc, launch, layer, rows, kv, self.rope, self.eps, has_mlp, has_qkv,
                                   *self.way)
        return ws_ouro64_kernel, (self.sms,), args, kwargs

    def _attention(self, layer: int) -> tuple:
        from engine import gluon_attention

        k, v = self.pool.block_plane(self.loop, layer)
        q = self.q.view(self.q.shape[0], -1, k.shape[-1])
        m = self.meta
        grid, args, kwargs = attention_launch(q, k, v, m.block_tables, m.context_lens, m.query_start,
                                              k.shape[-1] ** -0.5, self.config, self.sms, self.a)
        return gluon_attention.decode_attention_kernel, grid, args, kwargs

    def launches(self) -> list[tuple]:
        """Every launch of the pass in order, (kernel, grid, args, kwargs), its USE_PDL left to the caller."""
        out = [self._layer(0, -1, self.h, self.h_mid[0], False, True)]
        h_in = self.h
        for layer in range(self.layers):
            h_out = self.h_mid[layer % 2]
            out.append(self._attention(layer))
            out.append(self._layer(layer + 1, layer, h_in, h_out, True, layer + 1 < self.layers))
            h_in = h_out
        return out

    def readout_inputs(self) -> tuple[torch.Tensor, ...]:
        """The readout's add + norm inputs once the launches ran: (hm, d, n3 of the last layer, the final norm)."""
        rows = self.h.shape[0]
        return self.sc.hm[:rows], self.sc.d[:rows], self.w["norms"][3, self.layers - 1], self.final_norm

    def run(self, use_pdl: bool = True) -> torch.Tensor:
        """The pass on the GPU: counts zeroed, every launch (with PDL as the engine's kernels where use_pdl), the
        readout's add + norm; returns the readout."""
        from engine import gluon_attention, pdl, triton_fused

        device = self.h.device
        on = pdl.launch_kwargs(device) if use_pdl else {"USE_PDL": False}
        attention = gluon_attention._pdl_kwargs(device, self.config) if use_pdl else {"USE_PDL": 0}
        self.sc.zero_counts()
        for kernel, grid, args, kwargs in self.launches():
            kernel[grid](*args, **kwargs, **(on if kernel is ws_ouro64_kernel else attention))
        hm, d, n3, final = self.readout_inputs()
        self.h_out, self.readout = triton_fused.add_rms_norm2(hm, d, n3, final, self.eps)
        return self.readout
