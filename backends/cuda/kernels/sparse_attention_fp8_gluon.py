"""Gluon kernel (SM90): `sparse_attention` over FP8 caches, warp-specialised (DeepSeek-V4's decode attention).

Chosen by sparse_attention_path.py (backend option sparse_attention_path): on SM90 GPUs whose Triton has Gluon for
Hopper, by the default, auto, for FP8-cache calls of at least AUTO_MIN_QUERIES queries (one query ran faster on the tl
kernel), by sparse_attention_path=gluon for every call it serves. It passed `deepinfer conformance --backend cuda --op
sparse_attention` with sparse_attention_path=gluon (27 cases, H200, 2026-12-07; docs/measurements/2026-12-07/h200/).
The calls it does not serve (`not_served`) go to the tl kernel, which stays what the interpreter checks in CI;
deterministic mode keeps the tl kernel's batch-invariant registration. Compiled in CI by `deepinfer bench compile
--case gluon` (wgmma, no spills). Its attention warpgroups, split plan and launch are sparse_attention_gluon_common.py's,
shared with the bf16-cache kernel (sparse_attention_gluon.py); this module holds the converting warpgroup.

Semantics: the op's (deepinfer/ops/sparse_attention.py) for bf16 q [T, H, 512] over FP8 caches (kv_cache_format: a
row is 512 e4m3 values, its float32 scale at byte 512, 528 bytes). Each query attends to the rows its window list
(`indices` over kv) and its second list (`extra_indices` over extra_kv, the first extra_lengths[t] ids when given)
name, -1 for none, in one online softmax (log2 domain, float32); value = e4m3 * row scale, applied to a row's score
and to its softmax weight (s * (q . v) and (p * s) . v), as the tl kernel does. The sink joins the final normaliser.
With one split the kernel writes the output itself (the sink, and with out_positions the tail's rotation, in its
epilogue); with several it writes exactly the tl kernel's split partials (part_out [T, splits, H, 512] float32,
part_lse [T, splits, H] log2 domain, -inf for a split that saw no row) and sparse_attention.py's combine kernel
(`combine_splits`) merges them with the sink and rotates the tail.

Why: the tl kernel reads the FP8 cache slower than the bf16 cache although it reads half the bytes (docs/performance.md,
FP8 readers): the same warps gather, convert, run both products and the softmax. Here, as in FlashMLA's sparse FP8
decode kernel for SM90, the gather and conversion run in their own warpgroup while two others run the tensor cores.

Schedule: one program per (64-head tile, query, split), grid (head tiles, T, splits); the query's rows in tiles of 64
(the window list's blocks, then the extra list's, as the tl kernel orders them), a split a run of whole tiles. Three
partitions, 12 warps:
- converting warpgroup (a worker, 4 warps): per tile, the 64 row ids (loaded two tiles ahead), then the rows' e4m3
  values as 32-bit words (16-byte loads: a thread holds 16 bytes of two rows per 64-byte column chunk, 64 registers a
  tile) and scales; converts them to "raw" bf16 (mla_decode_fp8_gluon's E4M3X4_TO_RAW_BF16X4_PTX: value * 2^-112,
  exact; the row scale carries 2^112 back) into one of two bf16 stages (8 NVMMA-swizzled [64, 64] chunks, written
  through an int32 view: 16-byte shared stores), the scales beside them (-1 for a row not read: id -1, past its list or
  the split's end; those rows load as zeros). Tile j + 1's words are loaded while tile j is converted, chunk by chunk
  into the registers each converted chunk frees.
- softmax warpgroup (the default partition, 4 warps): loads the query's q [64 heads, 512] into shared memory; per
  tile, the scores q . k^T (64 x 64: 8 wgmma groups m64n64k16, q from shared memory), times the rows' scales,
  masked, the online softmax (it alone sees every score: no maxima to exchange), p * scale in bf16 to shared memory
  with the rescale factor alpha for the value warpgroup, then acc = acc * alpha + p . v[:, 0:256] with p in
  registers (m64n256k16 over a [64, 256] view of the stage: four swizzled [64, 64] chunks in a row are one [64, 256]
  128-byte-swizzled tile), and the next tile's scores issued behind it (waited for in the same iteration).
- value warpgroup (a worker, 4 warps): per tile, acc = acc * alpha + p . v[:, 256:512], p read by the wgmma from
  shared memory (m64n256k16: each 16-column slice of p read once for all 256 columns; with p in registers ptxas
  spilled, and at N = 64 serialised the wgmmas). Both attention warpgroups release the stage when their products
  are done; p and alpha are double-buffered, so the softmax warpgroup's next tile overlaps the value warpgroup's
  products.
No wgmma is in flight across a loop's back edge (ptxas would serialise them all). The epilogue: the softmax
warpgroup turns (m, l) and the sink into one factor per row (DIRECT: w / (l w + 2^(sink - M)), M = max(m, sink),
w = 2^(m - M); split: 1 / l and the lse) and hands it to the value warpgroup through shared memory; each stores its
256 columns; DIRECT with out_positions: the value warpgroup rotates the tail pairs (rounded to bf16 first, as the op
reads them).
Shared memory: q 64 KiB + two bf16 stages 128 KiB + p 16 KiB + scales, alphas, factors 1.3 KiB + 9 mbarriers (about
210 KiB of the 227 an SM90 block may have; one CTA per SM). Registers (setmaxnreg, `PARTITION_REGS`): 12 warps leave
504 a thread of each warpgroup triple; the value warpgroup takes 160, the converter 104 and the softmax warpgroup the
other 240 (each attention warpgroup holds a [64, 256] float32 accumulator, 128 registers; the softmax one also the
64 x 64 scores of two tiles and p). Without spills only because q's chunks are indexed through a zero the compilers
cannot see (`_hidden_zero`, as in mla_decode_fp8_gluon.py: else LLVM hoists q's descriptors out of the loop).
Compiled for sm90 with Triton 3.6 and 3.9: no spills, no wgmma serialisation (ptxas -v).

Served (`not_served`, and `launch_sparse_attention_fp8_gluon` returns None so callers fall back): bf16 q [T, H, 512]
with H <= 64 or a multiple of 64 (64-row head tiles; a head count below 64 pads the wgmma's M), FP8 kv (and FP8
extra_kv when given) of 528-byte rows, 16-byte aligned base and row stride, int32 lists, an output rotation of at
most 256 channels (V4's 64: inside the value warpgroup's half), at most 65535 queries (the grid's second dimension). Splits as the
tl kernel splits (host shapes only, CUDA-graph safe: pick_splits over one CTA per SM, down to one tile a split for few
queries); a forced num_splits is honoured.

Triton 3.6 (the GPU machine) and 3.9 differ in two names used here: the partition-wide barrier (3.6
`thread_barrier`, 3.9 `barrier`) and the shared-memory reinterpretation (3.6 `_reinterpret`, 3.9 `reinterpret`):
gluon_hopper.py's shims.
Not a registration module: sparse_attention_path.py registers the op.
"""

