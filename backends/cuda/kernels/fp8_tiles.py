"""Loading a tile of an FP8 KV cache (deepinfer.ops.kv_cache_format) as bfloat16 for tensor-core dots, fast.

Written naively (`tl.load` of the bytes, `.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)`), Triton moves the
cast behind the dot operand's layout conversion, so the 8-bit tile goes through shared memory and every thread
reads it back one byte at a time (`ld.shared.b8`: 128 per thread per 64-row tile of the MLA cache, measured by
`deepinfer bench compile` on the PTX), with no asynchronous copies: the FP8 reader ran at 27% of copy, slower
than the bf16 reader of twice the bytes. Here the tile is loaded as 32-bit words (four e4m3 values each, 16-byte
vectors along the row) and converted in registers by PTX (`cvt.rn.f16x2.e4m3x2`, exact, then to bf16), which
Triton cannot move: the bf16 tile reaches shared memory in 16-byte stores and the dots read it with ldmatrix, as
the bf16 reader's does. (A bit-placement conversion, as gemm.py's `_e4m3_bf16_pairs`, measured no faster on the H100.)

The interpreter cannot run PTX: kernels keep the plain cast for it (`interpreting()` picks), and the conformance
cases on the GPU check this path against the reference. Not a registration module (mla_decode and sparse_attention
use it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.triton_common import interpreting

# Four e4m3 bytes of a word -> two words of two bfloat16s (columns 4w, 4w+1 | 4w+2, 4w+3; low half first).
# cvt.rn.f16x2.e4m3x2 is exact (every e4m3 value is a normal half or zero), and so is half -> float -> bfloat16.
_E4M3X4_TO_BF16X4 = tl.constexpr("""{
.reg .b16 lo, hi;
.reg .b32 p, q;
.reg .f16 h<4>;
.reg .f32 f<4>;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 p, lo;
cvt.rn.f16x2.e4m3x2 q, hi;
mov.b32 {h0, h1}, p;
mov.b32 {h2, h3}, q;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
cvt.f32.f16 f2, h2;
cvt.f32.f16 f3, h3;
cvt.rn.bf16x2.f32 $0, f1, f0;
cvt.rn.bf16x2.f32 $1, f3, f2;
}""")


@triton.jit
def e4m3_words_to_bf16(words, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """int32 [ROWS, WORDS] words of four e4m3 values (little-endian: the first value in the low byte) -> bfloat16
    [ROWS, 4 * WORDS] in the same order, exactly."""
    lo, hi = tl.inline_asm_elementwise(_E4M3X4_TO_BF16X4, "=r,=r,r", [words], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    pairs = tl.reshape(tl.join(lo, hi), (ROWS, 2 * WORDS))  # words of two bf16: columns 2p (low half), 2p + 1
    halves = tl.join(pairs.to(tl.int16), (pairs >> 16).to(tl.int16))
    return tl.reshape(halves, (ROWS, 4 * WORDS)).to(tl.bfloat16, bitcast=True)


@triton.jit
def load_e4m3_tile(words_ptr, row_words, n_ok, col0, ROWS: tl.constexpr, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    """tile[n, c] = the e4m3 value at column col0 + c of the cache row starting at word row_words[n] (zeros for rows
    not n_ok), as bfloat16 [ROWS, BLOCK], unscaled. words_ptr: the cache as 32-bit words (any 32-bit view: the
    float32 view the scales are read through is bit-cast); col0 and BLOCK multiples of 4; the row's whole BLOCK
    columns are read (the caller's WIDTH == BLOCK)."""
    offs = tl.arange(0, BLOCK // 4)
    words = tl.load(words_ptr + row_words[:, None] + (col0 // 4 + offs)[None, :], mask=n_ok[:, None], other=0.0, eviction_policy=EVICT)
    return e4m3_words_to_bf16(words.to(tl.int32, bitcast=True), ROWS, BLOCK // 4)


def use_word_tiles(q_dtype: torch.dtype, dot_f32: bool, whole_widths: bool, cfg: dict) -> bool:
    """Whether a reader of an FP8 cache takes its tiles through `load_e4m3_tile`: bf16 q and dots (the tile comes out
    in bf16), tiles as wide as the row parts they read (whole_widths), not the interpreter (it cannot run PTX), and
    not turned off by the tuning override "fp8_words": False (the byte reads, kept for A/B runs)."""
    return q_dtype == torch.bfloat16 and not dot_f32 and whole_widths and not interpreting() and cfg.get("fp8_words", True)
