"""engine/weight_stream.py: checkpoint bytes read with preadv through two staging buffers.

The reference is safetensors' own reader (load_file) on files safetensors' own writer made: every tensor
must come back bit for bit, whatever the staging buffer's size (tensors grouped into one chunk, a tensor
split over many, reads split over threads), for mixed dtypes, odd sizes, scalars and empty tensors."""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file, save_file

from engine import weight_stream
from engine.config import OuroConfig
from engine.loader import load_state_dict
from engine.weight_stream import StagedReader, plan_chunks, tensor_spans
from ourobatch import CheckpointError
from ourobatch.testing import make_tiny_checkpoint

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool]


def _random(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, shape, generator=gen).to(dtype)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _read_all(path, stage_bytes: int, depth: int) -> dict[str, torch.Tensor]:
    spans = list(tensor_spans(path).values())
    with StagedReader(torch.device("cpu"), stage_bytes, depth) as reader:
        return {span.name: t.clone() for span, t in reader.read_file(path, spans)}


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


tensor_specs = st.lists(
    st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 9), min_size=0, max_size=3)),
    min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(specs=tensor_specs, stage_bytes=st.integers(65, 700), depth=st.sampled_from([1, 2, 3, 5]),
       seed=st.integers(0, 2**31 - 1))
def test_every_tensor_comes_back_bit_for_bit(tmp_path_factory, specs, stage_bytes, depth, seed):
    gen = torch.Generator().manual_seed(seed)
    tensors = {f"t{i}": _random(dtype, tuple(shape), gen) for i, (dtype, shape) in enumerate(specs)}
    path = tmp_path_factory.mktemp("st") / "x.safetensors"
    save_file(tensors, str(path))
    expected = load_file(str(path))
    got = _read_all(path, stage_bytes, depth)
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert _bitwise_equal(got[name], t), name


def test_chunks_cover_every_span_once_in_file_order(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(n, generator=gen) for i, n in enumerate([3, 40, 5, 5, 100, 1, 0, 64])}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    spans = list(tensor_spans(tmp_path / "x.safetensors").values())
    for stage in (65, 80, 160, 400, 10_000):
        chunks = plan_chunks(spans, stage)
        order = [s for c in chunks for s in c.spans if not c.whole or c.start == s.start]
        assert sorted(order, key=lambda s: s.start) == order and len(order) == len(spans) == len(set(order))
        for c in chunks:
            assert c.end - c.start <= stage and c.start % weight_stream.ALIGN == 0 or c.whole
            if c.whole:  # pieces of one span, back to back, covering it
                span = c.spans[0]
                pieces = [p for p in chunks if p.whole and p.spans[0] == span]
                assert pieces[0].start == span.start and pieces[-1].end == span.end
                assert all(a.end == b.start for a, b in zip(pieces, pieces[1:]))
                assert span.nbytes > stage - weight_stream.ALIGN
            else:
                assert c.start <= min(s.start for s in c.spans) and c.end == max(s.end for s in c.spans)
    assert len(plan_chunks(spans, 10_000)) == 1


def _write_raw(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


@pytest.mark.parametrize("header,data,match", [
    ({"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), r"tensor w has dtype Q7, not one of"),
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8),
     r"tensor w's bytes \[0, 8\) do not fit its shape \(3,\) and dtype F32"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8),
     r"tensor w's bytes \[0, 16\) do not fit .* inside the file"),
    ({"w": {"dtype": "F32", "shape": [2]}}, bytes(8), r"tensor w has a malformed header entry"),
])
def test_a_header_that_does_not_describe_the_file_is_named(tmp_path, header, data, match):
    path = tmp_path / "bad.safetensors"
    _write_raw(path, header, data)
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: ") + match):
        tensor_spans(path)


@pytest.mark.parametrize("raw", [b"", b"\x05\x00", struct.pack("<Q", 1 << 40) + b"{}", struct.pack("<Q", 4) + b"{no",
                                 struct.pack("<Q", 6) + b"[1, 2]"])
def test_a_file_that_is_not_safetensors_is_named(tmp_path, raw):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw)
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: not a readable safetensors file")):
        tensor_spans(path)


def test_a_file_cut_after_its_header_was_read_is_named(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.randn(100), "b": torch.randn(100)}, str(path))
    spans = list(tensor_spans(path).values())
    raw = path.read_bytes()
    path.write_bytes(raw[:-200])  # the file changes under the loader: its last tensor is cut
    with StagedReader(torch.device("cpu"), 1 << 20, 1) as reader:
        with pytest.raises(CheckpointError, match=re.escape(f"{path}: the file ended at byte")):
            list(reader.read_file(path, spans))


@pytest.mark.parametrize("stage_bytes", [100, 1000, 1 << 20])
@pytest.mark.parametrize("stored,dtype", [(torch.float32, torch.float64), (torch.bfloat16, torch.float32),
                                          (torch.float32, torch.float32)])
def test_the_loader_through_small_buffers_equals_safetensors(tmp_path, monkeypatch, stage_bytes, stored, dtype):
    monkeypatch.setattr(weight_stream, "STAGE_BYTES", stage_bytes)  # the loader's reader takes the module's
    ckpt = make_tiny_checkpoint(tmp_path / "ck", dtype=stored, num_shards=3, seed=stage_bytes)
    on_disk = {k: v for f in ckpt.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    state = load_state_dict(ckpt, OuroConfig.from_checkpoint(ckpt), dtype, "cpu")
    assert set(state) == set(on_disk)
    for name, t in on_disk.items():
        assert state[name].dtype == dtype and torch.equal(state[name], t.to(dtype)), name


@pytest.mark.parametrize("stage_bytes", [65, 128, 4096])
def test_tensors_at_offsets_not_aligned_to_their_dtype_are_read_as_bytes(tmp_path, stage_bytes):
    """safetensors' writer aligns every tensor; a foreign writer may not. The reader then copies bytes
    instead of a typed slice. Reference: numpy on the raw bytes."""
    import numpy as np
    rng = np.random.default_rng(stage_bytes)
    a, b, c = rng.standard_normal(1).astype(np.float16), rng.standard_normal(30).astype(np.float32), \
        rng.standard_normal(7).astype(np.float64)
    data = a.tobytes() + b.tobytes() + c.tobytes()  # b starts at byte 2, c at byte 122: neither aligned
    header = {"a": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]},
              "b": {"dtype": "F32", "shape": [5, 6], "data_offsets": [2, 122]},
              "c": {"dtype": "F64", "shape": [7], "data_offsets": [122, 178]}}
    path = tmp_path / "odd.safetensors"
    _write_raw(path, header, data)
    got = _read_all(path, stage_bytes, 2)
    assert np.array_equal(got["a"].numpy(), a)
    assert np.array_equal(got["b"].numpy(), b.reshape(5, 6))
    assert np.array_equal(got["c"].numpy(), c)
