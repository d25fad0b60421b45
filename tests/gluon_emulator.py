"""Runs a Gluon kernel's Python on the CPU, for the warp-specialized kernels that Triton's interpreter cannot run (it
has no Gluon): each CTA and each warp-specialized partition is a thread, global and shared memory are torch tensors,
and mbarriers, TMA copies, cp.async, wgmma, mma_v2 and global atomics are emulated with the semantics the PTX gives
them.

What it checks is a kernel's protocol and arithmetic: ring and barrier parities, counts, who computes which unit,
the results against torch. A wait that can never complete is reported as a `Hang` naming each thread's last wait;
a read of shared memory that a TMA copy has been issued to and not yet landed is a `Race`. TMA copies land later,
in random order, from a thread of their own, so a missing wait shows up as a race or as wrong data. Crossings
between the generic and the async proxy are a `ProxyRace` without a fence between them: shared memory a thread
stored to (or read) and then a wgmma reads (or a TMA copy overwrites) with no fence_async_shared by that thread
since; with check_global, global memory a generic store wrote and a TMA copy then reads with no
fence.proxy.async since (by any thread: an approximation, as Python threads see every write at once). What it
cannot check is the rest of the memory model (acquire / release ordering): that is found on the GPU only.

Emulated: gl.program_id / num_programs (grids of up to 3 axes) / arange / zeros / full / load / store / atomic_add /
atomic_xchg / static_range / range (indices convert like Triton's) / thread_barrier / allocate_shared_memory (and
index / slice / permute / _reinterpret / load / store) / warp_specialize / inline_asm_elementwise (PDL's asm a no-op,
fence.proxy.async a fence) / sum / max / rsqrt / exp / exp2 / log2 / sin / cos / sqrt / maximum / minimum / where /
cdiv / expand_dims / convert_layout / static_assert, the layouts (ignored), mbarrier.init / expect / arrive / wait,
tma.async_copy_global_to_shared, async_copy (cp.async; a partition's arrival counts each of its threads), mma_v2,
warpgroup_mma (is_async too: its shared-memory operands count as read until a warpgroup_mma_wait retires it, and a
TMA copy into them before that is a Race), warpgroup_mma_wait, fence_async_shared. Anything else a kernel calls
raises NotImplementedError with its name.
"""

from __future__ import annotations

import threading
import time
import types

import torch

from tests.gluon_emulator_ops import (TIMEOUT_S, Desc, Hang, ProxyRace, Ptr, Race, SMem, _Aborted,
                                      _allocate_shared_memory, _arrive, _async_copy, _async_copy_arrive, _atomic_add,
                                      _atomic_xchg, _expect, _init, _load, _local, _mma_v2, _span, _State, _state,
                                      _store, _tma_engine, _tma_load, _wait, _warpgroup_mma, fence_async_shared,
                                      fence_proxy_async_global)

__all__ = ["Hang", "ProxyRace", "Race", "emulate"]


def _warp_specialize(functions_and_args, worker_num_warps, worker_num_regs, **_):
    pid = _local.pid
    warps = [_state().num_warps, *worker_num_warps]  # the default partition's, then each worker's
    threads = []
    for k, (fn, args) in enumerate(functions_and_args):
        threads.append(_start(f"{threading.current_thread().name}.partition{k}", pid, fn, args, 32 * warps[k]))
    for t in threads:
        t.join()


def _start(name: str, pid: tuple[int, int, int], fn, args, threads: int) -> threading.Thread:
    # threads: the GPU threads this one stands for (a cp.async arrival counts each of them)
    state = _state()

    def body():
        _local.state, _local.pid, _local.threads = state, pid, threads
        try:
            fn(*args)
        except _Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported by emulate()
            with state.lock:
                state.errors.append(exc)
                state.abort = True
                state.cond.notify_all()

    t = threading.Thread(target=body, name=name, daemon=True)
    with state.lock:
        state.threads.append(t)
    t.start()
    return t


def _wgmma(a, b, acc, *, use_acc=True, is_async=False, **kw):
    """warpgroup_mma: computed at issue; an asynchronous one's shared-memory operands stay read (a TMA copy into
    them is a Race) until a warpgroup_mma_wait retires it."""
    out = _warpgroup_mma(a, b, acc, use_acc=use_acc, **kw)
    if is_async:
        spans = [_span(op.t) for op in (a, b) if isinstance(op, SMem)]
        with _state().lock:
            _state().mma_reads.setdefault(threading.current_thread().name, []).append(spans)
    return out


