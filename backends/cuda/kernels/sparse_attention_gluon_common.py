"""What the SM90 Gluon `sparse_attention` kernels share (sparse_attention_fp8_gluon.py over FP8 caches,
sparse_attention_gluon.py over bf16 caches). A helper module: no REGISTRATIONS (sparse_attention_path.py registers
the kernels).

Both kernels run one schedule and differ only in the partition that fills the shared-memory stages: the FP8 kernel's
converting warpgroup loads e4m3 rows into registers and stores them as bf16, the bf16 kernel's loader copies the rows
into the stages with cp.async. Shared here:
- the schedule's attention warpgroups (`softmax_partition`, `value_partition`) and their epilogues: one program per
  (64-head tile, query, split); per tile of BLOCK_N rows the softmax warpgroup scores every row (q . k^T on wgmma), runs
  the online softmax (log2 domain, float32), hands p and the rescale factor alpha to the value warpgroup through
  double-buffered shared memory, and multiplies p into output columns 0 .. D/2 - 1 while the value warpgroup does
  D/2 .. D - 1; each releases the stage when its products are done. Per stage, the filling partition also writes one
  float32 per row: the row's scale (FP8; 1.0 for bf16), -1 for a row not read (id -1, past its list or the split's
  end): the softmax warpgroup masks by it and multiplies it into the row's score and weight (s * (q . v) and
  (p * s) . v, as the tl kernel does).
- `row_pointers`: a tile's rows from the query's two id lists, in the tl kernel's order (the window list's blocks,
  then the extra list's up to extra_lengths[t]); `prefetch_rows`: those rows asked of L2 ahead of their copies.
- the partitions' pieces (`load_q`, `softmax_tiles`, `softmax_epilogue`, `value_tiles`, `value_epilogue`), which take
  their (head tile, query, split) and the first tile's place in the program's sequence as arguments: the partitions
  above pass their program ids and 0, the persistent bf16 kernel (sparse_attention_gluon_persistent.py) each item's.
- `merge_splits_if_last`: the bf16 kernel's fused combine (FUSED_COMBINE, off: no faster on an H100), each query's last split
  merging the partials in the kernel.
- the host side: which calls both serve (`call_not_served`), the split plan (`split_plan`, the tl kernel's rule), and
  the launch around a kernel (`launch`: the outputs or split partials, the arguments both kernels take in one order,
  and sparse_attention.py's `combine_splits` after a split launch unless the kernel merged them).

Stage handshakes (mbarriers): `bf_ready[stage]` completes when a tile's rows and scales are in the stage, `bf_empty
[stage]` when both attention warpgroups are done with it (count 2), `p_ready` / `p_free` hand p and alpha over.
CONSUMER_FENCE: the stage was written by cp.async (the generic proxy) and is read by wgmma (the async proxy); the
attention warpgroups then issue the proxy fence themselves after waiting for the stage (as Triton's own cp.async
pipeline does after its wait and barrier). The FP8 converter fences before it arrives: there it is off.
Not a registration module: sparse_attention_path.py registers the op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer.triton_common import cdiv, pick_splits
from deepinfer_cuda.kernels.common import capability
from deepinfer_cuda.kernels.gluon_hopper import GLUON_IMPORT_ERROR

if GLUON_IMPORT_ERROR is None:  # (else the kernels' launches decline every call)
    from deepinfer_cuda.kernels.gluon_hopper import async_copy, cp_async_load, fence_async_shared, gl, gluon, mbarrier, warpgroup_mma, warpgroup_mma_wait
    from deepinfer_cuda.kernels.gluon_hopper import reinterpret_shared as _reinterpret_shared
    from deepinfer_cuda.kernels.gluon_hopper import sync_warps as _sync_warps

    # the opaque zero: the FP8 mla_decode kernel's
    from deepinfer_cuda.kernels.mla_decode_fp8_gluon import _hidden_zero

LOG2E = 1.4426950408889634
DIM = 512  # D: V4's row (the rope channels inside)
BLOCK_M = 64  # heads per program: one wgmma M
MAX_ROTATED = DIM // 2  # the output rotation's R: inside the value warpgroup's columns (it rotates them in its epilogue)
MIN_ROWS_PER_SPLIT = 128  # a split's partial write (64 x 512 x 4 bytes) stays small next to its reads
MIN_ROWS_PER_SPLIT_FEW = 64  # few queries: splits down to 64 rows (not to a 32-row tile: its 128 KiB partial would outweigh its reads 4:1)
MAX_SPLITS = 32  # the tl combine's
MAX_GRID_Y = 65535  # queries: the grid's second dimension


if GLUON_IMPORT_ERROR is None:
    _LOG2E = gl.constexpr(LOG2E)

    @gluon.jit
    def row_pointers(kv_ptr, xkv_ptr, idx_row, xidx_row, blk, blk_end, nb1, width, width2, stride_kv, stride_xkv, rows,
                     BLOCK_N: gl.constexpr, HAS_EXTRA: gl.constexpr, SHIFT: gl.constexpr, ALIGN: gl.constexpr):
        """Row block `blk` of the query's lists (the window list's nb1 blocks, then the extra list's): a pointer to each
        row's first element, and whether the row is read (id >= 0, inside its list, blk before the split's end). A row
        starts at (id * stride) >> SHIFT elements of its cache pointer (the FP8 kernel's word pointers: a byte stride
        and SHIFT 2), a multiple of ALIGN. Row offsets in int64 (a cache of 512-wide rows passes 2^31 bytes at 4M rows)."""
        offs = blk * BLOCK_N + rows
        ids = gl.load(idx_row + offs, mask=(offs < width) & (blk < blk_end), other=-1)
        ok = ids >= 0
        off = gl.where(ok, ids, 0).to(gl.int64) * stride_kv
        if SHIFT > 0:
            off = off >> SHIFT
        ptrs = kv_ptr + gl.multiple_of(off, ALIGN)
        if HAS_EXTRA:
            if blk >= nb1:  # (the window list's load above was masked off: offs >= width)
                offs2 = (blk - nb1) * BLOCK_N + rows
                ids2 = gl.load(xidx_row + offs2, mask=(offs2 < width2) & (blk < blk_end), other=-1)
                ok = ids2 >= 0
                off2 = gl.where(ok, ids2, 0).to(gl.int64) * stride_xkv
                if SHIFT > 0:
                    off2 = off2 >> SHIFT
                ptrs = xkv_ptr + gl.multiple_of(off2, ALIGN)
        return ptrs, ok

    @gluon.jit
    def prefetch_rows(ptrs, ok, ROW_BYTES: gl.constexpr):
        """Ask L2 for a tile's read rows ahead of the copies that load them (cp.async.bulk.prefetch.L2: no registers, no
        shared memory; a row's start 16-byte aligned, ROW_BYTES a multiple of 16): the gather then waits on L2 instead
        of DRAM. Each thread asks for the rows it holds (the loaders' layouts repeat a row across a few lanes: repeated
        asks for a line already on its way cost L2 requests, not DRAM bytes)."""
        gl.static_assert(ROW_BYTES % 16 == 0, "bulk prefetches move 16-byte units")
        gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptrs.to(gl.int64), ok.to(gl.int32) * ROW_BYTES], dtype=gl.int32, is_pure=False, pack=1)

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
    def _dst_rows(dst_ptr, offs_m, tok, split, stride_o_t, stride_o_h, stride_po_split):
        """Each head row's output row: DIRECT, out[tok, h]; else the split's partial part_out[tok, split, h]."""
        return dst_ptr + tok.to(gl.int64) * stride_o_t + split * stride_po_split + offs_m.to(gl.int64) * stride_o_h

    @gluon.jit
    def _grow_normaliser(top, denom, lse):
        """(top, sum of exp2(x - top)) over the logits seen, with one more (-inf: none); -inf - -inf never formed."""
        grown = gl.maximum(top, lse)
        base = gl.where(grown == float("-inf"), 0.0, grown)
        return grown, denom * gl.exp2(top - base) + gl.exp2(lse - base)

    @gluon.jit
    def merge_splits_if_last(part_ptr, part_lse_ptr, cnt_ptr, out_ptr, sinks_ptr, opos_ptr, ocs_ptr, tile, tok, head_tiles, splits,
                             stride_po_t, stride_po_h, stride_po_split, stride_pl_t, stride_pl_split, stride_out_t, stride_out_h, stride_ocs,
                             H: gl.constexpr, D: gl.constexpr, R: gl.constexpr, BLOCK_M: gl.constexpr, HALF: gl.constexpr, ROPE: gl.constexpr):
        """FUSED_COMBINE's in-kernel combine, run by one attention warpgroup once it has stored its half (HALF: columns
        HALF * D/2 ..) of this split's partial and its split's lse is stored: a counter per (query, head tile, half) counts
        the splits done with that half (an acq_rel atomic at GPU scope after the warpgroup's barrier: every thread's stores
        before it); the last to arrive merges every split's half as `combine_splits` does (the largest lse first, the sink
        in the normaliser, the output's tail rotated when ROPE) into out, and zeroes the counter for the next launch. No
        second launch, no split waits for another. Partials are read through L2 (.cg): other SMs wrote them. tile, tok:
        this program's head tile and query; head_tiles, splits: the launch's."""
        _sync_warps()  # every thread of this warpgroup has stored its part of the partial (and, before, the lse)
        t = tok.to(gl.int64)
        cnt = cnt_ptr + (t * head_tiles + tile) * 2 + HALF
        arrived = gl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            gl.store(cnt, 0)  # (no other program of this launch touches it again)
            W: gl.constexpr = 64  # columns merged at a time: [64, 64] float32, 32 registers a thread
            layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])  # (whole rotation pairs in a thread)
            rows_l: gl.constexpr = gl.SliceLayout(1, layout)
            offs_m = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows_l)
            h_ok = offs_m < H
            cols = gl.arange(0, W, layout=gl.SliceLayout(0, layout))
            lse_row = part_lse_ptr + t * stride_pl_t + offs_m
            # the normaliser in one pass over the lse, rescaled as the largest grows (a split's weight is exp2(lse - top)),
            # the next split's lse loaded before this one's is used; then the sink, which joins it without a value
            top = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=rows_l)
            denom = gl.zeros([BLOCK_M], gl.float32, layout=rows_l)
            lse_next = gl.load(lse_row, mask=h_ok, other=float("-inf"), cache_modifier=".cg")
            for s in range(splits):
                lse_s = lse_next
                lse_next = gl.load(lse_row + (s + 1) * stride_pl_split, mask=h_ok & (s + 1 < splits), other=float("-inf"), cache_modifier=".cg")
                top, denom = _grow_normaliser(top, denom, lse_s)
            sink = gl.load(sinks_ptr + offs_m, mask=h_ok, other=0.0).to(gl.float32) * _LOG2E
            top, denom = _grow_normaliser(top, denom, sink)
            top = gl.where(top == float("-inf"), 0.0, top)
            factor = 1.0 / gl.where(denom > 0.0, denom, 1.0)
            part_rows = gl.expand_dims(part_ptr + t * stride_po_t + offs_m.to(gl.int64) * stride_po_h, 1)
            out_row = out_ptr + t * stride_out_t + offs_m.to(gl.int64) * stride_out_h
            pos = 0
            if ROPE:
                pos = gl.load(opos_ptr + t).to(gl.int64)
            ok2 = gl.expand_dims(h_ok, 1)
            for c in gl.static_range(D // 2 // W):
                col = part_rows + HALF * (D // 2) + c * W + gl.expand_dims(cols, 0)
                acc = gl.zeros([BLOCK_M, W], gl.float32, layout=layout)
                # split s + 1's columns and lse loaded before split s's are used: two L2 round trips in flight, not one
                lse_next = gl.load(lse_row, mask=h_ok, other=float("-inf"), cache_modifier=".cg")
                part_next = gl.load(col, mask=ok2, other=0.0, cache_modifier=".cg")
                for s in range(splits):
                    lse_s = lse_next
                    part = part_next
                    more = s + 1 < splits
                    lse_next = gl.load(lse_row + (s + 1) * stride_pl_split, mask=h_ok & more, other=float("-inf"), cache_modifier=".cg")
                    part_next = gl.load(col + (s + 1) * stride_po_split, mask=ok2 & more, other=0.0, cache_modifier=".cg")
                    acc += gl.expand_dims(gl.exp2(lse_s - top), 1) * part
                if ROPE:
                    _store_half_rotated(acc, factor, out_row, pos, ocs_ptr, stride_ocs, h_ok, cols, HALF * (D // 2) + c * W, D, R, layout)
                else:
                    _store_half(acc, factor, out_row, HALF * (D // 2) + c * W, h_ok, cols)

    @gluon.jit
    def _scores(q_smem, bf_smem, t, j, s, NUM_CHUNKS: gl.constexpr):
        """q . k^T of stage t's rows (tile j): NUM_CHUNKS async wgmma groups (m64nBLOCK_Nk16) over the 64-column chunks; s:
        zeros of the accumulator's layout (not accumulated). q's chunks are indexed through a zero the compilers cannot
        see: else LLVM hoists the loop-invariant q descriptors out of the loop, registers the softmax warpgroup lacks."""
        zero = _hidden_zero(j)
        for c in gl.static_range(NUM_CHUNKS):
            s = warpgroup_mma(q_smem.index(zero + c), bf_smem.index(t * NUM_CHUNKS + c).permute((1, 0)), s, use_acc=c > 0, is_async=True)
        return s

    @gluon.jit
    def softmax_partition(q_ptr, q_smem, bf_smem, bf_halves, scale_smem, p_smem, alpha_smem, fin_smem, bf_ready, bf_empty, p_ready, p_free,
                          fin_bar, sinks_ptr, dst_ptr, part_lse_ptr, num_tiles, qk_scale,
                          stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_po_split, stride_pl_t, stride_pl_split,
                          H: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                          DIRECT: gl.constexpr, CONSUMER_FENCE: gl.constexpr, EARLY_RELEASE: gl.constexpr,
                          cnt_ptr, out_ptr, stride_out_t, stride_out_h, FUSED: gl.constexpr):
        """The default partition: q into shared memory; per tile the scores, the online softmax, p and alpha for the value
        warpgroup, output columns 0 .. D/2 - 1 over all of the tile's rows (`softmax_tiles`); the epilogue's per-row factor
        (`softmax_epilogue`). One (head tile, query, split) a program: its program ids."""
        load_q(q_ptr, q_smem, gl.program_id(0), gl.program_id(1), stride_q_t, stride_q_h, H, D, BLOCK_M)
        m_i, l_i, acc = softmax_tiles(q_smem, bf_smem, bf_halves, scale_smem, p_smem, alpha_smem, bf_ready, bf_empty, p_ready, p_free, 0, num_tiles,
                                      qk_scale, D, BLOCK_M, BLOCK_N, STAGES, CONSUMER_FENCE, EARLY_RELEASE, fin_bar, False)
        # (the program ids are read here, not captured before the loop: nothing but its state is live across it)
        softmax_epilogue(m_i, l_i, acc, fin_smem, fin_bar, sinks_ptr, dst_ptr, part_lse_ptr, gl.program_id(0), gl.program_id(1), gl.program_id(2),
                         gl.num_programs(0), gl.num_programs(2), stride_o_t, stride_o_h, stride_po_split, stride_pl_t, stride_pl_split,
                         cnt_ptr, out_ptr, stride_out_t, stride_out_h, H, D, BLOCK_M, BLOCK_N, DIRECT, FUSED)

    @gluon.jit
    def load_q(q_ptr, q_smem, tile, tok, stride_q_t, stride_q_h, H: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr):
        """q [64 heads of head tile `tile`, D] of query `tok` -> D / 64 swizzled [64, 64] chunks of q_smem (heads past H
        zero), fenced for wgmma: the softmax warpgroup alone reads them."""
        NUM_CHUNKS: gl.constexpr = D // 64
        q_blocked: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        offs_qm = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_blocked))
        offs_qc = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, q_blocked)), 0)
        q_rows = gl.expand_dims(q_ptr + tok.to(gl.int64) * stride_q_t + offs_qm.to(gl.int64) * stride_q_h, 1)
        q_ok = gl.expand_dims(offs_qm < H, 1)
        for c in gl.static_range(NUM_CHUNKS):
            q_smem.index(c).store(gl.load(q_rows + c * 64 + offs_qc, mask=q_ok, other=0.0))
        fence_async_shared()  # read by wgmma (the async proxy)
        _sync_warps()

    @gluon.jit
    def issue_q_copy(q_ptr, q_smem, tile, tok, ok, stride_q_t, stride_q_h, H: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr):
        """`load_q`'s copy by cp.async, one commit group (nothing copied where not ok; heads past H zero-filled): the
        caller waits for it (async_copy.wait_group), fences and syncs its warps before wgmma reads q_smem."""
        q_tile = q_ptr + tok.to(gl.int64) * stride_q_t + (tile * BLOCK_M).to(gl.int64) * stride_q_h
        issue_q_tile_copy(q_tile, q_smem, gl.where(ok, H - tile * BLOCK_M, 0), stride_q_h, D, BLOCK_M)

    @gluon.jit
    def issue_q_tile_copy(q_tile, q_smem, heads, stride_q_h, D: gl.constexpr, BLOCK_M: gl.constexpr):
        """q's rows 0 .. heads - 1 from q_tile (a head tile's first row; the rest zero-filled, none read) into q_smem's
        swizzled [64, 64] chunks by cp.async, one commit group."""
        NUM_CHUNKS: gl.constexpr = D // 64
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # (the bf16 loader's: a warp's rows one swizzle row each)
        offs_qm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        offs_qc = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, layout)), 0)
        q_rows = gl.expand_dims(q_tile + offs_qm.to(gl.int64) * stride_q_h, 1) + offs_qc
        q_ok = gl.expand_dims(offs_qm < heads, 1)
        for c in gl.static_range(NUM_CHUNKS):
            cp_async_load(q_smem.index(c), q_rows + c * 64, mask=q_ok)
        async_copy.commit_group()

    @gluon.jit
    def softmax_tiles(q_smem, bf_smem, bf_halves, scale_smem, p_smem, alpha_smem, bf_ready, bf_empty, p_ready, p_free, g0, num_tiles, qk_scale,
                      D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      CONSUMER_FENCE: gl.constexpr, EARLY_RELEASE: gl.constexpr, q_free, RELEASE_Q: gl.constexpr):
        """num_tiles tiles, the program's tiles g0 .. g0 + num_tiles - 1 in the order the stages fill (tile g in stage g %
        STAGES, p's buffer g % 2; g0: the tiles this partition ran before, 0 for one item a program): per tile the scores,
        the online softmax, p and alpha for the value warpgroup, output columns 0 .. D/2 - 1 over all of the tile's rows.
        Returns the softmax state (m, l) and the accumulator. The next tile's scores are issued behind this tile's value
        product (EARLY_RELEASE off: the tensor cores get them without a gap, and the stage is released once both are issued
        and the product is done) or after it (EARLY_RELEASE on: the stage released before the next tile is waited for, so a
        filler that only issues copies keeps one more tile in flight). RELEASE_Q (the persistent kernel): q_free is arrived
        once the last tile's scores are done (nothing reads q_smem after them), so the next item's q can be copied in."""
        NUM_CHUNKS: gl.constexpr = D // 64
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D // 2, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
        acc = gl.zeros([BLOCK_M, D // 2], gl.float32, layout=o_layout)
        # tile 0's scores; then each iteration issues the next tile's behind its value product and waits for both in it:
        # the tensor cores get the next scores without a gap, and no wgmma is in flight across the loop's back edge
        # (ptxas would serialise them all)
        s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        if num_tiles > 0:
            mbarrier.wait(bf_ready.index(g0 % STAGES), (g0 // STAGES) & 1)
            if CONSUMER_FENCE:
                fence_async_shared()
            s = warpgroup_mma_wait(num_outstanding=0, deps=(_scores(q_smem, bf_smem, g0 % STAGES, num_tiles, s, NUM_CHUNKS),))
        for j in range(num_tiles):
            g = g0 + j  # the tile's place in the program's sequence
            t = g % STAGES  # the stage
            b = g % 2  # p's and alpha's buffer
            if RELEASE_Q:
                if j + 1 == num_tiles:  # (every scores product is done)
                    _sync_warps()
                    mbarrier.arrive(q_free)
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
            # p and alpha for the value warpgroup (buffer g % 2: free once its products of tile g - 2 are done)
            mbarrier.wait(p_free.index(b), ((g // 2) & 1) ^ 1)
            p_smem.index(b).store(pv)
            alpha_smem.index(b).store(alpha)
            fence_async_shared()  # p is read by the value warpgroup's wgmma (the async proxy)
            _sync_warps()
            mbarrier.arrive(p_ready.index(b))
            # acc = acc * alpha + p . v[:, 0 : D/2] over the tile's rows (p in registers; m64n256k16)
            p_op = gl.convert_layout(pv, p_layout)
            o = warpgroup_mma(p_op, bf_halves.index(t * 2 + 0), acc * gl.expand_dims(gl.convert_layout(alpha, o_rows, assert_trivial=True), 1),
                              is_async=True)
            if EARLY_RELEASE:
                # the stage released as soon as this product is done, before the next tile is waited for: its filler
                # refills it while the next tile is still in flight (the next scores no longer overlap this product)
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_op))
                _sync_warps()
                mbarrier.arrive(bf_empty.index(t))
                if j + 1 < num_tiles:
                    tn = (g + 1) % STAGES
                    mbarrier.wait(bf_ready.index(tn), ((g + 1) // STAGES) & 1)
                    if CONSUMER_FENCE:
                        fence_async_shared()
                    s_next = _scores(q_smem, bf_smem, tn, j + 1, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout), NUM_CHUNKS)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_next,))
            elif j + 1 < num_tiles:
                tn = (g + 1) % STAGES
                mbarrier.wait(bf_ready.index(tn), ((g + 1) // STAGES) & 1)
                if CONSUMER_FENCE:
                    fence_async_shared()
                s_next = _scores(q_smem, bf_smem, tn, j + 1, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout), NUM_CHUNKS)
                acc, p_op = warpgroup_mma_wait(num_outstanding=NUM_CHUNKS, deps=(o, p_op))  # (all but the next scores' groups)
                _sync_warps()
                mbarrier.arrive(bf_empty.index(t))
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s_next,))
            else:
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_op))
                _sync_warps()
                mbarrier.arrive(bf_empty.index(t))
        return m_i, l_i, acc

    @gluon.jit
    def softmax_epilogue(m_i, l_i, acc, fin_smem, fin_bar, sinks_ptr, dst_ptr, part_lse_ptr, tile, tok, split, head_tiles, splits,
                         stride_o_t, stride_o_h, stride_po_split, stride_pl_t, stride_pl_split, cnt_ptr, out_ptr, stride_out_t, stride_out_h,
                         H: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DIRECT: gl.constexpr, FUSED: gl.constexpr):
        """The softmax warpgroup's epilogue of (head tile, query tok, split): the per-row factor for both warpgroups
        (fin_smem, fin_bar), its half of the output or partial; FUSED: the merge when it is the query's last split."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D // 2, 16])
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        # the per-row factor: DIRECT, triton_common.normalise_with_sink's (the sink joins the normaliser); else
        # split_partial's 1 / l and the lse (-inf for a row that saw no row)
        offs_m = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
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
            gl.store(part_lse_ptr + tok.to(gl.int64) * stride_pl_t + split * stride_pl_split + offs_m, lse, mask=h_ok)
        fin_smem.store(factor)
        _sync_warps()
        mbarrier.arrive(fin_bar)
        offs_o = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=o_rows)
        dst_row = _dst_rows(dst_ptr, offs_o, tok, split, stride_o_t, stride_o_h, stride_po_split)
        cols = gl.arange(0, D // 2, layout=gl.SliceLayout(0, o_layout))
        _store_half(acc, gl.convert_layout(factor, o_rows, assert_trivial=True), dst_row, 0, offs_o < H, cols)
        if FUSED:  # (split partials only: the last split merges columns 0 .. D/2 - 1 into out; no rotation there)
            merge_splits_if_last(dst_ptr, part_lse_ptr, cnt_ptr, out_ptr, sinks_ptr, sinks_ptr, sinks_ptr, tile, tok, head_tiles, splits,
                                 stride_o_t, stride_o_h, stride_po_split, stride_pl_t, stride_pl_split, stride_out_t, stride_out_h, 0,
                                 H, D, 0, BLOCK_M, 0, False)

    @gluon.jit
    def value_partition(bf_halves, p_smem, alpha_smem, fin_smem, bf_ready, bf_empty, p_ready, p_free, fin_bar,
                        dst_ptr, opos_ptr, ocs_ptr, num_tiles, stride_o_t, stride_o_h, stride_po_split, stride_ocs,
                        H: gl.constexpr, D: gl.constexpr, R: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, ROPE: gl.constexpr,
                        CONSUMER_FENCE: gl.constexpr,
                        sinks_ptr, part_lse_ptr, cnt_ptr, out_ptr, stride_pl_t, stride_pl_split, stride_out_t, stride_out_h, FUSED: gl.constexpr):
        """A worker warpgroup: output columns D/2 .. D - 1 over all of each tile's rows, from the softmax warpgroup's p and
        alpha (`value_tiles`); its epilogue stores them (`value_epilogue`). One (head tile, query, split) a program."""
        acc = value_tiles(bf_halves, p_smem, alpha_smem, bf_ready, bf_empty, p_ready, p_free, 0, num_tiles, D, BLOCK_M, STAGES, CONSUMER_FENCE)
        mbarrier.wait(fin_bar, 0)
        factor = fin_smem.load(gl.SliceLayout(1, gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D // 2, 16])))
        value_epilogue(acc, factor, dst_ptr, opos_ptr, ocs_ptr, gl.program_id(0), gl.program_id(1), gl.program_id(2), gl.num_programs(0),
                       gl.num_programs(2), stride_o_t, stride_o_h, stride_po_split, stride_ocs, sinks_ptr, part_lse_ptr, cnt_ptr, out_ptr,
                       stride_pl_t, stride_pl_split, stride_out_t, stride_out_h, H, D, R, BLOCK_M, ROPE, FUSED)

    @gluon.jit
    def value_tiles(bf_halves, p_smem, alpha_smem, bf_ready, bf_empty, p_ready, p_free, g0, num_tiles,
                    D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CONSUMER_FENCE: gl.constexpr):
        """The value warpgroup's num_tiles tiles, the program's tiles g0 .. (as `softmax_tiles`): acc = acc * alpha + p . v
        over columns D/2 .. D - 1. Returns the accumulator."""
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D // 2, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        acc = gl.zeros([BLOCK_M, D // 2], gl.float32, layout=o_layout)
        for j in range(num_tiles):
            g = g0 + j
            t = g % STAGES
            b = g % 2
            mbarrier.wait(p_ready.index(b), (g // 2) & 1)
            alpha = alpha_smem.index(b).load(row_layout)
            mbarrier.wait(bf_ready.index(t), (g // STAGES) & 1)  # (complete already: the softmax warpgroup waited for it)
            if CONSUMER_FENCE:
                fence_async_shared()
            # acc = acc * alpha + p . v[:, D/2 : D] over the tile's rows, p from shared memory (m64n256k16: p read once per
            # 16 rows, for all 256 columns)
            o = warpgroup_mma(p_smem.index(b), bf_halves.index(t * 2 + 1), acc * gl.expand_dims(alpha, 1), is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
            _sync_warps()
            mbarrier.arrive(p_free.index(b))  # (p and alpha of tile g, read)
            mbarrier.arrive(bf_empty.index(t))
        return acc

    @gluon.jit
    def value_epilogue(acc, factor, dst_ptr, opos_ptr, ocs_ptr, tile, tok, split, head_tiles, splits,
                       stride_o_t, stride_o_h, stride_po_split, stride_ocs, sinks_ptr, part_lse_ptr, cnt_ptr, out_ptr,
                       stride_pl_t, stride_pl_split, stride_out_t, stride_out_h,
                       H: gl.constexpr, D: gl.constexpr, R: gl.constexpr, BLOCK_M: gl.constexpr, ROPE: gl.constexpr, FUSED: gl.constexpr):
        """The value warpgroup's epilogue of (head tile, query tok, split) with the softmax warpgroup's per-row factor: its
        half of the output (ROPE without FUSED: the tail rotated) or partial; FUSED: the merge when it is the query's last
        split."""
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D // 2, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        offs_m = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
        dst_row = _dst_rows(dst_ptr, offs_m, tok, split, stride_o_t, stride_o_h, stride_po_split)
        cols = gl.arange(0, D // 2, layout=gl.SliceLayout(0, o_layout))
        if ROPE and not FUSED:  # (DIRECT: with splits the combine rotates, FUSED's in the merge below)
            pos = gl.load(opos_ptr + tok).to(gl.int64)
            _store_half_rotated(acc, factor, dst_row, pos, ocs_ptr, stride_ocs, offs_m < H, cols, D // 2, D, R, o_layout)
        else:
            _store_half(acc, factor, dst_row, D // 2, offs_m < H, cols)
        if FUSED:  # (split partials only: the last split merges columns D/2 .. D - 1 into out, the tail rotated with ROPE)
            merge_splits_if_last(dst_ptr, part_lse_ptr, cnt_ptr, out_ptr, sinks_ptr, opos_ptr, ocs_ptr, tile, tok, head_tiles, splits,
                                 stride_o_t, stride_o_h, stride_po_split, stride_pl_t, stride_pl_split, stride_out_t, stride_out_h, stride_ocs,
                                 H, D, R, BLOCK_M, 1, ROPE)

    @gluon.jit
    def allocate_shared(D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, READY_COUNT: gl.constexpr):
        """The schedule's shared memory and mbarriers, initialised: q (D / 64 swizzled [64, 64] chunks), the stages (STAGES x
        D / 64 swizzled [BLOCK_N, 64] chunks, also seen as [stage * 2 + half, BLOCK_N, D/2]: a [BLOCK_N, 256]
        128-byte-swizzled tile is four [BLOCK_N, 64] ones one after the other, the value products' B operand, m64n256k16),
        p and alpha per tile parity, the rows' scales per stage, the epilogue's factor; bf_ready (READY_COUNT arrivals:
        the filler's), bf_empty (both attention warpgroups), p_ready, p_free, fin_bar."""
        NUM_CHUNKS: gl.constexpr = D // 64
        chunk_bf16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16)
        q_layout_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 64], gl.bfloat16)
        p_layout_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)
        halves_bf16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D // 2], gl.bfloat16)
        vec_s: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_CHUNKS, BLOCK_M, 64], q_layout_s)
        bf_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * NUM_CHUNKS, BLOCK_N, 64], chunk_bf16)
        bf_halves = _reinterpret_shared(bf_smem, gl.bfloat16, [STAGES * 2, BLOCK_N, D // 2], halves_bf16)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, BLOCK_N], p_layout_s)  # [tile parity]: p * row scale
        scale_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], vec_s)  # [stage]: the rows' scales (-1: not read)
        alpha_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], vec_s)  # [tile parity]: the rescale of acc
        fin_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec_s)  # the epilogue's factor per row
        bf_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        bf_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        fin_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bf_ready.index(i), count=READY_COUNT)
            mbarrier.init(bf_empty.index(i), count=2)  # both attention warpgroups
        for i in gl.static_range(2):
            mbarrier.init(p_ready.index(i), count=1)
            mbarrier.init(p_free.index(i), count=1)
        mbarrier.init(fin_bar, count=1)
        return q_smem, bf_smem, bf_halves, p_smem, scale_smem, alpha_smem, fin_smem, bf_ready, bf_empty, p_ready, p_free, fin_bar

    @gluon.jit
    def query_tiles(xlen_ptr, K, K2, BLOCK_N: gl.constexpr, HAS_LENGTHS: gl.constexpr):
        """This program's row blocks: `query_tiles_at` of its query (program_id 1) and split (program_id 2)."""
        return query_tiles_at(xlen_ptr, K, K2, gl.program_id(1), gl.program_id(2), gl.num_programs(2), BLOCK_N, HAS_LENGTHS)

    @gluon.jit
    def query_tiles_at(xlen_ptr, K, K2, t, split, num_splits, BLOCK_N: gl.constexpr, HAS_LENGTHS: gl.constexpr):
        """Query t's row blocks (triton_common.split_row_blocks): the window list's nb1, then the extra list's over the ids it
        reads (width2); split `split` of num_splits takes a run of per_split of them, tiles lo .. lo + num_tiles - 1."""
        nb1 = (K + BLOCK_N - 1) // BLOCK_N
        width2 = K2
        if HAS_LENGTHS:
            width2 = gl.minimum(gl.maximum(gl.load(xlen_ptr + t).to(gl.int32), 0), K2)
        nb2 = (width2 + BLOCK_N - 1) // BLOCK_N
        per_split = (nb1 + nb2 + num_splits - 1) // num_splits
        lo = split * per_split
        num_tiles = gl.maximum(gl.minimum(per_split, nb1 + nb2 - lo), 0)
        return nb1, width2, lo, num_tiles


