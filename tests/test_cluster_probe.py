"""benchmarks/cluster_probe.py: its table (always), and where Triton is importable, the constructs compiled for sm90 as
the probe reports them (the exchange through inline PTX must compile with its distributed-shared-memory instructions;
the GPU run checks its values)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.benchmark_scripts import load_benchmark


def test_the_table_names_each_construct_its_cause_and_the_gpu_runs():
    probe = load_benchmark("cluster_probe")
    report = {"triton": "3.6.0", "constructs": {
        "gluon_reduce": {"compiles": False, "error": "RuntimeError: PassManager::run failed",
                         "cause": "Assertion `helper.isReduceWithinCTA()`"},
        "ptx_exchange": {"compiles": True, "shared_cluster": 2, "mapa": 1, "cluster_barrier": 4}},
        "gpu": {"device": "H100", "us_per_round": {"dsmem": 0.5123, "l2": 1.25, "none": 0.4},
                "us_per_handoff": {"dsmem_512": 0.3, "l2_512": 0.9, "async_512": 0.25, "bulk_512": 0.2,
                                   "dsmem_16384": 1.5, "l2_16384": 2.0, "async_16384": 0.5, "bulk_16384": 0.4},
                "runs": [{"via": "dsmem", "clusters": 66, "rounds": 1, "equal": True, "unwritten": 0, "ms": 0.0101}]}}
    lines = probe.markdown(report).splitlines()
    assert lines[0].startswith("| construct (Triton 3.6.0, sm90, 2 CTAs a cluster) |")
    assert lines[2] == ("| gluon_reduce | False | - / - / - | RuntimeError: PassManager::run failed "
                        "(Assertion `helper.isReduceWithinCTA()`) |")
    assert lines[3] == "| ptx_exchange | True | 2 / 1 / 4 |  |"
    assert "| exchange, dsmem, 66 x 1 | True | 0 | 0.0101 |" in lines
    assert ("one round (a store, two cluster barriers, the peer's load): 0.512 us through the peer's shared memory, "
            "1.250 us through L2, 0.400 us for the barriers alone") in lines
    assert lines[-4:] == ["| one handoff, us (a CTA's values, then its flag / the mbarrier's transaction) | dsmem | "
                          "l2 | async | bulk |", "|---|---|---|---|---|", "| 512 B | 0.300 | 0.900 | 0.250 | 0.200 |",
                          "| 16384 B | 1.500 | 2.000 | 0.500 | 0.400 |"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (CI installs it)")
def test_the_inline_ptx_exchange_compiles_with_cluster_instructions():
    probe = load_benchmark("cluster_probe")
    report = probe.compile_report()
    assert set(report["constructs"]) == set(probe.CONSTRUCTS)
    exchange = report["constructs"]["ptx_exchange"]
    if report["triton"].startswith("3.6"):
        assert exchange["compiles"], exchange
        assert exchange["mapa"] == 1 and exchange["shared_cluster"] >= 2 and exchange["cluster_barrier"] == 6
        assert exchange["cluster_launch"] == 1
        pingpong = report["constructs"]["ptx_pingpong"]
        assert pingpong["compiles"] and pingpong["mapa"] >= 1 and pingpong["shared_cluster"] >= 2, pingpong
        # TMA loads and wgmma in each CTA of a cluster compile with layouts both CTAs hold
        wgmma = report["constructs"]["gluon_tma_wgmma"]
        assert wgmma["compiles"] and wgmma["wgmma"] > 0 and wgmma["tma_load"] == 2 and wgmma["cluster_launch"] == 1
        # Triton 3.6's own cross-CTA reduction and conversion do not lower (docs/benchmarks.md, session 37)
        assert not report["constructs"]["gluon_reduce"]["compiles"]
        assert not report["constructs"]["gluon_convert"]["compiles"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (CI installs it)")
@pytest.mark.parametrize("per_thread", [1, 32])
def test_every_handoff_way_compiles_with_its_instructions(per_thread):
    probe = load_benchmark("cluster_probe")
    own = {"dsmem": None, "l2": "release_gpu", "async": "st_async", "bulk": "bulk_copy"}  # each way's instruction
    assert set(own) == set(probe.PING_VIAS)
    for via in probe.PING_VIAS:
        result = probe.compile_one("ptx_pingpong", via, per_thread)
        assert result["compiles"], (via, result)
        assert result["cluster_launch"] == 1 and (result["mapa"] > 0) == (via != "l2"), (via, result)
        for other, key in own.items():
            if key:
                assert (result[key] > 0) == (other == via), (via, key, result)
    for via in probe.VIAS:
        result = probe.compile_one("ptx_exchange", via, per_thread)
        assert result["compiles"] and (result["mapa"] > 0) == (via == "dsmem"), (via, result)
