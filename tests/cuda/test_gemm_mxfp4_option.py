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


def chosen(kg, path, fmt="mxfp4"):
    registry = Registry()
    registry.register_all("cuda", kg.REGISTRATIONS)
    ctx = ResolveContext("cuda", dtype=torch.bfloat16, options={} if path is None else {"mxfp4_path": path})
    return {op: registry.choose(ctx, op, fmt).fn for op in ("linear", "grouped_gemm")}


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8_block32"])  # fp8_block32 (W8A16) takes mxfp4's path
def test_the_option_picks_the_registration(kg, fmt):
    assert chosen(kg, None, fmt) == chosen(kg, "auto", fmt) == {"linear": kg.linear, "grouped_gemm": kg.grouped_gemm}
    for path in ("dot_scaled", "upcast", "register"):
        want = {"linear": f"linear_mxfp4_{path}", "grouped_gemm": f"grouped_gemm_mxfp4_{path}"}
        assert {op: fn.__qualname__ for op, fn in chosen(kg, path, fmt).items()} == want


def test_a_forced_path_plans_that_path_whatever_the_machines_default(kg, monkeypatch):
    x, (w, _) = torch.randn(4, 64).bfloat16(), quant.quantize_weight_mxfp4(torch.randn(32, 64))
    for default in (True, False):
        monkeypatch.setattr(kg, "MXFP4_DOT_SCALED", default)
        assert kg.plan_gemm(x, w, "mxfp4", kg._LINEAR).mx_mode == (kg._MX_DOT_SCALED if default else kg._MX_UPCAST)
        assert kg.plan_gemm(x, w, "mxfp4", kg._LINEAR, "upcast").mx_mode == kg._MX_UPCAST
        assert kg.plan_gemm(x, w, "mxfp4", kg._LINEAR, "dot_scaled").mx_mode == kg._MX_DOT_SCALED
        assert kg.plan_gemm(x, w, "mxfp4", kg._LINEAR, "register").mx_mode == kg._MX_REGISTER
    # float32 activations stay on the exact upcast whatever is forced
    assert kg.plan_gemm(x.float(), w, "mxfp4", kg._LINEAR, "register").mx_mode == kg._MX_UPCAST


def test_sm90_takes_the_register_path_by_default(kg, monkeypatch):
    """auto: SM90 (no block-scaled MMA) dequantises in registers, mxfp8 and mxfp4_a8 too; SM100 keeps
    tl.dot_scaled (mxfp4) and the native block-scaled MMA (mxfp8, mxfp4_a8). Planned from meta tensors."""
    x = torch.empty(16, 256, dtype=torch.bfloat16, device="meta")
    w4 = torch.empty(64, 128, dtype=torch.uint8, device="meta")
    w8 = torch.empty(64, 256, dtype=quant.FP8_DTYPE, device="meta")
    monkeypatch.setattr(kg, "interpreting", lambda: False)
    monkeypatch.setattr(kg, "MXFP4_DOT_SCALED", True)
    for cap, want4, want8 in (((9, 0), kg._MX_REGISTER, kg._MX_REGISTER), ((10, 0), kg._MX_DOT_SCALED, kg._MX_NATIVE)):
        monkeypatch.setattr(kg, "capability", lambda device=None, cap=cap: cap)
        assert kg.plan_gemm(x, w4, "mxfp4", kg._LINEAR).mx_mode == want4
        assert kg.plan_gemm(x, w4, "mxfp4_a8", kg._LINEAR).mx_mode == want8
        assert kg.plan_gemm(x, w8, "mxfp8", kg._LINEAR).mx_mode == want8
        assert kg.plan_gemm(x, w8, "fp8_block32", kg._LINEAR).mx_mode == want4  # W8A16: mxfp4's path
    plan = kg.plan_gemm(x, w4, "mxfp4", kg._LINEAR, "register")
    assert plan.mx_dq == 0  # bf16 pairs through PTX on a GPU


def test_the_forced_upcast_computes_the_op(kg, monkeypatch):
    monkeypatch.setattr(kg, "MXFP4_DOT_SCALED", True)  # the machine would take tl.dot_scaled
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g).bfloat16()
    w, scale = quant.quantize_weight_mxfp4(torch.randn(32, 64, generator=g))
    got = chosen(kg, "upcast")["linear"](x, w, weight_scale=scale, fmt="mxfp4")
    want = OPS["linear"].reference(x, w, weight_scale=scale, fmt="mxfp4")
    tol = OPS["linear"].tolerance(torch.bfloat16)
    torch.testing.assert_close(got.double(), want.double(), rtol=tol.rtol, atol=tol.atol * 64)
