"""engine/triton_streamk's stream-K gate_up + SiLU and qkv + RoPE + store against float64 references written from
the math (silu(x @ gate.T) * (x @ up.T); q, k, v = x W^T by heads, RoPE on q and k, k and v at their slots), in
Triton's interpreter on the CPU (TRITON_INTERPRET=1, where Triton is installed)
on fresh random inputs. The interpreter runs the programs one after another by id, so an owner's wait finds its
producers' flags up; what it checks is the split of the (tile, K block) units: program counts that give tiles
shared by two and three programs, ranges inside one tile (middle producers), ranges holding whole tiles, one
program for everything and one program per unit, a last tile past N and a last K block past K, with pointer and
TMA loads; and that every flag is zero again after the launch. On the GPU: tests/gpu/test_gpu_streamk.py."""

from __future__ import annotations

from tests.interpreter import run_interpreted

INTERPRETED = """
import math
import torch
from engine import triton_streamk
from engine.gemm_dispatch import GemmConfig, new_stream_flags

g = torch.Generator().manual_seed(0)
err = lambda a, b: float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-9))
# (rows, K, N, block_n, block_k, programs): units = ceil(N / block_n) * ceil(K / block_k)
cases = [(5, 128, 64, 16, 16, 3),     # 4 tiles x 8 blocks = 32 units in 3: whole tiles, owners, producers
         (7, 96, 48, 16, 32, 7),      # 3 x 3 = 9 units in 7: ranges inside one tile, tiles over three programs
         (16, 100, 40, 16, 32, 5),    # K past the last block, N past the last tile: 3 x 4 = 12 units in 5
         (2, 64, 32, 16, 16, 1),      # one program walks every tile
         (3, 64, 32, 16, 16, 8),      # one unit a program: every tile over four programs
         (1, 256, 16, 16, 32, 6)]     # one tile over six programs
for rows, K, N, block_n, block_k, programs in cases:
    for tma in (0, 1, 2):
        x = torch.randn(rows, K, generator=g)
        w = torch.randn(2 * N, K, generator=g) / math.sqrt(K)
        gate, up = x.double() @ w[:N].double().T, x.double() @ w[N:].double().T
        flags = new_stream_flags(torch.device("cpu"), 16)
        cfg = GemmConfig(block_n_gate=block_n, block_k=block_k, tma=tma)
        got = triton_streamk.gate_up_silu_stream(x, w, cfg, flags, num_sms=programs)
        assert got.shape == (rows, N)
        assert err(got, gate / (1 + torch.exp(-gate)) * up) < 1e-5, (rows, K, N, programs, tma)
        assert int(flags.abs().sum()) == 0, (rows, K, N, programs, tma, flags)
# more programs than units: one per unit (none empty)
assert triton_streamk.stream_programs(2, 4, 132) == 8
assert triton_streamk.stream_programs(88, 16, 132) == 132
print("ok")
"""

QKV = """
import torch
from engine import triton_streamk
from engine.gemm_dispatch import GemmConfig, new_stream_flags
from tests.oracle import qkv_inputs_cpu, qkv_rope_reference

g = torch.Generator().manual_seed(1)
err = lambda a, b: float((a.double() - b).abs().max())
# (Hq, Hkv, d, hidden, rows, block_d, block_k, programs): tiles = (Hq + 2 Hkv) x d / 2 / block_d
for Hq, Hkv, d, hidden, rows, block_d, block_k, programs in [
        (4, 2, 32, 96, 5, 16, 32, 5),     # 8 tiles x 3 blocks = 24 units in 5: owners over q, k and v heads
        (2, 1, 64, 128, 9, 32, 32, 11),   # 8 x 4 = 32 units in 11: tiles over three and four programs
        (2, 2, 32, 64, 3, 16, 16, 1),     # one program, every tile whole
        (4, 1, 32, 80, 64, 16, 32, 24)]:  # K past the last block; 64 rows (one row tile)
    for tma in (0, 2):
        x, w, pos, slots, inv_freq, k_plane, v_plane = qkv_inputs_cpu(g, rows, Hq, Hkv, d, hidden)
        flags = new_stream_flags(torch.device("cpu"), 32)
        cfg = GemmConfig(block_d_qkv=block_d, block_k_qkv=block_k, tma=tma)
        q = triton_streamk.qkv_rope_store_stream(x, w, pos, slots, inv_freq, k_plane, v_plane, Hq, Hkv, d, cfg, flags,
                                                 num_sms=programs)
        q_ref, k_ref, v_ref = qkv_rope_reference(x, w, pos, inv_freq, Hq, Hkv, d)
        assert q.shape == (rows, Hq, d) and err(q, q_ref) < 1e-3, (Hq, d, programs, tma, err(q, q_ref))
        assert err(k_plane[slots], k_ref) < 1e-3 and err(v_plane[slots], v_ref) < 1e-3, (Hq, d, programs, tma)
        rest = torch.ones(k_plane.shape[0], dtype=torch.bool)
        rest[slots] = False
        assert not k_plane[rest].any() and not v_plane[rest].any()  # no other slot written
        assert int(flags.abs().sum()) == 0
print("ok")
"""


def test_stream_k_gate_up_matches_float64_in_tritons_interpreter():
    run_interpreted(INTERPRETED)


def test_stream_k_qkv_rope_store_matches_float64_in_tritons_interpreter():
    run_interpreted(QKV)