def _wgmma_wait(num_outstanding=0, deps=None):
    """warpgroup_mma_wait: all but this thread's `num_outstanding` newest asynchronous wgmmas are done."""
    with _state().lock:
        mine = _state().mma_reads.setdefault(threading.current_thread().name, [])
        del mine[:max(0, len(mine) - int(num_outstanding))]
    return deps[0] if len(deps) == 1 else tuple(deps)


def _tma_load_checked(desc, coord, bar, dest, pred=True):
    """tma.async_copy_global_to_shared, refused (Race) into shared memory an unfinished asynchronous wgmma reads."""
    if pred:
        lo, hi = _span(dest.t)
        with _state().lock:
            for name, groups in _state().mma_reads.items():
                if any(r_lo < hi and lo < r_hi for spans in groups for r_lo, r_hi in spans):
                    raise Race(f"a TMA copy into shared memory that an unfinished wgmma of {name} reads")
    _tma_load(desc, coord, bar, dest, pred)


def _maximum(a, b, **_):
    return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))


def _minimum(a, b, **_):
    return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))


class _Int(int):
    """A loop index or a program id (and the ints made from them): an int that, as in Triton, also converts like a
    scalar tensor."""

    def to(self, dtype, **_):
        return torch.tensor(int(self), dtype=dtype)


def _int_op(name: str):
    op = getattr(int, name)

    def call(self, other):
        out = op(self, other)
        return _Int(out) if type(out) is int else out
    return call


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__", "__rfloordiv__",
              "__mod__", "__rmod__"):
    setattr(_Int, _name, _int_op(_name))


def _range(*args):
    for i in range(*(int(a) for a in args)):
        yield _Int(i)


def _inline_asm(asm, *args, **kwargs):
    # the kernels' asm: PDL's griddepcontrol (nothing to do here) and proxy fences
    if "fence.proxy.async" in asm:
        fence_proxy_async_global()
    return torch.tensor(0)


def _where(cond, a, b):
    if not any(isinstance(x, torch.Tensor) for x in (cond, a, b)):
        return a if cond else b
    return torch.where(torch.as_tensor(cond), a, b)


def _static_assert(cond, msg=""):
    assert cond, msg


def _unsupported(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"the Gluon emulator has no {name}")
    return call


class _Namespace(types.SimpleNamespace):
    """An emulated module: what it lacks, and the real module has, raises NotImplementedError when called."""

    def __init__(self, real, **attrs) -> None:
        super().__init__(**attrs)
        self._real = real

    def __getattr__(self, name):
        value = getattr(self._real, name)
        if isinstance(value, type) and name.endswith("Layout"):
            return value  # layouts: real (plain data), ignored by the emulated ops
        return _unsupported(f"{self._real.__name__}.{name}")


def _modules():
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    emu_gl = _Namespace(
        gl, program_id=lambda axis=0: _Int(_local.pid[axis]),
        num_programs=lambda axis=0: _Int(_state().programs[axis]),
        arange=lambda start, end, layout=None: torch.arange(start, end, dtype=torch.int32),
        zeros=lambda shape, dtype, layout=None: torch.zeros(shape, dtype=dtype),
        full=lambda shape, value, dtype, layout=None: torch.full(shape, value, dtype=dtype),
        load=_load, store=_store, atomic_add=_atomic_add, static_range=range, thread_barrier=lambda: None,
        allocate_shared_memory=_allocate_shared_memory, warp_specialize=_warp_specialize,
        inline_asm_elementwise=_inline_asm, constexpr=lambda v: v,
        sum=lambda x, axis=None, **_: x.sum(dim=axis), max=lambda x, axis=None, **_: x.amax(dim=axis),
        rsqrt=torch.rsqrt, exp=torch.exp, exp2=torch.exp2, log2=torch.log2, sin=torch.sin, cos=torch.cos,
        sqrt=torch.sqrt, maximum=_maximum, minimum=_minimum, where=_where, cdiv=lambda a, b: (a + b - 1) // b,
        expand_dims=lambda x, axis: x.unsqueeze(axis), convert_layout=lambda x, layout, **_: x,
        atomic_xchg=_atomic_xchg, static_assert=_static_assert,
        float32=torch.float32, bfloat16=torch.bfloat16, float16=torch.float16, int32=torch.int32, int64=torch.int64,
        int8=torch.int8)
    emu_mbarrier = _Namespace(mbarrier, init=_init, expect=_expect, arrive=_arrive, wait=_wait,
                              invalidate=lambda bar: None, MBarrierLayout=mbarrier.MBarrierLayout)
    emu_tma = _Namespace(tma, async_copy_global_to_shared=_tma_load_checked)
    emu_async_copy = _Namespace(async_copy, async_copy_global_to_shared=_async_copy, commit_group=lambda: None,
                                wait_group=lambda num_outstanding=0: None, mbarrier_arrive=_async_copy_arrive)
    replace = {id(gl): emu_gl, id(mbarrier): emu_mbarrier, id(tma): emu_tma, id(hopper.warpgroup_mma): _wgmma,
               id(hopper.warpgroup_mma_wait): _wgmma_wait, id(hopper.fence_async_shared): fence_async_shared,
               id(async_copy): emu_async_copy, id(mma_v2): _mma_v2}
    return replace


