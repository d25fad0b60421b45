"""engine/triton_streamk's kernel (gate_up + SiLU and qkv + RoPE + store) compiled for sm90 on the CPU (where Triton
is installed; CI installs it), at the engine's 64-row launches (TMA boxes, 4 warps; 4 stages for gate_up, 8 for qkv):
its flat K loop is software-pipelined (several stages of weight and activation boxes in shared memory, as the
one-tile kernels have; a tl.debug_barrier in the loop would have stopped that: hence the asm barrier), every
producer's partial stores come before a bar.sync and that before the one release of its flag, and an owner takes
flags with an acquire compare-and-swap. The math: the interpreter test (test_streamk_interpreted.py) and
tests/gpu/test_gpu_streamk.py."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402

from engine.gemm_dispatch import GemmConfig, qkv_stream_stages  # noqa: E402

from .test_pdl_ptx import _source  # noqa: E402


def _compiled(name: str):
    """At the engine's launch: 4 stages for gate_up (GemmConfig.num_stages), 8 for qkv (qkv_stream_stages)."""
    stages = {"gate_up_silu_stream": 4, "qkv_rope_store_stream": qkv_stream_stages(GemmConfig(), 16, 64)}[name]
    return triton.compile(_source(name, use_pdl=True, tma=2), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": stages})


@pytest.mark.parametrize("name, rows", [("gate_up_silu_stream", 64), ("qkv_rope_store_stream", 16)])
def test_the_stream_k_loop_is_pipelined(name, rows):
    stream = _compiled(name)
    stage = (2 * rows * 128 + 64 * 128) * 2  # a stage: the pair's two weight boxes (rows x 128), the activations'
    assert 3 * stage < stream.metadata.shared <= 227 * 1024
    boxes = [x for x in stream.asm["ptx"].splitlines() if "cp.async.bulk.tensor" in x]
    assert len(boxes) >= 9  # the loop's three boxes, in the prologue too (an unpipelined loop has only them)


@pytest.mark.parametrize("name", ["gate_up_silu_stream", "qkv_rope_store_stream"])
def test_a_producers_stores_come_before_a_barrier_and_then_its_release(name):
    lines = [x.strip() for x in _compiled(name).asm["ptx"].splitlines()]
    releases = [i for i, x in enumerate(lines) if "atom.global" in x and "release" in x and "exch" in x]
    assert len(releases) == 2  # the publish inside the loop and the one after it
    for i in releases:
        stores = [j for j in range(i) if lines[j].startswith("st.global.cg")]
        barrier = max(j for j in range(i) if lines[j].startswith("bar.sync"))
        assert stores and stores[-1] < barrier < i
    assert any("atom.global" in x and "acquire" in x and "cas" in x for x in lines)


@pytest.mark.parametrize("name", ["gate_up_silu_stream", "qkv_rope_store_stream"])
def test_ptxas_keeps_the_mmas_asynchronous_without_spills(tmp_path, name):
    """The running sums are never reset inside the loop (a segment's sums are them less a copy): a write to the
    MMA accumulators between MMAs makes ptxas serialize them (its warning C7515)."""
    import os
    import subprocess

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("Triton's ptxas is not installed")
    ptx = tmp_path / "stream.ptx"
    ptx.write_text(_compiled(name).asm["ptx"])
    run = subprocess.run([ptxas, "--gpu-name", "sm_90a", "-v", str(ptx), "-o", str(tmp_path / "stream.cubin")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "C7515" not in run.stderr and "serialized" not in run.stderr, run.stderr
    assert "0 bytes spill stores, 0 bytes spill loads" in run.stderr, run.stderr
