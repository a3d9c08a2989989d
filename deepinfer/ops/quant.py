"""Number formats of DeepSeek's weights and activations, as plain functions (not ops).

- FP8 e4m3 with 128x128 block scales for weights and 1x128 (per token, per 128-column group)
  scales for activations, as DeepSeek-V3 ships and runs it. A scale is a float32 *multiplier*:
  value = fp8 * scale (the checkpoint calls the weight's `weight_scale_inv`).
- OCP MX FP4: e2m1 elements, two per byte, with one e8m0 power-of-two scale per 32 values.
- OCP MX FP8: e4m3 elements (float8_e4m3fn), with one e8m0 power-of-two scale per 32 values.
- FP8 e4m3 with one e8m0 power-of-two scale per 32x32 block, as DeepSeek-V4.1 ships its dense
  projections (`weight_block_size [32, 32]`, `scale_fmt "ue8m0"`).

Quantisers compute in float32 (the MX FP4 one in float64, where every step is exact) whatever
the input's precision; dequantisers compute in float32 (float64 when asked for float64) and cast.
Functions take any leading dimensions: [..., N, K] for weights, [..., K] for activations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_BLOCK = 128  # weight blocks are 128x128, activation groups 1x128
AMAX_FLOOR = 1e-4  # amax is clamped to this, so an all-zero block gets a finite, non-zero scale

MX_BLOCK = 32  # values sharing one e8m0 scale
E8M0_BIAS = 127
E2M1_EMAX = 2  # exponent of e2m1's largest binade (4 and 6)
E4M3_EMAX = 8  # exponent of e4m3's largest binade (256..448)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7; bit 3 is the sign
# Halfway points between neighbouring magnitudes; a tie goes to the even code (round half to even).
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand_groups(scale: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """Repeat each scale FP8_BLOCK times along `dim` and cut to `size` (the partial edge block)."""
    return scale.repeat_interleave(FP8_BLOCK, dim=dim).narrow(dim, 0, size)


# ---------------------------------------------------------------------------------------------
# FP8 e4m3, 128x128 weight blocks


def _block_amax(w: torch.Tensor, block: int) -> torch.Tensor:
    """The amax of |w| [..., N, K] per block x block tile -> [..., ceil(N/block), ceil(K/block)]; edge tiles cover only
    the real values."""
    n, k = w.shape[-2:]
    nb, kb = _ceil_div(n, block), _ceil_div(k, block)
    padded = F.pad(w.abs(), (0, kb * block - k, 0, nb * block - n))  # zeros leave amax alone
    return padded.unflatten(-1, (kb, block)).unflatten(-3, (nb, block)).amax(dim=(-3, -1))


def quantize_weight_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise w [..., N, K] to e4m3 with one float32 scale per 128x128 block.

    In float32: scale[i, j] = max(amax(|block i, j|), 1e-4) / 448 and
    w_fp8 = (w / scale).to(float8_e4m3fn) (round to nearest even). Blocks at the bottom and right
    edges are partial when N or K is not a multiple of 128; their amax covers only the real values.
    Returns (w_fp8 [..., N, K], scale float32 [..., ceil(N/128), ceil(K/128)]).
    """
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"quantize_weight_fp8_block takes a floating weight [..., N, K], got {tuple(w.shape)} {w.dtype}")
    n, k = w.shape[-2:]
    wf = w.float()
    amax = _block_amax(wf, FP8_BLOCK)
    scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    full_scale = _expand_groups(_expand_groups(scale, n, -2), k, -1)
    return (wf / full_scale).to(FP8_DTYPE), scale


