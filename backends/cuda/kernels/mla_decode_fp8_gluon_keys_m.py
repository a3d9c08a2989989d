"""Gluon kernel (SM90): `mla_decode` over the FP8 KV cache for at most 16 query rows, keys as the wgmma's M.

Not a registration module: mla_decode_fp8_gluon.py's launch sends the calls of at most 16 rows here when the tuning
entry mla_decode/gluon_fp8 says "keys_as_m" (the table's default since 2026-12-07). Compiled in CI by `deepinfer bench compile
--case gluon` (wgmma, no spills, TMA).

Semantics: mla_decode_fp8_gluon.py's (FP8 rows of 576 e4m3 values and a float32 scale at byte 576, 592 bytes, pages of
64; scores in the log2 domain, value = e4m3 * row scale applied to a key's score and its softmax weight; one split
writes the output, several write the split partials that mla_decode.py's combine merges).

Why: at 16 heads (V2-Lite, V3 at eight-way tensor parallelism) the FP8 reader (mla_decode_fp8_gluon.py) runs each
64-row wgmma with three quarters padding and re-reads a [64, 576] q (48 rows of zeros) from shared memory for every
tile: about 400 KB of shared-memory traffic a 64-key tile against 38 KB of cache bytes, and it reached 0.77-0.91x the
bf16 reader where it reads 51% of the bytes (H100, 2026-12-07). Swapping the products' operands makes the keys the M
that wgmma needs 64 of and the heads its N (16): s^T = k . q^T and o^T = v^T . p^T. Nothing is padded, q^T is 18 KB,
and k comes from registers: the warps that convert a tile's e4m3 bytes feed them to the score wgmmas directly, so a
tile's keys cross shared memory once as bytes (the TMA copy) and its values once more as bf16 (for o^T's A operand).

Schedule: one program per (request, split), grid (1, B, splits) as the other Gluon kernel's plan; tiles of 64 cache rows
(one page). Three partitions:
- loader (a worker, 1 warp): per tile, one TMA copy of the page's 64 rows ([64, 148] 32-bit words, unswizzled) into
  ring stage j % 2 once the stage is free; a split's partial last tile lands on its own mbarrier, gets its rows past
  the end zeroed (no NaN code of a stale row reaches a product), then is handed over.
- two math warpgroups (the default partition W = 0, a worker W = 1), tiles alternating: warpgroup W takes tiles
  j = W, W + 2, ... (stage W of the ring). Per tile:
  1. for each of the 9 chunks of 64 bytes a row: the chunk's bytes from shared memory (a thread: 16 bytes of two rows),
     converted to "raw" bf16 (mla_decode_fp8_gluon's E4M3X4_TO_RAW_BF16X4_PTX: value * 2^-112, exact; the row scale
     carries 2^112 back); the 8 value chunks stored into the warpgroup's own bf16 value buffer (natural order); the
     chunk, its columns reordered so that the thread's registers already are wgmma's A-operand fragment
     (`_mma_k_order`, a relabelling: no data moves), is the A of s^T += k . q^T (m64n16k16 x 4, q^T from shared
     memory, q's columns reordered the same way when it was staged: the dot product does not depend on the order);
  2. the rows' scales read, the stage released to the loader (its bytes are all in registers or the value buffer);
  3. s^T times scale * qk_scale, masked (rows past the split's end; with S > 1 also after a column's query position);
     the online softmax per column (head): the column maxima over the 64 keys (across the warpgroup's 4 warps), alpha,
     p^T = exp2(s^T - m); the row sums kept per thread and summed once after the loop;
  4. p^T * row scale in bf16 to the warpgroup's p buffer; o^T[chunk] = o^T[chunk] * alpha + v^T[chunk] . p^T for the 8
     chunks of 64 value columns (A: the value buffer's chunk, transposed; m64n16k16 x 4 each); waited for in the
     iteration (no wgmma in flight across the loop's back edge).
  After the loop warpgroup 1 hands (m, l, o^T) to warpgroup 0 through its value buffer; warpgroup 0 merges the two
  online softmaxes and stores the program's 16 rows (DIRECT: the output; else the split partial and its lse).
Shared memory: q^T 18 KiB + the ring 2 x 37 KiB + two value buffers 2 x 64 KiB + p^T 4 KiB: 225 KiB of the 227 an SM90
block may have (one CTA per SM). Registers (setmaxnreg): 232 each math warpgroup, 40 the loader's (padded to a
warpgroup); o^T is 8 [64, 16] float32 accumulators, 64 registers a thread.

Served: mla_decode_fp8_gluon.py's calls (its `not_served`) of at most 16 query rows (S * H), and the cache's rows as a
TMA matrix (`not_served` here: fewer than 2^31 rows).

Checked: compiled for sm90 (Triton 3.9 and 3.6); its CPU test emulates its schedule's arithmetic (the two warpgroups'
online softmaxes over alternate tiles and their merge, the raw bf16 and the row scales) against the op. On an H100
(Triton 3.6, 2026-12-07, docs/measurements/2026-12-07/h100_round16/): its GPU tests against the tl kernel (7 shapes)
and `deepinfer conformance --backend cuda --op mla_decode` with it on (16) passed. Speed at 16 heads, ctx 4096, CUDA
graphs: B32 / B64 / B96 / B128 43.5 / 72.8 / 119.8 / 131.0 us against the split-keys kernel's 70.0 / 126.4 / 204.1 /
234.9. Timed on the stream, calls with split partials are bound by the host (three TMA descriptors, the plan and the
combine launch a call: B64 182 against 158 us).

Triton 3.6 (the GPU machine) and 3.9 differ in names used here: gluon_hopper.py's shims.
"""

