"""Triton kernels: `sample` (greedy / temperature / top-k / top-p / min-p, stateless Gumbel noise) and
`apply_token_bitmask`.

sample: no sort of the vocabulary, no host synchronisation (the decode step is captured in a CUDA
  graph), every row with its own parameters (temperature >= 0: a negative temperature is outside the
  op's meaning). Each row is cut into NCH = cdiv(V, BLOCK) equal chunks (a multiple of 16 logits,
  at most BLOCK), chosen from V and the device's configuration only, never from the batch; each
  chunk is read once from memory into registers and computed alone. The chunk passes run a bounded
  number of programs (the tuning entry's pass1_programs / filter_programs, PASS2_PROGRAMS), a row's
  chunks shared out among its programs, so the batch size decides which program computes a chunk,
  never what it computes. Five launches:

  Pass 1, two kernels, grid B x G each: `_sample_pass1_argmax` (greedy and unfiltered rows, few
    registers, the next chunk's load issued before this one's work) and `_sample_pass1_filter`
    (filtered rows; optionally prefetching the same way); each returns at once for the other kind
    of row. One kernel for both held the filter's registers, so greedy rows streamed at its
    occupancy (2.4 TB/s against 4.1 for greedy's work alone on the H200). Per chunk: greedy rows:
    its maximum and first argmax. Unfiltered rows
    (temperature > 0, no filter): its argmax of z + Gumbel noise (z = logits / temperature, IEEE
    division as torch's; noise: the stateless hash of `sampling_uniform`, computed in-kernel in
    uint32; ties to the lowest index). Filtered rows: its maximum; the maxima of N_GROUPS strided
    groups (distinct elements of the row, stored for the plan); for top-p / min-p its partial
    softmax sum s_c = sum exp(z - z_c) relative to the chunk's own max z_c; and, when a bound
    local to the chunk exists, the chunk's candidates: its finite logits >= L_c, written in index
    order to the chunk's segment of SEG slots, with their count (past SEG: overflow) and the
    largest logit left out. L_c: top-k <= N_GROUPS: the k-th largest of the chunk's group maxima
    (k elements of the chunk are >= it, so no logit of the chunk below it reaches the row's k-th
    largest); min-p without top-p: also z_c + log(min_p) (minus a margin), below the row's min-p bound
    because z_c <= zmax.
  Plan (one program per row): greedy and unfiltered rows take the lowest index among the chunks
    reaching the maximum: done. Filtered rows: M, zmax, S = sum_c s_c * exp(z_c - zmax) (the
    rescale in float64), r = 1 / S, and the row's bound L from all chunks' group maxima, as
    before: the k-th largest (bisection over keys), and/or the min-p bound zmax + log(min_p)
    (minus a margin); top-p without top-k: the largest group maximum whose group maxima's mass
    already reaches top_p. If pass 1 gathered the row and no segment overflowed, L is raised to
    the largest L_c used (L >= every L_c, so the logits >= L are all in the segments: the
    candidates stay an upper set of the row's finite logits); else pass 2 gathers at L.
  Pass 2 (grid B x G, only rows that need it: top-p without top-k, top-k > N_GROUPS, an
    overflowed segment): the chunk's finite logits >= L into its segment, and for top-p without
    top-k the chunk's sum of p in float64 (the top-p renormaliser, summed over chunks in the
    finish). A row in pass 2 reads its logits twice; a top-k row once.
  Finish (one program per filtered row): the segments' logits >= L, compacted in index order into
    the row's candidate list C = {v : logits[v] >= L, finite} (at most CAP), and the exact phase
    on C (from the workspace, L1/L2 resident). -inf logits are never candidates: they can be kept
    only when fewer than top_k logits are finite (then every finite one is kept, which C with
    fewer than k elements gives) and their z + g is -inf, so they never change the token.
  Exact phase on C: the reference's rules, bit for bit in their float32 arithmetic. Up to TILE_C
    candidates: one sort of their keys (descending) in registers gives the top_k-th largest logit
    directly and the reference's cumulative sum of the sorted q (float64, rounded to float32,
    compared with top_p) and so the top-p threshold; more candidates (up to CAP): the thresholds
    by bisection over the ordered integer image of float32 (the result is an element's value, so
    ties behave as the reference's `>=`). Then the argmax of z + Gumbel noise over the kept
    candidates. The result is exact iff nothing outside C is kept: the kernel checks that by
    evaluating the three rules at the largest logit outside C (each rule is monotone in the logit).
  Fallback (rare: a segment overflowed in pass 2, more than CAP candidates, e.g. top-p alone on a
    very flat distribution, or the check failed): the same exact phase over the whole row, each
    bisection step one pass over it.

  The top-p rule: with q sorted descending, the prefix ends at the first q whose cumulative sum
  reaches top_p, and everything >= its value is kept. Equivalently the threshold is the largest
  element value t with sum(q >= t) >= top_p (the sum of a tie group is reached at its end). The
  reference's CPU cumsum accumulates in float64 and rounds each prefix to float32; the kernel sums
  in float64 and rounds once, comparing round32(mass) >= top_p the same way.

  Residual differences from the reference (documented, not hidden): the kernel's exp and log are
  libdevice's (<= 1-2 ulp), the reference's are torch's vectorised CPU (SLEEF) ones, and the
  softmax sum S and the top-p renormaliser are accumulated in a different order: S per chunk
  (a float32 tree sum of exp(z - z_c)) and rescaled by exp(z_c - zmax) in float64, the
  renormaliser per chunk in float64. p and q can therefore differ in the last bit, which changes a
  token only when a filter boundary (top-p cumulative mass within ~1e-7 of top_p, p within 1 ulp of
  min_p * max p) or the Gumbel argmax (two perturbed values within 1 ulp) is that close; z, the
  noise u, top-k and greedy are exact. The chunking depends on V and the configuration only, so a
  row's token never depends on the batch; another configuration (BLOCK) can move such a boundary
  case, as another summation order would.

apply_token_bitmask: one program per (row, vocabulary block), in place; the word's bit (v % 32) is
  read with an arithmetic shift and `& 1`, which is right for bit 31 (the sign bit) as well.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from deepinfer.triton_common import from_order_key, hash_uniform, interpreting, order_key, row_hash
from deepinfer_cuda.kernels.common import Registration, pdl_launch, pdl_prologue
from deepinfer_cuda.kernels.precise_math import precise_exp as _exp
from deepinfer_cuda.kernels.precise_math import precise_log as _log
from deepinfer_cuda.tuning import config

_MIN_KEY = tl.constexpr(-(2**31))
_MAX_KEY = tl.constexpr(2**31 - 1)


# ---------------------------------------------------------------------------------------------
# float helpers


@triton.jit
def _p_of(x, td, zmax, r, LIBDEVICE: tl.constexpr):
    # The reference: z = logits / t; p = exp(z - max z) * (1 / sum) (torch's CPU softmax).
    z = tl.math.div_rn(x, td)
    return _exp(z - zmax, LIBDEVICE) * r


@triton.jit
def _gumbel(rowhash, idx, LIBDEVICE: tl.constexpr):
    """g = -log(-log(u)), u the shared hash's uniform (`sampling_uniform`) of this row and index."""
    u = hash_uniform(rowhash, idx)
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
        c += tl.sum((ok & (order_key(x) >= kthr)).to(tl.int32), axis=0)
    return c


