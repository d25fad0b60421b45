"""benchmarks/ws_chain64_wg.py's kernel run on the CPU by tests/gluon_emulator.py (every CTA and partition a thread,
TMA copies landing late and out of order): its protocol and arithmetic against torch, on fresh random chains, for
both ways of summing the split partials, before any GPU has run it. Where Triton is installed (CI installs it).
Proxy fences are checked here (the emulator's ProxyRace, global memory included); acquire / release ordering is
left to the GPU run of the probe."""

from __future__ import annotations

import pytest
import torch

from tests.benchmark_scripts import load_benchmark

pytest.importorskip("triton.experimental.gluon")
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma  # noqa: E402
emulator = pytest.importorskip("tests.gluon_emulator")
load_benchmark("phase_probe_ws")  # puts benchmarks/ on sys.path, as running a script of it does
probe = load_benchmark("phase_probe")
wg = load_benchmark("ws_chain64_wg")

K = probe.K


def chain(rows: int, cols: list[int], seed: int):
    return probe.Chain(rows, cols, "cpu", seed=seed)


def run(c, stages: int, splits: int, ctas: int, skip: int = 0, group: int = 0, seed: int = 0) -> torch.Tensor:
    args, constexprs = wg.launch_args(c, stages, splits, ctas, skip, group)
    c.y[1:].zero_()
    emulator.emulate(wg.ws64wg_kernel, ctas, *args, seed=seed, check_global=True, **constexprs)
    return c.output().clone()


@pytest.mark.parametrize("rows,splits,ctas,group", [(64, 4, 8, 0), (64, 4, 8, 1), (40, 2, 6, 0), (33, 2, 4, 1)])
def test_the_kernel_computes_the_chain(rows, splits, ctas, group):
    # phases of different widths (K and more columns: each phase reads the last one's first K), some CTAs with
    # more units than others; fresh weights and inputs per case
    c = chain(rows, [K + 128, K, K + 320], seed=rows * 10 + splits)
    ref = c.reference()
    out = run(c, stages=4, splits=splits, ctas=ctas, group=group, seed=rows)
    assert probe.rel_err(out, ref) < 5e-3, probe.rel_err(out, ref)
    assert torch.equal(c.y[1:, rows:], torch.zeros_like(c.y[1:, rows:]))  # rows past M never written


def test_both_ways_of_summing_agree_to_the_bit_and_do_not_depend_on_arrival_order():
    # the partials are summed in split order either way, so the CTAs' timing (the TMA engine's seed) and the way
    # of summing change nothing
    c = chain(64, [K, K + 64], seed=7)
    first = run(c, stages=3, splits=4, ctas=8, group=0, seed=1)
    for group, seed in ((0, 2), (1, 3), (1, 4)):
        assert torch.equal(run(c, stages=3, splits=4, ctas=8, group=group, seed=seed), first)


def test_the_no_sum_diagnostic_is_wrong_by_design_and_the_check_sees_it():
    c = chain(64, [K, K], seed=3)
    ref = c.reference()
    assert probe.rel_err(run(c, stages=4, splits=4, ctas=8, skip=3), ref) > 0.1  # one split's partial per tile


@gluon.jit
def _never(x_ptr):
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    mbarrier.wait(bar.index(0), 0)  # nobody arrives
    gl.store(x_ptr, 1)


@gluon.jit
def _read_in_flight(desc, x_ptr):
    buf = gl.allocate_shared_memory(desc.dtype, desc.block_type.shape, desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    mbarrier.expect(bar.index(0), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [0, 0], bar.index(0), buf)
    x = buf.load(None)  # before waiting for the copy
    mbarrier.wait(bar.index(0), 0)
    gl.store(x_ptr, x.sum())


@gluon.jit
def _store_then_copy(desc, x_ptr, FENCE: gl.constexpr):
    buf = gl.allocate_shared_memory(desc.dtype, desc.block_type.shape, desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    buf.store(gl.zeros(desc.block_type.shape, desc.dtype, None))  # the generic proxy
    if FENCE:
        fence_async_shared()
    mbarrier.expect(bar.index(0), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [0, 0], bar.index(0), buf)  # the async proxy, into the same bytes
    mbarrier.wait(bar.index(0), 0)
    gl.store(x_ptr, buf.load(None).sum())


def test_the_emulator_wants_a_proxy_fence_between_a_generic_store_and_a_tma_copy_into_it():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    desc = TensorDescriptor.from_tensor(torch.ones(64, 128, dtype=torch.bfloat16), [64, 128], wg.box_layout())
    with pytest.raises(emulator.ProxyRace, match="TMA copy into"):
        emulator.emulate(_store_then_copy, 1, desc, torch.zeros(1), FENCE=False, timeout=5.0)
    x = torch.zeros(1)
    emulator.emulate(_store_then_copy, 1, desc, x, FENCE=True, timeout=5.0)
    assert float(x) == 64 * 128


def test_the_emulator_reports_a_wait_that_never_completes_and_a_read_of_a_copy_in_flight():
    with pytest.raises(emulator.Hang, match="mbarrier.wait"):
        emulator.emulate(_never, 2, torch.zeros(1, dtype=torch.int32), timeout=1.0)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    src = torch.ones(64, 128, dtype=torch.bfloat16)
    desc = TensorDescriptor.from_tensor(src, [64, 128], wg.box_layout())
    raced = 0
    for seed in range(20):  # the copy lands late in most interleavings: the read sees it in flight
        try:
            emulator.emulate(_read_in_flight, 1, desc, torch.zeros(1), seed=seed, timeout=5.0)
        except emulator.Race:
            raced += 1
    assert raced > 0
