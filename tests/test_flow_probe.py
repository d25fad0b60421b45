"""benchmarks/flow_probe.py's kernels (benchmarks/flow_kernels.py) in Triton's interpreter (where Triton is
installed; CI installs it) against float64 math written here and against the engine's kernels to the bit: the counted
decode attention (and its counts), o_proj's partials after the counts (even and uneven K splits) and the split-K GEMM
with its add + norm in one launch (and its ticket); then the probe's way names and flow_trace's reading of timer
stamps on hand-made stamps."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark
from tests.interpreter import run_interpreted

INTERPRETED = """
import math
import torch
from tests.benchmark_scripts import load_benchmark
from engine import triton_attention, triton_gemm
from engine.attention_dispatch import LaunchConfig
from engine.gemm_dispatch import GemmConfig
fk = load_benchmark("flow_kernels")
g = torch.Generator().manual_seed(5)
for seqs, heads, kv_heads, d, page in [(5, 4, 2, 16, 8), (3, 2, 2, 32, 16), (4, 4, 4, 16, 4)]:
    lens = torch.randint(1, 40, (seqs,), generator=g)
    width = int(-(-lens.max() // page))
    blocks = seqs * width + 3
    tables = torch.randperm(blocks, generator=g)[: seqs * width].reshape(seqs, width).to(torch.int32)
    kb, vb = torch.randn(blocks, page, kv_heads, d, generator=g), torch.randn(blocks, page, kv_heads, d, generator=g)
    q = torch.randn(seqs, heads, d, generator=g)
    starts = torch.arange(seqs + 1, dtype=torch.int32)
    count = torch.zeros(kv_heads, dtype=torch.int32)
    cfg = LaunchConfig(block_n=16, num_warps=1, num_stages=2, splits=1)
    got = fk.attention_count(q, kb, vb, tables, lens.to(torch.int32), starts, 0.3, count, cfg)
    assert count.tolist() == [seqs] * kv_heads, count
    want = triton_attention.launch_paged_attention(q, kb, vb, tables, lens.to(torch.int32), starts, 1, 0.3, cfg)
    assert torch.equal(got, want)
    for s in range(seqs):
        ids = tables[s].long()
        k = kb[ids].reshape(-1, kv_heads, d)[: lens[s]].double()
        v = vb[ids].reshape(-1, kv_heads, d)[: lens[s]].double()
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            p = torch.softmax(0.3 * k[:, kvh] @ q[s, h].double(), 0)
            assert (got[s, h].double() - p @ v[:, kvh]).abs().max() < 1e-4, (s, h)
for rows, K, N, splits, block_k, head_cols, tma in [(3, 64, 48, 4, 16, 16, 0), (9, 128, 40, 2, 32, 32, 2),
                                                    (16, 256, 64, 4, 32, 32, 1)]:
    x = torch.randn(rows, K, generator=g)
    w = torch.randn(N, K, generator=g) / math.sqrt(K)
    cfgg = GemmConfig(block_n=16, block_k=block_k, tma=tma)
    count = torch.full((K // head_cols,), 7, dtype=torch.int32)
    even = torch.tensor(fk.split_starts(K, splits, block_k), dtype=torch.int32)
    got = fk.partials_after_counts(x, w, even, cfgg, count, 7, head_cols)
    assert torch.equal(got, triton_gemm.linear_partials(x, w, splits, cfgg))
    uneven = fk.partials_after_counts(x, w, torch.tensor([0, block_k, K], dtype=torch.int32), cfgg, count, 7,
                                      head_cols)
    for part in (got, uneven):
        assert float((part.sum(0).double() - x.double() @ w.double().T).abs().max()) < 1e-4
    assert float(uneven[0].double().sub(x[:, :block_k].double() @ w[:, :block_k].double().T).abs().max()) < 1e-4
for rows, K, N, splits, block_k, tma in [(5, 64, 48, 4, 16, 0), (9, 128, 40, 2, 32, 2), (16, 256, 64, 4, 32, 1)]:
    x = torch.randn(rows, K, generator=g)
    w = torch.randn(N, K, generator=g) / math.sqrt(K)
    h = torch.randn(rows, N, generator=g)
    wa, wb = 1 + 0.1 * torch.randn(N, generator=g), 1 + 0.1 * torch.randn(N, generator=g)
    cfgg = GemmConfig(block_n=16, block_k=block_k, tma=tma)
    ticket = torch.zeros(1, dtype=torch.int32)
    got = fk.partials_norm(x, w, splits, cfgg, ticket, h, wa, wb, 1e-6, workers=1)  # one after another here
    assert int(ticket) == -(-N // 16) * splits, ticket
    want = triton_gemm.add_rms_norm2_partials(h, triton_gemm.linear_partials(x, w, splits, cfgg), wa, wb, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    y = x.double() @ w.double().T
    hn = h.double() + y / torch.sqrt((y * y).mean(1, keepdim=True) + 1e-6) * wa.double()
    xn = hn / torch.sqrt((hn * hn).mean(1, keepdim=True) + 1e-6) * wb.double()
    assert (got[0].double() - hn).abs().max() < 1e-4 and (got[1].double() - xn).abs().max() < 1e-4
try:
    fk.attention_count(q, kb, vb, tables, lens.to(torch.int32), starts, 0.3, torch.zeros(1, dtype=torch.int32), cfg)
    raise SystemExit("a count of the wrong size was taken")
except ValueError as e:
    assert "a count per kv head" in str(e)
print("ok")
"""


def test_the_flow_kernels_match_float64_and_the_engines_kernels_in_tritons_interpreter():
    run_interpreted(INTERPRETED)


def test_the_probe_reads_its_ways_and_refuses_the_rest():
    probe = load_benchmark("flow_probe")
    assert probe.parse_way("kernels") == ("kernels", 0, ())
    assert probe.parse_way("flow:8") == ("flow", 8, ())
    assert probe.parse_way("mirror:4") == ("mirror", 4, ())
    assert probe.parse_way("flow:h6-12-15") == ("flow", 4, (6, 12, 15))
    assert probe.parse_way("fold:od") == ("fold", 0, ("o", "d"))
    for bad in ("flow:3", "flow:h6-5", "flow:h", "flow:h0-3", "mirror:h3", "fold:x", "fold:do", "kernel", "flow:"):
        with pytest.raises(ValueError, match="--ways"):
            probe.parse_way(bad)


def test_the_trace_reads_hand_made_stamps():
    torch = pytest.importorskip("torch")
    trace = load_benchmark("flow_trace")
    # two layers alike: 3 requests x 2 kv heads (program seq + 3 x head), 2 o_proj tiles x 2 splits
    att = torch.zeros(2, 6, 2, dtype=torch.int64)
    att[:, :, 0] = torch.tensor([1000, 1500, 1000, 2000, 1000, 1000])
    att[:, :, 1] = torch.tensor([5000, 6000, 7000, 8000, 9000, 10000])  # head 0 ends at 7 us, head 1 at 10 us
    o = torch.zeros(2, 4, 3, dtype=torch.int64)  # programs tile + 2 x split
    o[:, :, 0] = torch.tensor([8000, 8500, 9000, 9500])
    o[:, :, 1] = torch.tensor([9000, 9500, 10500, 11000])
    o[:, :, 2] = torch.tensor([11000, 12000, 12500, 13500])
    got = trace.summarize(att, o, 3, 2, 2, 2)
    assert got["attention_us"] == 9.0 and got["head_end_us"] == [-3.0, 0.0]
    assert got["o_first_start_us"] == -2.0 and got["o_end_us"] == 3.5
    assert got["split_counts_us"] == [-0.5, 1.0] and got["split_end_us"] == [2.0, 3.5]
    assert got["split_work_us"] == [2.0, 2.0]
    lines = trace.trace_table({"flow:2": got}).splitlines()
    assert lines[2].startswith("| flow:2 | 9.00 | -2.00 | -0.50 / +1.00 | +2.00 / +3.50 |")
    assert lines[0].count("|") == lines[2].count("|")
