"""engine/pdl.py's switch (the kernels' PDL prologue runs only on the GPU: tests/gpu/test_gpu_gemm.py and
test_gpu_attention_kernels.py under OUROBATCH_PDL=1 compare them with the plain-torch references)."""

from __future__ import annotations

import pytest
import torch

from engine import pdl


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(pdl, "_ENABLED", {})
    monkeypatch.setattr(pdl, "_HOPPER", {})


@pytest.mark.parametrize("value", ["", "0", "1"])
def test_never_on_a_cpu_tensor(monkeypatch, value):
    monkeypatch.setenv(pdl.ENV_VAR, value)
    assert pdl.enabled(torch.device("cpu")) is False
    assert pdl.launch_kwargs(torch.device("cpu")) == {"USE_PDL": False}  # no launch_pdl: the interpreter's launch


@pytest.mark.parametrize("value", [None, "1"])
def test_on_by_default_on_hopper_or_later(monkeypatch, value):
    monkeypatch.setattr(pdl.torch.cuda, "get_device_capability", lambda i: (9, 0) if i == 0 else (8, 0))
    dev0, dev1 = torch.device("cuda", 0), torch.device("cuda", 1)
    if value is None:
        monkeypatch.delenv(pdl.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(pdl.ENV_VAR, value)
    assert pdl.enabled(dev0) and not pdl.enabled(dev1)
    assert pdl.launch_kwargs(dev0) == {"USE_PDL": True, "launch_pdl": True}
    assert pdl.launch_kwargs(dev1) == {"USE_PDL": False}


def test_off_when_asked(monkeypatch):
    monkeypatch.setattr(pdl.torch.cuda, "get_device_capability", lambda i: (9, 0))
    monkeypatch.setenv(pdl.ENV_VAR, "0")
    assert not pdl.enabled(torch.device("cuda", 0))
    assert pdl.launch_kwargs(torch.device("cuda", 0)) == {"USE_PDL": False}


def test_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(pdl.ENV_VAR, "yes")
    with pytest.raises(ValueError, match="OUROBATCH_PDL must be 0 .* or 1"):
        pdl.enabled(torch.device("cuda", 0))
