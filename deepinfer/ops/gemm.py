"""Matrix ops: `linear` and the MoE experts' `grouped_gemm`, in every weight format DeepSeek ships.

Weight formats (the `fmt` argument; number formats and their (de)quantisers live in `quant.py`):
- "dense": weight in a float dtype, no scale. The product is computed in float32 (float64 for
  float64 activations) whatever the weight's float dtype, and returned in x's dtype (`linear`: or in
  out_dtype).
- "fp8_block": DeepSeek-V3's FP8: weight float8_e4m3fn [N, K] with a float32 multiplier per 128x128
  block, weight_scale [ceil(N/128), ceil(K/128)] (the checkpoint's `weight_scale_inv`; edge blocks
  are partial when N or K is not a multiple of 128). The activation is quantised on the fly per
  token and 128-column group (`quant.quantize_act_fp8`, bit-exact on every backend, also in the
  float64 golden run), and the product is
  sum over groups g of x_scale[t, g] * w_scale[n//128, g] * (x_q[t, g] . w_q[n, g]).
  The reference computes it as (dequantised x) @ (dequantised W)^T, the same sum regrouped.
- "mxfp4": OCP MX FP4: weight uint8 [N, K/2], two e2m1 codes per byte (even k in the low nibble),
  weight_scale uint8 [N, K/32] e8m0 (2^(s-127)); K a multiple of 32. Activations stay in their
  dtype (W4A16): out = x @ dequantize_mxfp4(W)^T.
- "mxfp8": OCP MX FP8, W8A8: weight float8_e4m3fn [N, K] with e8m0 scales uint8 [N, K/32]
  (2^(s-127)); K a multiple of 32. Like fp8_block, the activation is quantised on the fly, here to
  MX FP8 per token and 32 columns (`quant.quantize_act_mxfp8`, bit-exact on every backend), so
  both operands are MX and block-scaled tensor cores (SM100 tcgen05 kind::mxf8f6f4) take them as
  they are: out = dequantize(quantize_act_mxfp8(x)) @ dequantize_mxfp8(W)^T.
- "mxfp4_a8": OCP MX FP4 weights with MX FP8 activations (W4A8 MX): the weight and its scale exactly
  as "mxfp4" (uint8 [N, K/2] e2m1 pairs, uint8 [N, K/32] e8m0), the activation quantised as for
  "mxfp8" (`quant.quantize_act_mxfp8`, bit-exact), so both operands are MX and the block-scaled
  tensor cores (SM100 tcgen05 kind::mxf8f6f4, e4m3 x e2m1) take them:
  out = dequantize(quantize_act_mxfp8(x)) @ dequantize_mxfp4(W)^T. "mxfp4" stays W4A16; a
  checkpoint's mxfp4 weights serve either format unchanged (the `_a8` suffix names the activations).
- "fp8_block32": DeepSeek-V4.1's FP8 (`weight_block_size [32, 32]`, `scale_fmt "ue8m0"`): weight
  float8_e4m3fn [N, K] with one e8m0 byte per 32x32 block, weight_scale uint8
  [ceil(N/32), ceil(K/32)] (2^(s-127); edge blocks are partial when N or K is not a multiple of 32).
  W8A16: the activation stays in its dtype, out = x @ dequantize_weight_fp8_block32(W)^T. Why not
  quantise x as fp8_block does: V4.1's reference (NeMo Automodel, whose parity runs against
  DeepSeek's code decoded the weights to BF16 on both sides) computes these GEMMs in BF16 from
  dequantised weights, and how DeepSeek's own engine quantises their activations (block shape, which
  inputs) is not known; W8A16 keeps the numbers of a forward that decodes the weights at load (the
  same products: e4m3 * 2^k is exact in bf16) while the weights stay 1 byte each. A kernel dequantises
  the weight tile (e4m3 * 2^(s-127)) where the products need it.

Every product accumulates in float32 (float64 for float64 activations). Quantised weights and
their scales are used as given (a float64 golden run leaves fp8/uint8 tensors untouched).

`linear`'s out_dtype (float16, bfloat16 or float32; default x's dtype) is the dtype that accumulation is
rounded to once: a bfloat16 x times a float32 dense weight (the MoE routers') returned in float32 is the
float32 product of x's exact values, with no float32 copy of x made first (a kernel widens x as it reads it).

Bad shapes, dtypes or formats raise ValueError.
"""

from __future__ import annotations

import torch

from deepinfer.ops import quant
from deepinfer.registry import ALLCLOSE, DEFAULT_TOLERANCES, Tolerance, op