@triton.jit
def _mass_ge(x_ptr, n, kthr, tk_key, td, zmax, r, Q, TILE: tl.constexpr, LIBDEVICE: tl.constexpr):
    """round32(sum of q over elements with key >= max(kthr, tk_key)), summed in float64."""
    acc = tl.zeros([TILE], dtype=tl.float64)
    for start in range(0, n, TILE):
        offs = start + tl.arange(0, TILE)
        ok = offs < n
        x = tl.load(x_ptr + offs, mask=ok, other=float("-inf"))
        key = order_key(x)
        q = tl.math.div_rn(_p_of(x, td, zmax, r, LIBDEVICE), Q)
        acc += tl.where(ok & (key >= kthr) & (key >= tk_key), q, 0.0).to(tl.float64)
    return tl.sum(acc, axis=0).to(tl.float32)


@triton.jit
def _out_is_kept(out_max, tk_key, tp, tp_on, thr, m_on, td, zmax, r, Q, LIBDEVICE: tl.constexpr):
    """Whether the largest logit outside the source would be kept (the rules are monotone in the logit)."""
    kept = order_key(out_max) >= tk_key
    p_out = _p_of(out_max, td, zmax, r, LIBDEVICE)
    kept = kept & ((tp_on == 0) | (tl.math.div_rn(p_out, Q) >= tp))
    kept = kept & ((m_on == 0) | (p_out >= thr))
    return kept & (out_max > float("-inf"))


@triton.jit
def _pick(x, idx, ok, best, best_idx, tk_key, tp, tp_on, Q, thr, p_on, m_on, td, zmax, r, rowhash, LIBDEVICE: tl.constexpr):
    """Fold a tile into the running argmax of z + g over the kept elements (lowest index on ties)."""
    keep = ok & (order_key(x) >= tk_key)
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
            key = order_key(x)
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
                acc += tl.where(ok & (order_key(x) >= tk_key), p, 0.0).to(tl.float64)
            Q = tl.sum(acc, axis=0).to(tl.float32)
        lo = tl.maximum(kmin, tk_key).to(tl.int64)
        hi = kmax.to(tl.int64)
        if _mass_ge(x_ptr, n, lo.to(tl.int32), tk_key, td, zmax, r, Q, TILE, LIBDEVICE) >= top_p:
            while lo < hi:
                mid = lo + ((hi - lo + 1) >> 1)
                good = _mass_ge(x_ptr, n, mid.to(tl.int32), tk_key, td, zmax, r, Q, TILE, LIBDEVICE) >= top_p
                lo = tl.where(good, mid, lo)
                hi = tl.where(good, hi, mid - 1)
            tp = tl.math.div_rn(_p_of(from_order_key(lo.to(tl.int32)), td, zmax, r, LIBDEVICE), Q)
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
    key = order_key(x)
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
        sq = tl.math.div_rn(_p_of(from_order_key(skey), td, zmax, r, LIBDEVICE), Q)
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


