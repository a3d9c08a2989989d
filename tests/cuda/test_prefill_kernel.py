"""The cuda backend's `prefill` Triton kernel under the Triton interpreter, against the op's reference.

Random var-len batches beyond the golden set: q_len 1, cached prefixes, lengths at block boundaries
(63/64/65/128), an empty request, sliding windows, float32 and bfloat16, Dqk 192 / Dv 128 and 64/64,
odd head dims; small tiles so that one request spans many query and key blocks (window-edge,
mask-free and diagonal phases), and the TMA-descriptor path.

tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported; tests/triton_mode.py fails
these tests loudly if the kernels in this process are not interpreted.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops.attention import prefill as reference
from deepinfer.registry import OPS, check_signature

from triton_mode import kernel_module, require_interpreter


@pytest.fixture(scope="module")
def kernels():
    require_interpreter()
    return kernel_module("deepinfer_cuda.kernels.prefill")


def _batch(q_lens, prefixes, heads, d_qk, d_v, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k_lens = [q + p for q, p in zip(q_lens, prefixes)]
    cu_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), heads, d_qk, generator=g).to(dtype)
    k = torch.randn(sum(k_lens), heads, d_qk, generator=g).to(dtype)
    v = torch.randn(sum(k_lens), heads, d_v, generator=g).to(dtype)
    return q, k, v, cu_q, cu_k


def _check(out, q, k, v, cu_q, cu_k, scale, window):
    ref = reference(q.double(), k.double(), v.double(), cu_q, cu_k, softmax_scale=scale, sliding_window=window)
    assert out.dtype == q.dtype and out.shape == ref.shape
    spec = OPS["prefill"]
    tol = spec.tolerance(q.dtype)
    length = spec.reduction_length(dict(cu_seqlens_k=cu_k))
    err = (out.double() - ref).abs()
    bound = tol.atol * length + tol.rtol * ref.abs()
    assert torch.isfinite(out).all()
    assert bool((err <= bound).all()), f"max err {float(err.max()):.3g}, worst err/bound {float((err / bound).max()):.3g}"


def test_signature_matches_the_op(kernels):
    check_signature(OPS["prefill"], kernels.prefill, "cuda")
    assert [r.op for r in kernels.REGISTRATIONS] == ["prefill"]


@pytest.mark.parametrize(
    "dtype, d_qk, d_v, window",
    [
        (torch.float32, 192, 128, None),
        (torch.bfloat16, 192, 128, None),
        (torch.float32, 64, 64, 37),
        (torch.bfloat16, 64, 64, 37),
    ],
)
def test_varlen_batch_table_config(kernels, dtype, d_qk, d_v, window):
    # q_len 1 after a prefix, block-boundary lengths with and without prefixes, an empty request.
    q_lens, prefixes = [1, 63, 64, 0, 65, 128], [40, 0, 70, 9, 1, 3]
    q, k, v, cu_q, cu_k = _batch(q_lens, prefixes, 2, d_qk, d_v, dtype, seed=d_qk + (window or 0))
    scale = d_qk**-0.5
    out = kernels.prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, sliding_window=window)
    _check(out, q, k, v, cu_q, cu_k, scale, window)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("window", [None, 1, 21])
def test_small_tiles_many_blocks(kernels, tma, window):
    # 16 x 16 tiles: each request spans several query blocks and the window-edge, mask-free and
    # diagonal key-block phases all run.
    q_lens, prefixes = [47, 1, 33, 16], [50, 17, 0, 16]
    q, k, v, cu_q, cu_k = _batch(q_lens, prefixes, 2, 192, 128, torch.float32, seed=7 + (window or 0))
    scale = 0.07
    cfg = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=2, tma=tma)
    out = kernels.launch_prefill(q, k, v, cu_q, cu_k, scale, window, cfg=cfg)
    _check(out, q, k, v, cu_q, cu_k, scale, window)


def test_gpu_tile_sizes_with_descriptors_bf16(kernels):
    # The SM90 table's tiles (128 x 64) and the TMA path, on a prefix that crosses key blocks.
    q_lens, prefixes = [130, 5], [70, 200]
    q, k, v, cu_q, cu_k = _batch(q_lens, prefixes, 1, 192, 128, torch.bfloat16, seed=3)
    scale = 192**-0.5
    cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, tma=True)
    out = kernels.launch_prefill(q, k, v, cu_q, cu_k, scale, None, cfg=cfg)
    _check(out, q, k, v, cu_q, cu_k, scale, None)


@pytest.mark.parametrize("d_qk, d_v", [(80, 48), (112, 96)])
def test_odd_head_dims(kernels, d_qk, d_v):
    # Dqk split into a power of two plus a padded remainder; Dv padded with masks.
    q_lens, prefixes = [20, 3], [9, 30]
    q, k, v, cu_q, cu_k = _batch(q_lens, prefixes, 3, d_qk, d_v, torch.float32, seed=d_qk)
    scale = d_qk**-0.5
    cfg = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=2)
    out = kernels.launch_prefill(q, k, v, cu_q, cu_k, scale, 11, cfg=cfg)
    _check(out, q, k, v, cu_q, cu_k, scale, 11)


def test_negative_scale_and_strided_inputs(kernels):
    # A negative softmax_scale takes the plain (non-FMA) path; q/k/v as column slices of wider
    # tensors (non-packed heads) take the pointer path.
    q_lens, prefixes = [17], [5]
    qw, kw, vw, cu_q, cu_k = _batch(q_lens, prefixes, 2, 96, 80, torch.float32, seed=11)
    q, k, v = qw[..., :64], kw[..., :64], vw[..., :64]
    cfg = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=2, tma=True)
    out = kernels.launch_prefill(q, k, v, cu_q, cu_k, -0.2, None, cfg=cfg)
    _check(out, q, k, v, cu_q, cu_k, -0.2, None)


def test_rejects_bad_window(kernels):
    q, k, v, cu_q, cu_k = _batch([2], [0], 1, 64, 64, torch.float32, seed=0)
    with pytest.raises(ValueError):
        kernels.prefill(q, k, v, cu_q, cu_k, softmax_scale=0.1, sliding_window=0)
