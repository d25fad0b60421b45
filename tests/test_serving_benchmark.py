"""benchmarks/serving.py at toy size on the CPU: every number of its JSON is recomputed here from the raw
per-request records (numpy's percentiles, not the script's), the records are checked against the seeded
workload, and the summary against its definition. Timings are never asserted, only their consistency."""

from __future__ import annotations

import gzip
import json
import sys
import types

import numpy as np
import pytest

from tests.benchmark_scripts import load_benchmark

serving = load_benchmark("serving")
report = load_benchmark("serving_report")

N, RATE = 8, 50.0
WORKLOAD = dict(prompt_median=8, prompt_sigma=0.6, max_prompt_len=16, output_median=5, output_sigma=0.6,
                max_tokens=10)
ARGS = ["--device", "cpu", "--dtype", "float32", "--tiny", "--num-requests", str(N), "--block-size", "4",
        "--max-num-seqs", str(N), "--rates", f"{RATE:g},inf",
        "--sample-interval", "0.001"]  # a toy round on a fast CPU can end within the default 50 ms
ARGS += [x for k, v in WORKLOAD.items() for x in ("--" + k.replace("_", "-"), str(v))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


def run(out, ckpt, *extra):
    assert serving.main([*ARGS, "--workdir", str(ckpt), "--out", str(out), *extra]) == 0
    data = json.loads((out / "serving.json").read_text())
    with gzip.open(out / "serving_requests.jsonl.gz", "rt") as f:
        raw = {(line["config"], line["rate"]): line["requests"] for line in map(json.loads, f)}
    return data, raw


def logged_steps(out):
    with gzip.open(out / "serving_steps.jsonl.gz", "rt") as f:
        return {(line["config"], line["rate"]): line["steps"] for line in map(json.loads, f)}


def check_steps(row, steps, prompt_lens):
    """The step log of one round: every prompt token prefilled once (no prefix sharing, no preemption: the
    workload's own lengths), each request's last chunk sampled once, and the summary recomputed from it."""
    assert row["counters"]["preemptions"] == 0
    assert sum(s["prefill_tokens"] for s in steps) == sum(prompt_lens)
    assert sum(s["prefills_sampled"] for s in steps) == len(prompt_lens)
    assert all(s["prefill_chunks"] >= s["history_chunks"] and s["step_ms"] > 0 for s in steps)
    assert [s["t"] for s in steps] == sorted(s["t"] for s in steps) and steps[0]["t"] > 0
    for a, b in zip(steps, steps[1:]):  # a step not launched ahead starts after the result before it
        assert b["ahead"] or b["t"] - b["step_ms"] / 1e3 >= a["t"] - 1e-6
    st = row["steps"]
    decode = [s["step_ms"] for s in steps if not s["prefill_tokens"] and (s["decode_rows"] or s["deep_rows"])]
    prefill = [s["step_ms"] for s in steps if s["prefill_tokens"]]
    assert st["num_steps"] == len(steps) and prefill and decode
    check_percentiles(st["decode"]["step_ms"], decode)
    check_percentiles(st["prefill"]["step_ms"], prefill)
    assert sum(b["count"] for b in st["by_prefill_tokens"].values()) == len(prefill)
    assert st["by_prefill_tokens"]["1-64"]["count"] == len(prefill)  # prompts <= 16 tokens
    assert st["slowest"][0]["step_ms"] == max(s["step_ms"] for s in steps)
    assert st["ahead"] == 0 and st["graph_replays"] == 0  # the CPU engine: no async scheduling, no graphs
    assert row["kernels_compiled_during_round"] is None and row["drain_reasons"] == {}
    assert row["allocator_during_round"] is None  # the CUDA caching allocator's counters: CUDA only


def ms(seconds):
    return 1e3 * seconds


def tokens_per_s(records):
    return sum(sum(r["counts"]) for r in records) / max(r["times"][-1] for r in records)


def check_percentiles(got, values):
    assert got["count"] == len(values)
    assert got["p50"] <= got["p90"] <= got["p99"] <= got["max"]
    for q in (50, 90, 99):
        assert got[f"p{q}"] == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-9)
    assert got["mean"] == pytest.approx(float(np.mean(values)), rel=1e-9, abs=1e-9)


