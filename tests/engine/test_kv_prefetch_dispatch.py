"""engine/kv_prefetch_dispatch.py: OUROBATCH_KV_PREFETCH's values, the calls the prefetch serves, and which
attention each launch of a pass asks for at each point of the layer (no GPU needed). The launches' values on the
GPU: tests/gpu/test_gpu_kv_prefetch.py; the kernel's PTX: tests/engine/test_kv_prefetch_ptx.py."""

from __future__ import annotations

import pytest

from engine import kv_prefetch_dispatch as kvp


def test_off_by_default_and_for_zero(monkeypatch):
    monkeypatch.delenv(kvp.ENV, raising=False)
    assert kvp.setting() is None
    monkeypatch.setenv(kvp.ENV, " 0 ")
    assert kvp.setting() is None


@pytest.mark.parametrize("text,want", [
    ("3", kvp.Prefetch(3, "norm", False, True)),
    ("1:qkv", kvp.Prefetch(1, "qkv", False, True)),
    ("32:gate_up:end", kvp.Prefetch(32, "gate_up", True, True)),
    ("4:normal", kvp.Prefetch(4, "norm", False, False)),
    ("2:norm:end:normal", kvp.Prefetch(2, "norm", True, False)),
    ("3:line", kvp.Prefetch(3, "norm", False, True, True)),
    ("2:qkv:normal:line", kvp.Prefetch(2, "qkv", False, False, True)),
])
def test_values(text, want, monkeypatch):
    assert kvp.parse(text) == want
    monkeypatch.setenv(kvp.ENV, text)
    assert kvp.setting() == want


@pytest.mark.parametrize("text", ["33", "-1", "x", "3:down", "3:end:end", "3:qkv:norm", "3:qkv:fast", "3::end",
                                  "3:line:line", "line"])
def test_bad_values_name_the_variable_and_the_allowed_ones(text):
    with pytest.raises(ValueError, match=rf"{kvp.ENV} must be 0 or PAGES\[:AT\]\[:end\]\[:normal\]\[:line\] with "
                                         r"PAGES in 1\.\.32 and AT one of qkv, norm, gate_up"):
        kvp.parse(text)


def test_the_calls_it_serves_are_decode_rows_of_more_requests_than_the_loop_pass_launch_takes():
    assert kvp.call_fits(kvp.MIN_ROWS, 1, False, False, True) and kvp.call_fits(256, 1, False, False, True)
    for args in [(kvp.MIN_ROWS - 1, 1, False, False, True), (64, 4, False, False, True),
                 (64, 1, True, False, True), (64, 1, False, True, True), (64, 1, False, False, False)]:
        assert not kvp.call_fits(*args), args


def _walk(config, layers: int, first_loop: int, last_loop: int) -> list[tuple[str, int, int, tuple[int, int]]]:
    """A pass's points in fused_pass.run_loops' order; each launch as (point, loop, layer reached, planes asked)."""
    asked = []
    where = {}
    pf = kvp.PassPrefetch(config, layers, first_loop, last_loop, lambda loop, layer: (loop, layer),
                          lambda loop, layer: asked.append((*where["at"], (loop, layer))))
    for loop in range(first_loop, last_loop + 1):
        for i in range(layers):
            where["at"] = ("qkv", loop, i)
            pf.at("qkv", loop, i)
            where["at"] = ("gate_up", loop, i)  # the layer's MLP, after its attention: for the next attention
            pf.at("gate_up", loop, i + 1)
            where["at"] = ("norm", loop, i)
            before_norm = pf.hook("norm", loop, i + 1)  # called by the kernel call between down and its norm
            assert (before_norm is None) == (config is None or config.at != "norm")
            if before_norm is not None:
                before_norm()
    return asked


@pytest.mark.parametrize("at", kvp.AT)
@pytest.mark.parametrize("loops", [(1, 1), (1, 4), (3, 4)])
def test_every_attention_of_a_pass_is_asked_for_once_before_it_runs(at, loops):
    layers = 3
    asked = _walk(kvp.Prefetch(2, at), layers, *loops)
    attentions = [(loop, i) for loop in range(loops[0], loops[1] + 1) for i in range(layers)]
    assert [a[3] for a in asked] == attentions  # each once, in the order they run
    for point, loop, layer, target in asked:
        if target == (loops[0], 0):  # the pass's first: nothing runs before its qkv
            assert (point, loop, layer) == ("qkv", *target)
        elif at == "qkv":
            assert (point, loop, layer) == ("qkv", *target)
        else:  # at the layer before's gate_up or last add + norm, the previous loop's last layer for a first one
            before = (target[0], target[1] - 1) if target[1] else (target[0] - 1, layers - 1)
            assert (point, loop, layer) == (at, *before)


def test_off_asks_for_nothing():
    assert _walk(None, 3, 1, 4) == []
