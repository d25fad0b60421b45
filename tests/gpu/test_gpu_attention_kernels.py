"""The paged attention kernel (one pass, split-K, the dispatch) against the torch reference (float64).

Marked gpu: runs on CUDA, or on CPU tensors under Triton's interpreter (a venv with triton):
    TRITON_INTERPRET=1 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gpu_attention_kernels.py
The interpreter's tl.dot is wrong for bfloat16 (fine for float16), so there float16 stands in for it.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine.attention import SeqSpan, paged_attention
from engine.attention_dispatch import LaunchConfig, max_tiles, query_tiling, tile_map
from engine.kv_cache import KVPool

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
LOW = torch.float16 if INTERPRET else torch.bfloat16
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                                  reason="needs CUDA (or TRITON_INTERPRET=1)")]


class Case:
    """Random paged KV (shuffled blocks, padded tables) and new rows; `ref` is the float64 torch reference."""

    def __init__(self, ctx: list[int], rows: list[int], heads: int, kv_heads: int, d: int, dtype: torch.dtype,
                 seed: int, block_size: int = 16, strided_q: bool = False, device: str = DEVICE) -> None:
        g = torch.Generator().manual_seed(seed)
        nb = [-(-c // block_size) for c in ctx]
        num_blocks = sum(nb) + 3
        shape = (1, 1, num_blocks, block_size, kv_heads, d)
        k, v = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
        perm = torch.randperm(num_blocks, generator=g).tolist()
        width, used, self.block_ids, tables = max(nb) + 2, 0, [], []
        for b in nb:
            self.block_ids.append(tuple(perm[used:used + b]))
            used += b
            tables.append(list(self.block_ids[-1]) + [perm[-1]] * (width - b))  # padding: a block of nobody's
        full = torch.randn(sum(rows), heads + 2 if strided_q else heads, d, generator=g).to(dtype)
        q = full[:, 1:heads + 1] if strided_q else full  # a view: row stride != heads * d
        self.scale, self.rows, self.q_ref = d**-0.5, rows, q.double()
        self.pool = KVPool.__new__(KVPool)
        self.pool.k, self.pool.v, self.pool.block_size = k.double(), v.double(), block_size
        self.ref = self.reference(ctx)
        starts = torch.zeros(len(ctx) + 1, dtype=torch.int32)
        starts[1:] = torch.tensor(rows).cumsum(0)
        # slice on the device: .to() of a non-dense view would make it contiguous there
        self.q = full.to(device)[:, 1:heads + 1] if strided_q else q.to(device)
        self.k, self.v = k[0, 0].to(device), v[0, 0].to(device)
        self.args = (torch.tensor(tables, dtype=torch.int32, device=device),
                     torch.tensor(ctx, dtype=torch.int32, device=device), starts.to(device), max(rows), self.scale)
        self.dtype = dtype
        self.ctx, self.block_size = ctx, block_size

    def poison_unread(self) -> None:
        """NaN in every key and value slot no request reads: its last page's tail, the blocks of nobody (the
        tables' padding). Memory nothing wrote holds what was there before (what another engine of the process
        freed); a kernel that reads such a slot must mask its value, not weight it by 0 (0 x NaN = NaN)."""
        read = torch.zeros(self.k.shape[:2], dtype=torch.bool)
        for ids, c in zip(self.block_ids, self.ctx):
            for p in range(c):
                read[ids[p // self.block_size], p % self.block_size] = True
        unread = ~read.to(self.k.device)
        self.k[unread] = float("nan")
        self.v[unread] = float("nan")

    def reference(self, ctx: list[int]) -> torch.Tensor:
        starts = [sum(self.rows[:i]) for i in range(len(self.rows))]
        spans = [SeqSpan(r0, n, c, ids) for r0, n, c, ids in zip(starts, self.rows, ctx, self.block_ids)]
        return paged_attention(self.q_ref, self.pool, 1, 0, spans, self.scale)

    def run(self, config: LaunchConfig | None = None) -> torch.Tensor:
        from engine.triton_attention import launch_paged_attention, triton_paged_attention

        if config is None:
            return triton_paged_attention(self.q, self.k, self.v, *self.args)
        return launch_paged_attention(self.q, self.k, self.v, *self.args, config)

    def check(self, out: torch.Tensor, ref: torch.Tensor | None = None) -> None:
        ref = self.ref if ref is None else ref
        assert out.shape == ref.shape and out.dtype == self.dtype
        assert torch.isfinite(out).all()
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        assert err < TOL[self.dtype], err


def capture(step):
    """step() run once on a side stream (its first launches compile), then captured: (graph, its output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


HEADS = [(4, 4, 128), (8, 2, 64), (4, 1, 32)]  # no GQA at Ouro's head_dim, GQA 4 and 4 at smaller heads


@pytest.mark.parametrize("dtype", [torch.float32, LOW])
@pytest.mark.parametrize("heads,kv_heads,d", HEADS)
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("block_n,splits", [(32, 1), (32, 3), (64, 4), (16, 16)])
def test_split_k_matches_reference(dtype, heads, kv_heads, d, rows, block_n, splits):
    # contexts: the new rows are the whole context; shorter than one key tile (most splits empty); not a
    # multiple of BLOCK_N or of the block size; a few tiles per split
    ctx = [rows, 7 + rows, 37, 129, 200]
    case = Case(ctx, [rows] * len(ctx), heads, kv_heads, d, dtype, seed=heads * 100 + rows * 10 + splits)
    case.check(case.run(LaunchConfig(block_n, 4, 2, splits)))


@pytest.mark.parametrize("dtype", [torch.float32, LOW])
@pytest.mark.parametrize("heads,kv_heads,d", HEADS[:2])
@pytest.mark.parametrize("splits", [1, 2, 8])
def test_varlen_rows_match_reference(dtype, heads, kv_heads, d, splits):
    # verify-style calls: every request its own number of rows, causal among themselves
    rows = [1, 5, 2, 8, 3]
    ctx = [40, 5, 97, 64, 150]
    case = Case(ctx, rows, heads, kv_heads, d, dtype, seed=7 + splits)
    case.check(case.run(LaunchConfig(32, 4, 2, splits)))


@pytest.mark.parametrize("dtype", [torch.float32, LOW])
@pytest.mark.parametrize("splits", [1, 3])
def test_tiles_past_max_block_m_run_as_m_tiles(dtype, splits):
    # 40 rows x GQA 4 = 160 query rows per kv head: 3 M tiles of 64 at d = 128 (10 of 16 in float32); the
    # short request's upper M tiles hold no row (they must write nothing and read nothing)
    heads, kv_heads, d = 8, 2, 128
    assert query_tiling(40, 4, d, fp32=dtype == torch.float32) == ((16, 10) if dtype == torch.float32 else (64, 3))
    case = Case([60, 173, 41], [40, 3, 40], heads, kv_heads, d, dtype, seed=11)
    case.check(case.run(LaunchConfig(32, 4, 2, splits)))


@pytest.mark.parametrize("dtype", [torch.float32, LOW])
@pytest.mark.parametrize("heads,kv_heads,d", HEADS)
@pytest.mark.parametrize("splits", [1, 2])
def test_tile_map_runs_only_the_listed_tiles(dtype, heads, kv_heads, d, splits):
    # graphed prefill's launch: a fresh chunk, a decode row, a chunk after a history and a short fresh
    # chunk, sized for a bucket of 128 rows; a padding sequence of no rows that the spare tiles name, and
    # query rows past every sequence (the bucket's padding) that no tile covers
    from engine.triton_attention import launch_paged_attention

    rows, ctx = [40, 1, 70, 3], [40, 50, 100, 3]
    case = Case(ctx, rows, heads, kv_heads, d, dtype, seed=heads + d + splits)
    tables, ctx_t, starts, _, scale = case.args
    bucket, group, n = 128, heads // kv_heads, sum(rows)
    tables = torch.cat([tables, tables[:1]])
    ctx_t = torch.cat([ctx_t, torch.zeros(1, dtype=torch.int32, device=DEVICE)])
    starts = torch.cat([starts, starts[-1:]])
    q = torch.cat([case.q, torch.randn(bucket - n, heads, d, device=DEVICE).to(dtype)])
    block_m, _ = query_tiling(bucket, group, d, fp32=dtype == torch.float32)
    cap = max_tiles(bucket, len(rows), group, block_m)
    tiles = torch.tensor(tile_map(rows, group, block_m, cap, pad_seq=len(rows)), dtype=torch.int32,
                         device=DEVICE).view(-1, 2)
    out = launch_paged_attention(q, case.k, case.v, tables, ctx_t, starts, bucket, scale,
                                 LaunchConfig(32, 4, 2, splits), tiles)
    case.check(out[:n])


@pytest.mark.parametrize("dtype", [torch.float32, LOW])
@pytest.mark.parametrize("splits", [1, 3])
def test_head_major_order_matches_reference(dtype, splits):
    # programs launched request by request: decode rows and verify-style rows, GQA 4 with 40 rows a request (M
    # tiles past the first, some holding no row of the short request), each against the float64 reference
    case = Case([60, 173, 41, 9], [40, 3, 40, 1], 8, 2, 128, dtype, seed=23 + splits)
    case.check(case.run(LaunchConfig(32, 4, 2, splits, head_major=True)))
    decode = Case([1, 40, 97, 300, 16], [1] * 5, 4, 4, 128, dtype, seed=29 + splits)
    decode.check(decode.run(LaunchConfig(16, 2, 3, splits, head_major=True)))


@pytest.mark.parametrize("splits", [1, 4])
def test_strided_queries(splits):
    # q as a view whose row stride is not heads * d (the output is a fresh contiguous tensor)
    case = Case([33, 90], [2, 2], 4, 2, 64, torch.float32, seed=5, strided_q=True)
    assert not case.q.is_contiguous()
    case.check(case.run(LaunchConfig(32, 4, 2, splits)))


@pytest.mark.parametrize("load", ["one", "eight", "many"])
@pytest.mark.parametrize("rows", [1, 4])
def test_dispatch_matches_reference(load, rows):
    # Ouro's heads (16 = 16 kv heads, d = 128): one request takes split-K, more than 2 programs per SM the
    # one-pass kernel, 8 requests whatever the table says
    from engine.triton_attention import default_config, num_sms

    # "many": just past the table's last split-K row for this tile (16 kv heads per request)
    from engine.attention_dispatch import LAUNCH_TABLE

    split_rows = [per_sm for per_sm, max_tile, c in LAUNCH_TABLE if c.splits > 1 and rows <= max_tile]
    many = int(max(split_rows) * num_sms(torch.device(DEVICE)) / 16) + 1
    seqs = {"one": 1, "eight": 8, "many": many}[load]
    g = torch.Generator().manual_seed(seqs)
    ctx = [int(c) for c in torch.randint(rows, 300, (seqs,), generator=g)]
    ctx[-1] = rows if seqs > 1 else ctx[-1]  # a request whose new rows are its whole context
    dtype = torch.float32 if INTERPRET else LOW  # the interpreter runs ~2,000 programs here: keep it to one dtype
    case = Case(ctx, [rows] * seqs, 16, 16, 128, dtype, seed=seqs + rows)
    config = default_config(case.q, case.k, seqs, rows)
    if load != "eight":
        assert (config.splits > 1) is (load == "one"), config
    case.check(case.run())


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_split_k_inside_a_cuda_graph_reads_context_lengths_on_the_device():
    # capture once, then change the context lengths in place: the replay must follow them
    case = Case([300, 20, 129], [4, 4, 4], 16, 16, 128, torch.float32, seed=3)
    tables, ctx, starts, max_rows, scale = case.args
    config = LaunchConfig(32, 4, 2, 8)
    from engine.triton_attention import launch_paged_attention

    def step() -> torch.Tensor:
        return launch_paged_attention(case.q, case.k, case.v, tables, ctx, starts, max_rows, scale, config)

    graph, out = capture(step)
    graph.replay()
    torch.cuda.synchronize()
    case.check(out)
    shorter = [150, 9, 64]
    ctx.copy_(torch.tensor(shorter, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    case.check(out, case.reference(shorter))


@pytest.mark.parametrize("splits", [1, 3])
def test_slots_nothing_wrote_do_not_reach_the_output(splits):
    # NaN in every slot past the contexts (an engine's pool on memory the process freed): the output is the same
    ctx = [1, 15, 16, 17, 100, 33]
    case = Case(ctx, [1] * len(ctx), 8, 8, 128, LOW, seed=splits)
    clean = case.run(LaunchConfig(32, 4, 2, splits))
    case.poison_unread()
    poisoned = case.run(LaunchConfig(32, 4, 2, splits))
    case.check(poisoned)
    assert torch.equal(poisoned, clean)
