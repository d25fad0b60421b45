"""benchmarks/l2_reuse_probe.py on the CPU: its flags (checked before it needs a GPU, errors naming the flag), its
tables, and its read kernel's sums in Triton's interpreter (where Triton is installed; CI installs it). Its timings need
a GPU and are never asserted."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.benchmark_scripts import BENCHMARKS, load_benchmark
from tests.interpreter import run_interpreted

bench = load_benchmark("l2_reuse_probe")


def test_sizes_and_the_chain_parse():
    assert bench.parse_mb_list("8, 16,24", "--stage-mb") == [8, 16, 24]
    assert bench.parse_chain("6x4") == (6, 4) and bench.parse_chain("1X1024") == (1, 1024)


@pytest.mark.parametrize("flags, message", [
    (["--stage-mb", "8,x"], "--stage-mb must be comma-separated"),
    (["--stage-mb", "0"], "--stage-mb must list at least one positive"),
    (["--chain", "6"], "--chain must be KERNELSxMB"),
    (["--chain", "65x4"], "KERNELS in 1..64"),
    (["--kv-mb", "40", "--stage-mb", "24"], "--kv-mb (40) must be at least twice"),
    (["--rounds", "0"], "must be positive"),
    (["--persist-mb", "-1"], "--persist-mb must be 0"),
])
def test_bad_flags_are_refused_before_a_gpu_is_needed(tmp_path, flags, message):
    run = subprocess.run([sys.executable, str(BENCHMARKS / "l2_reuse_probe.py"), "--out", str(tmp_path), *flags],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_the_tables_have_a_row_per_measurement():
    rows = [dict(stager="load:normal", gap=g, stage_mb=16, round=1, other_us=100.0, same_us=96.0, saving_us=4.0,
                 of_ideal=1.05) for g in bench.GAPS]
    text = bench.markdown(rows, "a GPU", 335, 4.2)
    assert "335 MB read (a GPU; the read kernel alone: 4.20 TB/s)" in text
    assert text.count("| load:normal |") == 3 and "| load:normal | none | 16 | 1 | 100.0 | 96.0 | +4.0 | 1.05 |" in text
    side = bench.side_markdown([dict(stager="bulk:evict_last", stage_mb=24, round=2, plain_us=120.0,
                                     other_us=121.0, same_us=118.5, net_us=1.5)])
    assert "| bulk:evict_last | 24 | 2 | 120.0 | 121.0 | 118.5 | +1.5 |" in side


SUM_CHECK = """
import sys, torch
sys.path.insert(0, {bench!r})
import l2_reuse_kernels as k
out = torch.zeros(64, dtype=torch.float32)
for n, grid, policy in ((1, 1, 0), (8192 * 3 + 5, 2, 1), (8192 * 5 - 1, 4, 2), (40000, 7, 0)):
    x = torch.randn(n + 100, dtype=torch.bfloat16)
    out.zero_()
    k.read_kernel[(grid,)](x, n, out, BLOCK=8192, POLICY=policy)
    want = x[:n].double().sum().item()
    got = out[:grid].double().sum().item()
    assert abs(got - want) <= 1e-3 * (1 + abs(want)), (n, grid, got, want)
    # every program wrote its own sum: one program's slice of the grid-stride order, in float64
    for p in range(grid):
        idx = torch.cat([torch.arange(s, min(s + 8192, n)) for s in range(p * 8192, n, grid * 8192)] or
                        [torch.zeros(0, dtype=torch.long)])
        assert abs(out[p].item() - x[idx].double().sum().item()) <= 1e-3 * (1 + idx.numel() ** 0.5), (n, p)
print("ok")
"""


def test_the_read_kernel_sums_its_bytes_grid_stride_in_tritons_interpreter():
    run_interpreted(SUM_CHECK.format(bench=str(BENCHMARKS)))


@pytest.mark.parametrize("policy", ["normal", "evict_last"])
def test_the_bulk_prefetch_and_the_reads_compile_for_sm90_under_their_policies(policy):
    """Where Triton is installed (CI installs it): ptxas takes both kernels; the prefetch is one bulk L2 prefetch under
    the stager's policy, and a read's loads carry the policy they were given."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernels = load_benchmark("l2_reuse_kernels")

    def ptx(fn, signature, constexprs, warps):
        source = ASTSource(fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        assert compiled.asm["cubin"]
        return compiled.asm["ptx"]

    asm = kernels._BULK.replace("EVICT", f"evict_{policy.removeprefix('evict_')}")
    text = ptx(kernels.bulk_kernel, dict(base="i64", pieces="i32", piece_bytes="i32"), dict(ASM=asm), 1)
    assert text.count("cp.async.bulk.prefetch.L2.global") == 1
    assert f"createpolicy.fractional.L2::evict_{policy.removeprefix('evict_')}.b64" in text
    line = kernels._LINE.replace("EVICT", "::evict_last" if policy == "evict_last" else "")
    text = ptx(kernels.line_kernel, dict(base="i64", lines="i32"), dict(LINE=kernels.LINE, ASM=line, WIDTH=1024), 8)
    want = "prefetch.global.L2::evict_last [" if policy == "evict_last" else "prefetch.global.L2 ["
    assert want in text and ("evict_last" in text) == (policy == "evict_last")
    read = dict(x_ptr="*bf16", n="i32", out_ptr="*fp32")
    for name, code in kernels.POLICIES.items():
        text = ptx(kernels.read_kernel, read, dict(BLOCK=kernels.BLOCK, POLICY=code), 8)
        hints = {p for p in ("evict_last", "evict_first") if f"createpolicy.fractional.L2::{p}" in text}
        assert hints == ({name} if name != "normal" else set()), (name, hints)
