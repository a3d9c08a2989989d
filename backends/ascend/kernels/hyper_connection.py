"""Ascend Triton kernels: hc_pre, hc_pre_delayed, hc_head and hc_post (DeepSeek-V4's manifold-constrained hyper-connections).

hc_pre_delayed (DeepSeek-V4.1's single-pass hyper-connections) runs hc_pre's launches with DELAYED on:
the mixings are computed alike and `pre` is stored beside post and comb, while the collapse weighs the
streams by the previous site's pre (prev_pre [T, N], loaded where hc_pre uses its own).

hc_head (the head's collapse before the final norm) runs them with HEAD on: W = N mixing logits (fn has
N rows) and one scale, so the mixings are `pre` alone (post and comb are neither made nor stored), and
the norm is always folded in; it returns the normed collapse.

hc_pre, per token t (x_t: N streams of D, flattened to K = N*D; W = (2+N)N mixing logits):

    m[t, w] = rsqrt(mean(x_t^2) + norm_eps) * sum_k x_t[k] * fn[w, k]

then pre = sigmoid, post = 2 sigmoid, comb = row softmax + Sinkhorn-Knopp on the N x N block, and
layer_input[t] = sum_n pre[t, n] * x[t, n]. The norm factors out of the dot, so one pass over x_t
yields both the sum of squares and the W projections; the mixings are computed on the vector unit
in the tile's own buffer; a second pass over x_t collapses the streams (pre needs the whole dot).
W = 24 (V4-Flash) is too narrow for the cube unit and float32 must stay exact: the projection is
a vector broadcast multiply, kept as a [BLOCK_T, W_PAD, BLOCK_K] accumulator (one multiply-add
per chunk, no per-chunk reduction) that is reduced once per segment.

A tile is BLOCK_T tokens, so each fn chunk [W_PAD, BLOCK_K] brought into the unified buffer
serves all of them. K is cut into segments of SEG elements; a segment's partial is its
accumulator's lane sums (chunks in order) reduced over the lanes. Two launch shapes, both
persistent vector grids (`vector_grid`, each program looping over its work items):

  * fused (at least as many token tiles as vector cores, or K within one 1024-wide segment): one
    kernel per token tile does the projection over all segments (SEG = 1024, added in order), the
    mixings and the collapse.
  * split (decode, and deterministic mode at every T): `_hc_pre_mix_kernel` over (token tile,
    segment) items with SEG = 256, one segment per item (64 items per tile for V4-Flash's K = 16384,
    enough to keep 48-64 vector cores busy at T = 1, where the 1024-wide segments gave 16), writes
    every segment's partial (float32 [T, segments, W_PAD] and the sum of squares [T, segments]);
    `_hc_pre_kernel` over (token tile, D range) items loads a tile's partials as one block
    [BLOCK_T, segments, W_PAD] (32 KB), sums them over the segments at once, recomputes the mixings
    in every D range (a few hundred vector operations), stores post/comb from the first one and
    collapses its range of D. SEG doubles for K past 64 segments (a fact of the model).

The two shapes sum in different orders, so their numbers differ in the last bits.

With `norm_weight` (the block's RMSNorm folded in: no rms_norm launch after hc_pre), the collapse
runs twice over a tile's rows: first over all of D for the sum of squares of the rows rounded to the
output dtype (every D range repeats it), then over the item's own range, storing
round(round(li) * rstd * weight) as rms_norm would.

The N x N block is taken out of the W_PAD logits by a masked sum (exact) and reshaped to
[BLOCK_T, N_PAD, N_PAD]; padding (N not a power of two) is masked to zero so Sinkhorn's sums see
only the N x N block. float32 math; layer_input rounded to nearest even (`to_output`); post and
comb stored float32.

Buffer budget (half the unified buffer, `tile_elems`): the projection keeps ~3 float32 values per
accumulator element (accumulator, product, the fn chunk and x chunk amortised): 12 bytes x
BLOCK_T x W_PAD x BLOCK_K; the collapse ~4 per [BLOCK_T, N_PAD, BLOCK_D] element (x in its dtype
and float32, the product) -> 16 bytes. With BLOCK_T = 4, W_PAD = 32, N_PAD = 4: BLOCK_K = 64 and
BLOCK_D = 256 on A2/A3 (BLOCK_D = 512 on 950). Under the interpreter (no buffer; it pays per
operation, not per element) a chunk is a whole segment, the collapse steps are 2048 wide and at
most two D ranges repeat the mixings.

Deterministic mode (`hc_pre_invariant`, and `hc_head_invariant` with HEAD): the split launch for every T. Its kernels are the same
for every T: BLOCK_T = 4, the split SEG and the chunk widths are fixed by the model's shapes and
the chip; T only sets the items (which program computes a segment or a D range). Cost: prefill
writes and re-reads the segment partials (segments * W_PAD float32 per token, 8 KB for V4-Flash):
small next to x's two passes.

`hc_post_invariant`: hc_post's elements are sums over j in a fixed order whatever the tile, but
its BLOCK_T follows T, and calls with other T would run other compiled kernels whose FMA
contraction of `out += c * x` need not agree; the invariant kernel fixes BLOCK_T by D and the chip.

hc_post: out[t, k] = post[t, k] * y[t] + sum_j comb[t, j, k] * x[t, j]: memory-bound, persistent
grid over (token tile, D tile) items; each reads y and the N streams of its tile once and writes
the N output streams; the sum over j runs in order j = 0..N-1. Budget ~16 bytes per output element.

float64 inputs (a test dtype; no float64 on the vector units) and tensors of 2**31 elements or
more (int32 index arithmetic) go to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops import hyper_connection as hc_ops
from deepinfer.triton_common import cdiv, interpreting, next_power_of_2, sinkhorn_mix
from deepinfer_ascend.device import current
from deepinfer_ascend.kernels.common import Registration, launch_options, tile_elems, to_output, vector_grid

_INT32_LIMIT = 2**31
_BLOCK_T = 4  # tokens per hc_pre tile (fixed: a token's numbers do not depend on the batch)
_SEG = 1024  # the fused launch's reduction segment
_SPLIT_SEG = 256  # the split launch's: one (token tile, segment) item each, 64 items per tile for K = 16384
_SPLIT_MAX_SEGMENTS = 64  # longer K doubles the split segment: the combine's [BLOCK_T, segments, W_PAD] block stays 32 KB
_MIX_BYTES_PER_ELEM = 12
_COLLAPSE_BYTES_PER_ELEM = 16
_POST_BYTES_PER_ELEM = 16
_INTERP_BLOCK_D = 2048  # collapse chunk under the interpreter
_POST_MAX_BLOCK_D = 1024


@triton.jit
def _segment_partial(
    x_ptr, fn_ptr, toks, t_ok, stride_t, stride_fn, k_lo, k_hi,
    W: tl.constexpr, BLOCK_T: tl.constexpr, W_PAD: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    """(sum_k x[t, k] fn[w, k], sum_k x[t, k]^2) over k in [k_lo, k_hi)."""
    w = tl.arange(0, W_PAD)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_T, W_PAD, BLOCK_K], tl.float32)
    sq = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    x_ptrs = x_ptr + toks[:, None] * stride_t + (k_lo + kk)[None, :]
    f_ptrs = fn_ptr + w[:, None] * stride_fn + (k_lo + kk)[None, :]
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:  # whole chunks: token / row masks only
            xt = tl.load(x_ptrs, mask=t_ok[:, None], other=0.0).to(tl.float32)
            ft = tl.load(f_ptrs, mask=(w < W)[:, None], other=0.0).to(tl.float32)
        else:
            k_ok = k0 + kk < k_hi
            xt = tl.load(x_ptrs, mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            ft = tl.load(f_ptrs, mask=(w < W)[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += xt[:, None, :] * ft[None, :, :]
        sq += xt * xt
        x_ptrs += BLOCK_K
        f_ptrs += BLOCK_K
    return tl.sum(acc, axis=2), tl.sum(sq, axis=1)


@triton.jit
def _hc_pre_mix_kernel(
    x_ptr, fn_ptr, part_ptr, part_ss_ptr,
    T, K, n_seg, stride_t, stride_fn,
    W: tl.constexpr, BLOCK_T: tl.constexpr, W_PAD: tl.constexpr, BLOCK_K: tl.constexpr, SEG: tl.constexpr, EVEN_K: tl.constexpr,
):
    """(token tile, segment) items: each segment's partial at row t * n_seg + seg of part [T, n_seg, W_PAD], part_ss [T, n_seg]."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_items = tl.cdiv(T, BLOCK_T) * n_seg
    w = tl.arange(0, W_PAD)
    for item in range(pid, n_items, nprog):
        toks = (item // n_seg) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = toks < T
        seg = item % n_seg
        k_lo = seg * SEG
        acc, ss = _segment_partial(x_ptr, fn_ptr, toks, t_ok, stride_t, stride_fn, k_lo, tl.minimum(k_lo + SEG, K), W, BLOCK_T, W_PAD, BLOCK_K, EVEN_K)
        row = toks * n_seg + seg
        tl.store(part_ptr + row[:, None] * W_PAD + w[None, :], acc, mask=t_ok[:, None])
        tl.store(part_ss_ptr + row, ss, mask=t_ok)


@triton.jit
def _mixings(
    acc, ss, base_ptr, scale_ptr, K, norm_eps, hc_eps, sinkhorn_iters,
    N: tl.constexpr, BLOCK_T: tl.constexpr, W_PAD: tl.constexpr, N_PAD: tl.constexpr, HEAD: tl.constexpr,
):
    """pre [BLOCK_T, N_PAD], post [BLOCK_T, N_PAD], comb [BLOCK_T, N_PAD, N_PAD] from the raw
    projections acc [BLOCK_T, W_PAD] and the sums of squares ss [BLOCK_T] (padding: zeros).
    HEAD (hc_head: N logits, one scale): pre alone; post and comb are pre again, placeholders never stored."""
    rstd = 1.0 / tl.sqrt(ss / K + norm_eps)
    m = acc * rstd[:, None]
    w = tl.arange(0, W_PAD)
    n = tl.arange(0, N_PAD)
    n_ok = n < N
    s0 = tl.load(scale_ptr)
    m_pre = tl.sum(tl.where((w[None, :] == n[:, None])[None, :, :], m[:, None, :], 0.0), axis=2)
    b_pre = tl.load(base_ptr + n, mask=n_ok, other=0.0)
    pre = tl.where(n_ok[None, :], 1.0 / (1.0 + tl.exp(-(m_pre * s0 + b_pre[None, :]))) + hc_eps, 0.0)
    if HEAD:
        post = pre
        comb = pre
    else:
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        m_post = tl.sum(tl.where((w[None, :] == (N + n)[:, None])[None, :, :], m[:, None, :], 0.0), axis=2)
        b_post = tl.load(base_ptr + N + n, mask=n_ok, other=0.0)
        post = 2.0 / (1.0 + tl.exp(-(m_post * s1 + b_post[None, :])))
        # comb: logits 2N + i*N + j -> flat e = i*N_PAD + j -> [BLOCK_T, N_PAD, N_PAD]
        e = tl.arange(0, N_PAD * N_PAD)
        e_ok = (e // N_PAD < N) & (e % N_PAD < N)
        col = 2 * N + (e // N_PAD) * N + e % N_PAD
        m_comb = tl.sum(tl.where(((w[None, :] == col[:, None]) & e_ok[:, None])[None, :, :], m[:, None, :], 0.0), axis=2)
        b_comb = tl.load(base_ptr + col, mask=e_ok, other=0.0)
        z = tl.reshape(m_comb * s2 + b_comb[None, :], [BLOCK_T, N_PAD, N_PAD])
        comb = sinkhorn_mix(z, n_ok, hc_eps, sinkhorn_iters)
    return pre, post, comb


@triton.jit
def _collapse(x_ptr, toks, t_ok, pre, d, d_ok, D, stride_t, N: tl.constexpr, N_PAD: tl.constexpr):
    """sum_n pre[t, n] * x[t, n, d] over the chunk d of the tile's tokens [BLOCK_T, BLOCK_D], float32 (zeros where masked)."""
    n = tl.arange(0, N_PAD)
    xt = tl.load(x_ptr + toks[:, None, None] * stride_t + (n[None, :, None] * D + d[None, None, :]),
                 mask=t_ok[:, None, None] & (n < N)[None, :, None] & d_ok[None, None, :], other=0.0).to(tl.float32)
    return tl.sum(xt * pre[:, :, None], axis=1)


@triton.jit
def _hc_pre_kernel(
    x_ptr, fn_ptr, base_ptr, scale_ptr, w_ptr, part_ptr, part_ss_ptr,
    out_ptr, post_ptr, comb_ptr, pre_ptr, prev_pre_ptr,
    T, D, n_seg, d_per_split, n_splits, stride_t, stride_fn, stride_out,
    norm_eps, hc_eps, sinkhorn_iters,
    FUSED: tl.constexpr, N: tl.constexpr,
    BLOCK_T: tl.constexpr, W_PAD: tl.constexpr, N_PAD: tl.constexpr, BLOCK_K: tl.constexpr, SEG: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_D: tl.constexpr,
    SEG_PAD: tl.constexpr, NORM: tl.constexpr,
    DELAYED: tl.constexpr,  # hc_pre_delayed: pre stored too, the streams collapsed by prev_pre [T, N]
    W: tl.constexpr,  # mixing logits: (2 + N) * N, or N for hc_head
    HEAD: tl.constexpr,  # hc_head: pre alone, no post or comb stored
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_items = tl.cdiv(T, BLOCK_T) * n_splits
    K = N * D
    w = tl.arange(0, W_PAD)
    s = tl.arange(0, SEG_PAD)
    n = tl.arange(0, N_PAD)
    n_ok = n < N
    nn_ok = (n_ok[:, None] & n_ok[None, :])[None, :, :]
    ij = (n[:, None] * N + n[None, :])[None, :, :]
    dd = tl.arange(0, BLOCK_D)
    for item in range(pid, n_items, nprog):
        toks = (item // n_splits) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = toks < T
        split = item % n_splits
        if FUSED:  # the segments in order
            acc = tl.zeros([BLOCK_T, W_PAD], tl.float32)
            ss = tl.zeros([BLOCK_T], tl.float32)
            for seg in range(0, tl.cdiv(K, SEG)):
                k_lo = seg * SEG
                seg_acc, seg_ss = _segment_partial(
                    x_ptr, fn_ptr, toks, t_ok, stride_t, stride_fn, k_lo, tl.minimum(k_lo + SEG, K), W, BLOCK_T, W_PAD, BLOCK_K, EVEN_K
                )
                acc += seg_acc
                ss += seg_ss
        else:  # the tile's partials as one block [BLOCK_T, SEG_PAD, W_PAD], summed over the segments at once
            rows = toks[:, None] * n_seg + s[None, :]
            r_ok = t_ok[:, None] & (s < n_seg)[None, :]
            acc = tl.sum(tl.load(part_ptr + rows[:, :, None] * W_PAD + w[None, None, :], mask=r_ok[:, :, None], other=0.0), axis=1)
            ss = tl.sum(tl.load(part_ss_ptr + rows, mask=r_ok, other=0.0), axis=1)
        pre, post, comb = _mixings(acc, ss, base_ptr, scale_ptr, K, norm_eps, hc_eps, sinkhorn_iters, N, BLOCK_T, W_PAD, N_PAD, HEAD)
        if not HEAD:
            if split == 0:
                tl.store(post_ptr + toks[:, None] * N + n[None, :], post, mask=t_ok[:, None] & n_ok[None, :])
                tl.store(comb_ptr + toks[:, None, None] * (N * N) + ij, comb, mask=t_ok[:, None, None] & nn_ok)
                if DELAYED:
                    tl.store(pre_ptr + toks[:, None] * N + n[None, :], pre, mask=t_ok[:, None] & n_ok[None, :])
        if DELAYED:
            pre = tl.load(prev_pre_ptr + toks[:, None] * N + n[None, :], mask=t_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        if NORM:
            # The whole row's statistics first (every D range repeats them), of the row rounded to the output
            # dtype, as a separate rms_norm would read it.
            sq = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
            for d0 in range(0, D, BLOCK_D):
                d = d0 + dd
                li = to_output(_collapse(x_ptr, toks, t_ok, pre, d, d < D, D, stride_t, N, N_PAD), out_ptr).to(tl.float32)
                sq += li * li
            inv = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / D + norm_eps)
        d_lo = split * d_per_split
        d_hi = tl.minimum(d_lo + d_per_split, D)
        for d0 in range(d_lo, d_hi, BLOCK_D):
            d = d0 + dd
            d_ok = d < d_hi
            li = _collapse(x_ptr, toks, t_ok, pre, d, d_ok, D, stride_t, N, N_PAD)
            if NORM:
                wt = tl.load(w_ptr + d, mask=d_ok, other=0.0)
                li = to_output(li, out_ptr).to(tl.float32) * inv[:, None] * wt[None, :]
            tl.store(out_ptr + toks[:, None] * stride_out + d[None, :], to_output(li, out_ptr), mask=t_ok[:, None] & d_ok[None, :])


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
    return _hc_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, norm_weight, invariant=False)


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
    return _hc_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, norm_weight, invariant=True)


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
    return _hc_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, None, invariant=False, prev_pre=prev_pre)


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
    return _hc_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, None, invariant=True, prev_pre=prev_pre)


def hc_head(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_weight: torch.Tensor, *, norm_eps: float, hc_eps: float
) -> torch.Tensor:
    return _hc_pre(x, fn, base, scale, norm_eps, hc_eps, 0, norm_weight, invariant=False, head=True)


def hc_head_invariant(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_weight: torch.Tensor, *, norm_eps: float, hc_eps: float
) -> torch.Tensor:
    return _hc_pre(x, fn, base, scale, norm_eps, hc_eps, 0, norm_weight, invariant=True, head=True)


def _hc_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, norm_weight, invariant, prev_pre=None, head=False):
    """invariant: the split launch for every T. With prev_pre: hc_pre_delayed (the same launches; the
    collapse weighs the streams by prev_pre, and pre is returned too). head: hc_head (the same launches
    with N mixing logits and one scale: pre alone, nothing but the normed collapse stored and returned)."""
    if head:
        hc_ops.check_hc_head_shapes(x, fn, base, scale, norm_weight)
    else:
        hc_ops.check_hc_pre_shapes(x, fn, base, scale, norm_weight, prev_pre)
    T, N, D = x.shape
    K, W = N * D, N if head else (2 + N) * N
    delayed = prev_pre is not None
    if x.dtype == torch.float64 or T == 0 or D == 0 or x.numel() >= _INT32_LIMIT or T * next_power_of_2(W) * cdiv(K, _SPLIT_SEG) >= _INT32_LIMIT:
        if head:
            return hc_ops.hc_head(x, fn, base, scale, norm_weight, norm_eps=norm_eps, hc_eps=hc_eps)
        if delayed:
            return hc_ops.hc_pre_delayed(x, prev_pre, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)
        return hc_ops.hc_pre(x, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters, norm_weight=norm_weight)
    if x.stride(2) != 1 or x.stride(1) != D:
        x = x.contiguous()
    fn = fn if fn.stride(1) == 1 else fn.contiguous()
    base, scale = base.to(torch.float32).contiguous(), scale.to(torch.float32).contiguous()
    weight = base if norm_weight is None else norm_weight.to(torch.float32).contiguous()  # base: a placeholder, never read without NORM
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    # (out: a placeholder pointer for the mixings hc_head does not make, never written with HEAD)
    post = out if head else torch.empty(T, N, dtype=torch.float32, device=x.device)
    comb = out if head else torch.empty(T, N, N, dtype=torch.float32, device=x.device)
    pre = torch.empty(T, N, dtype=torch.float32, device=x.device) if delayed else post  # (post: an unused pointer)
    prev_pre = prev_pre.to(torch.float32).contiguous() if delayed else post
    w_pad, n_pad = next_power_of_2(W), next_power_of_2(N)
    tiles = cdiv(T, _BLOCK_T)
    cores = current().num_vectorcore
    fused = not invariant and (K <= _SEG or tiles >= cores)
    seg = _SEG if fused else _SPLIT_SEG
    while not fused and cdiv(K, seg) > _SPLIT_MAX_SEGMENTS:  # a fact of the model
        seg *= 2
    n_seg = cdiv(K, seg)
    # the interpreter pays per operation, not per element (and has no buffer limit): whole segments
    block_k = seg if interpreting() else max(8, min(seg, tile_elems(_MIX_BYTES_PER_ELEM) // (_BLOCK_T * w_pad)))
    block_d = max(8, min(next_power_of_2(D), _INTERP_BLOCK_D if interpreting() else tile_elems(_COLLAPSE_BYTES_PER_ELEM) // (_BLOCK_T * n_pad)))
    common = dict(BLOCK_T=_BLOCK_T, W_PAD=w_pad, BLOCK_K=block_k, SEG=seg, EVEN_K=K % seg == 0)
    if fused:
        part = part_ss = post  # unused
        d_splits, d_per_split = 1, D
    else:
        part = torch.empty(T, n_seg, w_pad, dtype=torch.float32, device=x.device)
        part_ss = torch.empty(T, n_seg, dtype=torch.float32, device=x.device)
        _hc_pre_mix_kernel[(vector_grid(tiles * n_seg),)](x, fn, part, part_ss, T, K, n_seg, x.stride(0), fn.stride(0), W=W, **common, **launch_options())
        # every D range repeats the mixings (cheap on the device; the interpreter pays per call: two)
        d_splits = max(1, min(cdiv(cores, tiles), cdiv(D, block_d), 2 if interpreting() else D))
        d_per_split = cdiv(cdiv(D, d_splits), block_d) * block_d
        d_splits = cdiv(D, d_per_split)
    _hc_pre_kernel[(vector_grid(tiles * d_splits),)](
        x, fn, base, scale, weight, part, part_ss, out, post, comb, pre, prev_pre,
        T, D, n_seg, d_per_split, d_splits, x.stride(0), fn.stride(0), out.stride(0),
        float(norm_eps), float(hc_eps), int(sinkhorn_iters),
        FUSED=fused, N=N, N_PAD=n_pad, BLOCK_D=block_d, SEG_PAD=1 if fused else next_power_of_2(n_seg), NORM=norm_weight is not None,
        DELAYED=delayed, W=W, HEAD=head, **common, **launch_options(),
    )
    if head:
        return out
    return (out, pre, post, comb) if delayed else (out, post, comb)


@triton.jit
def _hc_post_kernel(
    y_ptr, x_ptr, post_ptr, comb_ptr, out_ptr,
    T, D, stride_y, stride_x, stride_out,
    N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    d_tiles = tl.cdiv(D, BLOCK_D)
    n_tiles = tl.cdiv(T, BLOCK_T) * d_tiles
    k = tl.arange(0, N_PAD)
    k_ok = k < N
    for tile in range(pid, n_tiles, nprog):
        toks = (tile // d_tiles) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = toks < T
        d = (tile % d_tiles) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = d < D
        td_ok = t_ok[:, None] & d_ok[None, :]
        tk_ok = t_ok[:, None] & k_ok[None, :]
        y = tl.load(y_ptr + toks[:, None] * stride_y + d[None, :], mask=td_ok, other=0.0).to(tl.float32)
        post = tl.load(post_ptr + toks[:, None] * N + k[None, :], mask=tk_ok, other=0.0)
        out = post[:, :, None] * y[:, None, :]
        for j in tl.static_range(N):
            xj = tl.load(x_ptr + toks[:, None] * stride_x + (j * D + d)[None, :], mask=td_ok, other=0.0).to(tl.float32)
            cj = tl.load(comb_ptr + toks[:, None] * (N * N) + (j * N + k)[None, :], mask=tk_ok, other=0.0)
            out += cj[:, :, None] * xj[:, None, :]
        tl.store(out_ptr + toks[:, None, None] * stride_out + (k[:, None] * D + d[None, :])[None, :, :], to_output(out, out_ptr),
                 mask=tk_ok[:, :, None] & d_ok[None, None, :])


def _check_hc_post_shapes(y, x, post, comb) -> None:
    # deepinfer.ops.hyper_connection has no shared check for hc_post: the reference's own test, verbatim.
    if x.dim() != 3 or y.shape != (x.shape[0], x.shape[2]) or post.shape != x.shape[:2] or comb.shape != (x.shape[0], x.shape[1], x.shape[1]):
        raise ValueError(
            "hc_post wants y [T, D], x [T, N, D], post [T, N], comb [T, N, N]; "
            f"got {tuple(y.shape)}, {tuple(x.shape)}, {tuple(post.shape)}, {tuple(comb.shape)}"
        )


def hc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    return _hc_post(y, x, post, comb, invariant=False)


def hc_post_invariant(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    return _hc_post(y, x, post, comb, invariant=True)


def _hc_post(y, x, post, comb, invariant):
    """invariant: BLOCK_T is the most tokens the buffer takes, whatever T (deterministic mode)."""
    _check_hc_post_shapes(y, x, post, comb)
    T, N, D = x.shape
    if x.dtype == torch.float64 or x.numel() >= _INT32_LIMIT:
        return hc_ops.hc_post(y, x, post, comb)
    out = torch.empty(T, N, D, dtype=x.dtype, device=x.device)
    if T == 0 or D == 0:
        return out
    if x.stride(2) != 1 or x.stride(1) != D:
        x = x.contiguous()
    y = y if y.stride(1) == 1 else y.contiguous()
    post, comb = post.to(torch.float32).contiguous(), comb.to(torch.float32).contiguous()
    n_pad = next_power_of_2(N)
    elems = tile_elems(_POST_BYTES_PER_ELEM) // n_pad
    block_d = max(8, min(next_power_of_2(D), _POST_MAX_BLOCK_D, elems))
    block_t = max(1, elems // block_d if invariant else min(next_power_of_2(T), elems // block_d))
    n_tiles = cdiv(T, block_t) * cdiv(D, block_d)
    _hc_post_kernel[(vector_grid(n_tiles),)](
        y, x, post, comb, out, T, D, y.stride(0), x.stride(0), out.stride(0),
        N=N, N_PAD=n_pad, BLOCK_T=block_t, BLOCK_D=block_d, **launch_options(),
    )
    return out


REGISTRATIONS = [
    Registration(
        op="hc_pre",
        fn=hc_pre,
        note="Triton (ascend): persistent vector grid, token tiles, norm + projection in one pass, Sinkhorn on the vector unit, split-K for few tokens",
    ),
    Registration(
        op="hc_pre",
        fn=hc_pre_invariant,
        priority=-1,
        batch_invariant=True,
        note="Triton (ascend): the kernels above, always the split launch (segment partials summed in order), never chosen by T",
    ),
    Registration(
        op="hc_pre_delayed",
        fn=hc_pre_delayed,
        note="Triton (ascend): hc_pre's kernels, pre stored, the collapse weighted by the previous site's pre (V4.1's single-pass mHC)",
    ),
    Registration(
        op="hc_pre_delayed",
        fn=hc_pre_delayed_invariant,
        priority=-1,
        batch_invariant=True,
        note="Triton (ascend): hc_pre's split launch for every token count, pre stored, the collapse weighted by the previous site's pre",
    ),
    Registration(
        op="hc_head",
        fn=hc_head,
        note="Triton (ascend): hc_pre's kernels with the head's N mixing logits, pre alone, the collapse normed in the same pass",
    ),
    Registration(
        op="hc_head",
        fn=hc_head_invariant,
        priority=-1,
        batch_invariant=True,
        note="Triton (ascend): hc_pre's split launch for every token count with the head's N mixing logits, pre alone, the collapse normed",
    ),
    Registration(
        op="hc_post",
        fn=hc_post,
        note="Triton (ascend): persistent vector grid, (token, D) tiles, post * y + comb-mixed streams in one pass",
    ),
    Registration(
        op="hc_post",
        fn=hc_post_invariant,
        priority=-1,
        batch_invariant=True,
        note="Triton (ascend): the kernel above with BLOCK_T fixed by D and the buffer (not by T)",
    ),
]
