"""DeepSeek-V4's manifold-constrained hyper-connections (mHC) around every attention and FFN block.

The residual is N streams per token ([T, N, D]). Before a block, `hc_pre` derives three mixings
from the streams (a projection of the RMS-normalised, flattened streams): `pre` collapses the
streams into the block's input, `post` spreads the block's output back over the streams, `comb`
(made doubly stochastic by Sinkhorn-Knopp iterations) mixes the old streams; `hc_post` applies the
last two. After the last block the head collapses the streams once more, with a `pre` of its own and
no post or comb (`hc_head`), into the final norm's input.
"""

from __future__ import annotations

import torch

from deepinfer.ops.norm import rms_norm
from deepinfer.ops.sparse_attention import V4, V4_AND_V41, V41
from deepinfer.registry import ALLCLOSE, op


def check_hc_pre_shapes(x, fn, base, scale, norm_weight=None, prev_pre=None) -> None:
    """`hc_pre`'s shapes (and `hc_pre_delayed`'s prev_pre): every backend's check."""
    if x.dim() != 3:
        raise ValueError(f"hc_pre wants x [T, N, D], got {tuple(x.shape)}")
    n, d = x.shape[1], x.shape[2]
    width = (2 + n) * n
    if fn.shape != (width, n * d) or base.shape != (width,) or scale.shape != (3,):
        raise ValueError(
            f"for N={n}, D={d}: fn [{width}, {n * d}], base [{width}], scale [3] expected; got {tuple(fn.shape)}, {tuple(base.shape)}, {tuple(scale.shape)}"
        )
    if norm_weight is not None and norm_weight.shape != (d,):
        raise ValueError(f"norm_weight must be [D={d}], got {tuple(norm_weight.shape)}")
    if prev_pre is not None and prev_pre.shape != x.shape[:2]:
        raise ValueError(f"prev_pre must be [T, N] = {tuple(x.shape[:2])}, got {tuple(prev_pre.shape)}")


def check_hc_head_shapes(x, fn, base, scale, norm_weight) -> None:
    """`hc_head`'s shapes: every backend's check."""
    if x.dim() != 3:
        raise ValueError(f"hc_head wants x [T, N, D], got {tuple(x.shape)}")
    n, d = x.shape[1], x.shape[2]
    if fn.shape != (n, n * d) or base.shape != (n,) or scale.shape != (1,):
        raise ValueError(
            f"for N={n}, D={d}: fn [{n}, {n * d}], base [{n}], scale [1] expected; got {tuple(fn.shape)}, {tuple(base.shape)}, {tuple(scale.shape)}"
        )
    if norm_weight.shape != (d,):
        raise ValueError(f"norm_weight must be [D={d}], got {tuple(norm_weight.shape)}")


# The reduction length is the N streams summed into layer_input: the N*D-long mixing products pass
# through a sigmoid / softmax and Sinkhorn (float32 kernels err by ~1e-7 there), and atol scaled by
# N*D (16384 for V4-Flash: 16 in bfloat16) would pass any post and comb in [0, 2].
@op(family="misc", outputs=("layer_input", "post", "comb"), compare=ALLCLOSE, reduction_length=lambda kw: kw["x"].shape[1], model_types=V4)
def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block input and the mixings of N residual streams.

    x: [T, N, D]; fn: [(2+N)N, N*D], base: [(2+N)N], scale: [3], all float32. With
    f = rms(x_t flattened to N*D, eps=norm_eps) (no weight) and m = f @ fn^T split into N, N and N*N:
        pre  = sigmoid(m_pre * scale[0] + base_pre) + hc_eps                     [N]
        post = 2 * sigmoid(m_post * scale[1] + base_post)                        [N]
        comb = softmax_rows(m_comb * scale[2] + base_comb) + hc_eps              [N, N]
    then comb's columns are normalised once (c / (colsum + hc_eps)), then sinkhorn_iters - 1 times
    rows then columns. layer_input = sum_n pre[n] * x[t, n] in x's dtype; post, comb float32.
    Computed in float32 (float64 for float64 x).

    norm_weight: [D] float32, the block's own RMSNorm (attn_norm, ffn_norm), or None. When given,
    layer_input is returned normed: exactly `rms_norm(layer_input, norm_weight, eps=norm_eps)` of the
    layer_input above, rounded to x's dtype first (the statistics read the rounded row, as a separate
    rms_norm would; V4 uses one norm_eps for the streams and the blocks' norms). An option of hc_pre and
    not an op of its own: a decode step's rms_norm is a launch of its own that reads back a row hc_pre
    has just written, while the collapse that writes it already holds the row.
    """
    check_hc_pre_shapes(x, fn, base, scale, norm_weight)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    pre, post, comb = _mixings(xf, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    layer_input = (pre[..., None] * xf).sum(dim=1).to(x.dtype)
    if norm_weight is not None:
        layer_input, _ = rms_norm(layer_input, norm_weight, eps=norm_eps)
    return layer_input, post, comb


def _mixing_logits(xf, fn, norm_eps: float) -> torch.Tensor:
    """rms(x_t flattened to N*D, eps=norm_eps) @ fn^T for streams xf [T, N, D]: [T, rows of fn], in xf's dtype."""
    flat = xf.flatten(1)
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return flat @ fn.to(xf.dtype).T


def _pre(m_pre, b_pre, s_pre, hc_eps: float) -> torch.Tensor:
    """The collapse weights from their mixing logits, bias and scale (hc_pre's and hc_head's)."""
    return torch.sigmoid(m_pre * s_pre + b_pre) + hc_eps


