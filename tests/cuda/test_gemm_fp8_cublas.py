"""fp8_path=auto|cublas: which linear and masked grouped_gemm calls cuBLAS's block-scaled FP8 GEMM serves, that the option
picks it only where it runs (auto) or says why it cannot (cublas, off an SM90 GPU), and (on an SM90 GPU) that it matches
the reference at V4-Flash's prefill projection shapes."""

from __future__ import annotations

import pytest
import torch

import deepinfer_cuda.kernels.gemm as kg
import deepinfer_cuda.kernels.gemm_fp8_cublas as gc
from deepinfer.ops import gemm as ref
from deepinfer.ops import quant
from deepinfer.registry import Registry, RegistryError, ResolveContext

from triton_mode import GPU, mode

F8 = quant.FP8_DTYPE
ON_SM90 = pytest.mark.skipif(mode() != GPU or not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                             reason="runs on an SM90 GPU only (TRITON_INTERPRET=0 pytest tests/cuda/test_gemm_fp8_cublas.py)")


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_it_serves_prefill_sized_bf16_calls_with_aligned_shapes_only():
    w = _meta(1536, 4096, dtype=F8)
    assert gc.not_served(_meta(8192, 4096), w, None) is None
    assert gc.not_served(_meta(2, 512, 4096), w, torch.bfloat16) is None  # rows flatten: 1024
    assert "fewer than 1024 rows" in gc.not_served(_meta(256, 4096), w, None)
    assert "float32" in gc.not_served(_meta(8192, 4096, dtype=torch.float32), w, None)
    assert "out_dtype" in gc.not_served(_meta(8192, 4096), w, torch.float32)
    assert "K=1280" in gc.not_served(_meta(8192, 1280), _meta(1536, 1280, dtype=F8), None)
    assert "N=1000" in gc.not_served(_meta(8192, 4096), _meta(1000, 4096, dtype=F8), None)
    assert "contiguous" in gc.not_served(_meta(8192, 4096), _meta(4096, 1536, dtype=F8).T, None)
    # masked: V4's wo_a (8 groups of every token) is served; decode's 256 experts of a few rows each are not
    assert gc.not_served(_meta(8, 16384, 4096), _meta(8, 1024, 4096, dtype=F8), None, masked=True) is None
    assert "fewer than 16384 rows a group" in gc.not_served(_meta(8, 8192, 4096), _meta(8, 1024, 4096, dtype=F8), None, masked=True)
    assert "more than 16" in gc.not_served(_meta(32, 16384, 4096), _meta(32, 1024, 4096, dtype=F8), None, masked=True)


def _registry():
    registry = Registry()
    registry.register_all("cuda", kg.REGISTRATIONS + gc.REGISTRATIONS)
    return registry


def test_auto_keeps_the_tl_kernel_where_cublas_cannot_run_and_tl_or_gluon_never_pick_it():
    registry = _registry()
    for path in (None, "auto", "tl", "gluon") if mode() != GPU else ("tl", "gluon"):
        ctx = ResolveContext("cuda", dtype=torch.bfloat16, options={} if path is None else {"fp8_path": path})
        assert registry.choose(ctx, "linear", "fp8_block").fn is not gc.linear, path
        assert registry.choose(ctx, "grouped_gemm", "fp8_block").fn is not gc.grouped_gemm, path


@pytest.mark.skipif(mode() == GPU, reason="on a GPU the option resolves (see the comparison below)")
def test_the_option_says_why_it_cannot_run_off_an_sm90_gpu():
    ctx = ResolveContext("cuda", dtype=torch.bfloat16, options={"fp8_path": "cublas"})
    with pytest.raises(RegistryError, match="SM90 GPUs only"):
        _registry().choose(ctx, "linear", "fp8_block")


@pytest.mark.skipif(mode() == GPU, reason="CPU tensors on the interpreted tl kernel: CI's; on a GPU the comparisons below cover the served calls")
def test_a_call_it_does_not_serve_runs_on_the_tl_kernel():
    gen = torch.Generator().manual_seed(0)
    w, s = quant.quantize_weight_fp8_block(torch.randn(128, 256, generator=gen) * 0.05)
    x = torch.randn(5, 256, generator=gen).bfloat16()
    assert torch.equal(gc.linear(x, w, weight_scale=s, fmt="fp8_block"), kg.launch_gemm(x, w, s, "fp8_block", kg._LINEAR))
    w, s = quant.quantize_weight_fp8_block(torch.randn(2, 128, 256, generator=gen) * 0.05)
    x, mm = torch.randn(2, 6, 256, generator=gen).bfloat16(), torch.tensor([6, 2], dtype=torch.int32)
    got = gc.grouped_gemm(x, w, masked_m=mm, weight_scale=s, fmt="fp8_block")
    want = kg.launch_gemm(x, w, s, "fp8_block", kg._MASKED, masked_m=mm)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1, :2], want[1, :2])
    offsets = torch.tensor([0, 4, 6], dtype=torch.int32)  # the contiguous layout is never served
    got = gc.grouped_gemm(x.reshape(12, 256)[:6], w, expert_offsets=offsets, weight_scale=s, fmt="fp8_block")
    assert torch.equal(got, kg.launch_gemm(x.reshape(12, 256)[:6], w, s, "fp8_block", kg._CONTIGUOUS, offsets=offsets))


@ON_SM90
@pytest.mark.parametrize("rows, n, k", [(1024, 1536, 4096), (8192, 4096, 8192), (4096, 2048, 512), (3000, 4096, 2048)])
def test_matches_the_reference_on_the_gpu(rows, n, k):
    dev = torch.device("cuda")
    assert gc.blockwise_unusable(dev) is None
    ctx = ResolveContext("cuda", device=dev, dtype=torch.bfloat16)
    assert _registry().choose(ctx, "linear", "fp8_block").fn is gc.linear  # auto picks it here
    gen = torch.Generator(device=dev).manual_seed(rows + n)
    x = torch.randn(rows, k, device=dev, generator=gen).bfloat16()
    w, s = quant.quantize_weight_fp8_block(torch.randn(n, k, device=dev, generator=gen) * 0.05)
    got = gc.linear(x, w, weight_scale=s, fmt="fp8_block").float()
    want = ref.linear(x.float(), w, weight_scale=s, fmt="fp8_block")
    assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item()


@ON_SM90
def test_the_grouped_output_projection_matches_the_reference_on_the_gpu():
    """V4's wo_a at 16384 tokens: x the heads-by-group transposed view [8, T, 4096] of [T, 8, 4096], as the model passes it."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(3)
    groups, tokens, k, n = 8, gc.MIN_MASKED_ROWS, 4096, 1024
    x = torch.randn(tokens, groups, k, device=dev, generator=gen).bfloat16().transpose(0, 1)
    w, s = quant.quantize_weight_fp8_block(torch.randn(groups, n, k, device=dev, generator=gen) * 0.05)
    mm = torch.full((groups,), tokens, dtype=torch.int32, device=dev)
    got = gc.grouped_gemm(x, w, masked_m=mm, weight_scale=s, fmt="fp8_block").float()
    want = ref.grouped_gemm(x.float(), w, masked_m=mm, weight_scale=s, fmt="fp8_block")
    assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item()
