"""RMSNorm, with the residual add fused in front of it as DeepSeek's layers use it."""

from __future__ import annotations

import torch

from deepinfer.registry import ALLCLOSE, op


# The output is normalised (magnitude ~ weight), so its error does not grow with D: no atol scaling.
@op(family="misc", outputs=("out", "residual_out"), compare=ALLCLOSE)
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`out = h / sqrt(mean(h^2) + eps) * weight` with `h = x + residual` (or `h = x`).

    x, residual: [T, D]; weight: [D]. Returns `(out, h)` when a residual is given (the sum, in the
    input dtype, feeds the next layer's residual) and `(out, None)` otherwise. Statistics are taken
    in float32 (float64 for float64 inputs); `out` has x's dtype.
    """
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x if residual is None else (x.to(acc) + residual.to(acc)).to(x.dtype)
    hf = h.to(acc)
    out = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc)
    return out.to(x.dtype), (None if residual is None else h)
