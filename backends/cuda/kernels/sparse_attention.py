"""Triton kernels: sparse_attention (DeepSeek-V4's shared-KV multi-query attention over listed cache
rows, with a per-head attention sink).

Every head of a query token attends to the same rows (keys and values are one row), so a program
takes a block of BLOCK_H heads of one token as the M dimension of its matrix products and reads
each gathered row block ONCE for all of them (FlashMLA's sparse decoding, in Triton):

    ids       = indices[t, n0 : n0 + BLOCK_N]                      (-1: no row, masked)
    tile[N,D] = kv[ids]                                            (row gather, 16-byte vectors)
    scores    = q[t, heads] @ tile^T * scale                       [BLOCK_H, BLOCK_N] (tensor cores)
    acc      += softmax-weights @ tile                             [BLOCK_H, D] (the same tile as V)

with an online (log-sum-exp, base 2) softmax in float32 in between. The window's list (indices
over kv) and the compressed entries' list (extra_indices over extra_kv) run as one sequence of row
blocks through the same running max / sum / accumulator, so they share one softmax; the sink
joins only the final normaliser: with M = max(m, sink),
    out = acc * 2^(m - M) / (l * 2^(m - M) + 2^(sink - M)),
which is zero for a query that listed no row (acc = l = 0) and never divides by zero.

Grid: (T * head blocks, splits), head blocks fastest: the head blocks of one token (H > 64) are
neighbours in launch order and their row gathers hit L2. Splits: decode has T = batch, and T * head
blocks programs may leave most SMs idle; then each token's row blocks (the window list's, then the
extra list's) are cut into `splits` runs of cdiv(blocks, splits) whole blocks, each program writes
its normalised float32 partial and its log-sum-exp, and a combine kernel merges them with the sink
(deterministic: one [splits, columns] load per (token, head, column block) program, summed as a
fixed tree; the loads are in flight together rather than one split after the other). The split
count comes from host-known shapes only (T, H, the lists' widths, the SM count), never from the
ids, so the launch is CUDA-graph safe and the wrapper never synchronises; the blocks a split takes
are counted per token on the device, over the extra list's `extra_lengths[t]` ids when given (V4
decode pads each HCA list to E_max entries: a token's splits share its valid rows, and the padding
is never loaded, not even its ids). Rows past a list's end or listed as -1 are masked loads: no
memory traffic.

Tiles (bf16/fp16): BLOCK_D = D rounded up to a power of two (the q block stays resident and the
[BLOCK_N, D] tile feeds both products). By the grid's size:
- 64 heads, 64 rows, 8 warps once T * cdiv(H, 64) programs fill half the SMs (prefill, large decode
  batches: each row block is read once per token, twice for 128 heads, the second time from L2);
- a few tokens (16-head programs would leave half the SMs idle: decode of a small batch): 16 heads,
  32 rows, 8 warps, two programs per SM, and splits down to one row block each, so that T * head
  blocks * splits programs fill the GPU; each program is then a short chain (its ids, its gather,
  two products, its partial) and the rows' re-reads by the other head blocks hit L2;
- between: 32 heads, 64 rows (32 with an FP8 cache), 8 warps (4 warps spill the [32, 512]
  accumulator beside the tile).
Fewer heads than BLOCK_H are masked rows (tl.dot wants M >= 16). float32 inputs take input_precision
"ieee" (no tf32 truncation; not on tensor cores) and 16-head, 32-row tiles. Row offsets are int64
(a flat cache of V4's 512-wide rows passes 2^31 elements at 4M rows), as are the token offsets of
q and out.

An FP8 cache (deepinfer.ops.kv_cache_format) is gathered as bytes: its e4m3 values convert
exactly to q's dtype and feed the same dots, and each row's float32 scale (after its values)
multiplies that row's scores and softmax weights, never the tile's elements.

Deterministic mode (`sparse_attention_invariant`): `plan` picks BLOCK_H and the warps from T, and
the split count from T and the lists' widths, which a batch pads to its longest list; a split
boundary then falls elsewhere in a query's rows. The invariant launch takes one tile for every call
(bf16/fp16: the full-grid 64-head tile, 8 warps; float32: 16 x 32, 4 warps; BLOCK_H capped by the
head count) and ONE split: each program folds all of its token's row blocks in list order, window
list first, and normalises with the sink itself (DIRECT, no partials, no combine). Row blocks are
aligned to each list's position 0, and a block of padding (-1, or past extra_lengths) leaves
(m, l, acc) exactly as they were, so a list padded to another width gives the same bits.

Row ids must be < the cache's rows (the reference raises on larger ids; checking here would need
a host synchronisation): the kernel does not check them.

With out_positions (V4: the values carried their key's rotation, undone on the output), the last
step that writes a query's output rows rotates their last R channels: DIRECT programs their [BLOCK_H,
D] tile, the combine its column block (whole pairs: its width is even and aligned). The rows are
rounded to the output dtype first, as the reference's rope reads them (`triton_common.rotate_tail_pairs`).

Deviations (interpreter only): dot operands are upcast to float32 under TRITON_INTERPRET=1
(deepinfer.triton_common.upcast_dot); bf16 outputs are rounded to nearest even by bit arithmetic
(the interpreter truncates float32 -> bfloat16 casts; a GPU rounds to nearest even).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops import kv_cache_format
from deepinfer.ops import sparse_attention as sparse_ops
from deepinfer.triton_common import (
    cdiv,
    float32_dots,
    fp8_views,
    interpreting,
    last_dim_contiguous,
    merge_split_columns,
    next_power_of_2,
    normalise_with_sink,
    pick_splits,
    rotate_tail_pairs,
    softmax_block,
    split_partial,
    split_row_blocks,
    to_bf16_rne,
    upcast_dot,
)
from deepinfer_cuda.kernels.common import Registration, dot_precision, num_sms, pdl_launch, pdl_prologue
from deepinfer_cuda.kernels.fp8_tiles import load_e4m3_tile, use_word_tiles

LOG2E = 1.4426950408889634

# Launch constants (bf16/fp16 | float32 operands).
BLOCK_H_MAX = 64  # heads per program on full grids: all of V4-Flash's 64; 128 heads run as two neighbouring blocks
BLOCK_N_16 = 64  # rows per gathered tile, 16-bit operands: [64, 512] bf16 = 64 KiB
BLOCK_H_F32 = 16  # float32 operands: [16, 512] float32 q + [32, 512] float32 tile + [16, 512] acc
BLOCK_N_F32 = 32
BLOCK_N_FEW = 32  # rows per tile when a few tokens run (decode of a small batch): shorter programs, more splits
NUM_STAGES = 2
CTAS_PER_SM = 1  # a 32- or 64-head program holds a [BLOCK_H, 512] float32 accumulator: one per SM
CTAS_PER_SM_FEW = 2  # 16 heads x 32 rows, 8 warps: at most 128 registers a thread (sm90, FP8), two programs an SM
MIN_ROWS_PER_SPLIT = 128  # a split's partial write (BLOCK_H * D * 4 bytes) stays small next to its reads
MAX_SPLITS = 32
COMBINE_ELEMS = 4096  # partial elements a combine program loads at once ([splits, columns] float32, 4 warps)
COMBINE_WARPS = 4


@triton.jit
def _attend(
    q, m_i, l_i, acc, kv_ptr, scale_ptr, idx_row, width, stride_kv, blk_lo, blk_hi, qk_scale,
    arange_n, offs_d, d_ok,
    D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, WORDS: tl.constexpr,
):
    """Fold the row blocks blk_lo .. blk_hi - 1 of one index list into the running (m, l, acc).
    FP8: kv_ptr holds the cache's bytes and scale_ptr the same memory as float32; WORDS: the tile is read
    through scale_ptr as words and converted by PTX (fp8_tiles: bf16 q, D a power of two, not the interpreter)."""
    for blk in range(blk_lo, blk_hi):
        offs_n = blk * BLOCK_N + arange_n
        ids = tl.load(idx_row + offs_n, mask=offs_n < width, other=-1)
        ok = ids >= 0
        row_off = tl.where(ok, ids, 0).to(tl.int64) * stride_kv
        rows = kv_ptr + row_off
        if WORDS:
            tile = load_e4m3_tile(scale_ptr, row_off // 4, ok, 0, BLOCK_N, D, "")
        else:
            tile = tl.load(rows[:, None] + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
            if FP8:  # e4m3 -> q's dtype is exact; each row's scale multiplies its scores and weights
                tile = tile.to(tl.float8e4nv, bitcast=True).to(q.dtype)
            elif DOT_F32:
                tile = tile.to(tl.float32)
        scores = tl.dot(q, tl.trans(tile), input_precision=DOT_PRECISION) * qk_scale
        if FP8:
            row_scale = tl.load(scale_ptr + (row_off + D) // 4, mask=ok, other=0.0)
            scores = scores * row_scale[None, :]
        scores = tl.where(ok[None, :], scores, float("-inf"))
        p, alpha, m_i, l_i = softmax_block(scores, m_i, l_i, BASE2=True)
        acc = acc * alpha[:, None]
        if FP8:
            p = p * row_scale[None, :]
        acc = tl.dot(p.to(tile.dtype), tile, acc, input_precision=DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _rounded_f32(values, ptrs, MANUAL_RNE: tl.constexpr):
    """float32 values rounded to the output's element type (nearest even), back in float32: what the
    output rotation reads (the reference rotates the rounded output)."""
    if MANUAL_RNE:
        r = to_bf16_rne(values).to(tl.float32)
    else:
        r = values.to(ptrs.dtype.element_ty).to(tl.float32)
    return r


@triton.jit
def _store_out(ptrs, values, mask, MANUAL_RNE: tl.constexpr):
    if MANUAL_RNE:
        tl.store(ptrs, to_bf16_rne(values), mask=mask)
    else:
        tl.store(ptrs, values.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _sparse_attention_kernel(
    q_ptr, kv_ptr, kv_scale_ptr, idx_ptr, xkv_ptr, xkv_scale_ptr, xidx_ptr, xlen_ptr, sinks_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, opos_ptr, ocs_ptr,
    qk_scale,  # softmax_scale * log2(e): scores live in the log2 domain
    K, K2,  # widths of the two index lists
    stride_q_t, stride_q_h,
    stride_kv, stride_idx_t,
    stride_xkv, stride_xidx_t,
    stride_o_t, stride_o_h,
    stride_po_t, stride_po_split, stride_po_h,
    stride_pl_t, stride_pl_split, stride_ocs,
    H: tl.constexpr, D: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ROPE: tl.constexpr, R: tl.constexpr,  # out_positions given: the output's last R channels rotated at them (table ocs_ptr)
    HAS_EXTRA: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,  # extra_lengths given: query t reads extra_indices[t, :extra_lengths[t]] only
    DIRECT: tl.constexpr,  # one split: normalise with the sink and write out, no partials
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MANUAL_RNE: tl.constexpr,
    FP8: tl.constexpr,  # kv is an FP8 cache (deepinfer.ops.kv_cache_format)
    XFP8: tl.constexpr,  # extra_kv is
    FP8_WORDS: tl.constexpr = False,  # FP8 tiles read as words and converted by PTX (fp8_tiles)
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    hb = pid % HEAD_BLOCKS
    t = (pid // HEAD_BLOCKS).to(tl.int64)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    arange_n = tl.arange(0, BLOCK_N)

    q_rows = q_ptr + t * stride_q_t + offs_h.to(tl.int64) * stride_q_h
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    # This token's row blocks: the window list's, then the extra list's up to its length; split
    # `split` takes the split-th run of cdiv(blocks, splits) of them (none past the token's last).
    nb1, width2, nb2, lo, hi = split_row_blocks(K, K2, xlen_ptr, t, split, num_splits, BLOCK_N, HAS_LENGTHS)
    m_i, l_i, acc = _attend(
        q, m_i, l_i, acc, kv_ptr, kv_scale_ptr, idx_ptr + t * stride_idx_t, K, stride_kv, lo, tl.minimum(hi, nb1), qk_scale,
        arange_n, offs_d, d_ok, D, BLOCK_N, DOT_F32, DOT_PRECISION, FP8, FP8 and FP8_WORDS,
    )
    if HAS_EXTRA:
        m_i, l_i, acc = _attend(
            q, m_i, l_i, acc, xkv_ptr, xkv_scale_ptr, xidx_ptr + t * stride_xidx_t, width2, stride_xkv,
            tl.maximum(lo - nb1, 0), tl.minimum(hi - nb1, nb2), qk_scale,
            arange_n, offs_d, d_ok, D, BLOCK_N, DOT_F32, DOT_PRECISION, XFP8, XFP8 and FP8_WORDS,
        )

    mask = h_ok[:, None] & d_ok[None, :]
    if DIRECT:
        sink = tl.load(sinks_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        out = normalise_with_sink(acc, m_i, l_i, sink, BASE2=True)
        if ROPE:
            pos = tl.load(opos_ptr + t).to(tl.int64)
            out = rotate_tail_pairs(_rounded_f32(out, out_ptr, MANUAL_RNE), 0, pos, ocs_ptr, stride_ocs, D, R, BLOCK_H, BLOCK_D)
        o_rows = out_ptr + t * stride_o_t + offs_h.to(tl.int64) * stride_o_h
        _store_out(o_rows[:, None] + offs_d[None, :], out, mask, MANUAL_RNE)
    else:
        out, lse = split_partial(acc, m_i, l_i, BASE2=True)
        po_rows = part_out_ptr + t * stride_po_t + split * stride_po_split + offs_h * stride_po_h
        tl.store(po_rows[:, None] + offs_d[None, :], out, mask=mask)
        tl.store(part_lse_ptr + t * stride_pl_t + split * stride_pl_split + offs_h, lse, mask=h_ok)


@triton.jit
def _sparse_attention_combine_kernel(
    part_out_ptr, part_lse_ptr, sinks_ptr, out_ptr, opos_ptr, ocs_ptr,
    num_splits,
    stride_po_t, stride_po_split, stride_po_h,
    stride_pl_t, stride_pl_split,
    stride_o_t, stride_o_h, stride_ocs,
    H: tl.constexpr, D: tl.constexpr,
    ROPE: tl.constexpr, R: tl.constexpr,
    COL_BLOCKS: tl.constexpr,
    SPLITS: tl.constexpr,  # splits a load: next_power_of_2(num_splits), at most MAX_SPLITS
    BLOCK_C: tl.constexpr,
    MANUAL_RNE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program per (token, head, BLOCK_C columns): every split's partial columns in one
    [SPLITS, BLOCK_C] load (all in flight together, not one split after another), merged as a
    fixed tree with the sink joining the normaliser (deterministic)."""
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    cb = pid % COL_BLOCKS
    rest = pid // COL_BLOCKS
    h = rest % H
    t = (rest // H).to(tl.int64)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < D
    sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
    out = merge_split_columns(
        part_lse_ptr + t * stride_pl_t + h, part_out_ptr + t * stride_po_t + h * stride_po_h, stride_pl_split, stride_po_split,
        num_splits, offs_c, c_ok, SPLITS, True, sink, True,
    )
    if ROPE:  # the column block holds whole pairs (BLOCK_C even, blocks start at multiples of it)
        pos = tl.load(opos_ptr + t).to(tl.int64)
        rounded = tl.reshape(_rounded_f32(out, out_ptr, MANUAL_RNE), (1, BLOCK_C))
        out = tl.reshape(rotate_tail_pairs(rounded, cb * BLOCK_C, pos, ocs_ptr, stride_ocs, D, R, 1, BLOCK_C), (BLOCK_C,))
    _store_out(out_ptr + t * stride_o_t + h.to(tl.int64) * stride_o_h + offs_c, out, c_ok, MANUAL_RNE)


def plan(
    tokens: int, heads: int, width: int, extra_width: int, dot_f32: bool, device: torch.device,
    num_splits: int | None = None, overrides: dict | None = None, invariant: bool = False, fp8: bool = False,
) -> dict:
    """Tiles and split count from host-known shapes only (width, extra_width: the lists' K, K2; fp8:
    a list's cache is FP8, whose tile conversion takes registers).
    `overrides` replaces BLOCK_H / BLOCK_N / num_warps / num_stages / ctas_per_sm (the GPU sweep
    uses it). invariant: one tile and one split for every call (deterministic mode, see the module
    docstring)."""
    sms = num_sms(device)
    if invariant:
        num_splits = 1
    few = not invariant and tokens * cdiv(heads, 16) <= sms // 2  # 16-head programs leave half the SMs idle
    if dot_f32:
        block_h, block_n, warps, ctas = BLOCK_H_F32, BLOCK_N_F32, 4, CTAS_PER_SM_FEW if few else CTAS_PER_SM
    elif few:
        block_h, block_n, warps, ctas = 16, BLOCK_N_FEW, 8, CTAS_PER_SM_FEW  # a few tokens: many short programs (4 warps: 255 registers with FP8)
    elif invariant or tokens * cdiv(heads, BLOCK_H_MAX) >= sms // 2:
        block_h, block_n, warps, ctas = BLOCK_H_MAX, BLOCK_N_16, 8, CTAS_PER_SM  # enough programs: each row block read once per token
    else:  # 8 warps: 4 spill a [32, 512] accumulator beside a [64, 512] tile; an FP8 tile's conversion spills at 64 rows
        block_h, block_n, warps, ctas = 32, BLOCK_N_FEW if fp8 else BLOCK_N_16, 8, CTAS_PER_SM
    cfg = {
        "BLOCK_H": min(block_h, max(16, next_power_of_2(heads))), "BLOCK_N": block_n, "num_warps": warps,
        "num_stages": NUM_STAGES, "ctas_per_sm": ctas,
    }
    cfg.update(overrides or {})
    head_blocks = cdiv(heads, cfg["BLOCK_H"])
    blocks = max(1, cdiv(width, cfg["BLOCK_N"]) + cdiv(extra_width, cfg["BLOCK_N"]))
    if num_splits is None:
        # A few tokens: down to one row block per split, so that their programs fill the GPU (the
        # partials stay in L2); otherwise splits of at least MIN_ROWS_PER_SPLIT rows.
        rows_per_split = cfg["BLOCK_N"] if few else MIN_ROWS_PER_SPLIT
        limit = min(MAX_SPLITS, blocks, max(1, (width + extra_width) // rows_per_split))
        num_splits = pick_splits(tokens * head_blocks, cfg["ctas_per_sm"] * sms, limit)
    return {**cfg, "head_blocks": head_blocks, "num_splits": max(1, min(int(num_splits), blocks, MAX_SPLITS))}


def launch_sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    softmax_scale: float,
    extra_kv: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_lengths: torch.Tensor | None = None,
    out_positions: torch.Tensor | None = None,
    out_cos_sin_cache: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    overrides: dict | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """sparse_attention with an optional forced split count (tests use it to exercise the combine)
    and tile overrides (see `plan`); invariant: the batch-invariant plan."""
    sparse_ops.check_sparse_attention_shapes(q, kv, indices, sinks, extra_kv, extra_indices, extra_lengths, out_positions, out_cos_sin_cache)
    tokens, heads, dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if tokens == 0 or heads == 0 or dim == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    if indices.stride(-1) != 1:
        indices = indices.contiguous()
    if sinks.stride(-1) != 1:
        sinks = sinks.contiguous()
    has_extra = extra_kv is not None
    if has_extra:
        if extra_kv.stride(-1) != 1:
            extra_kv = extra_kv.contiguous()
        if extra_indices.stride(-1) != 1:
            extra_indices = extra_indices.contiguous()
        xkv, xidx, width2 = extra_kv, extra_indices, extra_indices.shape[1]
    else:
        xkv, xidx, width2 = kv, indices, 0  # unused placeholders
    has_lengths = has_extra and extra_lengths is not None
    xlen = extra_lengths.contiguous() if has_lengths else indices  # (unused without lengths)
    rope = out_positions is not None
    opos = out_positions.contiguous() if rope else indices  # (unused without the rotation)
    ocs = last_dim_contiguous(out_cos_sin_cache)[0] if rope else sinks
    rope_dim = ocs.shape[-1] if rope else 0
    fp8, xfp8 = kv_cache_format.is_fp8(kv), has_extra and kv_cache_format.is_fp8(xkv)
    # Not the placeholder: counting it put every sliding layer with an FP8 cache on float32 dots
    # (16-head tiles off the tensor cores, the e2e prefill profile's largest kernel on the H100).
    dot_f32 = float32_dots(q, ((kv, fp8), (xkv, xfp8)) if has_extra else ((kv, fp8),))
    kv, kv_scales = fp8_views(kv) if fp8 else (kv, kv)
    xkv, xkv_scales = fp8_views(xkv) if xfp8 else (xkv, xkv)
    # (FP8 word tiles keep the byte tiles' 32-row plan: 64 rows measured no better with them on the H100, docs/performance.md)
    cfg = plan(tokens, heads, indices.shape[1], width2, dot_f32, q.device, num_splits, overrides, invariant, fp8 or xfp8)
    splits = cfg["num_splits"]
    direct = splits == 1
    if direct:
        part_out = part_lse = out  # unused
        po_strides, pl_strides = (0, 0, 0), (0, 0)
    else:
        part_out = torch.empty(tokens, splits, heads, dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(tokens, splits, heads, dtype=torch.float32, device=q.device)
        po_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2))
        pl_strides = (part_lse.stride(0), part_lse.stride(1))
    block_d = max(16, next_power_of_2(dim))
    manual_rne = interpreting() and q.dtype == torch.bfloat16
    _sparse_attention_kernel[(tokens * cfg["head_blocks"], splits)](
        q, kv, kv_scales, indices, xkv, xkv_scales, xidx, xlen, sinks,
        out, part_out, part_lse, opos, ocs,
        float(softmax_scale) * LOG2E,
        indices.shape[1], width2,
        q.stride(0), q.stride(1),
        kv.stride(0), indices.stride(0),
        xkv.stride(0), xidx.stride(0),
        out.stride(0), out.stride(1),
        *po_strides,
        *pl_strides, ocs.stride(0),
        H=heads, D=dim,
        HEAD_BLOCKS=cfg["head_blocks"],
        ROPE=rope, R=rope_dim,
        BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=block_d,
        HAS_EXTRA=has_extra,
        HAS_LENGTHS=has_lengths,
        DIRECT=direct,
        DOT_F32=dot_f32 or upcast_dot(),
        DOT_PRECISION=dot_precision(dot_f32 or upcast_dot()),
        MANUAL_RNE=manual_rne,
        FP8=fp8, XFP8=xfp8,
        FP8_WORDS=(fp8 or xfp8) and use_word_tiles(q.dtype, dot_f32 or upcast_dot(), next_power_of_2(dim) == dim, cfg),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(q.device),
    )
    if not direct:
        combine_splits(part_out, part_lse, sinks, out, out_positions, ocs if rope else None)
    return out


def combine_splits(
    part_out: torch.Tensor, part_lse: torch.Tensor, sinks: torch.Tensor, out: torch.Tensor,
    out_positions: torch.Tensor | None = None, out_cos_sin_cache: torch.Tensor | None = None,
) -> None:
    """Merge the split partials (part_out [T, splits, H, D] float32, normalised; part_lse [T, splits, H], log2 domain,
    -inf for a split that saw no row) with the sink into out [T, H, D], rotating the output's tail as the op says when
    out_positions is given. The split kernels of this module and of sparse_attention_fp8_gluon.py write these partials."""
    tokens, splits, heads, dim = part_out.shape
    rope = out_positions is not None
    opos = out_positions.contiguous() if rope else part_lse  # (unused without the rotation)
    ocs = last_dim_contiguous(out_cos_sin_cache)[0] if rope else sinks
    chunk = next_power_of_2(splits)
    block_c = max(16, min(max(16, next_power_of_2(dim)), COMBINE_ELEMS // chunk))
    col_blocks = cdiv(dim, block_c)
    _sparse_attention_combine_kernel[(tokens * heads * col_blocks,)](
        part_out, part_lse, sinks, out, opos, ocs,
        splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), ocs.stride(0),
        H=heads, D=dim,
        ROPE=rope, R=ocs.shape[-1] if rope else 0,
        COL_BLOCKS=col_blocks,
        SPLITS=chunk, BLOCK_C=block_c,
        MANUAL_RNE=interpreting() and out.dtype == torch.bfloat16,
        num_warps=COMBINE_WARPS, **pdl_launch(part_out.device),
    )


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    *,
    softmax_scale: float,
    extra_kv: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_lengths: torch.Tensor | None = None,
    out_positions: torch.Tensor | None = None,
    out_cos_sin_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    return launch_sparse_attention(q, kv, indices, sinks, softmax_scale, extra_kv, extra_indices, extra_lengths, out_positions, out_cos_sin_cache)


def sparse_attention_invariant(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    *,
    softmax_scale: float,
    extra_kv: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_lengths: torch.Tensor | None = None,
    out_positions: torch.Tensor | None = None,
    out_cos_sin_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    return launch_sparse_attention(
        q, kv, indices, sinks, softmax_scale, extra_kv, extra_indices, extra_lengths, out_positions, out_cos_sin_cache, invariant=True
    )


REGISTRATIONS = [
    Registration(
        op="sparse_attention",
        fn=sparse_attention,
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        note="Triton (heads as M over gathered row blocks, both lists in one online softmax, sink in the normaliser, split + combine)",
    ),
    Registration(
        op="sparse_attention",
        fn=sparse_attention_invariant,
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        priority=-1,
        batch_invariant=True,
        note="Triton (heads as M over gathered row blocks, both lists in one online softmax, sink in the normaliser; one tile, one split: no partials)",
    ),
]