# ---------------------------------------------------------------------------------------------
# Host side: the calls both kernels serve, the split plan, the launch


@dataclass(frozen=True)
class SparseGluonPlan:
    """One launch of a Gluon sparse_attention kernel (host shapes only): grid (head_tiles, T, num_splits), tiles of
    block_n rows through `stages` shared-memory stages."""

    head_tiles: int
    num_splits: int
    block_n: int = 64
    stages: int = 2

    @property
    def direct(self) -> bool:
        return self.num_splits == 1


def call_not_served(q, indices, extra_indices=None, out_cos_sin_cache=None) -> str | None:
    """Why neither Gluon kernel serves a call, the caches aside (None: the caches decide). Devices, shapes and dtypes."""
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
    for name, ids in (("indices", indices), ("extra_indices", extra_indices)):
        if ids is not None and ids.dtype != torch.int32:
            return f"{name} is {ids.dtype}, not int32"
    if out_cos_sin_cache is not None and out_cos_sin_cache.shape[-1] > MAX_ROTATED:
        return f"an output rotation of R = {out_cos_sin_cache.shape[-1]} channels: wants <= {MAX_ROTATED}"
    return None


def split_plan(tokens: int, heads: int, width: int, extra_width: int, sms: int, num_splits: int | None = None,
               block_n: int = 64, stages: int = 2, one_split_from: float | None = None) -> SparseGluonPlan:
    """Head tiles and splits from host-known shapes (width, extra_width: the lists' K, K2; sms: the GPU's SMs), by the
    tl kernel's rule: for few programs (at most half the SMs) splits down to one tile (of at least MIN_ROWS_PER_SPLIT_FEW
    rows), else of at least MIN_ROWS_PER_SPLIT rows, as pick_splits fills one CTA per SM (the kernels' shared memory
    allows one); with one_split_from, one split once the programs of one split fill that fraction of the SMs (the bf16
    kernel's rule); a forced num_splits is clamped to the query's tiles."""
    head_tiles = cdiv(heads, BLOCK_M)
    blocks = max(1, cdiv(width, block_n) + cdiv(extra_width, block_n))
    if num_splits is None and one_split_from is not None and tokens * head_tiles >= sms * one_split_from:
        num_splits = 1
    if num_splits is None:
        few = tokens * head_tiles <= sms // 2
        rows_per_split = max(block_n, MIN_ROWS_PER_SPLIT_FEW) if few else MIN_ROWS_PER_SPLIT
        limit = min(MAX_SPLITS, blocks, max(1, (width + extra_width) // rows_per_split))
        num_splits = pick_splits(tokens * head_tiles, sms, limit)
    return SparseGluonPlan(head_tiles=head_tiles, num_splits=max(1, min(int(num_splits), blocks, MAX_SPLITS)), block_n=block_n, stages=stages)


def launch(
    kernel,
    cache_arg: Callable[[torch.Tensor], tuple[torch.Tensor, int]],
    plan: Callable[[int, int, int, int, torch.device], SparseGluonPlan],
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    softmax_scale: float,
    extra_kv: torch.Tensor | None,
    extra_indices: torch.Tensor | None,
    extra_lengths: torch.Tensor | None,
    out_positions: torch.Tensor | None,
    out_cos_sin_cache: torch.Tensor | None,
    fused_combine: bool | None = None,
    persistent_programs: int | None = None,
    **constexprs,
) -> torch.Tensor:
    """One call of a served sparse_attention (the caller checked `not_served`) on a Gluon kernel whose arguments are
    (q, kv, indices, extra_kv, extra_indices, extra_lengths, sinks, dst, part_lse, out_positions, out_cos_sin_cache,
    softmax_scale * log2(e), K, K2, strides...) and the constexprs H, D, R, BLOCK_M, BLOCK_N, STAGES, HAS_EXTRA,
    HAS_LENGTHS, ROPE, DIRECT plus the kernel's own (`constexprs`). cache_arg(cache): the cache as the kernel reads it and
    its row stride in those elements; plan(tokens, heads, K, K2, device): the launch's plan. Several splits: the
    partials are merged by sparse_attention.py's combine kernel, or with fused_combine by the kernel's last split
    (`merge_splits_if_last`). fused_combine None: the kernel has no such arguments (the FP8 kernel); True / False: it
    takes cnt_ptr, out_ptr, stride_out_t, stride_out_h and FUSED_COMBINE by keyword. persistent_programs: a persistent
    kernel (sparse_attention_gluon_persistent.py) on at most this many programs (a 1-D grid), which also takes
    num_items, head_tiles and num_splits by keyword; None: a program per (head tile, query, split)."""
    from deepinfer_cuda.kernels import sparse_attention as tl_sparse

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
    p = plan(tokens, heads, indices.shape[1], width2, q.device)
    rope = out_positions is not None
    if p.direct:
        dst, part_lse = out, out  # (part_lse unused)
        dst_strides, pl_strides = (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        dst = torch.empty(tokens, p.num_splits, heads, dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(tokens, p.num_splits, heads, dtype=torch.float32, device=q.device)
        dst_strides, pl_strides = (dst.stride(0), dst.stride(2), dst.stride(1)), (part_lse.stride(0), part_lse.stride(1))
    fused = bool(fused_combine) and not p.direct
    rotate_here = rope and (p.direct or fused)  # (with splits the combine rotates, with the fused combine the kernel's merge)
    opos = out_positions.contiguous() if rotate_here else indices  # (unused without the rotation)
    ocs = out_cos_sin_cache.contiguous() if rotate_here else sinks
    kv_arg, stride_kv = cache_arg(kv)
    xkv_arg, stride_xkv = cache_arg(xkv)
    fused_args = {}
    if fused_combine is not None:
        cnt = split_counters(q.device, tokens * p.head_tiles * 2) if fused else indices  # (unused without the fused combine)
        fused_args = dict(cnt_ptr=cnt, out_ptr=out, stride_out_t=out.stride(0), stride_out_h=out.stride(1), FUSED_COMBINE=fused)
    grid = (p.head_tiles, tokens, p.num_splits)
    if persistent_programs is not None:
        items = p.head_tiles * tokens * p.num_splits
        grid = (max(1, min(items, persistent_programs)),)
        fused_args.update(num_items=items, head_tiles=p.head_tiles, num_splits=p.num_splits)
    kernel[grid](
        q, kv_arg, indices, xkv_arg, xidx, xlen, sinks,
        dst, part_lse, opos, ocs,
        float(softmax_scale) * LOG2E,
        indices.shape[1], width2,
        q.stride(0), q.stride(1),
        stride_kv, indices.stride(0),
        stride_xkv, xidx.stride(0),
        *dst_strides,
        *pl_strides,
        ocs.stride(0),
        H=heads, D=dim, R=ocs.shape[-1] if rotate_here else 0,
        BLOCK_M=BLOCK_M, BLOCK_N=p.block_n, STAGES=p.stages,
        HAS_EXTRA=has_extra, HAS_LENGTHS=has_lengths,
        ROPE=rotate_here, DIRECT=p.direct,
        num_warps=4,
        **constexprs,
        **fused_args,
    )
    if not p.direct and not fused:
        tl_sparse.combine_splits(dst, part_lse, sinks, out, out_positions, out_cos_sin_cache)
    return out


_SPLIT_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}  # every buffer handed out, the newest last (never freed)
SPLIT_COUNTERS_MIN = 1 << 18  # 1 MiB of int32: 65535 queries x 2 head tiles x 2 halves


def split_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` int32 zeros on `device` for FUSED_COMBINE's per-(query, head tile, half) counters, kept across
    calls: each launch leaves them zero (the last split of each resets its own), so no launch zeroes them (one kernel
    fewer in a CUDA graph). A buffer is never freed: a captured CUDA graph keeps its address. Launches that overlap on
    two streams would share them: the decode step runs one stream."""
    kept = _SPLIT_COUNTERS.setdefault(device, [])
    if not kept or kept[-1].numel() < count:
        kept.append(torch.zeros(max(count, SPLIT_COUNTERS_MIN), dtype=torch.int32, device=device))
    return kept[-1]

