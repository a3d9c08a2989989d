"""Gluon kernel (SM90): `mla_decode` over the FP8 KV cache, warp-specialised, both wgmma warpgroups scoring keys.

Registered for SM90 GPUs whose Triton has Gluon for Hopper, for models with an FP8 cache of these rows (`_chosen`;
backend option mla_decode_path=tl leaves them to the tl kernel); the calls it does not serve (`not_served`) go to
mla_decode.py's tl kernel, which stays what the interpreter checks in CI. Compiled in CI by `deepinfer bench compile
--case gluon` (wgmma, no spills; no TMA: the converting warps load the cache bytes). Checked on an H100 (Triton 3.6,
2026-12-06) against the tl kernel on the 6 shapes of tests/cuda/test_mla_decode_fp8_gluon.py's GPU cases (planned, 1,
8 and 3 splits, S = 2 and 4, 128 heads, ragged lengths): max |difference| 2.4e-4 .. 9.8e-4 at outputs below 1.8 (the
previous schedule's: 2e-3 .. 4e-3), from a scratch script; on an H100 on 2026-12-07 that test file's GPU cases passed
and `deepinfer conformance --backend cuda --op mla_decode` (its FP8 cases choose this kernel) passed with this
schedule.

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
BLOCK_N = 64 cache rows (one page); three partitions, 12 warps (the attention warpgroups, q's staging, the plan and the
launch are mla_decode_gluon_parts.py's, shared with mla_decode_gluon.py's kernel over the bf16 cache):
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

With the tuning switch mla_decode/gluon_fp8 "keys_as_m" (on in the table) the launch sends the calls of at
most 16 query rows to mla_decode_fp8_gluon_keys_m.py's kernel (the keys as the wgmma's M: no padded rows), the same plan.

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
`thread_barrier`, 3.9 `barrier`: `_sync_warps`) and the shared-memory reinterpretation (3.6 `_reinterpret`, 3.9
`reinterpret`: `reinterpret_shared`), gluon_hopper.py's shims.
"""


from __future__ import annotations

import torch

from deepinfer.ops import kv_cache_format
from deepinfer_cuda.kernels import mla_decode_gluon_parts as parts
from deepinfer_cuda.kernels.common import Registration
from deepinfer_cuda.kernels.gluon_hopper import GLUON_IMPORT_ERROR
from deepinfer_cuda.kernels.mla_decode_gluon_parts import BLOCK_N, LATENT, PAGE, ROPE, SPLIT_GRANULE, GluonPlan, plan  # noqa: F401  (its plan)
from deepinfer_cuda.options import MLA_DECODE_PATH
from deepinfer_cuda.tuning import config

if GLUON_IMPORT_ERROR is None:  # (else the launch declines every call)
    from deepinfer_cuda.kernels.gluon_hopper import fence_async_shared, gl, gluon, mbarrier, reinterpret_shared
    from deepinfer_cuda.kernels.gluon_hopper import sync_warps as _sync_warps
    from deepinfer_cuda.kernels.mla_decode_gluon_parts import _attend, _attention_barriers, _attention_smem, _hidden_zero, _split_range, _stage_q  # noqa: F401 (_hidden_zero: sparse_attention_fp8_gluon.py's import)

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
        seq_len, lo, split_end, num_tiles = _split_range(seq_lens_ptr, tokens_per_split, BLOCK_N)
        bt_row = block_table_ptr + gl.program_id(1).to(gl.int64) * stride_bt_b

        q_smem, bf_smem, p_smem = _attention_smem(BLOCK_M, BLOCK_N, NUM_CHUNKS)
        # the stages as int32 pairs of bf16 for the converting warps (the 128-byte swizzle moves 16-byte units: the
        # same bytes for 16- and 32-bit elements)
        chunk_words: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        bf_words = reinterpret_shared(bf_smem, gl.int32, [2 * NUM_CHUNKS, BLOCK_N, 32], chunk_words)
        vec_s: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        scale_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N], vec_s)  # [stage]: the rows' scales * 2^112 (-1: past the end)
        mx_smem, bf_ready, bf_empty, p_ready, p_free, mx_bar = _attention_barriers(BLOCK_M)
        _stage_q(q_smem, q_nope_ptr, q_rope_ptr, stride_qn_b, stride_qn_s, stride_qn_h, stride_qr_b, stride_qr_s, stride_qr_h,
                 S, H, C, R, BLOCK_M, num_warps)

        gl.warp_specialize(
            [
                (_attend, (q_smem, bf_smem, scale_smem, p_smem, mx_smem, bf_ready, bf_empty, p_ready, p_free, mx_bar,
                           dst_ptr, part_lse_ptr, seq_len, lo, split_end, num_tiles, qk_scale,
                           stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, stride_pl_b, stride_pl_split,
                           S, H, BLOCK_M, BLOCK_N, NUM_CHUNKS, DIRECT, 0, True)),
                (_attend, (q_smem, bf_smem, scale_smem, p_smem, mx_smem, bf_ready, bf_empty, p_ready, p_free, mx_bar,
                           dst_ptr, part_lse_ptr, seq_len, lo, split_end, num_tiles, qk_scale,
                           stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, stride_pl_b, stride_pl_split,
                           S, H, BLOCK_M, BLOCK_N, NUM_CHUNKS, DIRECT, 1, True)),
                (_converter, (kv_words, bt_row, bf_words, scale_smem, bf_ready, bf_empty, lo, split_end, num_tiles,
                              stride_kv_page, stride_kv_row, PAGE, BLOCK_N, NUM_CHUNKS, C + R)),
            ],
            [4, 4],
            [REGS_ATTEND, REGS_CONVERT],
        )


