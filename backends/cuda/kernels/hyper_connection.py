"""Triton kernels: hc_pre, hc_pre_delayed, hc_head and hc_post (DeepSeek-V4's manifold-constrained hyper-connections).

hc_pre_delayed (DeepSeek-V4.1's single-pass hyper-connections) runs hc_pre's launches with DELAYED on:
the mixings are computed alike and `pre` is stored beside post and comb, while the collapse weighs the
streams by the previous site's pre (prev_pre [T, N], loaded where hc_pre uses its own).

hc_head (the head's collapse before the final norm) runs them with HEAD on: W = N mixing logits (fn has
N rows, W_PAD 16) and one scale, so the mixings are `pre` alone (post and comb are neither made nor
stored), and the norm is always folded in; it returns the normed collapse. At decode sizes that is the
split launch's two kernels where the model ran about fifteen torch launches and an rms_norm.

hc_pre, per token t (x_t: N streams of D, flattened to K = N*D; W = (2+N)N mixing logits):

    m[t, w] = rsqrt(mean(x_t^2) + norm_eps) * sum_k x_t[k] * fn[w, k]

then pre = sigmoid, post = 2 sigmoid, comb = row softmax + Sinkhorn-Knopp on the N x N block, and
layer_input[t] = sum_n pre[t, n] * x[t, n]. The norm factors out of the dot, so ONE pass over x_t
yields both the sum of squares and the W projections; the mixings (a few dozen numbers per token)
are computed in registers; a second pass over x_t collapses the streams (pre needs the whole dot).

A mix program owns BLOCK_T tokens: each fn chunk it loads serves all of them (fn is W x K = 1.5 MB
for V4-Flash; re-reading it per token would cost far more than x). The projection is a float32
tl.dot [BLOCK_T, BLOCK_K] x [BLOCK_K, W_PAD] (fn^T chunk) at `dot_precision` (bfloat16 x: three bfloat16 dots
against fn split in three parts, exact products; float16 x: "tf32x3"; float32's accuracy on the tensor cores
either way; W = 24 is padded to 32 columns). float64 x (a test dtype) uses a broadcast
multiply reduced per chunk instead. K is cut into segments of SEG elements (whole chunks); within
a segment the dot accumulates the chunks in order and the squares accumulate per lane (reduced
across lanes at the segment's end). Two launch shapes:

  * fused (K within one 1024-wide segment: small models only): grid (token tiles,), `_hc_pre_kernel`
    does the projection over all segments (added in order), the mixings, and the collapse; with
    `norm_weight` the norm's own kernel runs after it (its 32-token tile has no room for the row).
  * split (every model shape; deterministic mode at every K): the product is spread over segments.
    `_hc_pre_mix_kernel`, grid (token tiles, segments), one segment per program, stores the segment's
    partial products and sum of squares (float32 [T, segments, W_PAD] and [T, segments]). Its segment
    and tile grow with T (`_SPLIT_BUCKETS`: 128 x 16 tokens at decode, 128 programs per tile for
    K = 16384, up to 1024 x 64 at prefill sizes: fewer partials, fn re-read less). Then the combine,
    in one of two forms:
      - row (`_hc_pre_row_kernel`, a token's N x D streams fit in registers: D <= `_ROW_MAX_D`): one
        token per program loads all of its partials as ONE [segments, W_PAD] tile (every load in
        flight at once), sums them with one tl.sum, computes the mixings, then loads its whole row,
        collapses it once and, with `norm_weight`, takes the row's statistics from registers and
        stores round(round(li) * rstd * weight) as rms_norm would (no norm launch after hc_pre).
      - D-split (`_hc_pre_combine_kernel`, wider rows): grid (tokens, D splits), the mixings repeated in
        every split, each collapsing its share of D in 512-wide steps; with `norm_weight` every split
        first re-reads the whole row for its statistics.
    SEG doubles for K past 256 segments (a fact of the model). Partials are float64 for float64 x; at
    most 4096 tokens run per mix + combine pair (the partials stay under 64 MB for V4-Flash).
    Measured on an H200 against the former choice (seg 128, 16-token tiles, the D-split combine below
    4224 tokens, fused + rms_norm above): see `_SPLIT_BUCKETS`.

Different segments sum in different orders (the segments by a tl.sum tree), so the buckets' numbers
differ in the last bits; each is deterministic run to run.

The N x N block is taken out of the W_PAD logits by a masked sum (exact) and reshaped to
[BLOCK_T, N_PAD, N_PAD]; padding (N not a power of two) is masked to zero so Sinkhorn's sums see
only the N x N block. Math in float32; post and comb are stored float32. float64 x (a test dtype)
is computed and returned in float64 throughout, post and comb included, as the reference does.

hc_post: out[t, k] = post[t, k] * y[t] + sum_j comb[t, j, k] * x[t, j]: memory-bound, grid
(token tiles, D tiles), each program reads y and the N streams of its tile once and writes the N
output streams; the sum over j runs in order j = 0..N-1.

The wrappers read only shapes and strides: no host synchronisation (CUDA-graph safe).

Deterministic mode: `hc_pre_invariant` takes the split launch with the first bucket's shape at every T,
so its compiled kernels are the same for every T: the segment, the mix tile (16 tokens, 64-wide chunks)
and the combine's form and tile are fixed by the model's shapes; T only sets the grids (which program
computes a segment or a row) and the 4096-token chunks, neither of which changes a value. The default
`hc_pre` runs that same shape up to 16 tokens, so at those decode sizes both give the same bits;
`hc_head_invariant` is the same split launch with HEAD. hc_post is batch-invariant as it is: every
output element is its own post * y + sum over j in order (no reduction across lanes), so its
T-dependent tile changes no value.

Deviation (interpreter only): under TRITON_INTERPRET=1 a combine program holds 16 tokens (numpy sums
every row of a tile alike, so no value changes), a chunk
is a whole segment and the collapse steps are 2048 wide (the interpreter pays per operation and
per jit-function call, tl.sum included, not per element), and at most two D splits repeat the mixings.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deepinfer.ops import hyper_connection as hc_ops
from deepinfer.triton_common import cdiv, interpreting, next_power_of_2, sinkhorn_mix, to_bf16_rne, upcast_dot
from deepinfer_cuda.kernels.common import Registration, bf16x3_dot, num_sms, pdl_launch, pdl_prologue

# hc_pre's fused launch (the best of the H200 configurations tried: 16/32/64 tokens, chunks of 32/64,
# 4/8 warps).
_PRE_BLOCK_T = 32  # tokens per program (the dot's M)
_PRE_BLOCK_K = 64  # projection chunk (elements of the flattened streams)
_PRE_SEG = 1024  # the fused launch's reduction segment
_PRE_BLOCK_D = 128  # collapse chunk: [BLOCK_T, N_PAD, BLOCK_D] per step
_PRE_WARPS = 4
_PRE_STAGES = 3
# hc_pre's split launch: one (token tile, segment) per program, then one token per combine program.
# Fixed for every T (deterministic mode runs it at every T): a token's numbers do not depend on the batch.
_SPLIT_SEG = 128  # reduction segment: 128 programs per token tile for V4-Flash's K = 16384
_SPLIT_MAX_SEGMENTS = 256  # longer K doubles the segment (the combine's tile holds every segment)
# (up to T tokens, mix segment, mix tokens): wider segments and taller mix tiles as T grows (fewer partials, fn read
# fewer times). From a sweep of V4-Flash's hc_pre with its norm on an H200 (docs/measurements/2026-12-07/h200/
# hc_sweep.txt, row combine): T 1 / 64 / 256 / 1024 / 8192 took 9.3 / 14.2 / 24.0 / 63.5 / 488 us against 11.9 / 29.4 /
# 54.8 / 142 / 662 for the former shapes (seg 128, 16 tokens, D-split combine; the fused launch and rms_norm at 8192).
_SPLIT_BUCKETS = ((16, 128, 16), (128, 256, 32), (1024, 512, 64), (None, 1024, 64))
_ROW_MAX_D = 8192  # the row combine holds a token's N x D 16-bit streams in registers (8 warps past 4096)
_SPLIT_BLOCK_K = 64
_SPLIT_STAGES = 2
_SPLIT_BLOCK_D = 512  # collapse chunk of a combine program
_SPLIT_MAX_TOKENS = 4096  # tokens per mix + combine pair: partials of at most 64 MB (V4-Flash)
_COMBINE_WARPS = 4
_STATS_BLOCK_D = 2048  # with the block's norm: a combine program's row statistics per step (one token: 32 KB of x in two steps)
_PRE_FILL = 2  # programs per SM the combine's D splits aim for
_INTERP_BLOCK_D = 2048  # collapse chunk under the interpreter
# hc_post launch constants.
_POST_TILE = 4096  # output elements per program
_POST_MAX_BLOCK_D = 1024
_POST_WARPS = 4


@triton.jit
def _to_out(v, out_ptr, MANUAL_RNE: tl.constexpr):
    """v in out_ptr's element type; bfloat16 rounded to nearest even by hand under the interpreter (its cast truncates)."""
    if MANUAL_RNE:
        r = to_bf16_rne(v.to(tl.float32))
    else:
        r = v.to(out_ptr.dtype.element_ty)
    return r


