"""A decode loop pass of 9..64 requests (one new row each) as gluon_layers64.py's launches between the engine's
decode attention calls: OuroForCausalLM.run_loops sends a call here where layer_stack.layers64_run says so (the
switch and the rules in layers64_dispatch.py). For each loop over L layers, from the loop's input rows h:
    launch 0         without the MLP: x = n0_0 rms(h), layer 0's q, keys and values
    attention l      layer l's decode attention as the engine dispatches it (triton_paged_attention: the Gluon
                     decode kernel, or Triton's paged kernel past 2 (request, head) pairs per SM, as at 64
                     requests of Ouro-1.4B), its rows a into the scratch's buffer
    launch l + 1     layer l: o, sandwich, MLP, sandwich, and layer l + 1's q, keys and values (the last layer's
                     stops at d)
    readout          triton_fused.add_rms_norm2(hm, d, n3_(L-1), model.norm): the loop's readout, the next's input
`pass_launches` lists them as (kernel, grid, arguments, keyword arguments) so the emulator can run them
(tests/test_gluon_layers64_emulated.py). What the launches read and write besides the rows lives on the model's
LayerStack (`Scratch64`, made outside any graph capture). Imported lazily (Triton).
"""

from __future__ import annotations

import torch

from . import layers64_dispatch as d64
from . import pdl
from .gluon_layers64 import layers64_kernel


