"""Triton kernels: `sample` (greedy / temperature / top-k / top-p / min-p, stateless Gumbel noise) and
`apply_token_bitmask`.

sample: one program per row, no sort of the vocabulary, no host synchronisation, every row with its
  own parameters (temperature >= 0: a negative temperature is outside the op's meaning).

  Pass 1 (rows that are greedy or filtered) streams the row once in BLOCK-wide tiles and keeps, per
    lane, the running maximum and its first index: the row maximum M and the greedy token (lowest
    index among the maxima). A greedy row is done.
  Pass 2 streams the row again: the softmax normaliser S = sum exp(z - zmax) (z = logits /
    temperature, IEEE division as torch's) and, in the same pass, gathers the candidates
    C = {v : logits[v] >= L} into a per-row scratch (order: increasing index), counting them and
    keeping the largest logit left outside. L is a lower bound of the kept set computed from what
    pass 1 saw: the top_k-th largest of N_GROUPS group maxima (maxima of groups of lanes: distinct
    elements, so at least top_k logits are >= it; one bitonic sort of N_GROUPS keys), else of the
    BLOCK lane maxima by bisection, and/or the min-p bound zmax + log(min_p) (minus a margin).
    Rows with top-p but no top-k need S first: their bound is the largest group (else lane) maximum
    whose groups' probability mass already reaches top_p, and a pass 3 gathers C and sums every p
    (the top-p renormaliser). Streaming loops issue the next tile's loads before this tile's math.
  Exact phase on C (from the scratch, L1/L2 resident): the reference's rules, bit for bit in
    their float32 arithmetic. Up to TILE_C candidates: one sort of their keys (descending) in
    registers gives the top_k-th largest logit directly and the reference's cumulative sum of the
    sorted q (float64, rounded to float32, compared with top_p) and so the top-p threshold; more
    candidates (up to BLOCK): the thresholds by bisection over the ordered integer image of float32
    (the result is an element's value, so ties behave as the reference's `>=`). Then the argmax of
    z + Gumbel noise over the kept candidates (noise: the stateless hash of `sampling_uniform`,
    computed in-kernel in uint32; ties to the lowest index). The result is exact iff nothing
    outside C is kept: the kernel checks that by evaluating the three rules at the largest logit
    outside C (each rule is monotone in the logit).
  Fallback (rare: more than BLOCK candidates, e.g. top-p alone on a very flat distribution, or the
    check failed): the same exact phase over the whole row, each bisection step one pass over it.
  Unfiltered rows (temperature > 0, no filter) take one pass: argmax of z + noise over the row.

  The top-p rule: with q sorted descending, the prefix ends at the first q whose cumulative sum
  reaches top_p, and everything >= its value is kept. Equivalently the threshold is the largest
  element value t with sum(q >= t) >= top_p (the sum of a tie group is reached at its end). The
  reference's CPU cumsum accumulates in float64 and rounds each prefix to float32; the kernel sums
  in float64 and rounds once, comparing round32(mass) >= top_p the same way.

  Residual differences from the reference (documented, not hidden): the kernel's exp and log are
  libdevice's (<= 1-2 ulp), the reference's are torch's vectorised CPU (SLEEF) ones, and the
  softmax sum S and the top-p renormaliser are accumulated in a different order. p and q can
  therefore differ in the last bit, which changes a token only when a filter boundary (top-p
  cumulative mass within ~1e-7 of top_p, p within 1 ulp of min_p * max p) or the Gumbel argmax
  (two perturbed values within 1 ulp) is that close; z, the noise u, top-k and greedy are exact.

apply_token_bitmask: one program per (row, vocabulary block), in place; the word's bit (v % 32) is
  read with an arithmetic shift and `& 1`, which is right for bit 31 (the sign bit) as well.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from deepinfer_cuda.kernels.common import Registration, interpreting
from deepinfer_cuda.kernels.precise_math import precise_exp as _exp
from deepinfer_cuda.kernels.precise_math import precise_log as _log
from deepinfer_cuda.tuning import config

_MIN_KEY = tl.constexpr(-(2**31))
_MAX_KEY = tl.constexpr(2**31 - 1)


# ---------------------------------------------------------------------------------------------
# float helpers


@triton.jit
def _okey(x):
    """float32 -> int32 whose order is the floats' order (-0.0 maps to +0.0's key)."""
    b = x.to(tl.int32, bitcast=True)
    k = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
    return tl.where(x == 0.0, 0, k)


@triton.jit
def _from_key(k):
    b = tl.where(k >= 0, k, k ^ 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _p_of(x, td, zmax, r, LIBDEVICE: tl.constexpr):
    # The reference: z = logits / t; p = exp(z - max z) * (1 / sum) (torch's CPU softmax).
    z = tl.math.div_rn(x, td)
    return _exp(z - zmax, LIBDEVICE) * r


@triton.jit
def _mix(x):
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0xD35A2D97
    return x ^ (x >> 15)


@triton.jit
def _row_hash(seed, pos):
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    pl = (pos & 0xFFFFFFFF).to(tl.uint32)
    h = _mix(lo + 0x9E3779B9)
    h = _mix(h ^ hi)
    return _mix(h ^ pl)


@triton.jit
def _gumbel(rowhash, idx, LIBDEVICE: tl.constexpr):
    h = _mix(rowhash ^ idx.to(tl.uint32))
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23: exact
    return -_log(-_log(u, LIBDEVICE), LIBDEVICE)


# ---------------------------------------------------------------------------------------------
# the exact rules over a source of elements: the whole row, or the candidate scratch


@triton.jit
def _src(x_ptr, i_ptr, start, n, FROM_BUF: tl.constexpr, TILE: tl.constexpr):
    offs = start + tl.arange(0, TILE)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=float("-inf"))
    if FROM_BUF:
        idx = tl.load(i_ptr + offs, mask=ok, other=0)
    else:
        idx = offs
    return x, idx, ok


@triton.jit
def _count_ge(x_ptr, n, kthr, TILE: tl.constexpr):
    c = tl.sum(tl.zeros([TILE], dtype=tl.int32), axis=0)
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        ok = offs < n
        x = tl.load(x_ptr + offs, mask=ok, other=float("-inf"))
        c += tl.sum((ok & (_okey(x) >= kthr)).to(tl.int32), axis=0)
    return c


@triton.jit
def _mass_ge(x_ptr, n, kthr, tk_key, td, zmax, r, Q, TILE: tl.constexpr, LIBDEVICE: tl.constexpr):
    """round32(sum of q over elements with key >= max(kthr, tk_key)), summed in float64."""
    acc = tl.zeros([TILE], dtype=tl.float64)
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        ok = offs < n
        x = tl.load(x_ptr + offs, mask=ok, other=float("-inf"))
        key = _okey(x)
        q = tl.math.div_rn(_p_of(x, td, zmax, r, LIBDEVICE), Q)
        acc += tl.where(ok & (key >= kthr) & (key >= tk_key), q, 0.0).to(tl.float64)
    return tl.sum(acc, axis=0).to(tl.float32)


@triton.jit
def _out_is_kept(out_max, tk_key, tp, tp_on, thr, m_on, td, zmax, r, Q, LIBDEVICE: tl.constexpr):
    """Whether the largest logit outside the source would be kept (the rules are monotone in the logit)."""
    kept = _okey(out_max) >= tk_key
    p_out = _p_of(out_max, td, zmax, r, LIBDEVICE)
    kept = kept & ((tp_on == 0) | (tl.math.div_rn(p_out, Q) >= tp))
    kept = kept & ((m_on == 0) | (p_out >= thr))
    return kept & (out_max > float("-inf"))


@triton.jit
def _pick(x, idx, ok, best, best_idx, tk_key, tp, tp_on, Q, thr, p_on, m_on, td, zmax, r, rowhash, LIBDEVICE: tl.constexpr):
    """Fold a tile into the running argmax of z + g over the kept elements (lowest index on ties)."""
    keep = ok & (_okey(x) >= tk_key)
    if p_on | m_on:
        p = _p_of(x, td, zmax, r, LIBDEVICE)
        if tp_on:
            keep = keep & (tl.math.div_rn(p, Q) >= tp)
        if m_on:
            keep = keep & (p >= thr)
    val = tl.where(keep, tl.math.div_rn(x, td) + _gumbel(rowhash, idx, LIBDEVICE), float("-inf"))
    tmax = tl.max(val, axis=0)
    tidx = tl.min(tl.where(keep & (val == tmax), idx, _MAX_KEY), axis=0)
    better = (tmax > best) | ((tmax == best) & (tidx < best_idx))
    return tl.where(better, tmax, best), tl.where(better, tidx, best_idx)


@triton.jit
def _exact(
    x_ptr, i_ptr, n, V, M, td, zmax, r, Q_all, rowhash,
    k, k_on, top_p, p_on, min_p, m_on, out_max,
    FROM_BUF: tl.constexpr, TILE: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """Apply the reference's rules to the source's elements (any number, TILE at a time); return
    (token, exact). exact: nothing outside the source is kept (checked at out_max, the largest
    logit outside it). Thresholds by bisection over float keys, one pass over the source per step.
    """
    # key range of the source (bisection bounds)
    kmin = tl.sum(tl.zeros([TILE], dtype=tl.int32), axis=0) + _MAX_KEY
    kmax = tl.sum(tl.zeros([TILE], dtype=tl.int32), axis=0) + _MIN_KEY
    if k_on | p_on:
        for start in range(0, n, TILE):
            x, idx, ok = _src(x_ptr, i_ptr, start, n, FROM_BUF, TILE)
            key = _okey(x)
            kmin = tl.minimum(kmin, tl.min(tl.where(ok, key, _MAX_KEY), axis=0))
            kmax = tl.maximum(kmax, tl.max(tl.where(ok, key, _MIN_KEY), axis=0))

    # keep_k: logits >= the k-th largest (its key, found by bisection: the largest key with
    # count(>= key) >= k is an element's key). Fewer than k elements here: all of them are in the
    # row's top k (the source is an upper set of the row).
    tk_key = kmin * 0 + _MIN_KEY
    if k_on & (n >= k):
        lo = kmin.to(tl.int64)
        hi = kmax.to(tl.int64)
        while lo < hi:
            mid = lo + ((hi - lo + 1) >> 1)
            good = _count_ge(x_ptr, n, mid.to(tl.int32), TILE) >= k
            lo = tl.where(good, mid, lo)
            hi = tl.where(good, hi, mid - 1)
        tk_key = lo.to(tl.int32)

    # keep_p: q = p / Q over keep_k; threshold = q(x*) for the largest logit x* with
    # round32(sum of q over logits >= x*) >= top_p (q is monotone in the logit, so this is the
    # largest q value whose mass reaches top_p). None: every q is kept.
    Q = Q_all
    tp_on = p_on & (p_on == 0)  # False, as a tensor
    tp = zmax * 0.0
    if p_on:
        if k_on:
            acc = tl.zeros([TILE], dtype=tl.float64)
            for start in range(0, n, TILE):
                x, idx, ok = _src(x_ptr, i_ptr, start, n, FROM_BUF, TILE)
                p = _p_of(x, td, zmax, r, LIBDEVICE)
                acc += tl.where(ok & (_okey(x) >= tk_key), p, 0.0).to(tl.float64)
            Q = tl.sum(acc, axis=0).to(tl.float32)
        lo = tl.maximum(kmin, tk_key).to(tl.int64)
        hi = kmax.to(tl.int64)
        if _mass_ge(x_ptr, n, lo.to(tl.int32), tk_key, td, zmax, r, Q, TILE, LIBDEVICE) >= top_p:
            while lo < hi:
                mid = lo + ((hi - lo + 1) >> 1)
                good = _mass_ge(x_ptr, n, mid.to(tl.int32), tk_key, td, zmax, r, Q, TILE, LIBDEVICE) >= top_p
                lo = tl.where(good, mid, lo)
                hi = tl.where(good, hi, mid - 1)
            tp = tl.math.div_rn(_p_of(_from_key(lo.to(tl.int32)), td, zmax, r, LIBDEVICE), Q)
            tp_on = p_on

    # keep_m: p >= min_p * max p (max p = p at the row maximum)
    thr = min_p * _p_of(M, td, zmax, r, LIBDEVICE)

    # argmax of z + g over the kept elements (the next tile's loads issued before this one's math)
    best = zmax * 0.0 + float("-inf")
    best_idx = kmin * 0 + _MAX_KEY
    xn, idn, okn = _src(x_ptr, i_ptr, 0, n, FROM_BUF, TILE)
    for start in range(0, n, TILE):
        x, idx, ok = xn, idn, okn
        xn, idn, okn = _src(x_ptr, i_ptr, start + TILE, n, FROM_BUF, TILE)
        best, best_idx = _pick(x, idx, ok, best, best_idx, tk_key, tp, tp_on, Q, thr, p_on, m_on, td, zmax, r, rowhash, LIBDEVICE)
    # every kept value -inf (or nothing kept): the reference's argmax over all -inf is index 0
    token = tl.where(best == float("-inf"), 0, best_idx)
    exact = _out_is_kept(out_max, tk_key, tp, tp_on, thr, m_on, td, zmax, r, Q, LIBDEVICE) == 0
    return token, exact


@triton.jit
def _exact_sorted(
    cx, ci, n, M, td, zmax, r, Q_all, rowhash,
    k, k_on, top_p, p_on, min_p, m_on, out_max,
    TILE: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """`_exact` for at most TILE candidates held in registers: one sort of their keys (descending)
    gives the k-th largest directly and the reference's cumulative sum over sorted q exactly."""
    pos = tl.arange(0, TILE)
    ok = pos < n
    x = tl.load(cx + pos, mask=ok, other=float("-inf"))
    idx = tl.load(ci + pos, mask=ok, other=0)
    key = _okey(x)
    skey = tl.sort(tl.where(ok, key, _MIN_KEY), descending=True)  # padding sorts last
    tk_key = n * 0 + _MIN_KEY
    if k_on & (n >= k):
        tk_key = tl.max(tl.where(pos == k - 1, skey, _MIN_KEY), axis=0)
    Q = Q_all
    tp_on = p_on & (p_on == 0)  # False, as a tensor
    tp = zmax * 0.0
    if p_on:
        if k_on:
            p = _p_of(x, td, zmax, r, LIBDEVICE)
            Q = tl.sum(tl.where(ok & (key >= tk_key), p, 0.0).to(tl.float64), axis=0).to(tl.float32)
        # the reference: below = #(cumsum(q sorted) < top_p); threshold = q_sorted[below]
        sq = tl.math.div_rn(_p_of(_from_key(skey), td, zmax, r, LIBDEVICE), Q)
        sq = tl.where(ok & (skey >= tk_key), sq, 0.0)
        cs = tl.cumsum(sq.to(tl.float64), axis=0).to(tl.float32)
        below = tl.sum((ok & (cs < top_p)).to(tl.int32), axis=0)
        if below < n:  # the prefix ends inside the candidates (else: q all kept)
            tp = tl.max(tl.where(pos == below, sq, -1.0), axis=0)
            tp_on = p_on
    thr = min_p * _p_of(M, td, zmax, r, LIBDEVICE)
    best = zmax * 0.0 + float("-inf")
    best_idx = n * 0 + _MAX_KEY
    best, best_idx = _pick(x, idx, ok, best, best_idx, tk_key, tp, tp_on, Q, thr, p_on, m_on, td, zmax, r, rowhash, LIBDEVICE)
    token = tl.where(best == float("-inf"), 0, best_idx)
    exact = _out_is_kept(out_max, tk_key, tp, tp_on, thr, m_on, td, zmax, r, Q, LIBDEVICE) == 0
    return token, exact


