"""Ascend Triton kernels: `linear` and `grouped_gemm` in every weight format (dense, fp8_block, mxfp4, mxfp8, mxfp4_a8, fp8_block32).

Written for triton-ascend (A2/A3 and 950) in the Triton subset community Triton also interprets.

Grid and work mapping (one GEMM kernel for both ops, all formats and layouts)
----------------------------------------------------------------------------
The GEMM is a `tl.dot` kernel: `cube_grid(bound)` programs (one per AI core), each walking its
share of the output tiles. The tile space is laid out expert by expert: expert e owns
cdiv(rows_e, BLOCK_M) * cdiv(N, BLOCK_N) tiles (N blocks fastest), where rows_e is
expert_offsets[e+1] - expert_offsets[e] (contiguous), min(masked_m[e], max_m) (masked) or M
(linear, one "expert"). Every program loops over the experts with scalar loads, keeps a running
tile base, and takes the tiles t of each expert with t % num_programs == pid. So the real tiles
are dense and dealt round-robin: empty experts, padding rows and rows at or past masked_m cost no
work, nothing is searched, and no value goes back to the host. The grid itself is sized from
shapes only: bound = min(cdiv(M, BLOCK_M) + E, M) * cdiv(N, BLOCK_N) for contiguous,
E * cdiv(max_m, BLOCK_M) * cdiv(N, BLOCK_N) for masked, then capped at the AI-core count.
Index arithmetic is int32 inside a tile; the per-expert and per-row-block bases are int64 scalars
(DeepSeek-V3's expert weights [256, 4096, 7168] exceed 2^31 elements).

Operands: the weight tile is loaded [BLOCK_N, BLOCK_K] (contiguous along K, the weight's own
layout) and transposed for the dot (`tl.trans`), so every load reads contiguous rows.

Formats
-------
- dense: both operands in x's dtype when the weight has it (bf16/fp16 on the cube), else both in
  float32 with input_precision="ieee" (float32 activations, mixed dtypes: the x tile widened as it is
  loaded). A float64 dense weight is converted to float32 on the host (what the reference does with it).
  `linear`'s out_dtype only sets the output's dtype (every format: the store casts the float32
  accumulator to the output's element type), so the MoE router's bf16 x times its float32 weight
  returned in float32 needs no float32 copy of x.
- fp8_block: the activation is quantised first by `_quant_act_fp8_kernel` (a vector kernel,
  `vector_grid`, per token and 128-column group, bit-exact with
  `deepinfer.ops.quant.quantize_act_fp8`: tl.math.div_rn for both divisions, an integer
  round-to-nearest-even to e4m3 with subnormals). BLOCK_K = 128 = one scale group per step: the
  group's dot goes to a fresh float32 product, scaled by x_scale[row, g] * w_scale[n // 128, g]
  and added to the float32 accumulator. Operands:
    * A2/A3 (no fp8 tl.dot), and every chip under the interpreter: the quantiser writes the e4m3
      *values* as float16 (exact), the weight bytes are decoded in-kernel to float16 (exact) with
      int16 arithmetic, and the dot runs in float16 (float32 accumulation). float16 rather than
      bf16: e4m3's layout maps onto float16's with a shift (no float subnormals needed: e4m3
      subnormals are float16 normals), and the interpreter's bf16 arithmetic is broken, so a bf16
      decoder could not be checked here. Both are exact for every e4m3 value.
    * 950 (device.has_fp8_dot) on hardware with bf16/fp16 activations: the quantiser writes e4m3
      bytes and the dot takes fp8 x fp8 directly. float32 activations keep the float16 path (the
      float32 tolerance leaves no room for a reduced-precision fp8 accumulation).
- mxfp4 (W4A16): packed e2m1 [N, K/2] and e8m0 scales [N, K/32]. The [BLOCK_N, BLOCK_K/2] byte
  tile is split into nibbles, interleaved (tl.join + reshape: low nibble = even k), and each code
  becomes bf16 bits with integer arithmetic only, the e8m0 exponent added into the bf16 exponent
  field (exact; a result below bf16's normal range, |w| < 2^-126, is flushed to 0 and one above
  it is inf, as float32 overflows in the reference). bf16 activations dot in bf16; float16 and
  float32 activations dot in float32 (ieee).

- mxfp8 (W8A8 MX): the activations go through the contract's quantiser `quant.quantize_act_mxfp8`
  in torch (per token and 32 columns; bit-exact by definition, not fused) and are dequantised to
  float32 (exact); the kernel decodes the e4m3 weight bytes (`_e4m3_to_f16`, exact) times
  2^(s-127) in float32 and dots in float32 (ieee). Not tuned: no Ascend hardware ran it.
- mxfp4_a8 (W4A8 MX: mxfp4 weights, MX FP8 activations): the activations as for mxfp8 (the
  contract's quantiser in torch, dequantised to float32, exact), the weights through the mxfp4
  decode (FMT 2), the dot in float32 (ieee). Not tuned: no Ascend hardware ran it (the 950's MX
  matmul takes exactly this pairing, see npu_ops; not wired).
- fp8_block32 (W8A16, DeepSeek-V4.1's FP8: e4m3 weights with one e8m0 byte per 32x32 block, scales
  [ceil(N/32), ceil(K/32)]): the activations stay as they are (the op's reference is x @ dequantised
  W^T: no quantiser); the kernel is mxfp8's weight decode (FMT 3: `_e4m3_to_f16`, exact, times
  2^(s-127) in float32) with WS_ROWS = 32, weight row n reading scale row n // 32, and scale columns
  up to cdiv(K, 32) (a partial last K block). bf16 activations dot in bf16 (the decoded weight is
  exact in bf16 but for values below 2^-133), float16 and float32 ones in float32 (ieee). Not tuned:
  no Ascend hardware ran it.

Tiles and the on-chip buffer
----------------------------
BLOCK_K = 128 for every format (the fp8 scale group; 4 e8m0 groups for mxfp4). `plan_tiles` picks
BLOCK_M (16..128, at most the power of two covering the rows per expert) and BLOCK_N (32..128, a
divisor of 128) as the largest tile whose estimated bytes (`tile_bytes`: operands, the decode
temporaries of quantised weights, the float32 product and accumulator) take at most half of the
chip's unified buffer (96 KB of 192 KB on A2/A3, 128 KB of 256 KB on 950), so triton-ascend's
double buffering (`multibuffer`) fits too. Ties go to the larger BLOCK_M for quantised weights
(a weight tile is decoded once per row block). The plans, for >= 128 rows per expert and for
decode (<= 16 rows per expert):

    format / operands               A2/A3 (<= 96 KB)                  950 (<= 128 KB)
    dense bf16/fp16                 M64 N128 80 KB | M16 N128 44 KB   M128 N128 128 KB | M16 N128 44 KB
    dense float32 / mixed dtypes    M32 N128 96 KB | M16 N128 80 KB   M64 N128 128 KB | M16 N128 80 KB
    fp8_block, float16 decode       M128 N32 92 KB | M16 N64 68 KB    (float32 activations) same
    fp8_block, fp8 dot              -                                 M128 N64 88 KB | M16 N128 34 KB
    mxfp4, bf16 activations         M128 N32 94 KB | M16 N32 52 KB    M128 N32 94 KB | M16 N64 100 KB
    mxfp4, fp16/fp32 activations    M32 N32 82 KB | M16 N32 72 KB     M64 N32 102 KB | M16 N32 72 KB
    fp8_block32, bf16 activations   M64 N32 84 KB | M16 N32 66 KB     M128 N32 108 KB | M16 N64 128 KB
    fp8_block32, fp16/fp32          M64 N32 92 KB | M16 N32 62 KB     M64 N32 92 KB | M16 N64 116 KB

The quantiser's tile is [16 rows, 128 columns]: 8 KB per live float32/int32 temporary.

Deterministic mode (the batch-invariant registrations, `linear_invariant` / `grouped_gemm_invariant`)
--------------------------------------------------------------------------------------------------
The only batch-dependent choice above is BLOCK_M (and with it BLOCK_N) from the rows per expert:
a row's K sum is the same sequence of BLOCK_K-wide dots either way, but each dot is a cube product
of another tile shape, whose accumulation inside the 128-wide K step the hardware is free to order
differently. The invariant kernels plan every call's tiles for INVARIANT_ROWS = 64 rows per expert
(A2/A3: dense bf16 M64 N128, fp8 M64 N32, mxfp4 M64 N32; 950: M64 N128 / N64 / N64), so an output
element is computed by one tile shape and one K order whatever the call holds; there is no split-K
anywhere, and the quantisers work per row (exact). Cost on hardware: prefill GEMMs re-read each
weight tile per 64 rows instead of per 128 where 128 fitted (from L2); decode computes padded rows
of a 64-row tile (the cube is idle there anyway: decode GEMMs are weight-bandwidth bound).

Interpreter deviations (TRITON_INTERPRET=1, `upcast_dot()` -> DOT_F32): dot operands are
converted to float32 (community Triton's interpreter computes bf16 tl.dot wrongly, and its bf16 elementwise arithmetic
too: negating a bf16 tensor negates its integer bits, so no bf16 arithmetic appears here, only
bit patterns), and the fp8 dot of the 950 is not chosen (the float16 path runs instead), so the
interpreter checks the A2/A3 operand path on both simulated chips' grids and tiles. The tests
force the fp8-dot path too (operands bitcast to fp8, then upcast under the interpreter) to check
its indexing and the quantiser's byte output.

To verify on hardware (not possible here): that triton-ascend lowers tl.math.div_rn (precise
division) and that `quantize_act_fp8` here stays bit-exact with deepinfer.ops.quant's there
(if triton-ascend lacks the lowering, `_div_rn` is the one place to change); tl.join/tl.reshape of the mxfp4 nibble tile; the
tile estimates against the real UB use; the fp8 dot on the 950.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops import gemm as gemm_ops
from deepinfer.ops import quant
from deepinfer.triton_common import cdiv, interpreting, next_power_of_2, upcast_dot
from deepinfer_ascend.kernels.common import Registration, cube_grid, current, launch_options, vector_grid

FP8_GROUP = quant.FP8_BLOCK  # 128: activation group width, weight block edge, BLOCK_K
MX_GROUP = quant.MX_BLOCK  # 32
BLOCK_K = 128
QUANT_BLOCK_R = 16  # rows per quantiser tile: [16, 128] float32 = 8 KB per live temporary
# Deterministic mode plans every GEMM's tiles for this many rows per expert, whatever the call holds
# (module docstring, "Deterministic mode").
INVARIANT_ROWS = 64

# mxfp4_a8: mxfp4 decode, float32 activations; fp8_block32: mxfp8's e4m3 decode, one scale row per 32 weight rows
_FMT_ID = {"dense": 0, "fp8_block": 1, "mxfp4": 2, "mxfp8": 3, "mxfp4_a8": 2, "fp8_block32": 3}
_SCALE_ROWS = {"fp8_block32": quant.FP8_BLOCK32}  # weight rows per scale row (others: 1)
_LINEAR, _CONTIGUOUS, _MASKED = 0, 1, 2
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# dot operand kinds
_DOT_NATIVE, _DOT_F32, _DOT_F16, _DOT_FP8 = 0, 1, 2, 3


# ---------------------------------------------------------------------------------------------
# Number-format helpers (integer arithmetic: exact on every chip and under the interpreter)


@triton.jit
def _div_rn(a, b):
    """Correctly rounded float32 division (the quantiser's definition asks for it)."""
    return tl.math.div_rn(a, b)


@triton.jit
def _e4m3_code(y):
    """The e4m3fn code (int32 0..255) nearest to float32 y, |y| < 464, ties to even, subnormals kept."""
    bits = y.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    # |y| >= 2^-6 (e4m3 normal): keep 3 of float32's 23 mantissa bits, round half to even (a carry
    # runs into the exponent by itself), then rebias the exponent from 127 to 7.
    keep = mag >> 20
    dropped = mag & 0xFFFFF
    up = (dropped > 0x80000) | ((dropped == 0x80000) & ((keep & 1) == 1))
    normal = keep + up.to(tl.int32) - (120 << 3)
    # |y| < 2^-6 (e4m3 subnormal, step 2^-9): code = RNE(|y| * 2^9) in 0..8; adding 2^23 makes
    # float32's own round-half-even leave that integer in the low mantissa bits.
    scaled = mag.to(tl.float32, bitcast=True) * 512.0 + 8388608.0
    sub = scaled.to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(mag >= 0x3C800000, normal, sub)
    return code | tl.where(bits < 0, 0x80, 0)


@triton.jit
def _e4m3_to_f16(b):
    """e4m3fn codes (any int type, 0..255) -> float16 values, exactly (0x7F/0xFF -> NaN).

    e4m3 s.eeee.mmm becomes float16 s.eeeee.mmm0000000 with the exponent rebiased by +8; codes with
    e = 0 (subnormals m * 2^-9) are built as 2^-6 * (1 + m/8) and then 2^-6 is subtracted, so no
    float16 subnormal is involved."""
    c = b.to(tl.int16)
    mag = c & 0x7F
    sub = mag < 8
    bits = ((mag << 7) + 0x2000 + (sub.to(tl.int16) << 10)).to(tl.int16)
    v = bits.to(tl.float16, bitcast=True) - tl.where(sub, 0.015625, 0.0).to(tl.float16)
    v = tl.where((c & 0x80) != 0, -v, v)
    return tl.where(mag == 0x7F, float("nan"), v)


@triton.jit
def _mxfp4_to_bf16(codes, s):
    """e2m1 codes (int, 0..15) times 2^(s - 127) for e8m0 bytes s (broadcastable) -> bfloat16, exactly.

    An e2m1 code is sign.ee.m: 0.5 * m for e = 0, else 2^(e-1) * (1 + m/2). The result's bf16
    biased exponent is s + e - 1 (bf16 and e8m0 share the bias 127); integer arithmetic only."""
    c = codes.to(tl.int32)
    sc = s.to(tl.int32)
    e = (c >> 1) & 3
    m = c & 1
    field = sc + e - 1
    bits = (field << 7) | tl.where(e > 0, m << 6, 0)
    bits = tl.where(field <= 0, 0, bits)  # below bf16's normal range: flushed
    bits = tl.where(field >= 255, 0x7F80, bits)  # overflow: inf
    bits = tl.where((c & 7) == 0, 0, bits)
    bits = tl.where(sc == 255, 0x7FC0, bits)  # e8m0 NaN
    bits = bits | tl.where((c & 8) != 0, -32768, 0)  # sign: the value stays within int16
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


# ---------------------------------------------------------------------------------------------
# fp8 activation quantiser (vector kernel)


@triton.jit
def _quant_act_fp8_kernel(
    x_ptr, q_ptr, s_ptr, limit_ptr,
    R, K, SLABS,
    stride_xe, stride_xm, stride_qe, stride_qm, stride_se, stride_sm,
    LAYOUT: tl.constexpr,  # 0: all R rows; 1: rows < limit_ptr[0]; 2: slab e's rows < limit_ptr[e]
    OUT_CODES: tl.constexpr,  # store e4m3 bytes (fp8 dot) instead of their float16 values
    BLOCK_R: tl.constexpr,
    GROUP: tl.constexpr,
):
    """x [SLABS, R, K] -> q (same shape) and scales [SLABS, R, cdiv(K, GROUP)], per row and group.
    Tiles: (slab, row block, group), dealt round-robin over the vector cores; row blocks past the
    slab's valid rows are skipped."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    groups = tl.cdiv(K, GROUP)
    row_blocks = tl.cdiv(R, BLOCK_R)
    per_slab = row_blocks * groups
    offs_r = tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, GROUP)
    for t in range(pid, SLABS * per_slab, nprog):
        slab = t // per_slab
        rb = (t % per_slab) // groups
        g = t % groups
        if LAYOUT == 1:
            limit = tl.minimum(tl.load(limit_ptr).to(tl.int32), R)
        elif LAYOUT == 2:
            limit = tl.minimum(tl.load(limit_ptr + slab).to(tl.int32), R)
        else:
            limit = R
        r0 = rb * BLOCK_R
        if r0 < limit:
            slab64 = tl.cast(slab, tl.int64)
            r064 = tl.cast(r0, tl.int64)
            cols = g * GROUP + offs_c
            row_ok = (r0 + offs_r) < limit
            mask = row_ok[:, None] & (cols < K)[None, :]
            x_base = x_ptr + slab64 * stride_xe + r064 * stride_xm
            x = tl.load(x_base + offs_r[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)  # float32(1e-4), as the reference clamps
            scale = _div_rn(amax, 448.0)
            code = _e4m3_code(_div_rn(x, scale[:, None]))
            q_ptrs = q_ptr + slab64 * stride_qe + r064 * stride_qm + offs_r[:, None] * stride_qm + cols[None, :]
            if OUT_CODES:
                tl.store(q_ptrs, code.to(tl.uint8), mask=mask)  # q_ptr: a uint8 view of the fp8 tensor
            else:
                tl.store(q_ptrs, _e4m3_to_f16(code), mask=mask)
            s_ptrs = s_ptr + slab64 * stride_se + r064 * stride_sm + offs_r * stride_sm + g
            tl.store(s_ptrs, scale, mask=row_ok)


def _quantize(x: torch.Tensor, layout: int, limit: torch.Tensor | None, out_codes: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (layouts 0, 1) or [E, max_m, K] (layout 2) -> (q, scale float32 [..., cdiv(K, 128)]).

    q is float8_e4m3fn when out_codes, else float16 holding the e4m3 values. Rows the layout leaves
    unspecified (past expert_offsets[E], at or past masked_m[e]) are left unwritten."""
    k = x.shape[-1]
    groups = cdiv(k, FP8_GROUP)
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    slabs, rows = x3.shape[0], x3.shape[1]
    q = torch.empty(x3.shape, dtype=quant.FP8_DTYPE if out_codes else torch.float16, device=x.device)
    s = torch.empty(slabs, rows, groups, dtype=torch.float32, device=x.device)
    tiles = slabs * cdiv(rows, QUANT_BLOCK_R) * groups
    if tiles:
        qv = q.view(torch.uint8) if out_codes else q
        _quant_act_fp8_kernel[(vector_grid(tiles),)](
            x3, qv, s, limit if limit is not None else s,
            rows, k, slabs,
            x3.stride(0), x3.stride(1), qv.stride(0), qv.stride(1), s.stride(0), s.stride(1),
            LAYOUT=layout, OUT_CODES=out_codes, BLOCK_R=QUANT_BLOCK_R, GROUP=FP8_GROUP,
            **launch_options(multibuffer=True),
        )
    if x.dim() == 2:
        q, s = q[0], s[0]
    return q, s


def quantize_act_fp8(x: torch.Tensor, *, codes: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantiser alone, `deepinfer.ops.quant.quantize_act_fp8`'s contract (bit-exact) for
    x [..., K]: (x_fp8 float8_e4m3fn [..., K], x_scale float32 [..., ceil(K/128)]). With
    codes=False the first tensor holds the same e4m3 values as float16 (what the A2/A3 GEMM reads)."""
    k = x.shape[-1]
    x2 = _contiguous_rows(x.reshape(-1, k))
    q, s = _quantize(x2, _LINEAR, None, codes)
    return q.reshape(*x.shape[:-1], k), s.reshape(*x.shape[:-1], cdiv(k, FP8_GROUP))


# ---------------------------------------------------------------------------------------------
# The GEMM (cube kernel)


@triton.jit
def _gemm_tile(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr,
    e, row0, row_end, n0, N, K,
    stride_xe, stride_xm, stride_se, stride_sm,
    stride_we, stride_wn, stride_wse, stride_wsn,
    stride_oe, stride_om,
    FMT: tl.constexpr, DOT: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WS_ROWS: tl.constexpr,
):
    """out[e, row0:row0+BLOCK_M (< row_end), n0:n0+BLOCK_N] for one expert. WS_ROWS: weight rows per
    scale row (FMT 3: 1 for mxfp8, 32 for fp8_block32)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = (row0 + offs_m) < row_end
    col_ok = (n0 + offs_n) < N
    e64 = tl.cast(e, tl.int64)
    # int64 scalar bases, int32 offsets inside the tile
    x_base = x_ptr + e64 * stride_xe + tl.cast(row0, tl.int64) * stride_xm
    w_base = w_ptr + e64 * stride_we + tl.cast(n0, tl.int64) * stride_wn
    x_rows = offs_m[:, None] * stride_xm
    w_rows = offs_n[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FMT == 1:
        xs_base = xs_ptr + e64 * stride_se + tl.cast(row0, tl.int64) * stride_sm
        ws_base = ws_ptr + e64 * stride_wse + (n0 // BLOCK_K) * stride_wsn  # BLOCK_N divides 128
    if FMT >= 2:
        offs_kp = tl.arange(0, BLOCK_K // 2)
        offs_ks = tl.arange(0, BLOCK_K // 32)
        ks_end = tl.cdiv(K, 32)  # scale columns (fp8_block32's last K block may be partial)
        if WS_ROWS == 1:
            ws_base = ws_ptr + e64 * stride_wse + tl.cast(n0, tl.int64) * stride_wsn
            ws_rows = offs_n[:, None] * stride_wsn
        else:  # n0 is a multiple of BLOCK_N; the tile's rows read scale rows (n0 + i) // WS_ROWS
            ws_base = ws_ptr + e64 * stride_wse
            ws_rows = ((n0 + offs_n) // WS_ROWS)[:, None] * stride_wsn

    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(x_base + x_rows + (k0 + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if FMT == 0:
            b = tl.load(w_base + w_rows + (k0 + offs_k)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT == 1 or DOT_F32:
                acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        elif FMT == 1:
            g = k0 // BLOCK_K
            b = tl.load(w_base + w_rows + (k0 + offs_k)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0)
            if DOT == 3:  # fp8 x fp8 (950): both tensors arrive as uint8 views (zero fill is a byte)
                a8 = a.to(tl.float8e4nv, bitcast=True)
                b8 = b.to(tl.float8e4nv, bitcast=True)
                if DOT_F32:  # only when a test forces this path under the interpreter
                    part = tl.dot(a8.to(tl.float32), tl.trans(b8.to(tl.float32)), input_precision="ieee")
                else:
                    part = tl.dot(a8, tl.trans(b8))
            else:  # a: float16 e4m3 values; b: e4m3 bytes decoded to float16 (exact)
                bf = _e4m3_to_f16(b)
                if DOT_F32:
                    part = tl.dot(a.to(tl.float32), tl.trans(bf.to(tl.float32)), input_precision="ieee")
                else:
                    part = tl.dot(a, tl.trans(bf))
            a_s = tl.load(xs_base + offs_m * stride_sm + g, mask=row_ok, other=0.0)
            w_s = tl.load(ws_base + g)
            acc += part * (a_s * w_s)[:, None]
        elif FMT == 3:  # mxfp8 (activations arrive dequantised, float32) / fp8_block32 (x as given); e4m3 bytes x 2^(s-127)
            ks = k0 // 32 + offs_ks
            b = tl.load(w_base + w_rows + (k0 + offs_k)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0)
            s = tl.load(ws_base + ws_rows + ks[None, :], mask=col_ok[:, None] & (ks < ks_end)[None, :], other=127)
            si = s.to(tl.int32)
            f = tl.where(si == 0, 0x00400000, tl.where(si == 255, 0x7FC00000, si << 23)).to(tl.float32, bitcast=True)  # 2^(s-127)
            wv = tl.reshape(tl.reshape(_e4m3_to_f16(b).to(tl.float32), (BLOCK_N, BLOCK_K // 32, 32)) * f[:, :, None], (BLOCK_N, BLOCK_K))
            if DOT == 1 or DOT_F32:
                acc = tl.dot(a.to(tl.float32), tl.trans(wv), acc, input_precision="ieee")
            else:  # bf16 activations (fp8_block32): the decoded weight is exact in bf16
                acc = tl.dot(a, tl.trans(wv.to(tl.bfloat16)), acc)
        else:
            kp = k0 // 2 + offs_kp
            ks = k0 // 32 + offs_ks
            packed = tl.load(w_base + w_rows + kp[None, :], mask=col_ok[:, None] & (kp < K // 2)[None, :], other=0)
            s = tl.load(ws_base + ws_rows + ks[None, :], mask=col_ok[:, None] & (ks < K // 32)[None, :], other=127)
            codes = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_N, BLOCK_K // 32, 32))  # low nibble: even k
            b = tl.reshape(_mxfp4_to_bf16(codes, s[:, :, None]), (BLOCK_N, BLOCK_K))
            if DOT == 1 or DOT_F32:
                acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)

    out_base = out_ptr + e64 * stride_oe + tl.cast(row0, tl.int64) * stride_om
    tl.store(out_base + offs_m[:, None] * stride_om + (n0 + offs_n)[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, bounds_ptr,
    M, N, K, E,
    stride_xe, stride_xm, stride_se, stride_sm,
    stride_we, stride_wn, stride_wse, stride_wsn,
    stride_oe, stride_om,
    FMT: tl.constexpr,  # 0 dense, 1 fp8_block, 2 mxfp4 (and mxfp4_a8), 3 mxfp8 (and fp8_block32)
    LAYOUT: tl.constexpr,  # 0 linear (M rows), 1 contiguous (bounds = expert_offsets), 2 masked (bounds = masked_m, M = max_m)
    DOT: tl.constexpr,  # 0 operands as loaded, 1 float32 ieee, 2 float16 (fp8 decode), 3 fp8
    DOT_F32: tl.constexpr,  # every dot's operands in float32 (the interpreter: upcast_dot)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WS_ROWS: tl.constexpr = 1,  # weight rows per scale row (fp8_block32: 32)
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_n = tl.cdiv(N, BLOCK_N)
    base = pid * 0  # tiles of the experts before e
    for e in range(0, E):
        if LAYOUT == 1:
            lo = tl.load(bounds_ptr + e).to(tl.int32)
            hi = tl.load(bounds_ptr + e + 1).to(tl.int32)
        elif LAYOUT == 2:
            lo = e * 0
            hi = tl.minimum(tl.maximum(tl.load(bounds_ptr + e).to(tl.int32), 0), M)
        else:
            lo = e * 0
            hi = e * 0 + M
        count = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_M) * num_n
        first = base + (pid - base % nprog + nprog) % nprog  # first tile >= base dealt to this program
        for t in range(first, base + count, nprog):
            local = t - base
            _gemm_tile(
                x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr,
                e, lo + (local // num_n) * BLOCK_M, hi, (local % num_n) * BLOCK_N, N, K,
                stride_xe, stride_xm, stride_se, stride_sm,
                stride_we, stride_wn, stride_wse, stride_wsn,
                stride_oe, stride_om,
                FMT, DOT, DOT_F32, BLOCK_M, BLOCK_N, BLOCK_K, WS_ROWS,
            )
        base += count


# ---------------------------------------------------------------------------------------------
# Plans: dot operands and tile sizes from shapes, dtypes and the chip only


def _dot_kind(fmt: str, x_dtype: torch.dtype, w_dtype: torch.dtype, fp8_dot: bool) -> int:
    if fmt == "dense":
        return _DOT_NATIVE if x_dtype == w_dtype and x_dtype in (torch.bfloat16, torch.float16) else _DOT_F32
    if fmt == "fp8_block":
        return _DOT_FP8 if fp8_dot and x_dtype in (torch.bfloat16, torch.float16) else _DOT_F16
    if fmt in ("mxfp8", "mxfp4_a8"):
        return _DOT_F32  # activations arrive dequantised to float32
    return _DOT_NATIVE if x_dtype == torch.bfloat16 else _DOT_F32  # mxfp4, fp8_block32: bf16 x dots in bf16


def tile_bytes(fmt: str, dot: int, x_bytes: int, w_bytes: int, bm: int, bn: int, bk: int = BLOCK_K) -> int:
    """Estimated on-chip bytes of one step's live tiles (operands, decode temporaries, float32
    product and accumulator)."""
    acc = 4 * bm * bn
    if fmt == "dense":
        op = 4 if dot == _DOT_F32 else x_bytes
        return bm * bk * op + bn * bk * (4 if dot == _DOT_F32 else w_bytes) + acc
    if fmt == "fp8_block":
        if dot == _DOT_FP8:
            return bm * bk + bn * bk + 2 * acc
        # float16 activation values; weight bytes + two int16 temporaries + float16 values
        return 2 * bm * bk + bn * bk * (1 + 2 * 2 + 2) + 2 * acc
    if fmt == "mxfp8":  # float32 activations; weight bytes, int16 + float16 decode, float32 values and scaled copy
        return 4 * bm * bk + bn * bk * (1 + 2 + 2 + 4 + 4) + acc
    if fmt == "fp8_block32":  # x as given (float32 copy for a float32 dot); mxfp8's decode, a bf16 copy for a bf16 dot
        op = 4 if dot == _DOT_F32 else x_bytes
        return bm * bk * op + bn * bk * (1 + 2 + 2 + 4 + 4 + (0 if dot == _DOT_F32 else 2)) + acc
    # mxfp4 (and mxfp4_a8, a float32 dot): packed bytes, joined nibbles, two int32 temporaries (bit building), bf16 values,
    # float32 copies of both operands for a float32 dot
    op = 4 if dot == _DOT_F32 else 2
    w = bn * bk // 2 + bn * bk + 2 * 4 * bn * bk + 2 * bn * bk + (4 * bn * bk if dot == _DOT_F32 else 0)
    return bm * bk * op + w + acc


def plan_tiles(fmt: str, dot: int, x_dtype: torch.dtype, w_dtype: torch.dtype, rows_per_expert: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): the largest tile (BLOCK_M 16..128, at most the power of two covering the
    rows per expert; BLOCK_N 32..128) whose estimated bytes take at most half the unified buffer.
    Ties go to the larger BLOCK_M for quantised weights (each weight tile is decoded once per row
    block) and to the larger BLOCK_N for dense ones."""
    budget = current().ub_bytes // 2
    x_bytes = torch.empty((), dtype=x_dtype).element_size()
    w_bytes = torch.empty((), dtype=w_dtype).element_size()
    top_m = max(16, min(128, next_power_of_2(max(1, rows_per_expert))))
    best = (16, 32)
    best_key = None
    bm = top_m
    while bm >= 16:
        for bn in (128, 64, 32):
            if tile_bytes(fmt, dot, x_bytes, w_bytes, bm, bn) <= budget:
                key = (bm * bn, bm if fmt != "dense" else bn)
                if best_key is None or key > best_key:
                    best, best_key = (bm, bn), key
        bm //= 2
    return best


def fp8_dot_enabled() -> bool:
    """fp8 operands reach tl.dot: a 950 on hardware (never under the interpreter)."""
    return current().has_fp8_dot and not interpreting()


def _contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.shape[-1] == 0 or t.stride(-1) == 1 else t.contiguous()


def launch_gemm(x, weight, weight_scale, fmt, layout, bounds=None, invariant=False, out_dtype=None):
    """out = the product for x in `layout` (weight [E, N, K...] for grouped layouts, [N, K...] for linear).

    invariant (deterministic mode): the tiles are planned for INVARIANT_ROWS rows per expert whatever
    the call holds, so every output element is one fixed sequence of BLOCK_K dots of one tile shape.
    out_dtype: the output's dtype (None: x's); the kernel stores its float32 accumulator in it."""
    k = x.shape[-1]
    w3 = weight if layout != _LINEAR else weight.unsqueeze(0)
    experts, n = w3.shape[0], w3.shape[1]
    x = _contiguous_rows(x)
    out_dtype = out_dtype or x.dtype
    if layout == _MASKED:
        max_m = x.shape[1]
        out = torch.empty(experts, max_m, n, dtype=out_dtype, device=x.device)
        m_arg, rows_per_expert = max_m, max_m
    else:
        m_arg = x.shape[0]
        out = torch.empty(m_arg, n, dtype=out_dtype, device=x.device)
        rows_per_expert = m_arg if layout == _LINEAR else -(-m_arg // max(experts, 1))
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()

    if fmt == "dense" and w3.dtype == torch.float64:
        w3 = w3.float()  # what the reference does with it; no float64 on the cube
    w3 = _contiguous_rows(w3)
    ws3 = None
    if weight_scale is not None:
        ws3 = weight_scale if layout != _LINEAR else weight_scale.unsqueeze(0)
        if fmt == "fp8_block" and ws3.dtype != torch.float32:
            ws3 = ws3.float()
        ws3 = _contiguous_rows(ws3)

    dot = _dot_kind(fmt, x.dtype, w3.dtype, fp8_dot_enabled())
    bm, bn = plan_tiles(fmt, dot, x.dtype, w3.dtype, INVARIANT_ROWS if invariant else rows_per_expert)

    xs = None
    xq = x
    if fmt == "fp8_block":
        limit = bounds[experts:] if layout == _CONTIGUOUS else bounds
        xq, xs = _quantize(x, layout, limit, out_codes=dot == _DOT_FP8)
        if dot == _DOT_FP8:
            xq = xq.view(torch.uint8)
        w3 = w3.view(torch.uint8)  # A2/A3: decoded in-kernel (no fp8 type there); 950: bitcast in-kernel
    elif fmt == "mxfp8":
        # The contract's MX FP8 activation quantiser in torch (bit-exact by definition), dequantised
        # to float32 (exact); the kernel decodes the e4m3 weight bytes and dots in float32.
        xq = quant.dequantize_mxfp8(*quant.quantize_act_mxfp8(x), dtype=torch.float32)
        w3 = w3.view(torch.uint8)
    elif fmt == "fp8_block32":  # W8A16: x as given; the kernel decodes the e4m3 weight bytes
        w3 = w3.view(torch.uint8)
    elif fmt == "mxfp4_a8":
        # W4A8 MX: the same activation quantiser, dequantised to float32 (exact); the mxfp4 weight decode.
        xq = quant.dequantize_mxfp8(*quant.quantize_act_mxfp8(x), dtype=torch.float32)
    x3 = xq if layout == _MASKED else xq.unsqueeze(0)
    xs3 = None if xs is None else (xs if layout == _MASKED else xs.unsqueeze(0))
    out3 = out if layout == _MASKED else out.unsqueeze(0)

    num_n = cdiv(n, bn)
    if layout == _MASKED:
        bound = experts * cdiv(max_m, bm) * num_n
    elif layout == _CONTIGUOUS:
        bound = min(cdiv(m_arg, bm) + experts, m_arg) * num_n  # an expert takes no more tiles than rows
    else:
        bound = cdiv(m_arg, bm) * num_n
    dummy = out
    _gemm_kernel[(cube_grid(bound),)](
        x3, xs3 if xs3 is not None else dummy, w3, ws3 if ws3 is not None else dummy, out3,
        bounds if bounds is not None else dummy,
        m_arg, n, k, experts if layout != _LINEAR else 1,
        x3.stride(0) if layout == _MASKED else 0, x3.stride(1),
        (xs3.stride(0) if layout == _MASKED else 0) if xs3 is not None else 0, xs3.stride(1) if xs3 is not None else 0,
        w3.stride(0), w3.stride(1),
        ws3.stride(0) if ws3 is not None else 0, ws3.stride(1) if ws3 is not None else 0,
        out3.stride(0) if layout == _MASKED else 0, out3.stride(1),
        FMT=_FMT_ID[fmt], LAYOUT=layout, DOT=dot, DOT_F32=upcast_dot(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, WS_ROWS=_SCALE_ROWS.get(fmt, 1),
        **launch_options(multibuffer=True),
    )
    return out


# ---------------------------------------------------------------------------------------------
# The ops


def _check_dtype(x: torch.Tensor) -> None:
    if x.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"the ascend gemm kernels take bfloat16/float16/float32 activations, got {x.dtype}")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    weight_scale: torch.Tensor | None = None,
    fmt: str = "dense",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return _linear(x, weight, weight_scale, fmt, out_dtype, invariant=False)


def linear_invariant(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    weight_scale: torch.Tensor | None = None,
    fmt: str = "dense",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return _linear(x, weight, weight_scale, fmt, out_dtype, invariant=True)


def _linear(x, weight, weight_scale, fmt, out_dtype, invariant):
    gemm_ops.check_linear_args(x, weight, weight_scale, fmt, out_dtype)
    _check_dtype(x)
    return launch_gemm(x, weight, weight_scale, fmt, _LINEAR, invariant=invariant, out_dtype=out_dtype)


def grouped_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    expert_offsets: torch.Tensor | None = None,
    masked_m: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    fmt: str = "dense",
) -> torch.Tensor:
    return _grouped_gemm(x, weight, expert_offsets, masked_m, weight_scale, fmt, invariant=False)


def grouped_gemm_invariant(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    expert_offsets: torch.Tensor | None = None,
    masked_m: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    fmt: str = "dense",
) -> torch.Tensor:
    return _grouped_gemm(x, weight, expert_offsets, masked_m, weight_scale, fmt, invariant=True)


def _grouped_gemm(x, weight, expert_offsets, masked_m, weight_scale, fmt, invariant):
    experts = gemm_ops.check_grouped_args(x, weight, weight_scale, fmt, expert_offsets, masked_m)
    _check_dtype(x)
    if expert_offsets is not None:
        gemm_ops.check_index_vector("expert_offsets", expert_offsets, experts + 1, x.device)
        return launch_gemm(x, weight, weight_scale, fmt, _CONTIGUOUS, bounds=expert_offsets, invariant=invariant)
    gemm_ops.check_index_vector("masked_m", masked_m, experts, x.device)
    return launch_gemm(x, weight, weight_scale, fmt, _MASKED, bounds=masked_m, invariant=invariant)



_NOTE = (
    "Triton (ascend): persistent cube-grid GEMM over expert-major tiles (no host sync); dense; "
    "fp8_block with a vector-grid per-token-group quantiser (bit-exact), fp8 bytes decoded to fp16 "
    "in-kernel (fp8 dot on 950 hardware), scales per 128-K group; mxfp4 unpacked to bf16 in-kernel; "
    "mxfp8 and mxfp4_a8: activations through the MX FP8 quantiser (torch), dequantised, float32 dot; "
    "fp8_block32 (W8A16): e4m3 bytes decoded in-kernel with a scale per 32x32 block, x unquantised"
)

_FORMATS = ("dense", "fp8_block", "mxfp4", "mxfp8", "mxfp4_a8", "fp8_block32")
_INVARIANT_NOTE = f"Triton (ascend): the GEMM above with one tile plan for every row count (planned for {INVARIANT_ROWS} rows per expert)"
REGISTRATIONS = [
    Registration(op="linear", fn=linear, formats=_FORMATS, dtypes=_KERNEL_DTYPES, note=_NOTE),
    Registration(op="grouped_gemm", fn=grouped_gemm, formats=_FORMATS, dtypes=_KERNEL_DTYPES, note=_NOTE + "; contiguous and masked layouts"),
    # Deterministic mode's kernels: below the default ones by priority, chosen only when only batch-invariant ones may be.
    Registration(op="linear", fn=linear_invariant, formats=_FORMATS, dtypes=_KERNEL_DTYPES, priority=-1, batch_invariant=True, note=_INVARIANT_NOTE),
    Registration(op="grouped_gemm", fn=grouped_gemm_invariant, formats=_FORMATS, dtypes=_KERNEL_DTYPES, priority=-1, batch_invariant=True,
                 note=_INVARIANT_NOTE + "; contiguous and masked layouts"),
]
