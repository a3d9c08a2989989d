"""The cuda backend's rms_norm, rope and silu_and_mul kernels under the Triton interpreter (CPU).

Shapes beyond the golden set: edge sizes (one row, odd widths, non-power-of-two halves), strided
views, leading batch dimensions, the long-row loop, empty inputs, float64, compared with the op
references in deepinfer.ops.

tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported; tests/triton_mode.py fails
these tests loudly if the kernels in this process are not interpreted.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops.activation import silu_and_mul as ref_silu_and_mul
from deepinfer.ops.norm import rms_norm as ref_rms_norm
from deepinfer.ops.rope import rope as ref_rope
from deepinfer.ops.rope import rope_cos_sin_cache

from triton_mode import kernel_module, require_interpreter

TOL = {torch.float64: (1e-10, 1e-12), torch.float32: (1.3e-6, 1e-6), torch.bfloat16: (1.6e-2, 1e-3), torch.float16: (1e-3, 1e-4)}


@pytest.fixture(scope="module")
def k():
    """The kernel modules, checked to be decorated for the interpreter."""
    require_interpreter()
    return {name: kernel_module(f"deepinfer_cuda.kernels.{name}") for name in ("norm", "rope", "activation")}


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOL[dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref.double(), rtol=rtol, atol=atol)


def golden(fn, *args, dtype, **kwargs):
    """The reference in float64 on float64-upcast inputs, stored in the case dtype (as the golden set is)."""
    up = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    kw = {n: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for n, v in kwargs.items()}
    res = fn(*up, **kw)
    if isinstance(res, tuple):
        return tuple(None if r is None else r.to(dtype) for r in res)
    return res.to(dtype)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize(
    "shape,dtype,residual",
    [
        ((1, 7), torch.float32, False),
        ((3, 100), torch.float32, True),
        ((17, 64), torch.bfloat16, True),
        ((2, 3, 48), torch.float32, True),  # leading batch dimensions
        ((5, 33), torch.float64, True),
        ((9, 256), torch.float16, False),
    ],
)
def test_rms_norm_matches_reference(k, shape, dtype, residual):
    g = _gen(1)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype) if residual else None
    out, h = k["norm"].rms_norm(x, w, eps=1e-5, residual=r)
    ref_out, ref_h = golden(ref_rms_norm, x, w, dtype=dtype, eps=1e-5, residual=r)
    close(out, ref_out, dtype)
    if residual:
        # h is the sum rounded to the input dtype: exact against the same rounding, except that the
        # interpreter truncates float32 -> bfloat16 (GPUs round to nearest even): one bf16 ulp there.
        exact = (x.double() + r.double()).to(dtype)
        if dtype == torch.bfloat16:
            torch.testing.assert_close(h.double(), exact.double(), rtol=2**-7, atol=0)
        else:
            assert torch.equal(h, exact)
    else:
        assert h is None


def test_rms_norm_strided_rows(k):
    g = _gen(2)
    base = torch.randn(6, 80, generator=g)
    x, r = base[:, 8:72], torch.randn(6, 100, generator=g)[:, :64]  # row strides 80 and 100
    w = torch.randn(64, generator=g)
    out, h = k["norm"].rms_norm(x, w, residual=r)
    ref_out, ref_h = golden(ref_rms_norm, x, w, dtype=torch.float32, residual=r)
    close(out, ref_out, torch.float32)
    close(h, ref_h, torch.float32)


def test_rms_norm_long_rows_take_the_loop(k, monkeypatch):
    cfg = dict(k["norm"]._config(torch.device("cpu")), max_block_d=64, loop_block_d=32)
    monkeypatch.setattr(k["norm"], "_config", lambda device: cfg)
    g = _gen(3)
    for dtype, residual in ((torch.float32, True), (torch.bfloat16, False)):
        x = torch.randn(3, 200, generator=g).to(dtype)
        w = torch.randn(200, generator=g).to(dtype)
        r = torch.randn(3, 200, generator=g).to(dtype) if residual else None
        out, h = k["norm"].rms_norm(x, w, residual=r)
        ref_out, ref_h = golden(ref_rms_norm, x, w, dtype=dtype, residual=r)
        close(out, ref_out, dtype)
        if residual:
            close(h, ref_h, dtype)


def test_rms_norm_empty(k):
    out, h = k["norm"].rms_norm(torch.empty(0, 16), torch.ones(16), residual=torch.empty(0, 16))
    assert out.shape == (0, 16) and h.shape == (0, 16)


# ---------------------------------------------------------------------------------------------- rope


@pytest.mark.parametrize(
    "T,H,D,interleaved,dtype",
    [
        (1, 1, 64, True, torch.float32),
        (5, 3, 6, True, torch.float32),  # half = 3: not a power of two
        (5, 3, 6, False, torch.float32),
        (7, 2, 64, False, torch.bfloat16),
        (4, 5, 16, True, torch.float64),
        (3, 2, 2, False, torch.float32),
    ],
)
def test_rope_matches_reference(k, T, H, D, interleaved, dtype):
    g = _gen(4)
    cache = rope_cos_sin_cache(D, 50, 10000.0)
    x = torch.randn(T, H, D, generator=g).to(dtype)
    pos = torch.randint(0, 50, (T,), generator=g)
    out = k["rope"].rope(x, pos, cache, interleaved=interleaved)
    close(out, golden(ref_rope, x, pos, cache, dtype=dtype, interleaved=interleaved), dtype)


def test_rope_strided_view_int32_positions_and_token_blocks(k, monkeypatch):
    # The rope part of q: [T, H, 96][..., 32:], not contiguous. Small tiles: several token and head blocks.
    cfg = dict(k["rope"]._config(torch.device("cpu")), tile_elems=128)
    monkeypatch.setattr(k["rope"], "_config", lambda device: cfg)
    g = _gen(5)
    q = torch.randn(9, 5, 96, generator=g)
    x = q[..., 32:]
    pos = torch.randint(0, 40, (9,), generator=g).to(torch.int32)
    cache = rope_cos_sin_cache(64, 40, 500.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    for interleaved in (True, False):
        out = k["rope"].rope(x, pos, cache, interleaved=interleaved)
        assert out.is_contiguous()
        close(out, golden(ref_rope, x, pos, cache, dtype=torch.float32, interleaved=interleaved), torch.float32)


def test_rope_empty(k):
    out = k["rope"].rope(torch.empty(0, 4, 8), torch.empty(0, dtype=torch.long), rope_cos_sin_cache(8, 4, 10000.0))
    assert out.shape == (0, 4, 8)


# ---------------------------------------------------------------------------------------------- silu_and_mul


@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((1, 10), torch.float32),  # I = 5
        ((7, 96), torch.bfloat16),
        ((2, 3, 48), torch.float32),  # leading batch dimensions
        ((4, 34), torch.float64),
        ((3, 64), torch.float16),
    ],
)
def test_silu_and_mul_matches_reference(k, shape, dtype):
    g = _gen(6)
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    out = k["activation"].silu_and_mul(x)
    close(out, golden(ref_silu_and_mul, x, dtype=dtype), dtype)


def test_silu_and_mul_strided_rows_and_column_blocks(k, monkeypatch):
    cfg = dict(k["activation"]._config(torch.device("cpu")), max_block_i=16, tile_elems=32)
    monkeypatch.setattr(k["activation"], "_config", lambda device: cfg)
    g = _gen(7)
    x = (torch.randn(5, 120, generator=g) * 30)[:, :2 * 50]  # I = 50: four column blocks, row stride 120
    out = k["activation"].silu_and_mul(x)
    close(out, golden(ref_silu_and_mul, x, dtype=torch.float32), torch.float32)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_silu_and_mul_extremes(k):
    x = torch.tensor([[-1e4, -88.0, 0.0, 88.0, 1e4, 2.0, 3.0, -4.0, 5.0, 6.0]])
    out = k["activation"].silu_and_mul(x)
    assert torch.isfinite(out).all()
    close(out, golden(ref_silu_and_mul, x, dtype=torch.float32), torch.float32)


def test_silu_and_mul_empty(k):
    assert k["activation"].silu_and_mul(torch.empty(0, 8)).shape == (0, 4)


# ---------------------------------------------------------------------------------------------- registrations


def test_registrations_have_the_op_signatures(k):
    from deepinfer.registry import Registry

    reg = Registry()
    for m in k.values():
        for r in m.REGISTRATIONS:
            reg.register_kernel("cuda", r.op, r.fn, formats=r.formats, dtypes=r.dtypes, note=r.note)
    assert {name for name, ks in reg.kernels["cuda"].items() if ks} == {"rms_norm", "rope", "silu_and_mul"}

