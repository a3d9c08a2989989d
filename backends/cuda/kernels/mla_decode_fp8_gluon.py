"""Gluon kernel (SM90): `mla_decode` over the FP8 KV cache, warp-specialised, both wgmma warpgroups scoring keys.

Registered for SM90 GPUs whose Triton has Gluon for Hopper, for models with an FP8 cache of these rows (`_chosen`);
the calls it does not serve (`not_served`) go to mla_decode.py's tl kernel, which stays what the interpreter checks
in CI. Compiled in CI by `deepinfer bench compile --case gluon` (wgmma, no spills; no TMA: the converting warps load
the cache bytes). Checked on an H100 (Triton 3.6, 2026-12-06) against the tl kernel on the 6 shapes of
tests/cuda/test_mla_decode_fp8_gluon.py's GPU cases (planned, 1, 8 and 3 splits, S = 2 and 4, 128 heads, ragged
lengths): max |difference| 2.4e-4 .. 9.8e-4 at outputs below 1.8 (the previous schedule's: 2e-3 .. 4e-3), from a
scratch script; on an H100 on 2026-12-07 that test file's GPU cases passed and `deepinfer conformance --backend cuda
--op mla_decode` (its FP8 cases choose this kernel) passed with this schedule.

Semantics: mla_decode.py's split kernel for an FP8 cache (deepinfer.ops.kv_cache_format: each row 576 e4m3 values
then the token's float32 scale at byte 576, 592 bytes a row, pages of 64 rows), scores in the log2 domain, value =
e4m3 * row scale applied to a key's score and to its softmax weight (s * (q . v) and (p * s) . v), online softmax
in float32. With one split it writes the normalised output; with several it writes exactly the split kernel's
partials (part_out [B, splits, rows, 512] float32, part_lse [B, splits, rows] log2-domain, -inf for a split that
saw no key) and mla_decode.py's combine kernel (or its wide combine) merges them in split order, as there.

Why: the `tl` kernel converts e4m3 -> bf16 in the warps that also run the dots and the softmax, and its FP8 tiles
pass through shared memory twice; it ran the FP8 cache at 0.63-0.72x of the bf16 reader on an H100 although it
reads 51% of the bytes. Here the conversion and the dots run in different warps. A first schedule (a TMA loader
warp, 32-row tiles, warpgroup 0 alone running every QK^T wgmma, the softmax and half of the PV while warpgroup 1
waited for p) spent its time in each tile's serial chain; this one splits a tile's work between the two math
warpgroups as FlashMLA's SM90 decode kernel does (each scores half the keys, they agree on the rescale through
shared memory, each owns half of the output columns over all keys), with one softmax bubble per 64 rows.

Schedule: one program per (64-row tile, request, split), grid (row tiles, B, splits) as the `tl` kernel's; tiles of
BLOCK_N = 64 cache rows (one page); three partitions, 12 warps:
- converting warpgroup (a worker, 4 warps): loads the tile's e4m3 rows from global memory itself as 32-bit words
  (16-byte vector loads: a thread holds 16 bytes of two rows per 64-byte column chunk; no TMA ring: an e4m3 ring
  does not fit beside two bf16 stages), converts them to "raw" bf16 (E4M3X4_TO_RAW_BF16X4_PTX: value * 2^-112,
  exact; the row scale carries 2^112 back), and stores them into one of two bf16 stages (9 NVMMA-swizzled [64, 64]
  chunks, written through an int32 view of the same memory: 16-byte st.shared, a warp's covering whole 128-byte
  swizzle rows, no bank conflicts) with the rows' scales (-1 past the split's end: the mark the attention
  warpgroups mask by; those rows load as zeros). Tile j + 1's words are loaded while tile j is converted, chunk by
  chunk into the registers each converted chunk frees (a tile in flight: 72 registers a thread), the block-table
  entry two tiles ahead.
- two attention warpgroups (the default partition is warpgroup 0, a worker warpgroup 1; the same code, W = 0 / 1).
  Per tile j, warpgroup W:
  1. has the scores of ITS 32 keys (rows W*32 .. W*32+31 of the tile): s = q . c^T, 9 wgmma groups m64n32 (q from
     shared memory), issued in the previous iteration; times row scale * qk_scale, masked (scale -1: past the
     split; with S > 1 also after the row's query position);
  2. writes its row maxima to shared memory (slot j % 2), arrives on an mbarrier both warpgroups arrive on, reads
     the other half's: both compute the same m_new and alpha (same operands in the same order: the same bits);
  3. p = exp2(s - m_new) for its keys, its own row sum l_W (the two are added at the end);
  4. waits until the other warpgroup has finished reading its previous p (`p_free`), writes p * row scale (bf16,
     [64, 32]) to shared memory, signals `p_ready`;
  5. acc = acc * alpha + p . c for ITS 256 output columns over the WHOLE tile: p_W (registers) . c[own keys] then,
     once the other's p is there, p_other (shared memory) . c[other keys]; four [64, 64] float32 accumulators;
  6. issues tile j + 1's QK^T wgmmas behind those, waits for the PV (all groups but the 9 just issued), releases
     the stage (`bf_empty`, both warpgroups) and the other's p (`p_free`), then waits for the scores.
  No wgmma is in flight across the loop's back edge (ptxas serialises every wgmma when it is: FlashMLA's note).
  The epilogue adds the row sums (the maxima's slots and mbarrier), each warpgroup stores its 256 columns (DIRECT:
  the output in q's dtype; else the split partial and, warpgroup 0, the lse).
q [64, 576] bf16 is loaded into shared memory by warpgroup 0 before the partitions fork (rows past S*H zero).
Shared memory (226 KiB of the 227 KiB an SM90 block may have; one CTA per SM): q 72 KiB + two bf16 stages 144 KiB +
p 8 KiB (two [64, 32] halves) + scales 0.5 KiB + maxima / row sums 1 KiB + 9 mbarriers.
Registers (setmaxnreg; 12 warps leave 168 a thread at launch, 504 per thread of each warpgroup triple): attention
warpgroup 0 192, warpgroup 1 200 (the same code spilled at 192 in the worker, not in the default partition), the
converting warpgroup 112; four [64, 64] float32 accumulators are 128 of the attention warpgroups'. Without spills
only because: the q descriptors are indexed through a zero the compilers cannot see (`_hidden_zero`: else LLVM
hoisted all 36 out of the loop), the program ids are read again after the loop, the key mask is the converter's
scale mark (no column indices live), and the converter keeps one page pointer and 32-bit row offsets. With S > 1
(the causal mask needs the column indices and each row's limit) it compiles with 24 bytes of spills (12 stored, 12
loaded; sm90, Triton 3.9: S 2 and 4 at 16 heads, S 2 at 32 and 64), no wgmma serialisation warning from ptxas; the
compile check's cases are S = 1.

Served (`not_served` says why not, and `launch_mla_decode_fp8_gluon` returns None so callers fall back):
FP8 cache with page 64 and rows of 576 + 16 bytes, C = 512, R = 64, bf16 q, S*H <= 64 (one 64-row tile,
padded: 16 heads use a quarter of each wgmma) or S*H = 128 (two row tiles, the second's cache reads hit L2),
no sliding window, no tuning overrides, no `tiles_of_one_query` (deterministic mode) unless S = 1, cache
pages laid out as one [pages * 64, 592] matrix with 16-byte aligned rows and base (the 16-byte loads). The splits
are chosen as the `tl` kernel's (host shapes only, CUDA-graph safe): pick_splits over one CTA per SM (this
kernel's shared memory allows one), splits of whole 64-token pages; a forced num_splits / tokens_per_split is
honoured.

Speed (one H100, 2026-12-06, CUDA graphs, median of 50 replays, ctx 4096; docs/performance.md has the table, the
raw output docs/measurements/2026-12-06/round8/h100_call3/mla_v2.txt): 16 heads B64 / B128 / B256 129.9 / 239.2 /
472.5 us, 0.92-0.94x the bf16 tl reader (120.7 / 225.8 / 432.9 us), 1.40-1.43x the tl FP8 reader, 1.16-1.18x the
first schedule; 128 heads 229.7 / 445.3 / 873.7 us, 1.37-1.39x bf16 (315.0 / 617.0 / 1195.9 us), 1.93-1.98x tl FP8,
1.27x the first schedule. Not known: what bounds the 16-head case (three quarters of each M = 64 wgmma is padding
there; the QK^T wgmmas, N = 32, q re-read from shared memory by each warpgroup, read shared memory at ~1.5x the rate
the tensor cores consume it: about 400 KB a 64-row tile, ~1.7 us at 128 B/clk).

Triton 3.6 (the GPU machine) and 3.9 differ in two names used here: the partition-wide barrier (3.6
`thread_barrier`, 3.9 `barrier`: `_sync_warps`, gluon_hopper.py's shim) and the shared-memory reinterpretation (3.6 `_reinterpret`, 3.9
`reinterpret`: `_REINTERPRET_IS_PUBLIC`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.ops import kv_cache_format
from deepinfer.triton_common import cdiv, pick_splits
from deepinfer_cuda.kernels.common import Registration, capability, num_sms
from deepinfer_cuda.kernels.gluon_hopper import GLUON_IMPORT_ERROR

if GLUON_IMPORT_ERROR is None:  # (else the launch declines every call)
    from deepinfer_cuda.kernels.gluon_hopper import fence_async_shared, gl, gluon, mbarrier, warpgroup_mma, warpgroup_mma_wait
    from deepinfer_cuda.kernels.gluon_hopper import sync_warps as _sync_warps

LOG2E = 1.4426950408889634
LATENT = 512  # C
ROPE = 64  # R
PAGE = 64
BLOCK_M = 64  # query rows per program: one wgmma M
BLOCK_N = 64  # cache rows per tile (one page); each attention warpgroup scores half of them
SPLIT_GRANULE = 64  # tokens: a split is whole pages (and whole tiles)
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
PARTITION_REGS = (200, 112)  # setmaxnreg of attention warpgroup 1 and of the converting warpgroup (warpgroup 0: the rest, 192)
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
    # A shared-memory view of another dtype: Triton 3.9 `reinterpret`, 3.6 `_reinterpret` (same arguments)
    _REINTERPRET_IS_PUBLIC = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

    @gluon.jit
    def _put_chunk(words, dst):
        """[64, 16] words of e4m3 codes -> raw bf16 (value * 2^-112, exact) as [64, 32] bf16 pairs -> one swizzled
        chunk (its int32 view). E4M3X4_TO_RAW_BF16X4_PTX, one word at a time: its two outputs are the pairs of bytes 0-1 and 2-3."""
        lo, hi = gl.inline_asm_elementwise(_E4M3X4_TO_RAW_BF16X4, "=r,=r,r", [words], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        dst.store(gl.reshape(gl.join(lo, hi), [words.shape[0], 2 * words.shape[1]]))

    @gluon.jit
    def _tile_rows(kv_words, page, tok, split_end, row_words, cols, sc_words, stride_kv_page, stride_kv_row, SCALE_BYTE: gl.constexpr):
        """A tile's addresses: word pointers of its rows' first chunk [64, 16] with the rows' mask (< split_end), and
        of its rows' scales [64] with theirs. The page's base is one (uniform) pointer, the rows' word offsets in it
        are the same for every tile and the masks compare them (row r < n <=> r * stride < n * stride): no other
        per-row value is live. (Byte offsets are multiples of 16: `not_served`.)"""
        tile = kv_words + gl.multiple_of((page.to(gl.int64) * stride_kv_page) >> 2, 4)
        ptrs = tile + gl.expand_dims(row_words, 1) + cols
        ok = gl.expand_dims(row_words < ((split_end - tok) * stride_kv_row) >> 2, 1)
        return ptrs, ok, tile + sc_words, sc_words < ((split_end - tok) * stride_kv_row + SCALE_BYTE) >> 2

    @gluon.jit
    def _converter(kv_words, bt_row, bf_words, scale_smem, bf_ready, bf_empty, lo, split_end, num_tiles, stride_kv_page, stride_kv_row,
                   PAGE: gl.constexpr, BLOCK_N: gl.constexpr, NUM_CHUNKS: gl.constexpr, SCALE_BYTE: gl.constexpr):
        """One warpgroup: tile j's e4m3 rows (loaded while tile j - 1 was converted) -> bf16 stage j % 2, chunk by
        chunk, each chunk's load of tile j + 1 issued once it is converted (into the registers it frees). The
        tiles are carried as 32-bit words (9 chunks x 8 registers a thread), never as bytes (a register each)."""
        # [64, 16] words (64 bytes of 64 rows): a thread holds 16 consecutive bytes of two rows (r and r + 32): 16-byte
        # global loads; converted, 32 bytes of bf16 a row: two 16-byte shared stores; a warp's cover 8 rows x 128
        # bytes, one swizzle atom (no bank conflicts)
        words_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
        sc_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # 64 scales: two threads hold each
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, words_layout))
        cols = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, words_layout)), 0)
        row_words = gl.multiple_of((rows * stride_kv_row) >> 2, 4)
        sc_words = (gl.arange(0, BLOCK_N, layout=sc_layout) * stride_kv_row + SCALE_BYTE) >> 2
        first = lo // PAGE
        # tile 0's words and scales
        page = gl.load(bt_row + first, mask=num_tiles > 0, other=0).to(gl.int32)
        ptrs, ok, sc_ptrs, sc_ok = _tile_rows(kv_words, page, lo, split_end, row_words, cols, sc_words, stride_kv_page, stride_kv_row, SCALE_BYTE)
        x0 = gl.load(ptrs, mask=ok, other=0)
        x1 = gl.load(ptrs + 16, mask=ok, other=0)
        x2 = gl.load(ptrs + 32, mask=ok, other=0)
        x3 = gl.load(ptrs + 48, mask=ok, other=0)
        x4 = gl.load(ptrs + 64, mask=ok, other=0)
        x5 = gl.load(ptrs + 80, mask=ok, other=0)
        x6 = gl.load(ptrs + 96, mask=ok, other=0)
        x7 = gl.load(ptrs + 112, mask=ok, other=0)
        x8 = gl.load(ptrs + 128, mask=ok, other=0)
        xs = gl.load(sc_ptrs, mask=sc_ok, other=0)
        page = gl.load(bt_row + first + 1, mask=num_tiles > 1, other=0).to(gl.int32)
        for j in range(num_tiles):
            t = j % 2
            page_after = gl.load(bt_row + first + j + 2, mask=j + 2 < num_tiles, other=0).to(gl.int32)
            # tile j + 1's addresses (every row masked off past the last tile)
            ptrs, ok, sc_ptrs, sc_ok = _tile_rows(kv_words, page, lo + (j + 1) * BLOCK_N, split_end, row_words, cols, sc_words,
                                                  stride_kv_page, stride_kv_row, SCALE_BYTE)
            mbarrier.wait(bf_empty.index(t), ((j // 2) & 1) ^ 1)  # both warpgroups are done with tile j - 2
            _put_chunk(x0, bf_words.index(t * NUM_CHUNKS + 0))
            y0 = gl.load(ptrs, mask=ok, other=0)
            _put_chunk(x1, bf_words.index(t * NUM_CHUNKS + 1))
            y1 = gl.load(ptrs + 16, mask=ok, other=0)
            _put_chunk(x2, bf_words.index(t * NUM_CHUNKS + 2))
            y2 = gl.load(ptrs + 32, mask=ok, other=0)
            _put_chunk(x3, bf_words.index(t * NUM_CHUNKS + 3))
            y3 = gl.load(ptrs + 48, mask=ok, other=0)
            _put_chunk(x4, bf_words.index(t * NUM_CHUNKS + 4))
            y4 = gl.load(ptrs + 64, mask=ok, other=0)
            _put_chunk(x5, bf_words.index(t * NUM_CHUNKS + 5))
            y5 = gl.load(ptrs + 80, mask=ok, other=0)
            _put_chunk(x6, bf_words.index(t * NUM_CHUNKS + 6))
            y6 = gl.load(ptrs + 96, mask=ok, other=0)
            _put_chunk(x7, bf_words.index(t * NUM_CHUNKS + 7))
            y7 = gl.load(ptrs + 112, mask=ok, other=0)
            _put_chunk(x8, bf_words.index(t * NUM_CHUNKS + 8))
            y8 = gl.load(ptrs + 128, mask=ok, other=0)
            ys = gl.load(sc_ptrs, mask=sc_ok, other=0)
            # the scale words as float32, the raw tile's 2^-112 undone here; -1 past the split's end (a real scale is
            # >= 0: the attention warpgroups mask the keys by it)
            sc_live = sc_words < ((split_end - lo - j * BLOCK_N) * stride_kv_row + SCALE_BYTE) >> 2
            scale_smem.index(t).store(gl.where(sc_live, xs.to(gl.float32, bitcast=True) * RAW_UNIT, -1.0))
            fence_async_shared()  # the bf16 stage is read by wgmma (the async proxy)
            _sync_warps()  # every warp's stores are done
            mbarrier.arrive(bf_ready.index(t))
            x0, x1, x2, x3, x4, x5, x6, x7, x8, xs = y0, y1, y2, y3, y4, y5, y6, y7, y8, ys
            page = page_after

    @gluon.jit
    def _store_half(acc0, acc1, acc2, acc3, inv, dst_ptr, b, split, pid_m, half,
                    stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m,
                    S: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr, DIRECT: gl.constexpr, mma_layout: gl.constexpr):
        """Columns half*256 .. half*256 + 255 of the program's rows: acc * inv, in dst's dtype (DIRECT: dst is the
        output [B, S, H, C]; else the split partials [B, splits, rows, C], float32). """
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
    def _hidden_zero(x):
        """0 for an int32 x >= 0 (x >> 31), in PTX: neither LLVM nor ptxas sees it is 0, so a value computed from it is
        not hoisted out of a loop (or kept live across one) but recomputed where it is used."""
        return gl.inline_asm_elementwise("shr.u32 $0, $1, 31;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _scores(q_smem, bf_smem, t, j, W: gl.constexpr, HALF: gl.constexpr, NUM_CHUNKS: gl.constexpr, s):
        """Warpgroup W's scores of stage t (tile j): q . c[W*HALF : W*HALF + HALF]^T over the 9 chunks (9 async wgmma
        groups; s: zeros of the accumulator's layout, not accumulated)."""
        # q's chunks are indexed through a zero the compilers cannot see: else LLVM hoists the 36 loop-invariant q
        # descriptors out of the loop, 72 registers the attention warpgroups lack (they spilled)
        zero = _hidden_zero(j)
        for c in gl.static_range(NUM_CHUNKS):
            s = warpgroup_mma(q_smem.index(zero + c), bf_smem.index(t * NUM_CHUNKS + c).slice(W * HALF, HALF).permute((1, 0)), s,
                              use_acc=c > 0, is_async=True)
        return s

    @gluon.jit
    def _attend(q_smem, bf_smem, scale_smem, p_smem, mx_smem, bf_ready, bf_empty, p_ready, p_free, mx_bar,
                dst_ptr, part_lse_ptr, seq_len, lo, split_end, num_tiles, qk_scale,
                stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, stride_pl_b, stride_pl_split,
                S: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_CHUNKS: gl.constexpr,
                DIRECT: gl.constexpr, W: gl.constexpr):
        """Attention warpgroup W (0: the default partition, 1: a worker): scores of keys W*32 .. W*32+31 of each tile,
        the shared online softmax, output columns W*256 .. W*256+255 over all of the tile's keys."""
        HALF: gl.constexpr = BLOCK_N // 2
        O: gl.constexpr = 1 - W  # the other warpgroup
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        V0: gl.constexpr = W * 4  # the first of this warpgroup's four value chunks
        # the keys past the split's end have scale -1 (the converter's mark); with S > 1, row m also sees only keys
        # <= its query position (seq_len - S + m // H); with S = 1 that is every key before seq_len
        if S > 1:
            key_end = seq_len - S + (gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)) // H + 1
            cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
        acc0 = gl.zeros([BLOCK_M, 64], gl.float32, layout=o_layout)
        acc1 = gl.zeros([BLOCK_M, 64], gl.float32, layout=o_layout)
        acc2 = gl.zeros([BLOCK_M, 64], gl.float32, layout=o_layout)
        acc3 = gl.zeros([BLOCK_M, 64], gl.float32, layout=o_layout)
        p_op = gl.zeros([BLOCK_M, HALF], gl.bfloat16, layout=p_layout)
        # tile 0's scores. A tile's PV wgmmas and the next tile's QK^T ones are issued in the same iteration and all are
        # waited for in it: no wgmma in flight across the loop's back edge (ptxas then cannot prove the accumulators
        # idle and serialises every wgmma: FlashMLA's note)
        s = gl.zeros([BLOCK_M, HALF], gl.float32, layout=s_layout)
        if num_tiles > 0:
            mbarrier.wait(bf_ready.index(0), 0)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(_scores(q_smem, bf_smem, 0, num_tiles, W, HALF, NUM_CHUNKS, s),))
        for j in range(num_tiles):
            t = j % 2
            sc = scale_smem.index(t).slice(W * HALF, HALF).load(gl.SliceLayout(0, s_layout))
            visible = gl.expand_dims(sc >= 0.0, 0)
            if S > 1:
                visible = visible & (gl.expand_dims(cols, 0) < gl.expand_dims(key_end - (lo + j * BLOCK_N + W * HALF), 1))
            scores = gl.where(visible, s * gl.expand_dims(sc * qk_scale, 0), float("-inf"))
            # 2. the row maxima of both halves (slot j % 2: the other may still read slot (j - 1) % 2)
            m_mine = gl.max(scores, axis=1)
            mx_smem.index(t * 2 + W).store(m_mine)
            _sync_warps()
            mbarrier.arrive(mx_bar)
            mbarrier.wait(mx_bar, j & 1)
            m_other = mx_smem.index(t * 2 + O).load(row_layout)
            if W == 0:  # (the same operands in the same order in both warpgroups: the same bits)
                m_tile = gl.maximum(m_mine, m_other)
            else:
                m_tile = gl.maximum(m_other, m_mine)
            # 3. mla_decode.py's softmax_block (base 2): a row that has seen only -inf keeps m = -inf and weights 0
            m_new = gl.maximum(m_i, m_tile)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(scores - gl.expand_dims(m_safe, 1))
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            pv = (p * gl.expand_dims(sc, 0)).to(gl.bfloat16)  # the weight times the key's scale: (p * s) . v (p = 0 where masked)
            a2 = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            # 4. this half of p for the other warpgroup, once it has read the previous one
            mbarrier.wait(p_free.index(W), (j & 1) ^ 1)
            p_smem.index(W).store(pv)
            fence_async_shared()
            _sync_warps()
            mbarrier.arrive(p_ready.index(W))
            # 5. acc[:, W*256 : W*256+256] = acc * alpha + p . c over the tile: own keys (p in registers), then the
            # other's (p from shared memory)
            p_op = gl.convert_layout(pv, p_layout)
            o0 = warpgroup_mma(p_op, bf_smem.index(t * NUM_CHUNKS + V0 + 0).slice(W * HALF, HALF), acc0 * a2, is_async=True)
            o1 = warpgroup_mma(p_op, bf_smem.index(t * NUM_CHUNKS + V0 + 1).slice(W * HALF, HALF), acc1 * a2, is_async=True)
            o2 = warpgroup_mma(p_op, bf_smem.index(t * NUM_CHUNKS + V0 + 2).slice(W * HALF, HALF), acc2 * a2, is_async=True)
            o3 = warpgroup_mma(p_op, bf_smem.index(t * NUM_CHUNKS + V0 + 3).slice(W * HALF, HALF), acc3 * a2, is_async=True)
            mbarrier.wait(p_ready.index(O), j & 1)
            p_other = p_smem.index(O)
            o0 = warpgroup_mma(p_other, bf_smem.index(t * NUM_CHUNKS + V0 + 0).slice(O * HALF, HALF), o0, is_async=True)
            o1 = warpgroup_mma(p_other, bf_smem.index(t * NUM_CHUNKS + V0 + 1).slice(O * HALF, HALF), o1, is_async=True)
            o2 = warpgroup_mma(p_other, bf_smem.index(t * NUM_CHUNKS + V0 + 2).slice(O * HALF, HALF), o2, is_async=True)
            o3 = warpgroup_mma(p_other, bf_smem.index(t * NUM_CHUNKS + V0 + 3).slice(O * HALF, HALF), o3, is_async=True)
            if j + 1 < num_tiles:
                # 1. the next tile's scores, issued behind this PV; once this PV is done (all groups but the
                # NUM_CHUNKS just issued) its stage and the other's p are free
                mbarrier.wait(bf_ready.index(1 - t), ((j + 1) // 2) & 1)
                s_next = _scores(q_smem, bf_smem, 1 - t, j + 1, W, HALF, NUM_CHUNKS, gl.zeros([BLOCK_M, HALF], gl.float32, layout=s_layout))
                acc0, acc1, acc2, acc3, p_op = warpgroup_mma_wait(num_outstanding=NUM_CHUNKS, deps=(o0, o1, o2, o3, p_op))
                _sync_warps()
                mbarrier.arrive(bf_empty.index(t))
                mbarrier.arrive(p_free.index(O))
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s_next,))
            else:
                acc0, acc1, acc2, acc3, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, o2, o3, p_op))
        # the row sums of both halves, each rescaled by the same alphas: through the maxima's slots (tile parity
        # num_tiles: the other read its last maxima from the other parity) and barrier (phase num_tiles)
        tf = num_tiles % 2
        mx_smem.index(tf * 2 + W).store(l_i)
        _sync_warps()
        mbarrier.arrive(mx_bar)
        mbarrier.wait(mx_bar, tf)
        l_other = mx_smem.index(tf * 2 + O).load(row_layout)
        if W == 0:
            l_sum = l_i + l_other
        else:
            l_sum = l_other + l_i
        # mla_decode.py's split_partial: 1/l (1 for a row that saw no key: its acc is 0) and lse (-inf there). The
        # program's ids are read here, not captured: nothing but the loop's state is live across the loop (the worker
        # warpgroup spilled when they were)
        pid_m = gl.program_id(0)
        b = gl.program_id(1)
        split = gl.program_id(2)
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
        has = l_sum > 0.0
        l_safe = gl.where(has, l_sum, 1.0)
        inv = 1.0 / l_safe
        if not DIRECT:
            if W == 0:
                lse = gl.where(has, m_i + gl.log2(l_safe), float("-inf"))
                gl.store(part_lse_ptr + b.to(gl.int64) * stride_pl_b + split * stride_pl_split + offs_m, lse, mask=offs_m < S * H)
        _store_half(acc0, acc1, acc2, acc3, gl.convert_layout(inv, gl.SliceLayout(1, o_layout)), dst_ptr, b, split, pid_m, W,
                    stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, S, H, BLOCK_M, DIRECT, o_layout)

    @gluon.jit(do_not_specialize=["tokens_per_split"])
    def _mla_decode_fp8_ws_kernel(
        kv_words,  # the cache as int32 words ([pages, 64, 148]: a row's 576 e4m3 codes, then its float32 scale)
        q_nope_ptr, q_rope_ptr, block_table_ptr, seq_lens_ptr,
        dst_ptr,  # DIRECT: the output [B, S, H, C]; else the split partials [B, splits, rows, C] float32
        part_lse_ptr,
        qk_scale,  # softmax_scale * log2(e)
        tokens_per_split,  # a multiple of BLOCK_N
        stride_kv_page, stride_kv_row,  # bytes
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
        DIRECT: gl.constexpr,
        REGS_ATTEND: gl.constexpr, REGS_CONVERT: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        NUM_CHUNKS: gl.constexpr = (C + R) // 64
        HALF: gl.constexpr = BLOCK_N // 2
        pid_m = gl.program_id(0)
        b = gl.program_id(1)
        split = gl.program_id(2)
        seq_len = gl.load(seq_lens_ptr + b).to(gl.int32)
        lo = split * tokens_per_split
        split_end = gl.minimum(lo + tokens_per_split, seq_len)
        num_tiles = gl.maximum(split_end - lo + BLOCK_N - 1, 0) // BLOCK_N
        bt_row = block_table_ptr + b.to(gl.int64) * stride_bt_b

        chunk_bf16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16)
        chunk_words: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        q_layout_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 64], gl.bfloat16)
        p_layout_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], gl.bfloat16)
        vec_s: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_CHUNKS, BLOCK_M, 64], q_layout_s)
        bf_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * NUM_CHUNKS, BLOCK_N, 64], chunk_bf16)
        # the same memory as int32 pairs of bf16 for the converting warps (the 128-byte swizzle moves 16-byte units: the
        # same bytes for 16- and 32-bit elements)
        if _REINTERPRET_IS_PUBLIC:
            bf_words = bf_smem.reinterpret(gl.int32, [2 * NUM_CHUNKS, BLOCK_N, 32], chunk_words)
        else:
            bf_words = bf_smem._reinterpret(gl.int32, [2 * NUM_CHUNKS, BLOCK_N, 32], chunk_words)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, HALF], p_layout_s)  # [warpgroup]: its keys' p
        scale_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N], vec_s)  # [stage]: the rows' scales * 2^112 (-1: past the end)
        mx_smem = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M], vec_s)  # [tile parity * 2 + warpgroup]: row maxima, then sums
        bf_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        bf_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mx_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(bf_ready.index(i), count=1)
            mbarrier.init(bf_empty.index(i), count=2)  # both attention warpgroups
            mbarrier.init(p_ready.index(i), count=1)
            mbarrier.init(p_free.index(i), count=1)
        mbarrier.init(mx_bar, count=2)

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
                (_attend, (q_smem, bf_smem, scale_smem, p_smem, mx_smem, bf_ready, bf_empty, p_ready, p_free, mx_bar,
                           dst_ptr, part_lse_ptr, seq_len, lo, split_end, num_tiles, qk_scale,
                           stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, stride_pl_b, stride_pl_split,
                           S, H, BLOCK_M, BLOCK_N, NUM_CHUNKS, DIRECT, 0)),
                (_attend, (q_smem, bf_smem, scale_smem, p_smem, mx_smem, bf_ready, bf_empty, p_ready, p_free, mx_bar,
                           dst_ptr, part_lse_ptr, seq_len, lo, split_end, num_tiles, qk_scale,
                           stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, stride_pl_b, stride_pl_split,
                           S, H, BLOCK_M, BLOCK_N, NUM_CHUNKS, DIRECT, 1)),
                (_converter, (kv_words, bt_row, bf_words, scale_smem, bf_ready, bf_empty, lo, split_end, num_tiles,
                              stride_kv_page, stride_kv_row, PAGE, BLOCK_N, NUM_CHUNKS, C + R)),
            ],
            [4, 4],
            [REGS_ATTEND, REGS_CONVERT],
        )


# ---------------------------------------------------------------------------------------------
# Host side: which calls the kernel serves, its plan and launch


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
    _mla_decode_fp8_ws_kernel[(p.row_tiles, batch, p.num_splits)](
        kv_cache.view(torch.int32), q_nope, q_rope, block_table, seq_lens,
        out if p.direct else part_out, part_lse,
        float(softmax_scale) * LOG2E,
        p.tokens_per_split,
        kv_cache.stride(0), kv_cache.stride(1),
        q_nope.stride(0), q_nope.stride(1), q_nope.stride(2),
        q_rope.stride(0), q_rope.stride(1), q_rope.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        *po_strides,
        *pl_strides,
        S=num_queries, H=heads, C=LATENT, R=ROPE, PAGE=PAGE, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DIRECT=p.direct,
        REGS_ATTEND=PARTITION_REGS[0], REGS_CONVERT=PARTITION_REGS[1],
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
        note="Gluon (SM90, FP8 cache): warp-specialised, a converting warpgroup loading 64-row tiles into bf16 stages, two wgmma "
        "warpgroups each scoring half the keys and owning half the output columns; the tl kernel for the calls it does not serve",
    ),
]
