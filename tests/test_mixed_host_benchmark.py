"""benchmarks/mixed_host.py at toy size on the CPU: every row ran the step it names (N decode rows and C
chunks of k tokens, fresh or after a history: one sampled token per request, checked against a second,
separately built executor that runs the same plan), the op counter counts what it is given, --compare
catches a changed output, and bad flags are refused. Timings are never asserted, only their consistency."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.benchmark_scripts import load_benchmark

mh = load_benchmark("mixed_host")

NS, KS, CHUNKS, H = (3,), (4, 12), (1, 2), 8
ARGS = ["--shape", "tiny", "--ns", "3", "--ks", "4,12", "--chunks", "1,2", "--history", str(H), "--block-size", "4",
        "--reps", "2", "--warmup", "1", "--decode-prompt", "6"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out, work = tmp_path_factory.mktemp("mh"), tmp_path_factory.mktemp("ckpt")
    assert mh.main([*ARGS, "--workdir", str(work), "--out", str(out)]) == 0
    return json.loads((out / "mixed_host.json").read_text()), out, work


def test_every_row_ran_its_step(run):
    data, _, _ = run
    rows = data["rows"]
    want = [("decode", 3, 0, 0)] + [(kind, 3, c, k) for kind in ("fresh", "history", "ragged") for c in CHUNKS
                                    for k in KS if kind != "ragged" or c > 1]
    assert [(r["kind"], r["N"], r["chunks"], r["k"]) for r in rows] == want
    for r in rows:
        ids = {f"d{i}" for i in range(r["N"])} | {f"{r['kind']}{r['chunks']}x{r['k']}-c{j}" for j in range(r["chunks"])}
        assert set(r["tokens"]) == ids == set(r["logprobs"])  # one token per decoding and prefilling request
        assert all(math.isfinite(lp) and lp <= 0 for lp in r["logprobs"].values())
        C, k = r["chunks"], r["k"]
        assert r["prefill_tokens"] == (C * k - C * (C - 1) // 2 if r["kind"] == "ragged" else C * k)
        assert r["history"] == (H if r["kind"] == "history" else 0)
        assert len(r["step_samples"]) == len(r["launch_samples"]) == 2
        assert all(s >= lt > 0 for s, lt in zip(r["step_samples"], r["launch_samples"]))
        assert r["launch_ms"] == pytest.approx(sum(r["launch_samples"]) / 2)  # the median of two
        assert r["ops"] > r["compute_ops"] > 0 and sum(r["top_ops"].values()) <= r["ops"]
    assert data["meta"]["attention"] == "torch" and data["meta"]["loops"] == 3


def test_its_tokens_are_what_an_independent_executor_samples(run):
    """The history row: a fresh executor prefills the history, then the chunk beside the decode rows."""
    data, _, work = run
    args = mh.parse_args([*ARGS, "--workdir", str(work), "--out", str(work)])
    rig = mh.Rig(args, str(work / "tiny"))
    with torch.inference_mode():
        decode = rig.decoders(3)
        prefills = rig.chunks(3, 2, 12, H, "history2x12")
        result, _, _ = rig.run(prefills, decode)
    row = next(r for r in data["rows"] if (r["kind"], r["chunks"], r["k"]) == ("history", 2, 12))
    assert {t.request_id: t.token_id for t in result.sampled} == row["tokens"]
    assert {t.request_id: t.logprob for t in result.sampled} == row["logprobs"]


def test_the_op_counter_counts_dispatched_ops():
    counter = mh.OpCounter()
    x = torch.ones(3)
    with counter:
        y = (x + 1).view(3, 1).t()
        torch.mm(y, y.t())
    assert counter.ops == {"aten.add": 1, "aten.view": 1, "aten.t": 2, "aten.mm": 1}
    assert counter.views == 3


def test_compare_flags_a_changed_output(run, tmp_path):
    data, out, work = run
    assert mh.compare(data["rows"], str(out / "mixed_host.json")) == []
    bad = json.loads((out / "mixed_host.json").read_text())
    rid = next(iter(bad["rows"][1]["logprobs"]))
    bad["rows"][1]["logprobs"][rid] += 1e-9
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert mh.compare(data["rows"], str(tmp_path / "bad.json")) == ["fresh N=3 C=1 k=4"]


@pytest.mark.parametrize("flags", [["--ks", "4,x"], ["--chunks", "0"], ["--kinds", "fresh,warm"], ["--kinds", "x"],
                                   ["--history", "6"], ["--dtype", "int8"]])
def test_bad_flags_are_refused(flags, tmp_path):
    with pytest.raises(SystemExit):
        mh.parse_args([*ARGS, *flags, "--out", str(tmp_path)])
