"""Gluon kernel (SM90): the persistent variant of the bf16-cache `sparse_attention` kernel (sparse_attention_gluon.py).
Chosen only by sparse_attention_gluon.PERSISTENT (off) or a launch's persistent=True (the GPU tests and `python -m
deepinfer_cuda.bench.sparse_attention_sweep --sweep sparse_gluon_bf16`). On an H100 (2026-12-07) the sweep timed it no
faster than the default (B64 38.0 against 37.4 us, B256 91.7 against 90.5), its outputs within 0.002 of the tl
kernel's; its GPU tests have not run. Compiled by `deepinfer
bench compile --arch sm90 --case "bf16 gluon"` (its "persistent" cases).

Why: the launch-per-item kernel runs one (head tile, query, split) a program and, at one program an SM (its ~210 KB of
shared memory), a program's gathering starts only when it starts: at B256 (256 programs on 132 SMs) each SM's second
program begins with its pipeline empty (its q and first tiles in flight, nothing else), and the SM's loads stop while
the first program's last tiles are multiplied and its output stored. Here min(items, SMs) programs each run items
item = program, program + programs, ... (an item: query-major, its splits adjacent), and the loader goes on to the next
item's rows as soon as a stage is free, so the next item's first tiles are in flight during the last one's tail.

Schedule: the launch-per-item kernel's, each partition looping over its items with its tile count carried across them
(tile g of the program's sequence in stage g % STAGES, p's buffer g % 2: the mbarrier phases run on), through the
shared helpers: sparse_attention_gluon.load_tiles (the loader), sparse_attention_gluon_common.issue_q_copy,
softmax_tiles, softmax_epilogue (the softmax warpgroup), value_tiles, value_epilogue (the value warpgroup). One
handshake more: fin_free, the value warpgroup has read an item's per-row factor, before the softmax warpgroup writes
the next item's (fin_bar's phase is the item's parity). Two more for q: the loader copies each item's q into q_smem
by cp.async (q_ready) once the softmax warpgroup is done with the previous item's (q_free, arrived when its last tile's
scores are done), so q lands behind that tile's softmax, products and epilogue (the softmax warpgroup copying it
itself spilled: its 240 registers hold the accumulator there). With several splits the
partials are merged by the combine kernel or, with the fused combine, by each query's last split
(merge_splits_if_last; splits adjacent in item order finish close together).
Not a registration module: sparse_attention_gluon.py launches it.
"""

from __future__ import annotations

from deepinfer_cuda.kernels.gluon_hopper import GLUON_IMPORT_ERROR

