"""The emulated memory, synchronization and MMA of tests/gluon_emulator.py (its docstring says what is emulated
and what is not): global memory through pointers into flat torch tensors, shared memory descriptors, mbarriers,
TMA copies landing late and out of order from an engine thread, wgmma, and the launch's shared state."""

from __future__ import annotations

import random
import threading
import time
import types

import torch

TIMEOUT_S = 120.0


class Hang(AssertionError):
    """Some thread waits for what never comes (the emulation's time limit passed)."""


class Race(AssertionError):
    """Shared memory was read while a TMA copy into it was in flight."""


class ProxyRace(AssertionError):
    """Memory that the generic proxy wrote (or read) is reached by the async proxy (wgmma, TMA) with no proxy fence
    between the two."""


class _Aborted(BaseException):
    pass


class _State:
    """One emulated launch: its grid (3 axes), its threads, the TMA engine's copies, the abort flag and each thread's
    last wait."""

    def __init__(self, programs: tuple[int, int, int], seed: int, num_warps: int, check_global: bool,
                 slow: float = 0.0, arrive_lag: tuple[int, float] | None = None) -> None:
        self.programs, self.num_warps, self.check_global = programs, num_warps, check_global
        self.threads: list[threading.Thread] = []  # every CTA's and partition's, as started
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.abort = False
        self.pending: list = []  # TMA copies issued, not yet landed
        self.rng = random.Random(seed)
        # `slow` seconds' lag after each mbarrier wait for the upper half of the CTAs by index (the lower half: the
        # seed's parity): blocks of adjacent CTAs that sync among themselves end apart, so a read of another block's
        # data with no wait for it sees the data missing
        n = programs[0] * programs[1] * programs[2]
        lagging = (lambda i: 2 * i >= n) if seed % 2 == 0 else (lambda i: 2 * i < n)
        self.lags = {(i % programs[0], i // programs[0] % programs[1], i // (programs[0] * programs[1])):
                     slow * lagging(i) for i in range(n)} if slow else {}
        # (k, seconds): warp-specialized partition k's threads sleep after each mbarrier arrive of theirs, so what
        # a partition does after signalling lands late (a reader relying on the signal sees it missing)
        self.arrive_lag = (f".partition{arrive_lag[0]}", arrive_lag[1]) if arrive_lag else None
        self.waits: dict[str, str] = {}
        self.errors: list[BaseException] = []
        self.unfenced: dict[str, set] = {}  # per thread: generic shared-memory accesses since its last proxy fence
        self.unfenced_global: set = set()  # generic global stores since the last fence.proxy.async (check_global)
        self.mma_reads: dict[str, list] = {}  # per thread: its unretired async wgmmas' operand spans, oldest first


_local = threading.local()


def _state() -> _State:
    return _local.state


def _check_abort() -> None:
    if _state().abort:
        raise _Aborted


# ------------------------------------------------------------------------------------------------- global memory

class Ptr:
    """A pointer (or a tensor of pointers) into a flat torch tensor: `off` an int or an integer tensor."""

    def __init__(self, flat: torch.Tensor, off) -> None:
        self.flat, self.off = flat, off

    @property
    def dtype(self):  # ptr.dtype.element_ty: the pointee's dtype
        return types.SimpleNamespace(element_ty=self.flat.dtype)

    def __add__(self, other):
        if isinstance(other, torch.Tensor) and other.dim() > 0:
            return Ptr(self.flat, self.off + other.long())
        return Ptr(self.flat, self.off + int(other))

    __radd__ = __add__

    def __sub__(self, other):
        return self + (-other)


def _load(ptr: Ptr, mask=None, other=None, **_):
    if not isinstance(ptr.off, torch.Tensor):
        return ptr.flat[ptr.off].clone()
    off = ptr.off
    if mask is None:
        return ptr.flat[off]
    mask = torch.broadcast_to(mask, off.shape)
    values = ptr.flat[torch.where(mask, off, torch.zeros_like(off))]
    return torch.where(mask, values, torch.as_tensor(0 if other is None else other, dtype=values.dtype))


def _global_written(ptr: Ptr) -> None:
    # a generic store to global memory, pending until a fence.proxy.async (only when the launch checks them)
    if _state().check_global:
        off = ptr.off if isinstance(ptr.off, torch.Tensor) else torch.tensor([ptr.off])
        size = ptr.flat.element_size()
        base = ptr.flat.data_ptr()
        with _state().lock:
            _state().unfenced_global.add((base + int(off.min()) * size, base + (int(off.max()) + 1) * size))


def _check_global_proxy(desc, coord) -> None:
    rows = desc.base[coord[0]:coord[0] + desc.block_type.shape[0]]
    if rows.numel() == 0:
        return
    lo, hi = _span(rows)
    with _state().lock:
        for w_lo, w_hi in _state().unfenced_global:
            if lo < w_hi and w_lo < hi:
                raise ProxyRace(f"a TMA read of global memory that a generic store wrote with no fence.proxy.async "
                                f"since ({threading.current_thread().name})")


def fence_proxy_async_global() -> None:
    # approximated: a fence by any thread orders every generic store made so far (what happened before it here)
    with _state().lock:
        _state().unfenced_global.clear()


def _store(ptr: Ptr, value, mask=None, **_):
    _global_written(ptr)
    if not isinstance(ptr.off, torch.Tensor):
        ptr.flat[ptr.off] = torch.as_tensor(value).to(ptr.flat.dtype)
        return
    off = ptr.off
    value = torch.broadcast_to(torch.as_tensor(value), off.shape).to(ptr.flat.dtype)
    if mask is None:
        ptr.flat[off] = value
        return
    mask = torch.broadcast_to(mask, off.shape)
    ptr.flat[off[mask]] = value[mask]


def _atomic_add(ptr: Ptr, val, mask=None, sem=None, scope=None):
    _check_abort()
    if isinstance(ptr.off, torch.Tensor):
        raise NotImplementedError("gl.atomic_add on a tensor of pointers")
    state = _state()
    poll = isinstance(val, (int, float)) and val == 0
    with state.lock:
        if poll:  # sleep until some atomic changes memory (a spinning thread would starve the others of the GIL)
            polls = _local.__dict__.setdefault("polls", {})
            key = (ptr.flat.data_ptr(), int(ptr.off))
            if polls.get(key) == int(ptr.flat[ptr.off]):
                state.cond.wait(0.002)
            polls[key] = int(ptr.flat[ptr.off])
        old = ptr.flat[ptr.off].clone()
        ptr.flat[ptr.off] += val
        if not poll:
            state.cond.notify_all()
    return old


def _atomic_xchg(ptr: Ptr, val, mask=None, sem=None, scope=None):
    _check_abort()
    with _state().lock:
        old = ptr.flat[ptr.off].clone()
        ptr.flat[ptr.off] = val
        _state().cond.notify_all()
    return old


def _async_copy(smem, pointer: Ptr, mask=None, **_):
    # cp.async (the generic proxy), landed at once (the copies' own waits and arrivals below then pass)
    _generic(smem.t, "write")
    smem.t.copy_(_load(pointer, mask, 0))


def _async_copy_arrive(bar, increment_count=True):
    # cp.async.mbarrier.arrive: each of the partition's threads arrives once its copies have landed (.noinc); with
    # the count incremented at issue the arrivals cancel out
    if not increment_count:
        _arrive(bar, count=_local.threads)


def _mma_v2(a, b, acc, input_precision=None):
    return acc + a.float() @ b.float()


# ------------------------------------------------------------------------------------------------- shared memory

class SMem:
    """A shared-memory descriptor: a view of the CTA's allocation."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    @property
    def shape(self):
        return list(self.t.shape)

    def index(self, i):
        return SMem(self.t[int(i)])

    def permute(self, dims):
        return SMem(self.t.permute(*dims))

    def slice(self, start, length, dim=0):
        return SMem(self.t.narrow(dim, int(start), int(length)))

    def load(self, layout=None):
        _check_race(self.t)
        _generic(self.t, "read")
        return self.t.clone()

    def _reinterpret(self, dtype, shape, layout=None):
        return SMem(self.t.view(dtype).view(list(shape)))

    @property
    def dtype(self):
        return self.t.dtype

    def store(self, value):
        _generic(self.t, "write")
        self.t.copy_(value)


def _span(t: torch.Tensor) -> tuple[int, int]:
    lo = t.data_ptr()
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
    return lo, lo + extent * t.element_size()


def _generic(t: torch.Tensor, kind: str) -> None:
    # a generic-proxy access to shared memory, pending until this thread's next fence_async_shared
    with _state().lock:
        _state().unfenced.setdefault(threading.current_thread().name, set()).add((*_span(t), kind))


def fence_async_shared(cluster=False) -> None:
    with _state().lock:
        _state().unfenced.pop(threading.current_thread().name, None)


def _check_proxy(t: torch.Tensor, kinds: tuple[str, ...], what: str) -> None:
    lo, hi = _span(t)
    with _state().lock:
        for thread, accesses in _state().unfenced.items():
            for a_lo, a_hi, kind in accesses:
                if kind in kinds and lo < a_hi and a_lo < hi:
                    raise ProxyRace(f"{what}: shared memory that {thread} accessed ({kind}) with no fence_async_shared "
                                    f"since ({threading.current_thread().name})")


def _check_race(t: torch.Tensor) -> None:
    lo, hi = _span(t)
    with _state().lock:
        for copy in _state().pending:
            d_lo, d_hi = _span(copy[1].t)
            if lo < d_hi and d_lo < hi:
                name = threading.current_thread().name
                raise Race(f"shared memory read while a TMA copy into it is in flight ({name})")


class Barrier:
    """An mbarrier: `count` arrivals and the expected transaction bytes complete a phase."""

    def __init__(self) -> None:
        self.count = self.pending = self.tx = self.phase = 0

    def index(self, i):  # an allocation of one barrier is used both ways
        assert int(i) == 0, i
        return self

    def _complete_if_done(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count
            _state().cond.notify_all()


class _Barriers:
    def __init__(self, n: int) -> None:
        self.bars = [Barrier() for _ in range(n)]

    def index(self, i):
        return self.bars[int(i)]


def _allocate_shared_memory(dtype, shape, layout=None, value=None):
    if type(layout).__name__ == "MBarrierLayout":
        return Barrier() if list(shape) == [1] else _Barriers(shape[0])
    t = torch.zeros(shape, dtype=dtype)
    if value is not None:
        t.copy_(value)
    return SMem(t)


def _init(bar: Barrier, count):
    with _state().lock:
        bar.count = bar.pending = int(count)
        bar.tx = bar.phase = 0


def _expect(bar: Barrier, nbytes, pred=True):
    if pred:
        with _state().lock:
            bar.tx += int(nbytes)
            bar.pending -= 1
            bar._complete_if_done()
        lag = _state().arrive_lag
        if lag and threading.current_thread().name.endswith(lag[0]):
            time.sleep(lag[1])


def _arrive(bar: Barrier, *, count=1, pred=True):
    if pred:
        with _state().lock:
            bar.pending -= int(count)
            if bar.pending < 0:
                raise AssertionError(f"mbarrier arrived at more than its count ({bar.count})")
            bar._complete_if_done()
        lag = _state().arrive_lag
        if lag and threading.current_thread().name.endswith(lag[0]):
            time.sleep(lag[1])


def _wait(bar: Barrier, phase, pred=True, deps=()):
    # try_wait.parity P returns once the phase of parity P has completed: the current phase's parity is not P
    if not pred:
        return
    state, name = _state(), threading.current_thread().name
    with state.lock:
        state.waits[name] = f"mbarrier.wait(parity {int(phase)}) at phase {bar.phase}"
        while (bar.phase & 1) == int(phase):
            if state.abort:
                raise _Aborted
            state.cond.wait(0.05)
        state.waits.pop(name, None)
    if state.lags:
        time.sleep(state.lags[_local.pid])


# ---------------------------------------------------------------------------------------------------------- TMA

class Desc:
    """A host TensorDescriptor as a kernel sees it."""

    def __init__(self, d) -> None:
        self.base, self.layout, self.dtype = d.base, d.layout, d.base.dtype
        nbytes = d.base.element_size()
        for s in d.block_shape:
            nbytes *= s
        self.block_type = types.SimpleNamespace(shape=list(d.block_shape), nbytes=nbytes)


def _tma_load(desc: Desc, coord, bar: Barrier, dest: SMem, pred=True):
    if not pred:
        return
    _check_proxy(dest.t, ("read", "write"), "a TMA copy into")
    if _state().check_global:
        _check_global_proxy(desc, [int(c) for c in coord])
    with _state().lock:
        _state().pending.append((desc, dest, [int(c) for c in coord], bar))
        _state().cond.notify_all()


def _land(copy) -> None:
    desc, dest, coord, bar = copy
    box = torch.zeros(desc.block_type.shape, dtype=desc.dtype)  # out of bounds: zeros, as the hardware's fill
    src = desc.base
    rows = slice(coord[0], min(coord[0] + box.shape[0], src.shape[0]))
    cols = slice(coord[1], min(coord[1] + box.shape[1], src.shape[1]))
    part = src[rows, cols]
    box[:part.shape[0], :part.shape[1]] = part
    dest.t.copy_(box)
    bar.tx -= desc.block_type.nbytes
    bar._complete_if_done()


def _tma_engine(state: _State, done: threading.Event) -> None:
    # copies land one at a time, in random order, a little later than issued
    _local.state = state
    while not (done.is_set() and not state.pending) and not state.abort:
        with state.lock:
            if not state.pending:
                state.cond.wait(0.01)
                continue
            _land(state.pending.pop(state.rng.randrange(len(state.pending))))
        time.sleep(state.rng.random() * 1e-4)


# ------------------------------------------------------------------------------------------------- MMA and misc

def _warpgroup_mma(a, b, acc, *, use_acc=True, is_async=False, **_):
    a_t = a.t if isinstance(a, SMem) else a
    for operand in (a, b) if isinstance(a, SMem) else (b,):  # read by the async proxy: landed, and fenced
        _check_race(operand.t)
        _check_proxy(operand.t, ("write",), "a wgmma operand in")
    out = a_t.float() @ b.t.float()
    return out + acc if use_acc else out
