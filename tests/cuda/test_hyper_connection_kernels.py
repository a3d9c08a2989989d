"""The cuda backend's hc_pre split launch in both combine forms under the Triton interpreter (CPU).

The golden set runs hc_pre's default launch shape (the row combine); `split_shape` also names the D-split form (rows too
wide for registers). Both forms must give the reference's numbers and each other's bits, for hc_pre with and
without the block's norm, hc_pre_delayed and hc_head, at widths that are and are not a power of two.

tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported; tests/triton_mode.py fails these tests loudly if
the kernels in this process are not interpreted.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops import hyper_connection as ref

from triton_mode import kernel_module, require_interpreter

KW = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
TOL = {torch.float32: (2e-6, 1e-6), torch.bfloat16: (1.6e-2, 1e-3)}


@pytest.fixture(scope="module")
def hc():
    require_interpreter()
    return kernel_module("deepinfer_cuda.kernels.hyper_connection")


def _inputs(tokens: int, streams: int, dim: int, dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mix = (2 + streams) * streams
    return {
        "x": torch.randn(tokens, streams, dim, generator=g).to(dtype),
        "fn": torch.randn(mix, streams * dim, generator=g) * (streams * dim) ** -0.5,
        "base": 0.5 * torch.randn(mix, generator=g),
        "scale": 1 + 0.2 * torch.randn(3, generator=g),
        "norm_weight": 1 + 0.1 * torch.randn(dim, generator=g),
        "prev_pre": torch.rand(tokens, streams, generator=g),
        "head_fn": torch.randn(streams, streams * dim, generator=g) * (streams * dim) ** -0.5,
        "head_base": torch.randn(streams, generator=g),
        "head_scale": 1 + 0.2 * torch.randn(1, generator=g),
    }


def _calls(hc, s: dict, impl) -> dict:
    """Every hyper-connection op that runs hc_pre's launches, through `impl` (the kernel module or the reference)."""
    x = s["x"]
    return {
        "hc_pre": impl.hc_pre(x, s["fn"], s["base"], s["scale"], **KW),
        "hc_pre normed": impl.hc_pre(x, s["fn"], s["base"], s["scale"], **KW, norm_weight=s["norm_weight"]),
        "hc_pre_delayed": impl.hc_pre_delayed(x, s["prev_pre"], s["fn"], s["base"], s["scale"], **KW),
        "hc_head": impl.hc_head(x, s["head_fn"], s["head_base"], s["head_scale"], s["norm_weight"], norm_eps=KW["norm_eps"], hc_eps=KW["hc_eps"]),
    }


def _with_form(hc, monkeypatch, row: bool) -> None:
    monkeypatch.setattr(hc, "split_shape", lambda *a, **k: hc.SplitShape(128, 16, 16, 0 if row else 2048, 1, row))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens, dim", [(5, 512), (3, 384)])
def test_row_and_d_split_forms_give_the_references_numbers_and_each_others_bits(hc, monkeypatch, dtype, tokens, dim):
    s = _inputs(tokens, 4, dim, dtype)
    want = _calls(hc, s, ref)
    got = {}
    for row in (False, True):
        _with_form(hc, monkeypatch, row)
        got[row] = _calls(hc, s, hc)
    rtol, atol = TOL[dtype]
    for name, expected in want.items():
        for row in (False, True):
            outs = got[row][name] if isinstance(expected, tuple) else (got[row][name],)
            for out, exp in zip(outs, expected if isinstance(expected, tuple) else (expected,), strict=True):
                assert out.dtype == exp.dtype and out.shape == exp.shape, name
                torch.testing.assert_close(out.double(), exp.double(), rtol=rtol, atol=atol, msg=lambda m, n=name, r=row: f"{n} row={r}: {m}")
        split = got[False][name] if isinstance(expected, tuple) else (got[False][name],)
        row_form = got[True][name] if isinstance(expected, tuple) else (got[True][name],)
        for a, b in zip(split, row_form, strict=True):
            assert torch.equal(a, b), f"{name}: the row form's bits differ from the D-split form's"


def test_row_warps_hold_a_v4_pro_row(hc):
    assert hc.row_warps(4096) == 4 and hc.row_warps(7168) == 8


def test_split_shape_by_batch_size(hc):
    """V4-Flash (K = 4 x 4096): the mix's segment and tile grow with T, the row combine throughout; deterministic mode keeps
    the first bucket at every T; only a K within one fused segment takes the fused launch (and never deterministically)."""

    def shape(t, invariant=False, k=4 * 4096, d=4096):
        return hc.split_shape(t, k, d, 132, invariant=invariant, interp=False, f64=False)

    assert [(shape(t).seg, shape(t).mix_t) for t in (1, 16, 17, 128, 256, 1024, 1025, 8192)] == [
        (128, 16), (128, 16), (256, 32), (256, 32), (512, 64), (512, 64), (1024, 64), (1024, 64)]  # fmt: skip
    assert all(shape(t).row and shape(t).d_splits == 1 for t in (1, 256, 8192))
    assert {shape(t, invariant=True) for t in (1, 17, 256, 8192)} == {shape(1)}
    assert shape(64, k=4 * 256, d=256) is None and shape(64, invariant=True, k=4 * 256, d=256) is not None
    wide = shape(1, k=4 * 16384, d=16384)
    assert not wide.row and wide.d_splits > 1  # a row too wide for registers: the D-split combine