# ---------------------------------------------------------------------------------------------
# the chunked passes: workspace layout (one float32, one int32 and one float64 region per row)
#
# float32, per row (WF elements): planes of NCH chunk values
#   [0, NCH)        chunk max logit (greedy / filtered rows) or best z + g (unfiltered rows)
#   [NCH, 2NCH)     sum over the chunk of exp(z - chunk max z)
#   [2NCH, 3NCH)    the bound L the chunk gathered with
#   [3NCH, 4NCH)    the largest logit the chunk did not gather
#   4NCH + 0..3     row: M, zmax, r = 1 / S, L (the row's candidate bound)
#   4NCH + 4        segments: NCH x SEG gathered logits (index order within each chunk)
#   ... + NCH*SEG   the row's compacted candidates (CAP)
# int32, per row (WI elements)
#   [0, NCH)        chunk argmax (first index) of the logits or of z + g
#   [NCH, 2NCH)     chunk candidate count (may exceed SEG: overflow)
#   2NCH + 0        row mode: 0 done, 1 candidates from pass 1, 2 candidates from pass 2
#   2NCH + 4        N_G group-maximum keys per chunk
#   ... + NCH*N_G   segments: NCH x SEG vocabulary indices
#   ... + NCH*SEG   the row's compacted candidate indices (CAP)
# float64, per row: NCH partial top-p renormalisers (sum of p over the chunk)


@triton.jit
def _params(temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V):
    temp = tl.load(temp_ptr + row)
    k = tl.load(topk_ptr + row)
    k = tl.minimum(tl.maximum(k, -1), V).to(tl.int32)  # >= V is off either way; no int32 wrap-around
    top_p = tl.load(topp_ptr + row)
    min_p = tl.load(minp_ptr + row)
    greedy = temp == 0.0
    td = tl.where(greedy, 1.0, temp)
    k_on = (k > 0) & (k < V)
    p_on = top_p < 1.0
    m_on = min_p > 0.0
    return td, k, top_p, min_p, greedy, k_on, p_on, m_on


@triton.jit
def _chunk_lanes(c, V, CH, BLOCK: tl.constexpr):
    """Chunk c's vocabulary indices and which of its BLOCK lanes hold one."""
    lanes = tl.arange(0, BLOCK)
    offs = c * CH + lanes
    return offs, (lanes < CH) & (offs < V)


@triton.jit
def _load_chunk(logits_ptr, stride_row, row, c, V, CH, BLOCK: tl.constexpr):
    offs, ok = _chunk_lanes(c, V, CH, BLOCK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=ok, other=float("-inf"))
    return x, offs, ok


@triton.jit
def _gather_chunk(x, offs, ok, L, sx, si, SEG: tl.constexpr):
    """Write the chunk's finite logits >= L (in index order) to its segment; return (count, the
    largest logit not written). Past SEG the count still grows: the caller sees the overflow."""
    sel = ok & (x >= L) & (x > float("-inf"))
    pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    w = sel & (pos < SEG)
    tl.store(sx + pos, x, mask=w)
    tl.store(si + pos, offs, mask=w)
    cnt = tl.sum(sel.to(tl.int32), axis=0)
    out = tl.max(tl.where(ok & (sel == 0), x, float("-inf")), axis=0)
    return cnt, out


