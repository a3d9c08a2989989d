"""Triton kernels: `linear` and `grouped_gemm` in every weight format (dense, fp8_block, mxfp4, mxfp8, mxfp4_a8, fp8_block32).

One GEMM kernel serves both ops and all three formats; constexprs pick the format and the layout:

- LAYOUT 0 (`linear`): one expert, rows 0..M.
- LAYOUT 1 (contiguous `grouped_gemm`): x [M, K], expert e owns rows offsets[e]:offsets[e+1].
  The grid is 1-D over `(cdiv(M, BLOCK_M) + E) * cdiv(N, BLOCK_N)` tiles (an upper bound on the
  row tiles: each expert adds at most one partial tile), derived from shapes only. Each program
  loads the E+1 offsets, turns them into tiles per expert, prefix-sums those (tl.cumsum) and finds
  its own (expert, row block) by counting the prefix sums at or below its tile index; tiles past
  the last expert's exit at once. No prepass launch, no host synchronisation.
- LAYOUT 2 (masked `grouped_gemm`): x [E, max_m, K], masked_m [E]. Grid
  (cdiv(max_m, BLOCK_M), cdiv(N, BLOCK_N), E * SPLIT_K): row blocks vary fastest so programs that
  share an expert's weight tile run together; a program whose rows start at or past masked_m[e]
  exits at once.

Large tiles on SM90+ (tuning entry "tma": True; dense bf16/fp16 and fp8_block) run
`_gemm_tma_kernel`: the same tile mapping, operands through host-side tensor descriptors (TMA,
x seen as [rows, K], the weight as [E*N, K]; a tile reading rows of the next expert, or zeros past
the end, only feeds outputs masked at the store), no split-K. Option "k_pairs" (fp8) runs two
128-K groups per step so one MMA is in flight while the other is promoted. The H200 figures are in
tuning/sm90.py.

Every choice of a launch (tiles, dot dtype, split-K, which kernel) is made once by `plan_gemm`
from shapes, dtypes, strides, the device and its tuning entry, into a `GemmPlan`; `launch_gemm`
quantises the activation and hands the plan to a launcher (`_launch_pointers`, `_launch_tma`).

Tiles are grouped GROUP_M row tiles at a time (L2 reuse of the weight tiles). Decode shapes
(few rows per expert) take the "small" tuning variant: BLOCK_M 16..64, wide BLOCK_K and deep
pipelines so the weight stream keeps HBM busy, and split-K when the (expert, N-block) programs
would not fill the GPU twice over; split-K partials go to a float32 workspace [SPLIT_K, rows, N]
and are summed in a fixed split order (deterministic): by the tile's last program to arrive (an
arrival counter per tile, no second launch: at batch 1 a decode step has ~60 split GEMMs), or by
a second kernel when the tiles outnumber the counters.

Formats:
- dense: both operands converted to one dot dtype: x's dtype when the weight has the same one
  (bf16/fp16 run on the tensor cores), float32 with input_precision="ieee" otherwise (float32
  inputs, mixed dtypes: each x tile widened as it is loaded), so every case meets its tolerance.
  `linear`'s out_dtype only sets the output's dtype (every format: the epilogues and the split-K sum
  store the float32 accumulator in the output's element type), so the MoE router's bf16 x times its
  float32 weight returned in float32 runs the float32 FMA path on x as it is, with no float32 copy of x.
- fp8_block (DeepSeek-V3, DeepGEMM-style): the activation is quantised first by
  `_quant_act_fp8_kernel` (per token and 128-column group, bit-exact with
  `deepinfer.ops.quant.quantize_act_fp8`: tl.math.div_rn for both divisions, RNE cast to e4m3).
  The GEMM then runs BLOCK_K = 128 (one scale group per step): an fp8 x fp8 tl.dot per group into
  a fresh float32 product, scaled by x_scale[row, g] * w_scale[n // 128, g] and added to the
  float32 accumulator (the promotion DeepGEMM does every 128 K). Hopper's fp8 MMA sums with
  reduced precision, fine for bf16/fp16 outputs but not for float32's tolerance (seen on the H200:
  up to 72x the bound): float32 activations take the fp8 values upcast to bf16 (exact) through the
  bf16 MMA, which sums in float32.
  fp8_path=gluon picks another implementation on SM90, the persistent warp-specialised Gluon kernel of
  gemm_fp8_gluon.py (its own registrations; not yet verified on a GPU), which hands the calls it does not
  serve back to this module.
- mxfp4 (W4A16): packed e2m1 weights [N, K/2] with e8m0 scales [N, K/32]. Three paths for bf16/fp16
  activations: the register dequant (MX_MODE 3, below; SM90's), `tl.dot_scaled(x, None, "bf16"|"fp16",
  w, w_scale, "e2m1")` (MX_MODE 1; SM100's: tcgen05 kind::f16 after Triton's upcast), or the in-kernel
  upcast (MX_MODE 0: nibbles -> float32 bit patterns -> times 2^(s-127) -> the dot dtype; x split into
  even and odd columns so the two nibble halves need no interleave), which float32 activations always
  take (exact) and where dot_scaled is missing. `mxfp4_path()` says which path bf16/fp16 take on this
  machine, and the registration note names it; the backend option mxfp4_path=dot_scaled|upcast|register
  (deepinfer_cuda.options) forces one, chosen when the ops are resolved (the forced registrations at
  the end of this module; every path takes fp8_block32 too, register mxfp8 and mxfp4_a8 too). Every path is checked under the
  interpreter. mxfp4_path=gluon picks another implementation on SM90, the warp-specialised Gluon kernel of
  gemm_mxfp4_gluon.py (its own registrations), which hands the calls it does not serve back to this module's register path.
- mxfp8 (W8A8 MX): e4m3 weights [N, K] with e8m0 scales [N, K/32]; the activation is quantised
  first by `_quant_act_mxfp8_kernel` (per token and 32 columns, bit-exact with
  `deepinfer.ops.quant.quantize_act_mxfp8`; integer e4m3 rounding under the interpreter), then
  MX_MODE 2: `tl.dot_scaled(w, w_scale, "e4m3", x^T, x_scale, "e4m3")` with the weight tile as the
  left operand (BLOCK_N rows: tcgen05's block-scaled MMA needs M = 128) and the tokens as N (16 for
  decode), the [BLOCK_N, BLOCK_M] accumulator stored transposed: SM100's path, tcgen05 kind::mxf8f6f4
  block_scale. SM90 takes MX_MODE 3 on the activation's MX FP8 values (below). mxfp4 stays W4A16: the
  block-scaled MMA needs both operands in MX formats, so on SM100 it runs kind::f16 after Triton's
  upcast (docs/backends/cuda.md says what was tried).
- mxfp4_a8 (W4A8 MX): mxfp4's packed e2m1 weights and e8m0 scales, the activation quantised as for
  mxfp8 (same quantiser kernel), then MX_MODE 2 with the packed weight tile as the left operand:
  `tl.dot_scaled(w_e2m1 [BLOCK_N, BLOCK_K/2], w_scale, "e2m1", x^T e4m3, x_scale, "e4m3")`. SM100:
  tcgen05 kind::mxf8f6f4 block_scale (e4m3 x e2m1); SM90: MX_MODE 3. The kernel sees FMT 2 (the mxfp4
  weight layout); tuning entries "mxfp4_a8_small" / "mxfp4_a8_large" (MX_MODE 2).
- fp8_block32 (W8A16, DeepSeek-V4.1's FP8): e4m3 weights [N, K] with one e8m0 byte per 32x32 block,
  scales [ceil(N/32), ceil(K/32)]; x stays in its dtype (no activation quantiser: the op's reference
  is x @ dequantised W^T). The kernel sees FMT 3 (mxfp8's e4m3 weight layout and its dequantisation)
  with WS_ROWS = 32: weight row n reads scale row n // 32, so the 32x32 blocks are mxfp8's per-row
  K groups of 32 with the scale shared by 32 rows; the scale columns run to cdiv(K, 32) (a partial last
  K block). Paths as mxfp4's (W4A16, the same choice by `_mx_mode` and backend option mxfp4_path): SM90
  the register dequant (MX_MODE 3) on x itself; elsewhere tl.dot_scaled(x, None, "bf16"|"fp16", w,
  w_scale, "e4m3") (MX_MODE 1) where Triton has it, else the in-kernel upcast (MX_MODE 0), which float32
  activations always take. Tuning entries "fp8_block32_small" / "_large" and "fp8_block32_reg_small" /
  "_reg_large" (as mxfp8's register tiles: the same e4m3 weight tile and bf16 x; not measured).

MX on SM90: the register dequant path (MX_MODE 3). Hopper has no block-scaled MMA, and Triton's
dot_scaled emulation (and MX_MODE 0) put the upcast weight on wgmma's shared-memory side, with
tokens as M (a 16-token decode tile cannot fill the 64-row wgmma). MX_MODE 3 swaps the operands
as MX_MODE 2 does: acc [BLOCK_N, BLOCK_M], the weight tile is wgmma's A operand, which Hopper takes
from registers, and x^T [BLOCK_K, BLOCK_M] (K-contiguous loads) its shared-memory B operand. Per K
step the weight bytes are loaded K-contiguous ([BLOCK_N, BLOCK_K/2] packed e2m1, or [BLOCK_N,
BLOCK_K] e4m3) and dequantised in registers by bit placement (`_mx_register_tile`): one integer
multiply spreads a byte's two codes into the two halves of a 32-bit word, two masks put the
exponent/mantissa bits on bf16's bits 8:6 and the signs on bit 15, so each half is the bf16 of
the code's value * 2^-126 (code 1 = 0.5 lands on the bf16 subnormal 2^-127; e4m3 likewise, value *
2^-120); one PTX `fma.rn.bf16x2` per word multiplies both halves by 2^(s - 127 + 126 - 64) for the
group's e8m0 byte s (bf16 arithmetic keeps subnormals; triton_kernels' Hopper mxfp4 upcast relies on
the same). The pairs are already in x's K order (low nibble = even k), so the [BLOCK_N, BLOCK_K/2]
words unpack into the [BLOCK_N, BLOCK_K] bf16 tile by join + reshape, which Triton lays out as the
wgmma register operand straight from the shared-memory bytes (no layout conversion). The extra
2^-64 keeps every factor a finite bf16 for s up to 192 (|w| < 2^68; above, the factor is inf) and
the float32 accumulator is multiplied by 2^64 before the store; weights below 2^-62 (s < 66) lose
bits or flush, far below any tolerance. fp16 activations take exact float32 values converted to fp16 (MX_DQ 2); under the
interpreter, whose bf16 arithmetic is integer arithmetic on the bits, the same bits and factors
are multiplied in float32 (MX_DQ 1). mxfp8 and mxfp4_a8 feed the activation's MX FP8 values as
bf16 (`mxfp8_act_values`: the quantiser's rounding, then e4m3 * 2^X, exact in bf16) to the same
kernel (FMT 3: e4m3 weight pairs, FMT 2: e2m1). K strides must be 1 (the launcher makes them so),
so the unit stride is a compile-time fact and the loads vectorise and pipeline. Tuning entries
"<fmt>_reg_small" (decode: 16-token tiles, split-K as for every small variant) and "<fmt>_reg_large"
(prefill: a 256-token tile so that one dequantised weight tile feeds a whole 192-token expert).

float32 dots (and mixed dtypes) keep wide operands in shared memory: `_fit_shared_memory` drops
stages, then halves BLOCK_K, until the buffers fit.

Deviation (interpreter only): Triton's interpreter converts float32 to float8e4nv incorrectly
(truncation that even loses the exponent carry: 7.96 -> 4.0, seen with Triton 3.9 on 2026-11-30),
so under TRITON_INTERPRET=1 the quantiser builds the e4m3 byte with integer arithmetic
(`e4m3_rne_bits`, round to nearest even with subnormals, exactly what the GPU's cvt.rn does).
Also, tl.dot on bf16 returns garbage there: dot operands are upcast to float32
(deepinfer.triton_common.upcast_dot).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer.ops import gemm as gemm_ops
from deepinfer.ops import quant
from deepinfer.triton_common import cdiv, e4m3_rne_bits, interpreting, next_power_of_2, upcast_dot
from deepinfer_cuda.kernels.common import ARRIVALS, Registration, arrival_counters, bf16x3_dot, capability, dot_precision, num_sms, pdl_launch, pdl_prologue
from deepinfer_cuda.options import MXFP4_PATH
from deepinfer_cuda.tuning import config

FP8_GROUP = quant.FP8_BLOCK  # 128: activation group width and weight block edge
MX_GROUP = quant.MX_BLOCK  # 32

# mxfp4_a8: the mxfp4 weight layout, MX_MODE 2; fp8_block32: the mxfp8 weight layout (e4m3 bytes), one scale row per 32 weight rows
_FMT_ID = {"dense": 0, "fp8_block": 1, "mxfp4": 2, "mxfp8": 3, "mxfp4_a8": 2, "fp8_block32": 3}
_MX_FMTS = ("mxfp4", "mxfp8", "mxfp4_a8", "fp8_block32")  # e8m0 scales per 32 along K
_WEIGHT_ONLY_FMTS = ("mxfp4", "fp8_block32")  # W4A16 / W8A16: x stays in its dtype
_SCALE_ROWS = {"fp8_block32": quant.FP8_BLOCK32}  # weight rows per scale row (others: 1)
_MX_UPCAST, _MX_DOT_SCALED, _MX_NATIVE, _MX_REGISTER = 0, 1, 2, 3  # MX_MODE: how an mx weight meets the activations
MXFP4_PATHS = ("dot_scaled", "upcast", "register")  # backend option mxfp4_path's forced paths
_LINEAR, _CONTIGUOUS, _MASKED = 0, 1, 2
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------
# fp8 activation quantiser (per token, per 128-column group)


@triton.jit(do_not_specialize=["R", "inner_rows"])
def _quant_act_fp8_kernel(
    x_ptr, q_ptr, s_ptr,
    R, K, inner_rows,
    stride_xo, stride_xr, stride_qr, stride_sr, stride_sg,
    BLOCK_R: tl.constexpr,
    GROUP: tl.constexpr,
    MANUAL_CVT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """x's row r at (r // inner_rows) * stride_xo + (r % inner_rows) * stride_xr: a [A, B, K] view whose rows
    do not flatten (a transposed one) is read where it lies, the quantised rows written in order. Row r's scale of
    group g at r * stride_sr + g * stride_sg (row-major, or each group's rows contiguous: `quantize_act_fp8`)."""
    pdl_prologue(PDL)
    pid_r = tl.program_id(0)
    g = tl.program_id(1)
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = g * GROUP + tl.arange(0, GROUP)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols < K)[None, :]
    x_rows = (rows // inner_rows) * stride_xo + (rows % inner_rows) * stride_xr
    x = tl.load(x_ptr + x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    amax = tl.maximum(amax, 1e-4)  # float32(1e-4), as the reference clamps
    scale = tl.math.div_rn(amax, 448.0)
    y = tl.math.div_rn(x, scale[:, None])
    q_ptrs = q_ptr + rows[:, None] * stride_qr + cols[None, :]
    if MANUAL_CVT:
        tl.store(q_ptrs, e4m3_rne_bits(y).to(tl.uint8), mask=mask)  # q_ptr is a uint8 view
    else:
        tl.store(q_ptrs, y.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + rows * stride_sr + g * stride_sg, scale, mask=row_ok)


def quantize_act_fp8(x: torch.Tensor, scale_rows_contiguous: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused quantiser, same contract as `deepinfer.ops.quant.quantize_act_fp8` (bit-exact):
    x [..., K] -> (x_fp8 [..., K] float8_e4m3fn, x_scale float32 [..., ceil(K/128)]).

    scale_rows_contiguous: x_scale is a view of a [ceil(K/128), rows] tensor (each group's row scales contiguous,
    DeepGEMM's MN-major activation scales), so that the warps promoting a 128-K group read their rows' scales in
    whole sectors (gemm_fp8_gluon.py); the values are the same."""
    k = x.shape[-1]
    groups = cdiv(k, FP8_GROUP)
    if x.dim() == 3 and k and x.stride(-1) == 1 and x.stride(0) != x.shape[1] * x.stride(1):
        # [A, B, K] whose rows do not flatten (a transposed view: the grouped output projection's heads
        # by group): read in place, two-level row strides, rather than copied first
        x2, inner, stride_outer = x, x.shape[1], x.stride(0)
        rows, stride_row = x.shape[0] * x.shape[1], x.stride(1)
    else:
        x2 = x.reshape(-1, k)
        if k and x2.stride(-1) != 1:
            x2 = x2.contiguous()
        rows = x2.shape[0]
        inner, stride_outer, stride_row = max(rows, 1), 0, x2.stride(0)
    q = torch.empty(rows, k, dtype=quant.FP8_DTYPE, device=x.device)
    if scale_rows_contiguous:
        s = torch.empty(groups, rows, dtype=torch.float32, device=x.device).T
    else:
        s = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows and k:
        block_r, warps = quant_act_tile(rows, config("gemm", "quant_act", x.device))
        manual = interpreting()
        grid = (cdiv(rows, block_r), groups)
        _quant_act_fp8_kernel[grid](
            x2, q.view(torch.uint8) if manual else q, s,
            rows, k, inner,
            stride_outer, stride_row, q.stride(0), s.stride(0), s.stride(1),
            BLOCK_R=block_r, GROUP=FP8_GROUP, MANUAL_CVT=manual,
            num_warps=warps, **pdl_launch(x2.device),
        )
    return q.reshape(*x.shape[:-1], k), s.reshape(*x.shape[:-1], groups)


def quant_act_tile(rows: int, cfg: dict) -> tuple[int, int]:
    """(rows per program, warps) of the fp8 quantiser: the power-of-two bucket of the rows, at most
    the entry's BLOCK_R, and warps for `elems_per_thread` elements each (at most the entry's
    num_warps). A decode row alone is one warp over its 128-column group (4 elements a thread, the
    row maximum in shuffles); a 16-row tile of padding rows would make every thread quantise 16.
    Every output element is its own row's (an exact maximum, IEEE divisions): the tile changes no value."""
    block_r = min(cfg["BLOCK_R"], next_power_of_2(rows))
    warps = max(1, min(cfg["num_warps"], block_r * FP8_GROUP // (32 * cfg.get("elems_per_thread", 8))))
    return block_r, warps


# ---------------------------------------------------------------------------------------------
# MX FP8 activation quantiser (mxfp8: per token and 32 columns)


@triton.jit
def _mx_e4m3_quantise(v, MANUAL_CVT: tl.constexpr):
    """OCP MX FP8 of v [R, G, 32] (float32) per group of 32: (codes int32 [R, G, 32], e8m0 byte
    int32 [R, G]). X = floor(log2 amax) - 8 read from amax's exponent
    bits (byte = X + 127 = biased exponent - 8, at least 0); v * 2^-X is exact; saturate at 448;
    round to nearest even."""
    amax = tl.max(tl.abs(v), axis=2)
    byte = tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 8, 0)
    inv = ((254 - byte) << 23).to(tl.float32, bitcast=True)  # 2^-X, a float32 normal
    y = tl.minimum(tl.maximum(v * inv[:, :, None], -448.0), 448.0)
    if MANUAL_CVT:
        codes = e4m3_rne_bits(y)
    else:
        codes = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    return codes, byte


@triton.jit(do_not_specialize=["R"])
def _quant_act_mxfp8_kernel(
    x_ptr, q_ptr, s_ptr,
    R, K,
    stride_xr, stride_qr, stride_sr,
    BLOCK_R: tl.constexpr,
    GROUPS: tl.constexpr,  # 32-column groups per program
    MANUAL_CVT: tl.constexpr,
    VALUES: tl.constexpr = False,  # store the MX FP8 values themselves (bf16 into q_ptr), no scales
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    pid_r = tl.program_id(0)
    pid_g = tl.program_id(1)
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    groups = pid_g * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * 32 + tl.arange(0, 32)[None, :]  # [GROUPS, 32]
    row_ok = rows < R
    g_ok = groups < K // 32
    mask = row_ok[:, None, None] & g_ok[None, :, None]
    x = tl.load(x_ptr + rows[:, None, None] * stride_xr + cols[None, :, :], mask=mask, other=0.0).to(tl.float32)
    codes, byte = _mx_e4m3_quantise(x, MANUAL_CVT)
    if VALUES:
        # e4m3 bits placed in float32's are the value * 2^-120 (subnormals too); times 2^(byte - 127)
        raw = (((codes & 0x7F) << 20) | ((codes & 0x80) << 24)).to(tl.float32, bitcast=True)
        vals = (raw * 1.329227995784916e36) * _mx_factor(byte)[:, :, None]  # 2^120
        tl.store(q_ptr + rows[:, None, None] * stride_qr + cols[None, :, :], vals.to(tl.bfloat16), mask=mask)
    else:
        tl.store(q_ptr + rows[:, None, None] * stride_qr + cols[None, :, :], codes.to(tl.uint8), mask=mask)
        tl.store(s_ptr + rows[:, None] * stride_sr + groups[None, :], byte.to(tl.uint8), mask=row_ok[:, None] & g_ok[None, :])


def _run_mx_quantiser(x: torch.Tensor, q: torch.Tensor, sc: torch.Tensor | None) -> None:
    """`_quant_act_mxfp8_kernel` over x [rows, K] (unit column stride) into q (and sc; None: the
    values themselves into q, VALUES mode)."""
    rows, k = x.shape
    if rows and k:
        cfg = config("gemm", "quant_act_mx", x.device)
        grid = (cdiv(rows, cfg["BLOCK_R"]), cdiv(k // MX_GROUP, cfg["GROUPS"]))
        _quant_act_mxfp8_kernel[grid](
            x, q, q if sc is None else sc, rows, k, x.stride(0), q.stride(0), 0 if sc is None else sc.stride(0),
            BLOCK_R=cfg["BLOCK_R"], GROUPS=cfg["GROUPS"], MANUAL_CVT=interpreting(), VALUES=sc is None, num_warps=cfg["num_warps"], **pdl_launch(x.device),
        )


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as [rows, K] with a unit column stride."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2.contiguous() if x.shape[-1] and x2.stride(-1) != 1 else x2


def quantize_act_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused quantiser, same contract as `deepinfer.ops.quant.quantize_act_mxfp8` (bit-exact):
    x [..., K] (K a multiple of 32) -> (x_fp8 [..., K] float8_e4m3fn, scale uint8 [..., K/32] e8m0)."""
    k = x.shape[-1]
    x2 = _as_rows(x)
    q = torch.empty(x2.shape[0], k, dtype=torch.uint8, device=x.device)
    sc = torch.empty(x2.shape[0], k // MX_GROUP, dtype=torch.uint8, device=x.device)
    _run_mx_quantiser(x2, q, sc)
    return q.view(quant.FP8_DTYPE).reshape(*x.shape[:-1], k), sc.reshape(*x.shape[:-1], k // MX_GROUP)


def mxfp8_act_values(x: torch.Tensor) -> torch.Tensor:
    """`quant.dequantize_mxfp8(*quant.quantize_act_mxfp8(x))` in one pass, as bfloat16 (exact: an e4m3
    value times a power of two, inside bf16's range): x [..., K] (K a multiple of 32) -> [..., K].
    The register path's activation for mxfp8 and mxfp4_a8 (MX_MODE 3)."""
    x2 = _as_rows(x)
    v = torch.empty(x2.shape, dtype=torch.bfloat16, device=x.device)
    _run_mx_quantiser(x2, v, None)
    return v.reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# The GEMM


@triton.jit
def _mx_factor(s):
    """e8m0 byte (int32) -> float32 2^(s-127); 0 -> 2^-127 (a float32 subnormal), 255 -> NaN."""
    bits = tl.where(s == 0, 0x00400000, s << 23)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_value(c):
    """e2m1 code (int32, 0..15) -> float32 value: sign bit 3, exponent bits 2:1, mantissa bit 0."""
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    bits = bits | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


# MX_MODE 3 (register dequant): weights leave this path as value * 2^-MX_SHIFT (bf16) and the float32
# accumulator is multiplied back by 2^MX_SHIFT, so that one bf16 multiply per pair covers the e8m0 range
# that matters (module doc: "MX on SM90").
MX_SHIFT = tl.constexpr(64)
MX_UNSHIFT = tl.constexpr(2.0**64)


@triton.jit
def _e2m1_bf16_pairs(b):
    """Packed bytes (int32 0..255, two e2m1 codes each) -> int32 words of two raw bfloat16s: the low
    half from the low nibble (even k), the high half from the high nibble, each equal to the code's
    value * 2^-126. The code's exponent and mantissa bits land on bf16's bits 8:6 (exponent field 0..3,
    so code 1 = 0.5 lands on the subnormal 2^-127, a multiply handles it) and its sign on bit 15."""
    a = b * 0x40040  # b << 6 | b << 18 (no overlap): codes' bits 2:0 at 8:6 and 24:22, signs at 9 and 25
    return (a & 0x01C001C0) | ((a << 6) & -0x7FFF8000)  # -0x7FFF8000 = 0x80008000: the signs at 15 and 31


@triton.jit
def _e4m3_bf16_pairs(lo, hi):
    """e4m3 bytes (int32 0..255) of even and odd k -> int32 words of two raw bfloat16s, each the value
    * 2^-120 (exponent and mantissa bits at bf16's 10:4; e4m3 subnormals land on bf16 subnormals)."""
    v = lo | (hi << 16)
    return ((v << 4) & 0x07F007F0) | ((v << 8) & -0x7FFF8000)


@triton.jit
def _bf16_pairs_scaled(words, factor_pairs, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """words * factor_pairs, both int32 [BLOCK_N, BLOCK_K/2] words of two bfloat16s, as one PTX
    bf16x2 multiply each (Triton's own bf16 multiply is scalar and ptxas pairs it with extra byte
    permutes), then unpacked into a [BLOCK_N, BLOCK_K] bf16 tile in k order. -0.0 is the addend so a
    product's zero keeps its sign; subnormal inputs are exact (bf16 arithmetic has no flush to zero)."""
    prod = tl.inline_asm_elementwise(
        "{ .reg .b32 z; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, $1, $2, z; }",
        "=r,r,r", [words, factor_pairs], dtype=tl.int32, is_pure=True, pack=1,
    )
    pairs = tl.join(prod.to(tl.int16), (prod >> 16).to(tl.int16))
    return tl.reshape(pairs, (BLOCK_N, BLOCK_K)).to(tl.bfloat16, bitcast=True)


@triton.jit
def _groups_to_pairs(t, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K/32] per-group values -> [BLOCK_N, BLOCK_K/2], one per k pair."""
    return tl.reshape(tl.broadcast_to(t[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))


@triton.jit
def _groups_to_k(t, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K/32] per-group values -> [BLOCK_N, BLOCK_K], one per k."""
    return tl.reshape(tl.broadcast_to(t[:, :, None], (BLOCK_N, BLOCK_K // 32, 32)), (BLOCK_N, BLOCK_K))


@triton.jit
def _mx_register_tile(w, ws, FMT: tl.constexpr, MX_DQ: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight tile of MX_MODE 3 in registers, k in x's order: [BLOCK_N, BLOCK_K] from the packed
    e2m1 bytes [BLOCK_N, BLOCK_K/2] (FMT 2) or the e4m3 bytes [BLOCK_N, BLOCK_K] (FMT 3) and the e8m0
    bytes ws [BLOCK_N, BLOCK_K/32].

    MX_DQ 0 (GPU, 16-bit bf16 dots): raw bf16 pairs times 2^(s - 127 + RAW - MX_SHIFT) (RAW = 126 for
    e2m1, 120 for e4m3), one bf16x2 multiply per pair: bf16 value * 2^-MX_SHIFT, exact for scales s up
    to 127 + MX_SHIFT + 1 (e2m1) / + 7 (e4m3); beyond that the factor saturates to inf (weights of
    2^65 and more). MX_DQ 1 (interpreter, whose bf16 arithmetic is integer arithmetic on the bits):
    the same bits and factors, multiplied in float32 (the same values). MX_DQ 2 (fp16 activations):
    exact float32 values (no shift), then fp16."""
    s = ws.to(tl.int32)
    if FMT == 2:
        words = _e2m1_bf16_pairs(w.to(tl.int32))
        raw_exp: tl.constexpr = 126
        raw_unit: tl.constexpr = 8.507059173023462e37  # 2^126
    else:
        lo, hi = tl.split(tl.reshape(w.to(tl.uint8, bitcast=True).to(tl.int32), (BLOCK_N, BLOCK_K // 2, 2)))
        words = _e4m3_bf16_pairs(lo, hi)
        raw_exp: tl.constexpr = 120
        raw_unit: tl.constexpr = 1.329227995784916e36  # 2^120
    if MX_DQ == 0:
        # bf16 exponent field of 2^(s - 127 + raw_exp - MX_SHIFT), at most 255 (inf)
        field = tl.minimum(s, 255 - raw_exp + MX_SHIFT) + (raw_exp - MX_SHIFT)
        out = _bf16_pairs_scaled(words, _groups_to_pairs(field * 0x00800080, BLOCK_N, BLOCK_K), BLOCK_N, BLOCK_K)
    else:
        # a bf16's float32 is its bits shifted up by 16 (built so, not converted: the interpreter's bf16
        # conversion flushes subnormals)
        lo = (words << 16).to(tl.float32, bitcast=True)
        hi = (words & -65536).to(tl.float32, bitcast=True)
        raw = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
        if MX_DQ == 1:
            field = tl.minimum(s, 255 - raw_exp + MX_SHIFT) + (raw_exp - MX_SHIFT)
            out = raw * _groups_to_k((field << 23).to(tl.float32, bitcast=True), BLOCK_N, BLOCK_K)
        else:
            # exact: raw * 2^raw_exp is the code's value; _mx_factor keeps e8m0's 0 (2^-127) and 255 (NaN)
            out = ((raw * raw_unit) * _groups_to_k(_mx_factor(s), BLOCK_N, BLOCK_K)).to(tl.float16)
    return out


@triton.jit
def _tile_of_program(
    offs_ptr, mm_ptr, M, N, E, num_m_tiles,
    LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, E_POW2: tl.constexpr,
):
    """This program's tile: (expert, first row, row bound, N block, K split). A program with no
    work gets row_start >= row_end (past masked_m[e], or past the last expert's tiles)."""
    if LAYOUT == 2:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_z = tl.program_id(2)
        e = pid_z // SPLIT_K
        pid_s = pid_z % SPLIT_K
        row_end = tl.load(mm_ptr + e).to(tl.int32)
        row_start = pid_m * BLOCK_M
    else:
        pid = tl.program_id(0)
        pid_s = tl.program_id(1)
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(num_m_tiles - first_m, GROUP_M)
        t = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m
        if LAYOUT == 1:
            idx = tl.arange(0, E_POW2)
            lo = tl.load(offs_ptr + idx, mask=idx < E, other=0).to(tl.int32)
            hi = tl.load(offs_ptr + idx + 1, mask=idx < E, other=0).to(tl.int32)
            tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
            ends = tl.cumsum(tiles, axis=0)  # tile index one past each expert's last tile
            e = tl.sum((ends <= t).to(tl.int32), axis=0)  # E when t is past every expert's tiles
            sel = idx == e
            row_start = tl.sum(tl.where(sel, lo + (t - (ends - tiles)) * BLOCK_M, 0), axis=0)
            row_end = tl.sum(tl.where(sel, hi, 0), axis=0)  # 0 when e == E: no work
        else:
            e = pid * 0
            row_start = t * BLOCK_M
            row_end = M
    return e, row_start, row_end, pid_n, pid_s


@triton.jit(do_not_specialize=["M", "num_m_tiles"])
def _gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, offs_ptr, mm_ptr, final_ptr, arrivals_ptr,
    M, N, K, E, num_m_tiles, iters_per_split,
    stride_xe, stride_xm, stride_xk,
    stride_xse, stride_xsm,
    stride_we, stride_wn, stride_wk,
    stride_wse, stride_wsn, stride_wsk,
    stride_os, stride_oe, stride_om, stride_on,
    FMT: tl.constexpr,  # 0 dense, 1 fp8_block, 2 mxfp4 (and mxfp4_a8 with MX_MODE 2), 3 mxfp8
    LAYOUT: tl.constexpr,  # 0 linear, 1 contiguous, 2 masked
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    E_POW2: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr,  # convert dot operands to float32 (ieee precision)
    DOT_PRECISION: tl.constexpr,
    MX_MODE: tl.constexpr,  # mx formats: 0 in-kernel upcast, 1 dot_scaled(16-bit x), 2 dot_scaled(mx x mx, swapped), 3 register dequant (swapped)
    MX_LHS: tl.constexpr,  # "bf16" | "fp16": dot_scaled's format of x (MX_MODE 1)
    MX_DQ: tl.constexpr,  # MX_MODE 3: how the weight tile is dequantised (_mx_register_tile)
    FP8_VIA_BF16: tl.constexpr,  # fp8 operands upcast to bf16 (exact) for a float32-exact sum
    SCALAR_WS: tl.constexpr,  # the N block lies in one 128-row weight-scale block
    FUSED_REDUCE: tl.constexpr,  # split-K: the tile's last program to arrive sums the partials into final_ptr
    W_DESC: tl.constexpr = False,  # MX_MODE 3, FMT 2: w_ptr is a tensor descriptor of the packed weight as [E*N, K/2] (TMA)
    WS_ROWS: tl.constexpr = 1,  # FMT >= 2: weight rows sharing one scale row (32: fp8_block32's 32x32 blocks)
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    e, row_start, row_end, pid_n, pid_s = _tile_of_program(
        offs_ptr, mm_ptr, M, N, E, num_m_tiles, LAYOUT, BLOCK_M, BLOCK_N, GROUP_M, SPLIT_K, E_POW2
    )
    if row_start >= row_end:
        return

    rows = row_start + tl.arange(0, BLOCK_M)
    rows_c = tl.minimum(rows, row_end - 1).to(tl.int64)  # clamped: loads need no row mask
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_c = tl.minimum(cols, N - 1).to(tl.int64)
    e64 = e.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)

    x_base = x_ptr + e64 * stride_xe + rows_c[:, None] * stride_xm
    if not W_DESC:
        w_base = w_ptr + e64 * stride_we + cols_c[None, :] * stride_wn

    total_iters = tl.cdiv(K, BLOCK_K)
    it0 = pid_s * iters_per_split
    it1 = tl.minimum(it0 + iters_per_split, total_iters)

    if MX_MODE >= 2:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # swapped: weight rows are the MMA's M
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FMT == 1:
        xs_base = xs_ptr + e64 * stride_xse + rows_c * stride_xsm
        ws_base = ws_ptr + e64 * stride_wse + (cols_c // BLOCK_K) * stride_wsn
        ws_tile = ws_ptr + e64 * stride_wse + ((pid_n * BLOCK_N) // BLOCK_K) * stride_wsn  # SCALAR_WS
    if FMT >= 2:
        offs_kp = tl.arange(0, BLOCK_K // 2)
        offs_ks = tl.arange(0, BLOCK_K // 32)
        ws_base = ws_ptr + e64 * stride_wse + (cols_c // WS_ROWS)[:, None] * stride_wsn
        ks_end = tl.cdiv(K, 32)  # scale columns (fp8_block32's last K block may be partial)
    if MX_MODE >= 2 and not W_DESC:
        wt_base = w_ptr + e64 * stride_we + cols_c[:, None] * stride_wn  # [BLOCK_N, *]: K contiguous
    if MX_MODE >= 2:
        xt_off = e64 * stride_xe + rows_c[None, :] * stride_xm  # [*, BLOCK_M]
        xsc_off = e64 * stride_xse + rows_c[:, None] * stride_xsm  # [BLOCK_M, *]

    for it in range(it0, it1):
        k0 = it * BLOCK_K
        kk = k0 + offs_k
        if MX_MODE == 3:
            # Register dequant, swapped (SM90: no block-scaled MMA): the weight tile, loaded K-contiguous,
            # becomes bf16/fp16 in registers (wgmma's A operand) and x^T [BLOCK_K, BLOCK_M] is the
            # shared-memory B operand, so 16-token decode tiles still fill the 64-row wgmma.
            ks = it * (BLOCK_K // 32) + offs_ks
            if FMT == 2:
                kw = it * (BLOCK_K // 2) + offs_kp
                kw_ok = kw < K // 2
            else:
                kw = kk
                kw_ok = kk < K
            # K strides are 1 here (the launcher sees to it): the unit stride is known at compile time
            # whatever the launch specialises, so the loads vectorise and pipeline.
            if W_DESC:
                # TMA: the [BLOCK_N, BLOCK_K/2] tile in one bulk copy (rows past N belong to the next
                # expert or are zero-filled: they only feed outputs masked at the store)
                wt = w_ptr.load([(e * N + pid_n * BLOCK_N).to(tl.int32), it * (BLOCK_K // 2)])
                bs = tl.load(ws_base + ks[None, :])
                xt = tl.load(x_ptr + xt_off + kk[:, None])
            elif EVEN_K:
                wt = tl.load(wt_base + kw[None, :])
                bs = tl.load(ws_base + ks[None, :])
                xt = tl.load(x_ptr + xt_off + kk[:, None])
            else:
                if FMT == 2:
                    wt = tl.load(wt_base + kw[None, :], mask=kw_ok[None, :], other=0)
                else:
                    wt = tl.load(wt_base + kw[None, :], mask=kw_ok[None, :], other=0.0)
                bs = tl.load(ws_base + ks[None, :], mask=(ks < ks_end)[None, :], other=127)
                xt = tl.load(x_ptr + xt_off + kk[:, None], mask=(kk < K)[:, None], other=0.0)
            wv = _mx_register_tile(wt, bs, FMT, MX_DQ, BLOCK_N, BLOCK_K)
            if DOT_F32:
                acc = tl.dot(wv.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(wv, xt, acc)
        elif MX_MODE == 2:
            # Block-scaled MMA (SM100: tcgen05 kind::mxf8f6f4; SM90: Triton upcasts to bf16 and
            # runs wgmma) on MX FP8 activations: the weight tile is the MMA's 128-row side and the
            # tokens its N side, so decode tiles of 16 rows still meet tcgen05's M = 128.
            # FMT 2 here is mxfp4_a8 (packed e2m1 weight, e4m3 x); FMT 3 is mxfp8.
            ks = k0 // 32 + offs_ks
            k_ok = kk < K
            ks_ok = ks < K // 32
            xq = tl.load(x_ptr + xt_off + kk[:, None] * stride_xk, mask=k_ok[:, None], other=0.0)
            xqs = tl.load(xs_ptr + xsc_off + ks[None, :], mask=ks_ok[None, :], other=127)
            bs = tl.load(ws_base + ks[None, :] * stride_wsk, mask=ks_ok[None, :], other=127)
            if FMT == 2:
                kp = k0 // 2 + offs_kp
                wt = tl.load(wt_base + kp[None, :] * stride_wk, mask=(kp < K // 2)[None, :], other=0)
                acc = tl.dot_scaled(wt, bs, "e2m1", xq, xqs, "e4m3", acc)
            else:
                wt = tl.load(wt_base + kk[None, :] * stride_wk, mask=k_ok[None, :], other=0.0)
                acc = tl.dot_scaled(wt, bs, "e4m3", xq, xqs, "e4m3", acc)
        else:
            if EVEN_K:
                a = tl.load(x_base + kk[None, :] * stride_xk)
            else:
                a = tl.load(x_base + kk[None, :] * stride_xk, mask=(kk < K)[None, :], other=0.0)
            if FMT == 0:
                if EVEN_K:
                    b = tl.load(w_base + kk[:, None] * stride_wk)
                else:
                    b = tl.load(w_base + kk[:, None] * stride_wk, mask=(kk < K)[:, None], other=0.0)
                if DOT_F32 and (DOT_PRECISION == "bf16x3" or DOT_PRECISION == "bf16x3_upcast"):  # bfloat16 x, float32 weight
                    acc = bf16x3_dot(a, b, acc, DOT_PRECISION == "bf16x3_upcast")
                else:
                    if DOT_F32:
                        a = a.to(tl.float32)
                        b = b.to(tl.float32)
                    acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            elif FMT == 1:
                if EVEN_K:
                    b = tl.load(w_base + kk[:, None] * stride_wk)
                else:
                    b = tl.load(w_base + kk[:, None] * stride_wk, mask=(kk < K)[:, None], other=0.0)
                a_s = tl.load(xs_base + it)
                if DOT_F32:
                    part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
                elif FP8_VIA_BF16:
                    part = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
                else:
                    part = tl.dot(a, b)
                if SCALAR_WS:
                    acc += part * (a_s * tl.load(ws_tile + it * stride_wsk))[:, None]
                else:
                    acc += part * (a_s[:, None] * tl.load(ws_base + it * stride_wsk)[None, :])
            elif FMT == 2:
                kp = k0 // 2 + offs_kp
                ks = k0 // 32 + offs_ks
                if EVEN_K:
                    bp = tl.load(w_base + kp[:, None] * stride_wk)
                    bs = tl.load(ws_base + ks[None, :] * stride_wsk)
                else:
                    bp = tl.load(w_base + kp[:, None] * stride_wk, mask=(kp < K // 2)[:, None], other=0)
                    bs = tl.load(ws_base + ks[None, :] * stride_wsk, mask=(ks < K // 32)[None, :], other=127)
                if MX_MODE == 1:
                    acc = tl.dot_scaled(a, None, MX_LHS, bp, bs, "e2m1", acc)
                else:
                    codes = bp.to(tl.int32)
                    # Row j of the [BLOCK_K/2, BLOCK_N] nibble tile holds k = 2j (low nibble) and 2j+1
                    # (high), both in scale group j // 16. Rather than interleave the two weight halves,
                    # split x into its even and odd columns and run two dots.
                    f = tl.trans(_mx_factor(bs.to(tl.int32)))  # [BLOCK_K/32, BLOCK_N]
                    f = tl.reshape(tl.broadcast_to(f[:, None, :], (BLOCK_K // 32, 16, BLOCK_N)), (BLOCK_K // 2, BLOCK_N))
                    w_lo = _e2m1_value(codes & 15) * f
                    w_hi = _e2m1_value(codes >> 4) * f
                    a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))
                    if DOT_F32:
                        acc = tl.dot(a_even.to(tl.float32), w_lo, acc, input_precision="ieee")
                        acc = tl.dot(a_odd.to(tl.float32), w_hi, acc, input_precision="ieee")
                    else:
                        acc = tl.dot(a_even, w_lo.to(a.dtype), acc)
                        acc = tl.dot(a_odd, w_hi.to(a.dtype), acc)
            else:  # FMT 3, mxfp8 / fp8_block32: [BLOCK_K, BLOCK_N] e4m3 and [BLOCK_N, BLOCK_K/32] e8m0
                ks = k0 // 32 + offs_ks
                if EVEN_K:
                    b = tl.load(w_base + kk[:, None] * stride_wk)
                    bs = tl.load(ws_base + ks[None, :] * stride_wsk)
                else:
                    b = tl.load(w_base + kk[:, None] * stride_wk, mask=(kk < K)[:, None], other=0.0)
                    bs = tl.load(ws_base + ks[None, :] * stride_wsk, mask=(ks < ks_end)[None, :], other=127)
                if MX_MODE == 1:
                    acc = tl.dot_scaled(a, None, MX_LHS, b, bs, "e4m3", acc)
                else:
                    f = tl.trans(_mx_factor(bs.to(tl.int32)))  # [BLOCK_K/32, BLOCK_N]
                    f = tl.reshape(tl.broadcast_to(f[:, None, :], (BLOCK_K // 32, 32, BLOCK_N)), (BLOCK_K, BLOCK_N))
                    wv = b.to(tl.float32) * f
                    if DOT_F32:
                        acc = tl.dot(a.to(tl.float32), wv, acc, input_precision="ieee")
                    else:
                        acc = tl.dot(a, wv.to(a.dtype), acc)

    if MX_MODE == 3 and MX_DQ < 2:
        acc = acc * MX_UNSHIFT  # the weights came shifted by 2^-MX_SHIFT (_mx_register_tile)
    if MX_MODE >= 2:  # acc is [BLOCK_N, BLOCK_M]
        out_mask = (cols < N)[:, None] & (rows < row_end)[None, :]
        out_offs = e64 * stride_oe + rows.to(tl.int64)[None, :] * stride_om + cols[:, None] * stride_on
    else:
        out_mask = (rows < row_end)[:, None] & (cols < N)[None, :]
        out_offs = e64 * stride_oe + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
    out_ptrs = out_ptr + out_offs
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptrs + pid_s * stride_os, acc, mask=out_mask)
        if FUSED_REDUCE:
            # The tile's split programs count their arrivals; the last one sums every partial in split
            # order (as _split_k_reduce_kernel does: the same bits, whichever program that is) and
            # resets the counter for the next launch. The barrier puts this program's stores before
            # its release; partials are read from L2 (.cg): other SMs wrote them.
            tl.debug_barrier()
            if LAYOUT == 2:
                tile = (e * tl.num_programs(1) + pid_n) * tl.num_programs(0) + tl.program_id(0)
            else:
                tile = tl.program_id(0)
            counter = arrivals_ptr + tile
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                tl.store(counter, 0)
                total = tl.load(out_ptrs, mask=out_mask, other=0.0, cache_modifier=".cg")
                for s in range(1, SPLIT_K):
                    total += tl.load(out_ptrs + s * stride_os, mask=out_mask, other=0.0, cache_modifier=".cg")
                tl.store(final_ptr + out_offs, total.to(final_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _tma_step(acc, it, x_desc, w_desc, x_row, w_row, xs_base, ws_base, ws_tile, stride_wsk,
              FMT: tl.constexpr, BLOCK_K: tl.constexpr, SCALAR_WS: tl.constexpr):
    a = x_desc.load([x_row, it * BLOCK_K])
    b = w_desc.load([w_row, it * BLOCK_K])
    if FMT == 0:
        acc = tl.dot(a, b.T, acc)
    else:
        a_s = tl.load(xs_base + it)
        if SCALAR_WS:
            acc += tl.dot(a, b.T) * (a_s * tl.load(ws_tile + it * stride_wsk))[:, None]
        else:
            acc += tl.dot(a, b.T) * (a_s[:, None] * tl.load(ws_base + it * stride_wsk)[None, :])
    return acc


@triton.jit(do_not_specialize=["M", "num_m_tiles", "MAX_M"])
def _gemm_tma_kernel(
    x_desc, xs_ptr, w_desc, ws_ptr, out_ptr, offs_ptr, mm_ptr,
    M, N, K, E, num_m_tiles, MAX_M,
    stride_xse, stride_xsm,
    stride_wse, stride_wsn, stride_wsk,
    stride_oe, stride_om, stride_on,
    FMT: tl.constexpr,  # 0 dense (16-bit, same dtype), 1 fp8_block
    LAYOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_POW2: tl.constexpr,
    SCALAR_WS: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    K_PAIRS: tl.constexpr,  # fp8 with SCALAR_WS only
    PDL: tl.constexpr = False,
):
    """The large-tile variant for SM90+: operands through tensor descriptors (TMA loads, zero fill
    past the tensor), no split-K. x is seen as [rows, K] (masked: [E * max_m, K]), the weight as
    [E * N, K]; rows or weight rows a tile reads beyond its expert only feed outputs that are
    masked at the store."""
    pdl_prologue(PDL)
    e, row_start, row_end, pid_n, pid_s = _tile_of_program(
        offs_ptr, mm_ptr, M, N, E, num_m_tiles, LAYOUT, BLOCK_M, BLOCK_N, GROUP_M, 1, E_POW2
    )
    if row_start >= row_end:
        return
    e64 = e.to(tl.int64)
    x_row = row_start
    if LAYOUT == 2:
        x_row = e * MAX_M + row_start
    w_row = e * N + pid_n * BLOCK_N
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FMT == 1:
        rows_c = tl.minimum(rows, row_end - 1).to(tl.int64)
        cols_c = tl.minimum(cols, N - 1).to(tl.int64)
        xs_base = xs_ptr + e64 * stride_xse + rows_c * stride_xsm
        ws_base = ws_ptr + e64 * stride_wse + (cols_c // BLOCK_K) * stride_wsn
        ws_tile = ws_ptr + e64 * stride_wse + ((pid_n * BLOCK_N) // BLOCK_K) * stride_wsn
    else:
        xs_base = xs_ptr
        ws_base = ws_ptr
        ws_tile = ws_ptr
    if FMT == 1 and K_PAIRS:
        # two scale groups per step: both MMAs can be in flight while the first is promoted
        groups = tl.cdiv(K, BLOCK_K)
        for it in range(0, tl.cdiv(groups, 2)):
            g0 = 2 * it
            g1 = g0 + 1
            p0 = tl.dot(x_desc.load([x_row, g0 * BLOCK_K]), w_desc.load([w_row, g0 * BLOCK_K]).T)
            p1 = tl.dot(x_desc.load([x_row, g1 * BLOCK_K]), w_desc.load([w_row, g1 * BLOCK_K]).T)
            has1 = g1 < groups
            s0 = tl.load(xs_base + g0) * tl.load(ws_tile + g0 * stride_wsk)
            s1 = tl.load(xs_base + g1, mask=has1 & (rows_c >= 0), other=0.0) * tl.load(ws_tile + g1 * stride_wsk, mask=has1, other=0.0)
            acc += p0 * s0[:, None]
            acc += p1 * s1[:, None]
    elif WARP_SPEC:
        for it in tl.range(0, tl.cdiv(K, BLOCK_K), warp_specialize=True):
            acc = _tma_step(acc, it, x_desc, w_desc, x_row, w_row, xs_base, ws_base, ws_tile, stride_wsk, FMT, BLOCK_K, SCALAR_WS)
    else:
        for it in range(0, tl.cdiv(K, BLOCK_K)):
            acc = _tma_step(acc, it, x_desc, w_desc, x_row, w_row, xs_base, ws_base, ws_tile, stride_wsk, FMT, BLOCK_K, SCALAR_WS)
    out_mask = (rows < row_end)[:, None] & (cols < N)[None, :]
    out_ptrs = out_ptr + e64 * stride_oe + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["numel"])
def _split_k_reduce_kernel(ws_ptr, out_ptr, numel, stride_s, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in range(1, SPLIT_K):
        acc += tl.load(ws_ptr + s * stride_s + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Choices made from shapes and the device only


def _mxfp4_dot_scaled_default() -> bool:
    """Whether bf16/fp16 activations take tl.dot_scaled on this machine (else the upcast path): the
    path of backend option mxfp4_path=auto."""
    if not hasattr(tl, "dot_scaled"):
        return False
    if interpreting():
        return True  # the interpreter implements dot_scaled (Triton 3.9), exactly
    try:
        return torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (9, 0)
    except Exception:  # noqa: BLE001 - no usable device: the upcast path
        return False


MXFP4_DOT_SCALED = _mxfp4_dot_scaled_default()
# The path mxfp4_path=auto takes ("dot_scaled", "upcast" or "register"); None: chosen per device by
# `_mx_mode`. Benchmarks set it to time each path (deepinfer_cuda.bench.gemm).
MXFP4_AUTO_PATH: str | None = None


def _register_dequant_device(x: torch.Tensor) -> bool:
    """SM90 (Hopper): no block-scaled MMA, and Triton's dot_scaled emulation is slow there, so MX
    weights are dequantised in registers (MX_MODE 3). SM100 keeps tl.dot_scaled (native)."""
    return capability(x.device)[0] == 9


def _mx_mode(fmt: str, x: torch.Tensor, mx_path: str | None = None) -> int:
    """How an mx weight meets x.

    mxfp4 (W4A16) and fp8_block32 (W8A16, the same choice) with bf16/fp16 x: "register" (MX_MODE 3: e2m1 -> bf16 in registers, weight tile as
    wgmma's register operand), "dot_scaled" (x as bf16/fp16: on SM100 Triton upcasts the e2m1 side and
    runs kind::f16, tcgen05's block-scaled MMA taking only fp8/fp6/fp4 operands) or "upcast" (MX_MODE
    0); auto: register on SM90, else dot_scaled where Triton has it. float32 x: always the upcast (exact).
    mxfp8 (W8A8) and mxfp4_a8 (W4A8): x quantised to MX FP8; "register" (SM90's auto: x's MX FP8 values
    as bf16, the weight dequantised in registers, MX_MODE 3) or tl.dot_scaled on both MX operands
    (MX_MODE 2; native block-scaled MMA on SM100). mx_path: a path forced (backend option mxfp4_path,
    benchmarks, tests); None: auto."""
    if fmt in ("mxfp8", "mxfp4_a8"):
        if mx_path == "register" or (mx_path is None and _register_dequant_device(x)):
            return _MX_REGISTER
        if not hasattr(tl, "dot_scaled"):
            raise RuntimeError(f"{fmt} GEMM needs tl.dot_scaled, missing in Triton {triton.__version__}")
        return _MX_NATIVE
    if fmt not in _WEIGHT_ONLY_FMTS or x.dtype not in (torch.bfloat16, torch.float16):
        return _MX_UPCAST
    path = mx_path or MXFP4_AUTO_PATH
    if path is None:
        path = "register" if _register_dequant_device(x) else ("dot_scaled" if MXFP4_DOT_SCALED else "upcast")
    return {"register": _MX_REGISTER, "dot_scaled": _MX_DOT_SCALED, "upcast": _MX_UPCAST}[path]


def mxfp4_path() -> str:
    """What mxfp4 with bf16/fp16 activations runs on this machine (mxfp4_path=auto)."""
    try:
        sm90 = not interpreting() and torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] == 9
    except Exception:  # noqa: BLE001 - no usable device
        sm90 = False
    if sm90:
        return "e2m1 dequantised in registers, weight tile as wgmma's register operand (SM90)"
    return "tl.dot_scaled" if MXFP4_DOT_SCALED else "in-kernel e2m1 upcast"


# Formats with a <fmt>_medium entry for 65-256 rows per expert (large decode batches): there the prefill tile (fp8_block's
# 128 x 128) leaves 2 x N/128 programs, so the planner splits K and loses the TMA kernel; the H100's batch-256 V4-Flash
# step spent 2.26 ms in its dense fp8 projections so (0.8 GB, 0.35 TB/s; docs/performance.md).
_MEDIUM_FMTS = ("fp8_block",)
MEDIUM_ROWS = 256


def _variant(fmt: str, rows_per_expert: float, mx_mode: int | None = None) -> str:
    """The tuning entry: <fmt>_small (<= 64 rows per expert: decode), <fmt>_medium (<= MEDIUM_ROWS, the formats of
    _MEDIUM_FMTS) or <fmt>_large; the register dequant path (MX_MODE 3) has its own, <fmt>_reg_small / _large
    (mxfp4_a8 takes mxfp4's)."""
    size = "small" if rows_per_expert <= 64 else "medium" if rows_per_expert <= MEDIUM_ROWS and fmt in _MEDIUM_FMTS else "large"
    if mx_mode == _MX_REGISTER:
        return f"{fmt if fmt in ('mxfp8', 'fp8_block32') else 'mxfp4'}_reg_{size}"
    return f"{fmt}_{size}"


# Formats whose large (prefill) tiles may have an entry of their own for a short K: <fmt>_large_short_k, taken for
# K <= SHORT_K where the device's table has one (else <fmt>_large). A 1024-deep K (DeepSeek-V4's q_lora_rank: wq_b and the
# indexer's wq_b) is 8 steps of 128: each tile's pipeline fill and its epilogue are a large part of its time, so the
# tile that suits K 4096-8192 may not suit it.
_SHORT_K_FMTS = ("fp8_block",)
SHORT_K = 1024


def _shape_entry(fmt: str, variant: str, k: int, device) -> dict:
    """The tuning entry of `variant` (`_variant`), or its short-K entry (`_SHORT_K_FMTS`) where the table has one."""
    if variant == f"{fmt}_large" and fmt in _SHORT_K_FMTS and k <= SHORT_K:
        with contextlib.suppress(KeyError):  # no short-K entry for this device: the large one serves
            return config("gemm", f"{variant}_short_k", device)
    return config("gemm", variant, device)


def _invariant_config(fmt: str, mx_mode: int | None, device) -> dict:
    """Deterministic mode's one entry for every row count: the table's <fmt>_invariant where one
    was measured (its tiles must serve batch 1 and batch 256 alike), else the decode entry."""
    if mx_mode != _MX_REGISTER:
        with contextlib.suppress(KeyError):  # no entry measured for this format
            return config("gemm", f"{fmt}_invariant", device)
    return config("gemm", _variant(fmt, 0, mx_mode), device)


SHARED_MEMORY_BUDGET = 200 * 1024  # bytes of pipeline buffers; SM90/SM100 have 227 KiB per block


def _fit_shared_memory(fmt, x, weight, dot_f32, block_m, block_n, block_k, num_stages, x_bytes=None):
    """Fewer stages, then a narrower K block, until the operand buffers fit (float32 dots
    and mixed dtypes keep wide operands in shared memory). x_bytes: x's element size as the kernel
    reads it, where that is not x's (the register path's bf16 MX FP8 values)."""
    a_bytes = 4 if dot_f32 else (1 if fmt == "fp8_block" else (x_bytes or x.element_size()))
    b_per_k = {"dense": 4 if dot_f32 else weight.element_size(), "fp8_block": 4 if dot_f32 else 1,
               "mxfp4": 0.5, "mxfp8": 1, "mxfp4_a8": 0.5, "fp8_block32": 1}[fmt]  # fmt: skip
    min_k = FP8_GROUP if fmt == "fp8_block" else (2 * MX_GROUP if fmt in _MX_FMTS else 16)

    def need(bk, st):
        return st * (block_m * bk * a_bytes + bk * block_n * b_per_k)

    while need(block_k, num_stages) > SHARED_MEMORY_BUDGET and (num_stages > 2 or block_k > min_k):
        if num_stages > 2:
            num_stages -= 1
        else:
            block_k //= 2
    return block_k, num_stages


def _use_tma(cfg: dict, fmt: str, x: torch.Tensor, weight: torch.Tensor, k: int, split: int) -> bool:
    """Tensor descriptors (TMA) for the large tiles on SM90+: 16-byte aligned rows and bases."""
    if not cfg.get("tma") or split != 1 or interpreting() or capability(x.device) < (9, 0) or _TensorDescriptor is None:
        return False
    if fmt == "dense" and not (x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    if fmt not in ("dense", "fp8_block") or (fmt == "fp8_block" and x.dtype == torch.float32):
        return False  # (float32 activations with fp8 weights take the bf16 MMA: pointer kernel)
    if fmt == "dense" and not (x.is_contiguous() and x.data_ptr() % 16 == 0):
        return False
    return (k * weight.element_size()) % 16 == 0 and weight.is_contiguous() and weight.data_ptr() % 16 == 0


def _use_weight_descriptor(cfg: dict, fmt: str, x: torch.Tensor, weight: torch.Tensor, k: int, block_k: int) -> bool:
    """The register path's packed e2m1 weight tiles through TMA (tuning entry "w_tma"; SM90+): whole K
    steps, the weight viewable as [E*N, K/2] with 16-byte aligned rows and base. On the H100 the expert
    GEMMs of V4-Flash's decode read 10-12% faster so (docs/performance.md)."""
    if not cfg.get("w_tma") or fmt not in ("mxfp4", "mxfp4_a8") or interpreting() or _TensorDescriptor is None:
        return False
    if capability(x.device) < (9, 0) or k % block_k:
        return False
    row_bytes = k // 2
    return weight.is_contiguous() and row_bytes % 16 == 0 and weight.data_ptr() % 16 == 0


try:
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # older Triton: the pointer kernel serves
    _TensorDescriptor = None


@dataclass(frozen=True)
class GemmPlan:
    """Every choice of one GEMM launch; `plan_gemm` makes it, the launchers only apply it."""

    fmt: str
    layout: int  # _LINEAR, _CONTIGUOUS or _MASKED
    experts: int  # 1 for linear
    n: int
    k: int
    max_m: int  # masked: rows per expert of x [E, max_m, K]; else 0
    rows_total: int  # rows of x (masked: E * max_m)
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    mx_mode: int  # _MX_UPCAST, _MX_DOT_SCALED, _MX_NATIVE or _MX_REGISTER
    mx_lhs: str  # dot_scaled's format of x (MX_MODE 1): "bf16" | "fp16"
    mx_dq: int  # MX_MODE 3: the weight dequantisation (_mx_register_tile's MX_DQ)
    dot_f32: bool  # dot operands converted to float32 (ieee, or tf32x3: `f32_dot_precision`)
    fp8_via_bf16: bool  # fp8 operands upcast to bf16 (exact) for a float32-exact sum
    num_m_tiles: int  # row tiles on the grid (contiguous: an upper bound, min(row tiles + E, rows))
    num_n: int
    split: int  # split-K factor; 1: none
    iters_per_split: int
    tma: bool  # `_gemm_tma_kernel` (tensor descriptors), else `_gemm_kernel` (pointers)
    k_pairs: bool  # tma fp8: two 128-K groups per step
    warp_specialize: bool  # tma: tl.range(warp_specialize=True)
    fused_reduce: bool  # split-K partials summed by the tile's last program (arrival counters), not a second kernel
    f32_precision: str = "ieee"  # with dot_f32: tl.dot's input_precision (`f32_dot_precision`)
    w_desc: bool = False  # MX_MODE 3 mxfp4: the packed weight tiles through a tensor descriptor (TMA) in `_gemm_kernel`

    @property
    def m_arg(self) -> int:
        """The kernels' M: rows of x, or max_m for the masked layout."""
        return self.max_m if self.layout == _MASKED else self.rows_total

    @property
    def scalar_ws(self) -> bool:
        """An N block lies inside one 128-row weight-scale block."""
        return FP8_GROUP % self.block_n == 0


_FUSED_REDUCE_ELEMS_PER_THREAD = 64  # accumulator elements per thread up to which split-K sums in-kernel


def row_buckets(x: torch.Tensor, weight: torch.Tensor, layout: int) -> tuple[int, int, int, int, float]:
    """(experts, N, masked max_m or 0, rows in all, rows per expert of the power-of-two bucket): what a
    launch's tiles are chosen from (plan_gemm's docstring: why the bucket, not the exact count)."""
    experts = weight.shape[0] if layout != _LINEAR else 1
    n = weight.shape[-2]
    if layout == _MASKED:
        return experts, n, x.shape[1], experts * x.shape[1], x.shape[1]
    return experts, n, 0, x.shape[0], next_power_of_2(x.shape[0]) / max(experts, 1)


def f32_dot_precision(x: torch.Tensor, weight: torch.Tensor, fmt: str) -> str:
    """input_precision of a float32 dot. A 16-bit x against a float32 dense weight (the MoE routers' logits, linear's
    out_dtype) runs on the tensor cores instead of CUDA-core FMAs ("ieee": the routers' logits at prefill sizes are a
    GEMM of T x 4096 x 256): bfloat16 x as "bf16x3" (common.bf16x3_dot: the weight split into three bfloat16 parts,
    exact products at the bfloat16 rate, as hc_pre's mix), float16 x as "tf32x3" (x is exact in tf32; x * w_hi + x *
    w_lo, w split into two tf32 parts: products within about 2^-22 of float32's). On an H100, 2026-12-07, the 8-layer
    V4-Flash prefill of 8 x 8192 tokens took 1.051 s with "ieee" and 0.999 s with "tf32x3" (the routers' GEMM then 33
    ms of it), and `deepinfer conformance --backend cuda --op linear --op grouped_gemm` passed. float32 x keeps "ieee"
    (its own low bits would be dropped); the interpreter's dot is numpy's either way."""
    if fmt == "dense" and weight.dtype == torch.float32 and not interpreting():
        if x.dtype == torch.bfloat16:
            return "bf16x3"
        if x.dtype == torch.float16:
            return "tf32x3"
    return "ieee"


def plan_gemm(x: torch.Tensor, weight: torch.Tensor, fmt: str, layout: int, mx_path: str | None = None, invariant: bool = False) -> GemmPlan:
    """The launch's tiles, dot dtype, split-K and kernel, from the tensors' shapes, dtypes, strides
    and alignment, the device and its tuning entry only (never their values: no host sync).
    For non-empty products (rows, N and K > 0). mx_path: an mx path forced (`_mx_mode`).

    invariant (deterministic mode): nothing depends on the number of rows: one tuning entry
    (`_invariant_config`) with its full BLOCK_M, and a split-K chosen as if there were one row tile, so every
    output element is summed over K in the same tiles and the same split order whatever the batch.

    Otherwise the choices that become constexprs (tuning entry, BLOCK_M, split-K, the fused reduce) are
    made for the row count rounded up to a power of two: every row count of one power-of-two bucket
    compiles the same kernel, so a start-up warm-up of power-of-two steps compiles every kernel
    that serving meets (a split-K chosen from the exact count compiled new variants mid-serving: on
    the H200, seconds of stalled tokens). Only the grid and the row arguments see the exact count."""
    device = x.device
    k = x.shape[-1]
    experts, n, max_m, rows_total, rows_per_expert = row_buckets(x, weight, layout)

    mx_mode = _mx_mode(fmt, x, mx_path)
    register = mx_mode == _MX_REGISTER
    # The register path's x is bf16/fp16 (mxfp8 and mxfp4_a8: x's MX FP8 values as bf16, exact).
    x_dtype = x.dtype if (not register or fmt in _WEIGHT_ONLY_FMTS) else torch.bfloat16
    # float32 dense products (the MoE router) sum with FMAs, not the MMA: tiles of their own
    tuned = "dense_f32" if fmt == "dense" and torch.float32 in (x.dtype, weight.dtype) else fmt
    cfg = _invariant_config(tuned, mx_mode, device) if invariant else _shape_entry(tuned, _variant(tuned, rows_per_expert, mx_mode), k, device)
    if invariant:
        block_m = cfg["BLOCK_M"]
    else:
        block_m = max(16, min(cfg["BLOCK_M"], next_power_of_2(int(rows_per_expert) if rows_per_expert >= 1 else 1)))
    block_n = cfg["BLOCK_N"]
    if fmt == "fp8_block":
        block_k = FP8_GROUP  # one scale group per step
    elif fmt in _MX_FMTS:
        block_k = max(2 * MX_GROUP, min(cfg["BLOCK_K"], next_power_of_2(k)))
    else:
        block_k = max(16, min(cfg["BLOCK_K"], next_power_of_2(k)))

    # The dot dtype.
    upcast = upcast_dot()
    if fmt == "dense":
        dot_f32 = upcast or x.dtype == torch.float32 or weight.dtype != x.dtype
    elif fmt == "fp8_block":
        dot_f32 = upcast
    else:
        dot_f32 = upcast or x_dtype == torch.float32
    # MX_MODE 3's weight dequantisation (_mx_register_tile): 0 bf16 pairs (PTX), 1 the same values in
    # float32 (the interpreter's bf16 arithmetic is wrong), 2 exact float32 then fp16 (fp16 x).
    mx_dq = (1 if interpreting() else 0) if x_dtype == torch.bfloat16 else 2
    # Hopper's fp8 MMA sums with reduced precision (DeepSeek-V3 report: ~14 bits), invisible in a
    # bf16/fp16 output but not within float32's tolerance: float32 activations take the fp8 values
    # upcast to bf16 (exact) through the bf16 MMA, which sums in float32.
    fp8_via_bf16 = fmt == "fp8_block" and x.dtype == torch.float32 and not dot_f32
    num_stages = cfg["num_stages"]
    if not interpreting():
        block_k, num_stages = _fit_shared_memory(fmt, x, weight, dot_f32, block_m, block_n, block_k, num_stages,
                                                 x_bytes=2 if register else None)

    # Tiles, grid and split-K.
    num_n = cdiv(n, block_n)
    if layout == _MASKED:
        num_m_tiles = plan_m_tiles = cdiv(rows_per_expert, block_m)
        programs = experts * num_m_tiles * num_n
    else:
        num_m_tiles = cdiv(rows_total, block_m)
        plan_rows = next_power_of_2(rows_total)  # the bucket's row tiles decide (docstring)
        plan_m_tiles = cdiv(plan_rows, block_m)
        if layout == _CONTIGUOUS:
            # each expert's last tile may be partial (+ E), and an expert with rows takes no more tiles
            # than rows: at decode (6 rows over 64 experts) the grid is 6 tiles, not 65 mostly empty ones
            num_m_tiles = min(num_m_tiles + experts, rows_total)
            plan_m_tiles = min(plan_m_tiles + experts, plan_rows)
        programs = cdiv(plan_rows, block_m) * num_n
    if invariant:
        programs = num_n * experts  # as if every expert had one row tile: the split follows N and K only
    total_iters = cdiv(k, block_k)
    split = 1
    target = cfg.get("split_target_per_sm", 2) * num_sms(device)
    if programs < target and cfg.get("split_k", True):
        split = min(cdiv(target, programs), max(1, total_iters // cfg.get("min_iters_per_split", 4)), 16)
    iters_per_split = cdiv(total_iters, split)
    split = cdiv(total_iters, iters_per_split)

    tma = _use_tma(cfg, fmt, x, weight, k, split)
    k_pairs = tma and bool(cfg.get("k_pairs", False)) and fmt == "fp8_block" and FP8_GROUP % block_n == 0
    if k_pairs:
        num_stages = min(num_stages, 3)  # four loads per stage
    # The partials sum in-kernel (one launch) when the tiles fit the counters and the tile is a decode
    # tile: a large one's epilogue (its sum and a partial in registers, 128 per thread each for 128x256
    # over 8 warps) made the H200's batch-256 decode GEMMs 27% slower; those keep the second kernel.
    tiles = plan_m_tiles * num_n * (experts if layout == _MASKED else 1)  # >= the grid's: the bucket's counters suffice
    small_tile = block_m * block_n <= _FUSED_REDUCE_ELEMS_PER_THREAD * 32 * cfg["num_warps"]
    fused_reduce = split > 1 and small_tile and tiles <= ARRIVALS
    w_desc = register and _use_weight_descriptor(cfg, fmt, x, weight, k, block_k)
    return GemmPlan(
        fmt=fmt, layout=layout, experts=experts, n=n, k=k, max_m=max_m, rows_total=rows_total,
        block_m=block_m, block_n=block_n, block_k=block_k, group_m=cfg.get("GROUP_M", 8),
        num_warps=cfg["num_warps"], num_stages=num_stages,
        mx_mode=mx_mode, mx_lhs="fp16" if x.dtype == torch.float16 else "bf16", mx_dq=mx_dq,
        dot_f32=dot_f32, fp8_via_bf16=fp8_via_bf16, f32_precision=f32_dot_precision(x, weight, fmt),
        num_m_tiles=num_m_tiles, num_n=num_n, split=split, iters_per_split=iters_per_split,
        tma=tma, k_pairs=k_pairs, warp_specialize=bool(cfg.get("warp_specialize", False)), fused_reduce=fused_reduce,
        w_desc=w_desc,
    )


def launch_gemm(
    x, weight, weight_scale, fmt, layout, *, offsets=None, masked_m=None, prequantised=None, mx_path=None, invariant=False, out_dtype=None,
) -> torch.Tensor:
    """out = the product for x in `layout`: plan, quantise the activation (fp8_block, MX FP8), launch.

    prequantised: (x_q, x_scale) already made by the activation quantiser (benchmarks of the GEMM
    alone; the register path of mxfp8 / mxfp4_a8: (mxfp8_act_values(x), None)).
    mx_path: the mx path forced (backend option mxfp4_path, `_mx_mode`; None: this machine's).
    invariant: the batch-invariant plan (`plan_gemm`).
    out_dtype: the output's dtype (None: x's): the kernels store the float32 accumulator in the output's dtype."""
    n = weight.shape[-2]
    out_dtype = out_dtype or x.dtype
    if layout == _MASKED:
        out = torch.empty(weight.shape[0], x.shape[1], n, dtype=out_dtype, device=x.device)
    else:
        out = torch.empty(x.shape[0], n, dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    if x.shape[-1] == 0:
        return out.zero_()
    plan = plan_gemm(x, weight, fmt, layout, mx_path, invariant)
    if layout == _MASKED and x.stride(0) < x.stride(1) and plan.split == 1:
        # x [E, max_m, K] lies expert-minor (a transposed view): the output follows, [E, max_m, N] over
        # [max_m, E, N] memory, so that a caller's transpose back is a view (a split-K's partials and their
        # sum address the output as they address the partials: those keep the plain layout)
        out = torch.empty(x.shape[1], weight.shape[0], n, dtype=out_dtype, device=x.device).transpose(0, 1)
    xq, xs = x, None
    if fmt == "fp8_block":
        xq, xs = prequantised if prequantised is not None else quantize_act_fp8(x)
    elif plan.mx_mode == _MX_NATIVE:
        xq, xs = prequantised if prequantised is not None else quantize_act_mxfp8(x)
    elif plan.mx_mode == _MX_REGISTER:
        if fmt not in _WEIGHT_ONLY_FMTS:
            xq, xs = prequantised if prequantised is not None else (mxfp8_act_values(x), None)
        xq, weight, weight_scale = (t if t.stride(-1) == 1 else t.contiguous() for t in (xq, weight, weight_scale))  # unit K strides
    launch = _launch_tma if plan.tma else _launch_pointers
    launch(plan, xq, xs, weight, weight_scale, out, offsets if offsets is not None else weight, masked_m if masked_m is not None else weight)
    return out


def _scale_strides(plan: GemmPlan, xs: torch.Tensor | None, weight_scale: torch.Tensor | None) -> tuple[tuple, tuple]:
    """(x_scale's expert and row strides, weight_scale's expert, row and column strides); zeros where absent."""
    if plan.layout == _MASKED:
        xs_strides = (xs.stride(0), xs.stride(1)) if xs is not None else (0, 0)
    else:
        xs_strides = (0, xs.stride(0)) if xs is not None else (0, 0)
    if weight_scale is None:
        ws_strides = (0, 0, 0)
    else:
        ws_strides = (0, *weight_scale.stride()) if plan.layout == _LINEAR else tuple(weight_scale.stride())
    return xs_strides, ws_strides


def _out_strides(plan: GemmPlan, out: torch.Tensor) -> tuple:
    """(expert, row, column) strides of an output or a split-K partial."""
    return tuple(out.stride()) if plan.layout == _MASKED else (0, *out.stride())


def _launch_pointers(plan, xq, xs, weight, weight_scale, out, offs_arg, mm_arg) -> None:
    """`_gemm_kernel` (pointer loads, every format, split-K partials summed in-kernel or by a second kernel).
    offs_arg / mm_arg: expert_offsets / masked_m, or any device tensor where the layout has none."""
    p = plan
    x_strides = tuple(xq.stride()) if p.layout == _MASKED else (0, *xq.stride())
    w_strides = (0, *weight.stride()) if p.layout == _LINEAR else tuple(weight.stride())
    xs_strides, ws_strides = _scale_strides(p, xs, weight_scale)
    if p.split > 1:
        dest = torch.empty(p.split, *out.shape, dtype=torch.float32, device=out.device)
        stride_os = dest.stride(0)
        dest_strides = tuple(dest.stride()[1:]) if p.layout == _MASKED else (0, *dest.stride()[1:])
    else:
        dest, stride_os, dest_strides = out, 0, _out_strides(p, out)
    grid = (p.num_m_tiles, p.num_n, p.experts * p.split) if p.layout == _MASKED else (p.num_m_tiles * p.num_n, p.split)
    arrivals = arrival_counters(out.device, "gemm") if p.fused_reduce else out
    w_arg = weight
    if p.w_desc:  # [E*N, K/2] packed bytes, one [BLOCK_N, BLOCK_K/2] box per K step
        packed = weight.reshape(-1, p.k // 2)
        w_arg = _TensorDescriptor(packed, list(packed.shape), list(packed.stride()), [p.block_n, p.block_k // 2])
    _gemm_kernel[grid](
        xq, xs if xs is not None else xq, w_arg, weight_scale if weight_scale is not None else weight, dest,
        offs_arg, mm_arg, out, arrivals,
        p.m_arg, p.n, p.k, p.experts, p.num_m_tiles, p.iters_per_split,
        *x_strides,
        *xs_strides,
        *w_strides,
        *ws_strides,
        stride_os, *dest_strides,
        FMT=_FMT_ID[p.fmt], LAYOUT=p.layout,
        BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m,
        SPLIT_K=p.split, E_POW2=next_power_of_2(p.experts), EVEN_K=p.k % p.block_k == 0,
        DOT_F32=p.dot_f32, DOT_PRECISION=p.f32_precision if p.dot_f32 else dot_precision(False),
        MX_MODE=p.mx_mode, MX_LHS=p.mx_lhs, MX_DQ=p.mx_dq,
        FP8_VIA_BF16=p.fp8_via_bf16, SCALAR_WS=p.scalar_ws, FUSED_REDUCE=p.fused_reduce, W_DESC=p.w_desc,
        WS_ROWS=_SCALE_ROWS.get(p.fmt, 1),
        num_warps=p.num_warps, num_stages=p.num_stages, **pdl_launch(xq.device),
    )
    if p.split > 1 and not p.fused_reduce:
        numel = out.numel()
        block = 1024
        _split_k_reduce_kernel[(cdiv(numel, block),)](dest, out, numel, stride_os, SPLIT_K=p.split, BLOCK=block, num_warps=4, **pdl_launch(dest.device))


def _launch_tma(plan, xq, xs, weight, weight_scale, out, offs_arg, mm_arg) -> None:
    """`_gemm_tma_kernel`: x as [rows, K] and the weight as [E*N, K] through tensor descriptors."""
    p = plan
    xs_strides, ws_strides = _scale_strides(p, xs, weight_scale)
    x2 = xq.reshape(-1, p.k)
    w2 = weight.reshape(-1, p.k)
    x_desc = _TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [p.block_m, p.block_k])
    w_desc = _TensorDescriptor(w2, list(w2.shape), list(w2.stride()), [p.block_n, p.block_k])
    grid = (p.num_m_tiles, p.num_n, p.experts) if p.layout == _MASKED else (p.num_m_tiles * p.num_n,)
    _gemm_tma_kernel[grid](
        x_desc, xs if xs is not None else xq, w_desc, weight_scale if weight_scale is not None else weight, out,
        offs_arg, mm_arg,
        p.m_arg, p.n, p.k, p.experts, p.num_m_tiles, p.max_m,
        *xs_strides,
        *ws_strides,
        *_out_strides(p, out),
        FMT=_FMT_ID[p.fmt], LAYOUT=p.layout,
        BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m,
        E_POW2=next_power_of_2(p.experts), SCALAR_WS=p.scalar_ws, WARP_SPEC=p.warp_specialize,
        K_PAIRS=p.k_pairs,
        num_warps=p.num_warps, num_stages=p.num_stages, **pdl_launch(out.device),
    )


def _check_dtype(x: torch.Tensor) -> None:
    if x.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"the cuda gemm kernels take bfloat16/float16/float32 activations, got {x.dtype}")


def _weight_operands(weight: torch.Tensor, weight_scale: torch.Tensor | None, fmt: str):
    if fmt == "fp8_block" and weight_scale is not None and weight_scale.dtype != torch.float32:
        weight_scale = weight_scale.float()
    return weight, weight_scale


# ---------------------------------------------------------------------------------------------
# The ops


def _gemm_ops(mx_path: str | None = None, invariant: bool = False):
    """The `linear` and `grouped_gemm` kernels. mx_path: the mxfp4 path with bf16/fp16 activations
    (backend option mxfp4_path=dot_scaled|upcast|register; "register" also takes mxfp8 and mxfp4_a8
    through the register dequant); None: this machine's default. float32 activations with mxfp4
    weights always take the upcast. invariant: the batch-invariant plan (deterministic mode)."""

    def linear(
        x: torch.Tensor, weight: torch.Tensor, *, weight_scale: torch.Tensor | None = None, fmt: str = "dense", out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        gemm_ops.check_linear_args(x, weight, weight_scale, fmt, out_dtype)
        _check_dtype(x)
        weight, weight_scale = _weight_operands(weight, weight_scale, fmt)
        return launch_gemm(x, weight, weight_scale, fmt, _LINEAR, mx_path=mx_path, invariant=invariant, out_dtype=out_dtype)

    def grouped_gemm(
        x: torch.Tensor,
        weight: torch.Tensor,
        *,
        expert_offsets: torch.Tensor | None = None,
        masked_m: torch.Tensor | None = None,
        weight_scale: torch.Tensor | None = None,
        fmt: str = "dense",
    ) -> torch.Tensor:
        experts = gemm_ops.check_grouped_args(x, weight, weight_scale, fmt, expert_offsets, masked_m)
        _check_dtype(x)
        weight, weight_scale = _weight_operands(weight, weight_scale, fmt)
        if expert_offsets is not None:
            gemm_ops.check_index_vector("expert_offsets", expert_offsets, experts + 1, x.device)
            return launch_gemm(x, weight, weight_scale, fmt, _CONTIGUOUS, offsets=expert_offsets, mx_path=mx_path, invariant=invariant)
        gemm_ops.check_index_vector("masked_m", masked_m, experts, x.device)
        return launch_gemm(x, weight, weight_scale, fmt, _MASKED, masked_m=masked_m, mx_path=mx_path, invariant=invariant)

    suffix = (f"_mxfp4_{mx_path}" if mx_path is not None else "") + ("_invariant" if invariant else "")
    linear.__qualname__, grouped_gemm.__qualname__ = f"linear{suffix}", f"grouped_gemm{suffix}"
    return linear, grouped_gemm


linear, grouped_gemm = _gemm_ops()


_NOTE = (
    "Triton: one tiled GEMM (grouped tiles, split-K for decode shapes) for dense, fp8_block "
    "(fused per-token-group quantiser, fp8 tl.dot per 128-K group, DeepGEMM-style promotion) and "
    f"mxfp4 (bf16/fp16 activations: {mxfp4_path()}; float32 activations: in-kernel e2m1 upcast); "
    "mxfp8 and mxfp4_a8 (MX FP8 activation quantiser; SM100: tl.dot_scaled on both MX operands with the weight "
    "tile as the MMA's 128-row side, block-scaled tcgen05; SM90: the MX FP8 values as bf16 and the weight "
    "dequantised in registers); fp8_block32 (W8A16, e8m0 per 32x32 block: mxfp8's e4m3 weight path with a "
    "scale row per 32 weight rows, x unquantised, on mxfp4's path)"
)


def _forced_by(path: str):
    """`when` of a forced mxfp4 path: the backend option mxfp4_path names it."""
    return lambda ctx: MXFP4_PATH.value(ctx) == path


def _dot_scaled_unusable(ctx) -> str | None:
    if hasattr(tl, "dot_scaled"):
        return None
    return f"backend option mxfp4_path=dot_scaled, but Triton {triton.__version__} has no tl.dot_scaled (mxfp4_path=auto or upcast works)"


_INVARIANT_NOTE = (
    f"Triton: the tiled GEMM (mxfp4 with bf16/fp16 activations: {mxfp4_path()}) with one plan for every row count "
    "(decode tiles, split-K from N and K only)"
)
FORMATS = ("dense", "fp8_block", "mxfp4", "mxfp8", "mxfp4_a8", "fp8_block32")
REGISTRATIONS = [
    Registration(op="linear", fn=linear, formats=FORMATS, dtypes=_KERNEL_DTYPES, note=_NOTE),
    Registration(
        op="grouped_gemm", fn=grouped_gemm, formats=FORMATS, dtypes=_KERNEL_DTYPES,
        note=_NOTE + "; contiguous layout: tile->expert map computed in-kernel from expert_offsets, no host sync",
    ),
]
# Deterministic mode's kernels: below the default ones by priority, chosen only when only batch-invariant ones may be.
for _op, _fn in zip(("linear", "grouped_gemm"), _gemm_ops(invariant=True)):
    REGISTRATIONS.append(Registration(op=_op, fn=_fn, formats=FORMATS, dtypes=_KERNEL_DTYPES,
                                      priority=-1, batch_invariant=True, note=_INVARIANT_NOTE))  # fmt: skip
# mxfp4_path=dot_scaled|upcast|register: the same kernels with the mxfp4 path fixed, chosen at resolve
# (above the default registrations by priority; never chosen under mxfp4_path=auto).
_FORCED_NOTES = {
    "dot_scaled": "tl.dot_scaled",
    "upcast": "in-kernel e2m1 upcast",
    "register": "e2m1 dequantised in registers, weight tile as the MMA's register operand (mxfp8, mxfp4_a8 and fp8_block32 too)",
}
for _path in MXFP4_PATHS:
    for _invariant in (False, True):
        for _op, _fn in zip(("linear", "grouped_gemm"), _gemm_ops(mx_path=_path, invariant=_invariant)):
            REGISTRATIONS.append(Registration(
                op=_op, fn=_fn, formats=("mxfp4", "mxfp8", "mxfp4_a8", "fp8_block32") if _path == "register" else _WEIGHT_ONLY_FMTS,
                dtypes=_KERNEL_DTYPES, when=_forced_by(_path), priority=0 if _invariant else 1, batch_invariant=_invariant,
                unusable=_dot_scaled_unusable if _path == "dot_scaled" else None,
                note=f"Triton: the GEMM above, mxfp4 (and fp8_block32) with bf16/fp16 activations by {_FORCED_NOTES[_path]} (mxfp4_path={_path})"
                     + (", one plan for every row count" if _invariant else ""),
            ))  # fmt: skip
