"""Triton kernels: `linear` and `grouped_gemm` in every weight format (dense, fp8_block, mxfp4, mxfp8, mxfp4_a8).

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
and a second kernel sums them in a fixed order (deterministic, no atomics).

Formats:
- dense: both operands converted to one dot dtype: x's dtype when the weight has the same one
  (bf16/fp16 run on the tensor cores), float32 with input_precision="ieee" otherwise (float32
  inputs, mixed dtypes), so every case meets its tolerance.
- fp8_block (DeepSeek-V3, DeepGEMM-style): the activation is quantised first by
  `_quant_act_fp8_kernel` (per token and 128-column group, bit-exact with
  `deepinfer.ops.quant.quantize_act_fp8`: tl.math.div_rn for both divisions, RNE cast to e4m3).
  The GEMM then runs BLOCK_K = 128 (one scale group per step): an fp8 x fp8 tl.dot per group into
  a fresh float32 product, scaled by x_scale[row, g] * w_scale[n // 128, g] and added to the
  float32 accumulator (the promotion DeepGEMM does every 128 K). Hopper's fp8 MMA sums with
  reduced precision, fine for bf16/fp16 outputs but not for float32's tolerance (seen on the H200:
  up to 72x the bound): float32 activations take the fp8 values upcast to bf16 (exact) through the
  bf16 MMA, which sums in float32.
- mxfp4 (W4A16): packed e2m1 weights [N, K/2] with e8m0 scales [N, K/32]. Two paths:
  `tl.dot_scaled(x, None, "bf16"|"fp16", w, w_scale, "e2m1")` (emulated with an upcast on SM90,
  native on SM100), or an in-kernel upcast (nibbles -> float32 bit patterns -> times 2^(s-127) ->
  the dot dtype; x split into even and odd columns so the two nibble halves need no interleave)
  for float32 activations and where dot_scaled is unavailable. `mxfp4_path()` says which path
  bf16/fp16 activations take on this machine, and the registration note names it; the backend
  option mxfp4_path=dot_scaled|upcast (deepinfer_cuda.options) forces one, chosen when the ops are
  resolved (the forced registrations at the end of this module). Both paths are checked under the interpreter and on the H200.

- mxfp8 (W8A8 MX): e4m3 weights [N, K] with e8m0 scales [N, K/32]; the activation is quantised
  first by `_quant_act_mxfp8_kernel` (per token and 32 columns, bit-exact with
  `deepinfer.ops.quant.quantize_act_mxfp8`; integer e4m3 rounding under the interpreter), then
  MX_MODE 2: `tl.dot_scaled(w, w_scale, "e4m3", x^T, x_scale, "e4m3")` with the weight tile as the
  left operand (BLOCK_N rows: tcgen05's block-scaled MMA needs M = 128) and the tokens as N (16 for
  decode), the [BLOCK_N, BLOCK_M] accumulator stored transposed. SM100: tcgen05 kind::mxf8f6f4
  block_scale; SM90: Triton's emulation (upcast to bf16, wgmma). mxfp4 stays W4A16: the
  block-scaled MMA needs both operands in MX formats, so on SM100 it runs kind::f16 after Triton's
  upcast (docs/backends/cuda.md says what was tried).
- mxfp4_a8 (W4A8 MX): mxfp4's packed e2m1 weights and e8m0 scales, the activation quantised as for
  mxfp8 (same quantiser kernel), then MX_MODE 2 with the packed weight tile as the left operand:
  `tl.dot_scaled(w_e2m1 [BLOCK_N, BLOCK_K/2], w_scale, "e2m1", x^T e4m3, x_scale, "e4m3")`. SM100:
  tcgen05 kind::mxf8f6f4 block_scale (e4m3 x e2m1); SM90: Triton's emulation. The kernel sees FMT 2
  (the mxfp4 weight layout) with MX_MODE 2; tuning entries "mxfp4_a8_small" / "mxfp4_a8_large".

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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer.ops import gemm as gemm_ops
from deepinfer.ops import quant
from deepinfer.triton_common import cdiv, e4m3_rne_bits, interpreting, next_power_of_2, upcast_dot
from deepinfer_cuda.kernels.common import Registration, capability, dot_precision, num_sms
from deepinfer_cuda.options import MXFP4_PATH
from deepinfer_cuda.tuning import config

FP8_GROUP = quant.FP8_BLOCK  # 128: activation group width and weight block edge
MX_GROUP = quant.MX_BLOCK  # 32

_FMT_ID = {"dense": 0, "fp8_block": 1, "mxfp4": 2, "mxfp8": 3, "mxfp4_a8": 2}  # mxfp4_a8: the mxfp4 weight layout, MX_MODE 2
_MX_FMTS = ("mxfp4", "mxfp8", "mxfp4_a8")
_MX_UPCAST, _MX_DOT_SCALED, _MX_NATIVE = 0, 1, 2  # MX_MODE: how an mx weight meets the activations
_LINEAR, _CONTIGUOUS, _MASKED = 0, 1, 2
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------
# fp8 activation quantiser (per token, per 128-column group)


@triton.jit
def _quant_act_fp8_kernel(
    x_ptr, q_ptr, s_ptr,
    R, K,
    stride_xr, stride_qr, stride_sr,
    BLOCK_R: tl.constexpr,
    GROUP: tl.constexpr,
    MANUAL_CVT: tl.constexpr,
):
    pid_r = tl.program_id(0)
    g = tl.program_id(1)
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = g * GROUP + tl.arange(0, GROUP)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    amax = tl.maximum(amax, 1e-4)  # float32(1e-4), as the reference clamps
    scale = tl.math.div_rn(amax, 448.0)
    y = tl.math.div_rn(x, scale[:, None])
    q_ptrs = q_ptr + rows[:, None] * stride_qr + cols[None, :]
    if MANUAL_CVT:
        tl.store(q_ptrs, e4m3_rne_bits(y).to(tl.uint8), mask=mask)  # q_ptr is a uint8 view
    else:
        tl.store(q_ptrs, y.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + rows * stride_sr + g, scale, mask=row_ok)


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused quantiser, same contract as `deepinfer.ops.quant.quantize_act_fp8` (bit-exact):
    x [..., K] -> (x_fp8 [..., K] float8_e4m3fn, x_scale float32 [..., ceil(K/128)])."""
    k = x.shape[-1]
    groups = cdiv(k, FP8_GROUP)
    x2 = x.reshape(-1, k)
    if k and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    q = torch.empty(rows, k, dtype=quant.FP8_DTYPE, device=x.device)
    s = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows and k:
        cfg = config("gemm", "quant_act", x.device)
        manual = interpreting()
        grid = (cdiv(rows, cfg["BLOCK_R"]), groups)
        _quant_act_fp8_kernel[grid](
            x2, q.view(torch.uint8) if manual else q, s,
            rows, k,
            x2.stride(0), q.stride(0), s.stride(0),
            BLOCK_R=cfg["BLOCK_R"], GROUP=FP8_GROUP, MANUAL_CVT=manual,
            num_warps=cfg["num_warps"],
        )
    return q.reshape(*x.shape[:-1], k), s.reshape(*x.shape[:-1], groups)


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