from __future__ import annotations

import torch

from deepinfer_cuda.kernels import mla_decode_gluon_parts as parts
from deepinfer_cuda.kernels.gluon_hopper import GLUON_IMPORT_ERROR
from deepinfer_cuda.kernels.mla_decode_gluon_parts import LATENT, PAGE, ROPE

if GLUON_IMPORT_ERROR is None:  # (else mla_decode_fp8_gluon.py declines every call)
    from deepinfer_cuda.kernels.gluon_hopper import (
        TensorDescriptor,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        reinterpret_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from deepinfer_cuda.kernels.gluon_hopper import sync_warps as _sync_warps
    from deepinfer_cuda.kernels.gluon_hopper import tma_load as _tma_load
    from deepinfer_cuda.kernels.mla_decode_fp8_gluon import _E4M3X4_TO_RAW_BF16X4, RAW_UNIT
    from deepinfer_cuda.kernels.mla_decode_gluon_parts import _hidden_zero, _split_range

MAX_ROWS = 16  # S * H: the products' N
ROW_WORDS = (LATENT + ROPE + 16) // 4  # 148 32-bit words a cache row (576 e4m3 bytes, the scale, padding)
PARTITION_REGS = (232, 40)  # setmaxnreg of math warpgroup 1 and of the loader's warpgroup (warpgroup 0: the rest, 232)


def mma_k_order(x: torch.Tensor) -> torch.Tensor:
    """The kernel's column order within each 64-column chunk (`_mma_k_order`), in torch: column 16 i + 8 h + 2 c + j
    of the result is column 16 c + 4 i + 2 h + j of x (x [..., 64 * chunks]). The test checks q and k reordered this way
    give the same dot products, and it is the kernel's relabelling of a thread's 16 consecutive bytes of a row
    (c = lane % 4) as its A fragment for four k16 steps i (bf16 pairs j of halves h)."""
    lead = len(x.shape) - 1
    order = (*range(lead), lead, lead + 2, lead + 3, lead + 1, lead + 4)  # (chunk, c, i, h, j) -> (chunk, i, h, c, j)
    return x.reshape(*x.shape[:-1], -1, 4, 4, 2, 2).permute(order).reshape(*x.shape[:-1], -1)


if GLUON_IMPORT_ERROR is None:

    @gluon.jit
    def _mma_k_order(x):
        """[rows, 64] -> the same values, columns reordered as `mma_k_order` (the torch twin) says."""
        rows: gl.constexpr = x.shape[0]
        return gl.reshape(gl.permute(gl.reshape(x, [rows, 4, 4, 2, 2]), [0, 2, 3, 1, 4]), [rows, 64])

    @gluon.jit
    def _stage_q_t(q_smem, q_nope_ptr, q_rope_ptr, stride_qn_b, stride_qn_s, stride_qn_h, stride_qr_b, stride_qr_s, stride_qr_h,
                   S: gl.constexpr, H: gl.constexpr, C: gl.constexpr, R: gl.constexpr, N: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
        """q [N rows, 576] of the program's request -> 9 [N, 64] chunks in `_mma_k_order` (rows past S*H zero), by the
        default warps before the fork; then the fence that shows them (and the mbarriers' init) to wgmma and TMA."""
        q_blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        offs_m = gl.arange(0, N, layout=gl.SliceLayout(1, q_blocked))
        offs_c = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, q_blocked)), 0)
        m_ok = gl.expand_dims(offs_m < S * H, 1)
        b64 = gl.program_id(1).to(gl.int64)
        qn_rows = gl.expand_dims(q_nope_ptr + b64 * stride_qn_b + (offs_m // H) * stride_qn_s + (offs_m % H) * stride_qn_h, 1)
        for c in gl.static_range(C // 64):
            q_smem.index(c).store(_mma_k_order(gl.load(qn_rows + c * 64 + offs_c, mask=m_ok, other=0.0).to(gl.bfloat16)))
        qr_rows = gl.expand_dims(q_rope_ptr + b64 * stride_qr_b + (offs_m // H) * stride_qr_s + (offs_m % H) * stride_qr_h, 1)
        for c in gl.static_range(R // 64):
            q_smem.index(C // 64 + c).store(_mma_k_order(gl.load(qr_rows + c * 64 + offs_c, mask=m_ok, other=0.0).to(gl.bfloat16)))
        fence_async_shared()

    @gluon.jit
    def _zero_rows_from(lat_rows, rope_rows, scale_rows, t, live, BLOCK_N: gl.constexpr):
        """Rows live .. BLOCK_N - 1 of ring stage t set to zero by the loader's warp (the *_rows views: [2 * BLOCK_N, words])."""
        wide: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
        narrow: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        for r in range(t * BLOCK_N + live, (t + 1) * BLOCK_N):
            lat_rows.index(r).store(gl.zeros([128], gl.int32, layout=wide))
            rope_rows.index(r).store(gl.zeros([16], gl.int32, layout=narrow))
            scale_rows.index(r).store(gl.zeros([4], gl.int32, layout=narrow))

    @gluon.jit
    def _copy_tile(lat_desc, rope_desc, scale_desc, row, lat, rope, scale, t, bar):
        """The TMA copies of the page at cache row `row` into ring stage t (its latent, rope and scale words), on `bar`."""
        mbarrier.expect(bar, lat_desc.block_type.nbytes + rope_desc.block_type.nbytes + scale_desc.block_type.nbytes)
        _tma_load(lat_desc, [row, 0], bar, lat.index(t))
        _tma_load(rope_desc, [row, 128], bar, rope.index(t))
        _tma_load(scale_desc, [row, 144], bar, scale.index(t))

    @gluon.jit
    def _loader(lat_desc, rope_desc, scale_desc, bt_row, lat, rope, scale, lat_rows, rope_rows, scale_rows, ring_ready, ring_empty, landed,
                lo, split_end, num_tiles, PAGE: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
        """One warp: tile j's page (block-table entry lo // PAGE + j) into ring stage j % 2 once its math warpgroup has
        released the stage's previous tile (a fresh `empty` barrier counts as having completed the phase before 0)."""
        first = lo // PAGE
        for j in range(num_tiles):
            t = j % 2
            page = gl.load(bt_row + first + j).to(gl.int32)
            live = split_end - (lo + j * BLOCK_N)  # rows of the tile before the split's end
            mbarrier.wait(ring_empty.index(t), ((j // 2) & 1) ^ 1)
            if live >= BLOCK_N:
                _copy_tile(lat_desc, rope_desc, scale_desc, page * PAGE, lat, rope, scale, t, ring_ready.index(t))
            else:  # (at most once a program: the last tile)
                _copy_tile(lat_desc, rope_desc, scale_desc, page * PAGE, lat, rope, scale, t, landed)
                mbarrier.wait(landed, 0)
                _zero_rows_from(lat_rows, rope_rows, scale_rows, t, live, BLOCK_N)
                _sync_warps()
                mbarrier.arrive(ring_ready.index(t))

    @gluon.jit
    def _tile_scores(lat_bytes, rope_bytes, v_smem, q_smem, j, W: gl.constexpr, NUM_CHUNKS: gl.constexpr, s):
        """Tile j's keys (ring stage W) converted chunk by chunk: the value chunks into warpgroup W's value buffer, each
        chunk the A of s^T += k . q^T (async wgmmas; at most two chunks' fragments in flight)."""
        # the stage and q's chunks are indexed through a zero the compilers cannot see: else LLVM computes every chunk's
        # addresses and descriptors before the loop and keeps them live (ptxas 12.8 spilled them)
        t = W + _hidden_zero(j)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s.type.layout, k_width=2)
        # a [64, 64] byte chunk as wgmma's A fragment wants it after `_mma_k_order`: warp w, lane l holds 16 consecutive
        # bytes (one 16-byte load) of rows 16 w + l // 4 and that + 8, at byte 16 * (l % 4)
        bytes_layout: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
            lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]],
            block_bases=[],
            shape=[64, 64],
        )
        for c in gl.static_range(NUM_CHUNKS):
            if c < NUM_CHUNKS - 1:
                x = lat_bytes.index(t).slice(64 * c, 64, dim=1).load(bytes_layout)
            else:
                x = rope_bytes.index(t).load(bytes_layout)
            k = gl.inline_asm_elementwise(_E4M3X4_TO_RAW_BF16X4, "=r,=r,r", [x], dtype=gl.bfloat16, is_pure=True, pack=4)
            if c < NUM_CHUNKS - 1:
                v_smem.index(W * (NUM_CHUNKS - 1) + c).store(k)
            s = warpgroup_mma(
                gl.convert_layout(_mma_k_order(k), a_layout, assert_trivial=True), q_smem.index(t - W + c).permute((1, 0)), s, use_acc=c > 0, is_async=True
            )
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        return s

    @gluon.jit
    def _math(lat_bytes, rope_bytes, scale_words, v_smem, q_smem, p_smem, ml_smem, ring_ready, ring_empty, merged,
              dst_ptr, part_lse_ptr, seq_len, lo, split_end, num_tiles, qk_scale,
              stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, stride_pl_b, stride_pl_split,
              S: gl.constexpr, H: gl.constexpr, N: gl.constexpr, BLOCK_N: gl.constexpr, NUM_CHUNKS: gl.constexpr,
              ROW_WORDS: gl.constexpr, DIRECT: gl.constexpr, W: gl.constexpr):  # fmt: skip
        """Math warpgroup W: tiles W, W + 2, ... of the split (the module docstring's steps 1-4), then the merge."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
        keys_l: gl.constexpr = gl.SliceLayout(1, mma)  # along the 64 keys (or value columns) of a [64, N] tile
        cols_l: gl.constexpr = gl.SliceLayout(0, mma)  # along its N query rows
        V: gl.constexpr = NUM_CHUNKS - 1  # value chunks
        scale_l: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [4, 1], [1, 0])
        keys = gl.arange(0, BLOCK_N, layout=keys_l)
        cols = gl.arange(0, N, layout=cols_l)
        if S > 1:  # column n (query n // H) sees the keys before its position + 1
            col_end = gl.expand_dims(seq_len - S + cols // H + 1, 0)
        m_i = gl.full([N], float("-inf"), gl.float32, layout=cols_l)
        l_part = gl.zeros([BLOCK_N, N], gl.float32, layout=mma)  # row sums per thread, summed over the keys after the loop
        o0 = gl.zeros([64, N], gl.float32, layout=mma)
        o1 = gl.zeros([64, N], gl.float32, layout=mma)
        o2 = gl.zeros([64, N], gl.float32, layout=mma)
        o3 = gl.zeros([64, N], gl.float32, layout=mma)
        o4 = gl.zeros([64, N], gl.float32, layout=mma)
        o5 = gl.zeros([64, N], gl.float32, layout=mma)
        o6 = gl.zeros([64, N], gl.float32, layout=mma)
        o7 = gl.zeros([64, N], gl.float32, layout=mma)
        for j in range(W, num_tiles, 2):
            mbarrier.wait(ring_ready.index(W), (j // 2) & 1)
            # 1. the scores (and the value chunks stored on the way)
            s = _tile_scores(lat_bytes, rope_bytes, v_smem, q_smem, j, W, NUM_CHUNKS, gl.zeros([BLOCK_N, N], gl.float32, layout=mma))
            # 2. the rows' scales (float32, a row's word 144; 2^112 undoes the raw tile's 2^-112), then the stage is the loader's
            sc = gl.reshape(scale_words.index(W).slice(0, 1, dim=1).load(scale_l), [BLOCK_N])
            sc = gl.convert_layout(sc.to(gl.float32, bitcast=True), keys_l) * RAW_UNIT
            _sync_warps()
            mbarrier.arrive(ring_empty.index(W))
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            # 3. masked scores, the per-column online softmax
            visible = gl.expand_dims(keys < split_end - (lo + j * BLOCK_N), 1)
            if S > 1:
                visible = visible & (gl.expand_dims(keys + (lo + j * BLOCK_N), 1) < col_end)
            scores = gl.where(visible, s * gl.expand_dims(sc * qk_scale, 1), float("-inf"))
            m_new = gl.maximum(m_i, gl.max(scores, axis=0))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a column that has seen only -inf keeps weights 0
            alpha = gl.expand_dims(gl.exp2(m_i - m_safe), 0)
            p = gl.exp2(scores - gl.expand_dims(m_safe, 0))
            l_part = l_part * alpha + p
            m_i = m_new
            # 4. p^T * scale (bf16), then o^T = o^T * alpha + v^T . p^T over the value chunks
            p_smem.index(W).store((p * gl.expand_dims(sc, 1)).to(gl.bfloat16))
            fence_async_shared()  # the value buffer's and p's stores, before wgmma reads them (the async proxy)
            _sync_warps()
            pt = p_smem.index(W)
            o0 = warpgroup_mma(v_smem.index(W * V + 0).permute((1, 0)), pt, o0 * alpha, is_async=True)
            o1 = warpgroup_mma(v_smem.index(W * V + 1).permute((1, 0)), pt, o1 * alpha, is_async=True)
            o2 = warpgroup_mma(v_smem.index(W * V + 2).permute((1, 0)), pt, o2 * alpha, is_async=True)
            o3 = warpgroup_mma(v_smem.index(W * V + 3).permute((1, 0)), pt, o3 * alpha, is_async=True)
            o4 = warpgroup_mma(v_smem.index(W * V + 4).permute((1, 0)), pt, o4 * alpha, is_async=True)
            o5 = warpgroup_mma(v_smem.index(W * V + 5).permute((1, 0)), pt, o5 * alpha, is_async=True)
            o6 = warpgroup_mma(v_smem.index(W * V + 6).permute((1, 0)), pt, o6 * alpha, is_async=True)
            o7 = warpgroup_mma(v_smem.index(W * V + 7).permute((1, 0)), pt, o7 * alpha, is_async=True)
            o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, o2, o3, o4, o5, o6, o7))
        l_i = gl.sum(l_part, axis=0)
        # the merge: warpgroup 1's (m, l, o^T) through its value buffer (float32 [8, 64, N] view) and ml_smem
        # (the buffers as float32 [64, N] slots, 4 KiB each at N = 16: warpgroup 1's value buffer starts at slot 2 V)
        plain: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        o_view = reinterpret_shared(v_smem, gl.float32, [64 * V // N, 64, N], plain)
        HANDOFF: gl.constexpr = 32 * V // N
        if W == 1:
            ml_smem.index(0).store(m_i)
            ml_smem.index(1).store(l_i)
            o_view.index(HANDOFF + 0).store(o0)
            o_view.index(HANDOFF + 1).store(o1)
            o_view.index(HANDOFF + 2).store(o2)
            o_view.index(HANDOFF + 3).store(o3)
            o_view.index(HANDOFF + 4).store(o4)
            o_view.index(HANDOFF + 5).store(o5)
            o_view.index(HANDOFF + 6).store(o6)
            o_view.index(HANDOFF + 7).store(o7)
            _sync_warps()
            mbarrier.arrive(merged)
        else:
            mbarrier.wait(merged, 0)
            m_1 = ml_smem.index(0).load(cols_l)
            l_1 = ml_smem.index(1).load(cols_l)
            m = gl.maximum(m_i, m_1)
            m_safe = gl.where(m == float("-inf"), 0.0, m)
            a_0 = gl.exp2(m_i - m_safe)
            a_1 = gl.exp2(m_1 - m_safe)
            l_sum = l_i * a_0 + l_1 * a_1
            # mla_decode.py's split_partial: 1/l (1 for a column that saw no key: its o is 0) and lse (-inf there)
            has = l_sum > 0.0
            l_safe = gl.where(has, l_sum, 1.0)
            f_0 = gl.expand_dims(a_0 / l_safe, 0)
            f_1 = gl.expand_dims(a_1 / l_safe, 0)
            b = gl.program_id(1)
            split = gl.program_id(2)
            if not DIRECT:
                lse = gl.where(has, m + gl.log2(l_safe), float("-inf"))
                gl.store(part_lse_ptr + b.to(gl.int64) * stride_pl_b + split * stride_pl_split + cols, lse, mask=cols < S * H)
            if DIRECT:
                base = dst_ptr + b.to(gl.int64) * stride_o_b + (cols // H) * stride_o_s + (cols % H) * stride_o_h
            else:
                base = dst_ptr + b.to(gl.int64) * stride_po_b + split * stride_po_split + cols * stride_po_m
            ptrs = gl.expand_dims(base, 0) + gl.expand_dims(gl.arange(0, 64, layout=keys_l), 1)
            mask = gl.expand_dims(cols < S * H, 0) & gl.expand_dims(keys < 64, 1)
            ty = dst_ptr.dtype.element_ty
            gl.store(ptrs + 0 * 64, (o0 * f_0 + o_view.index(HANDOFF + 0).load(mma) * f_1).to(ty), mask=mask)
            gl.store(ptrs + 1 * 64, (o1 * f_0 + o_view.index(HANDOFF + 1).load(mma) * f_1).to(ty), mask=mask)
            gl.store(ptrs + 2 * 64, (o2 * f_0 + o_view.index(HANDOFF + 2).load(mma) * f_1).to(ty), mask=mask)
            gl.store(ptrs + 3 * 64, (o3 * f_0 + o_view.index(HANDOFF + 3).load(mma) * f_1).to(ty), mask=mask)
            gl.store(ptrs + 4 * 64, (o4 * f_0 + o_view.index(HANDOFF + 4).load(mma) * f_1).to(ty), mask=mask)
            gl.store(ptrs + 5 * 64, (o5 * f_0 + o_view.index(HANDOFF + 5).load(mma) * f_1).to(ty), mask=mask)
            gl.store(ptrs + 6 * 64, (o6 * f_0 + o_view.index(HANDOFF + 6).load(mma) * f_1).to(ty), mask=mask)
            gl.store(ptrs + 7 * 64, (o7 * f_0 + o_view.index(HANDOFF + 7).load(mma) * f_1).to(ty), mask=mask)

    @gluon.jit(do_not_specialize=["tokens_per_split"])
    def _mla_decode_fp8_keys_m_kernel(
        lat_desc,  # TMA over the cache's [pages * 64, 148] int32 words: [64, 128] boxes (the latent bytes), unswizzled
        q_nope_ptr, q_rope_ptr, block_table_ptr, seq_lens_ptr,
        dst_ptr,  # DIRECT: the output [B, S, H, C]; else the split partials [B, splits, rows, C] float32
        part_lse_ptr,
        qk_scale,  # softmax_scale * log2(e)
        tokens_per_split,  # a multiple of BLOCK_N
        rope_desc, scale_desc,  # the same words in [64, 16] boxes (the rope bytes) and [64, 4] (the scale and padding)
        stride_qn_b, stride_qn_s, stride_qn_h, stride_qr_b, stride_qr_s, stride_qr_h, stride_bt_b,
        stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, stride_pl_b, stride_pl_split,
        S: gl.constexpr, H: gl.constexpr, C: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DIRECT: gl.constexpr,
        N: gl.constexpr, ROW_WORDS: gl.constexpr, REGS_MATH: gl.constexpr, REGS_LOAD: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        NUM_CHUNKS: gl.constexpr = (C + R) // 64
        seq_len, lo, split_end, num_tiles = _split_range(seq_lens_ptr, tokens_per_split, BLOCK_N)
        bt_row = block_table_ptr + gl.program_id(1).to(gl.int64) * stride_bt_b

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_CHUNKS, N, 64], gl.NVMMASharedLayout.get_default_for([N, 64], gl.bfloat16))
        lat = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N, 128], lat_desc.layout)
        rope = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N, 16], rope_desc.layout)
        scale = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N, 4], scale_desc.layout)
        plain: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])  # row-major views of the ring
        rows: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])  # its rows one by one (the loader's zeroing)
        lat_bytes = reinterpret_shared(lat, gl.int8, [2, BLOCK_N, 512], plain)
        rope_bytes = reinterpret_shared(rope, gl.int8, [2, BLOCK_N, 64], plain)
        scale_words = reinterpret_shared(scale, gl.int32, [2, BLOCK_N, 4], plain)
        lat_rows = reinterpret_shared(lat, gl.int32, [2 * BLOCK_N, 128], rows)
        rope_rows = reinterpret_shared(rope, gl.int32, [2 * BLOCK_N, 16], rows)
        scale_rows = reinterpret_shared(scale, gl.int32, [2 * BLOCK_N, 4], rows)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * (NUM_CHUNKS - 1), BLOCK_N, 64], gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16))
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, N], gl.NVMMASharedLayout.get_default_for([BLOCK_N, N], gl.bfloat16))
        ml_smem = gl.allocate_shared_memory(gl.float32, [2, N], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
        ring_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ring_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        landed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        merged = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ring_ready.index(i), count=1)
            mbarrier.init(ring_empty.index(i), count=1)
        mbarrier.init(landed, count=1)
        mbarrier.init(merged, count=1)
        _stage_q_t(q_smem, q_nope_ptr, q_rope_ptr, stride_qn_b, stride_qn_s, stride_qn_h, stride_qr_b, stride_qr_s, stride_qr_h, S, H, C, R, N, num_warps)

        # fmt: off
        gl.warp_specialize(
            [
                (_math, (lat_bytes, rope_bytes, scale_words, v_smem, q_smem, p_smem, ml_smem, ring_ready, ring_empty, merged, dst_ptr, part_lse_ptr,
                         seq_len, lo, split_end, num_tiles, qk_scale, stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m,
                         stride_pl_b, stride_pl_split, S, H, N, BLOCK_N, NUM_CHUNKS, ROW_WORDS, DIRECT, 0)),
                (_math, (lat_bytes, rope_bytes, scale_words, v_smem, q_smem, p_smem, ml_smem, ring_ready, ring_empty, merged, dst_ptr, part_lse_ptr,
                         seq_len, lo, split_end, num_tiles, qk_scale, stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m,
                         stride_pl_b, stride_pl_split, S, H, N, BLOCK_N, NUM_CHUNKS, ROW_WORDS, DIRECT, 1)),
                (_loader, (lat_desc, rope_desc, scale_desc, bt_row, lat, rope, scale, lat_rows, rope_rows, scale_rows, ring_ready, ring_empty,
                           landed, lo, split_end, num_tiles, PAGE, BLOCK_N)),
            ],
            [4, 1],
            [REGS_MATH, REGS_LOAD],
        )
        # fmt: on


# ---------------------------------------------------------------------------------------------
# Host side


def not_served(q_nope: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
    """Why this kernel does not serve a call that mla_decode_fp8_gluon.py serves (None: it does)."""
    rows = q_nope.shape[1] * q_nope.shape[2]
    if rows > MAX_ROWS:
        return f"S*H = {rows}: wants <= {MAX_ROWS}"
    if kv_cache.shape[0] * PAGE >= 2**31:
        return "more cache rows than a 32-bit TMA coordinate reaches"
    return None


_last_descriptors: list = [None, None]  # the last cache's (key, descriptors): an engine passes one cache every step


def _descriptors(kv_cache: torch.Tensor) -> tuple:
    """TMA over the cache's rows as [pages * 64, 148] int32 words, unswizzled (the math warps read 16-byte runs of rows),
    in [64, 128], [64, 16] and [64, 4] boxes (a page's latent, rope and scale words: a box's sides are powers of 2).
    The last cache's are kept (building them took 30 of an eager call's 334 µs on the host at B64 on an H100 machine); they
    hold a view of it, so no other tensor can have its address while they are kept, and the key cannot go stale."""
    key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.stride(), kv_cache.device)
    if _last_descriptors[0] != key:
        words = kv_cache.view(torch.int32)
        rows = words.as_strided((kv_cache.shape[0] * PAGE, ROW_WORDS), (words.stride(1), 1))
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        _last_descriptors[:] = [key, tuple(TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [PAGE, width], layout) for width in (128, 16, 4))]
    return _last_descriptors[1]


def launch(q_nope, q_rope, kv_cache, block_table, seq_lens, softmax_scale: float, num_splits: int | None, tokens_per_split: int | None) -> torch.Tensor:
    """One launch (parts.launch: its plan, the combine of several splits) over a call `not_served` accepts. (parts.launch
    passes the latent descriptor as the cache and the other two where the other kernels take the cache's strides.)"""
    lat, rope, scale = _descriptors(kv_cache)
    return parts.launch(
        _mla_decode_fp8_keys_m_kernel,
        lat,
        (rope, scale),
        q_nope,
        q_rope,
        block_table,
        seq_lens,
        softmax_scale,
        num_splits,
        tokens_per_split,
        N=MAX_ROWS,
        ROW_WORDS=ROW_WORDS,
        REGS_MATH=PARTITION_REGS[0],
        REGS_LOAD=PARTITION_REGS[1],
    )
