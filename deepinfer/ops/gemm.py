"""Matrix ops: `linear` and the MoE experts' `grouped_gemm`, in every weight format DeepSeek ships.

Weight formats (the `fmt` argument; number formats and their (de)quantisers live in `quant.py`):
- "dense": weight in a float dtype, no scale. The product is computed in float32 (float64 for
  float64 activations) whatever the weight's float dtype, and returned in x's dtype.
- "fp8_block": DeepSeek-V3's FP8: weight float8_e4m3fn [N, K] with a float32 multiplier per 128x128
  block, weight_scale [ceil(N/128), ceil(K/128)] (the checkpoint's `weight_scale_inv`). The
  activation is quantised on the fly per token and 128-column group (`quant.quantize_act_fp8`),
  and the product is sum over groups g of x_scale[t, g] * w_scale[n//128, g] * (x_q[t, g] . w_q[n, g]).
- "mxfp4": OCP MX FP4: weight uint8 [N, K/2], two e2m1 codes per byte (even k in the low nibble),
  weight_scale uint8 [N, K/32] e8m0 (2^(s-127)). Activations stay in their dtype (W4A16).
"""

from __future__ import annotations

import torch

from deepinfer.registry import ALLCLOSE, DEFAULT_TOLERANCES, Tolerance, op

FORMATS = ("dense", "fp8_block", "mxfp4")

# Kernels quantise activations to fp8 themselves; one e4m3 rounding step (6%) on an element that a
# kernel rounds the other way is within this budget for K up to 7168.
GEMM_TOLERANCES = {**DEFAULT_TOLERANCES, torch.bfloat16: Tolerance(rtol=2e-2, atol=2e-3)}


@op(
    family="gemm",
    outputs=("out",),
    compare=ALLCLOSE,
    reduction_length=lambda kw: kw["x"].shape[-1],
    formats=FORMATS,
    tolerances=GEMM_TOLERANCES,
)
def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    weight_scale: torch.Tensor | None = None,
    fmt: str = "dense",
) -> torch.Tensor:
    """`out = x @ W^T`: x [T, K], W [N, K] in format `fmt` (see the module doc). Returns [T, N], x's dtype."""
    raise NotImplementedError


def _grouped_gemm_canonicalize(kwargs, outputs):
    raise NotImplementedError


@op(
    family="gemm",
    outputs=("out",),
    compare=ALLCLOSE,
    reduction_length=lambda kw: kw["x"].shape[-1],
    formats=FORMATS,
    tolerances=GEMM_TOLERANCES,
    canonicalize=_grouped_gemm_canonicalize,
)
def grouped_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    expert_offsets: torch.Tensor | None = None,
    masked_m: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    fmt: str = "dense",
) -> torch.Tensor:
    """One GEMM per expert: weight [E, N, K] (fp8_block scale [E, ceil(N/128), ceil(K/128)];
    mxfp4 weight [E, N, K/2], scale [E, N, K/32]). Exactly one layout is given:

    - contiguous (prefill, what `dispatch` produces): x [M, K] with expert e's rows at
      expert_offsets[e]:expert_offsets[e+1] (expert_offsets: [E+1] int32, starting at 0, ending at
      or before M); out [M, N]. Rows past expert_offsets[E] are padding: their output is unspecified.
    - masked (decode, DeepGEMM's layout): x [E, max_m, K] with masked_m [E] int32 valid rows per
      expert; out [E, max_m, N]; rows at or past masked_m[e] are unspecified.
    Returns x's dtype; products as `linear` computes them.
    """
    raise NotImplementedError
