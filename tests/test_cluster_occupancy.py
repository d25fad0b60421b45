"""benchmarks/cluster_occupancy.py without a GPU: its ctypes structs have cuda.h's layout (the driver reads them by
offset), the kernel it asks about compiles for sm90 with each cluster size, bad flags are refused naming the flag, and
the table has a row per (size, shared memory). The query itself runs on a GPU only."""

from __future__ import annotations

import ctypes

import pytest

from tests.benchmark_scripts import load_benchmark

occ = load_benchmark("cluster_occupancy")


def test_the_structs_have_the_layout_of_cuda_h():
    # cuda.h (CUDA 12): CUlaunchAttribute { CUlaunchAttributeID id; char pad[8 - sizeof(id)]; value union [64 B] }
    assert ctypes.sizeof(occ.CUlaunchAttribute) == 72 and occ.CUlaunchAttribute.value.offset == 8
    # CUlaunchConfig: six grid / block uints, sharedMemBytes, then a pointer aligned to 8, attrs, numAttrs
    cfg = occ.CUlaunchConfig
    assert (cfg.sharedMemBytes.offset, cfg.hStream.offset, cfg.attrs.offset, cfg.numAttrs.offset) == (24, 32, 40, 48)
    assert ctypes.sizeof(cfg) == 56


def test_a_cluster_dimension_lands_in_the_value_union():
    attr = occ.CUlaunchAttribute(id=occ.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
    attr.value[0:3] = [8, 1, 1]
    raw = bytes(attr)
    assert int.from_bytes(raw[:4], "little") == 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION in cuda.h
    assert [int.from_bytes(raw[8 + 4 * i:12 + 4 * i], "little") for i in range(3)] == [8, 1, 1]


@pytest.mark.parametrize("cluster", occ.SIZES)
def test_the_kernel_compiles_for_sm90_with_each_cluster_size(cluster):
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    ptx = occ.compile_noop(cluster, 4, GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert (f".reqnctapercluster {cluster}" in ptx) == (cluster > 1)


@pytest.mark.parametrize("argv, words", [
    (["--sizes", "3"], "--sizes must be comma-separated integers, each one of 1, 2, 4, 8, 16; got '3'"),
    (["--sizes", "32"], "one of 1, 2, 4, 8, 16"), (["--sizes", "a,b"], "--sizes"), (["--sizes", ","], "--sizes"),
    (["--smem-kb", "228"], "--smem-kb must be comma-separated integers, each 0..227"),
    (["--smem-kb", "-1"], "--smem-kb"), (["--warps", "0"], "--warps must be 1..32"),
])
def test_bad_flags_are_refused_naming_the_flag(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        occ.parse_args(["--out", "x", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_the_flags_parse_into_lists():
    args = occ.parse_args(["--out", "x", "--sizes", "8,16", "--smem-kb", "0,200", "--warps", "8"])
    assert (args.sizes, args.smem_kb, args.warps) == ([8, 16], [0, 200], 8)


def test_the_table_has_a_row_per_size_and_budget():
    rows = [{"cluster": c, "smem_kb": kb, "clusters": 132 // c - kb, "ctas": (132 // c - kb) * c, "error": None}
            for c in (8, 16) for kb in (0, 3)]
    rows[-1]["error"] = "CUDA_ERROR_INVALID_CLUSTER_SIZE"
    table = occ.markdown({"device": "GPU", "sms": 132, "warps": 4, "rows": rows}).splitlines()
    assert len(table) == 2 + 4
    assert table[2] == "| 8 | 0 KB | 16 | 128 / 132 |  |"
    assert table[-1].startswith("| 16 | 3 KB | 5 | 80 / 132 |") and "INVALID_CLUSTER_SIZE" in table[-1]
