"""The cuda backend option mxfp4_path (default from DEEPINFER_CUDA_MXFP4_PATH): which path mxfp4
GEMMs with bf16/fp16 activations take is chosen when the ops are resolved, by registration, not by
a module global read from the environment at import."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops import quant
from deepinfer.registry import OPS, Registry, ResolveContext


@pytest.fixture
def kg(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import deepinfer_cuda.kernels.gemm as kg

    return kg


def chosen(kg, path):
    registry = Registry()
    registry.register_all("cuda", kg.REGISTRATIONS)
    ctx = ResolveContext("cuda", dtype=torch.bfloat16, options={} if path is None else {"mxfp4_path": path})
    return {op: registry.choose(ctx, op, "mxfp4").fn for op in ("linear", "grouped_gemm")}


def test_the_option_picks_the_registration(kg):
    assert chosen(kg, None) == chosen(kg, "auto") == {"linear": kg.linear, "grouped_gemm": kg.grouped_gemm}
    for path in ("dot_scaled", "upcast"):
        assert {op: fn.__qualname__ for op, fn in chosen(kg, path).items()} == {"linear": f"linear_mxfp4_{path}", "grouped_gemm": f"grouped_gemm_mxfp4_{path}"}


def test_a_forced_path_plans_that_path_whatever_the_machines_default(kg, monkeypatch):
    x, (w, _) = torch.randn(4, 64).bfloat16(), quant.quantize_weight_mxfp4(torch.randn(32, 64))
    for default in (True, False):
        monkeypatch.setattr(kg, "MXFP4_DOT_SCALED", default)
        assert kg.plan_gemm(x, w, "mxfp4", kg._LINEAR).mx_mode == (kg._MX_DOT_SCALED if default else kg._MX_UPCAST)
        assert kg.plan_gemm(x, w, "mxfp4", kg._LINEAR, False).mx_mode == kg._MX_UPCAST
        assert kg.plan_gemm(x, w, "mxfp4", kg._LINEAR, True).mx_mode == kg._MX_DOT_SCALED


def test_the_forced_upcast_computes_the_op(kg, monkeypatch):
    monkeypatch.setattr(kg, "MXFP4_DOT_SCALED", True)  # the machine would take tl.dot_scaled
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g).bfloat16()
    w, scale = quant.quantize_weight_mxfp4(torch.randn(32, 64, generator=g))
    got = chosen(kg, "upcast")["linear"](x, w, weight_scale=scale, fmt="mxfp4")
    want = OPS["linear"].reference(x, w, weight_scale=scale, fmt="mxfp4")
    tol = OPS["linear"].tolerance(torch.bfloat16)
    torch.testing.assert_close(got.double(), want.double(), rtol=tol.rtol, atol=tol.atol * 64)
