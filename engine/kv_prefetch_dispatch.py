"""When a decode loop pass asks the L2 for the next attention's keys and values (engine/kv_prefetch.py), which
pages and where in the layer (Triton-free).

OUROBATCH_KV_PREFETCH: "0" (off, the default: every setting measured slower on the H200, docs/benchmarks.md session
28) or "PAGES[:AT][:end][:normal][:line]":
- PAGES (1..32): pages (of block_size positions) of every request's keys and values, for each attention;
- AT: the kernel the prefetch launch goes before: "qkv" (the attention's own layer's qkv GEMM), "norm" (the
  add + norm that ends the layer before: the default) or "gate_up" (the layer before's gate_up GEMM). A pass's
  first layer is asked for at "qkv" whatever AT says (nothing runs before it in the pass);
- end: the requests' last pages instead of their first;
- normal: the lines marked evict_normal in the L2 instead of evict_last;
- line: a prefetch.global.L2 for each 128-byte line of a page instead of one bulk prefetch a page (session 43).
It serves the fused per-layer kernels' decode calls (engine/fused_pass.py) of MIN_ROWS or more requests, one new
row each: fewer go to the loop-pass launch (layers_dispatch.py), which reads its keys and values itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

from .layers_dispatch import ROWS as LAUNCH_ROWS

ENV = "OUROBATCH_KV_PREFETCH"
AT = ("qkv", "norm", "gate_up")
MAX_PAGES = 32  # engine/kv_prefetch.WIDTH: a page per thread of the launch's one warp
MIN_ROWS = LAUNCH_ROWS + 1


@dataclass(frozen=True)
class Prefetch:
    pages: int
    at: str = "norm"
    from_end: bool = False
    evict_last: bool = True
    line: bool = False


@lru_cache(maxsize=16)
def parse(text: str) -> Prefetch | None:
    """OUROBATCH_KV_PREFETCH's value -> its Prefetch, or None for "0" (and for an empty value: the default)."""
    fields = [f.strip() for f in text.strip().split(":")] if text.strip() else ["0"]
    if fields == ["0"]:
        return None
    usage = (f"{ENV} must be 0 or PAGES[:AT][:end][:normal][:line] with PAGES in 1..{MAX_PAGES} and AT one of "
             f"{', '.join(AT)}, got {text!r}")
    if not fields[0].isdigit() or not 1 <= int(fields[0]) <= MAX_PAGES:
        raise ValueError(usage)
    at = "norm"
    rest = fields[1:]
    if rest and rest[0] in AT:
        at, rest = rest[0], rest[1:]
    if any(f not in ("end", "normal", "line") for f in rest) or len(set(rest)) != len(rest):
        raise ValueError(usage)
    return Prefetch(int(fields[0]), at, "end" in rest, "normal" not in rest, "line" in rest)


def setting() -> Prefetch | None:
    """The process's OUROBATCH_KV_PREFETCH, read at each call (a pass reads it once; graphs replay the launches)."""
    return parse(os.environ.get(ENV, ""))


def call_fits(rows: int, max_rows: int, prefill: bool, has_tiles: bool, cuda: bool) -> bool:
    """Whether a call's rows are the ones the prefetch serves: decode on CUDA, one row per request, MIN_ROWS or
    more of them."""
    return cuda and rows >= MIN_ROWS and max_rows == 1 and not prefill and not has_tiles


class PassPrefetch:
    """One loop pass's prefetch launches. `at(point, loop, layer)`, called where the pass reaches `point` (one of
    AT; `hook` gives the same launch as a call for later), asks for (loop, layer)'s attention's pages when `point`
    is the setting's; layer == num_layers names the next loop's first layer (nothing past last_loop). The pass's
    first attention is asked for at its qkv whatever the setting. `planes(loop, layer)`: that attention's (k, v)
    planes by block; `launch(k, v)`: the kernel (engine/kv_prefetch.prefetch_pages with the call's tables and the
    setting)."""

    def __init__(self, config: Prefetch | None, num_layers: int, first_loop: int, last_loop: int, planes,
                 launch) -> None:
        self.config, self.num_layers, self.first_loop, self.last_loop = config, num_layers, first_loop, last_loop
        self.planes, self.launch = planes, launch

    def at(self, point: str, loop: int, layer: int) -> None:
        if self._asks(point, loop, layer):
            self._launch(loop, layer)

    def hook(self, point: str, loop: int, layer: int):
        """at()'s launch as a call for later (a kernel's before_norm), or None where at() would launch nothing."""
        return (lambda: self._launch(loop, layer)) if self._asks(point, loop, layer) else None

    def _asks(self, point: str, loop: int, layer: int) -> bool:
        if self.config is None:
            return False
        return point == self.config.at or (point == "qkv" and (loop, layer) == (self.first_loop, 0))

    def _launch(self, loop: int, layer: int) -> None:
        if layer == self.num_layers:
            loop, layer = loop + 1, 0
            if loop > self.last_loop:
                return
        self.launch(*self.planes(loop, layer))
