"""Probes of the cuda and ascend backends: each failure mode has its own reason and hint.

torch_npu is never installed here: its import failures are simulated.
"""

import importlib.machinery
import sys
import types

import pytest
import torch

import deepinfer_ascend.probe as ascend
import deepinfer_cuda.probe as cuda


def test_cuda_on_a_cpu_build_of_torch(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    found = cuda.probe()
    assert not found.available and "built without CUDA" in found.reason and found.hint


def test_cuda_with_no_gpu_visible(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cuda, "triton_version", lambda: "3.6.0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    found = cuda.probe()
    assert not found.available and "no NVIDIA GPU is visible" in found.reason and "CUDA_VISIBLE_DEVICES=''" in found.reason


def test_cuda_without_triton(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cuda, "triton_version", lambda: None)
    found = cuda.probe()
    assert not found.available and "triton is not installed" in found.reason and "deepinfer[cuda]" in found.hint


def test_cuda_on_an_old_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cuda, "triton_version", lambda: "3.6.0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda, "nvml_capability", lambda: (8, 0))
    found = cuda.probe()
    assert not found.available and "sm80" in found.reason


def test_cuda_available(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cuda, "triton_version", lambda: "3.6.0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda, "nvml_capability", lambda: (9, 0))
    found = cuda.probe()
    assert found.available and found.details["capability"] == "sm90"


def test_interpreter_mode_needs_only_triton(monkeypatch):
    monkeypatch.setattr(cuda, "triton_version", lambda: "3.9.0")
    assert cuda.probe(interpret=True).available
    monkeypatch.setattr(cuda, "triton_version", lambda: None)
    assert not cuda.probe(interpret=True).available


def _fake_torch_npu(monkeypatch, *, error: Exception | None = None, version="2.10.0.post4"):
    """Make find_spec see torch_npu and its import either fail with `error` or give a fake module."""
    real_find_spec = ascend.importlib.util.find_spec
    monkeypatch.setattr(
        ascend.importlib.util,
        "find_spec",
        lambda name, *a: importlib.machinery.ModuleSpec("torch_npu", None) if name == "torch_npu" else real_find_spec(name, *a),
    )
    if error is not None:
        monkeypatch.setattr(ascend, "import_optional", lambda name: (None, error))
        return None
    module = types.SimpleNamespace(__version__=version, npu=types.SimpleNamespace(get_soc_version=lambda: 223))
    monkeypatch.setattr(ascend, "import_optional", lambda name: (module, None))
    return module


def test_ascend_not_installed():
    found = ascend.probe()
    assert not found.available and found.reason == "torch_npu is not installed" and "deepinfer[ascend]" in found.hint


def test_ascend_cann_missing(monkeypatch):
    _fake_torch_npu(monkeypatch, error=OSError("libhccl.so: cannot open shared object file: No such file or directory"))
    found = ascend.probe()
    assert not found.available and "CANN libraries are not loadable" in found.reason and "libhccl.so" in found.reason
    assert "set_env.sh" in found.hint


def test_ascend_import_fails_otherwise(monkeypatch):
    _fake_torch_npu(monkeypatch, error=ImportError("cannot import name 'foo' from 'torch._C'"))
    found = ascend.probe()
    assert not found.available and "torch_npu failed to import" in found.reason and "reinstall" in found.hint


def test_ascend_version_mismatch(monkeypatch):
    _fake_torch_npu(monkeypatch, version="2.5.1")
    found = ascend.probe()
    assert not found.available and "does not match torch" in found.reason and "2.10.0" in found.hint


def test_ascend_no_device(monkeypatch):
    _fake_torch_npu(monkeypatch, version=torch.__version__.split("+")[0] + ".post1")
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(device_count=lambda: 0), raising=False)
    found = ascend.probe()
    assert not found.available and "no Ascend NPU is visible" in found.reason and "npu-smi" in found.hint


def test_ascend_available_reports_the_chip(monkeypatch):
    _fake_torch_npu(monkeypatch, version=torch.__version__.split("+")[0] + ".post1")
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(device_count=lambda: 8), raising=False)
    found = ascend.probe()
    assert found.available and found.details["chip"] == "A2" and found.details["npus"] == 8


@pytest.mark.parametrize("soc, chip", [(220, "A2"), (225, "A2"), (250, "A3"), (255, "A3"), (260, "950"), (None, "unknown")])
def test_chip_from_soc(soc, chip):
    assert ascend.chip_from_soc(soc) == chip
    assert "torch_npu" not in sys.modules
