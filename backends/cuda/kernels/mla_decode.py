"""Triton kernels: mla_decode (absorbed multi-head latent attention over the paged latent cache).

All H query heads of a request (times its S query tokens, MTP) share one latent KV head, so a
program treats the request's S*H query rows as the M dimension of its matrix products and reads
each cache tile ONCE for all of them:

    scores[M, N] = q_nope[M, C] @ c[N, C]^T + q_rope[M, R] @ k[N, R]^T      (tensor-core dots)
    acc[M, C]   += softmax-weights[M, N] @ c[N, C]                           (the same tile as V)

The tile c/k of BLOCK_N cache rows is loaded once per iteration (16-byte vectors along the row)
and feeds both products, with an online (log-sum-exp) softmax in float32 in between.

An FP8 cache (deepinfer.ops.kv_cache_format: e4m3 values, the token's float32 scale at the row's
end) is read as bytes: the tile's e4m3 values convert exactly to q's dtype and feed the same dots,
and each row's scale multiplies its column of scores and of softmax weights (s * (q . v) and
(p * s) . v), so no element of the tile is ever scaled.

Grid: (row tiles, B, splits). Row tiles: one tile of BLOCK_M >= S*H rows when S*H <= 64 (the
memory-bound case: 16 heads), else tiles of 64 rows (128 heads: compute-bound; the row tiles of one
(request, split) are neighbours in launch order, so the second tile's cache reads hit L2). Splits:
the context is cut into `num_splits` chunks of whole BLOCK_N tiles so B * row tiles * splits fills
the GPU; the count comes from host-known shapes only (B, the block table's width, H, S, the SM
count), never from seq_lens, so the launch is CUDA-graph safe. A split past a request's length
(or before its sliding window) runs no iteration and reports lse = -inf. With one split the
kernel writes the normalised output directly; otherwise it writes per-split normalised partials
and their log-sum-exp, and they are merged in a fixed split order (deterministic): by the last
split program of each (row tile, request) to finish, which counts arrivals in a per-device int32
counter array and resets its counter for the next launch ("fused_combine", the default), or by a
separate combine kernel. With fewer (row tile, request) groups than SMs (small batches, long
contexts: many splits each) those merges would run on a few SMs, each reading every split's partial
in turn, so from `wide_min_splits` splits on a wide combine kernel ("wide_combine") merges instead:
a program per (query row, request, 64 latent columns), 32 splits a load.

Deterministic mode (the batch-invariant registration): the context is cut into splits of a fixed
INVARIANT_TOKENS_PER_SPLIT tokens, whatever the batch, and the partials are always merged by the
separate combine kernel; a request's splits past its length add exact zeros, so its output is the
same bits alone or beside a longer request.

Tiles come from the tuning table by rows per request (`rows_le16` .. `rows_gt64`); the H200
figures behind them, and why the 128-head case stays below its target, are in docs/performance.md.

Deviation (interpreter only): dot operands are upcast to float32 under TRITON_INTERPRET=1
(deepinfer.triton_common.upcast_dot); float32 operands use input_precision="ieee".
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from deepinfer.ops import attention as attention_ops
from deepinfer.ops import kv_cache_format
from deepinfer.triton_common import cdiv, fp8_views, merge_split_columns, next_power_of_2, pick_splits, softmax_block, split_partial, upcast_dot
from deepinfer_cuda.kernels.common import ARRIVALS, Registration, arrival_counters, dot_precision, num_sms, pdl_launch, pdl_prologue
from deepinfer_cuda.kernels.fp8_tiles import load_e4m3_tile, use_word_tiles
from deepinfer_cuda.tuning import config

LOG2E = 1.4426950408889634


@triton.jit
def _tile_rows(bt_row, start, split_end, arange_n, stride_kv_page, stride_kv_row, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row offsets (elements) of the cache tile holding tokens start .. start+BLOCK_N-1, and which are < split_end."""
    offs_n = start + arange_n
    n_ok = offs_n < split_end
    if PAGE % BLOCK_N == 0:
        # The tile lies inside one page: one page number, BLOCK_N consecutive rows.
        page = tl.load(bt_row + start // PAGE, mask=start < split_end, other=0).to(tl.int64)
        row_off = page * stride_kv_page + ((start % PAGE) + arange_n).to(tl.int64) * stride_kv_row
    else:
        page = tl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
        row_off = page * stride_kv_page + (offs_n % PAGE).to(tl.int64) * stride_kv_row
    return row_off, n_ok


@triton.jit
def _load_cols(rows, n_ok, offs, col0, like, WIDTH: tl.constexpr, BLOCK: tl.constexpr, DOT_F32: tl.constexpr, EVICT: tl.constexpr, FP8: tl.constexpr):
    """tile[n, c] = cache row n, columns col0 + c (zeros for rows past the split or columns past WIDTH).
    FP8: the rows are bytes; their e4m3 values come out exactly in `like`'s dtype (float32 with
    DOT_F32), unscaled: the caller applies each row's scale to the scores and the weights."""
    if WIDTH == BLOCK:  # (the fast path: row masks only, no per-column predicates)
        t = tl.load(rows[:, None] + col0 + offs[None, :], mask=n_ok[:, None], other=0.0, eviction_policy=EVICT)
    else:
        t = tl.load(rows[:, None] + col0 + offs[None, :], mask=n_ok[:, None] & (offs < WIDTH)[None, :], other=0.0, eviction_policy=EVICT)
    if FP8:
        t = t.to(tl.float8e4nv, bitcast=True)
        t = t.to(tl.float32) if DOT_F32 else t.to(like.dtype)
    elif DOT_F32:
        t = t.to(tl.float32)
    return t


@triton.jit(do_not_specialize=["tokens_per_split", "num_splits"])
def _mla_decode_split_kernel(
    q_nope_ptr, q_rope_ptr, kv_ptr, scale_ptr, block_table_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, arrivals_ptr,
    qk_scale,  # softmax_scale * log2(e): scores live in the log2 domain
    window,  # sliding window (used only when HAS_WINDOW)
    tokens_per_split,  # a multiple of BLOCK_N
    stride_qn_b, stride_qn_s, stride_qn_h,
    stride_qr_b, stride_qr_s, stride_qr_h,
    stride_kv_page, stride_kv_row,
    stride_bt_b,
    stride_o_b, stride_o_s, stride_o_h,
    stride_po_b, stride_po_split, stride_po_m,
    stride_pl_b, stride_pl_split,
    num_splits,
    S: tl.constexpr, H: tl.constexpr,
    C: tl.constexpr, R: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: write the final output, no partials
    FUSED_COMBINE: tl.constexpr,  # the last split program of a (row tile, request) merges the partials
    DOT_F32: tl.constexpr,  # dot operands in float32 (float32 inputs, mixed dtypes, or the interpreter)
    DOT_PRECISION: tl.constexpr,
    EVICT: tl.constexpr,  # eviction policy of the cache-tile loads ("" or "evict_first": read once, streamed)
    FP8: tl.constexpr,  # an FP8 cache: kv_ptr its bytes, scale_ptr the same memory as float32 (a row's scale at (row + C + R) / 4)
    FP8_WORDS: tl.constexpr = False,  # FP8 tiles read as words and converted by PTX (bf16 q, full-width tiles, not the interpreter)
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < S * H
    s_idx = offs_m // H
    h_idx = offs_m % H
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    c_ok = offs_c < C
    r_ok = offs_r < R

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    # Query row m sits at position seq_len - S + s and sees keys j <= pos (and j > pos - window).
    pos = seq_len - S + s_idx

    split_start = split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)
    lo = split_start
    if HAS_WINDOW:
        # The first row (s = 0) sees the earliest keys; tiles wholly before them are skipped.
        first = tl.maximum(seq_len - S - window + 1, 0)
        lo = tl.maximum(lo, (first // BLOCK_N) * BLOCK_N)

    b64 = b.to(tl.int64)
    q_rows_n = q_nope_ptr + b64 * stride_qn_b + s_idx * stride_qn_s + h_idx * stride_qn_h
    qn = tl.load(q_rows_n[:, None] + offs_c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0.0)
    q_rows_r = q_rope_ptr + b64 * stride_qr_b + s_idx * stride_qr_s + h_idx * stride_qr_h
    qr = tl.load(q_rows_r[:, None] + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    if DOT_F32:
        qn = qn.to(tl.float32)
        qr = qr.to(tl.float32)
    elif not FP8:  # (an FP8 tile comes out in q's dtype)
        qn = qn.to(kv_ptr.dtype.element_ty)
        qr = qr.to(kv_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)

    bt_row = block_table_ptr + b64 * stride_bt_b
    arange_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, split_end, BLOCK_N):
        offs_n = start_n + arange_n
        row_off, n_ok = _tile_rows(bt_row, start_n, split_end, arange_n, stride_kv_page, stride_kv_row, PAGE, BLOCK_N)
        rows = kv_ptr + row_off
        # One load of the tile feeds both products: c as keys (transposed) and as values.
        if FP8_WORDS:  # (fp8_tiles: 32-bit words converted in registers, not bytes through shared memory)
            kc = load_e4m3_tile(scale_ptr, row_off // 4, n_ok, 0, BLOCK_N, BLOCK_C, EVICT)
            kr = load_e4m3_tile(scale_ptr, row_off // 4, n_ok, C, BLOCK_N, BLOCK_R, EVICT)
        else:
            kc = _load_cols(rows, n_ok, offs_c, 0, qn, C, BLOCK_C, DOT_F32, EVICT, FP8)
            kr = _load_cols(rows, n_ok, offs_r, C, qn, R, BLOCK_R, DOT_F32, EVICT, FP8)
        scores = tl.dot(qn, tl.trans(kc), input_precision=DOT_PRECISION)
        scores += tl.dot(qr, tl.trans(kr), input_precision=DOT_PRECISION)
        if FP8:
            # value = e4m3 * row scale: the scale multiplies a key's score and, below, its weight.
            row_scale = tl.load(scale_ptr + (row_off + C + R) // 4, mask=n_ok, other=0.0)
            scores = scores * (row_scale * qk_scale)[None, :]
        else:
            scores = scores * qk_scale
        visible = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))

        p, alpha, m_i, l_i = softmax_block(scores, m_i, l_i, BASE2=True)
        acc = acc * alpha[:, None]
        if FP8:
            p = p * row_scale[None, :]
        acc = tl.dot(p.to(kc.dtype), kc, acc, input_precision=DOT_PRECISION)

    out, lse = split_partial(acc, m_i, l_i, BASE2=True)
    if DIRECT:
        o_rows = out_ptr + b64 * stride_o_b + s_idx * stride_o_s + h_idx * stride_o_h
        tl.store(o_rows[:, None] + offs_c[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & c_ok[None, :])
    else:
        po_rows = part_out_ptr + b64 * stride_po_b + split * stride_po_split + offs_m * stride_po_m
        tl.store(po_rows[:, None] + offs_c[None, :], out, mask=row_ok[:, None] & c_ok[None, :])
        tl.store(part_lse_ptr + b64 * stride_pl_b + split * stride_pl_split + offs_m, lse, mask=row_ok)
        if FUSED_COMBINE:
            # Count the arrivals of this (row tile, request): the program that arrives last merges
            # every split's partial, in split order, so the result does not depend on which one
            # that is. The barrier puts all of this program's stores before its release; the
            # counter is reset for the next launch (CUDA-graph replays included).
            tl.debug_barrier()
            counter = arrivals_ptr + b64 * tl.num_programs(0) + pid_m
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                tl.debug_barrier()
                tl.store(counter, 0)
                _merge_splits(
                    part_out_ptr + b64 * stride_po_b, part_lse_ptr + b64 * stride_pl_b, out_ptr + b64 * stride_o_b,
                    offs_m, row_ok, s_idx, h_idx, offs_c, c_ok, num_splits,
                    stride_po_split, stride_po_m, stride_pl_split, stride_o_s, stride_o_h, BLOCK_M, BLOCK_C,
                )


@triton.jit
def _merge_splits(
    po_base, pl_base, o_base, offs_m, row_ok, s_idx, h_idx, offs_c, c_ok, num_splits,
    stride_po_split, stride_po_m, stride_pl_split, stride_o_s, stride_o_h, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Merge the splits' normalised partials of BLOCK_M rows (weights 2^(lse_k - max lse)), in split
    order; reads go to L2 (.cg): the other splits' stores came from other SMs."""
    top = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for k in range(num_splits):
        top = tl.maximum(top, tl.load(pl_base + k * stride_pl_split + offs_m, mask=row_ok, other=float("-inf"), cache_modifier=".cg"))
    top = tl.where(top == float("-inf"), 0.0, top)
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for k in range(num_splits):
        w = tl.exp2(tl.load(pl_base + k * stride_pl_split + offs_m, mask=row_ok, other=float("-inf"), cache_modifier=".cg") - top)
        part_ptrs = po_base + k * stride_po_split + offs_m[:, None] * stride_po_m + offs_c[None, :]
        part = tl.load(part_ptrs, mask=row_ok[:, None] & c_ok[None, :], other=0.0, cache_modifier=".cg")
        denom += w
        acc += w[:, None] * part
    out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    o_rows = o_base + s_idx * stride_o_s + h_idx * stride_o_h
    tl.store(o_rows[:, None] + offs_c[None, :], out.to(o_base.dtype.element_ty), mask=row_ok[:, None] & c_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _mla_decode_combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    num_splits,
    stride_po_b, stride_po_split, stride_po_m,
    stride_pl_b, stride_pl_split,
    stride_o_b, stride_o_s, stride_o_h,
    H: tl.constexpr, C: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_SPLITS: tl.constexpr, PDL: tl.constexpr = False,
):
    """One program per (query row, request): merge the splits' partials in split order."""
    pdl_prologue(PDL)
    m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_SPLITS)
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    lse_row = part_lse_ptr + b * stride_pl_b + m
    lses = tl.load(lse_row + offs_k * stride_pl_split, mask=offs_k < num_splits, other=float("-inf"))
    top = tl.max(lses, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    denom = 0.0  # summed in split order (not a tree over BLOCK_SPLITS): the same bits for any split count
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    po_row = part_out_ptr + b * stride_po_b + m * stride_po_m
    for k in range(num_splits):
        w = tl.exp2(tl.load(lse_row + k * stride_pl_split) - top)
        # Every split program writes its partial (zeros when it saw no key), so all are finite.
        part = tl.load(po_row + k * stride_po_split + offs_c, mask=c_ok, other=0.0)
        denom += w
        acc += w * part
    out = acc / tl.where(denom > 0.0, denom, 1.0)
    s = m // H
    h = m % H
    tl.store(out_ptr + b * stride_o_b + s * stride_o_s + h * stride_o_h + offs_c, out.to(out_ptr.dtype.element_ty), mask=c_ok)




WIDE_SPLITS = 32  # splits a wide-combine program reads at once
WIDE_COLS = 64  # latent columns per wide-combine program


@triton.jit(do_not_specialize=["num_splits"])
def _mla_decode_wide_combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    num_splits,
    stride_po_b, stride_po_split, stride_po_m,
    stride_pl_b, stride_pl_split,
    stride_o_b, stride_o_s, stride_o_h,
    H: tl.constexpr, C: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_CC: tl.constexpr, PDL: tl.constexpr = False,
):
    """One program per (query row, request, WIDE_COLS latent columns): every split's partial of
    those columns, CHUNK splits a load (the loads of a chunk in flight together, not one split after
    another), summed as a tree within each chunk: deterministic for a given split count."""
    pdl_prologue(PDL)
    m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_c = tl.program_id(2) * BLOCK_CC + tl.arange(0, BLOCK_CC)
    c_ok = offs_c < C
    out = merge_split_columns(
        part_lse_ptr + b * stride_pl_b + m, part_out_ptr + b * stride_po_b + m * stride_po_m, stride_pl_split, stride_po_split,
        num_splits, offs_c, c_ok, CHUNK, BASE2=True,
    )
    s = m // H
    h = m % H
    tl.store(out_ptr + b * stride_o_b + s * stride_o_s + h * stride_o_h + offs_c, out.to(out_ptr.dtype.element_ty), mask=c_ok)


@lru_cache(maxsize=None)
def _config(device: torch.device, variant: str) -> dict:
    return config("mla_decode", variant, device)


def _variant(rows: int) -> str:
    for limit in (16, 32, 64):
        if rows <= limit:
            return f"rows_le{limit}"
    return "rows_gt64"


def plan(
    batch: int, rows: int, capacity: int, device: torch.device, num_splits: int | None, tokens_per_split: int | None, overrides: dict | None = None
):
    """Tiles and split count, from host-known shapes only.

    rows = S*H query rows per request; capacity = max_blocks * block_size tokens (the block table's
    width). Returns (cfg, block_m, row_tiles, tokens_per_split, num_splits).
    """
    if overrides is None:
        return _cached_plan(batch, rows, capacity, device, num_splits, tokens_per_split)
    return _make_plan(batch, rows, capacity, device, num_splits, tokens_per_split, overrides)


def _make_plan(batch, rows, capacity, device, num_splits, tokens_per_split, overrides):
    cfg = _config(device, _variant(rows))
    if overrides:
        cfg = {**cfg, **overrides}
    block_n = cfg["BLOCK_N"]
    if rows <= 64:
        block_m = max(16, next_power_of_2(rows))
    else:
        block_m = cfg["BLOCK_M"]
    row_tiles = cdiv(rows, block_m)
    tiles = max(1, cdiv(capacity, block_n))
    if tokens_per_split is not None:
        per_split = max(1, cdiv(tokens_per_split, block_n))
    else:
        if num_splits is None:
            limit = min(cfg["max_splits"], tiles, max(1, capacity // cfg["min_tokens_per_split"]))
            num_splits = pick_splits(batch * row_tiles, cfg["ctas_per_sm"] * num_sms(device), limit)
        num_splits = max(1, min(num_splits, tiles))
        per_split = cdiv(tiles, num_splits)
    num_splits = cdiv(tiles, per_split)
    return cfg, block_m, row_tiles, per_split * block_n, num_splits


@lru_cache(maxsize=1024)
def _cached_plan(batch, rows, capacity, device, num_splits, tokens_per_split):
    return _make_plan(batch, rows, capacity, device, num_splits, tokens_per_split, None)


def merges_wide(cfg: dict, splits: int, groups: int, device: torch.device) -> bool:
    """Whether `splits` partials of `groups` (row tile, request) groups merge on the wide combine kernel: many splits
    and fewer groups than SMs (the tuning entry's wide_combine / wide_min_splits; launch_mla_decode_with_handle says why)."""
    return bool(cfg.get("wide_combine", False)) and splits >= cfg.get("wide_min_splits", 8) and groups < num_sms(device)


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, splits: int, wide: bool) -> None:
    """Merge split partials (part_out [B, splits, rows, C] float32, part_lse [B, splits, rows]) into out [B, S, H, C]:
    one program per (query row, request), or (wide) per (query row, request, WIDE_COLS columns)."""
    batch, _, rows, latent_dim = part_out.shape
    args = (part_out, part_lse, out, splits, part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1), out.stride(2))  # fmt: skip
    ccfg = _config(out.device, "combine")
    if wide:
        _mla_decode_wide_combine_kernel[(rows, batch, cdiv(latent_dim, WIDE_COLS))](
            *args, H=out.shape[2], C=latent_dim, CHUNK=WIDE_SPLITS, BLOCK_CC=WIDE_COLS, num_warps=ccfg["num_warps"], **pdl_launch(out.device),
        )
    else:
        _mla_decode_combine_kernel[(rows, batch)](
            *args, H=out.shape[2], C=latent_dim, BLOCK_C=max(16, next_power_of_2(latent_dim)), BLOCK_SPLITS=max(2, next_power_of_2(splits)),
            num_warps=ccfg["num_warps"], **pdl_launch(out.device),
        )


def launch_mla_decode(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    sliding_window: int | None = None,
    *,
    num_splits: int | None = None,
    tokens_per_split: int | None = None,
    overrides: dict | None = None,
    separate_combine: bool = False,
    tiles_of_one_query: bool = False,
) -> torch.Tensor:
    """mla_decode with an optional forced split (tests use it to exercise the combine kernel),
    tuning-entry overrides (the bench sweep uses them), the combine kernel forced, and the tiles
    planned for one query token whatever S is (tiles_of_one_query: deterministic mode)."""
    out, _ = launch_mla_decode_with_handle(
        q_nope, q_rope, kv_cache, block_table, seq_lens, softmax_scale, sliding_window,
        num_splits=num_splits, tokens_per_split=tokens_per_split, overrides=overrides, separate_combine=separate_combine,
        tiles_of_one_query=tiles_of_one_query,
    )
    return out


def launch_mla_decode_with_handle(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    sliding_window: int | None = None,
    *,
    num_splits: int | None = None,
    tokens_per_split: int | None = None,
    overrides: dict | None = None,
    separate_combine: bool = False,
    tiles_of_one_query: bool = False,
):
    """`launch_mla_decode`, also returning what launching the split kernel returned: its compiled
    handle (registers, spills, shared memory: the bench sweep reports them), None for empty inputs."""
    batch, num_queries, heads, latent_dim = q_nope.shape
    rope_dim = q_rope.shape[-1]
    _, page, _ = kv_cache.shape
    attention_ops.check_mla_decode_shapes(q_nope, q_rope, kv_cache, sliding_window)
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache rows must be contiguous (last stride 1)")
    fp8 = kv_cache_format.is_fp8(kv_cache)
    kv_bytes, kv_scales = fp8_views(kv_cache) if fp8 else (kv_cache, kv_cache)
    out = torch.empty(batch, num_queries, heads, latent_dim, dtype=q_nope.dtype, device=q_nope.device)
    if batch == 0 or num_queries == 0 or heads == 0 or latent_dim == 0:
        return out, None
    if q_nope.stride(-1) != 1:
        q_nope = q_nope.contiguous()
    if q_rope.stride(-1) != 1:
        q_rope = q_rope.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()

    rows = num_queries * heads
    capacity = block_table.shape[1] * page
    # tiles_of_one_query: the configuration (BLOCK_N, BLOCK_M, ...) an S = 1 call takes, so each
    # query's reduction order is the same whether it comes alone (decode) or among S (speculative
    # verification); its rows then span whole tiles of their own or share one with the same order.
    plan_rows = heads if tiles_of_one_query else rows
    cfg, block_m, row_tiles, per_split, splits = plan(batch, plan_rows, capacity, q_nope.device, num_splits, tokens_per_split, overrides)
    row_tiles = cdiv(rows, block_m)
    block_c = max(16, next_power_of_2(latent_dim))
    block_r = max(16, next_power_of_2(rope_dim))
    # (an FP8 tile is converted to q's dtype in the kernel, exactly)
    dot_f32 = upcast_dot() or q_nope.dtype == torch.float32 or (not fp8 and (kv_cache.dtype == torch.float32 or q_nope.dtype != kv_cache.dtype))
    fp8_words = fp8 and use_word_tiles(q_nope.dtype, dot_f32, block_c == latent_dim and block_r == rope_dim, cfg)
    direct = splits == 1
    # Few (row tile, request) groups: their merges would be that many programs, each reading every
    # split's partial in turn, on a mostly idle GPU (B1 ctx8192 H16: 41 us, most of it the merge);
    # the wide combine spreads them over rows x column blocks instead.
    wide = not direct and not separate_combine and merges_wide(cfg, splits, row_tiles * batch, q_nope.device)
    fused = not direct and not wide and not separate_combine and cfg.get("fused_combine", False) and row_tiles * batch <= ARRIVALS
    arrivals = arrival_counters(q_nope.device, "mla_decode") if fused else seq_lens  # seq_lens: an unused placeholder
    if direct:
        part_out = out  # unused
        part_lse = out
        po_strides = (0, 0, 0)
        pl_strides = (0, 0)
    else:
        part_out = torch.empty(batch, splits, rows, latent_dim, dtype=torch.float32, device=q_nope.device)
        part_lse = torch.empty(batch, splits, rows, dtype=torch.float32, device=q_nope.device)
        po_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2))
        pl_strides = (part_lse.stride(0), part_lse.stride(1))
    grid = (row_tiles, batch, splits)
    handle = _mla_decode_split_kernel[grid](
        q_nope, q_rope, kv_bytes, kv_scales, block_table, seq_lens,
        out, part_out, part_lse, arrivals,
        float(softmax_scale) * LOG2E,
        int(sliding_window or 0),
        per_split,
        q_nope.stride(0), q_nope.stride(1), q_nope.stride(2),
        q_rope.stride(0), q_rope.stride(1), q_rope.stride(2),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        *po_strides,
        *pl_strides,
        splits,
        S=num_queries, H=heads, C=latent_dim, R=rope_dim,
        BLOCK_C=block_c, BLOCK_R=block_r,
        PAGE=page,
        BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"],
        HAS_WINDOW=sliding_window is not None,
        DIRECT=direct,
        FUSED_COMBINE=fused,
        DOT_F32=dot_f32,
        DOT_PRECISION=dot_precision(dot_f32),
        EVICT=cfg.get("evict", ""),
        FP8=fp8,
        FP8_WORDS=fp8_words,
        # float32 q over an FP8 cache (a test dtype): the bytes are pipelined and converted to float32
        # tiles; with the bf16 tiles' stages that needed 258 KB of shared memory on the H200 (232 KB)
        num_warps=cfg.get("fp8_num_warps", cfg["num_warps"]) if fp8 else cfg["num_warps"],
        num_stages=1 if fp8 and dot_f32 else cfg["num_stages"], **pdl_launch(q_nope.device),
    )
    if wide or (not direct and not fused):
        merge_splits(part_out, part_lse, out, splits, wide)
    return out, handle


def mla_decode(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    return launch_mla_decode(q_nope, q_rope, kv_cache, block_table, seq_lens, softmax_scale, sliding_window)


# Deterministic mode's split size; a multiple of every table's BLOCK_N. Not yet tuned on the H200.
INVARIANT_TOKENS_PER_SPLIT = 512


def mla_decode_invariant(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    return launch_mla_decode(q_nope, q_rope, kv_cache, block_table, seq_lens, softmax_scale, sliding_window,
                             tokens_per_split=INVARIANT_TOKENS_PER_SPLIT, separate_combine=True, tiles_of_one_query=True)  # fmt: skip


REGISTRATIONS = [
    Registration(
        op="mla_decode",
        fn=mla_decode,
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        note="Triton (heads as M, split-KV + deterministic combine)",
    ),
    Registration(
        op="mla_decode",
        fn=mla_decode_invariant,
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        priority=-1,
        batch_invariant=True,
        note=f"Triton (the kernel above with splits of {INVARIANT_TOKENS_PER_SPLIT} tokens whatever the batch and one query's tiles "
        "whatever S, merged by the combine kernel)",
    ),
]
