"""DeepSeek-V4's hyper-connection references: `hc_head` is `hc_pre`'s pre and collapse with the head's
own mixing, normed, and it is exactly what the V4 head computed as torch glue before it was an op."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops.hyper_connection import hc_head, hc_pre
from deepinfer.ops.norm import rms_norm

N, D = 4, 48


def head_inputs(tokens: int, dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": (torch.randn(tokens, N, D, generator=g) * 3).to(dtype),
        "fn": torch.randn(N, N * D, generator=g) * (N * D) ** -0.5,
        "base": torch.randn(N, generator=g) * 0.5,
        "scale": torch.tensor([0.8]),
        "norm_weight": 1 + 0.3 * torch.randn(D, generator=g),
    }


def test_hc_head_is_hc_pres_normed_collapse_with_the_heads_mixing():
    """hc_pre whose first N mixing rows, biases and scale are the head's gives hc_head's result as its layer input."""
    kw = {k: v.double() for k, v in head_inputs(5, torch.float64).items()}
    g = torch.Generator().manual_seed(1)
    width = (2 + N) * N
    fn = torch.cat([kw["fn"], torch.randn(width - N, N * D, generator=g, dtype=torch.float64)])
    base = torch.cat([kw["base"], torch.randn(width - N, generator=g, dtype=torch.float64)])
    scale = torch.cat([kw["scale"], torch.tensor([0.5, 1.5], dtype=torch.float64)])
    layer_input, _, _ = hc_pre(kw["x"], fn, base, scale, norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=3, norm_weight=kw["norm_weight"])
    got = hc_head(**kw, norm_eps=1e-6, hc_eps=1e-6)
    torch.testing.assert_close(got, layer_input, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_head_is_the_v4_heads_former_glue_bit_for_bit(dtype):
    """The torch glue DeepSeek-V4's `_logits` ran before `hc_head` (flatten, rms, the mixing, sigmoid, the weighted sum,
    the cast, then rms_norm): the reference computes the same bits."""
    kw = head_inputs(3, dtype, seed=2)
    x, fn, base, scale = kw["x"], kw["fn"], kw["base"], kw["scale"]
    flat = x.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
    pre = torch.sigmoid(flat @ fn.T * scale + base) + 1e-6
    glue, _ = rms_norm((pre[..., None] * x.float()).sum(dim=1).to(dtype), kw["norm_weight"], eps=1e-6)
    got = hc_head(**kw, norm_eps=1e-6, hc_eps=1e-6)
    assert got.dtype == dtype and torch.equal(got, glue)


def test_hc_head_of_no_tokens_is_empty():
    """A prompt chunk samples no row: the head sees zero tokens."""
    got = hc_head(**head_inputs(0, torch.bfloat16), norm_eps=1e-6, hc_eps=1e-6)
    assert got.shape == (0, D) and got.dtype == torch.bfloat16


def test_hc_head_rejects_a_blocks_mixing_parameters():
    kw = head_inputs(2, torch.float32)
    width = (2 + N) * N
    with pytest.raises(ValueError, match=r"fn \[4, 192\], base \[4\], scale \[1\] expected"):
        hc_head(kw["x"], torch.zeros(width, N * D), torch.zeros(width), torch.zeros(3), kw["norm_weight"], norm_eps=1e-6, hc_eps=1e-6)
    with pytest.raises(ValueError, match="norm_weight must be"):
        hc_head(kw["x"], kw["fn"], kw["base"], kw["scale"], torch.ones(D + 1), norm_eps=1e-6, hc_eps=1e-6)