# ---------------------------------------------------------------------------------------------
# Host side: which calls the kernel serves and its launch (the plan and the launch with the combine: mla_decode_gluon_parts)

Fp8GluonPlan = GluonPlan  # (the plan of either Gluon mla_decode kernel)


def not_served(q_nope, q_rope, kv_cache, sliding_window, overrides=None, tiles_of_one_query=False) -> str | None:
    """Why this kernel does not serve a call (None: it does). Shapes, dtypes, strides and alignment only."""
    why = parts.q_not_served(q_nope, q_rope, sliding_window, overrides, tiles_of_one_query)
    if why is not None:
        return why
    if not kv_cache_format.is_fp8(kv_cache):
        return "the cache is not FP8"
    if kv_cache.dim() != 3 or kv_cache.shape[1] != PAGE or kv_cache.shape[2] != LATENT + ROPE + kv_cache_format.ROW_TAIL:
        return f"cache {tuple(kv_cache.shape)}: wants [pages, {PAGE}, {LATENT + ROPE + kv_cache_format.ROW_TAIL}]"
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) % 16 or kv_cache.stride(0) != PAGE * kv_cache.stride(1):
        return "cache pages are not one matrix of 16-byte aligned rows"
    if kv_cache.data_ptr() % 16:
        return "cache base is not 16-byte aligned"
    return None


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
    """mla_decode.launch_mla_decode's signature; None for a call this kernel does not serve (`not_served`: the caller
    falls back to it). Several splits: the partials are merged by mla_decode.py's combine kernel (parts.launch);
    separate_combine changes nothing here (this kernel never merges in its split programs)."""
    from deepinfer.ops import attention as attention_ops

    del separate_combine
    attention_ops.check_mla_decode_shapes(q_nope, q_rope, kv_cache, sliding_window)
    if not_served(q_nope, q_rope, kv_cache, sliding_window, overrides, tiles_of_one_query) is not None:
        return None
    if config("mla_decode", "gluon_fp8", q_nope.device)["keys_as_m"]:
        from deepinfer_cuda.kernels import mla_decode_fp8_gluon_keys_m as keys_m

        if keys_m.not_served(q_nope, kv_cache) is None:  # (at most 16 query rows)
            return keys_m.launch(q_nope, q_rope, kv_cache, block_table, seq_lens, softmax_scale, num_splits, tokens_per_split)
    return parts.launch(_mla_decode_fp8_ws_kernel, kv_cache.view(torch.int32), (kv_cache.stride(0), kv_cache.stride(1)),
                        q_nope, q_rope, block_table, seq_lens, softmax_scale, num_splits, tokens_per_split,
                        REGS_ATTEND=PARTITION_REGS[0], REGS_CONVERT=PARTITION_REGS[1])


# The op on this kernel where it serves the call (`not_served`), else on mla_decode.py's tl kernel.
mla_decode = parts.op_with_fallback(launch_mla_decode_fp8_gluon, __name__)


def _chosen(ctx) -> bool:
    """An SM90 GPU whose Triton has Gluon for Hopper, serving a model with an FP8 cache of this kernel's rows (C 512,
    R 64, pages of 64, no sliding window), unless backend option mla_decode_path=tl; facts not known keep the tl kernel."""
    from deepinfer_cuda.kernels.gemm_mxfp4_gluon import is_sm90

    m = ctx.model
    return (MLA_DECODE_PATH.value(ctx) != "tl" and GLUON_IMPORT_ERROR is None and is_sm90(ctx.device) and m.kv_cache_fp8 is True
            and m.kv_lora_rank == LATENT and m.qk_rope_head_dim == ROPE and m.sliding_window == 0 and m.kv_block_size == PAGE)  # fmt: skip


REGISTRATIONS = [
    Registration(
        op="mla_decode",
        fn=mla_decode,
        dtypes=(torch.bfloat16,),
        when=_chosen,
        priority=1,
        note="Gluon (SM90, FP8 cache; mla_decode_path auto or gluon): warp-specialised, a converting warpgroup loading 64-row tiles "
        "into bf16 stages, two wgmma warpgroups each scoring half the keys and owning half the output columns; the tl kernel for "
        "the calls it does not serve",
    ),
]
