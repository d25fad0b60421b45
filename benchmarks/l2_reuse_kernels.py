"""Kernels and timing for benchmarks/l2_reuse_probe.py: a grid-stride read with an L2 eviction policy, Hopper's
bulk prefetch into L2 over a buffer's first bytes, and sequences of them timed in CUDA graphs."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gemm_sweep, however this module was loaded

from gemm_sweep import COPIES, timed  # noqa: E402  (us a copy: a graph of COPIES runs, replayed)

BLOCK = 8192  # elements a program reads an iteration (16 KB of bf16)
PIECE = 64 << 10  # bytes a bulk prefetch asks for (one of the pool's pages)
POLICIES = {"normal": 0, "evict_last": 1, "evict_first": 2}

_BULK = """{
.reg .b64 pol;
createpolicy.fractional.L2::EVICT.b64 pol, 1.0;
cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
mov.u32 $0, 0;
}"""

_LINE = """{
prefetch.global.L2EVICT [$1];
mov.u32 $0, 0;
}"""
LINE = 128  # bytes a line prefetch asks for


@triton.jit
def read_kernel(x_ptr, n, out_ptr, BLOCK: tl.constexpr, POLICY: tl.constexpr):
    """Sum x[:n] grid-stride, so the whole grid reads the buffer front to back; one float per program."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        if POLICY == 1:
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_last")
        elif POLICY == 2:
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
        else:
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        acc += x.to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def bulk_kernel(base, pieces, piece_bytes, ASM: tl.constexpr):
    """One bulk L2 prefetch of piece_bytes per thread, pieces of them from base (an address)."""
    j = tl.minimum(tl.program_id(0) * 32 + tl.arange(0, 32), pieces - 1)
    size = tl.full([32], 0, tl.int32) + piece_bytes
    tl.inline_asm_elementwise(ASM, "=r,l,r", [base + j.to(tl.int64) * piece_bytes, size], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def line_kernel(base, lines, LINE: tl.constexpr, ASM: tl.constexpr, WIDTH: tl.constexpr):
    """One L2 line prefetch (prefetch.global.L2) per thread, `lines` of them from base (an address)."""
    j = tl.minimum(tl.program_id(0) * WIDTH + tl.arange(0, WIDTH), lines - 1)
    tl.inline_asm_elementwise(ASM, "=r,l", [base + j.to(tl.int64) * LINE], dtype=tl.int32, is_pure=False, pack=1)


def set_persisting_l2(nbytes: int) -> int:
    """The persisting L2 set-aside (CU_LIMIT_PERSISTING_L2_CACHE_SIZE) of torch's current context, through the
    driver (the context torch made current, whatever runtime it links); returns the limit read back."""
    torch.cuda.current_stream().synchronize()  # the primary context is current on this thread
    drv = ctypes.CDLL("libcuda.so.1")
    limit, dev, most, value = 0x06, ctypes.c_int(0), ctypes.c_int(0), ctypes.c_size_t(0)

    def check(call: str, err: int) -> None:
        if err != 0:
            raise RuntimeError(f"{call} failed: CUresult {err} (persisting L2 of {nbytes} bytes asked)")

    check("cuCtxGetDevice", drv.cuCtxGetDevice(ctypes.byref(dev)))
    check("cuDeviceGetAttribute(MAX_PERSISTING_L2_CACHE_SIZE)",
          drv.cuDeviceGetAttribute(ctypes.byref(most), ctypes.c_int(108), dev))
    if most.value <= 0:
        raise RuntimeError("this device sets no L2 aside for persisting lines (its most is 0 bytes)")
    check("cuCtxSetLimit", drv.cuCtxSetLimit(ctypes.c_int(limit), ctypes.c_size_t(min(nbytes, most.value))))
    check("cuCtxGetLimit", drv.cuCtxGetLimit(ctypes.byref(value), ctypes.c_int(limit)))
    return value.value


class Probe:
    """The buffers, the launches and their timings (us a sequence, gemm_sweep.timed)."""

    def __init__(self, kv_bytes: int, weights_bytes: int, chain_kernels: int, chain_bytes: int,
                 chain_programs: int):
        props = torch.cuda.get_device_properties(0)
        self.device, self.l2_bytes, self.sms = props.name, props.L2_cache_size, props.multi_processor_count

        def buf(nbytes):
            return torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")

        self.kv_same, self.kv_other, self.weights = buf(kv_bytes), buf(kv_bytes), buf(weights_bytes)
        self.chain = [buf(chain_bytes) for _ in range(chain_kernels)]
        self.chain_programs = chain_programs
        programs = max(self.sms * 4, chain_programs)  # a float a program of any read
        self.out = torch.empty(programs, dtype=torch.float32, device="cuda")
        self.side_stream = torch.cuda.Stream()
        self.read_tbps = kv_bytes / (self.time(lambda: self.read(self.kv_other)) * 1e-6) / 1e12

    def read(self, x: torch.Tensor, policy: str = "normal", nbytes: int | None = None, programs: int = 0) -> None:
        n = (nbytes if nbytes is not None else x.numel() * 2) // 2
        read_kernel[(programs or self.sms * 4,)](x, n, self.out, BLOCK=BLOCK, POLICY=POLICIES[policy], num_warps=8)

    def bulk(self, x: torch.Tensor, nbytes: int, policy: str) -> None:
        pieces = max(1, nbytes // PIECE)
        asm = _BULK.replace("EVICT", "evict_" + policy.removeprefix("evict_"))  # normal -> evict_normal
        bulk_kernel[(triton.cdiv(pieces, 32),)](x.data_ptr(), pieces, PIECE, ASM=asm, num_warps=1)

    def lines(self, x: torch.Tensor, nbytes: int, policy: str) -> None:
        lines = max(1, nbytes // LINE)
        asm = _LINE.replace("EVICT", "::evict_last" if policy == "evict_last" else "")
        line_kernel[(triton.cdiv(lines, 1024),)](x.data_ptr(), lines, LINE=LINE, ASM=asm, WIDTH=1024, num_warps=8)

    def stage(self, stager: str, nbytes: int) -> None:
        way, policy = stager.split(":")
        if way == "load":
            self.read(self.kv_same, policy, nbytes)
        elif way == "line":
            self.lines(self.kv_same, nbytes, policy)
        else:
            self.bulk(self.kv_same, nbytes, policy)

    def gap(self, gap: str) -> None:
        if gap != "none":
            self.read(self.weights, gap.split(":")[1])

    def run_chain(self) -> None:
        for x in self.chain:
            self.read(x, programs=self.chain_programs)

    def time(self, seq) -> float:
        """us a run of seq: gemm_sweep.timed over a graph of COPIES runs (warmed and compiled outside it)."""
        return timed(lambda: [seq() for _ in range(COPIES)])

    def ideal_us(self, nbytes: int) -> float:
        return nbytes / (self.read_tbps * 1e12) * 1e6

    def staged(self, stager: str, nbytes: int, gap: str) -> dict:
        def seq(target):
            def run():
                self.stage(stager, nbytes)
                self.gap(gap)
                self.read(target)
            return run

        other, same = self.time(seq(self.kv_other)), self.time(seq(self.kv_same))
        return dict(other_us=other, same_us=same, saving_us=other - same,
                    of_ideal=(other - same) / self.ideal_us(nbytes))

    def beside(self, stager: str, nbytes: int) -> dict:
        def plain():
            self.run_chain()
            self.read(self.kv_other)

        def side(target):
            def run():
                main = torch.cuda.current_stream()
                self.side_stream.wait_stream(main)
                with torch.cuda.stream(self.side_stream):
                    self.stage(stager, nbytes)
                self.run_chain()
                main.wait_stream(self.side_stream)
                self.read(target)
            return run

        base, other, same = self.time(plain), self.time(side(self.kv_other)), self.time(side(self.kv_same))
        return dict(plain_us=base, other_us=other, same_us=same, net_us=base - same)
