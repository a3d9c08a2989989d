"""Gluon kernel (SM90): `mla_decode` over the FP8 KV cache, warp-specialised as FlashMLA reads an FP8 cache.

Registered for SM90 GPUs whose Triton has Gluon for Hopper, for models with an FP8 cache of these rows (`_chosen`);
the calls it does not serve (`not_served`) go to mla_decode.py's tl kernel, which stays what the interpreter checks
in CI. Verified on the GPU by `deepinfer conformance --backend cuda` (the FP8 mla_decode cases choose it there) and
compiled in CI by `deepinfer bench compile --case gluon` (wgmma, TMA loads, no spills).

Semantics: mla_decode.py's split kernel for an FP8 cache (deepinfer.ops.kv_cache_format: each row 576 e4m3 values
then the token's float32 scale at byte 576), scores in the log2 domain, value = e4m3 * row scale applied to a
key's score and to its softmax weight (s * (q . v) and (p * s) . v), online softmax in float32. With one split it
writes the normalised output; with several it writes exactly the split kernel's partials (part_out [B, splits,
rows, 512] float32, part_lse [B, splits, rows] log2-domain, -inf for a split that saw no key) and mla_decode.py's
combine kernel (or its wide combine) merges them in split order, as there.

Why: the `tl` kernel converts e4m3 -> bf16 in the warps that also run the dots and the softmax, and its FP8 tiles
pass through shared memory twice; it ran the FP8 cache at 0.63-0.72x of the bf16 reader on an H100 although it
reads 51% of the bytes. Here the loads, the conversion and the dots run in different warps.

Schedule: one program per (64-row tile, request, split); grid (row tiles, B, splits) as the `tl` kernel's; a
tile of BLOCK_N = 32 cache rows (half a 64-token page) at a time:
- loader partition (1 warp): per tile, looks up the page in the block table and TMA-copies the tile's e4m3 bytes
  as 9 boxes of [32, 64] (unswizzled: the converting warps read rows of 64 bytes without bank conflicts) and
  the rows' scales as one [32, 4] float32 box (bytes 576..591: the scale and the zero padding) into a KV_STAGES
  ring, each stage with a `kv_ready` mbarrier (expect-tx bytes) and a `kv_empty` one.
- converting partition (4 warps, a warpgroup): per tile, reads the e4m3 stage into registers (16-byte rows
  pieces), converts to bf16 (exact), zeroes the rows past the split's end (stale cache bytes may be NaN
  patterns), stores them into one of two bf16 stages (9 NVMMA-swizzled [32, 64] chunks, 128-byte swizzle: the
  wgmma B operand) with the scales (zero past the end), releases the e4m3 stage, fences the generic-proxy writes
  for the async proxy and signals `bf_ready`.
- the default partition (4 warps, warpgroup 0: softmax and the left half of the output): per tile,
  scores = q . c^T over the 9 chunks (wgmma, q from shared memory, the tile's chunks K-major through permute),
  times row scale * qk_scale, masked (rows past the split, keys after the query position), online softmax in
  float32 (mla_decode.py's softmax_block), p * row scale as bf16; it hands p (shared memory, NVMMA) and the
  rescale factor alpha to warpgroup 1 (`p_ready`), then acc[:, 0:256] = acc * alpha + p . c[:, 0:256]
  (wgmma, p from registers, four [64, 64] accumulators), and releases the bf16 stage (`bf_empty`, 2 arrivals).
- worker partition (4 warps, warpgroup 1): per tile, waits for p, acc[:, 256:512] = acc * alpha + p . c[:, 256:512]
  (wgmma, p from shared memory), releases p (`p_empty`) and the bf16 stage.
- epilogue: warpgroup 0 publishes 1/l and the log-sum-exp (`done`); each warpgroup stores its 256 columns
  (DIRECT: the output in q's dtype; else the split partial and, warpgroup 0, the lse).
q [64, 576] bf16 is loaded into shared memory by warpgroup 0 before the partitions fork (rows past S*H zero).
Shared memory (KV_STAGES 3): q 72 KiB + e4m3 ring 55.5 KiB + two bf16 stages 72 KiB + p 8 KiB + small.

Served (`not_served` says why not, and `launch_mla_decode_fp8_gluon` returns None so callers fall back):
FP8 cache with page 64 and rows of 576 + 16 bytes, C = 512, R = 64, bf16 q, S*H <= 64 (one 64-row tile,
padded: 16 heads use a quarter of each wgmma) or S*H = 128 (two row tiles, the second's cache reads hit L2),
no sliding window, no tuning overrides, no `tiles_of_one_query` (deterministic mode) unless S = 1, cache
pages laid out as one [pages * 64, 592] matrix with 16-byte aligned rows and base. The splits are chosen as
the `tl` kernel's (host shapes only, CUDA-graph safe): pick_splits over one CTA per SM (this kernel's shared
memory allows one), splits of whole 64-token pages; a forced num_splits / tokens_per_split is honoured.

Where its time goes (docs/performance.md has the figures): not in the loads (without them it ran as fast); in the
chain of each 32-row tile: the conversion, then warpgroup 0's scores, softmax and half of the values, while
warpgroup 1 waits for p. At 16 heads the 64-row wgmmas are three quarters padding.

Triton 3.6 (the GPU machine) and 3.9 differ in two names used here: the TMA load (gemm_mxfp4_gluon.py's shim)
and the partition-wide barrier (3.6 `thread_barrier`, 3.9 `barrier`): `_tma_load` and `_sync_warps` below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.ops import kv_cache_format
from deepinfer.triton_common import cdiv, pick_splits
from deepinfer_cuda.kernels.common import Registration, capability, num_sms

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # gemm_mxfp4_gluon.py's shim: Triton 3.9 calls the TMA global->shared copy `async_load`, 3.6 only has
    # async_copy_global_to_shared (same arguments).
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    # A barrier over the calling partition's warps: Triton 3.9 `gl.barrier`, 3.6 `gl.thread_barrier` (both lower to
    # the partition's named barrier inside warp_specialize).
    _sync_warps = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
    GLUON_IMPORT_ERROR = None
except ImportError as exc:  # a Triton without Gluon's Hopper pieces: the launch declines every call
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

LOG2E = 1.4426950408889634
LATENT = 512  # C
ROPE = 64  # R
PAGE = 64
BLOCK_M = 64  # query rows per program: one wgmma M
BLOCK_N = 32  # cache rows per tile
CHUNK = 64  # columns per shared-memory chunk (128 bytes of bf16: the 128-byte swizzle's span)
KV_STAGES = 3  # e4m3 ring stages
SPLIT_GRANULE = 64  # tokens: a split is whole pages
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
PARTITION_REGS = (160, 88, 40)  # setmaxnreg of warpgroup 1, the converting warpgroup, the loader warp
# Four e4m3 codes (one 32-bit register) -> four "raw" bfloat16 (two registers): the value * 2^-112, exactly. The
# e4m3 pairs become halves (cvt.rn.f16x2.e4m3x2, exact: every e4m3 value is a normal half or zero), and a half's
# exponent and top 7 mantissa bits, shifted right by 3, are a bfloat16 of the same sign with the same fields, i.e.
# the value * 2^(15 - 127): integer ops at full rate, where half -> bfloat16 conversions (cvt.bf16.f16, 2 per pair)
# ran at a quarter rate and held the converting warpgroup to ~1.6 us a tile on an H100. No raw value is subnormal
# (the smallest e4m3, 2^-9, becomes 2^-121), so the dots see normal bf16 only; the row scale carries 2^112 back.
RAW_UNIT_VALUE = 5.192296858534828e33  # 2^112
E4M3X4_TO_RAW_BF16X4_PTX = """{
.reg .b16 lo, hi;
.reg .b32 p, q, s;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 p, lo;
cvt.rn.f16x2.e4m3x2 q, hi;
and.b32 s, p, 0x80008000;
shr.b32 p, p, 3;
and.b32 p, p, 0x0FFF0FFF;
or.b32 $0, p, s;
and.b32 s, q, 0x80008000;
shr.b32 q, q, 3;
and.b32 q, q, 0x0FFF0FFF;
or.b32 $1, q, s;
}"""


if GLUON_IMPORT_ERROR is None:
    RAW_UNIT = gl.constexpr(RAW_UNIT_VALUE)
    _E4M3X4_TO_RAW_BF16X4 = gl.constexpr(E4M3X4_TO_RAW_BF16X4_PTX)

    @gluon.jit
    def _loader(kv_desc, sc_desc, fp8_smem, sc_smem, kv_ready, kv_empty, bt_row, lo, num_tiles,
                PAGE: gl.constexpr, BLOCK_N: gl.constexpr, NUM_CHUNKS: gl.constexpr, KV_STAGES: gl.constexpr, SCALE_COL: gl.constexpr):
        """One warp: the tiles' e4m3 boxes and scale box into the ring. A stage's `kv_empty` has completed phase
        p - 1 when the converting warps released its previous use (a fresh barrier: the phase before 0)."""
        for j in range(num_tiles):
            stage = j % KV_STAGES
            mbarrier.wait(kv_empty.index(stage), ((j // KV_STAGES) & 1) ^ 1)
            tok = lo + j * BLOCK_N
            page = gl.load(bt_row + tok // PAGE).to(gl.int32)
            row = page * PAGE + tok % PAGE
            bar = kv_ready.index(stage)
            mbarrier.expect(bar, NUM_CHUNKS * kv_desc.block_type.nbytes + sc_desc.block_type.nbytes)
            for c in gl.static_range(NUM_CHUNKS):
                _tma_load(kv_desc, [row, c * 64], bar, fp8_smem.index(stage * NUM_CHUNKS + c))
            _tma_load(sc_desc, [row, SCALE_COL], bar, sc_smem.index(stage))

    @gluon.jit
    def _converter(fp8_smem, sc_smem, bf_smem, scale_smem, kv_ready, kv_empty, bf_ready, bf_empty, lo, split_end, num_tiles,
                   BLOCK_N: gl.constexpr, NUM_CHUNKS: gl.constexpr, KV_STAGES: gl.constexpr):
        """One warpgroup: e4m3 stage -> bf16 stage (exact), rows past the split's end zeroed, scales copied."""
        # [32, 64] bytes: a thread converts 16 consecutive bytes of a row; a warp reads 8 rows of 64 bytes (512
        # contiguous bytes of the unswizzled box: no bank conflicts)
        tile_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        sc_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [4, 1], [1, 0])
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, tile_layout))
        sc_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, sc_layout))
        sc_cols = gl.arange(0, 4, layout=gl.SliceLayout(0, sc_layout))
        for j in range(num_tiles):
            stage = j % KV_STAGES
            t = j % 2
            mbarrier.wait(kv_ready.index(stage), (j // KV_STAGES) & 1)
            mbarrier.wait(bf_empty.index(t), ((j // 2) & 1) ^ 1)
            tok = lo + j * BLOCK_N
            row_ok = gl.expand_dims(tok + rows < split_end, 1)
            for c in gl.static_range(NUM_CHUNKS):
                codes = fp8_smem.index(stage * NUM_CHUNKS + c).load(tile_layout).to(gl.uint8, bitcast=True)
                codes = gl.where(row_ok, codes, 0)
                x = gl.inline_asm_elementwise(_E4M3X4_TO_RAW_BF16X4, "=r,=r,r", [codes], dtype=gl.bfloat16, is_pure=True, pack=4)
                bf_smem.index(t * NUM_CHUNKS + c).store(x)
            words = sc_smem.index(stage).load(sc_layout)  # [32, 4] float32: the scale, then three zero words
            sc = gl.sum(gl.where(gl.expand_dims(sc_cols == 0, 0), words, 0.0), axis=1)
            sc = gl.where(tok + sc_rows < split_end, sc * RAW_UNIT, 0.0)  # the raw tile's 2^-112 undone here
            scale_smem.index(t).store(sc)
            fence_async_shared()  # the bf16 stage is read by wgmma (the async proxy)
            _sync_warps()  # every warp's reads of the e4m3 stage and writes of the bf16 stage are done
            mbarrier.arrive(kv_empty.index(stage))
            mbarrier.arrive(bf_ready.index(t))

    @gluon.jit
    def _store_half(acc0, acc1, acc2, acc3, inv, dst_ptr, b, split, pid_m, half,
                    stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m,
                    S: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr, DIRECT: gl.constexpr, mma_layout: gl.constexpr):
        """Columns half*256 .. half*256 + 255 of the program's rows: acc * inv, in dst's dtype (DIRECT: dst is the
        output [B, S, H, C]; else the split partials [B, splits, rows, C], float32)."""
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, mma_layout))
        row_ok = gl.expand_dims(offs_m < S * H, 1)
        inv2 = gl.expand_dims(inv, 1)
        b64 = b.to(gl.int64)
        if DIRECT:
            base = dst_ptr + b64 * stride_o_b + (offs_m // H) * stride_o_s + (offs_m % H) * stride_o_h
        else:
            base = dst_ptr + b64 * stride_po_b + split * stride_po_split + offs_m * stride_po_m
        ptrs = gl.expand_dims(base + half * 256, 1) + gl.expand_dims(cols, 0)
        mask = row_ok & gl.expand_dims(cols < 64, 0)
        gl.store(ptrs, (acc0 * inv2).to(dst_ptr.dtype.element_ty), mask=mask)
        gl.store(ptrs + 64, (acc1 * inv2).to(dst_ptr.dtype.element_ty), mask=mask)
        gl.store(ptrs + 128, (acc2 * inv2).to(dst_ptr.dtype.element_ty), mask=mask)
        gl.store(ptrs + 192, (acc3 * inv2).to(dst_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _softmax_warpgroup(q_smem, bf_smem, scale_smem, p_smem, alpha_smem, stat_smem, bf_ready, bf_empty, p_ready, p_empty, done,
                           dst_ptr, part_lse_ptr, b, split, pid_m, seq_len, lo, split_end, num_tiles, qk_scale,
                           stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, stride_pl_b, stride_pl_split,
                           S: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_CHUNKS: gl.constexpr,
                           DIRECT: gl.constexpr):
        """Warpgroup 0: scores, online softmax, p for warpgroup 1, the left 256 output columns."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        pos = gl.expand_dims(seq_len - S + offs_m // H, 1)  # row m's query position: it sees keys j <= pos
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc0 = gl.zeros([BLOCK_M, 64], gl.float32, layout=o_layout)
        acc1 = gl.zeros([BLOCK_M, 64], gl.float32, layout=o_layout)
        acc2 = gl.zeros([BLOCK_M, 64], gl.float32, layout=o_layout)
        acc3 = gl.zeros([BLOCK_M, 64], gl.float32, layout=o_layout)
        for j in range(num_tiles):
            t = j % 2
            phase = (j // 2) & 1
            mbarrier.wait(bf_ready.index(t), phase)
            s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
            for c in gl.static_range(NUM_CHUNKS):
                s = warpgroup_mma(q_smem.index(c), bf_smem.index(t * NUM_CHUNKS + c).permute((1, 0)), s, use_acc=c > 0, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            sc = scale_smem.index(t).load(gl.SliceLayout(0, s_layout))
            tok = gl.expand_dims(lo + j * BLOCK_N + cols, 0)
            scores = s * gl.expand_dims(sc * qk_scale, 0)
            scores = gl.where((tok < split_end) & (tok <= pos), scores, float("-inf"))
            # mla_decode.py's softmax_block (base 2): a row that has seen only -inf keeps m = -inf and weights 0
            m_new = gl.maximum(m_i, gl.max(scores, axis=1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(scores - gl.expand_dims(m_safe, 1))
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            pv = (p * gl.expand_dims(sc, 0)).to(gl.bfloat16)  # the weight times the key's scale: (p * s) . v
            # hand p and alpha to warpgroup 1 (its previous use of this slot, tile j - 2, released it)
            mbarrier.wait(p_empty.index(t), phase ^ 1)
            p_smem.index(t).store(pv)
            alpha_smem.index(t).store(alpha)
            fence_async_shared()
            _sync_warps()
            mbarrier.arrive(p_ready.index(t))
            # the left half: acc = acc * alpha + p . c[:, 0:256]
            a2 = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p_op = gl.convert_layout(pv, p_layout)
            acc0 = warpgroup_mma(p_op, bf_smem.index(t * NUM_CHUNKS + 0), acc0 * a2, is_async=True)
            acc1 = warpgroup_mma(p_op, bf_smem.index(t * NUM_CHUNKS + 1), acc1 * a2, is_async=True)
            acc2 = warpgroup_mma(p_op, bf_smem.index(t * NUM_CHUNKS + 2), acc2 * a2, is_async=True)
            acc3 = warpgroup_mma(p_op, bf_smem.index(t * NUM_CHUNKS + 3), acc3 * a2, is_async=True)
            acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2, acc3))
            _sync_warps()
            mbarrier.arrive(bf_empty.index(t))
        # mla_decode.py's split_partial: 1/l (1 for a row that saw no key: its acc is 0) and lse (-inf there)
        has = l_i > 0.0
        l_safe = gl.where(has, l_i, 1.0)
        inv = 1.0 / l_safe
        lse = gl.where(has, m_i + gl.log2(l_safe), float("-inf"))
        stat_smem.store(inv)
        _sync_warps()
        mbarrier.arrive(done)
        if not DIRECT:
            gl.store(part_lse_ptr + b.to(gl.int64) * stride_pl_b + split * stride_pl_split + offs_m, lse, mask=offs_m < S * H)
        _store_half(acc0, acc1, acc2, acc3, gl.convert_layout(inv, gl.SliceLayout(1, o_layout)), dst_ptr, b, split, pid_m, 0,
                    stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, S, H, BLOCK_M, DIRECT, o_layout)

    @gluon.jit
    def _value_warpgroup(bf_smem, p_smem, alpha_smem, stat_smem, p_ready, p_empty, bf_empty, done,
                         dst_ptr, b, split, pid_m, num_tiles,
                         stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m,
                         S: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr, NUM_CHUNKS: gl.constexpr, DIRECT: gl.constexpr):
        """Warpgroup 1: the right 256 output columns, acc = acc * alpha + p . c[:, 256:512], p from shared memory."""
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        acc0 = gl.zeros([BLOCK_M, 64], gl.float32, layout=o_layout)
        acc1 = gl.zeros([BLOCK_M, 64], gl.float32, layout=o_layout)
        acc2 = gl.zeros([BLOCK_M, 64], gl.float32, layout=o_layout)
        acc3 = gl.zeros([BLOCK_M, 64], gl.float32, layout=o_layout)
        for j in range(num_tiles):
            t = j % 2
            mbarrier.wait(p_ready.index(t), (j // 2) & 1)
            a2 = gl.expand_dims(alpha_smem.index(t).load(gl.SliceLayout(1, o_layout)), 1)
            p = p_smem.index(t)
            acc0 = warpgroup_mma(p, bf_smem.index(t * NUM_CHUNKS + 4), acc0 * a2, is_async=True)
            acc1 = warpgroup_mma(p, bf_smem.index(t * NUM_CHUNKS + 5), acc1 * a2, is_async=True)
            acc2 = warpgroup_mma(p, bf_smem.index(t * NUM_CHUNKS + 6), acc2 * a2, is_async=True)
            acc3 = warpgroup_mma(p, bf_smem.index(t * NUM_CHUNKS + 7), acc3 * a2, is_async=True)
            acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2, acc3))
            _sync_warps()
            mbarrier.arrive(p_empty.index(t))
            mbarrier.arrive(bf_empty.index(t))
        mbarrier.wait(done, 0)
        inv = stat_smem.load(gl.SliceLayout(1, o_layout))
        _store_half(acc0, acc1, acc2, acc3, inv, dst_ptr, b, split, pid_m, 1,
                    stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, S, H, BLOCK_M, DIRECT, o_layout)

    @gluon.jit(do_not_specialize=["tokens_per_split"])
    def _mla_decode_fp8_ws_kernel(
        kv_desc, sc_desc, q_nope_ptr, q_rope_ptr, block_table_ptr, seq_lens_ptr,
        dst_ptr,  # DIRECT: the output [B, S, H, C]; else the split partials [B, splits, rows, C] float32
        part_lse_ptr,
        qk_scale,  # softmax_scale * log2(e)
        tokens_per_split,  # a multiple of BLOCK_N
        stride_qn_b, stride_qn_s, stride_qn_h,
        stride_qr_b, stride_qr_s, stride_qr_h,
        stride_bt_b,
        stride_o_b, stride_o_s, stride_o_h,
        stride_po_b, stride_po_split, stride_po_m,
        stride_pl_b, stride_pl_split,
        S: gl.constexpr, H: gl.constexpr,
        C: gl.constexpr, R: gl.constexpr,
        PAGE: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        KV_STAGES: gl.constexpr,
        DIRECT: gl.constexpr,
        REGS_VALUE: gl.constexpr, REGS_CONVERT: gl.constexpr, REGS_LOAD: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        NUM_CHUNKS: gl.constexpr = (C + R) // 64
        pid_m = gl.program_id(0)
        b = gl.program_id(1)
        split = gl.program_id(2)
        seq_len = gl.load(seq_lens_ptr + b).to(gl.int32)
        lo = split * tokens_per_split
        split_end = gl.minimum(lo + tokens_per_split, seq_len)
        num_tiles = gl.maximum(split_end - lo + BLOCK_N - 1, 0) // BLOCK_N
        bt_row = block_table_ptr + b.to(gl.int64) * stride_bt_b

        chunk_bf16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16)
        q_layout_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 64], gl.bfloat16)
        p_layout_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)
        vec_s: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_CHUNKS, BLOCK_M, 64], q_layout_s)
        fp8_smem = gl.allocate_shared_memory(kv_desc.dtype, [KV_STAGES * NUM_CHUNKS] + kv_desc.block_type.shape, kv_desc.layout)
        sc_smem = gl.allocate_shared_memory(sc_desc.dtype, [KV_STAGES] + sc_desc.block_type.shape, sc_desc.layout)
        bf_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * NUM_CHUNKS, BLOCK_N, 64], chunk_bf16)
        scale_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N], vec_s)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, BLOCK_N], p_layout_s)
        alpha_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], vec_s)
        stat_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec_s)
        kv_ready = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
        bf_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        bf_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(KV_STAGES):
            mbarrier.init(kv_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(bf_ready.index(i), count=1)
            mbarrier.init(bf_empty.index(i), count=2)  # warpgroups 0 and 1
            mbarrier.init(p_ready.index(i), count=1)
            mbarrier.init(p_empty.index(i), count=1)
        mbarrier.init(done, count=1)

        # q [64 rows, 576] -> 9 swizzled [64, 64] chunks (rows past S*H zero), by the default warps before the fork
        q_blocked: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_blocked))
        offs_c = gl.arange(0, 64, layout=gl.SliceLayout(0, q_blocked))
        m_ok = gl.expand_dims(offs_m < S * H, 1)
        b64 = b.to(gl.int64)
        qn_rows = gl.expand_dims(q_nope_ptr + b64 * stride_qn_b + (offs_m // H) * stride_qn_s + (offs_m % H) * stride_qn_h, 1)
        for c in gl.static_range(C // 64):
            q_smem.index(c).store(gl.load(qn_rows + c * 64 + gl.expand_dims(offs_c, 0), mask=m_ok, other=0.0).to(gl.bfloat16))
        qr_rows = gl.expand_dims(q_rope_ptr + b64 * stride_qr_b + (offs_m // H) * stride_qr_s + (offs_m % H) * stride_qr_h, 1)
        for c in gl.static_range(R // 64):
            q_smem.index(C // 64 + c).store(gl.load(qr_rows + c * 64 + gl.expand_dims(offs_c, 0), mask=m_ok, other=0.0).to(gl.bfloat16))
        fence_async_shared()

        gl.warp_specialize(
            [
                (_softmax_warpgroup, (q_smem, bf_smem, scale_smem, p_smem, alpha_smem, stat_smem, bf_ready, bf_empty, p_ready, p_empty, done,
                                      dst_ptr, part_lse_ptr, b, split, pid_m, seq_len, lo, split_end, num_tiles, qk_scale,
                                      stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, stride_pl_b, stride_pl_split,
                                      S, H, BLOCK_M, BLOCK_N, NUM_CHUNKS, DIRECT)),
                (_value_warpgroup, (bf_smem, p_smem, alpha_smem, stat_smem, p_ready, p_empty, bf_empty, done,
                                    dst_ptr, b, split, pid_m, num_tiles,
                                    stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m,
                                    S, H, BLOCK_M, NUM_CHUNKS, DIRECT)),
                (_converter, (fp8_smem, sc_smem, bf_smem, scale_smem, kv_ready, kv_empty, bf_ready, bf_empty, lo, split_end, num_tiles,
                              BLOCK_N, NUM_CHUNKS, KV_STAGES)),
                (_loader, (kv_desc, sc_desc, fp8_smem, sc_smem, kv_ready, kv_empty, bt_row, lo, num_tiles,
                           PAGE, BLOCK_N, NUM_CHUNKS, KV_STAGES, (C + R) // 4)),
            ],
            [4, 4, 1],
            [REGS_VALUE, REGS_CONVERT, REGS_LOAD],
        )


# ---------------------------------------------------------------------------------------------
# Host side: which calls the kernel serves, its plan, its descriptors and launch


@dataclass(frozen=True)
class Fp8GluonPlan:
    """One launch of `_mla_decode_fp8_ws_kernel` (host shapes only)."""

    rows: int  # S * H
    row_tiles: int
    tokens_per_split: int
    num_splits: int

    @property
    def direct(self) -> bool:
        return self.num_splits == 1


def not_served(q_nope, q_rope, kv_cache, sliding_window, overrides=None, tiles_of_one_query=False) -> str | None:
    """Why this kernel does not serve a call (None: it does). Shapes, dtypes, strides and alignment only."""
    if GLUON_IMPORT_ERROR is not None:
        return f"no Gluon for Hopper in this Triton ({GLUON_IMPORT_ERROR})"
    if q_nope.device.type not in ("cuda", "meta"):  # ("meta" tensors pass: the compile check)
        return f"not on a GPU ({q_nope.device.type}: the interpreter runs the tl kernel)"
    if q_nope.device.type == "cuda" and capability(q_nope.device)[0] != 9:
        return f"not an SM90 GPU (capability {capability(q_nope.device)})"
    if not kv_cache_format.is_fp8(kv_cache):
        return "the cache is not FP8"
    if q_nope.dtype != torch.bfloat16 or q_rope.dtype != torch.bfloat16:
        return f"q is {q_nope.dtype}/{q_rope.dtype}, not bfloat16"
    if sliding_window is not None:
        return "sliding window"
    if overrides:
        return "tuning overrides (the tl kernel's)"
    _, s, h, c = q_nope.shape
    if tiles_of_one_query and s != 1:
        return "tiles_of_one_query with S > 1 (deterministic mode keeps the tl kernel)"
    if c != LATENT or q_rope.shape[-1] != ROPE:
        return f"C={c}, R={q_rope.shape[-1]}: wants {LATENT} + {ROPE}"
    rows = s * h
    if not (1 <= rows <= BLOCK_M or rows == 2 * BLOCK_M):
        return f"S*H = {rows}: wants <= {BLOCK_M} or {2 * BLOCK_M}"
    if kv_cache.dim() != 3 or kv_cache.shape[1] != PAGE or kv_cache.shape[2] != LATENT + ROPE + kv_cache_format.ROW_TAIL:
        return f"cache {tuple(kv_cache.shape)}: wants [pages, {PAGE}, {LATENT + ROPE + kv_cache_format.ROW_TAIL}]"
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) % 16 or kv_cache.stride(0) != PAGE * kv_cache.stride(1):
        return "cache pages are not one matrix of 16-byte aligned rows"
    if kv_cache.data_ptr() % 16:
        return "cache base is not 16-byte aligned"
    if q_nope.stride(-1) != 1 or q_rope.stride(-1) != 1:
        return "q rows are not contiguous"
    return None


def plan(batch: int, rows: int, capacity: int, device: torch.device, num_splits: int | None = None, tokens_per_split: int | None = None) -> Fp8GluonPlan:
    """Row tiles and splits from host-known shapes (mla_decode.plan's rule: pick_splits over the SMs, at most
    MAX_SPLITS and capacity / MIN_TOKENS_PER_SPLIT, splits of whole pages); one CTA per SM (shared memory)."""
    row_tiles = cdiv(rows, BLOCK_M)
    granules = max(1, cdiv(capacity, SPLIT_GRANULE))
    if tokens_per_split is not None:
        per_split = max(1, cdiv(tokens_per_split, SPLIT_GRANULE))
    else:
        if num_splits is None:
            limit = min(MAX_SPLITS, granules, max(1, capacity // MIN_TOKENS_PER_SPLIT))
            num_splits = pick_splits(batch * row_tiles, num_sms(device), limit)
        num_splits = max(1, min(num_splits, granules))
        per_split = cdiv(granules, num_splits)
    return Fp8GluonPlan(rows=rows, row_tiles=row_tiles, tokens_per_split=per_split * SPLIT_GRANULE, num_splits=cdiv(granules, per_split))


def descriptors(kv_cache: torch.Tensor):
    """TMA descriptors over the cache's rows: the e4m3 values as [pages * 64, 592] bytes in [BLOCK_N, 64] boxes
    (unswizzled), and the same memory as [pages * 64, 148] float32 in [BLOCK_N, 4] boxes (the scale word and the
    padding, at word 144)."""
    rows = kv_cache.shape[0] * PAGE
    row_bytes = kv_cache.stride(1)
    width = kv_cache.shape[2]
    kv2 = kv_cache.view(torch.uint8).as_strided((rows, width), (row_bytes, 1)).view(kv_cache.dtype)
    sc2 = kv_cache.view(torch.uint8).as_strided((rows, width), (row_bytes, 1)).view(torch.float32)
    kv_box, sc_box = [BLOCK_N, CHUNK], [BLOCK_N, 4]
    return (
        TensorDescriptor(kv2, list(kv2.shape), list(kv2.stride()), kv_box, gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)),
        TensorDescriptor(sc2, list(sc2.shape), list(sc2.stride()), sc_box, gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)),
    )


def launch_mla_decode_fp8_gluon(
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
) -> torch.Tensor | None:
    """mla_decode.launch_mla_decode's signature; None for a call this kernel does not serve (`not_served`: the
    caller falls back to it). Several splits: the partials are merged by mla_decode.py's combine kernel (the wide
    one for few (row tile, request) groups and many splits, as its plan does); separate_combine changes nothing
    here (this kernel never merges in its split programs)."""
    from deepinfer.ops import attention as attention_ops
    from deepinfer_cuda.kernels import mla_decode as tl_mla

    del separate_combine
    attention_ops.check_mla_decode_shapes(q_nope, q_rope, kv_cache, sliding_window)
    if not_served(q_nope, q_rope, kv_cache, sliding_window, overrides, tiles_of_one_query) is not None:
        return None
    batch, num_queries, heads, latent_dim = q_nope.shape
    out = torch.empty(batch, num_queries, heads, latent_dim, dtype=q_nope.dtype, device=q_nope.device)
    if batch == 0 or num_queries == 0 or heads == 0:
        return out
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    p = plan(batch, num_queries * heads, block_table.shape[1] * PAGE, q_nope.device, num_splits, tokens_per_split)
    if p.direct:
        part_out, part_lse = out, out  # unused
        po_strides, pl_strides = (0, 0, 0), (0, 0)
    else:
        part_out = torch.empty(batch, p.num_splits, p.rows, latent_dim, dtype=torch.float32, device=q_nope.device)
        part_lse = torch.empty(batch, p.num_splits, p.rows, dtype=torch.float32, device=q_nope.device)
        po_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2))
        pl_strides = (part_lse.stride(0), part_lse.stride(1))
    kv_desc, sc_desc = descriptors(kv_cache)
    _mla_decode_fp8_ws_kernel[(p.row_tiles, batch, p.num_splits)](
        kv_desc, sc_desc, q_nope, q_rope, block_table, seq_lens,
        out if p.direct else part_out, part_lse,
        float(softmax_scale) * LOG2E,
        p.tokens_per_split,
        q_nope.stride(0), q_nope.stride(1), q_nope.stride(2),
        q_rope.stride(0), q_rope.stride(1), q_rope.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        *po_strides,
        *pl_strides,
        S=num_queries, H=heads, C=LATENT, R=ROPE, PAGE=PAGE, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, KV_STAGES=KV_STAGES, DIRECT=p.direct,
        REGS_VALUE=PARTITION_REGS[0], REGS_CONVERT=PARTITION_REGS[1], REGS_LOAD=PARTITION_REGS[2],
        num_warps=4,
    )
    if p.direct:
        return out
    tl_cfg = tl_mla._config(q_nope.device, tl_mla._variant(p.rows))  # the tl kernel's merge choice for these rows
    tl_mla.merge_splits(part_out, part_lse, out, p.num_splits, tl_mla.merges_wide(tl_cfg, p.num_splits, p.row_tiles * batch, q_nope.device))
    return out


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
    """The op on this kernel where it serves the call (`not_served`), else on mla_decode.py's tl kernel."""
    from deepinfer_cuda.kernels import mla_decode as tl_mla

    out = launch_mla_decode_fp8_gluon(q_nope, q_rope, kv_cache, block_table, seq_lens, softmax_scale, sliding_window)
    return out if out is not None else tl_mla.launch_mla_decode(q_nope, q_rope, kv_cache, block_table, seq_lens, softmax_scale, sliding_window)


def _chosen(ctx) -> bool:
    """An SM90 GPU whose Triton has Gluon for Hopper, serving a model with an FP8 cache of this kernel's rows (C 512,
    R 64, pages of 64, no sliding window); facts not known keep the tl kernel."""
    from deepinfer_cuda.kernels.gemm_mxfp4_gluon import is_sm90

    m = ctx.model
    return (GLUON_IMPORT_ERROR is None and is_sm90(ctx.device) and m.kv_cache_fp8 is True and m.kv_lora_rank == LATENT
            and m.qk_rope_head_dim == ROPE and m.sliding_window == 0 and m.kv_block_size == PAGE)  # fmt: skip


REGISTRATIONS = [
    Registration(
        op="mla_decode",
        fn=mla_decode,
        dtypes=(torch.bfloat16,),
        when=_chosen,
        priority=1,
        note="Gluon (SM90, FP8 cache): warp-specialised, a TMA loader warp, a converting warpgroup filling bf16 stages, two wgmma "
        "warpgroups; the tl kernel for the calls it does not serve",
    ),
]