FORMATS = ("dense", "fp8_block", "mxfp4", "mxfp8", "mxfp4_a8", "fp8_block32")
MX_FORMATS = ("mxfp4", "mxfp8", "mxfp4_a8")  # K a multiple of 32, e8m0 scales [N, K/32]
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # `linear`'s out_dtype

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
    result_dtype=lambda kw: kw.get("out_dtype"),
)
def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    weight_scale: torch.Tensor | None = None,
    fmt: str = "dense",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`out = x @ W^T`: x [T, K], W [N, K] in format `fmt` (see the module doc). Returns [T, N] in
    out_dtype (float16, bfloat16 or float32; None: x's dtype), the accumulation rounded to it once.

    weight_scale is required for every format but dense, and must be None for dense.
    """
    check_linear_args(x, weight, weight_scale, fmt, out_dtype)
    acc = _accumulator(x)
    return (_activation_for_product(x, fmt, acc) @ _weight_for_product(weight, weight_scale, fmt, acc).T).to(out_dtype or x.dtype)


def _accumulator(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_activation(x: torch.Tensor, dims: int) -> None:
    if x.dtype not in FLOAT_DTYPES or x.dim() != dims:
        raise ValueError(f"x must be a {dims}-d tensor of {_names(FLOAT_DTYPES)}, got {tuple(x.shape)} {x.dtype}")


def _layout(fmt: str, n: int, k: int) -> tuple[tuple, tuple[int, int], tuple, tuple[int, int] | None]:
    """(weight dtypes, weight shape, scale dtypes, scale shape) of an [N, K] weight stored in `fmt`."""
    if fmt == "dense":
        return FLOAT_DTYPES, (n, k), (), None
    if fmt == "fp8_block":
        blocks = (-(-n // quant.FP8_BLOCK), -(-k // quant.FP8_BLOCK))
        return (quant.FP8_DTYPE,), (n, k), FLOAT_DTYPES, blocks
    if fmt == "mxfp8":
        return (quant.FP8_DTYPE,), (n, k), (torch.uint8,), (n, k // quant.MX_BLOCK)
    if fmt == "fp8_block32":
        return (quant.FP8_DTYPE,), (n, k), (torch.uint8,), (-(-n // quant.FP8_BLOCK32), -(-k // quant.FP8_BLOCK32))
    return (torch.uint8,), (n, k // 2), (torch.uint8,), (n, k // quant.MX_BLOCK)


def _check_weight(weight: torch.Tensor, weight_scale: torch.Tensor | None, fmt: str, k: int, experts: tuple[int, ...]) -> None:
    """weight (and weight_scale) hold an [*experts, N, K] weight in format `fmt`, for K = k."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; formats: {', '.join(FORMATS)}")
    if (fmt == "dense") != (weight_scale is None):
        raise ValueError(f"fmt {fmt!r} {'takes no' if fmt == 'dense' else 'needs a'} weight_scale")
    if fmt in MX_FORMATS and k % quant.MX_BLOCK:
        raise ValueError(f"{fmt} needs K to be a multiple of {quant.MX_BLOCK}, got K={k}")
    if weight.dim() != len(experts) + 2:
        raise ValueError(f"{fmt} weight must have {len(experts) + 2} dims, got {tuple(weight.shape)}")
    weight_dtypes, weight_shape, scale_dtypes, scale_shape = _layout(fmt, weight.shape[-2], k)
    if weight.dtype not in weight_dtypes or tuple(weight.shape) != (*experts, *weight_shape):
        raise ValueError(f"{fmt} weight must be {(*experts, *weight_shape)} of {_names(weight_dtypes)} for K={k}, got {tuple(weight.shape)} {weight.dtype}")
    if weight_scale is not None and (weight_scale.dtype not in scale_dtypes or tuple(weight_scale.shape) != (*experts, *scale_shape)):
        raise ValueError(
            f"{fmt} weight_scale must be {(*experts, *scale_shape)} of {_names(scale_dtypes)}, got {tuple(weight_scale.shape)} {weight_scale.dtype}"
        )


def _names(dtypes: tuple) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)


def _activation_for_product(x: torch.Tensor, fmt: str, acc: torch.dtype) -> torch.Tensor:
    """x as it enters the product, in the accumulation dtype: fp8_block, mxfp8 and mxfp4_a8 quantise it first."""
    if fmt == "fp8_block":
        return quant.dequantize_act_fp8(*quant.quantize_act_fp8(x), dtype=acc)
    if fmt in ("mxfp8", "mxfp4_a8"):
        return quant.dequantize_mxfp8(*quant.quantize_act_mxfp8(x), dtype=acc)
    return x.to(acc)


def _weight_for_product(weight: torch.Tensor, weight_scale: torch.Tensor | None, fmt: str, acc: torch.dtype) -> torch.Tensor:
    """The weight's values [..., N, K] in the accumulation dtype."""
    if fmt == "fp8_block":
        return quant.dequantize_weight_fp8_block(weight, weight_scale, dtype=acc)
    if fmt in ("mxfp4", "mxfp4_a8"):
        return quant.dequantize_mxfp4(weight, weight_scale, dtype=acc)
    if fmt == "mxfp8":
        return quant.dequantize_mxfp8(weight, weight_scale, dtype=acc)
    if fmt == "fp8_block32":
        return quant.dequantize_weight_fp8_block32(weight, weight_scale, dtype=acc)
    return weight.to(acc)