if GLUON_IMPORT_ERROR is None:  # (else the bf16 launch declines every call before it gets here)
    from deepinfer_cuda.kernels.gluon_hopper import async_copy, fence_async_shared, gl, gluon, mbarrier
    from deepinfer_cuda.kernels.gluon_hopper import sync_warps as _sync_warps
    from deepinfer_cuda.kernels.sparse_attention_gluon import load_tiles  # (that module imports this one only when it launches it)
    from deepinfer_cuda.kernels.sparse_attention_gluon_common import (
        allocate_shared,
        issue_q_copy,
        query_tiles_at,
        softmax_epilogue,
        softmax_tiles,
        value_epilogue,
        value_tiles,
    )

    @gluon.jit
    def _item_ids(item, head_tiles, splits):
        """An item's (head tile, query, split): query-major, a query's splits adjacent."""
        split = item % splits
        rest = item // splits
        return rest % head_tiles, rest // head_tiles, split

    @gluon.jit
    def _persistent_loader(q_ptr, kv_ptr, xkv_ptr, idx_ptr, xidx_ptr, xlen_ptr, q_smem, bf_smem, scale_smem, bf_ready, bf_empty, q_ready, q_free,
                           num_items, head_tiles, splits, K, K2, stride_q_t, stride_q_h, stride_kv, stride_xkv, stride_idx_t, stride_xidx_t,
                           H: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_EXTRA: gl.constexpr,
                           HAS_LENGTHS: gl.constexpr):
        """The loader over the program's items: each item's q (issue_q_copy), then its tiles (load_tiles: the bf16 kernel's,
        tile counts carried across items)."""
        g0 = 0
        n = 0
        for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
            tile, tok, split = _item_ids(item, head_tiles, splits)
            nb1, width2, lo, num_tiles = query_tiles_at(xlen_ptr, K, K2, tok, split, splits, BLOCK_N, HAS_LENGTHS)
            t64 = tok.to(gl.int64)
            # the item's q, once the softmax warpgroup's last scores of the previous item are done (about when the stage
            # this item's first tile goes to is released: the wait costs the tiles little)
            mbarrier.wait(q_free, (n & 1) ^ 1)
            issue_q_copy(q_ptr, q_smem, tile, tok, True, stride_q_t, stride_q_h, H, D, BLOCK_M)
            async_copy.mbarrier_arrive(q_ready, increment_count=False)  # once this thread's copies have landed
            n += 1
            load_tiles(kv_ptr, xkv_ptr, idx_ptr + t64 * stride_idx_t, xidx_ptr + t64 * stride_xidx_t, bf_smem, scale_smem, bf_ready, bf_empty, g0, lo,
                       num_tiles, nb1, K, width2, stride_kv, stride_xkv, D, BLOCK_N, STAGES, HAS_EXTRA)
            g0 += num_tiles
        # (no copy outstanding when the warps exit)
        async_copy.commit_group()
        async_copy.wait_group(0)

    @gluon.jit
    def _persistent_softmax(q_smem, bf_smem, bf_halves, scale_smem, p_smem, alpha_smem, fin_smem, bf_ready, bf_empty, p_ready, p_free,
                            fin_bar, fin_free, q_ready, q_free, sinks_ptr, dst_ptr, part_lse_ptr, xlen_ptr, num_items, head_tiles, splits, K, K2, qk_scale,
                            stride_o_t, stride_o_h, stride_po_split, stride_pl_t, stride_pl_split,
                            cnt_ptr, out_ptr, stride_out_t, stride_out_h,
                            H: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                            DIRECT: gl.constexpr, EARLY_RELEASE: gl.constexpr, HAS_LENGTHS: gl.constexpr, FUSED: gl.constexpr):
        """The softmax warpgroup over the program's items: q (q_ready: the loader copied it in; q_free once the last tile's
        scores are done), the tiles, the epilogue (after fin_free: the value warpgroup has read the previous item's factor)."""
        g0 = 0
        n = 0
        for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
            tile, tok, split = _item_ids(item, head_tiles, splits)
            _nb1, _width2, _lo, num_tiles = query_tiles_at(xlen_ptr, K, K2, tok, split, splits, BLOCK_N, HAS_LENGTHS)
            mbarrier.wait(q_ready, n & 1)  # this item's q, copied in by the loader
            fence_async_shared()  # (written by cp.async, the generic proxy; read by wgmma, the async proxy)
            m_i, l_i, acc = softmax_tiles(q_smem, bf_smem, bf_halves, scale_smem, p_smem, alpha_smem, bf_ready, bf_empty, p_ready, p_free, g0,
                                          num_tiles, qk_scale, D, BLOCK_M, BLOCK_N, STAGES, True, EARLY_RELEASE, q_free, True)
            if num_tiles == 0:  # (no last tile's scores released q)
                mbarrier.arrive(q_free)
            mbarrier.wait(fin_free, (n & 1) ^ 1)
            tile, tok, split = _item_ids(item, head_tiles, splits)  # (recomputed: not live across the tiles)
            softmax_epilogue(m_i, l_i, acc, fin_smem, fin_bar, sinks_ptr, dst_ptr, part_lse_ptr, tile, tok, split, head_tiles, splits,
                             stride_o_t, stride_o_h, stride_po_split, stride_pl_t, stride_pl_split, cnt_ptr, out_ptr, stride_out_t, stride_out_h,
                             H, D, BLOCK_M, BLOCK_N, DIRECT, FUSED)
            g0 += num_tiles
            n += 1

    @gluon.jit
    def _persistent_value(bf_halves, p_smem, alpha_smem, fin_smem, bf_ready, bf_empty, p_ready, p_free, fin_bar, fin_free,
                          dst_ptr, opos_ptr, ocs_ptr, sinks_ptr, part_lse_ptr, cnt_ptr, out_ptr, xlen_ptr, num_items, head_tiles, splits, K, K2,
                          stride_o_t, stride_o_h, stride_po_split, stride_ocs, stride_pl_t, stride_pl_split, stride_out_t, stride_out_h,
                          H: gl.constexpr, D: gl.constexpr, R: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                          ROPE: gl.constexpr, HAS_LENGTHS: gl.constexpr, FUSED: gl.constexpr):
        """The value warpgroup over the program's items: the tiles, the item's factor (fin_bar at the item's parity; read,
        then fin_free), the epilogue."""
        row_layout: gl.constexpr = gl.SliceLayout(1, gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D // 2, 16]))
        g0 = 0
        n = 0
        for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
            tile, tok, split = _item_ids(item, head_tiles, splits)
            _nb1, _width2, _lo, num_tiles = query_tiles_at(xlen_ptr, K, K2, tok, split, splits, BLOCK_N, HAS_LENGTHS)
            acc = value_tiles(bf_halves, p_smem, alpha_smem, bf_ready, bf_empty, p_ready, p_free, g0, num_tiles, D, BLOCK_M, STAGES, True)
            mbarrier.wait(fin_bar, n & 1)
            factor = fin_smem.load(row_layout)
            _sync_warps()  # every thread has read it
            mbarrier.arrive(fin_free)
            tile, tok, split = _item_ids(item, head_tiles, splits)
            value_epilogue(acc, factor, dst_ptr, opos_ptr, ocs_ptr, tile, tok, split, head_tiles, splits, stride_o_t, stride_o_h, stride_po_split,
                           stride_ocs, sinks_ptr, part_lse_ptr, cnt_ptr, out_ptr, stride_pl_t, stride_pl_split, stride_out_t, stride_out_h,
                           H, D, R, BLOCK_M, ROPE, FUSED)
            g0 += num_tiles
            n += 1

    @gluon.jit
    def sparse_attention_persistent_kernel(
        q_ptr,
        kv_ptr, idx_ptr,
        xkv_ptr, xidx_ptr, xlen_ptr,
        sinks_ptr,
        dst_ptr,
        part_lse_ptr, opos_ptr, ocs_ptr,
        qk_scale,
        K, K2,
        stride_q_t, stride_q_h,
        stride_kv, stride_idx_t,
        stride_xkv, stride_xidx_t,
        stride_o_t, stride_o_h, stride_po_split,
        stride_pl_t, stride_pl_split,
        stride_ocs,
        H: gl.constexpr, D: gl.constexpr, R: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        HAS_EXTRA: gl.constexpr, HAS_LENGTHS: gl.constexpr,
        ROPE: gl.constexpr,
        DIRECT: gl.constexpr,
        REGS_VALUE: gl.constexpr, REGS_LOADER: gl.constexpr, LOADER_WARPS: gl.constexpr,
        EARLY_RELEASE: gl.constexpr,
        num_warps: gl.constexpr,
        cnt_ptr, out_ptr, stride_out_t, stride_out_h,
        FUSED_COMBINE: gl.constexpr,
        num_items, head_tiles, num_splits,  # the items (head_tiles x queries x num_splits) the programs share
    ):
        """sparse_attention_gluon._sparse_attention_ws_kernel's arguments (the same launch, common.launch) and the items:
        a 1-D grid of min(items, SMs) programs."""
        gl.static_assert(D % 64 == 0, "the stages are 64-column chunks")
        gl.static_assert(BLOCK_N % 16 == 0, "the value products' K")
        q_smem, bf_smem, bf_halves, p_smem, scale_smem, alpha_smem, fin_smem, bf_ready, bf_empty, p_ready, p_free, fin_bar = allocate_shared(
            D, BLOCK_M, BLOCK_N, STAGES, LOADER_WARPS * 32 + 1)
        fin_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(fin_free, count=1)
        mbarrier.init(q_ready, count=LOADER_WARPS * 32)  # every loader thread's copies of q
        mbarrier.init(q_free, count=1)

        gl.warp_specialize(
            [
                (_persistent_softmax, (q_smem, bf_smem, bf_halves, scale_smem, p_smem, alpha_smem, fin_smem, bf_ready, bf_empty, p_ready, p_free,
                                       fin_bar, fin_free, q_ready, q_free, sinks_ptr, dst_ptr, part_lse_ptr, xlen_ptr, num_items, head_tiles, num_splits,
                                       K, K2, qk_scale, stride_o_t, stride_o_h, stride_po_split, stride_pl_t, stride_pl_split,
                                       cnt_ptr, out_ptr, stride_out_t, stride_out_h,
                                       H, D, BLOCK_M, BLOCK_N, STAGES, DIRECT, EARLY_RELEASE, HAS_LENGTHS, FUSED_COMBINE)),
                (_persistent_value, (bf_halves, p_smem, alpha_smem, fin_smem, bf_ready, bf_empty, p_ready, p_free, fin_bar, fin_free,
                                     dst_ptr, opos_ptr, ocs_ptr, sinks_ptr, part_lse_ptr, cnt_ptr, out_ptr, xlen_ptr, num_items, head_tiles, num_splits, K, K2,
                                     stride_o_t, stride_o_h, stride_po_split, stride_ocs, stride_pl_t, stride_pl_split, stride_out_t, stride_out_h,
                                     H, D, R, BLOCK_M, BLOCK_N, STAGES, ROPE, HAS_LENGTHS, FUSED_COMBINE)),
                (_persistent_loader, (q_ptr, kv_ptr, xkv_ptr, idx_ptr, xidx_ptr, xlen_ptr, q_smem, bf_smem, scale_smem, bf_ready, bf_empty, q_ready,
                                      q_free, num_items, head_tiles, num_splits, K, K2, stride_q_t, stride_q_h, stride_kv, stride_xkv, stride_idx_t,
                                      stride_xidx_t, H, BLOCK_M, D, BLOCK_N, STAGES, HAS_EXTRA, HAS_LENGTHS)),
            ],
            [4, LOADER_WARPS],
            [REGS_VALUE, REGS_LOADER],
        )
