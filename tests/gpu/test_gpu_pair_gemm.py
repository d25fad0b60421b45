"""engine/gluon_pair_gemm.py's weight-prefetching gate_up + SiLU and qkv + RoPE + store on the GPU (`pytest -m gpu`):
against float64 references and against triton_gemm's kernels they would replace, at Ouro-1.4B's shape and small ones,
weights from launch or after the wait, with and without PDL; chained under PDL (each launch reads the output of an
add + norm kernel right before it), and replayed in a CUDA graph with fresh inputs. In the engine:
test_gpu_gemm.py's engine test."""

from __future__ import annotations

import pytest
import torch

from engine.gemm_dispatch import GemmConfig
from tests.oracle import qkv_rope_reference

from .test_gpu_gemm import qkv_inputs
from .test_gpu_streamk import reference, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF = {"device": "cuda", "dtype": torch.bfloat16}


@pytest.mark.parametrize("rows", [1, 9, 40, 64])
@pytest.mark.parametrize("hidden,inter", [(2048, 5632), (256, 320)])
@pytest.mark.parametrize("prefetch,use_pdl,ring", [(True, True, (8, 4)), (False, True, (8, 2)),
                                                   (True, False, (10, 2))])
def test_gate_up_matches_float64_and_tritons(rows, hidden, inter, prefetch, use_pdl, ring):
    from engine import gluon_pair_gemm, triton_gemm

    g = torch.Generator(device="cuda").manual_seed(rows * 31 + inter)
    x = torch.randn(rows, hidden, generator=g, **BF)
    w = torch.randn(2 * inter, hidden, generator=g, **BF) / hidden**0.5
    got = gluon_pair_gemm.gate_up_silu(x, w, stages=ring[0], x_stages=ring[1], prefetch=prefetch, use_pdl=use_pdl)
    exact = reference(x, w)
    assert rel_err(got, exact) < 1e-2
    assert rel_err(got, triton_gemm.gate_up_silu(x, w, GemmConfig(block_n_gate=64, tma=2))) < 1e-2


@pytest.mark.parametrize("rows", [1, 9, 40, 64])
@pytest.mark.parametrize("Hq,Hkv,d,hidden,bd", [(16, 16, 128, 2048, 16), (4, 2, 64, 256, 32), (8, 1, 32, 128, 16)])
@pytest.mark.parametrize("prefetch,ring", [(True, (16, 2)), (False, (8, 4))])
def test_qkv_rope_store_matches_float64(rows, Hq, Hkv, d, hidden, bd, prefetch, ring):
    from engine import gluon_pair_gemm

    x, w, pos, slots, inv_freq, n_slots = qkv_inputs(rows, Hq, Hkv, d, hidden, rows * 13 + d)
    planes = [torch.zeros(n_slots, Hkv, d, **BF) for _ in range(2)]
    q = gluon_pair_gemm.qkv_rope_store(x, w, (pos, slots, inv_freq, *planes), Hq, Hkv, d, bd=bd, stages=ring[0],
                                       x_stages=ring[1], prefetch=prefetch)
    want_q, want_k, want_v = qkv_rope_reference(x, w, pos, inv_freq, Hq, Hkv, d)
    assert rel_err(q, want_q) < 1e-2
    assert rel_err(planes[0][slots], want_k) < 1e-2 and rel_err(planes[1][slots], want_v) < 1e-2
    rest = torch.ones(n_slots, dtype=torch.bool, device="cuda")
    rest[slots] = False
    assert not planes[0][rest].any() and not planes[1][rest].any()


def test_a_chain_under_pdl_reads_each_norms_output_and_replays_in_a_graph():
    # add + norm -> gate_up, eight times over with each gate_up's output feeding the next partials: a weight box
    # loaded before the wait is fine, an activation box loaded before it would read the last chain's rows
    from engine import gluon_pair_gemm, triton_gemm

    g = torch.Generator(device="cuda").manual_seed(5)
    hidden, rows = 256, 40  # gate_up's intermediate = hidden: its output is the next link's residual
    wa, wb = (1 + 0.1 * torch.randn(hidden, generator=g, **BF) for _ in range(2))
    w_gu = torch.randn(2 * hidden, hidden, generator=g, **BF) / hidden**0.5
    w_d = torch.randn(hidden, hidden, generator=g, **BF) / hidden**0.5
    cfg = GemmConfig(block_n=64, block_n_gate=64, tma=2)

    def chain(gate_up, h):
        outs = []
        for _ in range(8):
            h, x = triton_gemm.add_rms_norm2_partials(h, triton_gemm.linear_partials(h, w_d, 1, cfg), wa, wb, 1e-6)
            h = gate_up(x)
            outs.append(h)
        return torch.stack(outs)

    static = torch.randn(rows, hidden, generator=g, **BF)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(lambda x: gluon_pair_gemm.gate_up_silu(x, w_gu), static)
    for _ in range(2):
        static.copy_(torch.randn(rows, hidden, generator=g, **BF))
        graph.replay()
        want = chain(lambda x: triton_gemm.gate_up_silu(x, w_gu, cfg), static.clone())
        assert rel_err(got, want) < 2e-2