@triton.jit(do_not_specialize=["G"])
def _sample_pass1_argmax(
    logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr,
    wf_ptr, wi_ptr, V, NCH, CH, WF, WI, G,
    BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, ALL_GREEDY: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Pass 1 of greedy and unfiltered rows, grid (B, G): the row's chunks g, g + G, ..., each
    computed alone (G, from the batch size, changes which program does a chunk, never its result).
    Greedy: the chunk's maximum and first argmax; unfiltered: its argmax of z + g (lowest index on
    ties). Few registers, so many programs per SM, and the next chunk's load is issued before this
    one's work: a greedy row streams at memory speed. Filtered rows return at once."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    g = tl.program_id(1)
    td, k, top_p, min_p, greedy, k_on, p_on, m_on = _params(temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V)
    greedy = greedy | ALL_GREEDY  # the caller's promise: every row greedy, whatever its temperature
    if greedy | ((k_on | p_on | m_on) == 0):
        fr = wf_ptr + row.to(tl.int64) * WF
        ir = wi_ptr + row.to(tl.int64) * WI
        rowhash = row_hash(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
        xn, offs, ok = _load_chunk(logits_ptr, stride_row, row, g, V, CH, BLOCK)
        for c in range(g, NCH, G):
            x = xn
            xn, offs, ok = _load_chunk(logits_ptr, stride_row, row, c + G, V, CH, BLOCK)  # past the row: masked, no traffic
            # this chunk's lanes, from the next one's (carrying fewer tensors keeps more programs per SM)
            offs -= G * CH
            ok = (offs < (c + 1) * CH) & (offs < V)
            if greedy:
                best = tl.max(x, axis=0)
                arg = tl.min(tl.where(x == best, offs, _MAX_KEY), axis=0)
            else:
                val = tl.where(ok, tl.math.div_rn(x, td) + _gumbel(rowhash, offs, LIBDEVICE), float("-inf"))
                best = tl.max(val, axis=0)
                arg = tl.min(tl.where(ok & (val == best), offs, _MAX_KEY), axis=0)
            tl.store(fr + c, best)
            tl.store(ir + c, arg)


@triton.jit(do_not_specialize=["G"])
def _sample_pass1_filter(
    logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, minp_ptr,
    wf_ptr, wi_ptr, V, NCH, CH, WF, WI, G,
    BLOCK: tl.constexpr, N_G: tl.constexpr, SEG: tl.constexpr, LIBDEVICE: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False,
):
    """Pass 1 of filtered rows, grid (B, G): the row's chunks g, g + G, ..., each read once from
    memory into registers and computed alone (PREFETCH: the next chunk's load issued before this
    one's work). Greedy and unfiltered rows return at once."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    g = tl.program_id(1)
    td, k, top_p, min_p, greedy, k_on, p_on, m_on = _params(temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V)
    if (greedy == 0) & (k_on | p_on | m_on):
        fr = wf_ptr + row.to(tl.int64) * WF
        ir = wi_ptr + row.to(tl.int64) * WI
        if PREFETCH:
            xn, _, _ = _load_chunk(logits_ptr, stride_row, row, g, V, CH, BLOCK)
        for c in range(g, NCH, G):
            if PREFETCH:
                x = xn
                xn, _, _ = _load_chunk(logits_ptr, stride_row, row, c + G, V, CH, BLOCK)
                offs, ok = _chunk_lanes(c, V, CH, BLOCK)
            else:
                x, offs, ok = _load_chunk(logits_ptr, stride_row, row, c, V, CH, BLOCK)
            m = tl.max(x, axis=0)
            tl.store(fr + c, m)
            # N_G strided groups (lane j of the chunk is in group j % N_G): their maxima are distinct
            # elements, so at least k logits are >= the k-th largest of any set of them
            key = order_key(x)
            gk = tl.max(tl.reshape(key, [BLOCK // N_G, N_G]), axis=0)
            tl.store(ir + 2 * NCH + 4 + c * N_G + tl.arange(0, N_G), gk)
            s = m * 0.0
            if (p_on | m_on) & (m > float("-inf")):
                zm = tl.math.div_rn(m, td)
                s = tl.sum(tl.where(ok, _exp(tl.math.div_rn(x, td) - zm, LIBDEVICE), 0.0), axis=0)
            tl.store(fr + NCH + c, s)
            kg = k_on & (k <= N_G)
            if kg | (m_on & (p_on == 0)):
                # the chunk's own bound: its elements in the row's kept set are >= it (see _sample_plan)
                L = m * 0.0 + float("-inf")
                if kg:
                    sk = tl.sort(gk, descending=True)
                    L = from_order_key(tl.max(tl.where(tl.arange(0, N_G) == k - 1, sk, _MIN_KEY), axis=0))
                if m_on & (p_on == 0) & (m > float("-inf")):
                    zlo = tl.math.div_rn(m, td) + _log(min_p, LIBDEVICE)
                    zlo = zlo - 1e-4 * (1.0 + tl.abs(zlo))
                    L = tl.maximum(L, tl.minimum(zlo * td, m))
                seg = 4 * NCH + 4 + c * SEG
                cnt, out = _gather_chunk(x, offs, ok, L, fr + seg, ir + 2 * NCH + 4 + NCH * N_G + c * SEG, SEG)
                tl.store(fr + 2 * NCH + c, L)
                tl.store(fr + 3 * NCH + c, out)
                tl.store(ir + NCH + c, cnt)


@triton.jit
def _sample_plan(
    temp_ptr, topk_ptr, topp_ptr, minp_ptr, out_ptr, path_ptr,
    wf_ptr, wi_ptr, V, NCH, WF, WI,
    NCH_P2: tl.constexpr, N_G: tl.constexpr, SEG: tl.constexpr, LIBDEVICE: tl.constexpr, RECORD_PATH: tl.constexpr,
    ALL_GREEDY: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """One program per row: combine the chunks. Greedy and unfiltered rows get their token here;
    filtered rows get M, zmax, r, the candidate bound L and where their candidates come from."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    td, k, top_p, min_p, greedy, k_on, p_on, m_on = _params(temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V)
    greedy = greedy | ALL_GREEDY
    filtered = k_on | p_on | m_on
    fr = wf_ptr + row.to(tl.int64) * WF
    ir = wi_ptr + row.to(tl.int64) * WI
    cp = tl.arange(0, NCH_P2)
    cok = cp < NCH
    cmax = tl.load(fr + cp, mask=cok, other=float("-inf"))
    M = tl.max(cmax, axis=0)
    if greedy | (filtered == 0) | (M == float("-inf")):
        # greedy: the first index of the row maximum; unfiltered: argmax of z + g; the reference's
        # argmax over all -inf is index 0
        carg = tl.load(ir + cp, mask=cok, other=_MAX_KEY)
        arg = tl.min(tl.where(cok & (cmax == M), carg, _MAX_KEY), axis=0)
        tl.store(out_ptr + row, tl.where(M == float("-inf"), 0, arg).to(tl.int64))
        tl.store(ir + 2 * NCH, 0)
        if RECORD_PATH:
            tl.store(path_ptr + row, tl.where(filtered & (greedy == 0), 0, tl.where(greedy, 0, 1)))
    else:
        zmax = tl.math.div_rn(M, td)
        r = zmax * 0.0 + 1.0
        if p_on | m_on:
            # S = sum over chunks of s_c * exp(z_c - zmax), z_c the chunk's max z (the rescale in float64)
            s = tl.load(fr + NCH + cp, mask=cok, other=0.0).to(tl.float64)
            zc = tl.math.div_rn(cmax, td)
            f = _exp(zc.to(tl.float64) - zmax.to(tl.float64), LIBDEVICE)
            S = tl.sum(tl.where(cok & (cmax > float("-inf")), s * f, 0.0), axis=0).to(tl.float32)
            r = tl.math.div_rn(zmax * 0.0 + 1.0, S)
        gpos = tl.arange(0, NCH_P2 * N_G)
        gok = gpos < NCH * N_G
        gk = tl.load(ir + 2 * NCH + 4 + gpos, mask=gok, other=_MIN_KEY)
        glo = tl.min(tl.where(gok, gk, _MAX_KEY), axis=0).to(tl.int64)
        ghi = tl.max(gk, axis=0).to(tl.int64)
        neg_inf = zmax * 0.0 + float("-inf")
        # the row's bound from all chunks' group maxima: the k-th largest (bisection over keys)
        Lk = neg_inf
        if k_on & (k <= NCH * N_G):
            lo = glo
            hi = ghi
            while lo < hi:
                mid = lo + ((hi - lo + 1) >> 1)
                good = tl.sum((gk >= mid.to(tl.int32)).to(tl.int32), axis=0) >= k
                lo = tl.where(good, mid, lo)
                hi = tl.where(good, hi, mid - 1)
            Lk = from_order_key(lo.to(tl.int32))
        Lm = neg_inf
        if m_on:
            # p >= min_p * max p  <=>  z >= zmax + log(min_p), up to rounding: a small margin
            zlo = zmax + _log(min_p, LIBDEVICE)
            zlo = zlo - 1e-4 * (1.0 + tl.abs(zlo))
            Lm = tl.minimum(zlo * td, M)
        L = tl.where(k_on & p_on, Lk, tl.maximum(Lk, Lm))
        if p_on & (k_on == 0):
            # top-p without top-k: the largest group maximum whose groups' probability mass
            # (the group maxima's p) already reaches top_p
            gp = tl.where(gok, _p_of(from_order_key(gk), td, zmax, r, LIBDEVICE), 0.0)
            Lp = neg_inf
            if tl.sum(gp, axis=0) >= top_p:
                lo = glo
                hi = ghi
                while lo < hi:
                    mid = lo + ((hi - lo + 1) >> 1)
                    good = tl.sum(tl.where(gk >= mid.to(tl.int32), gp, 0.0), axis=0) >= top_p
                    lo = tl.where(good, mid, lo)
                    hi = tl.where(good, hi, mid - 1)
                Lp = from_order_key(lo.to(tl.int32))
            L = tl.maximum(Lp, Lm)
        # pass 1 gathered already (no segment overflowed): the bound is the largest used, so that
        # the candidates stay an upper set of the row's finite logits; else pass 2 gathers at L
        from_1 = (k_on & (k <= N_G)) | (m_on & (p_on == 0))
        if from_1:
            cnt = tl.load(ir + NCH + cp, mask=cok, other=0)
            from_1 = tl.max(cnt, axis=0) <= SEG
            L = tl.maximum(L, tl.max(tl.load(fr + 2 * NCH + cp, mask=cok, other=float("-inf")), axis=0))
        tl.store(fr + 4 * NCH + 0, M)
        tl.store(fr + 4 * NCH + 1, zmax)
        tl.store(fr + 4 * NCH + 2, r)
        tl.store(fr + 4 * NCH + 3, L)
        tl.store(ir + 2 * NCH, tl.where(from_1, 1, 2))


@triton.jit(do_not_specialize=["G"])
def _sample_pass2(
    logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, minp_ptr,
    wf_ptr, wi_ptr, wq_ptr, V, NCH, CH, WF, WI, G,
    BLOCK: tl.constexpr, N_G: tl.constexpr, SEG: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (B, G), only rows of mode 2 work: for each of the row's chunks g, g + G, ..., gather
    the chunk's logits >= the row's bound and, for top-p without top-k, the chunk's sum of p (the
    top-p renormaliser's part). Each chunk is computed alone, so G (from the batch size) changes
    which program does it, never its result."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    g = tl.program_id(1)
    fr = wf_ptr + row.to(tl.int64) * WF
    ir = wi_ptr + row.to(tl.int64) * WI
    if tl.load(ir + 2 * NCH) == 2:
        td, k, top_p, min_p, greedy, k_on, p_on, m_on = _params(temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V)
        L = tl.load(fr + 4 * NCH + 3)
        for c in range(g, NCH, G):
            x, offs, ok = _load_chunk(logits_ptr, stride_row, row, c, V, CH, BLOCK)
            seg = 4 * NCH + 4 + c * SEG
            cnt, out = _gather_chunk(x, offs, ok, L, fr + seg, ir + 2 * NCH + 4 + NCH * N_G + c * SEG, SEG)
            tl.store(fr + 3 * NCH + c, out)
            tl.store(ir + NCH + c, cnt)
            if p_on & (k_on == 0):
                zmax = tl.load(fr + 4 * NCH + 1)
                r = tl.load(fr + 4 * NCH + 2)
                q = tl.where(ok, _p_of(x, td, zmax, r, LIBDEVICE), 0.0).to(tl.float64)
                tl.store(wq_ptr + row.to(tl.int64) * NCH + c, tl.sum(q, axis=0))


@triton.jit
def _sample_finish(
    logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr,
    out_ptr, path_ptr, wf_ptr, wi_ptr, wq_ptr, V, NCH, WF, WI,
    NCH_P2: tl.constexpr, N_G: tl.constexpr, SEG: tl.constexpr, CAP: tl.constexpr, CG: tl.constexpr,
    TILE_C: tl.constexpr, FB_TILE: tl.constexpr, LIBDEVICE: tl.constexpr, RECORD_PATH: tl.constexpr, PDL: tl.constexpr = False,
):
    """One program per filtered row: compact the segments' logits >= L into the row's candidate
    list (index order), the exact phase on it, the whole-row fallback when needed."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    fr = wf_ptr + row.to(tl.int64) * WF
    ir = wi_ptr + row.to(tl.int64) * WI
    mode = tl.load(ir + 2 * NCH)
    if mode != 0:
        td, k, top_p, min_p, greedy, k_on, p_on, m_on = _params(temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V)
        rowhash = row_hash(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
        M = tl.load(fr + 4 * NCH + 0)
        zmax = tl.load(fr + 4 * NCH + 1)
        r = tl.load(fr + 4 * NCH + 2)
        L = tl.load(fr + 4 * NCH + 3)
        cp = tl.arange(0, NCH_P2)
        cok = cp < NCH
        Q_all = zmax * 0.0 + 1.0
        if p_on & (k_on == 0):
            Q_all = tl.sum(tl.load(wq_ptr + row.to(tl.int64) * NCH + cp, mask=cok, other=0.0), axis=0).to(tl.float32)
        cnt = tl.load(ir + NCH + cp, mask=cok, other=0)
        out_max = tl.max(tl.load(fr + 3 * NCH + cp, mask=cok, other=float("-inf")), axis=0)
        cx = fr + 4 * NCH + 4 + NCH * SEG
        ci = ir + 2 * NCH + 4 + NCH * N_G + NCH * SEG
        exact = mode == 0  # False
        token = mode * 0
        if tl.max(cnt, axis=0) <= SEG:
            # CG chunks' segments at a time: slot j of chunk c at flat position c * SEG + j (index order)
            fp = tl.arange(0, CG * SEG)
            n_c = mode * 0
            for c0 in range(0, NCH, CG):
                ch = c0 + fp // SEG
                sl = fp % SEG
                ok = (ch < NCH) & (sl < tl.load(ir + NCH + ch, mask=ch < NCH, other=0))
                x = tl.load(fr + 4 * NCH + 4 + c0 * SEG + fp, mask=ok, other=float("-inf"))
                idx = tl.load(ir + 2 * NCH + 4 + NCH * N_G + c0 * SEG + fp, mask=ok, other=0)
                sel = ok & (x >= L)
                pos = n_c + tl.cumsum(sel.to(tl.int32), axis=0) - 1
                tl.store(cx + pos, x, mask=sel & (pos < CAP))
                tl.store(ci + pos, idx, mask=sel & (pos < CAP))
                n_c += tl.sum(sel.to(tl.int32), axis=0)
                out_max = tl.maximum(out_max, tl.max(tl.where(ok & (sel == 0), x, float("-inf")), axis=0))
            if n_c <= CAP:
                tl.debug_barrier()  # the candidate list was written by every thread of the program
                if n_c <= TILE_C:
                    token, exact = _exact_sorted(
                        cx, ci, n_c, M, td, zmax, r, Q_all, rowhash, k, k_on, top_p, p_on, min_p, m_on, out_max,
                        TILE_C, LIBDEVICE,
                    )
                else:
                    token, exact = _exact(
                        cx, ci, n_c, V, M, td, zmax, r, Q_all, rowhash, k, k_on, top_p, p_on, min_p, m_on, out_max,
                        True, TILE_C, LIBDEVICE,
                    )
        if exact == 0:
            lp = logits_ptr + row.to(tl.int64) * stride_row
            token, exact = _exact(
                lp, lp, V, V, M, td, zmax, r, Q_all, rowhash, k, k_on, top_p, p_on, min_p, m_on, zmax * 0.0 + float("-inf"),
                False, FB_TILE, LIBDEVICE,
            )
            if RECORD_PATH:
                tl.store(path_ptr + row, 3)
        elif RECORD_PATH:
            tl.store(path_ptr + row, tl.where(mode == 1, 2, 4))
        tl.store(out_ptr + row, token.to(tl.int64))


# Chunk configurations by architecture (a tuning table's "sample"/"chunks" entry, if any, wins):
# BLOCK: chunk width (a chunk held in registers; the row is cut into cdiv(V, BLOCK) chunks of
#   equal length, whatever the batch size); N_GROUPS: strided group maxima per chunk (top-k up to
#   N_GROUPS gathers in pass 1); SEG: candidate slots per chunk; CAP: the row's candidate capacity;
#   TILE_C: candidates sorted in registers; num_warps: the chunk passes; row_warps: the per-row
#   kernels. Optional: pass1_programs / filter_programs (the two first-pass kernels' programs,
#   default PASS1_PROGRAMS), filter_prefetch (the filter kernel issues the next chunk's load first),
#   filter_warps (its warps, default num_warps). `python -m deepinfer_cuda.bench.sampling --sweep` prints
#   the line to paste here.
@lru_cache(maxsize=None)
def _cfg(op: str, variant: str, device: torch.device) -> dict:
    return config(op, variant, device)


def _sample_config(device: torch.device) -> dict:
    """The chunking of the passes: the tuning table's "sample"/"chunks" entry for this device."""
    return dict(_cfg("sample", "chunks", device))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    all_greedy: bool = False,
) -> torch.Tensor:
    return _sample(logits, temperature, top_k, top_p, min_p, seeds, positions, all_greedy=all_greedy)


PASS1_PROGRAMS = 2048  # programs of each first-pass kernel unless the tuning entry says (at least one a row)
PASS2_PROGRAMS = 4096  # programs of the second chunk pass (at least one a row)


def _programs_per_row(programs: int, nch: int, B: int) -> int:
    """A chunk pass's programs per row: `programs` shared by the B rows, at least one a row, at
    most one a chunk."""
    return max(1, min(nch, -(-programs // B)))


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def _sample(
    logits, temperature, top_k, top_p, min_p, seeds, positions, *,
    block=None, n_groups=None, seg=None, cap=None, tile_c=None, num_warps=None, row_warps=None, paths=None,
    pass1_programs=None, filter_programs=None, filter_prefetch=None, filter_warps=None, all_greedy=False,
):
    """`sample`, with the configuration overridable and the path each row took recorded (for tests
    and the sweep). all_greedy: every row greedy (the contract's promise): pass 1's argmax kernel and the plan only."""
    B, V = logits.shape
    device = logits.device
    out = torch.empty(B, dtype=torch.int64, device=device)
    if B == 0:
        return out
    x = logits if logits.dtype == torch.float32 else logits.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = _sample_config(device)
    block = block or cfg["BLOCK"]
    n_g = min(n_groups or cfg["N_GROUPS"], block)
    seg = min(seg or cfg["SEG"], block)
    cap = cap or cfg["CAP"]
    tile_c = min(tile_c or cfg["TILE_C"], cap)
    # equal chunks, each a multiple of 16 logits (aligned loads), at most BLOCK: V alone decides
    nch = -(-V // block)
    ch = min(block, -(-(-(-V // nch)) // 16) * 16)
    nch = -(-V // ch)
    nch_p2 = _pow2(nch)
    wf_row = -(-(4 * nch + 4 + nch * seg + cap) // 16) * 16
    wi_row = -(-(2 * nch + 4 + nch * n_g + nch * seg + cap) // 16) * 16
    wf = torch.empty(B * wf_row, dtype=torch.float32, device=device)
    wi = torch.empty(B * wi_row, dtype=torch.int32, device=device)
    wq = None if all_greedy else torch.empty(B * nch, dtype=torch.float64, device=device)
    params = (
        temperature if temperature.dtype == torch.float32 else temperature.float(),
        top_k if top_k.dtype in (torch.int32, torch.int64) else top_k.to(torch.int64),
        top_p if top_p.dtype == torch.float32 else top_p.float(),
        min_p if min_p.dtype == torch.float32 else min_p.float(),
    )
    params = tuple(p if p.is_contiguous() else p.contiguous() for p in params)
    seeds = seeds if seeds.dtype == torch.int64 and seeds.is_contiguous() else seeds.to(torch.int64).contiguous()
    positions = positions if positions.dtype == torch.int64 and positions.is_contiguous() else positions.to(torch.int64).contiguous()
    libdevice = not interpreting()
    record = paths is not None
    path_ptr = paths if record else out
    warps = num_warps or cfg["num_warps"]
    rwarps = row_warps or cfg["row_warps"]
    # pass 1: each kind of row in its own kernel (a greedy row's chunks must not wait on the filter
    # kernel's registers), at most PASS1_PROGRAMS programs each, a row's chunks shared out among them
    g1 = _programs_per_row(pass1_programs or cfg.get("pass1_programs", PASS1_PROGRAMS), nch, B)
    _sample_pass1_argmax[(B, g1)](
        x, x.stride(0), *params, seeds, positions, wf, wi, V, nch, ch, wf_row, wi_row, g1,
        BLOCK=block, LIBDEVICE=libdevice, ALL_GREEDY=all_greedy, num_warps=warps, **pdl_launch(x.device),
    )
    if not all_greedy:  # (all greedy: every row's token comes out of the plan; two launches, as torch.argmax's reduction)
        gf = _programs_per_row(filter_programs or cfg.get("filter_programs", PASS1_PROGRAMS), nch, B)
        _sample_pass1_filter[(B, gf)](
            x, x.stride(0), *params, wf, wi, V, nch, ch, wf_row, wi_row, gf,
            BLOCK=block, N_G=n_g, SEG=seg, LIBDEVICE=libdevice, PREFETCH=cfg.get("filter_prefetch", False) if filter_prefetch is None else filter_prefetch,
            num_warps=filter_warps or cfg.get("filter_warps", warps), **pdl_launch(x.device),
        )
    _sample_plan[(B,)](
        *params, out, path_ptr, wf, wi, V, nch, wf_row, wi_row,
        NCH_P2=nch_p2, N_G=n_g, SEG=seg, LIBDEVICE=libdevice, RECORD_PATH=record, ALL_GREEDY=all_greedy, num_warps=rwarps, **pdl_launch(out.device),
    )
    if all_greedy:
        return out
    # pass 2 works only for rows whose candidates overflowed pass 1; every other program returns at
    # once, so past PASS2_PROGRAMS programs a row's chunks are shared out (the H200: 16k programs
    # that return at once took 17 us of a 76 us greedy batch of 256)
    g = _programs_per_row(PASS2_PROGRAMS, nch, B)
    _sample_pass2[(B, g)](
        x, x.stride(0), *params, wf, wi, wq, V, nch, ch, wf_row, wi_row, g,
        BLOCK=block, N_G=n_g, SEG=seg, LIBDEVICE=libdevice, num_warps=warps, **pdl_launch(x.device),
    )
    _sample_finish[(B,)](
        x, x.stride(0), *params, seeds, positions, out, path_ptr, wf, wi, wq, V, nch, wf_row, wi_row,
        NCH_P2=nch_p2, N_G=n_g, SEG=seg, CAP=cap, CG=max(1, min(nch_p2, 2048 // seg)), TILE_C=tile_c, FB_TILE=min(_pow2(V), 2048), LIBDEVICE=libdevice,
        RECORD_PATH=record, num_warps=rwarps, **pdl_launch(x.device),
    )
    return out


# ---------------------------------------------------------------------------------------------
# apply_token_bitmask


@triton.jit
def _bitmask_kernel(logits_ptr, mask_ptr, V, W, stride_l, stride_m, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
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
        logits, m, vocab, m.shape[1], logits.stride(0), m.stride(0), BLOCK=block, num_warps=cfg["num_warps"], **pdl_launch(logits.device),
    )
    return logits


REGISTRATIONS = [
    # Batch-invariant as they are. sample: every program serves one row (the chunk passes some of its
    # chunks, each computed alone); the chunking, workspace and warps come from V and the device's
    # entry only (B only decides which program computes a chunk), and the noise is a hash of the
    # row's own seed and position. apply_token_bitmask: elementwise.
    Registration(op="sample", fn=sample, note="Triton (no sort: bisection on float keys over gathered candidates, in-kernel hash noise)",
                 batch_invariant=True),
    Registration(op="apply_token_bitmask", fn=apply_token_bitmask, note="Triton (in place)", batch_invariant=True),
]  # fmt: skip