def check_index_vector(name: str, t: torch.Tensor, length: int, device: torch.device | None = None) -> None:
    """An integer vector of `length` (on `device` when given): shape, dtype and device only, so a
    kernel's wrapper can check it without synchronising with the host."""
    if t.dim() != 1 or t.shape[0] != length or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer vector of length {length}, got {tuple(t.shape)} {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def _check_integer_vector(name: str, t: torch.Tensor, length: int) -> list[int]:
    check_index_vector(name, t, length)
    return t.tolist()


def check_linear_args(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, fmt: str, out_dtype: torch.dtype | None = None) -> None:
    """`linear`'s arguments, shapes and dtypes only (no host synchronisation): every backend's check."""
    _check_activation(x, dims=2)
    _check_weight(weight, weight_scale, fmt, k=x.shape[-1], experts=())
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be None (x's dtype) or one of {_names(OUT_DTYPES)}, got {out_dtype}")


def check_grouped_args(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, fmt: str,
    expert_offsets: torch.Tensor | None, masked_m: torch.Tensor | None,
) -> int:
    """`grouped_gemm`'s arguments, shapes and dtypes only (no host synchronisation): one layout, the
    weight, the activation of that layout. Returns the expert count E."""
    if (expert_offsets is None) == (masked_m is None):
        raise ValueError("grouped_gemm takes exactly one of expert_offsets (contiguous layout) and masked_m (masked layout)")
    if weight.dim() != 3:
        raise ValueError(f"grouped_gemm weight must be [E, N, K] (or [E, N, K/2] for mxfp4 and mxfp4_a8), got {tuple(weight.shape)}")
    experts = weight.shape[0]
    _check_activation(x, dims=2 if expert_offsets is not None else 3)
    _check_weight(weight, weight_scale, fmt, k=x.shape[-1], experts=(experts,))
    if masked_m is not None and x.shape[0] != experts:
        raise ValueError(f"masked layout: x must be [E={experts}, max_m, K], got {tuple(x.shape)}")
    return experts


def _specified_rows(kwargs, out: torch.Tensor) -> torch.Tensor:
    """A boolean mask, broadcastable to `out`, of the rows grouped_gemm defines."""
    if kwargs.get("expert_offsets") is not None:
        end = kwargs["expert_offsets"][-1].to(out.device)
        return (torch.arange(out.shape[0], device=out.device) < end).unsqueeze(-1)
    masked_m = kwargs["masked_m"].to(out.device)
    rows = torch.arange(out.shape[1], device=out.device)
    return (rows.unsqueeze(0) < masked_m.unsqueeze(1)).unsqueeze(-1)


def _grouped_gemm_canonicalize(kwargs, outputs):
    """Zero the rows grouped_gemm leaves unspecified (padding past the last offset, rows at or past
    masked_m[e]), so a backend that never writes them compares equal. NaNs there are zeroed too."""
    out = outputs["out"]
    zero = torch.zeros((), dtype=out.dtype, device=out.device)
    return {**outputs, "out": torch.where(_specified_rows(kwargs, out), out, zero)}


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
    mxfp4 / mxfp4_a8 weight [E, N, K/2], scale [E, N, K/32]; mxfp8 weight [E, N, K], scale [E, N, K/32];
    fp8_block32 weight [E, N, K], scale [E, ceil(N/32), ceil(K/32)]). Exactly one layout is given:

    - contiguous (prefill, what `dispatch` produces): x [M, K] with expert e's rows at
      expert_offsets[e]:expert_offsets[e+1] (expert_offsets: [E+1] int32, starting at 0, ending at
      or before M); out [M, N]. Rows past expert_offsets[E] are padding: their output is unspecified.
    - masked (decode, DeepGEMM's layout): x [E, max_m, K] with masked_m [E] int32 valid rows per
      expert; out [E, max_m, N]; rows at or past masked_m[e] are unspecified.
    Returns x's dtype; products as `linear` computes them. Unspecified rows: the reference writes
    zeros, the conformance suite zeroes them on every backend before comparing. Offsets and counts
    may be any integer dtype; the reference checks their values (which syncs with the host).
    """
    experts = check_grouped_args(x, weight, weight_scale, fmt, expert_offsets, masked_m)
    acc = _accumulator(x)
    xs = _activation_for_product(x, fmt, acc)  # per-token quantisation: rows are independent
    ws = _weight_for_product(weight, weight_scale, fmt, acc)
    out = torch.zeros(*x.shape[:-1], weight.shape[1], dtype=acc, device=x.device)
    if expert_offsets is not None:
        bounds = _check_integer_vector("expert_offsets", expert_offsets, experts + 1)
        if bounds[0] != 0 or any(a > b for a, b in zip(bounds, bounds[1:])) or bounds[-1] > x.shape[0]:
            raise ValueError(f"expert_offsets must start at 0, not decrease and end at or before M={x.shape[0]}, got {bounds}")
        for e in range(experts):
            rows = slice(bounds[e], bounds[e + 1])
            out[rows] = xs[rows] @ ws[e].T
    else:
        counts = _check_integer_vector("masked_m", masked_m, experts)
        if any(not 0 <= m <= x.shape[1] for m in counts):
            raise ValueError(f"masked_m values must lie in [0, max_m={x.shape[1]}], got {counts}")
        for e, m in enumerate(counts):
            out[e, :m] = xs[e, :m] @ ws[e].T
    return out.to(x.dtype)