@triton.jit
def _segment_partial(
    x_ptr, fn_ptr, toks, t_ok, stride_t, stride_fn, k_lo, k_hi,
    ACC: tl.constexpr, W: tl.constexpr, BLOCK_T: tl.constexpr, W_PAD: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """(sum_k x[t, k] fn[w, k], sum_k x[t, k]^2) over k in [k_lo, k_hi): the products accumulate
    chunk by chunk in order (float32 dot at DOT_PRECISION, or "bf16x3": `bf16x3_dot`), the squares per lane,
    reduced at the end."""
    w = tl.arange(0, W_PAD)
    kk = tl.arange(0, BLOCK_K)
    w_ok = w < W
    acc = tl.zeros([BLOCK_T, W_PAD], ACC)
    sq = tl.zeros([BLOCK_T, BLOCK_K], ACC)
    x_ptrs = x_ptr + toks[:, None] * stride_t + (k_lo + kk)[None, :]
    f_ptrs = fn_ptr + w[None, :] * stride_fn + (k_lo + kk)[:, None]  # fn^T chunk [BLOCK_K, W_PAD]
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:  # whole chunks: token / row masks only
            xs = tl.load(x_ptrs, mask=t_ok[:, None], other=0.0)
            ft = tl.load(f_ptrs, mask=w_ok[None, :], other=0.0).to(ACC)
        else:
            k_ok = k0 + kk < k_hi
            xs = tl.load(x_ptrs, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            ft = tl.load(f_ptrs, mask=k_ok[:, None] & w_ok[None, :], other=0.0).to(ACC)
        xt = xs.to(ACC)
        if DOT_PRECISION == "bf16x3" or DOT_PRECISION == "bf16x3_upcast":
            acc = bf16x3_dot(xs, ft, acc, DOT_PRECISION == "bf16x3_upcast")
        elif USE_DOT:
            acc = tl.dot(xt, ft, acc, input_precision=DOT_PRECISION)
        else:  # float64 (a test dtype): broadcast multiply, reduced per chunk
            acc += tl.sum(xt[:, :, None] * ft[None, :, :], axis=1)
        sq += xt * xt
        x_ptrs += BLOCK_K
        f_ptrs += BLOCK_K
    return acc, tl.sum(sq, axis=1)


@triton.jit(do_not_specialize=["T"])
def _hc_pre_mix_kernel(
    x_ptr, fn_ptr, part_ptr, part_ss_ptr,
    T, K, n_seg, stride_t, stride_fn,
    ACC: tl.constexpr, W: tl.constexpr, BLOCK_T: tl.constexpr, W_PAD: tl.constexpr, BLOCK_K: tl.constexpr, SEG: tl.constexpr,
    EVEN_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):
    """One (token tile, segment) per program: the segment's partial products and sum of squares,
    stored at row t * n_seg + seg of part [T, n_seg, W_PAD] and part_ss [T, n_seg]."""
    pdl_prologue(PDL)
    pid_t = tl.program_id(0)
    seg = tl.program_id(1)
    toks = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = toks < T
    w = tl.arange(0, W_PAD)
    k_lo = seg * SEG
    acc, ss = _segment_partial(
        x_ptr, fn_ptr, toks, t_ok, stride_t, stride_fn, k_lo, tl.minimum(k_lo + SEG, K), ACC, W, BLOCK_T, W_PAD, BLOCK_K, EVEN_K, USE_DOT,
        DOT_PRECISION,
    )
    row = toks * n_seg + seg
    tl.store(part_ptr + row[:, None] * W_PAD + w[None, :], acc.to(part_ptr.dtype.element_ty), mask=t_ok[:, None])
    tl.store(part_ss_ptr + row, ss.to(part_ss_ptr.dtype.element_ty), mask=t_ok)


@triton.jit
def _mixings(
    acc, ss, base_ptr, scale_ptr, K, norm_eps, hc_eps, sinkhorn_iters,
    ACC: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr, W_PAD: tl.constexpr, N_PAD: tl.constexpr, HEAD: tl.constexpr,
):
    """pre [BLOCK_T, N_PAD], post [BLOCK_T, N_PAD], comb [BLOCK_T, N_PAD, N_PAD] from the raw
    projections acc [BLOCK_T, W_PAD] and the sums of squares ss [BLOCK_T] (padding: zeros).
    HEAD (hc_head: N logits, one scale): pre alone; post and comb are pre again, placeholders never stored."""
    rstd = 1.0 / tl.sqrt(ss / K + norm_eps)
    m = acc * rstd[:, None]
    w = tl.arange(0, W_PAD)
    n = tl.arange(0, N_PAD)
    n_ok = n < N
    s0 = tl.load(scale_ptr).to(ACC)
    m_pre = tl.sum(tl.where((w[None, :] == n[:, None])[None, :, :], m[:, None, :], 0.0), axis=2)
    b_pre = tl.load(base_ptr + n, mask=n_ok, other=0.0).to(ACC)
    pre = tl.where(n_ok[None, :], 1.0 / (1.0 + tl.exp(-(m_pre * s0 + b_pre[None, :]))) + hc_eps, 0.0)
    if HEAD:
        post = pre
        comb = pre
    else:
        s1 = tl.load(scale_ptr + 1).to(ACC)
        s2 = tl.load(scale_ptr + 2).to(ACC)
        m_post = tl.sum(tl.where((w[None, :] == (N + n)[:, None])[None, :, :], m[:, None, :], 0.0), axis=2)
        b_post = tl.load(base_ptr + N + n, mask=n_ok, other=0.0).to(ACC)
        post = 2.0 / (1.0 + tl.exp(-(m_post * s1 + b_post[None, :])))
        # comb: logits 2N + i*N + j -> flat e = i*N_PAD + j -> [BLOCK_T, N_PAD, N_PAD]
        e = tl.arange(0, N_PAD * N_PAD)
        e_ok = (e // N_PAD < N) & (e % N_PAD < N)
        col = 2 * N + (e // N_PAD) * N + e % N_PAD
        m_comb = tl.sum(tl.where(((w[None, :] == col[:, None]) & e_ok[:, None])[None, :, :], m[:, None, :], 0.0), axis=2)
        b_comb = tl.load(base_ptr + col, mask=e_ok, other=0.0).to(ACC)
        z = tl.reshape(m_comb * s2 + b_comb[None, :], [BLOCK_T, N_PAD, N_PAD])
        comb = sinkhorn_mix(z, n_ok, hc_eps, sinkhorn_iters)
    return pre, post, comb


@triton.jit
def _collapse(x_ptr, toks, t_ok, pre, d, d_ok, D, stride_t, ACC: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr):
    """sum_n pre[t, n] * x[t, n, d] over the chunk d of the tokens [BLOCK_T, BLOCK_D] (ACC; zeros where masked)."""
    n = tl.arange(0, N_PAD)
    xt = tl.load(x_ptr + toks[:, None, None] * stride_t + (n[None, :, None] * D + d[None, None, :]),
                 mask=t_ok[:, None, None] & (n < N)[None, :, None] & d_ok[None, None, :], other=0.0).to(ACC)
    return tl.sum(xt * pre[:, :, None], axis=1)


@triton.jit
def _store_mixings(
    post_ptr, comb_ptr, pre_ptr, prev_pre_ptr, toks, t_ok, pre, post, comb, store_mixings,
    ACC: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr, DELAYED: tl.constexpr, HEAD: tl.constexpr,
):
    """post / comb of the tokens (when store_mixings; never with HEAD: hc_head has none), and with DELAYED their pre;
    returns the weights the streams collapse with: pre, or with DELAYED the previous site's (prev_pre [T, N])."""
    n = tl.arange(0, N_PAD)
    n_ok = n < N
    if DELAYED:
        if store_mixings:
            tl.store(pre_ptr + toks[:, None] * N + n[None, :], pre.to(pre_ptr.dtype.element_ty), mask=t_ok[:, None] & n_ok[None, :])
        pre = tl.load(prev_pre_ptr + toks[:, None] * N + n[None, :], mask=t_ok[:, None] & n_ok[None, :], other=0.0).to(ACC)
    if not HEAD:
        if store_mixings:
            tl.store(post_ptr + toks[:, None] * N + n[None, :], post.to(post_ptr.dtype.element_ty), mask=t_ok[:, None] & n_ok[None, :])
            ij = n[:, None] * N + n[None, :]
            tl.store(comb_ptr + toks[:, None, None] * (N * N) + ij[None, :, :], comb.to(comb_ptr.dtype.element_ty),
                     mask=t_ok[:, None, None] & (n_ok[:, None] & n_ok[None, :])[None, :, :])
    return pre


@triton.jit
def _store_mixed(
    x_ptr, out_ptr, post_ptr, comb_ptr, w_ptr, pre_ptr, prev_pre_ptr, toks, t_ok, pre, post, comb, store_mixings, d_lo, d_hi, D, stride_t,
    stride_out, norm_eps,
    ACC: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr, MANUAL_RNE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr,
    STATS_BLOCK_D: tl.constexpr, DELAYED: tl.constexpr, HEAD: tl.constexpr,
):
    """post / comb of the tokens (when store_mixings; never with HEAD: hc_head has none) and their layer input over d in [d_lo, d_hi); with
    NORM, rms-normed with the weight at w_ptr over the whole row (norm_eps), its statistics taken in
    STATS_BLOCK_D-wide steps (a decode token's split: 2048, so the row's loads are in flight together
    rather than eight 512-wide steps one after another). DELAYED (hc_pre_delayed): pre is stored too, and
    the streams collapse with prev_pre [T, N] instead."""
    pre = _store_mixings(post_ptr, comb_ptr, pre_ptr, prev_pre_ptr, toks, t_ok, pre, post, comb, store_mixings, ACC, N, N_PAD, DELAYED, HEAD)
    dd = tl.arange(0, BLOCK_D)
    if NORM:
        # The whole row's statistics first (every D split repeats them: a split owns a share of D, the norm
        # needs all of it), of the row rounded to the output dtype, as a separate rms_norm would read it.
        ds = tl.arange(0, STATS_BLOCK_D)
        sq = tl.zeros([BLOCK_T, STATS_BLOCK_D], ACC)
        for d0 in range(0, D, STATS_BLOCK_D):
            d = d0 + ds
            li = _to_out(_collapse(x_ptr, toks, t_ok, pre, d, d < D, D, stride_t, ACC, N, N_PAD), out_ptr, MANUAL_RNE).to(ACC)
            sq += li * li
        inv = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / D + norm_eps)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        d = d0 + dd
        d_ok = d < d_hi
        li = _collapse(x_ptr, toks, t_ok, pre, d, d_ok, D, stride_t, ACC, N, N_PAD)
        if NORM:
            w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(ACC)
            li = _to_out(li, out_ptr, MANUAL_RNE).to(ACC) * inv[:, None] * w[None, :]
        tl.store(out_ptr + toks[:, None] * stride_out + d[None, :], _to_out(li, out_ptr, MANUAL_RNE), mask=t_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["T"])
def _hc_pre_kernel(
    x_ptr, fn_ptr, base_ptr, scale_ptr, w_ptr,
    out_ptr, post_ptr, comb_ptr, pre_ptr, prev_pre_ptr,
    T, D, stride_t, stride_fn, stride_out,
    norm_eps, hc_eps, sinkhorn_iters,
    ACC: tl.constexpr, N: tl.constexpr, MANUAL_RNE: tl.constexpr,
    BLOCK_T: tl.constexpr, W_PAD: tl.constexpr, N_PAD: tl.constexpr, BLOCK_K: tl.constexpr, SEG: tl.constexpr, EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr, STATS_BLOCK_D: tl.constexpr,
    DELAYED: tl.constexpr, W: tl.constexpr, HEAD: tl.constexpr, PDL: tl.constexpr = False,
):
    """The fused launch: one token tile per program, the segments in order, the mixings, the collapse of all of D."""
    pdl_prologue(PDL)
    pid_t = tl.program_id(0)
    toks = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = toks < T
    K = N * D
    acc = tl.zeros([BLOCK_T, W_PAD], ACC)
    ss = tl.zeros([BLOCK_T], ACC)
    for seg in range(0, tl.cdiv(K, SEG)):
        k_lo = seg * SEG
        seg_acc, seg_ss = _segment_partial(
            x_ptr, fn_ptr, toks, t_ok, stride_t, stride_fn, k_lo, tl.minimum(k_lo + SEG, K), ACC, W, BLOCK_T, W_PAD, BLOCK_K, EVEN_K, USE_DOT,
            DOT_PRECISION,
        )
        acc += seg_acc
        ss += seg_ss
    pre, post, comb = _mixings(acc, ss, base_ptr, scale_ptr, K, norm_eps, hc_eps, sinkhorn_iters, ACC, N, BLOCK_T, W_PAD, N_PAD, HEAD)
    _store_mixed(x_ptr, out_ptr, post_ptr, comb_ptr, w_ptr, pre_ptr, prev_pre_ptr, toks, t_ok, pre, post, comb, True, 0, D, D, stride_t, stride_out,
                 norm_eps, ACC, N, N_PAD, MANUAL_RNE, BLOCK_T, BLOCK_D, NORM, STATS_BLOCK_D, DELAYED, HEAD)


@triton.jit
def _summed_partials(part_ptr, part_ss_ptr, toks, t_ok, n_seg, ACC: tl.constexpr, W_PAD: tl.constexpr, SEG_PAD: tl.constexpr):
    """The tokens' projections [BLOCK_T, W_PAD] and sums of squares [BLOCK_T]: all of their segment partials loaded as
    ONE tile (every load in flight at once, not one dependent load per segment), summed with one tl.sum (a fixed tree)."""
    w = tl.arange(0, W_PAD)
    s = tl.arange(0, SEG_PAD)
    rows = toks[:, None] * n_seg + s[None, :]  # [BLOCK_T, SEG_PAD]
    r_ok = t_ok[:, None] & (s < n_seg)[None, :]
    parts = tl.load(part_ptr + rows[:, :, None] * W_PAD + w[None, None, :], mask=r_ok[:, :, None], other=0.0).to(ACC)
    return tl.sum(parts, axis=1), tl.sum(tl.load(part_ss_ptr + rows, mask=r_ok, other=0.0).to(ACC), axis=1)


@triton.jit(do_not_specialize=["T"])
def _hc_pre_combine_kernel(
    x_ptr, base_ptr, scale_ptr, w_ptr, part_ptr, part_ss_ptr,
    out_ptr, post_ptr, comb_ptr, pre_ptr, prev_pre_ptr,
    T, D, n_seg, d_per_split, stride_t, stride_out,
    norm_eps, hc_eps, sinkhorn_iters,
    ACC: tl.constexpr, N: tl.constexpr, MANUAL_RNE: tl.constexpr,
    BLOCK_T: tl.constexpr, W_PAD: tl.constexpr, N_PAD: tl.constexpr, SEG_PAD: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr,
    STATS_BLOCK_D: tl.constexpr, DELAYED: tl.constexpr, HEAD: tl.constexpr, PDL: tl.constexpr = False,
):
    """The split launch's second kernel, grid (token tiles, D splits): each program loads all of its
    tokens' segment partials as one tile, sums them over the segments (one tl.sum: a fixed tree),
    computes the mixings and collapses its share of D; the first D split stores post and comb."""
    pdl_prologue(PDL)
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    toks = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = toks < T
    acc, ss = _summed_partials(part_ptr, part_ss_ptr, toks, t_ok, n_seg, ACC, W_PAD, SEG_PAD)
    pre, post, comb = _mixings(acc, ss, base_ptr, scale_ptr, N * D, norm_eps, hc_eps, sinkhorn_iters, ACC, N, BLOCK_T, W_PAD, N_PAD, HEAD)
    d_lo = pid_d * d_per_split
    _store_mixed(x_ptr, out_ptr, post_ptr, comb_ptr, w_ptr, pre_ptr, prev_pre_ptr, toks, t_ok, pre, post, comb, pid_d == 0, d_lo,
                 tl.minimum(d_lo + d_per_split, D), D, stride_t, stride_out, norm_eps, ACC, N, N_PAD, MANUAL_RNE, BLOCK_T, BLOCK_D, NORM,
                 STATS_BLOCK_D, DELAYED, HEAD)


@triton.jit(do_not_specialize=["T"])
def _hc_pre_row_kernel(
    x_ptr, base_ptr, scale_ptr, w_ptr, part_ptr, part_ss_ptr,
    out_ptr, post_ptr, comb_ptr, pre_ptr, prev_pre_ptr,
    T, D, n_seg, stride_t, stride_out,
    norm_eps, hc_eps, sinkhorn_iters,
    ACC: tl.constexpr, N: tl.constexpr, MANUAL_RNE: tl.constexpr,
    W_PAD: tl.constexpr, N_PAD: tl.constexpr, SEG_PAD: tl.constexpr, D_PAD: tl.constexpr, NORM: tl.constexpr,
    DELAYED: tl.constexpr, HEAD: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr = False,
):
    """The split launch's second kernel in its row form: one token per program, its whole row in registers. The
    collapse is computed once, and with NORM the row's statistics come from registers (the D-split form repeats the
    mixings and re-reads the row in every split). The partials are summed and the mixings computed as the D-split form
    does. The row is loaded after the mixings: held across Sinkhorn's loop it spilled 38 KB a thread (sm90, Triton 3.9);
    the other programs resident on the SM cover its latency. BLOCK_T: 1 on a GPU; 16 under the interpreter (it pays per
    program; every token's sums stay its own, so the bits are the same)."""
    pdl_prologue(PDL)
    toks = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = toks < T
    n = tl.arange(0, N_PAD)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    acc, ss = _summed_partials(part_ptr, part_ss_ptr, toks, t_ok, n_seg, ACC, W_PAD, SEG_PAD)
    pre, post, comb = _mixings(acc, ss, base_ptr, scale_ptr, N * D, norm_eps, hc_eps, sinkhorn_iters, ACC, N, BLOCK_T, W_PAD, N_PAD, HEAD)
    pre = _store_mixings(post_ptr, comb_ptr, pre_ptr, prev_pre_ptr, toks, t_ok, pre, post, comb, True, ACC, N, N_PAD, DELAYED, HEAD)
    xt = tl.load(x_ptr + toks[:, None, None] * stride_t + (n[None, :, None] * D + d[None, None, :]),
                 mask=t_ok[:, None, None] & (n < N)[None, :, None] & d_ok[None, None, :], other=0.0)
    li = tl.sum(xt.to(ACC) * pre[:, :, None], axis=1)  # [BLOCK_T, D_PAD]
    if NORM:
        li = _to_out(li, out_ptr, MANUAL_RNE).to(ACC)  # the row rounded to the output dtype, as a separate rms_norm reads it
        inv = 1.0 / tl.sqrt(tl.sum(li * li, axis=1) / D + norm_eps)
        li = li * inv[:, None] * tl.load(w_ptr + d, mask=d_ok, other=0.0).to(ACC)[None, :]
    tl.store(out_ptr + toks[:, None] * stride_out + d[None, :], _to_out(li, out_ptr, MANUAL_RNE), mask=t_ok[:, None] & d_ok[None, :])


def _manual_rne(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and interpreting()


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_hc_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, norm_weight)


def hc_pre_invariant(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_hc_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, norm_weight, invariant=True)


def hc_pre_delayed(
    x: torch.Tensor,
    prev_pre: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_hc_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, prev_pre=prev_pre)


def hc_pre_delayed_invariant(
    x: torch.Tensor,
    prev_pre: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_hc_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, invariant=True, prev_pre=prev_pre)


def hc_head(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_weight: torch.Tensor, *, norm_eps: float, hc_eps: float
) -> torch.Tensor:
    return launch_hc_pre(x, fn, base, scale, norm_eps, hc_eps, 0, norm_weight, head=True)


def hc_head_invariant(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_weight: torch.Tensor, *, norm_eps: float, hc_eps: float
) -> torch.Tensor:
    return launch_hc_pre(x, fn, base, scale, norm_eps, hc_eps, 0, norm_weight, invariant=True, head=True)


def launch_hc_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, norm_weight=None, *, invariant: bool = False,
                  prev_pre: torch.Tensor | None = None, head: bool = False):
    """hc_pre; invariant: the split launch for every T (deterministic mode). With prev_pre: hc_pre_delayed
    (the same launches; the collapse weighs the streams by prev_pre, and pre is returned too). head: hc_head
    (the same launches with N mixing logits and one scale: pre alone, nothing but the collapse stored)."""
    if head:
        hc_ops.check_hc_head_shapes(x, fn, base, scale, norm_weight)
    else:
        hc_ops.check_hc_pre_shapes(x, fn, base, scale, norm_weight, prev_pre)
    T, N, D = x.shape
    K, W = N * D, N if head else (2 + N) * N
    delayed = prev_pre is not None
    if T == 0 or D == 0:
        if head:
            return hc_ops.hc_head(x, fn, base, scale, norm_weight, norm_eps=norm_eps, hc_eps=hc_eps)
        if delayed:
            return hc_ops.hc_pre_delayed(x, prev_pre, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)
        return hc_ops.hc_pre(x, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters, norm_weight=norm_weight)
    if x.stride(2) != 1 or x.stride(1) != D:
        x = x.contiguous()
    fn = fn if fn.stride(1) == 1 else fn.contiguous()
    base, scale = base.contiguous(), scale.contiguous()
    norm = norm_weight is not None
    weight = norm_weight.contiguous() if norm else base  # base: a placeholder pointer, never read without NORM
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    mix_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32  # the reference's: float32, float64 for float64 x
    # (out: a placeholder pointer for the mixings hc_head does not make, never written with HEAD)
    post = out if head else torch.empty(T, N, dtype=mix_dtype, device=x.device)
    comb = out if head else torch.empty(T, N, N, dtype=mix_dtype, device=x.device)
    pre = torch.empty(T, N, dtype=mix_dtype, device=x.device) if delayed else post  # (post: an unused pointer)
    prev_pre = prev_pre.contiguous() if delayed else post
    w_pad, n_pad = max(16, next_power_of_2(W)), next_power_of_2(N)  # a dot's N >= 16
    interp = interpreting()
    f64 = x.dtype == torch.float64
    common = dict(ACC=_acc(x.dtype), W_PAD=w_pad, N=N, N_PAD=n_pad, MANUAL_RNE=_manual_rne(x.dtype), NORM=norm, DELAYED=delayed, HEAD=head)
    dot = dict(USE_DOT=not f64, DOT_PRECISION=dot_precision(x.dtype), num_warps=_PRE_WARPS)
    # float64: no dot, a smaller broadcast tile. The interpreter: the dot's smallest M (its numpy
    # matmul is slow per element), whole segments per step (it pays per operation and per
    # jit-function call, tl.sum included, not per element).
    fused_t = 8 if f64 else 16 if interp else _PRE_BLOCK_T
    shape = split_shape(T, K, D, num_sms(x.device), invariant=invariant, interp=interp, f64=f64)
    if shape is None:
        # The fused launch's tile (32 tokens) holds no room for the norm's row statistics (sm90: 796 bytes of
        # spills, 10% slower at T 8192 than the norm's own kernel after it): the block's norm runs after it.
        _hc_pre_kernel[(cdiv(T, fused_t),)](
            x, fn, base, scale, weight, out, post, comb, pre, prev_pre,
            T, D, x.stride(0), fn.stride(0), out.stride(0),
            float(norm_eps), float(hc_eps), int(sinkhorn_iters),
            BLOCK_T=fused_t, BLOCK_K=_PRE_SEG if interp else _PRE_BLOCK_K,
            SEG=_PRE_SEG, EVEN_K=K % _PRE_SEG == 0, BLOCK_D=_INTERP_BLOCK_D if interp else _PRE_BLOCK_D,
            num_stages=_PRE_STAGES, STATS_BLOCK_D=_INTERP_BLOCK_D if interp else _PRE_BLOCK_D, W=W, **{**common, "NORM": False}, **dot,
            **pdl_launch(x.device),
        )
        if norm:
            from deepinfer_cuda.kernels.norm import launch_rms_norm

            out = launch_rms_norm(out, norm_weight, norm_eps, None)[0]
        return _results(out, pre, post, comb, delayed, head)
    seg, mix_t, comb_t, block_d, d_splits, row = shape
    n_seg = cdiv(K, seg)
    d_per_split = 0 if row else cdiv(cdiv(D, d_splits), block_d) * block_d
    args = dict(W_PAD=w_pad, N=N, N_PAD=n_pad, ACC=common["ACC"], MANUAL_RNE=common["MANUAL_RNE"], NORM=norm, DELAYED=delayed, HEAD=head)
    for t0 in range(0, T, _SPLIT_MAX_TOKENS):  # bounded partials; a token's numbers do not depend on its chunk
        t1 = min(T, t0 + _SPLIT_MAX_TOKENS)
        xs, rows = x[t0:t1], t1 - t0
        part = torch.empty(rows, n_seg, w_pad, dtype=mix_dtype, device=x.device)
        part_ss = torch.empty(rows, n_seg, dtype=mix_dtype, device=x.device)
        _hc_pre_mix_kernel[(cdiv(rows, mix_t), n_seg)](
            xs, fn, part, part_ss, rows, K, n_seg, xs.stride(0), fn.stride(0),
            ACC=common["ACC"], W=W, BLOCK_T=mix_t, W_PAD=w_pad, BLOCK_K=seg if interp else _SPLIT_BLOCK_K, SEG=seg, EVEN_K=K % seg == 0,
            num_stages=_SPLIT_STAGES, **dot, **pdl_launch(xs.device),
        )
        if row:
            _hc_pre_row_kernel[(cdiv(rows, comb_t),)](
                xs, base, scale, weight, part, part_ss, out[t0:t1], post[t0:t1], comb[t0:t1], pre[t0:t1], prev_pre[t0:t1],
                rows, D, n_seg, xs.stride(0), out.stride(0), float(norm_eps), float(hc_eps), int(sinkhorn_iters),
                SEG_PAD=next_power_of_2(n_seg), D_PAD=next_power_of_2(D), BLOCK_T=comb_t, num_warps=row_warps(D), **args,
                **pdl_launch(xs.device),
            )
            continue
        _hc_pre_combine_kernel[(cdiv(rows, comb_t), cdiv(D, d_per_split))](
            xs, base, scale, weight, part, part_ss, out[t0:t1], post[t0:t1], comb[t0:t1], pre[t0:t1], prev_pre[t0:t1],
            rows, D, n_seg, d_per_split, xs.stride(0), out.stride(0),
            float(norm_eps), float(hc_eps), int(sinkhorn_iters),
            BLOCK_T=comb_t, SEG_PAD=next_power_of_2(n_seg), BLOCK_D=block_d, num_warps=_COMBINE_WARPS, **common,
            STATS_BLOCK_D=block_d if interp else min(_STATS_BLOCK_D // comb_t, next_power_of_2(D)), **pdl_launch(xs.device),
        )
    return _results(out, pre, post, comb, delayed, head)


def _results(out, pre, post, comb, delayed: bool, head: bool):
    """What the op launched returns: hc_head the collapse alone, hc_pre_delayed its own pre too."""
    if head:
        return out
    return (out, pre, post, comb) if delayed else (out, post, comb)


def dot_precision(dtype: torch.dtype) -> str:
    """The projection's dot precision. bfloat16 x (the models') is a bfloat16 dot operand as it is: "bf16x3" (fn
    split into three bfloat16 parts, `bf16x3_dot`) gives float32's products exactly, at the bfloat16 tensor cores'
    rate, here and in the interpreter (on an H100, 2026-12-07, the mix kernels of the 8-layer V4-Flash prefill of
    8 x 8192 tokens took 21.3 ms against tf32x3's 47.4). float16 x is exact in tf32, so "tf32x3" (x * fn_hi + x * fn_lo on the tensor
    cores, fn split into two tf32 parts) gives float32's products within about 2^-22 of each: the float32 FMAs'
    ("ieee") accuracy at tensor-core speed. float32 x keeps "ieee": its own low bits would be dropped."""
    if dtype == torch.bfloat16:
        return "bf16x3_upcast" if upcast_dot() else "bf16x3"
    return "tf32x3" if dtype == torch.float16 and not interpreting() else "ieee"


class SplitShape(NamedTuple):
    """The split launch's shape: the mix's reduction segment and tokens per program; the combine's tokens per program,
    collapse chunk and D splits, or (row) the row form, a token's whole row per program (block_d 0, one split)."""

    seg: int
    mix_t: int
    comb_t: int
    block_d: int
    d_splits: int
    row: bool = False


def row_warps(d: int) -> int:
    """Warps of a row-form combine program: its row's N x D streams in registers (16-bit: N * D / (32 * warps) words)."""
    return 4 if next_power_of_2(d) <= 4096 else 8


def split_shape(T: int, K: int, D: int, sms: int, *, invariant: bool, interp: bool, f64: bool) -> SplitShape | None:
    """The launch shape for T tokens of K = N*D inputs: None for the fused launch (K within one fused segment: small
    models; never in deterministic mode), else the split launch's: the mix's segment and tile from `_SPLIT_BUCKETS` by
    T (deterministic mode: the first bucket at every T, so a token's numbers do not depend on the batch), the row
    combine where the row fits in registers (`_ROW_MAX_D`), else the D-split combine. Host-known shapes only
    (CUDA-graph safe); `sms` sets the D-split combine's splits."""
    if not invariant and K <= _PRE_SEG:
        return None
    seg, mix_t = next((seg, t) for most, seg, t in _SPLIT_BUCKETS if invariant or most is None or T <= most)
    seg = max(seg, split_segment(K))
    if f64:  # (a test dtype: the broadcast product's smaller tile)
        mix_t = 8
    if next_power_of_2(D) <= _ROW_MAX_D:
        return SplitShape(seg, mix_t, 16 if interp else 1, 0, 1, row=True)
    comb_t = 16 if interp else 1
    block_d = _INTERP_BLOCK_D if interp else _SPLIT_BLOCK_D
    # the interpreter repeats the mixings in at most two D splits (it pays per operation)
    d_splits = max(1, min(cdiv(D, block_d), 2 if interp else cdiv(_PRE_FILL * sms, cdiv(T, comb_t))))
    return SplitShape(seg, mix_t, comb_t, block_d, d_splits)


def split_segment(k: int) -> int:
    """The split launch's reduction segment for K = N*D: `_SPLIT_SEG`, doubled until at most
    `_SPLIT_MAX_SEGMENTS` segments remain (the combine holds them all in one tile). A fact of the model."""
    seg = _SPLIT_SEG
    while cdiv(k, seg) > _SPLIT_MAX_SEGMENTS:
        seg *= 2
    return seg


@triton.jit(do_not_specialize=["T"])
def _hc_post_kernel(
    y_ptr, x_ptr, post_ptr, comb_ptr, out_ptr,
    T, D, stride_y, stride_x, stride_out,
    ACC: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, MANUAL_RNE: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    toks = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = toks < T
    k = tl.arange(0, N_PAD)
    k_ok = k < N
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    td_ok = t_ok[:, None] & d_ok[None, :]
    tk_ok = t_ok[:, None] & k_ok[None, :]
    y = tl.load(y_ptr + toks[:, None] * stride_y + d[None, :], mask=td_ok, other=0.0).to(ACC)
    post = tl.load(post_ptr + toks[:, None] * N + k[None, :], mask=tk_ok, other=0.0).to(ACC)
    out = post[:, :, None] * y[:, None, :]
    for j in tl.static_range(N):
        xj = tl.load(x_ptr + toks[:, None] * stride_x + (j * D + d)[None, :], mask=td_ok, other=0.0).to(ACC)
        cj = tl.load(comb_ptr + toks[:, None] * (N * N) + (j * N + k)[None, :], mask=tk_ok, other=0.0).to(ACC)
        out += cj[:, :, None] * xj[:, None, :]
    tl.store(out_ptr + toks[:, None, None] * stride_out + (k[:, None] * D + d[None, :])[None, :, :], _to_out(out, out_ptr, MANUAL_RNE),
             mask=tk_ok[:, :, None] & d_ok[None, None, :])


def _check_hc_post_shapes(y, x, post, comb) -> None:
    # deepinfer.ops.hyper_connection has no shared check for hc_post: the reference's own test, verbatim.
    if x.dim() != 3 or y.shape != (x.shape[0], x.shape[2]) or post.shape != x.shape[:2] or comb.shape != (x.shape[0], x.shape[1], x.shape[1]):
        raise ValueError(
            "hc_post wants y [T, D], x [T, N, D], post [T, N], comb [T, N, N]; "
            f"got {tuple(y.shape)}, {tuple(x.shape)}, {tuple(post.shape)}, {tuple(comb.shape)}"
        )


def hc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    _check_hc_post_shapes(y, x, post, comb)
    T, N, D = x.shape
    out = torch.empty(T, N, D, dtype=x.dtype, device=x.device)
    if T == 0 or D == 0:
        return out
    if x.stride(2) != 1 or x.stride(1) != D:
        x = x.contiguous()
    y = y if y.stride(1) == 1 else y.contiguous()
    post, comb = post.contiguous(), comb.contiguous()
    n_pad = next_power_of_2(N)
    block_d = min(next_power_of_2(D), _POST_MAX_BLOCK_D)
    block_t = max(1, min(next_power_of_2(T), _POST_TILE // (n_pad * block_d)))
    _hc_post_kernel[(cdiv(T, block_t), cdiv(D, block_d))](
        y, x, post, comb, out, T, D, y.stride(0), x.stride(0), out.stride(0),
        ACC=_acc(x.dtype), N=N, N_PAD=n_pad, BLOCK_T=block_t, BLOCK_D=block_d, MANUAL_RNE=_manual_rne(x.dtype), num_warps=_POST_WARPS, **pdl_launch(y.device),
    )
    return out


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

REGISTRATIONS = [
    Registration(
        op="hc_pre",
        fn=hc_pre,
        dtypes=_DTYPES,
        note="Triton: token tiles, one pass for norm + projection, Sinkhorn in registers, collapse; split-K partials for few tokens",
    ),
    Registration(
        op="hc_pre",
        fn=hc_pre_invariant,
        dtypes=_DTYPES,
        priority=-1,
        batch_invariant=True,
        note="Triton: token tiles, one pass for norm + projection, Sinkhorn in registers, collapse; split-K partials for every token count",
    ),
    Registration(
        op="hc_pre_delayed",
        fn=hc_pre_delayed,
        dtypes=_DTYPES,
        note="Triton: hc_pre's launches, pre stored, the collapse weighted by the previous site's pre (V4.1's single-pass mHC)",
    ),
    Registration(
        op="hc_pre_delayed",
        fn=hc_pre_delayed_invariant,
        dtypes=_DTYPES,
        priority=-1,
        batch_invariant=True,
        note="Triton: hc_pre's split launch for every token count, pre stored, the collapse weighted by the previous site's pre",
    ),
    Registration(
        op="hc_head",
        fn=hc_head,
        dtypes=_DTYPES,
        note="Triton: hc_pre's launches with the head's N mixing logits, pre alone, the collapse normed (split launch) or then rms_norm (fused)",
    ),
    Registration(
        op="hc_head",
        fn=hc_head_invariant,
        dtypes=_DTYPES,
        priority=-1,
        batch_invariant=True,
        note="Triton: hc_pre's split launch for every token count with the head's N mixing logits, pre alone, the collapse normed",
    ),
    Registration(
        op="hc_post",
        fn=hc_post,
        dtypes=_DTYPES,
        note="Triton: (token, D) tiles, post * y + comb-mixed streams in one pass",
        batch_invariant=True,  # elementwise per output (see the module docstring)
    ),
]
