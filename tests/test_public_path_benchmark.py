"""benchmarks/public_path.py at toy size on the CPU: both public paths produce every token, and the profile's
parts are consistent with each other (timings themselves are never asserted)."""

from __future__ import annotations

import json

from tests.benchmark_scripts import load_benchmark

public_path = load_benchmark("public_path")


def test_tiny_run_reports_both_paths_and_a_consistent_profile(tmp_path):
    N, P, M = 3, 5, 9
    rc = public_path.main(["--device", "cpu", "--dtype", "float32", "--tiny", "-N", str(N), "-P", str(P), "-M", str(M),
                           "--configs", "interval1,deferred4", "--out", str(tmp_path / "out"),
                           "--workdir", str(tmp_path / "ckpt")])
    assert rc == 0
    data = json.loads((tmp_path / "out" / "public_path.json").read_text())
    assert [(r["config"], r["path"]) for r in data["rows"]] == [
        ("interval1", "sync"), ("interval1", "async"), ("deferred4", "sync"), ("deferred4", "async")]
    assert all(r["tokens"] == N * M for r in data["rows"])  # every request ran to max_tokens (ignore_eos)
    for r in data["rows"]:  # the timed runs' GPU-idle measure (host clocks on the CPU): every step seen
        idle = r["gpu_idle"]
        # the sync path adds every request before its first step: M steps; the async engine may start stepping
        # after the first arrival (seen in a full parallel run: 10 steps for M = 9), as the profiles below say
        steps = (M, M) if r["path"] == "sync" else (M, M + N - 1)
        assert idle["clock"] == "host" and steps[0] <= idle["steps"] <= steps[1]
        assert 0 <= idle["idle_s"] <= idle["span_s"] <= r["wall_s"]
        assert idle["gpu_idle_share"] == idle["idle_s"] / idle["span_s"]
    for p in data["profiles"]:
        assert p["tokens"] == N * M
        # M tokens: token 1 from the prefill step, then one token per step; the prefills of N short prompts
        # share one step when all N have arrived before it starts, so the round is M steps. The async engine may
        # start stepping after the first arrival, though (seen once in a full parallel run: 10 steps for M = 9):
        # then some prefills come one step later, at most N - 1 steps more
        assert M <= p["steps"] <= M + N - 1
        phases = sum(p["device_s"].values())  # on the CPU these are host clocks inside execute
        assert 0 < phases <= p["host_s"]["execute_wall"] <= p["wall_s"]
        assert p["device_s"]["prefill"] > 0 and p["device_s"]["shallow"] > 0
        assert ("deep" in p["device_s"]) == (p["config"] == "deferred4")  # interval 1: one call per step
        assert p["graph_captures_in_run"] == 0 and 0 <= p["aligning_share"] < 1
    md = (tmp_path / "out" / "public_path.md").read_text()
    assert "| interval1 |" in md and "| deferred4 |" in md and "GPU idle between steps: sync / async" in md


def test_no_profile_runs_the_timed_paths_only(tmp_path):
    rc = public_path.main(["--device", "cpu", "--dtype", "float32", "--tiny", "-N", "2", "-P", "5", "-M", "6",
                           "--configs", "interval1", "--no-profile", "--async-scheduling", "on",
                           "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "ckpt")])
    assert rc == 0
    data = json.loads((tmp_path / "out" / "public_path.json").read_text())
    assert data["profiles"] == [] and data["meta"]["async_scheduling"] == "on"
    assert [r["gpu_idle"]["steps"] for r in data["rows"]] == [6, 6]  # lookahead's steps are seen too
    assert "Where the profiled" not in (tmp_path / "out" / "public_path.md").read_text()



def test_fresh_prompts_make_the_timed_rounds_prefill_everything(tmp_path):
    N, P = 2, 40  # two full 16-token blocks per prompt
    for fresh in (False, True):
        out = tmp_path / f"out{int(fresh)}"
        rc = public_path.main(["--device", "cpu", "--dtype", "float32", "--tiny", "-N", str(N), "-P", str(P), "-M", "3",
                               "--configs", "interval1", "--no-profile", "--out", str(out),
                               "--workdir", str(tmp_path / "ckpt")] + ["--fresh-prompts"] * fresh)
        assert rc == 0
        rows = json.loads((out / "public_path.json").read_text())["rows"]
        for r in rows:  # each timed row's own counts: the warm-up's prompts share their 32 full-block tokens
            assert r["prefix_cache_hits"] == (0 if fresh else N * 32)
            assert r["prefill_tokens_computed"] == (N * P if fresh else N * (P - 32))