@triton.jit
def _quant_act_mxfp8_kernel(
    x_ptr, q_ptr, s_ptr,
    R, K,
    stride_xr, stride_qr, stride_sr,
    BLOCK_R: tl.constexpr,
    GROUPS: tl.constexpr,  # 32-column groups per program
    MANUAL_CVT: tl.constexpr,
):
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
    tl.store(q_ptr + rows[:, None, None] * stride_qr + cols[None, :, :], codes.to(tl.uint8), mask=mask)
    tl.store(s_ptr + rows[:, None] * stride_sr + groups[None, :], byte.to(tl.uint8), mask=row_ok[:, None] & g_ok[None, :])


def quantize_act_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused quantiser, same contract as `deepinfer.ops.quant.quantize_act_mxfp8` (bit-exact):
    x [..., K] (K a multiple of 32) -> (x_fp8 [..., K] float8_e4m3fn, scale uint8 [..., K/32] e8m0)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if k and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    q = torch.empty(rows, k, dtype=torch.uint8, device=x.device)
    sc = torch.empty(rows, k // MX_GROUP, dtype=torch.uint8, device=x.device)
    if rows and k:
        cfg = config("gemm", "quant_act_mx", x.device)
        grid = (cdiv(rows, cfg["BLOCK_R"]), cdiv(k // MX_GROUP, cfg["GROUPS"]))
        _quant_act_mxfp8_kernel[grid](
            x2, q, sc, rows, k, x2.stride(0), q.stride(0), sc.stride(0),
            BLOCK_R=cfg["BLOCK_R"], GROUPS=cfg["GROUPS"], MANUAL_CVT=interpreting(), num_warps=cfg["num_warps"],
        )
    return q.view(quant.FP8_DTYPE).reshape(*x.shape[:-1], k), sc.reshape(*x.shape[:-1], k // MX_GROUP)


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


@triton.jit
def _gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, offs_ptr, mm_ptr,
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
    MX_MODE: tl.constexpr,  # mx formats: 0 in-kernel upcast, 1 dot_scaled(16-bit x), 2 dot_scaled(mx x mx, swapped)
    MX_LHS: tl.constexpr,  # "bf16" | "fp16": dot_scaled's format of x (MX_MODE 1)
    FP8_VIA_BF16: tl.constexpr,  # fp8 operands upcast to bf16 (exact) for a float32-exact sum
    SCALAR_WS: tl.constexpr,  # the N block lies in one 128-row weight-scale block
):
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
    w_base = w_ptr + e64 * stride_we + cols_c[None, :] * stride_wn

    total_iters = tl.cdiv(K, BLOCK_K)
    it0 = pid_s * iters_per_split
    it1 = tl.minimum(it0 + iters_per_split, total_iters)

    if MX_MODE == 2:
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
        ws_base = ws_ptr + e64 * stride_wse + cols_c[:, None] * stride_wsn
    if MX_MODE == 2:
        wt_base = w_ptr + e64 * stride_we + cols_c[:, None] * stride_wn  # [BLOCK_N, *]: K contiguous
        xt_off = e64 * stride_xe + rows_c[None, :] * stride_xm  # [*, BLOCK_M]
        xsc_off = e64 * stride_xse + rows_c[:, None] * stride_xsm  # [BLOCK_M, *]

    for it in range(it0, it1):
        k0 = it * BLOCK_K
        kk = k0 + offs_k
        if MX_MODE == 2:
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
            else:  # FMT 3, mxfp8: [BLOCK_K, BLOCK_N] e4m3 and [BLOCK_N, BLOCK_K/32] e8m0
                ks = k0 // 32 + offs_ks
                if EVEN_K:
                    b = tl.load(w_base + kk[:, None] * stride_wk)
                    bs = tl.load(ws_base + ks[None, :] * stride_wsk)
                else:
                    b = tl.load(w_base + kk[:, None] * stride_wk, mask=(kk < K)[:, None], other=0.0)
                    bs = tl.load(ws_base + ks[None, :] * stride_wsk, mask=(ks < K // 32)[None, :], other=127)
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

    if MX_MODE == 2:  # acc is [BLOCK_N, BLOCK_M]
        out_mask = (cols < N)[:, None] & (rows < row_end)[None, :]
        out_ptrs = out_ptr + e64 * stride_oe + rows.to(tl.int64)[None, :] * stride_om + cols[:, None] * stride_on
    else:
        out_mask = (rows < row_end)[:, None] & (cols < N)[None, :]
        out_ptrs = out_ptr + e64 * stride_oe + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptrs + pid_s * stride_os, acc, mask=out_mask)


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


@triton.jit
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
):
    """The large-tile variant for SM90+: operands through tensor descriptors (TMA loads, zero fill
    past the tensor), no split-K. x is seen as [rows, K] (masked: [E * max_m, K]), the weight as
    [E * N, K]; rows or weight rows a tile reads beyond its expert only feed outputs that are
    masked at the store."""
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


@triton.jit
def _split_k_reduce_kernel(ws_ptr, out_ptr, numel, stride_s, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
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

def _mx_mode(fmt: str, x: torch.Tensor, mxfp4_dot_scaled: bool | None = None) -> int:
    """How an mx weight meets x. mxfp8 (W8A8 by contract) and mxfp4_a8 (W4A8): x quantised to MX FP8
    and tl.dot_scaled on both MX operands (native block-scaled MMA on SM100, Triton's bf16 emulation
    on SM90). mxfp4
    (W4A16): tl.dot_scaled with x as bf16/fp16 (SM100 too: tcgen05's block-scaled MMA takes only
    fp8/fp6/fp4 operands, so Triton upcasts the e2m1 side and runs kind::f16), or the in-kernel upcast.
    mxfp4_dot_scaled: the path backend option mxfp4_path forces (None: this machine's, MXFP4_DOT_SCALED)."""
    if fmt in ("mxfp8", "mxfp4_a8"):
        if not hasattr(tl, "dot_scaled"):
            raise RuntimeError(f"{fmt} GEMM needs tl.dot_scaled, missing in Triton {triton.__version__}")
        return _MX_NATIVE
    if fmt != "mxfp4":
        return _MX_UPCAST
    dot_scaled = MXFP4_DOT_SCALED if mxfp4_dot_scaled is None else mxfp4_dot_scaled
    if dot_scaled and x.dtype in (torch.bfloat16, torch.float16):
        return _MX_DOT_SCALED
    return _MX_UPCAST


def mxfp4_path() -> str:
    return "tl.dot_scaled" if MXFP4_DOT_SCALED else "in-kernel e2m1 upcast"


def _variant(fmt: str, rows_per_expert: float) -> str:
    return f"{fmt}_{'small' if rows_per_expert <= 64 else 'large'}"


SHARED_MEMORY_BUDGET = 200 * 1024  # bytes of pipeline buffers; SM90/SM100 have 227 KiB per block


def _fit_shared_memory(fmt, x, weight, dot_f32, block_m, block_n, block_k, num_stages):
    """Fewer stages, then a narrower K block, until the operand buffers fit (float32 dots
    and mixed dtypes keep wide operands in shared memory)."""
    a_bytes = 4 if dot_f32 else (1 if fmt == "fp8_block" else x.element_size())
    b_per_k = {"dense": 4 if dot_f32 else weight.element_size(), "fp8_block": 4 if dot_f32 else 1, "mxfp4": 0.5, "mxfp8": 1, "mxfp4_a8": 0.5}[fmt]
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
    mx_mode: int  # _MX_UPCAST, _MX_DOT_SCALED or _MX_NATIVE
    mx_lhs: str  # dot_scaled's format of x (MX_MODE 1): "bf16" | "fp16"
    dot_f32: bool  # dot operands converted to float32 (ieee)
    fp8_via_bf16: bool  # fp8 operands upcast to bf16 (exact) for a float32-exact sum
    num_m_tiles: int  # row tiles on the grid (an upper bound for contiguous: + E)
    num_n: int
    split: int  # split-K factor; 1: none
    iters_per_split: int
    tma: bool  # `_gemm_tma_kernel` (tensor descriptors), else `_gemm_kernel` (pointers)
    k_pairs: bool  # tma fp8: two 128-K groups per step
    warp_specialize: bool  # tma: tl.range(warp_specialize=True)

    @property
    def m_arg(self) -> int:
        """The kernels' M: rows of x, or max_m for the masked layout."""
        return self.max_m if self.layout == _MASKED else self.rows_total

    @property
    def scalar_ws(self) -> bool:
        """An N block lies inside one 128-row weight-scale block."""
        return FP8_GROUP % self.block_n == 0


def plan_gemm(x: torch.Tensor, weight: torch.Tensor, fmt: str, layout: int, mxfp4_dot_scaled: bool | None = None) -> GemmPlan:
    """The launch's tiles, dot dtype, split-K and kernel, from the tensors' shapes, dtypes, strides
    and alignment, the device and its tuning entry only (never their values: no host sync).
    For non-empty products (rows, N and K > 0)."""
    device = x.device
    k = x.shape[-1]
    experts = weight.shape[0] if layout != _LINEAR else 1
    n = weight.shape[-2]
    if layout == _MASKED:
        max_m = x.shape[1]
        rows_total = experts * max_m
        rows_per_expert = max_m
    else:
        max_m = 0
        rows_total = x.shape[0]
        rows_per_expert = rows_total / max(experts, 1)

    cfg = config("gemm", _variant(fmt, rows_per_expert), device)
    block_m = max(16, min(cfg["BLOCK_M"], next_power_of_2(int(rows_per_expert) if rows_per_expert >= 1 else 1)))
    block_n = cfg["BLOCK_N"]
    if fmt == "fp8_block":
        block_k = FP8_GROUP  # one scale group per step
    elif fmt in _MX_FMTS:
        block_k = max(2 * MX_GROUP, min(cfg["BLOCK_K"], next_power_of_2(k)))
    else:
        block_k = max(16, min(cfg["BLOCK_K"], next_power_of_2(k)))
    mx_mode = _mx_mode(fmt, x, mxfp4_dot_scaled)

    # The dot dtype.
    upcast = upcast_dot()
    if fmt == "dense":
        dot_f32 = upcast or x.dtype == torch.float32 or weight.dtype != x.dtype
    elif fmt == "fp8_block":
        dot_f32 = upcast
    else:
        dot_f32 = upcast or x.dtype == torch.float32
    # Hopper's fp8 MMA sums with reduced precision (DeepSeek-V3 report: ~14 bits), invisible in a
    # bf16/fp16 output but not within float32's tolerance: float32 activations take the fp8 values
    # upcast to bf16 (exact) through the bf16 MMA, which sums in float32.
    fp8_via_bf16 = fmt == "fp8_block" and x.dtype == torch.float32 and not dot_f32
    num_stages = cfg["num_stages"]
    if not interpreting():
        block_k, num_stages = _fit_shared_memory(fmt, x, weight, dot_f32, block_m, block_n, block_k, num_stages)

    # Tiles, grid and split-K.
    num_n = cdiv(n, block_n)
    if layout == _MASKED:
        num_m_tiles = cdiv(rows_per_expert, block_m)
        programs = experts * num_m_tiles * num_n
    else:
        num_m_tiles = cdiv(rows_total, block_m) + (experts if layout == _CONTIGUOUS else 0)
        programs = cdiv(rows_total, block_m) * num_n
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
    return GemmPlan(
        fmt=fmt, layout=layout, experts=experts, n=n, k=k, max_m=max_m, rows_total=rows_total,
        block_m=block_m, block_n=block_n, block_k=block_k, group_m=cfg.get("GROUP_M", 8),
        num_warps=cfg["num_warps"], num_stages=num_stages,
        mx_mode=mx_mode, mx_lhs="fp16" if x.dtype == torch.float16 else "bf16",
        dot_f32=dot_f32, fp8_via_bf16=fp8_via_bf16,
        num_m_tiles=num_m_tiles, num_n=num_n, split=split, iters_per_split=iters_per_split,
        tma=tma, k_pairs=k_pairs, warp_specialize=bool(cfg.get("warp_specialize", False)),
    )


def launch_gemm(x, weight, weight_scale, fmt, layout, *, offsets=None, masked_m=None, prequantised=None, mxfp4_dot_scaled=None) -> torch.Tensor:
    """out = the product for x in `layout`: plan, quantise the activation (fp8_block, MX FP8), launch.

    prequantised: (x_q, x_scale) already made by the activation quantiser (benchmarks of the GEMM alone).
    mxfp4_dot_scaled: the mxfp4 path backend option mxfp4_path forces (None: this machine's)."""
    n = weight.shape[-2]
    if layout == _MASKED:
        out = torch.empty(weight.shape[0], x.shape[1], n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if x.shape[-1] == 0:
        return out.zero_()
    plan = plan_gemm(x, weight, fmt, layout, mxfp4_dot_scaled)
    xq, xs = x, None
    if fmt == "fp8_block":
        xq, xs = prequantised if prequantised is not None else quantize_act_fp8(x)
    elif plan.mx_mode == _MX_NATIVE:
        xq, xs = prequantised if prequantised is not None else quantize_act_mxfp8(x)
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
    """`_gemm_kernel` (pointer loads, every format, split-K partials summed by a second kernel).
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
    _gemm_kernel[grid](
        xq, xs if xs is not None else xq, weight, weight_scale if weight_scale is not None else weight, dest,
        offs_arg, mm_arg,
        p.m_arg, p.n, p.k, p.experts, p.num_m_tiles, p.iters_per_split,
        *x_strides,
        *xs_strides,
        *w_strides,
        *ws_strides,
        stride_os, *dest_strides,
        FMT=_FMT_ID[p.fmt], LAYOUT=p.layout,
        BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m,
        SPLIT_K=p.split, E_POW2=next_power_of_2(p.experts), EVEN_K=p.k % p.block_k == 0,
        DOT_F32=p.dot_f32, DOT_PRECISION=dot_precision(p.dot_f32),
        MX_MODE=p.mx_mode, MX_LHS=p.mx_lhs,
        FP8_VIA_BF16=p.fp8_via_bf16, SCALAR_WS=p.scalar_ws,
        num_warps=p.num_warps, num_stages=p.num_stages,
    )
    if p.split > 1:
        numel = out.numel()
        block = 1024
        _split_k_reduce_kernel[(cdiv(numel, block),)](dest, out, numel, stride_os, SPLIT_K=p.split, BLOCK=block, num_warps=4)


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
        num_warps=p.num_warps, num_stages=p.num_stages,
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


def _gemm_ops(mxfp4_dot_scaled: bool | None = None):
    """The `linear` and `grouped_gemm` kernels. mxfp4_dot_scaled: the mxfp4 path with bf16/fp16
    activations (backend option mxfp4_path=dot_scaled|upcast); None: this machine's default.
    float32 activations always take the upcast."""

    def linear(x: torch.Tensor, weight: torch.Tensor, *, weight_scale: torch.Tensor | None = None, fmt: str = "dense") -> torch.Tensor:
        gemm_ops.check_linear_args(x, weight, weight_scale, fmt)
        _check_dtype(x)
        weight, weight_scale = _weight_operands(weight, weight_scale, fmt)
        return launch_gemm(x, weight, weight_scale, fmt, _LINEAR, mxfp4_dot_scaled=mxfp4_dot_scaled)

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
            return launch_gemm(x, weight, weight_scale, fmt, _CONTIGUOUS, offsets=expert_offsets, mxfp4_dot_scaled=mxfp4_dot_scaled)
        gemm_ops.check_index_vector("masked_m", masked_m, experts, x.device)
        return launch_gemm(x, weight, weight_scale, fmt, _MASKED, masked_m=masked_m, mxfp4_dot_scaled=mxfp4_dot_scaled)

    if mxfp4_dot_scaled is not None:
        suffix = "dot_scaled" if mxfp4_dot_scaled else "upcast"
        linear.__qualname__, grouped_gemm.__qualname__ = f"linear_mxfp4_{suffix}", f"grouped_gemm_mxfp4_{suffix}"
    else:
        linear.__qualname__, grouped_gemm.__qualname__ = "linear", "grouped_gemm"
    return linear, grouped_gemm


linear, grouped_gemm = _gemm_ops()


_NOTE = (
    "Triton: one tiled GEMM (grouped tiles, split-K for decode shapes) for dense, fp8_block "
    "(fused per-token-group quantiser, fp8 tl.dot per 128-K group, DeepGEMM-style promotion) and "
    f"mxfp4 (bf16/fp16 activations: {mxfp4_path()}; float32 activations: in-kernel e2m1 upcast); "
    "mxfp8 and mxfp4_a8 (MX FP8 activation quantiser, tl.dot_scaled on both MX operands with the weight "
    "tile as the MMA's 128-row side: block-scaled tcgen05 on SM100, Triton's emulation on SM90)"
)



def _forced_by(path: str):
    """`when` of a forced mxfp4 path: the backend option mxfp4_path names it."""
    return lambda ctx: MXFP4_PATH.value(ctx) == path


def _dot_scaled_unusable(ctx) -> str | None:
    if hasattr(tl, "dot_scaled"):
        return None
    return f"backend option mxfp4_path=dot_scaled, but Triton {triton.__version__} has no tl.dot_scaled (mxfp4_path=auto or upcast works)"


REGISTRATIONS = [
    Registration(op="linear", fn=linear, formats=("dense", "fp8_block", "mxfp4", "mxfp8", "mxfp4_a8"), dtypes=_KERNEL_DTYPES, note=_NOTE),
    Registration(
        op="grouped_gemm", fn=grouped_gemm, formats=("dense", "fp8_block", "mxfp4", "mxfp8", "mxfp4_a8"), dtypes=_KERNEL_DTYPES,
        note=_NOTE + "; contiguous layout: tile->expert map computed in-kernel from expert_offsets, no host sync",
    ),
]
# mxfp4_path=dot_scaled|upcast: the same kernels with the mxfp4 path fixed, chosen at resolve (above
# the default registrations by priority; never chosen under mxfp4_path=auto).
for _path, _dot_scaled in (("dot_scaled", True), ("upcast", False)):
    for _op, _fn in zip(("linear", "grouped_gemm"), _gemm_ops(mxfp4_dot_scaled=_dot_scaled)):
        REGISTRATIONS.append(Registration(
            op=_op, fn=_fn, formats=("mxfp4",), dtypes=_KERNEL_DTYPES, when=_forced_by(_path), priority=1,
            unusable=_dot_scaled_unusable if _dot_scaled else None,
            note=f"Triton: the GEMM above, mxfp4 with bf16/fp16 activations by "
                 f"{'tl.dot_scaled' if _dot_scaled else 'in-kernel e2m1 upcast'} (mxfp4_path={_path})",
        ))  # fmt: skip
