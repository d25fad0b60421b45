"""engine/pdl.py's switch (the kernels' PDL prologue runs only on the GPU: tests/gpu/test_gpu_gemm.py and
test_gpu_attention_kernels.py under OUROBATCH_PDL=1 compare them with the plain-torch references)."""

from __future__ import annotations

import pytest
import torch

from engine import pdl


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(pdl, "_ENABLED", {})


@pytest.mark.parametrize("value", ["", "0", "1"])
def test_never_on_a_cpu_tensor(monkeypatch, value):
    monkeypatch.setenv(pdl.ENV_VAR, value)
    assert pdl.enabled(torch.device("cpu")) is False
    assert pdl.launch_kwargs(torch.device("cpu")) == {"USE_PDL": False}  # no launch_pdl: the interpreter's launch


def test_on_only_when_asked_and_the_device_is_hopper_or_later(monkeypatch):
    monkeypatch.setattr(pdl.torch.cuda, "get_device_capability", lambda i: (9, 0) if i == 0 else (8, 0))
    dev0, dev1 = torch.device("cuda", 0), torch.device("cuda", 1)
    monkeypatch.setenv(pdl.ENV_VAR, "1")
    assert pdl.enabled(dev0) and not pdl.enabled(dev1)
    assert pdl.launch_kwargs(dev0) == {"USE_PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "_ENABLED", {})
    monkeypatch.delenv(pdl.ENV_VAR)
    assert not pdl.enabled(dev0)  # off by default


def test_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(pdl.ENV_VAR, "yes")
    with pytest.raises(ValueError, match="OUROBATCH_PDL must be 0 .* or 1"):
        pdl.enabled(torch.device("cuda", 0))


def test_gemm_launch_kwargs(monkeypatch):
    """PREFETCH only with PDL on, the switch on, and the bulk prefetch's 16-byte alignment."""
    monkeypatch.setattr(pdl, "_ENABLED", {})
    monkeypatch.setattr(pdl, "_PREFETCH", {})
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert pdl.gemm_launch_kwargs(w) == {"USE_PDL": False, "PREFETCH": False}  # CPU: no PDL
    monkeypatch.setattr(pdl, "launch_kwargs", lambda device: {"USE_PDL": True, "launch_pdl": True})
    assert pdl.gemm_launch_kwargs(w)["PREFETCH"] is True
    assert pdl.gemm_launch_kwargs(torch.zeros(8, 60, dtype=torch.bfloat16))["PREFETCH"] is False  # 120-byte rows
    assert pdl.gemm_launch_kwargs(w[:, 1:])["PREFETCH"] is False  # base 2 bytes in
    monkeypatch.setenv(pdl.PREFETCH_ENV_VAR, "0")
    monkeypatch.setattr(pdl, "_PREFETCH", {})
    assert pdl.gemm_launch_kwargs(w) == {"USE_PDL": True, "launch_pdl": True, "PREFETCH": False}
    monkeypatch.setenv(pdl.PREFETCH_ENV_VAR, "maybe")
    monkeypatch.setattr(pdl, "_PREFETCH", {})
    with pytest.raises(ValueError, match="OUROBATCH_PDL_PREFETCH must be 0 .* or 1"):
        pdl.gemm_launch_kwargs(w)