def _mixings(xf, fn, base, scale, norm_eps: float, hc_eps: float, sinkhorn_iters: int):
    """(pre, post, comb) of streams xf [T, N, D] in their accumulation dtype (`hc_pre`'s formulas)."""
    tokens, n, _ = xf.shape
    acc = xf.dtype
    mixes = _mixing_logits(xf, fn, norm_eps)
    m_pre, m_post, m_comb = mixes.split([n, n, n * n], dim=-1)
    b_pre, b_post, b_comb = base.to(acc).split([n, n, n * n])
    s = scale.to(acc)
    pre = _pre(m_pre, b_pre, s[0], hc_eps)
    post = 2 * torch.sigmoid(m_post * s[1] + b_post)
    comb = torch.softmax((m_comb * s[2] + b_comb).view(tokens, n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


# The reduction length is hc_pre's: the N streams summed into the collapse, normed after it as hc_pre's normed cases are.
@op(family="misc", outputs=("hidden",), compare=ALLCLOSE, reduction_length=lambda kw: kw["x"].shape[1], model_types=V4)
def hc_head(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_weight: torch.Tensor, *, norm_eps: float, hc_eps: float
) -> torch.Tensor:
    """DeepSeek-V4's head: the streams collapsed by the head's own mixing, then the final RMSNorm.

    x: [T, N, D]; fn: [N, N*D], base: [N], scale: [1], norm_weight: [D], float32. `hc_pre`'s `pre` and
    its collapse with the head's parameters, the norm always applied: with
    f = rms(x_t flattened to N*D, eps=norm_eps) (no weight),
        pre    = sigmoid((f @ fn^T) * scale[0] + base) + hc_eps                  [N]
        hidden = rms_norm(sum_n pre[n] * x[t, n] rounded to x's dtype, norm_weight, eps=norm_eps)
    in x's dtype (the statistics read the rounded collapse, as a separate rms_norm would). Computed in
    float32 (float64 for float64 x). What an MTP block's head computes too, with its own parameters.

    An op of its own, not an hc_pre call: the head mixes nothing back into the streams (no post, no comb)
    and always norms, so its parameters have other shapes and its result is one tensor, where an hc_pre
    whose outputs followed fn's shape would be an op whose outputs are not what its spec names. The
    backends run it in hc_pre's kernels (the projection, `pre`, the collapse and the fused norm are the same code).
    """
    check_hc_head_shapes(x, fn, base, scale, norm_weight)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    pre = _pre(_mixing_logits(xf, fn, norm_eps), base.to(acc), scale.to(acc)[0], hc_eps)
    collapsed = (pre[..., None] * xf).sum(dim=1).to(x.dtype)
    return rms_norm(collapsed, norm_weight, eps=norm_eps)[0]


@op(
    family="misc", outputs=("layer_input", "pre", "post", "comb"), compare=ALLCLOSE, reduction_length=lambda kw: kw["x"].shape[1], model_types=V41,
)  # fmt: skip
def hc_pre_delayed(
    x: torch.Tensor,
    prev_pre: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V4.1's single-pass hyper-connections: `hc_pre` whose collapse uses the previous site's `pre`.

    V4.1 computes a site's mixings once, from the streams entering it, but collapses those streams with
    the `pre` the *previous* site computed (the attention site of block b with block b-1's FFN-site
    pre, the FFN site with block b's attention-site pre; the first block with the one-hot (1, 0, .., 0)),
    so the collapse does not wait for the site's own projection. x: [T, N, D]; prev_pre: [T, N] float32;
    fn, base, scale, norm_eps, hc_eps, sinkhorn_iters: as `hc_pre`. Returns (layer_input =
    sum_n prev_pre[n] * x[t, n] in x's dtype, and this site's pre [T, N], post [T, N], comb [T, N, N]
    float32, for the next site and this site's `hc_post`). Computed in float32 (float64 for float64 x).
    """
    check_hc_pre_shapes(x, fn, base, scale, prev_pre=prev_pre)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    pre, post, comb = _mixings(xf, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    layer_input = (prev_pre.to(acc)[..., None] * xf).sum(dim=1).to(x.dtype)
    return layer_input, pre, post, comb


@op(family="misc", outputs=("out",), compare=ALLCLOSE, reduction_length=lambda kw: kw["x"].shape[1] + 1, model_types=V4_AND_V41)
def hc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a block: out[t, k] = post[t, k] * y[t] + sum_j comb[t, j, k] * x[t, j].

    y: [T, D] the block's output; x: [T, N, D] the streams before it; post: [T, N], comb: [T, N, N]
    float32 (from `hc_pre`). Returns [T, N, D] in x's dtype; computed in float32 (float64 for float64 x).
    """
    if x.dim() != 3 or y.shape != (x.shape[0], x.shape[2]) or post.shape != x.shape[:2] or comb.shape != (x.shape[0], x.shape[1], x.shape[1]):
        raise ValueError(
            "hc_post wants y [T, D], x [T, N, D], post [T, N], comb [T, N, N]; "
            f"got {tuple(y.shape)}, {tuple(x.shape)}, {tuple(post.shape)}, {tuple(comb.shape)}"
        )
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = post.to(acc)[..., None] * y.to(acc)[:, None, :] + torch.einsum("tjk,tjd->tkd", comb.to(acc), x.to(acc))
    return out.to(x.dtype)