@triton.jit
def _gather_tile(x, offs, ok, L, n_c, out_max, cx, ci, CAP: tl.constexpr):
    """Append the tile's elements >= L to the candidate scratch (in index order)."""
    sel = ok & (x >= L)
    cnt = tl.sum(sel.to(tl.int32), axis=0)
    if cnt > 0:
        pos = n_c + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        w = sel & (pos < CAP)
        tl.store(cx + pos, x, mask=w)
        tl.store(ci + pos, offs, mask=w)
    out_max = tl.maximum(out_max, tl.max(tl.where(ok & (sel == 0), x, float("-inf")), axis=0))
    return n_c + cnt, out_max


@triton.jit
def _sample_kernel(
    logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr,
    out_ptr, cx_ptr, ci_ptr, path_ptr,
    V,
    BLOCK: tl.constexpr,
    TILE_C: tl.constexpr,
    N_GROUPS: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    RECORD_PATH: tl.constexpr,
):
    row = tl.program_id(0)
    lp = logits_ptr + row.to(tl.int64) * stride_row
    cx = cx_ptr + row.to(tl.int64) * BLOCK
    ci = ci_ptr + row.to(tl.int64) * BLOCK
    temp = tl.load(temp_ptr + row)
    k = tl.load(topk_ptr + row)
    top_p = tl.load(topp_ptr + row)
    min_p = tl.load(minp_ptr + row)
    rowhash = _row_hash(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
    greedy = temp == 0.0
    td = tl.where(greedy, 1.0, temp)
    k_on = (k > 0) & (k < V)
    p_on = top_p < 1.0
    m_on = min_p > 0.0
    filtered = k_on | p_on | m_on
    lanes = tl.arange(0, BLOCK)
    gpos = tl.arange(0, N_GROUPS)
    zero_i = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), axis=0)
    neg_inf = td * 0.0 + float("-inf")

    token = zero_i
    path = zero_i  # for tests: 0 greedy, 1 unfiltered, 2 candidates (exact), 3 whole-row fallback
    full = (greedy == 0) & (filtered == 0)  # unfiltered: one pass of argmax(z + g) over the row
    M = neg_inf
    zmax = td * 0.0
    r = td * 0.0 + 1.0
    Q_all = td * 0.0 + 1.0
    if greedy | filtered:
        # pass 1: lane maxima (first index per lane), row maximum, greedy token; the next tile's
        # loads are issued before this tile's compares (two tiles in flight per thread)
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_idx = tl.zeros([BLOCK], dtype=tl.int32)
        xn = tl.load(lp + lanes, mask=lanes < V, other=float("-inf"))
        for start in range(0, V, BLOCK):
            offs = start + lanes
            x = xn
            xn = tl.load(lp + offs + BLOCK, mask=offs + BLOCK < V, other=float("-inf"))
            up = x > lane_max
            lane_idx = tl.where(up, offs, lane_idx)
            lane_max = tl.where(up, x, lane_max)
        M = tl.max(lane_max, axis=0)
        arg = tl.min(tl.where(lane_max == M, lane_idx, _MAX_KEY), axis=0)
        token = tl.where(M == float("-inf"), 0, arg)
        if (greedy == 0) & (M > float("-inf")):
            zmax = tl.math.div_rn(M, td)
            lkey = _okey(lane_max)
            # group maxima: N_GROUPS distinct elements of the row, sorted (descending keys)
            gkey = tl.sort(tl.max(tl.reshape(lkey, [N_GROUPS, BLOCK // N_GROUPS]), axis=1), descending=True)
            Lk = neg_inf
            if k_on & (k <= N_GROUPS):
                # the k-th largest group maximum: >= k distinct elements are >= it
                Lk = _from_key(tl.max(tl.where(gpos == k - 1, gkey, _MIN_KEY), axis=0))
            elif k_on & (k <= BLOCK):
                # the k-th largest lane maximum, by bisection
                lo = tl.min(lkey, axis=0).to(tl.int64)
                hi = tl.max(lkey, axis=0).to(tl.int64)
                while lo < hi:
                    mid = lo + ((hi - lo + 1) >> 1)
                    good = tl.sum((lkey >= mid.to(tl.int32)).to(tl.int32), axis=0) >= k
                    lo = tl.where(good, mid, lo)
                    hi = tl.where(good, hi, mid - 1)
                Lk = _from_key(lo.to(tl.int32))
            Lm = neg_inf
            if m_on:
                # p >= min_p * max p  <=>  z >= zmax + log(min_p), up to rounding: a small margin
                zlo = zmax + _log(min_p, LIBDEVICE)
                zlo = zlo - 1e-4 * (1.0 + tl.abs(zlo))
                Lm = tl.minimum(zlo * td, M)
            defer = p_on & (k_on == 0)
            L = tl.where(k_on & p_on, Lk, tl.maximum(Lk, Lm))
            gather = (defer == 0) & ((L > float("-inf")) | (V <= BLOCK))
            need_s = p_on | m_on
            # pass 2: softmax normaliser (and the candidates when L is already known)
            s_acc = tl.zeros([BLOCK], dtype=tl.float32)
            n_c = zero_i
            out_max = neg_inf
            if need_s | gather:
                xn = tl.load(lp + lanes, mask=lanes < V, other=float("-inf"))
                for start in range(0, V, BLOCK):
                    offs = start + lanes
                    ok = offs < V
                    x = xn
                    xn = tl.load(lp + offs + BLOCK, mask=offs + BLOCK < V, other=float("-inf"))
                    if need_s:
                        s_acc += _exp(tl.math.div_rn(x, td) - zmax, LIBDEVICE)
                    if gather:
                        n_c, out_max = _gather_tile(x, offs, ok, L, n_c, out_max, cx, ci, BLOCK)
            if need_s:
                r = tl.math.div_rn(td * 0.0 + 1.0, tl.sum(s_acc, axis=0))
            if defer:
                # top-p without top-k: the largest group (else lane) maximum whose groups' (lanes')
                # mass reaches top_p
                gp = tl.where(gkey > _MIN_KEY, _p_of(_from_key(gkey), td, zmax, r, LIBDEVICE), 0.0)
                gbelow = tl.sum((tl.cumsum(gp, axis=0) < top_p).to(tl.int32), axis=0)
                Lp = neg_inf
                if gbelow < N_GROUPS:
                    Lp = _from_key(tl.max(tl.where(gpos == gbelow, gkey, _MIN_KEY), axis=0))
                else:
                    lane_p = _p_of(lane_max, td, zmax, r, LIBDEVICE)
                    lo = tl.min(lkey, axis=0).to(tl.int64)
                    hi = tl.max(lkey, axis=0).to(tl.int64)
                    if tl.sum(lane_p, axis=0) >= top_p:
                        while lo < hi:
                            mid = lo + ((hi - lo + 1) >> 1)
                            good = tl.sum(tl.where(lkey >= mid.to(tl.int32), lane_p, 0.0), axis=0) >= top_p
                            lo = tl.where(good, mid, lo)
                            hi = tl.where(good, hi, mid - 1)
                        Lp = _from_key(lo.to(tl.int32))
                L = tl.maximum(Lp, Lm)
                gather = (L > float("-inf")) | (V <= BLOCK)
                # pass 3: the top-p renormaliser over the whole row, and the candidates
                q_acc = tl.zeros([BLOCK], dtype=tl.float64)
                xn = tl.load(lp + lanes, mask=lanes < V, other=float("-inf"))
                for start in range(0, V, BLOCK):
                    offs = start + lanes
                    ok = offs < V
                    x = xn
                    xn = tl.load(lp + offs + BLOCK, mask=offs + BLOCK < V, other=float("-inf"))
                    q_acc += _p_of(x, td, zmax, r, LIBDEVICE).to(tl.float64)
                    if gather:
                        n_c, out_max = _gather_tile(x, offs, ok, L, n_c, out_max, cx, ci, BLOCK)
                Q_all = tl.sum(q_acc, axis=0).to(tl.float32)
            exact = gather & (gather == 0)  # False
            if gather & (n_c <= BLOCK):
                tl.debug_barrier()  # the scratch was written by every thread of the program
                if n_c <= TILE_C:
                    tok_c, exact = _exact_sorted(
                        cx, ci, n_c, M, td, zmax, r, Q_all, rowhash, k, k_on, top_p, p_on, min_p, m_on, out_max,
                        TILE_C, LIBDEVICE,
                    )
                else:
                    tok_c, exact = _exact(
                        cx, ci, n_c, V, M, td, zmax, r, Q_all, rowhash, k, k_on, top_p, p_on, min_p, m_on, out_max,
                        True, TILE_C, LIBDEVICE,
                    )
                token = tok_c
                path = zero_i + 2
            full = exact == 0
    if full:
        tok_f, exact_f = _exact(
            lp, lp, V, V, M, td, zmax, r, Q_all, rowhash, k, k_on, top_p, p_on, min_p, m_on, neg_inf,
            False, BLOCK, LIBDEVICE,
        )
        token = tok_f
        path = tl.where(filtered, 3, 1)
    tl.store(out_ptr + row, token.to(tl.int64))
    if RECORD_PATH:
        tl.store(path_ptr + row, path)


@lru_cache(maxsize=None)
def _cfg(op: str, variant: str, device: torch.device) -> dict:
    return config(op, variant, device)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    return _sample(logits, temperature, top_k, top_p, min_p, seeds, positions)


def _sample(logits, temperature, top_k, top_p, min_p, seeds, positions, *, block=None, tile_c=None, n_groups=None, num_warps=None, paths=None):
    """`sample`, with the tile sizes overridable and the path each row took recorded (for tests)."""
    B, V = logits.shape
    device = logits.device
    out = torch.empty(B, dtype=torch.int64, device=device)
    if B == 0:
        return out
    x = logits if logits.dtype == torch.float32 else logits.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = _cfg("sample", "rows", device)
    block = block or cfg["BLOCK"]
    cx = torch.empty(B, block, dtype=torch.float32, device=device)
    ci = torch.empty(B, block, dtype=torch.int32, device=device)
    _sample_kernel[(B,)](
        x, x.stride(0),
        temperature.to(torch.float32).contiguous(),
        top_k.clamp(-1, V).to(torch.int32).contiguous(),  # >= V is off either way; no int32 wrap-around
        top_p.to(torch.float32).contiguous(),
        min_p.to(torch.float32).contiguous(),
        seeds.to(torch.int64).contiguous(),
        positions.to(torch.int64).contiguous(),
        out, cx, ci, paths if paths is not None else out, V,
        BLOCK=block, TILE_C=tile_c or cfg["TILE_C"], N_GROUPS=min(n_groups or cfg["N_GROUPS"], block), LIBDEVICE=not interpreting(), RECORD_PATH=paths is not None,
        num_warps=num_warps or cfg["num_warps"],
    )
    return out


# ---------------------------------------------------------------------------------------------
# apply_token_bitmask


@triton.jit
def _bitmask_kernel(logits_ptr, mask_ptr, V, W, stride_l, stride_m, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    word = tl.load(mask_ptr + row * stride_m + offs // 32, mask=ok, other=-1)
    allowed = ((word >> (offs % 32)) & 1) != 0  # arithmetic shift: bit 31 reads right too
    neg = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_l + offs, neg, mask=ok & (allowed == 0))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    if tuple(bitmask.shape) != (rows, (vocab + 31) // 32):
        raise ValueError(f"bitmask has shape {tuple(bitmask.shape)}, expected ({rows}, {(vocab + 31) // 32}) for logits {tuple(logits.shape)}")
    if rows == 0 or vocab == 0:
        return logits
    if logits.stride(-1) != 1:
        # in place on a non-unit-stride view: fill a contiguous copy, write it back
        tmp = logits.contiguous()
        apply_token_bitmask(tmp, bitmask)
        return logits.copy_(tmp)
    m = bitmask if bitmask.stride(-1) == 1 else bitmask.contiguous()
    if m.dtype != torch.int32:
        m = m.to(torch.int32)
    cfg = _cfg("apply_token_bitmask", "rows", logits.device)
    block = cfg["BLOCK"]
    _bitmask_kernel[(rows, triton.cdiv(vocab, block))](
        logits, m, vocab, m.shape[1], logits.stride(0), m.stride(0), BLOCK=block, num_warps=cfg["num_warps"],
    )
    return logits


REGISTRATIONS = [
    Registration(op="sample", fn=sample, note="Triton (no sort: bisection on float keys over gathered candidates, in-kernel hash noise)"),
    Registration(op="apply_token_bitmask", fn=apply_token_bitmask, note="Triton (in place)"),
]
