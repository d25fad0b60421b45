"""engine/triton_streamk's stream-K gate_up + SiLU and qkv + RoPE + store on the GPU (`pytest -m gpu`): against
float64 references of the math and against the one-tile kernels they replace, at Ouro-1.4B's shape and small ones,
with the program count bounded so tiles are shared by two, three and more programs; gate_up replayed in a CUDA
graph on one set of flags with fresh inputs, and chained launch after launch under PDL (each launch reads the one
before's output). Every launch must leave the flags at zero. In the engine against the cuBLAS path:
test_gpu_gemm.py's engine test."""

from __future__ import annotations

import pytest
import torch

from engine.gemm_dispatch import GemmConfig, new_stream_flags
from tests.oracle import qkv_rope_reference

from .test_gpu_gemm import qkv_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF = dict(device="cuda", dtype=torch.bfloat16)


def kernels():
    """(triton_gemm, triton_streamk): Triton's modules, imported where a GPU runs them (collection needs no Triton)."""
    from engine import triton_gemm, triton_streamk

    return triton_gemm, triton_streamk


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in float64 from the bf16 roundings of gate and up (as F.linear's outputs are rounded)."""
    n = w.shape[0] // 2
    gate_up = (x.double() @ w.double().T).to(x.dtype).double()
    gate, up = gate_up[:, :n], gate_up[:, n:]
    return gate / (1 + torch.exp(-gate)) * up


@pytest.mark.parametrize("rows", [1, 8, 33, 64])
@pytest.mark.parametrize("hidden,inter", [(2048, 5632), (256, 320), (96, 200)])
@pytest.mark.parametrize("tma", [0, 2])
@pytest.mark.parametrize("num_sms", [None, 7, 64])
def test_stream_k_gate_up_matches_float64_and_the_one_tile_kernel(rows, hidden, inter, tma, num_sms):
    triton_gemm, triton_streamk = kernels()
    g = torch.Generator(device="cuda").manual_seed(rows * 31 + inter)
    x = torch.randn(rows, hidden, generator=g, **BF)
    w = torch.randn(2 * inter, hidden, generator=g, **BF) / hidden**0.5
    cfg = GemmConfig(block_n_gate=64, block_k=128, tma=tma)
    flags = new_stream_flags(x.device)
    got = triton_streamk.gate_up_silu_stream(x, w, cfg, flags, num_sms=num_sms)
    torch.cuda.synchronize()
    assert int(flags.abs().sum()) == 0
    exact = reference(x, w)
    assert rel_err(got, exact) < 1e-2
    one_tile = triton_gemm.gate_up_silu(x, w, cfg)
    assert rel_err(got, one_tile) < 1e-2 and rel_err(one_tile, exact) < 1e-2


@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("Hq,Hkv,d,hidden", [(16, 16, 128, 2048), (4, 2, 64, 256)])
@pytest.mark.parametrize("block_d", [16, 32])
@pytest.mark.parametrize("num_sms", [None, 7])
def test_stream_k_qkv_rope_store_matches_float64_and_the_one_tile_kernel(rows, Hq, Hkv, d, hidden, block_d, num_sms):
    triton_gemm, triton_streamk = kernels()
    x, w, pos, slots, inv_freq, n_slots = qkv_inputs(rows, Hq, Hkv, d, hidden, rows * 13 + Hq + block_d)
    cfg = GemmConfig(block_d_qkv=block_d, block_k_qkv=128, tma=2)
    planes = {name: [torch.zeros(n_slots, Hkv, d, **BF) for _ in range(2)] for name in ("stream", "one")}
    flags = new_stream_flags(x.device)
    q = triton_streamk.qkv_rope_store_stream(x, w, pos, slots, inv_freq, *planes["stream"], Hq, Hkv, d, cfg, flags,
                                             num_sms=num_sms)
    q_one = triton_gemm.qkv_rope_store(x, w, pos, slots, inv_freq, *planes["one"], Hq, Hkv, d, cfg)
    torch.cuda.synchronize()
    assert int(flags.abs().sum()) == 0
    q_ref, k_ref, v_ref = qkv_rope_reference(x, w, pos, inv_freq, Hq, Hkv, d)
    k_plane, v_plane = planes["stream"]
    assert rel_err(q, q_ref) < 1e-2 and rel_err(k_plane[slots], k_ref) < 1e-2 and rel_err(v_plane[slots], v_ref) < 1e-2
    assert rel_err(q, q_one) < 1e-2 and rel_err(k_plane, planes["one"][0]) < 1e-2
    rest = torch.ones(n_slots, dtype=torch.bool, device="cuda")
    rest[slots] = False
    assert not k_plane[rest].any() and not v_plane[rest].any()  # no other slot written


def test_stream_k_gate_up_replays_in_a_graph_with_fresh_inputs():
    _, triton_streamk = kernels()
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(64, 2048, generator=g, **BF)
    w = torch.randn(2 * 5632, 2048, generator=g, **BF) / 2048**0.5
    cfg, flags = GemmConfig(block_n_gate=64, block_k=128, tma=2), new_stream_flags(x.device)
    triton_streamk.gate_up_silu_stream(x, w, cfg, flags)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_streamk.gate_up_silu_stream(x, w, cfg, flags)
    before = None
    for _ in range(20):
        x.copy_(torch.randn(64, 2048, generator=g, **BF))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference(x, w)) < 1e-2
        assert before is None or not torch.equal(out, before)  # each replay computed this replay's input
        before = out.clone()
    assert int(flags.abs().sum()) == 0


def test_chained_stream_k_launches_under_pdl_read_the_launch_befores_output():
    """Eight launches back to back in a graph, each reading the one before's output (a PDL edge between stream-K
    kernels: the next one's programs touch the flags only after its wait), against the one-tile chain, replayed on
    new inputs."""
    triton_gemm, triton_streamk = kernels()
    g = torch.Generator(device="cuda").manual_seed(4)
    n = 512
    x0 = torch.randn(64, n, generator=g, **BF)
    # Each weight is scaled so that its launch's output has a mean square near 1 on x0: silu(g) * u is about of
    # degree 2 in w, so unscaled the chain under- or overflows bf16 within eight launches; the replays' inputs are
    # x0 plus noise (on a fresh draw the chain's mean square drifts off by its square each launch).
    ws, x = [], x0
    for _ in range(8):
        w = torch.randn(2 * n, n, generator=g, **BF) / n**0.5
        ws.append(w / float(reference(x, w).pow(2).mean()) ** 0.25)
        x = reference(x, ws[-1]).to(torch.bfloat16)
    cfg, flags = GemmConfig(block_n_gate=64, block_k=128, tma=2), new_stream_flags(torch.device("cuda"))

    def chain(fn):
        x = x0
        for w in ws:
            x = fn(x, w)
        return x

    chain(lambda x, w: triton_streamk.gate_up_silu_stream(x, w, cfg, flags))  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(lambda x, w: triton_streamk.gate_up_silu_stream(x, w, cfg, flags))
    base = x0.clone()
    for _ in range(5):
        x0.copy_(base + 0.1 * torch.randn(64, n, generator=g, **BF))
        graph.replay()
        want = chain(lambda x, w: triton_gemm.gate_up_silu(x, w, cfg))
        torch.cuda.synchronize()
        assert rel_err(got, want) < 3e-2
    assert int(flags.abs().sum()) == 0

