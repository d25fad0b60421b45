"""Would a persistent layer kernel pay? The cost of a phase boundary on one GPU, kernels against grid barriers.

The full-depth decode step sits 1.8x (N = 8) and 1.27x (N = 64) above its bytes floor, and the profile says
the gap is a fixed cost per kernel (its first loads, its last wave, the wait for the kernel before), not the
streaming inside kernels (docs/benchmarks.md, sessions 9-12). A persistent layer kernel would replace the
kernel boundaries with grid-wide barriers, and could ask L2 for the next phase's weights while it waits.
This probe measures that trade on the same bytes before anyone builds the real kernel.

A chain of skinny GEMM phases, y_i = x_i @ W_i.T with x_i = y_(i-1)[:, :K] (K = 2048, `--rows` rows),
distinct weights per phase (24 layers x 4 phases: ~2.4 GB, so L2 holds none), each phase's columns a
multiple of the SM count in 16-column tiles, near one Ouro-1.4B layer's (qkv, o, gate_up, down), run three
ways, each in a CUDA graph:
- kernels: one Triton kernel per phase, PDL-chained like the engine's decode step (engine/pdl.py);
- persistent: one launch, `--per-sm` programs per SM (all resident at once), each looping over its tiles of
  every phase, with a grid barrier (an atomic counter per boundary, zeroed by a memset in the graph) between
  phases;
- persistent + flat: the same, each program's tiles of a phase as one loop over (tile, K block), so the
  pipeliner loads a tile's first blocks while the one before finishes (Triton's persistent-matmul pattern);
- + pfN: after arriving at a barrier and before waiting there, each program asks L2
  (cp.async.bulk.prefetch.L2) for the first N bytes of every weight row of its first tile of the next phase.
Every run's last output is checked against a torch reference. Reported: ms per chain, the bytes floor at
4.3 TB/s, and us per phase above the floor.

    python benchmarks/phase_probe.py --out DIR [--rows 8,64] [--layers 24] [--per-sm 1,2,4]
    python benchmarks/phase_probe.py --out DIR --smoke   # CPU: Triton's interpreter, one program, tiny shapes
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from gemm_sweep import COPIES  # benchmarks/ is on sys.path when a script of it runs
from gemm_sweep import timed as timed_per_copy

K, BLOCK_N, BLOCK_K, COPY_TBPS = 2048, 16, 128, 4.3
PREFETCH_BYTES = (0, 512, 2 * K)  # per weight row, at each barrier: nothing, the first two K blocks, the whole row
LAYER_COLUMNS = (6144, 2048, 11264, 5632)  # qkv, o, gate_up, down's bytes (as K = 2048 rows of 2 bytes)


def phase_columns(sms: int, layers: int, block_n: int = BLOCK_N) -> list[int]:
    """Each phase's output columns: the layer's, rounded to whole waves of `sms` tiles of block_n."""
    wave = sms * block_n
    return [max(wave, round(c / wave) * wave) for c in LAYER_COLUMNS] * layers


@triton.jit
def tile(x_ptr, w_ptr, y_ptr, col0, M, stride_x, stride_y, K, BLOCK_M: tl.constexpr,
         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # y[:, col0 : col0 + BLOCK_N] = x @ w[col0 : col0 + BLOCK_N].T over all of K
    rm = tl.arange(0, BLOCK_M)
    rn = col0 + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=(rm < M)[:, None], other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :])
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=(rm < M)[:, None])

@triton.jit
def phase_kernel(x_ptr, w_ptr, y_ptr, M, stride_y, K: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tile(x_ptr, w_ptr, y_ptr, tl.program_id(0) * BLOCK_N, M, stride_y, stride_y, K, BLOCK_M, BLOCK_N, BLOCK_K)

@triton.jit
def barrier_arrive(cnt_ptr):
    # every thread's stores of this program are done (bar.sync), then one release increment
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")


@triton.jit
def barrier_wait(cnt_ptr, expected):
    # acquire-poll until every program has arrived
    seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    while seen < expected:
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def prefetch_tile(w_ptr, col0, K: tl.constexpr, BLOCK_N: tl.constexpr, PF_BYTES: tl.constexpr):
    # ask L2 for the first PF_BYTES of rows col0 .. col0 + BLOCK_N of w, one bulk prefetch per row
    addr = w_ptr + (col0 + tl.arange(0, BLOCK_N)).to(tl.int64) * K
    size = tl.full((BLOCK_N,), PF_BYTES, tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def flat_tiles(x_ptr, w_ptr, y_ptr, n_tiles, pid, programs, M, stride_y, K: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # this program's tiles pid, pid + programs, ... as one loop over (tile, K block): the pipeliner loads the
    # next tile's first blocks while the current one finishes (Triton's persistent-matmul pattern)
    k_tiles: tl.constexpr = K // BLOCK_K
    mine = tl.maximum(n_tiles - pid + programs - 1, 0) // programs
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(0, mine * k_tiles):
        t = pid + (it // k_tiles) * programs
        ki = it % k_tiles
        rn = t * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = ki * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_y + rk[None, :], mask=(rm < M)[:, None], other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :])
        acc += tl.dot(x, tl.trans(w))
        if ki == k_tiles - 1:
            tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=(rm < M)[:, None])
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def persistent_kernel(w_ptr, y_ptr, cnt_ptr, cols_ptr, w_row_ptr, num_phases, M, stride_y, slot,
                      K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PF_BYTES: tl.constexpr, FLAT: tl.constexpr):
    # PF_BYTES > 0: between arriving at a barrier and waiting there, ask L2 for that much of each weight row
    # of this program's first tile of the next phase
    pid, programs = tl.program_id(0), tl.num_programs(0)
    for i in range(num_phases):
        w_phase = w_ptr + tl.load(w_row_ptr + i).to(tl.int64) * K
        n_tiles = tl.load(cols_ptr + i) // BLOCK_N
        if FLAT:
            flat_tiles(y_ptr + i * slot, w_phase, y_ptr + (i + 1) * slot, n_tiles, pid, programs, M, stride_y, K,
                       BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            for t in range(pid, n_tiles, programs):
                tile(y_ptr + i * slot, w_phase, y_ptr + (i + 1) * slot, t * BLOCK_N, M, stride_y, stride_y, K,
                     BLOCK_M, BLOCK_N, BLOCK_K)
        if i + 1 < num_phases:
            barrier_arrive(cnt_ptr + i)
            if PF_BYTES > 0:
                if pid < tl.load(cols_ptr + i + 1) // BLOCK_N:
                    prefetch_tile(w_ptr + tl.load(w_row_ptr + i + 1).to(tl.int64) * K, pid * BLOCK_N, K, BLOCK_N,
                                  PF_BYTES)
            barrier_wait(cnt_ptr + i, programs)


class Chain:
    """The phases' weights, the activation slots (slot 0: the input) and the ways to run them. Each phase reads
    the first k columns of the slot before (k: a multiple of BLOCK_K; the layer's K unless the smoke shrinks it)."""

    def __init__(self, rows: int, cols: list[int], device: str, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, block_n: int = BLOCK_N, k: int = K) -> None:
        g = torch.Generator(device=device).manual_seed(seed)
        self.rows, self.cols, self.device, self.block_n, self.k = rows, cols, device, block_n, k
        self.block_m = max(16, 1 << (rows - 1).bit_length())
        starts = [0]
        for c in cols:
            starts.append(starts[-1] + c)
        self.w = (torch.randn(starts[-1], k, generator=g, device=device) / k**0.5).to(dtype)
        self.starts = starts[:-1]  # host ints: a graph capture must not read the device
        self.w_rows = torch.tensor(self.starts, dtype=torch.int64, device=device)
        self.cols_t = torch.tensor(cols, dtype=torch.int32, device=device)
        self.width = max(max(cols), k)
        self.y = torch.zeros(len(cols) + 1, self.block_m, self.width, dtype=dtype, device=device)
        self.y[0, :rows, :k] = torch.randn(rows, k, generator=g, device=device).to(dtype)
        self.cnt = torch.zeros(len(cols), dtype=torch.int32, device=device)

    def check_whole_waves(self, programs: int) -> None:
        """The persistent Gluon kernels (ws_chain.py, ws_chain64.py) give every CTA a tile in every phase; a CTA
        without one would skip that phase's signals and a later wait for the same parity would pass early."""
        if any(c % (self.block_n * programs) for c in self.cols):
            raise ValueError(f"every phase must be whole waves of {self.block_n}-column tiles on {programs} "
                             f"programs (phase_columns), got {sorted(set(self.cols))}")

    def run_kernels(self, pdl: bool, block_n: int | None = None) -> None:
        """One kernel per phase, of block_n-column tiles (default: the chain's; any divisor of its columns)."""
        launch = {"launch_pdl": True} if pdl else {}
        block_n = block_n or self.block_n
        for i, c in enumerate(self.cols):
            w = self.w[self.starts[i]:self.starts[i] + c]
            phase_kernel[(c // block_n,)](self.y[i], w, self.y[i + 1], self.rows, self.width, K=self.k,
                                          BLOCK_M=self.block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
                                          USE_PDL=pdl, num_warps=4, num_stages=4, **launch)

    def run_persistent(self, programs: int, pf_bytes: int = 0, flat: bool = False) -> None:
        self.cnt.zero_()
        persistent_kernel[(programs,)](self.w, self.y, self.cnt, self.cols_t, self.w_rows, len(self.cols),
                                       self.rows, self.width, self.y.stride(0), K=self.k, BLOCK_M=self.block_m,
                                       BLOCK_N=self.block_n, BLOCK_K=BLOCK_K, PF_BYTES=pf_bytes, FLAT=flat,
                                       num_warps=4, num_stages=4)

    def resident_per_sm(self, sms: int) -> int:
        """How many persistent programs one SM holds at once (shared memory, registers, threads): more per SM
        than this would deadlock at the first barrier."""
        fits = 2048 // 128  # threads
        for pf_bytes, flat in itertools.product(PREFETCH_BYTES, (False, True)):  # every variant probe() runs
            kernel = persistent_kernel.warmup(self.w, self.y, self.cnt, self.cols_t, self.w_rows, len(self.cols),
                                              self.rows, self.width, self.y.stride(0), K=self.k, BLOCK_M=self.block_m,
                                              BLOCK_N=self.block_n, BLOCK_K=BLOCK_K, PF_BYTES=pf_bytes, FLAT=flat,
                                              num_warps=4, num_stages=4, grid=(sms,))
            kernel._init_handles()
            props = torch.cuda.get_device_properties(0)
            smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) - 1024
            fits = min(fits, smem // max(kernel.metadata.shared, 1), 65536 // max(kernel.n_regs * 128, 1))
        return fits

    def reference(self) -> torch.Tensor:
        """The last phase's output from torch, each phase rounded to the dtype as the kernels store it."""
        x = self.y[0, :self.rows, :self.k]
        for i, c in enumerate(self.cols):
            w = self.w[self.starts[i]:self.starts[i] + c]
            x_full = (x.float() @ w.float().T).to(self.w.dtype)
            x = x_full[:, :self.k]
        return x_full

    def output(self) -> torch.Tensor:
        return self.y[len(self.cols), :self.rows, :self.cols[-1]]


def timed(fn) -> float:
    """ms per call of fn, replayed from a CUDA graph (gemm_sweep.timed, which divides by its COPIES)."""
    return timed_per_copy(fn) * COPIES / 1e3


def time_in_turn(ways: dict, result: dict, path: Path, note=lambda ms: "", rounds: int = 2) -> dict:
    """Every way timed (`timed`) `rounds` times in turn, the spread between rounds being the noise: ms per call into
    result["ways"][name], printed with note(ms), and result written to `path` (JSON) after each."""
    for _ in range(rounds):
        for name, fn in ways.items():
            ms = timed(fn)
            result["ways"].setdefault(name, []).append(ms)
            print(f"{name:14s} {ms:.3f} ms a pass{note(ms)}", flush=True)
            path.write_text(json.dumps(result, indent=1))
    return result


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def probe(rows: int, layers: int, sms: int, per_sm: list[int]) -> dict:
    """The chain at `rows` rows (16-column tiles up to 16 rows, 64 above: a wider tile reads the activations
    fewer times), run every way twice in turn; persistent launches of per_sm programs per SM (all resident)."""
    block_n = BLOCK_N if rows <= 16 else 64
    chain = Chain(rows, phase_columns(sms, layers, block_n), "cuda", block_n=block_n)
    ref = chain.reference()
    floor_ms = chain.w.numel() * 2 / (COPY_TBPS * 1e9)
    ways = {"kernels": lambda: chain.run_kernels(pdl=True), "kernels_no_pdl": lambda: chain.run_kernels(pdl=False)}
    fits = chain.resident_per_sm(sms)
    for k in (k for k in per_sm if k <= fits):
        for flat in (False, True):
            for pf in PREFETCH_BYTES:
                name = f"persistent_x{k}{'_flat' if flat else ''}{f'_pf{pf}' if pf else ''}"
                ways[name] = lambda k=k, pf=pf, flat=flat: chain.run_persistent(k * sms, pf, flat)
    result = dict(rows=rows, layers=layers, block_n=block_n, phases=len(chain.cols), floor_ms=floor_ms,
                  resident_per_sm=fits, ways={})
    print(f"rows={rows}: {fits} persistent programs fit on an SM; per-SM counts tried: "
          f"{[k for k in per_sm if k <= fits]}", flush=True)
    measure(chain, ways, ref, floor_ms, result)
    return result


def out_and_sms(ap: argparse.ArgumentParser, out: str | None) -> tuple[Path, int]:
    """A measuring run's output folder (made) and the GPU's SM count; --out missing is the parser's error."""
    if not out:
        ap.error("--out is required to measure")
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    return path, torch.cuda.get_device_properties(0).multi_processor_count


def measure(chain: Chain, ways: dict, ref: torch.Tensor, floor_ms: float, result: dict) -> None:
    """Every way twice in turn (the spread between rounds is the noise), each checked against ref: ms per
    chain and us per phase above the bytes floor, into result["ways"]."""
    for _ in range(2):
        for name, fn in ways.items():
            chain.y[1:].zero_()
            ms = timed(fn)
            err = rel_err(chain.output(), ref)
            per_phase = (ms - floor_ms) * 1e3 / len(chain.cols)
            result["ways"].setdefault(name, []).append(dict(ms=ms, us_above_floor_per_phase=per_phase, rel_err=err))
            print(f"rows={chain.rows:3d} {name:30s} {ms:7.3f} ms (floor {floor_ms:.3f}) {per_phase:5.2f} us/phase "
                  f"above the floor, rel err {err:.1e}", flush=True)


def smoke() -> None:
    """CPU: both kernels in Triton's interpreter (one persistent program, so its barriers pass at once)."""
    # float32: the interpreter's dot on bf16 is not numpy's; a phase feeds the next its first K columns
    k = 2 * BLOCK_K  # the layer's K = 2048 took the interpreter ~50 s; two K blocks still test the K loop
    chain = Chain(3, [k, k + BLOCK_N, k], "cpu", dtype=torch.float32, k=k)
    ref = chain.reference()
    for run in (lambda: chain.run_kernels(pdl=False), lambda: chain.run_persistent(1),
                lambda: chain.run_persistent(1, flat=True)):
        chain.y[1:].zero_()
        run()
        assert rel_err(chain.output(), ref) < 1e-2, rel_err(chain.output(), ref)
    print("ok")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="8,64")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--per-sm", default="1,2,4", help="programs per SM of the persistent launches")
    ap.add_argument("--smoke", action="store_true", help="CPU: the kernels in Triton's interpreter, tiny shapes")
    args = ap.parse_args(argv)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke needs TRITON_INTERPRET=1 in the environment")
        smoke()
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = dict(device=torch.cuda.get_device_name(0), sms=sms, torch=torch.__version__, probes=[])
    for rows in (int(r) for r in args.rows.split(",")):
        results["probes"].append(probe(rows, args.layers, sms, [int(k) for k in args.per_sm.split(",")]))
        (out / "phase_probe.json").write_text(json.dumps(results, indent=1))
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