class Scratch64:
    """The launches' buffers: hm, o, d and the attention rows a ([64, H] bf16), act ([64, INTER]), the tiles' row
    sums of o and d, the float32 partials, the staged ranges' row sums, per launch of a pass its four phase counts
    and [4, CTAs] group counts (zeroed once a pass), and the TMA descriptors (cached: a graph captures them once)."""

    def __init__(self, stack, sms: int, k_range: int = d64.K_RANGE) -> None:
        h, inter, qkv, layers = stack.wo.shape[1], stack.inter, stack.qkv_width, stack.layers
        self.s_in, self.s_down = d64.splits(h, inter, k_range)
        dev, bf16 = stack.wq.device, stack.wq.dtype

        def rows(width, dtype=bf16):
            return torch.zeros(d64.ROWS, width, dtype=dtype, device=dev)

        self.hm, self.o, self.d, self.a, self.act = rows(h), rows(h), rows(h), rows(h), rows(inter)
        self.osq = torch.zeros(h // d64.TILE_N, d64.ROWS, dtype=torch.float32, device=dev)
        self.dsq = torch.zeros_like(self.osq)
        self.part = torch.zeros(max(self.s_in, self.s_down), d64.ROWS, max(qkv, 2 * inter), dtype=torch.float32,
                                device=dev)
        self.rowsq = torch.zeros(4, sms, d64.ROWS, dtype=torch.float32, device=dev)
        self.counts = torch.zeros(layers + 1, 4 + 4 * sms, dtype=torch.int32, device=dev)
        self.norms = stack.norm_table  # [4, layers, H]: n0..n3 (layer_stack.NORMS)
        self.descriptors = self._descriptors(stack)

    def _descriptors(self, stack) -> tuple:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        layout = gl.NVMMASharedLayout.get_default_for([d64.ROWS, d64.BOX_K], gl.bfloat16)
        return tuple(TensorDescriptor.from_tensor(t, [d64.ROWS, d64.BOX_K], layout)
                     for t in (stack.wo, stack.wgu, stack.wd, stack.wq, self.a, self.act))


def warm(stack, device: torch.device) -> None:
    """Compile and load the three launch kinds (a pass's first, a middle layer's, its last) by running each once on
    zeros at 64 rows: a graph capture may then record them without compiling (layer_stack.stack_layers calls this
    where OUROBATCH_DECODE_LAYERS64 is on; each is one compile, its rows and layer not specialized)."""
    sc = scratch(stack, device)
    h, heads_d = torch.zeros(d64.ROWS, stack.wo.shape[1], dtype=stack.wq.dtype, device=device), stack.wo.shape[1]
    d = stack.inv_freq.shape[0] * 2
    kv_heads = (stack.qkv_width - heads_d) // (2 * d)
    plane = torch.zeros(1, kv_heads, d, dtype=h.dtype, device=device)  # every row's key and value to slot 0
    index = torch.zeros(d64.ROWS, dtype=torch.int64, device=device)
    rows = {"h": h, "h_out": torch.zeros_like(h), "q": torch.zeros(d64.ROWS, heads_d, dtype=h.dtype, device=device)}
    for layer, has_mlp, has_qkv in ((-1, False, True), (0, True, True), (0, True, False)):
        sc.counts.zero_()
        args, kwargs = layer_args(stack, sc, 0, layer, rows, (plane, plane), (index, index, stack.inv_freq), 1e-6,
                                  has_mlp, has_qkv)
        layers64_kernel[(pdl.num_sms(device),)](*args, **kwargs, **pdl.launch_kwargs(device))
    torch.cuda.synchronize(device)


def scratch(stack, device: torch.device) -> Scratch64:
    """The stack's Scratch64, made on first use (refused inside a graph capture: its buffers must outlive it)."""
    found = getattr(stack, "scratch64", None)
    if found is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("layers64: the scratch buffers must be made before a graph capture "
                               "(layer_stack.stack_layers makes them where OUROBATCH_DECODE_LAYERS64 is on)")
        found = stack.scratch64 = Scratch64(stack, pdl.num_sms(device))
    return found


def layer_args(stack, sc: Scratch64, launch: int, layer: int, rows: dict, kv, rope, eps: float, has_mlp: bool,
               has_qkv: bool) -> tuple[tuple, dict]:
    """layers64_kernel's arguments and constexprs but USE_PDL. launch: its counts' row in the pass; layer: the
    MLP's (-1 without); rows: h, h_out ([M, H]), q ([M, HQ x D]); kv: layer + 1's planes ([slots, HKV, D]); rope:
    (positions [M] int64, slots [M] int64, inv_freq [D / 2] float32)."""
    h_in, q = rows["h"], rows["q"]
    hkv, d = kv[0].shape[-2], kv[0].shape[-1]
    counts = sc.counts[launch]
    args = (*sc.descriptors, h_in, rows["h_out"], sc.hm, sc.o, sc.d, sc.act, sc.osq, sc.dsq, sc.norms, q, kv[0],
            kv[1], *rope, sc.part, sc.rowsq, counts[:4], counts[4:], layer, h_in.shape[0], eps)
    return args, dict(H=h_in.shape[1], QKV=stack.qkv_width, INTER=stack.inter, HQ=q.shape[1] // d, HKV=hkv, D=d,
                      LAYERS=stack.layers, PW=sc.part.shape[2], S_IN=sc.s_in, S_DOWN=sc.s_down, STAGES=d64.STAGES,
                      HAS_MLP=has_mlp, HAS_QKV=has_qkv, num_warps=4)


def _attention(sc: Scratch64, q: torch.Tensor, pool, loop: int, layer: int, meta, config, sms: int):
    """Layer `layer`'s decode attention, its rows into sc.a: the engine's dispatch (triton_paged_attention: the Gluon
    decode kernel or Triton's, as for any decode call) as a call, or with `config` the Gluon kernel's launch."""
    k, v = pool.block_plane(loop, layer)
    rows, d = q.shape[0], k.shape[-1]
    q3, out, m = q.view(rows, -1, d), sc.a[:rows].view(rows, -1, d), meta
    if config is None:
        from .triton_attention import triton_paged_attention

        return lambda: triton_paged_attention(q3, k, v, m.block_tables, m.context_lens, m.query_start, 1, d**-0.5,
                                              None, out)
    from . import gluon_attention

    grid, args, constexprs, _ = gluon_attention.decode_attention_args(
        q3, k, v, m.block_tables, m.context_lens, m.query_start, d**-0.5, config, sms, out)
    return gluon_attention.decode_attention_kernel, grid, args, constexprs


def pass_launches(stack, sc: Scratch64, h: torch.Tensor, pool, loop: int, meta, eps: float, sms: int,
                  attention=None) -> tuple[list, torch.Tensor]:
    """One loop's launches in order and the q rows they pass between them; h: the loop's input rows [M, H]. A
    layer launch is (kernel, grid, args, kwargs), its USE_PDL left to the caller; an attention is a call of the
    engine's dispatch, or with `attention` (a DecodeConfig, one pass: the emulator's) the Gluon kernel's launch."""
    layers = stack.layers
    q = torch.empty(h.shape[0], stack.wo.shape[1], dtype=h.dtype, device=h.device)  # heads x d == hidden
    rope = (meta.positions, meta.slots, stack.inv_freq)

    def layer(launch, index, h_in, h_out, has_mlp, has_qkv):
        kv = pool.plane(loop, index + 1 if has_qkv else index)
        args, kwargs = layer_args(stack, sc, launch, index, {"h": h_in, "h_out": h_out, "q": q}, kv, rope, eps,
                                  has_mlp, has_qkv)
        return layers64_kernel, (sms,), args, kwargs

    out = [layer(0, -1, h, h, False, True)]
    h_in = h
    for index in range(layers):
        h_out = torch.empty_like(h) if index + 1 < layers else h_in  # the last layer writes no residual
        out.append(_attention(sc, q, pool, loop, index, meta, attention, sms))
        out.append(layer(index + 1, index, h_in, h_out, True, index + 1 < layers))
        h_in = h_out
    return out, q


def readout_inputs(stack, sc: Scratch64, rows: int) -> tuple[torch.Tensor, ...]:
    """The readout's add + norm inputs once a pass's launches ran: (hm, d, n3 of the last layer, the final norm)."""
    return sc.hm[:rows], sc.d[:rows], sc.norms[3, stack.layers - 1], stack.final_norm


def run_loops(model, h: torch.Tensor, meta, pool, first_loop: int, last_loop: int) -> list[torch.Tensor]:
    """OuroForCausalLM.run_loops through the launches: per loop its launches (PDL as the engine's kernels), the
    attention as the engine dispatches it, and the readout's add + norm."""
    from . import triton_fused

    stack, device, eps = model.layer_stack, h.device, model.config.rms_norm_eps
    sc, sms, layer_pdl = scratch(stack, device), pdl.num_sms(device), pdl.launch_kwargs(device)
    readouts = []
    for loop in range(first_loop, last_loop + 1):
        sc.counts.zero_()
        launches, _ = pass_launches(stack, sc, h, pool, loop, meta, eps, sms)
        for launch in launches:
            if callable(launch):  # an attention call
                launch()
            else:
                kernel, grid, args, kwargs = launch
                kernel[grid](*args, **kwargs, **layer_pdl)
        _, h = triton_fused.add_rms_norm2(*readout_inputs(stack, sc, h.shape[0]), eps)
        readouts.append(h)
    return readouts
