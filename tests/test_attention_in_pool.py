"""benchmarks/attention_in_pool.py on the CPU: its --kernels parsing (the Triton kernel, Gluon rings, errors naming
the flag), its refusal without CUDA, and its table. Its timings need a GPU and are never asserted."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.attention_dispatch import DecodeConfig
from tests.benchmark_scripts import BENCHMARKS, load_benchmark

bench = load_benchmark("attention_in_pool")


def test_kernels_parse_into_the_triton_kernel_and_gluon_rings():
    assert bench.parse_kernels("triton, 32x12p1,32x6,32x12p1@128,32x6p2@64") == [
        ("triton", None, None), ("32x12p1", DecodeConfig(32, 12, ctas_per_sm=1), None),
        ("32x6", DecodeConfig(32, 6), None), ("32x12p1@128", DecodeConfig(32, 12, ctas_per_sm=1), 128),
        ("32x6p2@64", DecodeConfig(32, 6, ctas_per_sm=2), 64)]


# @CTAS: only on a persistent ring, a positive multiple of its CTAs an SM
@pytest.mark.parametrize("text", ["", " , ", "32x", "ring", "33x6", "32x6p9", "32x6@128", "triton@128",
                                  "32x12p1@0", "32x12p1@x", "32x12p2@127", "32x12p1@"])
def test_a_bad_kernel_list_names_the_flag(text):
    with pytest.raises(ValueError, match="--kernels"):
        bench.parse_kernels(text)


def test_the_script_refuses_bad_flags_before_it_needs_a_gpu(tmp_path):
    run = subprocess.run([sys.executable, str(BENCHMARKS / "attention_in_pool.py"), "--out", str(tmp_path),
                          "--kernels", "32x"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--kernels item '32x'" in run.stderr


def test_the_table_has_a_row_per_kernel_and_round():
    rows = [dict(kernel=k, round=r, back_to_back_us=100.0 + r, with_breaks_us=110.0 + r,
                 tbps_with_breaks=3.0, rel_err=1e-3) for r in (1, 2) for k in ("triton", "32x12p1")]
    text = bench.markdown(rows, 335_000_000, "a GPU")
    assert "335 MB" in text and "a GPU" in text
    body = [line for line in text.splitlines() if line.startswith("| triton") or line.startswith("| 32x12p1")]
    assert len(body) == 4 and "| 32x12p1 | 2 | 102.0 | 112.0 | 3.00 | 1.0e-03 |" in body