def check_round(row, records, prompt_lens, output_lens):
    """One (config, rate): the records are the seeded workload, and every number follows from them."""
    assert row["num_requests"] == len(records) == N
    for r, p, n in zip(records, prompt_lens, output_lens):
        assert (r["prompt_len"], r["output_len"], sum(r["counts"])) == (p, n, n)  # exactly the drawn length
        assert r["finish_reason"] == "length" and min(r["counts"]) >= 1
        assert r["times"] == sorted(r["times"]) and r["times"][0] > r["arrival"] >= 0
    ttft = [ms(r["times"][0] - r["arrival"]) for r in records]
    e2e = [ms(r["times"][-1] - r["arrival"]) for r in records]
    gaps = [ms(b - a) for r in records for a, b in zip(r["times"], r["times"][1:])]
    assert min(ttft) > 0
    check_percentiles(row["ttft_ms"], ttft)
    check_percentiles(row["e2e_ms"], e2e)
    check_percentiles(row["itl_ms"], gaps)
    # per token: one gap per token after a request's first, 0 for the tokens that shared a delivery
    assert row["itl_token_ms"]["count"] == sum(n - 1 for n in output_lens)
    assert row["itl_token_ms"]["mean"] == pytest.approx(sum(gaps) / sum(n - 1 for n in output_lens))
    assert sum(row["itl_hist"]) == len(gaps)
    duration = max(r["times"][-1] for r in records)
    assert row["duration_s"] == pytest.approx(duration)
    assert row["requests_per_s"] == pytest.approx(N / duration)
    assert row["output_tokens_per_s"] == pytest.approx(sum(output_lens) / duration)
    assert row["tokens_per_delivery"] == pytest.approx(sum(output_lens) / sum(len(r["times"]) for r in records))
    assert row["mean_in_flight"] == pytest.approx(sum(e2e) / 1e3 / duration)  # Little's law over the round
    assert row["peak_in_flight"] == max(sum(1 for o in records if o["arrival"] <= r["arrival"] < o["times"][-1])
                                        for r in records)
    assert row["trace"] and 1 <= row["peak_running"] <= N


