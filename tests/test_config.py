"""Options that cannot work are refused up front, naming the option and the allowed values (issue 10, item 11).

Static checks (EngineConfig construction) and machine checks (engine build, before any weight is loaded)."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from ourobatch import EngineConfig, RequestRejectedError, SamplingParams, SyncEngine
from ourobatch.assembly import check_attention, check_machine
from scheduler.params import MAX_N
from ourobatch.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("cfg") / "m", seed=1, max_position_embeddings=64)


def config(ckpt, **kw) -> EngineConfig:
    return EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=32, max_model_len=32, **kw)


# ------------------------------------------------------------------ static: EngineConfig


@pytest.mark.parametrize("device", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:-1", "cuda:0:1", "mps", "", " cpu"])
def test_device_syntax_is_checked_at_construction(ckpt, device):
    with pytest.raises(ValueError, match=r"EngineConfig\.device.*'cpu', 'cuda' or 'cuda:N'"):
        config(ckpt, device=device)


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:12"])
def test_valid_device_strings_construct(ckpt, device):
    assert config(ckpt, device=device).device == device


def test_deep_interval_is_bounded_by_max_model_len(ckpt):
    with pytest.raises(ValueError, match=r"EngineConfig\.deep_interval.*<= max_model_len \(32\).*1000000"):
        config(ckpt, deep_interval=10**6)
    assert config(ckpt, deep_interval=32).deep_interval == 32


def test_n_has_a_documented_upper_bound():
    assert SamplingParams(n=MAX_N).n == MAX_N
    with pytest.raises(ValueError, match=rf"SamplingParams\.n must satisfy 1 <= n <= {MAX_N}, got {MAX_N + 1}"):
        SamplingParams(n=MAX_N + 1)
    with pytest.raises(ValueError, match="SamplingParams.n"):
        SamplingParams(n=10**7)


# ------------------------------------------------------------------ machine: engine build


@pytest.mark.parametrize("kw, needle", [
    (dict(attention_backend="triton"), r"attention_backend='triton' needs a CUDA device.*'auto' or 'torch'"),
    (dict(cuda_graphs=True), r"cuda_graphs=True needs a CUDA device.*None or False"),
    (dict(device="cuda"), r"EngineConfig\.device='cuda'.*no CUDA device.*'cpu'"),
    (dict(device="cuda:1"), r"EngineConfig\.device='cuda:1'.*no CUDA device.*'cpu'"),
])
def test_options_the_machine_cannot_run_fail_at_build(ckpt, monkeypatch, kw, needle):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match=needle):
        SyncEngine(config(ckpt, **kw))


@pytest.mark.parametrize("kw, needle", [
    (dict(device="cuda:2"), r"EngineConfig\.device='cuda:2'.*2 CUDA device\(s\).*cuda:0 \.\. cuda:1"),
    (dict(device="cuda", cuda_graphs=True, attention_backend="torch"),
     r"cuda_graphs=True needs the Triton attention backend.*attention_backend='torch'"),
])
def test_cuda_option_combinations(ckpt, kw, needle):
    with pytest.raises(ValueError, match=needle):
        check_machine(config(ckpt, **kw), num_cuda_devices=2)


def test_valid_cuda_combinations_pass_the_machine_check(ckpt):
    for kw in (dict(device="cuda"), dict(device="cuda:1", attention_backend="triton", cuda_graphs=True),
               dict(device="cuda", attention_backend="torch", cuda_graphs=False)):
        check_machine(config(ckpt, **kw), num_cuda_devices=2)
    check_machine(config(ckpt, attention_backend="torch", cuda_graphs=False), num_cuda_devices=0)


@pytest.mark.parametrize("supported", [False, None])  # None: the triton package is missing
def test_triton_kernel_limits_are_checked_before_loading(ckpt, monkeypatch, supported):
    if supported is None:
        monkeypatch.setitem(sys.modules, "engine.triton_attention", None)  # import raises
        why = "triton` package is not installed"
    else:
        fake = types.ModuleType("engine.triton_attention")
        fake.supports = lambda head_dim, dtype: supported
        monkeypatch.setitem(sys.modules, "engine.triton_attention", fake)
        why = "head_dim=8, dtype=float64"
    with pytest.raises(ValueError, match=rf"attention_backend='triton' cannot run: .*{why}.*'auto' or 'torch'"):
        check_attention(config(ckpt, device="cuda", attention_backend="triton"), 8, torch.float64)
    with pytest.raises(ValueError, match=rf"cuda_graphs=True needs the Triton attention backend.*{why}"):
        check_attention(config(ckpt, device="cuda", cuda_graphs=True), 8, torch.float64)
    check_attention(config(ckpt, device="cuda"), 8, torch.float64)  # 'auto' falls back to torch by itself
    check_attention(config(ckpt, attention_backend="torch"), 8, torch.float64)


# ------------------------------------------------------------------ what is built from the config


def test_retained_buffer_is_sized_by_what_a_request_can_use(ckpt):
    # deep_interval and max_model_len both 4096, but the checkpoint caps max_model_len at 64: a request
    # never holds more than 64 retained rows, so the buffer must not be [seqs + 1, 4096, hidden].
    cfg = EngineConfig(model=str(ckpt), max_model_len=4096, deep_interval=4096, max_num_seqs=2, block_size=4,
                       num_kv_blocks=32)
    with SyncEngine(cfg) as llm:
        assert llm.core.executor.retained_rows.shape[:2] == (3, 64)
        out = llm.generate([1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True)).outputs[0]
        assert out.readout_loops == [4] + [2] * 59  # never a boundary: every later token from loop s


def test_capped_max_model_len_warns_once_and_is_reported(ckpt, caplog):
    with caplog.at_level(logging.INFO, logger="ourobatch"):
        with SyncEngine(EngineConfig(model=str(ckpt), max_model_len=100, block_size=4, num_kv_blocks=32)) as llm:
            assert llm.stats()["max_model_len"] == 64
            with pytest.raises(RequestRejectedError, match="max_model_len=64"):
                llm.generate([1, 2], SamplingParams(max_tokens=63))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "max_model_len_capped" in text and "requested=100" in text and "max_position_embeddings=64" in text
    ready = [r.getMessage() for r in caplog.records if "engine_ready" in r.getMessage()]
    assert len(ready) == 1 and "max_model_len=64" in ready[0]


def test_uncapped_max_model_len_does_not_warn(ckpt, caplog):
    with caplog.at_level(logging.WARNING, logger="ourobatch"):
        with SyncEngine(config(ckpt)) as llm:
            assert llm.stats()["max_model_len"] == 32
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_n_above_max_num_seqs_is_rejected_at_add(ckpt):
    with SyncEngine(config(ckpt, max_num_seqs=4)) as llm:
        with pytest.raises(RequestRejectedError, match=r"n=5.*max_num_seqs=4"):
            llm.generate([1, 2], SamplingParams(n=5, max_tokens=2))
        assert not llm.core.has_unfinished and llm.stats()["requests_added"] == 0
        assert len(llm.generate([1, 2], SamplingParams(n=4, max_tokens=2)).outputs) == 4