from __future__ import annotations

import torch

from deepinfer.ops import kv_cache_format
from deepinfer.ops import sparse_attention as sparse_ops
from deepinfer_cuda.kernels import sparse_attention_gluon_common as common
from deepinfer_cuda.kernels.common import num_sms
from deepinfer_cuda.kernels.gluon_hopper import GLUON_IMPORT_ERROR

# the e4m3 -> raw bf16 chunk conversion: the FP8 mla_decode kernel's (the same converter)
from deepinfer_cuda.kernels.mla_decode_fp8_gluon import RAW_UNIT_VALUE, _put_chunk
from deepinfer_cuda.kernels.sparse_attention_gluon_common import DIM, SparseGluonPlan

if GLUON_IMPORT_ERROR is None:  # (else the launch declines every call)
    from deepinfer_cuda.kernels.gluon_hopper import fence_async_shared, gl, gluon, mbarrier, reinterpret_shared
    from deepinfer_cuda.kernels.gluon_hopper import sync_warps as _sync_warps
    from deepinfer_cuda.kernels.sparse_attention_gluon_common import (
        allocate_shared,
        prefetch_rows,
        query_tiles,
        row_pointers,
        softmax_partition,
        value_partition,
    )

BLOCK_N = 64  # cache rows per tile
STAGES = 2  # bf16 stages (64 KiB each)
PARTITION_REGS = (160, 104)  # setmaxnreg of the value warpgroup and of the converting warpgroup (the softmax warpgroup: 504 less both)
# The converter asks L2 for the rows of the tile two ahead (cp.async.bulk.prefetch.L2) when it learns their ids, a tile
# before it loads them into registers (it holds one tile in flight: on an H100 at B256 it waited on those loads about
# half its cycles, ncu 2026-12-07). Off: on that H100 its GPU tests passed but it moved the kernel by 2% at most (B64 /
# B256 39.4 / 102.6 against 39.8 / 104.5 us in CUDA graphs): the rows' DRAM latency is not what holds the converter.
L2_PREFETCH = False