def test_engine_run_numbers_follow_from_the_records(tmp_path, ckpt):
    data, raw = run(tmp_path / "out", ckpt, "--configs", "interval1,deferred4")
    rows = data["rows"]
    assert [(r["config"], r["rate"]) for r in rows] == [("interval1", RATE), ("interval1", "inf"),
                                                       ("deferred4", RATE), ("deferred4", "inf")]
    assert set(raw) == {(r["config"], r["rate"]) for r in rows}
    prompts, output_lens, _ = serving.workload(types.SimpleNamespace(**WORKLOAD), vocab=97, seed=0, n=N)
    steps = logged_steps(tmp_path / "out")
    for row in rows:
        check_steps(row, steps[(row["config"], row["rate"])], [len(p) for p in prompts])
    unit = [r["arrival"] * RATE for r in raw[("interval1", RATE)]]
    assert unit[0] == 0 and unit == sorted(unit) and unit[-1] > 0
    for row in rows:
        records = raw[(row["config"], row["rate"])]
        check_round(row, records, [len(p) for p in prompts], output_lens)
        arrivals = [r["arrival"] * RATE if row["rate"] == RATE else r["arrival"] for r in records]
        assert arrivals == pytest.approx(unit if row["rate"] == RATE else [0.0] * N, abs=1e-5)  # same pattern
    assert data["meta"]["torch"] and data["meta"]["num_requests"] == N
    # the summary, from the raw records: the highest finite rate with interval1's p99 TTFT < 1 s
    ok = [rate for (config, rate), recs in raw.items() if config == "interval1" and rate != "inf"
          and np.percentile([ms(r["times"][0] - r["arrival"]) for r in recs], 99) < 1000]
    s = data["summary"]
    assert s["rate"] == (max(ok) if ok else None)
    if ok:
        base, other = raw[("interval1", max(ok))], raw[("deferred4", max(ok))]
        assert s["compared_throughput_gain"] == pytest.approx(tokens_per_s(other) / tokens_per_s(base))
        p99 = [np.percentile([ms(b - a) for r in recs for a, b in zip(r["times"], r["times"][1:])], 99)
               for recs in (other, base)]
        assert s["compared_itl_p99_ratio"] == pytest.approx(p99[0] / p99[1])
    assert s["top_rate_throughput_gain"]["deferred4"] == pytest.approx(
        tokens_per_s(raw[("deferred4", "inf")]) / tokens_per_s(raw[("interval1", "inf")]))
    md = (tmp_path / "out" / "serving.md").read_text()
    assert "| interval1 | inf |" in md and "| deferred4 | 50.0 |" in md and "Engine steps" in md
    for name in ("serving_latency.png", "serving_running.png", "serving_gaps.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0


def test_server_run_counts_every_token_over_sse(tmp_path, ckpt, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the server subprocess: one intra-op thread, as the suite
    data, raw = run(tmp_path / "out", ckpt, "--configs", "interval1", "--server", "--no-plots")
    prompts, output_lens, _ = serving.workload(types.SimpleNamespace(**WORKLOAD), vocab=97, seed=0, n=N)
    assert [r["rate"] for r in data["rows"]] == [RATE, "inf"]
    for row in data["rows"]:
        assert row["transport"] == "http" and row["counters"]["tokens_generated"] == sum(output_lens)
        check_round(row, raw[(row["config"], row["rate"])], [len(p) for p in prompts], output_lens)
    assert data["summary"]["compared_throughput_gain"] is None and "deferred4" in data["summary"]["note"]
    assert all(r["steps"] is None for r in data["rows"]) and not logged_steps(tmp_path / "out")  # in the server


def test_no_matplotlib_no_plots(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert report.plot([row("interval1", 2.0, 100)], tmp_path, 2.0) is False and not list(tmp_path.iterdir())


def row(config, rate, ttft_p99, tok_s=100.0, itl=(10.0, 20.0)):
    return dict(config=config, rate=rate, output_tokens_per_s=tok_s, ttft_ms=dict(p50=1.0, p99=ttft_p99),
                itl_ms=dict(p50=itl[0], p99=itl[1]), e2e_ms=dict(p50=1.0, p99=2.0))


def test_summary_picks_the_highest_finite_rate_under_the_bound():
    rows = [row("interval1", 2.0, 100), row("interval1", 4.0, 900), row("interval1", 8.0, 2000),
            row("interval1", "inf", 500), row("deferred4", 2.0, 90), row("deferred4", 4.0, 400, 150.0, (5.0, 30.0)),
            row("deferred4", 8.0, 800), row("deferred4", "inf", 600, 175.0)]
    s = report.summarize(rows, 1000.0)
    assert s["rate"] == 4.0 and s["compared_throughput_gain"] == 1.5 and s["compared_itl_p99_ratio"] == 1.5
    assert s["at_rate"]["deferred4"]["itl_p50_ratio"] == 0.5 and s["top_rate_throughput_gain"]["deferred4"] == 1.75
    assert report.summarize(rows, 50.0)["rate"] is None


def test_warmup_steps_down_through_every_graph_bucket():
    lengths = serving.warmup_lengths(8, 3)
    assert [sum(1 for n in lengths if n > t) for t in range(13)] == [8] * 3 + [4] * 3 + [2] * 3 + [1] * 3 + [0]
    assert [sum(1 for n in serving.warmup_lengths(6, 1) if n > t) for t in range(5)] == [6, 4, 2, 1, 0]


@pytest.mark.parametrize("flag,value,message", [
    ("--rates", "0,inf", "--rates"), ("--rates", "4,x", "--rates"), ("--rates", "nan", "--rates"),
    ("--rates", "4,4.0", "twice"), ("--configs", "interval1,bogus", "unknown config 'bogus'"),
    ("--num-requests", "0", "--num-requests must be >= 1"), ("--output-median", "0", "--output-median must be > 0")])
def test_bad_arguments_name_the_flag(tmp_path, capsys, flag, value, message):
    with pytest.raises(SystemExit) as exc:
        serving.main(["--out", str(tmp_path), flag, value])
    assert exc.value.code == 2 and message in capsys.readouterr().err