def _emulated(fn, replace: dict, cache: dict):
    """The JIT function's Python with the emulated modules, ops and JIT functions in its globals."""
    from triton.runtime.jit import JITFunction

    if id(fn) in cache:
        return cache[id(fn)]
    raw = fn.fn
    glb = {}
    new = types.FunctionType(raw.__code__, glb, raw.__name__, raw.__defaults__, raw.__closure__)
    cache[id(fn)] = new
    glb["range"] = _range  # Triton's loops: the index converts like a tensor
    for name, value in raw.__globals__.items():
        if isinstance(value, JITFunction):
            value = _emulated(value, replace, cache)
        elif type(value).__name__ == "constexpr":
            value = value.value
        glb[name] = replace.get(id(value), value)
    return new


def _argument(value):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if isinstance(value, torch.Tensor):  # a pointer to its first element, into its whole storage (views alias it)
        whole = value.as_strided((value.untyped_storage().nbytes() // value.element_size(),), (1,), 0)
        return Ptr(whole, value.storage_offset())
    if isinstance(value, TensorDescriptor):
        return Desc(value)
    return value


def emulate(kernel, grid: int | tuple[int, ...], *args, seed: int = 0, timeout: float = TIMEOUT_S,
            check_global: bool = False, slow: float = 0.0, arrive_lag: tuple[int, float] | None = None,
            **constexprs) -> None:
    """Run `kernel` (a @gluon.jit function) as `grid` CTAs on the CPU (an int, or up to 3 axes). Tensors are its
    global memory (written in place), TensorDescriptors its TMA descriptors; keyword arguments its constexprs
    (num_warps included). slow: that many seconds' lag after each mbarrier wait for half of the CTAs (_State).
    arrive_lag=(k, seconds): warp-specialized partition k sleeps after each of its mbarrier arrives (_State).
    Raises Hang, Race, ProxyRace, or the first error a thread raised."""
    grid = tuple(grid) + (1,) * (3 - len(grid)) if isinstance(grid, (tuple, list)) else (grid, 1, 1)
    state = _State(grid, seed, constexprs.get("num_warps", 4), check_global, slow, arrive_lag)
    _local.state = state
    fn = _emulated(kernel, _modules(), {})
    args = [_argument(a) for a in args]
    params = [p.name for p in kernel.params]
    kwargs = {k: v for k, v in constexprs.items() if k in params}
    done = threading.Event()
    engine = threading.Thread(target=_tma_engine, args=(state, done), name="tma", daemon=True)
    engine.start()
    pids = [(x, y, z) for z in range(grid[2]) for y in range(grid[1]) for x in range(grid[0])]
    ctas = [_start(f"cta{'.'.join(map(str, pid))}", pid, lambda: fn(*args, **kwargs), (), 32 * state.num_warps)
            for pid in pids]
    deadline = time.monotonic() + timeout
    for t in ctas:
        t.join(max(0.0, deadline - time.monotonic()))
    done.set()
    with state.lock:
        stuck = [t.name for t in state.threads if t.is_alive()]
    with state.lock:
        waits = dict(state.waits)
        state.abort = True
        state.cond.notify_all()
    engine.join(5)
    if state.errors:
        raise state.errors[0]
    if stuck:
        raise Hang(f"{len(stuck)} threads still running after {timeout:.0f} s; their last waits: "
                   f"{ {n: waits.get(n, 'not in an mbarrier wait (a poll loop?)') for n in sorted(stuck)[:12]} }")