if GLUON_IMPORT_ERROR is None:
    RAW_UNIT = gl.constexpr(RAW_UNIT_VALUE)

    @gluon.jit
    def _converter(kv_words, xkv_words, idx_row, xidx_row, bf_words, scale_smem, bf_ready, bf_empty,
                   lo, num_tiles, nb1, width, width2, stride_kv, stride_xkv,
                   D: gl.constexpr, BLOCK_N: gl.constexpr, HAS_EXTRA: gl.constexpr, L2_PREFETCH: gl.constexpr):
        """One warpgroup: tile j's e4m3 rows (loaded while tile j - 1 was converted) -> bf16 stage j % 2, chunk by chunk,
        each chunk's load of tile j + 1 issued once it is converted (into the registers it frees); tile j + 2's ids
        loaded a tile ahead of its rows (with L2_PREFETCH its rows asked of L2 then: `prefetch_rows`). The rows are
        carried as 32-bit words (8 chunks x 8 registers a thread)."""
        NUM_CHUNKS: gl.constexpr = D // 64
        SCALE_WORD: gl.constexpr = D // 4  # a row's scale: the word after its values
        # [64, 16] words (64 bytes of 64 rows): a thread holds 16 consecutive bytes of two rows (r and r + 32): 16-byte
        # global loads; converted, 32 bytes of bf16 a row: two 16-byte shared stores; a warp's cover 8 rows x 128
        # bytes, one swizzle atom (no bank conflicts)
        words_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, words_layout))
        cols = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, words_layout)), 0)
        end = lo + num_tiles
        # tile 0's words and scales, tile 1's row pointers
        # (word pointers: row offsets in bytes >> 2, multiples of 16 bytes)
        ptrs, ok = row_pointers(kv_words, xkv_words, idx_row, xidx_row, lo, end, nb1, width, width2, stride_kv, stride_xkv, rows, BLOCK_N, HAS_EXTRA,
                                2, 4)
        p = gl.expand_dims(ptrs, 1) + cols
        m = gl.expand_dims(ok, 1)
        x0 = gl.load(p, mask=m, other=0)
        x1 = gl.load(p + 16, mask=m, other=0)
        x2 = gl.load(p + 32, mask=m, other=0)
        x3 = gl.load(p + 48, mask=m, other=0)
        x4 = gl.load(p + 64, mask=m, other=0)
        x5 = gl.load(p + 80, mask=m, other=0)
        x6 = gl.load(p + 96, mask=m, other=0)
        x7 = gl.load(p + 112, mask=m, other=0)
        xs = gl.load(ptrs + SCALE_WORD, mask=ok, other=0)
        x_ok = ok
        ptrs1, ok1 = row_pointers(kv_words, xkv_words, idx_row, xidx_row, lo + 1, end, nb1, width, width2, stride_kv, stride_xkv, rows,
                                  BLOCK_N, HAS_EXTRA, 2, 4)
        for j in range(num_tiles):
            t = j % 2
            ptrs2, ok2 = row_pointers(kv_words, xkv_words, idx_row, xidx_row, lo + j + 2, end, nb1, width, width2, stride_kv, stride_xkv,
                                      rows, BLOCK_N, HAS_EXTRA, 2, 4)
            if L2_PREFETCH:
                prefetch_rows(ptrs2, ok2, D + 16)  # a row: its values, its scale, padding (528 bytes)
            p = gl.expand_dims(ptrs1, 1) + cols
            m = gl.expand_dims(ok1, 1)
            mbarrier.wait(bf_empty.index(t), ((j // 2) & 1) ^ 1)  # both attention warpgroups are done with tile j - 2
            _put_chunk(x0, bf_words.index(t * NUM_CHUNKS + 0))
            y0 = gl.load(p, mask=m, other=0)
            _put_chunk(x1, bf_words.index(t * NUM_CHUNKS + 1))
            y1 = gl.load(p + 16, mask=m, other=0)
            _put_chunk(x2, bf_words.index(t * NUM_CHUNKS + 2))
            y2 = gl.load(p + 32, mask=m, other=0)
            _put_chunk(x3, bf_words.index(t * NUM_CHUNKS + 3))
            y3 = gl.load(p + 48, mask=m, other=0)
            _put_chunk(x4, bf_words.index(t * NUM_CHUNKS + 4))
            y4 = gl.load(p + 64, mask=m, other=0)
            _put_chunk(x5, bf_words.index(t * NUM_CHUNKS + 5))
            y5 = gl.load(p + 80, mask=m, other=0)
            _put_chunk(x6, bf_words.index(t * NUM_CHUNKS + 6))
            y6 = gl.load(p + 96, mask=m, other=0)
            _put_chunk(x7, bf_words.index(t * NUM_CHUNKS + 7))
            y7 = gl.load(p + 112, mask=m, other=0)
            ys = gl.load(ptrs1 + SCALE_WORD, mask=ok1, other=0)
            # the scale words as float32, the raw tile's 2^-112 undone here; -1 for a row not read (a real scale is
            # >= 0: the softmax warpgroup masks the rows by it)
            scale_smem.index(t).store(gl.where(x_ok, xs.to(gl.float32, bitcast=True) * RAW_UNIT, -1.0))
            fence_async_shared()  # the bf16 stage is read by wgmma (the async proxy)
            _sync_warps()  # every warp's stores are done
            mbarrier.arrive(bf_ready.index(t))
            x0, x1, x2, x3, x4, x5, x6, x7, xs, x_ok = y0, y1, y2, y3, y4, y5, y6, y7, ys, ok1
            ptrs1, ok1 = ptrs2, ok2

    @gluon.jit
    def _sparse_attention_fp8_ws_kernel(
        q_ptr,
        kv_words, idx_ptr,  # the window cache as int32 words ([N, 132]: a row's 512 e4m3 codes, its float32 scale, zeros)
        xkv_words, xidx_ptr, xlen_ptr,  # the extra list's (placeholders without HAS_EXTRA / HAS_LENGTHS)
        sinks_ptr,
        dst_ptr,  # DIRECT: the output [T, H, D]; else the split partials [T, splits, H, D] float32
        part_lse_ptr, opos_ptr, ocs_ptr,
        qk_scale,  # softmax_scale * log2(e)
        K, K2,  # the lists' widths
        stride_q_t, stride_q_h,
        stride_kv, stride_idx_t,  # the cache's row stride in bytes
        stride_xkv, stride_xidx_t,
        stride_o_t, stride_o_h, stride_po_split,  # dst's (stride_po_split: 0 when DIRECT)
        stride_pl_t, stride_pl_split,
        stride_ocs,
        H: gl.constexpr, D: gl.constexpr, R: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        HAS_EXTRA: gl.constexpr, HAS_LENGTHS: gl.constexpr,
        ROPE: gl.constexpr,  # DIRECT with out_positions: the output's last R channels rotated back
        DIRECT: gl.constexpr,
        REGS_VALUE: gl.constexpr, REGS_CONVERT: gl.constexpr,
        L2_PREFETCH: gl.constexpr,  # the converter asks L2 for the rows of the tile two ahead (common.prefetch_rows)
        num_warps: gl.constexpr,
    ):
        gl.static_assert(D == 512, "the converter's tile is 8 chunks of 64 values")
        gl.static_assert(BLOCK_N == 64, "the scores' tile is the value products' K (one 64-column chunk)")
        gl.static_assert(STAGES == 2, "the converter fills two stages")
        NUM_CHUNKS: gl.constexpr = D // 64
        t = gl.program_id(1)
        nb1, width2, lo, num_tiles = query_tiles(xlen_ptr, K, K2, BLOCK_N, HAS_LENGTHS)
        t64 = t.to(gl.int64)

        q_smem, bf_smem, bf_halves, p_smem, scale_smem, alpha_smem, fin_smem, bf_ready, bf_empty, p_ready, p_free, fin_bar = allocate_shared(
            D, BLOCK_M, BLOCK_N, STAGES, 1)
        # the stages as int32 pairs of bf16 for the converting warps (the 128-byte swizzle moves 16-byte units: the same
        # bytes for 16- and 32-bit elements); the scales are the rows' scales * 2^112
        chunk_words: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        bf_words = reinterpret_shared(bf_smem, gl.int32, [STAGES * NUM_CHUNKS, BLOCK_N, 32], chunk_words)

        gl.warp_specialize(
            [
                (softmax_partition, (q_ptr, q_smem, bf_smem, bf_halves, scale_smem, p_smem, alpha_smem, fin_smem, bf_ready, bf_empty, p_ready, p_free,
                                     fin_bar, sinks_ptr, dst_ptr, part_lse_ptr, num_tiles, qk_scale,
                                     stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_po_split, stride_pl_t, stride_pl_split,
                                     H, D, BLOCK_M, BLOCK_N, STAGES, DIRECT, False, False,
                                     sinks_ptr, sinks_ptr, 0, 0, False)),  # (no fused combine: the combine kernel merges splits)
                (value_partition, (bf_halves, p_smem, alpha_smem, fin_smem, bf_ready, bf_empty, p_ready, p_free, fin_bar,
                                   dst_ptr, opos_ptr, ocs_ptr, num_tiles, stride_o_t, stride_o_h, stride_po_split, stride_ocs,
                                   H, D, R, BLOCK_M, STAGES, ROPE, False,
                                   sinks_ptr, part_lse_ptr, sinks_ptr, sinks_ptr, stride_pl_t, stride_pl_split, 0, 0, False)),
                (_converter, (kv_words, xkv_words, idx_ptr + t64 * stride_idx_t, xidx_ptr + t64 * stride_xidx_t, bf_words, scale_smem,
                              bf_ready, bf_empty, lo, num_tiles, nb1, K, width2, stride_kv, stride_xkv, D, BLOCK_N, HAS_EXTRA, L2_PREFETCH)),
            ],
            [4, 4],
            [REGS_VALUE, REGS_CONVERT],
        )


# ---------------------------------------------------------------------------------------------
# Host side: which calls the kernel serves, its plan and launch


def _cache_not_served(name: str, cache: torch.Tensor) -> str | None:
    if not kv_cache_format.is_fp8(cache):
        return f"{name} is not an FP8 cache"
    if cache.dim() != 2 or cache.shape[1] != DIM + kv_cache_format.ROW_TAIL:
        return f"{name} {tuple(cache.shape)}: wants [rows, {DIM + kv_cache_format.ROW_TAIL}]"
    if cache.stride(1) != 1 or cache.stride(0) % 16 or cache.data_ptr() % 16:
        return f"{name}'s rows are not contiguous 16-byte aligned rows"
    return None


def not_served(q, kv, indices, extra_kv=None, extra_indices=None, out_cos_sin_cache=None) -> str | None:
    """Why this kernel does not serve a call (None: it does). Devices, shapes, dtypes, strides and alignment only."""
    if (why := common.call_not_served(q, indices, extra_indices, out_cos_sin_cache)) is not None:
        return why
    for name, cache in (("kv", kv), ("extra_kv", extra_kv)):
        if cache is not None and (why := _cache_not_served(name, cache)) is not None:
            return why
    return None


def plan(tokens: int, heads: int, width: int, extra_width: int, device: torch.device, num_splits: int | None = None) -> SparseGluonPlan:
    """Head tiles and splits from host-known shapes (width, extra_width: the lists' K, K2): common.split_plan's rule over
    this GPU's SMs, 64-row tiles through two stages."""
    return common.split_plan(tokens, heads, width, extra_width, num_sms(device), num_splits, BLOCK_N, STAGES)


def _cache_words(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """An FP8 cache as the kernel reads it: int32 words, the row stride in bytes."""
    return cache.view(torch.int32), cache.stride(0)


def launch_sparse_attention_fp8_gluon(
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
    l2_prefetch: bool | None = None,
) -> torch.Tensor | None:
    """sparse_attention.launch_sparse_attention's arguments; None for a call this kernel does not serve (`not_served`:
    the caller falls back). Several splits: the partials are merged by sparse_attention.py's combine kernel.
    l2_prefetch: the converter's L2 prefetch (L2_PREFETCH unless given)."""
    sparse_ops.check_sparse_attention_shapes(q, kv, indices, sinks, extra_kv, extra_indices, extra_lengths, out_positions, out_cos_sin_cache)
    if not_served(q, kv, indices, extra_kv, extra_indices, out_cos_sin_cache) is not None:
        return None
    return common.launch(
        _sparse_attention_fp8_ws_kernel, _cache_words,
        lambda tokens, heads, width, width2, device: plan(tokens, heads, width, width2, device, num_splits),
        q, kv, indices, sinks, softmax_scale, extra_kv, extra_indices, extra_lengths, out_positions, out_cos_sin_cache,
        REGS_VALUE=PARTITION_REGS[0], REGS_CONVERT=PARTITION_REGS[1], L2_PREFETCH=L2_PREFETCH if l2_prefetch is None else bool(l2_prefetch),
    )  # fmt: skip