def dequantize_weight_fp8_block(w_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """w = w_fp8 * scale of its 128x128 block, computed in float32 (float64 for float64) and cast to dtype.

    w_fp8: [..., N, K] float8_e4m3fn; scale: [..., ceil(N/128), ceil(K/128)] float.
    """
    n, k = w_fp8.shape[-2:]
    want = (*w_fp8.shape[:-2], _ceil_div(n, FP8_BLOCK), _ceil_div(k, FP8_BLOCK))
    if w_fp8.dtype != FP8_DTYPE:
        raise ValueError(f"fp8 weight must be float8_e4m3fn, got {w_fp8.dtype}")
    if tuple(scale.shape) != want or not scale.is_floating_point():
        raise ValueError(f"fp8 weight {tuple(w_fp8.shape)} needs a float scale of shape {want}, got {tuple(scale.shape)} {scale.dtype}")
    acc = _compute_dtype(dtype)
    full_scale = _expand_groups(_expand_groups(scale.to(acc), n, -2), k, -1)
    return (w_fp8.to(acc) * full_scale).to(dtype)


# ---------------------------------------------------------------------------------------------
# FP8 e4m3, activations per token and 128-column group


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations x [..., K] per token and per group of 128 consecutive columns.

    The definition, which every backend's kernel reproduces bit for bit:
      1. xf = x converted to float32 (exact for bf16/fp16/fp32 inputs; a float64 golden run
         feeds upcast bf16/fp32 values, so this step recovers the kernel's inputs exactly);
      2. per group g (columns 128g .. min(128g+128, K) - 1; the last group may be partial):
         amax = max |xf| over the group, then amax = max(amax, float32(1e-4));
      3. scale = amax / 448, one IEEE float32 division, correctly rounded (in Triton use
         tl.math.div_rn, not the approximate `/`; do not multiply by a reciprocal);
      4. q = (xf / scale).to(float8_e4m3fn): again a correctly rounded float32 division, then the
         round-to-nearest-even cast (subnormals kept). |xf / scale| < 464, so nothing overflows.
    Returns (x_fp8 [..., K] float8_e4m3fn, x_scale float32 [..., ceil(K/128)]).
    """
    if x.dim() < 1 or not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise ValueError(f"quantize_act_fp8 takes floating activations [..., K], got {tuple(x.shape)} {x.dtype}")
    k = x.shape[-1]
    groups = _ceil_div(k, FP8_BLOCK)
    xf = x.float()
    padded = F.pad(xf.abs(), (0, groups * FP8_BLOCK - k))
    amax = padded.unflatten(-1, (groups, FP8_BLOCK)).amax(dim=-1)
    scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    return (xf / _expand_groups(scale, k, -1)).to(FP8_DTYPE), scale


def dequantize_act_fp8(x_fp8: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x = x_fp8 * x_scale of its 128-column group, in float32 (float64 for float64), cast to dtype."""
    want = (*x_fp8.shape[:-1], _ceil_div(x_fp8.shape[-1], FP8_BLOCK))
    if x_fp8.dtype != FP8_DTYPE or tuple(x_scale.shape) != want:
        raise ValueError(f"fp8 activations {tuple(x_fp8.shape)} {x_fp8.dtype} need float8_e4m3fn and a scale {want}, got {tuple(x_scale.shape)}")
    acc = _compute_dtype(dtype)
    return (x_fp8.to(acc) * _expand_groups(x_scale.to(acc), x_fp8.shape[-1], -1)).to(dtype)


# ---------------------------------------------------------------------------------------------
# OCP MX FP4: e2m1 elements, e8m0 scale per 32 values


def quantize_weight_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise w [..., N, K] (K a multiple of 32) to MX FP4, as the OCP MX spec does.

    Per block of 32 consecutive K values: the shared exponent is
    X = floor(log2(amax)) - 2 (2 = emax of e2m1), clamped to [-127, 127] (X = -127 for an
    all-zero block), stored as the e8m0 byte X + 127. Each value v becomes the e2m1 code nearest
    to v / 2^X (ties to the even code), magnitudes above 6 saturating to 6; the code's bit 3 is
    the sign of v. Codes k and k+1 (k even) share a byte: k in the low nibble, k+1 in the high.
    Returns (packed uint8 [..., N, K/2], scale uint8 [..., N, K/32]).
    """
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"quantize_weight_mxfp4 takes a floating weight [..., N, K], got {tuple(w.shape)} {w.dtype}")
    k = w.shape[-1]
    if k % MX_BLOCK:
        raise ValueError(f"mxfp4 needs K to be a multiple of {MX_BLOCK}, got K={k}")
    blocks = w.double().unflatten(-1, (k // MX_BLOCK, MX_BLOCK))  # float64: every step below is exact
    amax = blocks.abs().amax(dim=-1)
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent with m in [0.5, 1): floor(log2) = exponent - 1
    shared = torch.where(amax > 0, exponent - 1 - E2M1_EMAX, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = blocks / torch.exp2(shared.double()).unsqueeze(-1)
    codes = _nearest_e2m1(scaled.abs().clamp(max=E2M1_VALUES[-1])) | torch.where(scaled < 0, 8, 0).to(torch.uint8)
    codes = codes.flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (shared + E8M0_BIAS).to(torch.uint8)


def _nearest_e2m1(magnitude: torch.Tensor) -> torch.Tensor:
    """The e2m1 magnitude code (0..7) nearest to each value in [0, 6], ties to the even code."""
    midpoints = torch.tensor(E2M1_MIDPOINTS, dtype=magnitude.dtype, device=magnitude.device)
    code = torch.bucketize(magnitude, midpoints)  # number of midpoints strictly below the value
    # On a tie the value equals midpoints[code]: the lower code won; move up when it is odd.
    tie = magnitude == midpoints[code.clamp(max=len(E2M1_MIDPOINTS) - 1)]
    return torch.where(tie & (code % 2 == 1), code + 1, code).to(torch.uint8)


def e2m1_codes(packed: torch.Tensor) -> torch.Tensor:
    """Unpack uint8 [..., K/2] into the e2m1 codes [..., K]: low nibble first (even k)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """w = e2m1(code) * 2^(scale - 127), computed in float32 (float64 for float64), cast to dtype.

    packed: [..., N, K/2] uint8 (even k in the low nibble); scale: [..., N, K/32] uint8 e8m0
    (255 is e8m0's NaN). Returns [..., N, K].
    """
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"mxfp4 weight and scale must be uint8, got {packed.dtype} and {scale.dtype}")
    k = 2 * packed.shape[-1]
    want = (*packed.shape[:-1], k // MX_BLOCK)
    if k % MX_BLOCK or tuple(scale.shape) != want:
        raise ValueError(f"mxfp4 weight {tuple(packed.shape)} (K={k}, a multiple of {MX_BLOCK}) needs a scale {want}, got {tuple(scale.shape)}")
    acc = _compute_dtype(dtype)
    codes = e2m1_codes(packed).long()
    table = torch.tensor(E2M1_VALUES, dtype=acc, device=packed.device)
    values = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).to(acc)
    factor = torch.exp2(scale.to(acc) - E8M0_BIAS).masked_fill(scale == 255, float("nan"))
    return (values.unflatten(-1, (k // MX_BLOCK, MX_BLOCK)) * factor.unsqueeze(-1)).flatten(-2).to(dtype)


# ---------------------------------------------------------------------------------------------
# OCP MX FP8: e4m3 elements, e8m0 scale per 32 values


def _mx_shared_exponent(amax: torch.Tensor, emax: int) -> torch.Tensor:
    """OCP MX shared exponent X = floor(log2(amax)) - emax, clamped to [-127, 127]; -127 for amax 0."""
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent with m in [0.5, 1): floor(log2) = exponent - 1
    return torch.where(amax > 0, exponent - 1 - emax, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)


def quantize_weight_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise w [..., N, K] (K a multiple of 32) to MX FP8 (e4m3), as the OCP MX spec does.

    Per block of 32 consecutive K values: X = floor(log2(amax)) - 8 (8 = emax of e4m3), clamped to
    [-127, 127] (X = -127 for an all-zero block), stored as the e8m0 byte X + 127. Each value v
    becomes e4m3(v / 2^X), round to nearest even, saturating at +-448 (v / 2^X lies in [256, 512)
    for the block's largest value). Computed in float32 (w converted first; dividing by a power of
    two is exact there), then one round-to-nearest-even cast.
    Returns (w_fp8 float8_e4m3fn [..., N, K], scale uint8 [..., N, K/32]).
    """
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"quantize_weight_mxfp8 takes a floating weight [..., N, K], got {tuple(w.shape)} {w.dtype}")
    k = w.shape[-1]
    if k % MX_BLOCK:
        raise ValueError(f"mxfp8 needs K to be a multiple of {MX_BLOCK}, got K={k}")
    blocks = w.float().unflatten(-1, (k // MX_BLOCK, MX_BLOCK))
    shared = _mx_shared_exponent(blocks.abs().amax(dim=-1), E4M3_EMAX)
    scaled = (blocks / torch.exp2(shared.float()).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return scaled.to(FP8_DTYPE).flatten(-2), (shared + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp8(w_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """w = e4m3 value * 2^(scale - 127), computed in float32 (float64 for float64), cast to dtype.

    w_fp8: [..., N, K] float8_e4m3fn; scale: [..., N, K/32] uint8 e8m0 (255 is e8m0's NaN). Returns [..., N, K].
    """
    if w_fp8.dtype != FP8_DTYPE or scale.dtype != torch.uint8:
        raise ValueError(f"mxfp8 weight must be float8_e4m3fn and its scale uint8, got {w_fp8.dtype} and {scale.dtype}")
    k = w_fp8.shape[-1]
    want = (*w_fp8.shape[:-1], k // MX_BLOCK)
    if k % MX_BLOCK or tuple(scale.shape) != want:
        raise ValueError(f"mxfp8 weight {tuple(w_fp8.shape)} (K a multiple of {MX_BLOCK}) needs a scale {want}, got {tuple(scale.shape)}")
    acc = _compute_dtype(dtype)
    factor = torch.exp2(scale.to(acc) - E8M0_BIAS).masked_fill(scale == 255, float("nan"))
    values = w_fp8.to(acc).unflatten(-1, (k // MX_BLOCK, MX_BLOCK))
    return (values * factor.unsqueeze(-1)).flatten(-2).to(dtype)


def quantize_act_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations x [..., K] (K a multiple of 32) to MX FP8 per token and 32 columns.

    The definition, which every backend reproduces bit for bit: xf = x converted to float32; per
    group of 32 columns X = floor(log2(amax)) - 8, clamped to [-127, 127] (-127 for an all-zero
    group); q = e4m3(clamp(xf / 2^X, -448, 448)), round to nearest even (the division by a
    power of two is exact). Returns (x_fp8 [..., K] float8_e4m3fn, scale uint8 [..., K/32] e8m0).
    """
    if x.dim() < 1 or not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise ValueError(f"quantize_act_mxfp8 takes floating activations [..., K], got {tuple(x.shape)} {x.dtype}")
    k = x.shape[-1]
    if k % MX_BLOCK:
        raise ValueError(f"mxfp8 needs K to be a multiple of {MX_BLOCK}, got K={k}")
    blocks = x.float().unflatten(-1, (k // MX_BLOCK, MX_BLOCK))
    shared = _mx_shared_exponent(blocks.abs().amax(dim=-1), E4M3_EMAX)
    scaled = (blocks / torch.exp2(shared.float()).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return scaled.to(FP8_DTYPE).flatten(-2), (shared + E8M0_BIAS).to(torch.uint8)


# ---------------------------------------------------------------------------------------------
# FP8 e4m3, 32x32 weight blocks with e8m0 scales (DeepSeek-V4.1's dense projections)

FP8_BLOCK32 = 32  # weight blocks are 32x32, one e8m0 byte each


def _expand_blocks32(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[..., ceil(N/32), ceil(K/32)] per-block values -> [..., N, K] (partial edge blocks cut)."""
    rows = scale.repeat_interleave(FP8_BLOCK32, dim=-2).narrow(-2, 0, n)
    return rows.repeat_interleave(FP8_BLOCK32, dim=-1).narrow(-1, 0, k)


def quantize_weight_fp8_block32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise w [..., N, K] to e4m3 with one e8m0 (power-of-two) scale per 32x32 block, the way
    DeepSeek's ue8m0 scales round: scale = 2^ceil(log2(max(amax, 1e-4) / 448)) (the float32 amax / 448
    rounded up to a power of two unless it is one), so |w| / scale <= 448 and nothing saturates;
    w_fp8 = (w / scale).to(float8_e4m3fn) (round to nearest even; dividing by a power of two is exact).
    Blocks at the bottom and right edges are partial when N or K is not a multiple of 32; their amax
    covers only the real values. Computed in float32.
    Returns (w_fp8 [..., N, K], scale uint8 [..., ceil(N/32), ceil(K/32)], the e8m0 byte exponent + 127).
    """
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"quantize_weight_fp8_block32 takes a floating weight [..., N, K], got {tuple(w.shape)} {w.dtype}")
    n, k = w.shape[-2:]
    wf = w.float()
    amax = _block_amax(wf, FP8_BLOCK32)
    ratio = amax.clamp(min=AMAX_FLOOR) / FP8_MAX  # float32, > 0
    mantissa, exponent = torch.frexp(ratio)  # ratio = m * 2^e, m in [0.5, 1): ceil(log2) = e - 1 if m == 0.5, else e
    shared = (exponent - (mantissa == 0.5).to(exponent.dtype)).clamp(-E8M0_BIAS, E8M0_BIAS)
    q = (wf / _expand_blocks32(torch.exp2(shared.float()), n, k)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE), (shared + E8M0_BIAS).to(torch.uint8)


def dequantize_weight_fp8_block32(w_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """w = e4m3 value * 2^(s - 127) for the e8m0 byte s of its 32x32 block, computed in float32 (float64
    for float64) and cast to dtype (exact in float32; in bfloat16 too, but for values below 2^-133).

    w_fp8: [..., N, K] float8_e4m3fn; scale: [..., ceil(N/32), ceil(K/32)] uint8 (255 is e8m0's NaN).
    """
    n, k = w_fp8.shape[-2:]
    want = (*w_fp8.shape[:-2], _ceil_div(n, FP8_BLOCK32), _ceil_div(k, FP8_BLOCK32))
    if w_fp8.dtype != FP8_DTYPE or scale.dtype != torch.uint8:
        raise ValueError(f"fp8_block32 weight must be float8_e4m3fn and its scale uint8 (e8m0), got {w_fp8.dtype} and {scale.dtype}")
    if tuple(scale.shape) != want:
        raise ValueError(f"fp8_block32 weight {tuple(w_fp8.shape)} needs a scale of shape {want}, got {tuple(scale.shape)}")
    acc = _compute_dtype(dtype)
    factor = torch.exp2(scale.to(acc) - E8M0_BIAS).masked_fill(scale == 255, float("nan"))
    return (w_fp8.to(acc) * _expand_blocks32(factor, n, k)).to(dtype)
