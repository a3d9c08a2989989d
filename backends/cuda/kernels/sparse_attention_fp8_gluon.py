"""Gluon kernel (SM90): `sparse_attention` over FP8 caches, warp-specialised (DeepSeek-V4's decode attention).

Chosen on SM90 GPUs whose Triton has Gluon for Hopper: by the default, sparse_attention_path=auto, for calls of at least
AUTO_MIN_QUERIES queries (one query ran faster on the tl kernel), by sparse_attention_path=gluon for every call it
serves. It passed `deepinfer conformance --backend cuda --op sparse_attention` with sparse_attention_path=gluon (27
cases, H200, 2026-12-07; docs/measurements/2026-12-07/h200/). The calls it does not serve (`not_served`) go to the tl
kernel, which stays what the interpreter checks in CI; deterministic mode keeps the tl kernel's batch-invariant
registration. Compiled in CI by `deepinfer bench compile --case gluon` (wgmma, no spills).

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
`thread_barrier`, 3.9 `barrier`) and the shared-memory reinterpretation (3.6 `_reinterpret`, 3.9 `reinterpret`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.ops import kv_cache_format
from deepinfer.ops import sparse_attention as sparse_ops
from deepinfer.triton_common import cdiv, pick_splits
from deepinfer_cuda.kernels.common import Registration, capability, num_sms
from deepinfer_cuda.kernels.gluon_hopper import GLUON_IMPORT_ERROR, gluon_unusable

# the e4m3 -> raw bf16 chunk conversion and the opaque zero: the FP8 mla_decode kernel's (the same converter)
from deepinfer_cuda.kernels.mla_decode_fp8_gluon import RAW_UNIT_VALUE, _hidden_zero, _put_chunk
from deepinfer_cuda.options import SPARSE_ATTENTION_PATH

if GLUON_IMPORT_ERROR is None:  # (else the launch declines every call)
    from deepinfer_cuda.kernels.gluon_hopper import fence_async_shared, gl, gluon, mbarrier, warpgroup_mma, warpgroup_mma_wait
    from deepinfer_cuda.kernels.gluon_hopper import sync_warps as _sync_warps

LOG2E = 1.4426950408889634
DIM = 512  # D: V4's row (the rope channels inside)
BLOCK_M = 64  # heads per program: one wgmma M
BLOCK_N = 64  # cache rows per tile
MAX_ROTATED = DIM // 2  # the output rotation's R: inside the value warpgroup's columns (it rotates them in its epilogue)
MIN_ROWS_PER_SPLIT = 128  # a split's partial write (64 x 512 x 4 bytes) stays small next to its reads
MAX_SPLITS = 32  # the tl combine's
MAX_GRID_Y = 65535  # queries: the grid's second dimension
PARTITION_REGS = (160, 104)  # setmaxnreg of the value warpgroup and of the converting warpgroup (the softmax warpgroup: 504 less both)


if GLUON_IMPORT_ERROR is None:
    RAW_UNIT = gl.constexpr(RAW_UNIT_VALUE)
    _LOG2E = gl.constexpr(LOG2E)
    # A shared-memory view of another dtype: Triton 3.9 `reinterpret`, 3.6 `_reinterpret` (same arguments)
    _REINTERPRET_IS_PUBLIC = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

    @gluon.jit
    def _tile_rows(kv_words, xkv_words, idx_row, xidx_row, blk, blk_end, nb1, width, width2, stride_kv, stride_xkv, rows,
                   BLOCK_N: gl.constexpr, HAS_EXTRA: gl.constexpr):
        """Row block `blk` of the query's lists (the window list's nb1 blocks, then the extra list's): a word pointer to
        each row's first value, and whether the row is read (id >= 0, inside its list, blk before the split's end).
        Row offsets in int64 (a cache of 528-byte rows passes 2^31 bytes at 4M rows), multiples of 16 bytes."""
        offs = blk * BLOCK_N + rows
        ids = gl.load(idx_row + offs, mask=(offs < width) & (blk < blk_end), other=-1)
        ok = ids >= 0
        ptrs = kv_words + gl.multiple_of((gl.where(ok, ids, 0).to(gl.int64) * stride_kv) >> 2, 4)
        if HAS_EXTRA:
            if blk >= nb1:  # (the window list's load above was masked off: offs >= width)
                offs2 = (blk - nb1) * BLOCK_N + rows
                ids2 = gl.load(xidx_row + offs2, mask=(offs2 < width2) & (blk < blk_end), other=-1)
                ok = ids2 >= 0
                ptrs = xkv_words + gl.multiple_of((gl.where(ok, ids2, 0).to(gl.int64) * stride_xkv) >> 2, 4)
        return ptrs, ok

    @gluon.jit
    def _converter(kv_words, xkv_words, idx_row, xidx_row, bf_words, scale_smem, bf_ready, bf_empty,
                   lo, num_tiles, nb1, width, width2, stride_kv, stride_xkv,
                   D: gl.constexpr, BLOCK_N: gl.constexpr, HAS_EXTRA: gl.constexpr):
        """One warpgroup: tile j's e4m3 rows (loaded while tile j - 1 was converted) -> bf16 stage j % 2, chunk by chunk,
        each chunk's load of tile j + 1 issued once it is converted (into the registers it frees); tile j + 2's ids
        loaded a tile ahead of its rows. The rows are carried as 32-bit words (8 chunks x 8 registers a thread)."""
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
        ptrs, ok = _tile_rows(kv_words, xkv_words, idx_row, xidx_row, lo, end, nb1, width, width2, stride_kv, stride_xkv, rows, BLOCK_N, HAS_EXTRA)
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
        ptrs1, ok1 = _tile_rows(kv_words, xkv_words, idx_row, xidx_row, lo + 1, end, nb1, width, width2, stride_kv, stride_xkv, rows,
                                BLOCK_N, HAS_EXTRA)
        for j in range(num_tiles):
            t = j % 2
            ptrs2, ok2 = _tile_rows(kv_words, xkv_words, idx_row, xidx_row, lo + j + 2, end, nb1, width, width2, stride_kv, stride_xkv,
                                    rows, BLOCK_N, HAS_EXTRA)
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
    def _store_half(acc, factor, dst_row, col0, row_ok, cols):
        """acc [64, W] * factor (per row) at columns col0 .. col0 + W - 1 of the rows dst_row, in dst's dtype."""
        ptrs = gl.expand_dims(dst_row + col0, 1) + gl.expand_dims(cols, 0)
        gl.store(ptrs, (acc * gl.expand_dims(factor, 1)).to(dst_row.dtype.element_ty), mask=gl.expand_dims(row_ok, 1))

    @gluon.jit
    def _store_half_rotated(acc, factor, dst_row, pos, ocs_ptr, stride_ocs, row_ok, cols,
                            COL0: gl.constexpr, D: gl.constexpr, R: gl.constexpr, layout: gl.constexpr):
        """The output's columns COL0 .. COL0 + W - 1 (the last of them the tail), with the channels c >= D - R rotated
        in DeepSeek's interleaved pairs at `pos` (`rope`, interleaved=True: (a, b) -> (a cos - b sin, b cos + a sin))
        after rounding to the output dtype, as the op reads them; then rounded again. A thread holds whole (even, odd)
        pairs of the accumulator's columns: reshape and split take them apart in registers."""
        BLOCK_M: gl.constexpr = acc.shape[0]
        W: gl.constexpr = acc.shape[1]
        out_ty: gl.constexpr = dst_row.dtype.element_ty
        rounded = (acc * gl.expand_dims(factor, 1)).to(out_ty).to(gl.float32)
        col2 = gl.expand_dims(cols + COL0, 0) + gl.zeros([BLOCK_M, W], gl.int32, layout)
        ok2 = gl.expand_dims(row_ok, 1) & (col2 >= 0)
        a, b = gl.split(gl.reshape(rounded, [BLOCK_M, W // 2, 2]))
        col_a, col_b = gl.split(gl.reshape(col2, [BLOCK_M, W // 2, 2]))
        ok_a, ok_b = gl.split(gl.reshape(ok2, [BLOCK_M, W // 2, 2]))
        tail = col_a >= D - R
        j = gl.where(tail, (col_a - (D - R)) // 2, 0)
        cs_row = ocs_ptr + pos * stride_ocs
        cos = gl.load(cs_row + j, mask=tail, other=1.0).to(gl.float32)
        sin = gl.load(cs_row + R // 2 + j, mask=tail, other=0.0).to(gl.float32)
        ra = gl.where(tail, a * cos - b * sin, a)
        rb = gl.where(tail, b * cos + a * sin, b)
        # the rows' pointers in the pairs' layout: the base of each pair's row, through the same reshape and split
        base = gl.expand_dims(dst_row, 1) + gl.zeros([BLOCK_M, W], gl.int32, layout)
        base_a, base_b = gl.split(gl.reshape(base, [BLOCK_M, W // 2, 2]))
        gl.store(base_a + col_a, ra.to(out_ty), mask=ok_a)
        gl.store(base_b + col_b, rb.to(out_ty), mask=ok_b)

    @gluon.jit
    def _dst_rows(dst_ptr, offs_m, stride_o_t, stride_o_h, stride_po_split):
        """Each head row's output row: DIRECT, out[t, h]; else the split's partial part_out[t, split, h]."""
        t = gl.program_id(1).to(gl.int64)
        split = gl.program_id(2)
        return dst_ptr + t * stride_o_t + split * stride_po_split + offs_m.to(gl.int64) * stride_o_h

    @gluon.jit
    def _scores(q_smem, bf_smem, t, j, s, NUM_CHUNKS: gl.constexpr):
        """q . k^T of stage t's rows (tile j): NUM_CHUNKS async wgmma groups (m64n64k16) over the 64-column chunks; s: zeros
        of the accumulator's layout (not accumulated). q's chunks are indexed through a zero the compilers cannot see:
        else LLVM hoists the loop-invariant q descriptors out of the loop, registers the softmax warpgroup lacks."""
        zero = _hidden_zero(j)
        for c in gl.static_range(NUM_CHUNKS):
            s = warpgroup_mma(q_smem.index(zero + c), bf_smem.index(t * NUM_CHUNKS + c).permute((1, 0)), s, use_acc=c > 0, is_async=True)
        return s

    @gluon.jit
    def _softmax_partition(q_ptr, q_smem, bf_smem, bf_halves, scale_smem, p_smem, alpha_smem, fin_smem, bf_ready, bf_empty, p_ready, p_free,
                           fin_bar, sinks_ptr, dst_ptr, part_lse_ptr, num_tiles, qk_scale,
                           stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_po_split, stride_pl_t, stride_pl_split,
                           H: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DIRECT: gl.constexpr):
        """The default partition: q into shared memory; per tile the scores, the online softmax, p and alpha for the value
        warpgroup, output columns 0 .. D/2 - 1 over all of the tile's rows; the epilogue's per-row factor."""
        NUM_CHUNKS: gl.constexpr = D // 64
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D // 2, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        # q [64 heads, D] -> NUM_CHUNKS swizzled [64, 64] chunks (heads past H zero): this warpgroup alone reads them
        q_blocked: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        tok = gl.program_id(1).to(gl.int64)
        offs_qm = gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_blocked))
        offs_qc = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, q_blocked)), 0)
        q_rows = gl.expand_dims(q_ptr + tok * stride_q_t + offs_qm.to(gl.int64) * stride_q_h, 1)
        q_ok = gl.expand_dims(offs_qm < H, 1)
        for c in gl.static_range(NUM_CHUNKS):
            q_smem.index(c).store(gl.load(q_rows + c * 64 + offs_qc, mask=q_ok, other=0.0))
        fence_async_shared()  # read by wgmma (the async proxy)
        _sync_warps()

        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
        acc = gl.zeros([BLOCK_M, D // 2], gl.float32, layout=o_layout)
        # tile 0's scores; then each iteration issues the next tile's behind its value product and waits for both in it:
        # the tensor cores get the next scores without a gap, and no wgmma is in flight across the loop's back edge
        # (ptxas would serialise them all)
        s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        if num_tiles > 0:
            mbarrier.wait(bf_ready.index(0), 0)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(_scores(q_smem, bf_smem, 0, num_tiles, s, NUM_CHUNKS),))
        for j in range(num_tiles):
            t = j % 2
            # the rows' scales (-1: not read) times softmax_scale * log2(e): log2-domain scores, masked
            sc = scale_smem.index(t).load(gl.SliceLayout(0, s_layout))
            scores = gl.where(gl.expand_dims(sc >= 0.0, 0), s * gl.expand_dims(sc * qk_scale, 0), float("-inf"))
            # triton_common.softmax_block (base 2): a row that has seen only -inf keeps m = -inf and weights 0
            m_new = gl.maximum(m_i, gl.max(scores, axis=1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(scores - gl.expand_dims(m_safe, 1))
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            pv = (p * gl.expand_dims(sc, 0)).to(gl.bfloat16)  # the weight times the row's scale: (p * s) . v (0 where masked)
            # p and alpha for the value warpgroup (buffer j % 2: free once its products of tile j - 2 are done)
            mbarrier.wait(p_free.index(t), ((j // 2) & 1) ^ 1)
            p_smem.index(t).store(pv)
            alpha_smem.index(t).store(alpha)
            fence_async_shared()  # p is read by the value warpgroup's wgmma (the async proxy)
            _sync_warps()
            mbarrier.arrive(p_ready.index(t))
            # acc = acc * alpha + p . v[:, 0 : D/2] over the tile's rows (p in registers; m64n256k16)
            p_op = gl.convert_layout(pv, p_layout)
            o = warpgroup_mma(p_op, bf_halves.index(t * 2 + 0), acc * gl.expand_dims(gl.convert_layout(alpha, o_rows, assert_trivial=True), 1),
                              is_async=True)
            if j + 1 < num_tiles:
                mbarrier.wait(bf_ready.index(1 - t), ((j + 1) // 2) & 1)
                s_next = _scores(q_smem, bf_smem, 1 - t, j + 1, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout), NUM_CHUNKS)
                acc, p_op = warpgroup_mma_wait(num_outstanding=NUM_CHUNKS, deps=(o, p_op))  # (all but the next scores' groups)
                _sync_warps()
                mbarrier.arrive(bf_empty.index(t))
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s_next,))
            else:
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_op))
                _sync_warps()
                mbarrier.arrive(bf_empty.index(t))
        # the per-row factor: DIRECT, triton_common.normalise_with_sink's (the sink joins the normaliser); else
        # split_partial's 1 / l and the lse (-inf for a row that saw no row). The program ids are read here, not
        # captured before the loop (nothing but its state is live across it).
        offs_m = gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
        h_ok = offs_m < H
        if DIRECT:
            sink = gl.load(sinks_ptr + offs_m, mask=h_ok, other=0.0).to(gl.float32) * _LOG2E
            top = gl.maximum(m_i, sink)
            top = gl.where(top == float("-inf"), 0.0, top)
            w = gl.exp2(m_i - top)
            denom = l_i * w + gl.exp2(sink - top)
            factor = w / gl.where(denom > 0.0, denom, 1.0)
        else:
            has = l_i > 0.0
            l_safe = gl.where(has, l_i, 1.0)
            factor = 1.0 / l_safe
            lse = gl.where(has, m_i + gl.log2(l_safe), float("-inf"))
            gl.store(part_lse_ptr + gl.program_id(1).to(gl.int64) * stride_pl_t + gl.program_id(2) * stride_pl_split + offs_m, lse, mask=h_ok)
        fin_smem.store(factor)
        _sync_warps()
        mbarrier.arrive(fin_bar)
        offs_o = gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=o_rows)
        dst_row = _dst_rows(dst_ptr, offs_o, stride_o_t, stride_o_h, stride_po_split)
        cols = gl.arange(0, D // 2, layout=gl.SliceLayout(0, o_layout))
        _store_half(acc, gl.convert_layout(factor, o_rows, assert_trivial=True), dst_row, 0, offs_o < H, cols)

    @gluon.jit
    def _value_partition(bf_halves, p_smem, alpha_smem, fin_smem, bf_ready, bf_empty, p_ready, p_free, fin_bar,
                         dst_ptr, opos_ptr, ocs_ptr, num_tiles, stride_o_t, stride_o_h, stride_po_split, stride_ocs,
                         H: gl.constexpr, D: gl.constexpr, R: gl.constexpr, BLOCK_M: gl.constexpr, ROPE: gl.constexpr):
        """A worker warpgroup: output columns D/2 .. D - 1 over all of each tile's rows, from the softmax warpgroup's p and
        alpha; its epilogue stores them (DIRECT with ROPE: the tail rotated)."""
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D // 2, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        acc = gl.zeros([BLOCK_M, D // 2], gl.float32, layout=o_layout)
        for j in range(num_tiles):
            t = j % 2
            mbarrier.wait(p_ready.index(t), (j // 2) & 1)
            alpha = alpha_smem.index(t).load(row_layout)
            mbarrier.wait(bf_ready.index(t), (j // 2) & 1)  # (complete already: the softmax warpgroup waited for it)
            # acc = acc * alpha + p . v[:, D/2 : D] over the tile's rows, p from shared memory (m64n256k16: p read once per
            # 16 rows, for all 256 columns)
            o = warpgroup_mma(p_smem.index(t), bf_halves.index(t * 2 + 1), acc * gl.expand_dims(alpha, 1), is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
            _sync_warps()
            mbarrier.arrive(p_free.index(t))  # (p and alpha of tile j, read)
            mbarrier.arrive(bf_empty.index(t))
        mbarrier.wait(fin_bar, 0)
        factor = fin_smem.load(row_layout)
        offs_m = gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
        dst_row = _dst_rows(dst_ptr, offs_m, stride_o_t, stride_o_h, stride_po_split)
        cols = gl.arange(0, D // 2, layout=gl.SliceLayout(0, o_layout))
        if ROPE:  # (DIRECT only: with splits the combine rotates)
            pos = gl.load(opos_ptr + gl.program_id(1)).to(gl.int64)
            _store_half_rotated(acc, factor, dst_row, pos, ocs_ptr, stride_ocs, offs_m < H, cols, D // 2, D, R, o_layout)
        else:
            _store_half(acc, factor, dst_row, D // 2, offs_m < H, cols)

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
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        HAS_EXTRA: gl.constexpr, HAS_LENGTHS: gl.constexpr,
        ROPE: gl.constexpr,  # DIRECT with out_positions: the output's last R channels rotated back
        DIRECT: gl.constexpr,
        REGS_VALUE: gl.constexpr, REGS_CONVERT: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        gl.static_assert(D == 512, "the converter's tile is 8 chunks of 64 values")
        gl.static_assert(BLOCK_N == 64, "the scores' tile is the value products' K (one 64-column chunk)")
        NUM_CHUNKS: gl.constexpr = D // 64
        t = gl.program_id(1)
        split = gl.program_id(2)
        num_splits = gl.num_programs(2)
        # this query's row blocks (triton_common.split_row_blocks): the window list's nb1, then the extra list's nb2 over
        # the ids it reads; the split takes a run of per_split of them
        nb1 = (K + BLOCK_N - 1) // BLOCK_N
        width2 = K2
        if HAS_LENGTHS:
            width2 = gl.minimum(gl.maximum(gl.load(xlen_ptr + t).to(gl.int32), 0), K2)
        nb2 = (width2 + BLOCK_N - 1) // BLOCK_N
        per_split = (nb1 + nb2 + num_splits - 1) // num_splits
        lo = split * per_split
        num_tiles = gl.maximum(gl.minimum(per_split, nb1 + nb2 - lo), 0)
        t64 = t.to(gl.int64)

        chunk_bf16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16)
        chunk_words: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        q_layout_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 64], gl.bfloat16)
        p_layout_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)
        vec_s: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_CHUNKS, BLOCK_M, 64], q_layout_s)
        bf_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * NUM_CHUNKS, BLOCK_N, 64], chunk_bf16)
        # the same memory as int32 pairs of bf16 for the converting warps (the 128-byte swizzle moves 16-byte units: the
        # same bytes for 16- and 32-bit elements)
        # and as [stage * 2 + half, 64, D/2]: a [64, 256] 128-byte-swizzled tile is four [64, 64] ones one after the other,
        # the value products' B operand (m64n256k16)
        halves_bf16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D // 2], gl.bfloat16)
        if _REINTERPRET_IS_PUBLIC:
            bf_words = bf_smem.reinterpret(gl.int32, [2 * NUM_CHUNKS, BLOCK_N, 32], chunk_words)
            bf_halves = bf_smem.reinterpret(gl.bfloat16, [4, BLOCK_N, D // 2], halves_bf16)
        else:
            bf_words = bf_smem._reinterpret(gl.int32, [2 * NUM_CHUNKS, BLOCK_N, 32], chunk_words)
            bf_halves = bf_smem._reinterpret(gl.bfloat16, [4, BLOCK_N, D // 2], halves_bf16)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, BLOCK_N], p_layout_s)  # [tile parity]: p * row scale
        scale_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N], vec_s)  # [stage]: the rows' scales * 2^112 (-1: not read)
        alpha_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], vec_s)  # [tile parity]: the rescale of acc
        fin_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec_s)  # the epilogue's factor per row
        bf_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        bf_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        fin_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(bf_ready.index(i), count=1)
            mbarrier.init(bf_empty.index(i), count=2)  # both attention warpgroups
            mbarrier.init(p_ready.index(i), count=1)
            mbarrier.init(p_free.index(i), count=1)
        mbarrier.init(fin_bar, count=1)

        gl.warp_specialize(
            [
                (_softmax_partition, (q_ptr, q_smem, bf_smem, bf_halves, scale_smem, p_smem, alpha_smem, fin_smem, bf_ready, bf_empty, p_ready, p_free,
                                      fin_bar, sinks_ptr, dst_ptr, part_lse_ptr, num_tiles, qk_scale,
                                      stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_po_split, stride_pl_t, stride_pl_split,
                                      H, D, BLOCK_M, BLOCK_N, DIRECT)),
                (_value_partition, (bf_halves, p_smem, alpha_smem, fin_smem, bf_ready, bf_empty, p_ready, p_free, fin_bar,
                                    dst_ptr, opos_ptr, ocs_ptr, num_tiles, stride_o_t, stride_o_h, stride_po_split, stride_ocs,
                                    H, D, R, BLOCK_M, ROPE)),
                (_converter, (kv_words, xkv_words, idx_ptr + t64 * stride_idx_t, xidx_ptr + t64 * stride_xidx_t, bf_words, scale_smem,
                              bf_ready, bf_empty, lo, num_tiles, nb1, K, width2, stride_kv, stride_xkv, D, BLOCK_N, HAS_EXTRA)),
            ],
            [4, 4],
            [REGS_VALUE, REGS_CONVERT],
        )


# ---------------------------------------------------------------------------------------------
# Host side: which calls the kernel serves, its plan and launch


@dataclass(frozen=True)
class SparseFp8GluonPlan:
    """One launch of `_sparse_attention_fp8_ws_kernel` (host shapes only)."""

    head_tiles: int
    num_splits: int

    @property
    def direct(self) -> bool:
        return self.num_splits == 1


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
    if GLUON_IMPORT_ERROR is not None:
        return f"no Gluon for Hopper in this Triton ({GLUON_IMPORT_ERROR})"
    if q.device.type not in ("cuda", "meta"):  # ("meta" tensors pass: the compile check)
        return f"not on a GPU ({q.device.type}: the interpreter runs the tl kernel)"
    if q.device.type == "cuda" and capability(q.device)[0] != 9:
        return f"not an SM90 GPU (capability {capability(q.device)})"
    if q.dtype != torch.bfloat16:
        return f"q is {q.dtype}, not bfloat16"
    heads, dim = q.shape[1], q.shape[2]
    if dim != DIM:
        return f"D = {dim}: wants {DIM}"
    if heads > BLOCK_M and heads % BLOCK_M:
        return f"H = {heads}: wants <= {BLOCK_M} or a multiple of it"
    if q.shape[0] > MAX_GRID_Y:
        return f"T = {q.shape[0]}: the grid's second dimension holds at most {MAX_GRID_Y} queries"
    for name, cache in (("kv", kv), ("extra_kv", extra_kv)):
        if cache is not None and (why := _cache_not_served(name, cache)) is not None:
            return why
    for name, ids in (("indices", indices), ("extra_indices", extra_indices)):
        if ids is not None and ids.dtype != torch.int32:
            return f"{name} is {ids.dtype}, not int32"
    if out_cos_sin_cache is not None and out_cos_sin_cache.shape[-1] > MAX_ROTATED:
        return f"an output rotation of R = {out_cos_sin_cache.shape[-1]} channels: wants <= {MAX_ROTATED}"
    return None


def plan(tokens: int, heads: int, width: int, extra_width: int, device: torch.device, num_splits: int | None = None) -> SparseFp8GluonPlan:
    """Head tiles and splits from host-known shapes (width, extra_width: the lists' K, K2), by the tl kernel's rule: for
    few programs (at most half the SMs) splits down to one 64-row tile, else of at least MIN_ROWS_PER_SPLIT rows, as
    pick_splits fills one CTA per SM (this kernel's shared memory allows one)."""
    sms = num_sms(device)
    head_tiles = cdiv(heads, BLOCK_M)
    blocks = max(1, cdiv(width, BLOCK_N) + cdiv(extra_width, BLOCK_N))
    if num_splits is None:
        few = tokens * head_tiles <= sms // 2
        rows_per_split = BLOCK_N if few else MIN_ROWS_PER_SPLIT
        limit = min(MAX_SPLITS, blocks, max(1, (width + extra_width) // rows_per_split))
        num_splits = pick_splits(tokens * head_tiles, sms, limit)
    return SparseFp8GluonPlan(head_tiles=head_tiles, num_splits=max(1, min(int(num_splits), blocks, MAX_SPLITS)))


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
) -> torch.Tensor | None:
    """sparse_attention.launch_sparse_attention's arguments; None for a call this kernel does not serve (`not_served`:
    the caller falls back). Several splits: the partials are merged by sparse_attention.py's combine kernel."""
    from deepinfer_cuda.kernels import sparse_attention as tl_sparse

    sparse_ops.check_sparse_attention_shapes(q, kv, indices, sinks, extra_kv, extra_indices, extra_lengths, out_positions, out_cos_sin_cache)
    if not_served(q, kv, indices, extra_kv, extra_indices, out_cos_sin_cache) is not None:
        return None
    tokens, heads, dim = q.shape
    out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    if tokens == 0 or heads == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    sinks = sinks.contiguous()
    has_extra = extra_kv is not None
    if has_extra:
        extra_indices = extra_indices if extra_indices.stride(-1) == 1 else extra_indices.contiguous()
        xkv, xidx, width2 = extra_kv, extra_indices, extra_indices.shape[1]
    else:
        xkv, xidx, width2 = kv, indices, 0  # unused placeholders
    has_lengths = has_extra and extra_lengths is not None
    xlen = extra_lengths.contiguous() if has_lengths else indices  # (unused without lengths)
    p = plan(tokens, heads, indices.shape[1], width2, q.device, num_splits)
    rope = out_positions is not None
    if p.direct:
        dst, part_lse = out, out  # (part_lse unused)
        dst_strides, pl_strides = (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        dst = torch.empty(tokens, p.num_splits, heads, dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(tokens, p.num_splits, heads, dtype=torch.float32, device=q.device)
        dst_strides, pl_strides = (dst.stride(0), dst.stride(2), dst.stride(1)), (part_lse.stride(0), part_lse.stride(1))
    rotate_here = rope and p.direct  # (with splits the combine rotates)
    opos = out_positions.contiguous() if rotate_here else indices  # (unused without the rotation)
    ocs = out_cos_sin_cache.contiguous() if rotate_here else sinks
    _sparse_attention_fp8_ws_kernel[(p.head_tiles, tokens, p.num_splits)](
        q, kv.view(torch.int32), indices, xkv.view(torch.int32), xidx, xlen, sinks,
        dst, part_lse, opos, ocs,
        float(softmax_scale) * LOG2E,
        indices.shape[1], width2,
        q.stride(0), q.stride(1),
        kv.stride(0), indices.stride(0),
        xkv.stride(0), xidx.stride(0),
        *dst_strides,
        *pl_strides,
        ocs.stride(0),
        H=heads, D=dim, R=ocs.shape[-1] if rotate_here else 0,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        HAS_EXTRA=has_extra, HAS_LENGTHS=has_lengths,
        ROPE=rotate_here, DIRECT=p.direct,
        REGS_VALUE=PARTITION_REGS[0], REGS_CONVERT=PARTITION_REGS[1],
        num_warps=4,
    )
    if not p.direct:
        tl_sparse.combine_splits(dst, part_lse, sinks, out, out_positions, out_cos_sin_cache)
    return out


# sparse_attention_path=auto serves calls of at least this many queries here: one decode query measured 12.7 us against
# the tl kernel's 11.9 (H200, window 128 + top 512, 64 heads; 64 / 256 queries: 35.6 / 96.0 us against 97.8 / 212.5,
# docs/measurements/2026-12-07/h200/ops_sparse.txt)
AUTO_MIN_QUERIES = 2


def _op(min_queries: int):
    """The op on this kernel for the calls it serves (`not_served`) of at least `min_queries` queries, else on
    sparse_attention.py's tl kernel."""

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
        from deepinfer_cuda.kernels import sparse_attention as tl_sparse

        args = (q, kv, indices, sinks, softmax_scale, extra_kv, extra_indices, extra_lengths, out_positions, out_cos_sin_cache)
        out = launch_sparse_attention_fp8_gluon(*args) if q.shape[0] >= min_queries else None
        return out if out is not None else tl_sparse.launch_sparse_attention(*args)

    return sparse_attention


sparse_attention = _op(1)  # sparse_attention_path=gluon: every call it serves
sparse_attention_auto = _op(AUTO_MIN_QUERIES)  # sparse_attention_path=auto
sparse_attention_auto.__qualname__ = "sparse_attention_auto"


def _chosen(ctx) -> bool:
    """sparse_attention_path=gluon on an SM90 device (elsewhere that option leaves the op to the tl kernel)."""
    from deepinfer_cuda.kernels.gemm_mxfp4_gluon import is_sm90

    return SPARSE_ATTENTION_PATH.value(ctx) == "gluon" and is_sm90(ctx.device)


def _chosen_by_auto(ctx) -> bool:
    """sparse_attention_path=auto on an SM90 device whose Triton has Gluon for Hopper (else auto is the tl kernel)."""
    from deepinfer_cuda.kernels.gemm_mxfp4_gluon import is_sm90

    return SPARSE_ATTENTION_PATH.value(ctx) == "auto" and is_sm90(ctx.device) and GLUON_IMPORT_ERROR is None


def _unusable(ctx) -> str | None:
    return gluon_unusable("sparse_attention_path=gluon", GLUON_IMPORT_ERROR)


REGISTRATIONS = [
    Registration(
        op="sparse_attention",
        fn=sparse_attention,
        dtypes=(torch.bfloat16,),
        when=_chosen,
        priority=1,
        unusable=_unusable,
        note="Gluon (SM90, FP8 caches; sparse_attention_path=gluon): warp-specialised, a converting warpgroup gathering 64-row tiles "
        "into bf16 stages, a softmax warpgroup scoring every row and a value warpgroup, each owning half the output columns; the tl "
        "kernel for the calls it does not serve",
    ),
    Registration(
        op="sparse_attention",
        fn=sparse_attention_auto,
        dtypes=(torch.bfloat16,),
        when=_chosen_by_auto,
        priority=1,
        note="Gluon (SM90, FP8 caches; sparse_attention_path=auto): the kernel above for calls of at least 2 queries, the tl kernel "
        "for one query (where it measured faster) and for the calls the Gluon kernel does not serve",
    ),
]
