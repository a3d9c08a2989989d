"""What the ascend `sample` kernel's two paths compute alike: the row path (`sampling`) and the
small-batch chunked path (`sampling_chunked`) build a row's token from these same expressions,
which is why they give it the same bits. Float keys, exact fixed-point sums, the noise hash, p,
the threshold searches (over candidates held on chip, and over the whole row when the candidates
overflow), the streaming passes over a span of a row (the whole row in the row path, a chunk in the
chunked one), the keep rules and the token's argmax, and the PATH_* flags recording which searches
a row took. Not a registration module.

Exact sums without float64 (the vector units have none): each value in [0, 1] is split into
three 20-bit integer limbs (2^-20, 2^-40, 2^-60) summed in int32 with carries, so a sum is
exact to 2^-60 per element and independent of the order (the candidate and the whole-row paths
give the same thresholds). `round32(mass) >= top_p` is decided exactly in that fixed point:
mass above the midpoint between top_p and the float32 below it (at the midpoint, round half to
even). The reference's cumulative sum runs in float64 (torch's CPU cumsum accumulates float32
in double) and rounds each prefix to float32; the two agree except within ~1e-12 of a rounding
boundary.

The hash (`sampling_uniform`) in the kernel: with NATIVE_U32 = False (the default) every 32-bit
word is held as two 16-bit halves in int32, so nothing depends on unsigned types, logical
shifts or wrap-around on overflow: xor and shifts act on the halves, and the multiplication by
a 32-bit constant is built from products of a 16-bit half by a byte of the constant (every
intermediate < 2^27). NATIVE_U32 = True runs the shared uint32 hash (deepinfer.triton_common
`mix32`, the one the cuda kernels use; about 4x fewer operations; bit-identical under the
interpreter, to be confirmed on triton-ascend before it is switched on). u = ((h >> 9) + 0.5) *
2^-23 is exact; seeds and positions arrive as int32 (low, high) pairs (a view of the int64
tensors), so no int64 vector arithmetic either (int64 only for a few scalars of the key
bisections, whose intervals can span 2^32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.triton_common import from_order_key, mix32, order_key

_MIN_KEY = tl.constexpr(-(2**31))
_MAX_KEY = tl.constexpr(2**31 - 1)
# The hash's 32-bit multiplications: False builds them from 16-bit halves (no reliance on unsigned
# wrap-around); True uses uint32 multiply (fewer operations; equal under the interpreter, to be
# confirmed on triton-ascend hardware before it is switched on).
NATIVE_U32 = False

# ---------------------------------------------------------------------------------------------
# float keys, fixed-point sums, the hash


@triton.jit
def _split3(v):
    """v in [0, 1] -> integer limbs (a, b, c) with v ~ a 2^-20 + b 2^-40 + c 2^-60 (truncated)."""
    s = v * 1048576.0
    a = tl.floor(s)
    s = (s - a) * 1048576.0  # exact: the fraction of s, rescaled by a power of two
    b = tl.floor(s)
    c = tl.floor((s - b) * 1048576.0)
    return a.to(tl.int32), b.to(tl.int32), c.to(tl.int32)


@triton.jit
def _carry(U, A, B, C):
    B = B + (C >> 20)
    C = C & 0xFFFFF
    A = A + (B >> 20)
    B = B & 0xFFFFF
    U = U + (A >> 20)
    A = A & 0xFFFFF
    return U, A, B, C


@triton.jit
def _limbsum2(sel, a, b, c):
    """Exact sum of the selected elements' limbs over a 2-D tile of at most 2048 elements whose
    values sum to <= 1 (probabilities): no int32 sum can overflow (a limb's sum stays below
    2^20 * (the values' sum) + 2^20 * 2048 for b and c)."""
    A = tl.sum(tl.sum(tl.where(sel, a, 0), axis=1), axis=0)
    B = tl.sum(tl.sum(tl.where(sel, b, 0), axis=1), axis=0)
    C = tl.sum(tl.sum(tl.where(sel, c, 0), axis=1), axis=0)
    return _carry(A * 0, A, B, C)


@triton.jit
def _fixed_to_float(U, A, B, C):
    """U + A 2^-20 + B 2^-40 + C 2^-60 rounded to float32 (a two-sum keeps the first rounding's error)."""
    hi = U.to(tl.float32)
    lo = A.to(tl.float32) * 9.5367431640625e-07  # 2^-20
    s = hi + lo
    bb = s - hi
    err = (hi - (s - bb)) + (lo - bb)
    rest = B.to(tl.float32) * 9.094947017729282e-13 + C.to(tl.float32) * 8.673617379884035e-19  # 2^-40, 2^-60
    return s + (err + rest)


@triton.jit
def _midpoint(top_p):
    """The fixed-point limbs of the midpoint between top_p and the float32 below it, and whether a
    mass exactly there rounds up to top_p (round half to even); top_p < 1."""
    top_p = tl.where(top_p.to(tl.int32, bitcast=True) <= 0, 0.5, top_p)  # (top_p <= 0: `_reaches` says yes anyway)
    below = (top_p.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
    half = (top_p - below) * 0.5  # exact: a power of two
    ta, tb, tc = _split3(below)
    ha, hb, hc = _split3(half)
    tu, ta, tb, tc = _carry(ta * 0, ta + ha, tb + hb, tc + hc)
    tie_up = (top_p.to(tl.int32, bitcast=True) & 1) == 0
    return tu, ta, tb, tc, tie_up


@triton.jit
def _reaches(U, A, B, C, tu, ta, tb, tc, tie_up, top_p):
    """round32(U + A 2^-20 + B 2^-40 + C 2^-60) >= top_p, decided exactly against the midpoint."""
    gt = (U > tu) | ((U == tu) & ((A > ta) | ((A == ta) & ((B > tb) | ((B == tb) & (C > tc))))))
    eq = (U == tu) & (A == ta) & (B == tb) & (C == tc)
    nonpositive = top_p.to(tl.int32, bitcast=True) <= 0  # top_p <= 0: every mass reaches it
    return gt | (eq & tie_up) | nonpositive


@triton.jit
def _mul32(l, h, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr):
    """(h 2^16 + l) * C mod 2^32 as halves, C = bytes C3 C2 C1 C0; intermediates < 2^27."""
    p0 = l * C0
    p1 = l * C1
    t = p0 + ((p1 & 0xFF) << 8)
    lo = t & 0xFFFF
    carry = (t >> 16) + (p1 >> 8)
    a1 = h * C0 + (((h * C1) & 0xFF) << 8)
    a2 = l * C2 + (((l * C3) & 0xFF) << 8)
    hi = (carry + a1 + a2) & 0xFFFF
    return lo, hi


@triton.jit
def _xorshift15(l, h):
    """x ^= x >> 15 on halves."""
    l2 = l ^ (((h << 1) & 0xFFFF) | (l >> 15))
    return l2, h ^ (h >> 15)


@triton.jit
def _mix32_halves(l, h, NATIVE_U32: tl.constexpr):
    """deepinfer.triton_common.mix32 on a word held as 16-bit halves: natively in uint32, or
    emulated on the halves (the same bits, checked against sampling_uniform by the tests)."""
    if NATIVE_U32:
        x = mix32(((h << 16) | l).to(tl.uint32))
        l = (x & 0xFFFF).to(tl.int32)
        h = (x >> 16).to(tl.int32)
    else:
        l = l ^ h  # x ^= x >> 16
        l, h = _mul32(l, h, 0xAD, 0xAA, 0xF0, 0x21)  # x *= 0x21F0AAAD
        l, h = _xorshift15(l, h)
        l, h = _mul32(l, h, 0x97, 0x2D, 0x5A, 0xD3)  # x *= 0xD35A2D97
        l, h = _xorshift15(l, h)
    return l, h


@triton.jit
def _row_hash(seed_ptr, pos_ptr, row, NATIVE_U32: tl.constexpr):
    """mix(mix(mix(seed_lo + 0x9E3779B9) ^ seed_hi) ^ position_lo), as halves, from the row's seed
    and position words (int32 pairs, `_words`)."""
    seed_lo = tl.load(seed_ptr + 2 * row)
    seed_hi = tl.load(seed_ptr + 2 * row + 1)
    pos_lo = tl.load(pos_ptr + 2 * row)
    l = (seed_lo & 0xFFFF) + 0x79B9
    h = (((seed_lo >> 16) & 0xFFFF) + 0x9E37 + (l >> 16)) & 0xFFFF
    l = l & 0xFFFF
    l, h = _mix32_halves(l, h, NATIVE_U32)
    l, h = _mix32_halves(l ^ (seed_hi & 0xFFFF), h ^ ((seed_hi >> 16) & 0xFFFF), NATIVE_U32)
    return _mix32_halves(l ^ (pos_lo & 0xFFFF), h ^ ((pos_lo >> 16) & 0xFFFF), NATIVE_U32)


@triton.jit
def _hash_uniform_halves(rl, rh, idx, NATIVE_U32: tl.constexpr):
    """u = ((mix(row ^ v) >> 9) + 0.5) 2^-23 for int32 indices v >= 0."""
    l, h = _mix32_halves(rl ^ (idx & 0xFFFF), rh ^ (idx >> 16), NATIVE_U32)
    return (((h << 7) | (l >> 9)).to(tl.float32) + 0.5) * 1.1920928955078125e-07


def _words(t: torch.Tensor) -> torch.Tensor:
    """int64 [B] -> int32 [B, 2] (low word, high word), a view when possible (no kernel)."""
    t = t.reshape(-1).to(torch.int64).contiguous()
    return t.view(torch.int32).view(-1, 2)


# ---------------------------------------------------------------------------------------------
# a row's parameters


@triton.jit
def _row_rules(temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V):
    """A row's parameters: (td, greedy, k, k_on, top_p, p_on, min_p, m_on); td = 1 for greedy rows."""
    temp = tl.load(temp_ptr + row)
    k = tl.load(topk_ptr + row)
    top_p = tl.load(topp_ptr + row)
    min_p = tl.load(minp_ptr + row)
    greedy = temp == 0.0
    td = tl.where(greedy, 1.0, temp)
    return td, greedy, k, (k > 0) & (k < V), top_p, top_p < 1.0, min_p, min_p > 0.0


# ---------------------------------------------------------------------------------------------
# p, as the reference computes it


@triton.jit
def _p_of(x, td, zmax, r):
    # the reference: z = logits / t; p = softmax(z) = exp(z - max z) * (1 / sum)
    return tl.exp(x / td - zmax) * r


# ---------------------------------------------------------------------------------------------
# the token: the keep rules and the argmax of z + g (lowest index on ties)


@triton.jit
def _perturbed(x, td, rl, rh, idx, NATIVE_U32: tl.constexpr):
    """z + g: the value the token maximises."""
    return x / td - tl.log(-tl.log(_hash_uniform_halves(rl, rh, idx, NATIVE_U32)))


@triton.jit
def _kept(x, ok, td, zmax, r, Q, tk_key, tp, tp_on, thr, p_on, m_on):
    """Which of the elements `ok` pass the row's filters: key >= the top-k threshold's, q >= tp
    (tp_on), p >= min_p * max p (m_on)."""
    keep = ok & (order_key(x) >= tk_key)
    if p_on | m_on:
        p = _p_of(x, td, zmax, r)
        if tp_on != 0:
            keep = keep & (p / Q >= tp)
        if m_on:
            keep = keep & (p >= thr)
    return keep


@triton.jit
def _keep_first_max(val, idx, best, best_idx):
    """Lane-wise running maximum with its index; an equal later value does not replace it, so a
    lane keeps its lowest index among ties (tiles come in index order)."""
    up = val > best
    return tl.where(up, val, best), tl.where(up, idx, best_idx)


@triton.jit
def _lowest_index_of_max(val, idx):
    """(max, the lowest index among the lanes that reach it) over a [N] vector."""
    vmax = tl.max(val, axis=0)
    return vmax, tl.min(tl.where(val == vmax, idx, _MAX_KEY), axis=0)


# ---------------------------------------------------------------------------------------------
# the streaming passes over a span [start, end) of a row (BLOCK-wide tiles)


@triton.jit
def _first_pass(lp, start, end, rl, rh, td, with_noise, BLOCK: tl.constexpr, NATIVE_U32: tl.constexpr):
    """Lane maxima with their first index and lane minima of the keys; `with_noise` (unfiltered
    rows) also the lanes' argmax of z + g, in the same pass (the row path passes a constexpr False:
    no noise code there). Returns (lane_max, lane_idx, lane_min, best, best_idx)."""
    lanes = tl.arange(0, BLOCK)
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_idx = tl.zeros([BLOCK], dtype=tl.int32)
    lane_min = tl.full([BLOCK], _MAX_KEY, tl.int32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], _MAX_KEY, tl.int32)
    for tile in range(start, end, BLOCK):
        offs = tile + lanes
        ok = offs < end
        x = tl.load(lp + offs, mask=ok, other=float("-inf"))
        lane_max, lane_idx = _keep_first_max(x, offs, lane_max, lane_idx)
        lane_min = tl.minimum(lane_min, tl.where(ok, order_key(x), _MAX_KEY))
        if with_noise:
            best, best_idx = _keep_first_max(tl.where(ok, _perturbed(x, td, rl, rh, offs, NATIVE_U32), float("-inf")), offs, best, best_idx)
    return lane_max, lane_idx, lane_min, best, best_idx


@triton.jit
def _add_limbs(U, A, B, C, v):
    """The fixed-point sum (U, A, B, C) plus the exact sum of a tile of values in [0, 1]."""
    a, b, c = _split3(v)
    return _carry(U, A + tl.sum(a, axis=0), B + tl.sum(b, axis=0), C + tl.sum(c, axis=0))


@triton.jit
def _mass_above(x, w, thresholds):
    """For each threshold, the float32 sum of the weights w of the tile's logits x >= it."""
    return tl.sum(tl.where(x[:, None] >= thresholds[None, :], w[:, None], 0.0), axis=0)


@triton.jit
def _normaliser_tile(x, td, zmax, xc, p_on, U, A, B, C, coarse):
    """One tile's part of S = sum exp(z - zmax) (exact limbs) and, for top-p, of the coarse
    estimates of the mass above the logits xc."""
    e = tl.exp(x / td - zmax)
    U, A, B, C = _add_limbs(U, A, B, C, e)
    if p_on:
        coarse += _mass_above(x, e, xc)
    return U, A, B, C, coarse


@triton.jit
def _kept_mass_pass(lp, start, end, td, zmax, r, tk_key, xf, bracket_found, BLOCK: tl.constexpr, NT: tl.constexpr):
    """The span's part of Q = sum of p over keep_k (exact limbs) and, when the coarse bracket was
    found, of the float32 estimates of that mass above the logits xf. Returns (U, A, B, C, approx)."""
    lanes = tl.arange(0, BLOCK)
    approx = tl.zeros([NT], dtype=tl.float32)
    U = tk_key * 0
    A = U
    B = U
    C = U
    for tile in range(start, end, BLOCK):
        offs = tile + lanes
        ok = offs < end
        x = tl.load(lp + offs, mask=ok, other=float("-inf"))
        p = tl.where(ok & (order_key(x) >= tk_key), _p_of(x, td, zmax, r), 0.0)
        U, A, B, C = _add_limbs(U, A, B, C, p)
        if bracket_found:
            approx += _mass_above(x, p, xf)
    return U, A, B, C, approx


@triton.jit
def _token_pass(lp, start, end, rl, rh, td, zmax, r, Q, tk_key, tp, tp_on, thr, p_on, m_on, BLOCK: tl.constexpr, NATIVE_U32: tl.constexpr):
    """(the best z + g over the span's kept elements, its lowest index); -inf when none is kept."""
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], _MAX_KEY, tl.int32)
    for tile in range(start, end, BLOCK):
        offs = tile + lanes
        x = tl.load(lp + offs, mask=offs < end, other=float("-inf"))
        keep = _kept(x, offs < end, td, zmax, r, Q, tk_key, tp, tp_on, thr, p_on, m_on)
        best, best_idx = _keep_first_max(tl.where(keep, _perturbed(x, td, rl, rh, offs, NATIVE_U32), float("-inf")), offs, best, best_idx)
    return _lowest_index_of_max(best, best_idx)


# ---------------------------------------------------------------------------------------------
# the top-p bracket: float32 estimates that narrow the exact search


@triton.jit
def _coarse_thresholds(zmax, td, NT: tl.constexpr):
    """NT logits zmax - d_j (d_j = 0.25 e^{0.3 j}, up to 22.5 for NT = 16), descending."""
    return (zmax - 0.25 * tl.exp(0.3 * tl.arange(0, NT).to(tl.float32))) * td


@triton.jit
def _coarse_bracket(coarse, S, top_p, xc, M, NT: tl.constexpr):
    """(x_lo, x_hi, found): the logits around the top-p crossing from the coarse estimates (mass
    above xc, unnormalised), when one clearly reaches top_p; x_lo, x_hi are 0 (unused) otherwise."""
    nt = tl.arange(0, NT)
    n_c = tl.sum((coarse >= top_p * S * 1.0001).to(tl.int32), axis=0)
    x_lo = S * 0.0
    x_hi = S * 0.0
    if n_c > 0:
        # the crossing lies between xc[j1] and xc[j1 - 1] (or M): the clear ones are a suffix
        j1 = NT - n_c
        x_lo = tl.max(tl.where(nt == j1, xc, float("-inf")), axis=0)
        x_hi = tl.where(j1 > 0, tl.max(tl.where(nt == j1 - 1, xc, float("-inf")), axis=0), M)
    return x_lo, x_hi, (n_c > 0).to(tl.int32)


@triton.jit
def _refined_thresholds(x_lo, x_hi, NT: tl.constexpr):
    """NT logits evenly spaced in the coarse bracket, ascending."""
    return x_lo + (x_hi - x_lo) * (tl.arange(0, NT).to(tl.float32) / NT)


@triton.jit
def _guessed_bound(lo, approx, xf, Q, top_p, bracket_found, NT: tl.constexpr):
    """The key lower bound lo (int32) raised to the largest refined threshold xf whose estimated
    mass clearly reaches top_p: a guess, checked exactly by the top-p search."""
    n_f = tl.sum((approx >= top_p * Q * 1.0001 + 1e-6).to(tl.int32), axis=0)
    if bracket_found & (n_f > 0):
        # ascending thresholds: the clear ones are a prefix
        lo = tl.maximum(lo, order_key(tl.max(tl.where(tl.arange(0, NT) == n_f - 1, xf, float("-inf")), axis=0)))
    return lo


# ---------------------------------------------------------------------------------------------
# threshold searches over candidates held on chip


@triton.jit
def _bracket(keys, valid, lo, hi):
    """[lo, hi] narrowed to the keys present (the answer is one of them; no key lies between lo
    and the smallest one >= lo, so the search's predicate is the same there)."""
    k_lo = tl.min(tl.min(tl.where(valid & (keys >= lo.to(tl.int32)), keys, _MAX_KEY), axis=1), axis=0)
    k_hi = tl.max(tl.max(tl.where(valid, keys, _MIN_KEY), axis=1), axis=0)
    new_lo = tl.maximum(lo, k_lo.to(tl.int64))
    new_hi = tl.maximum(tl.minimum(hi, k_hi.to(tl.int64)), new_lo)
    return tl.where(k_lo < _MAX_KEY, new_lo, lo), tl.where(k_lo < _MAX_KEY, new_hi, lo)


@triton.jit
def _search_count(keys, valid, k, lo, hi):
    """Largest key in [lo, hi] (int64 scalars) with count(valid & keys >= key) >= k, by bisection
    over a 2-D tile held on chip; count(>= lo) >= k is known."""
    lo, hi = _bracket(keys, valid, lo, hi)
    for _ in range(32):
        if lo < hi:
            mid = lo + (hi - lo + 1) // 2
            c = tl.sum(tl.sum((valid & (keys >= mid.to(tl.int32))).to(tl.int32), axis=1), axis=0)
            good = c >= k
            lo = tl.where(good, mid, lo)
            hi = tl.where(good, hi, mid - 1)
    return lo


@triton.jit
def _search_mass(keys, a, b, c, lo, hi, top_p):
    """(kappa, found): the largest key in [lo, hi] whose mass (limbs a, b, c of the elements with
    keys >= kappa; zero limbs for elements that do not count) rounds to >= top_p, by bisection over
    a 2-D tile held on chip; found = whether lo itself reaches top_p (else kappa = lo, unused)."""
    tu, ta, tb, tc, tie_up = _midpoint(top_p)
    lo, hi = _bracket(keys, keys > _MIN_KEY, lo, hi)
    U, A, B, C = _limbsum2(keys >= lo.to(tl.int32), a, b, c)
    found = _reaches(U, A, B, C, tu, ta, tb, tc, tie_up, top_p).to(tl.int32)
    hi = tl.where(found != 0, hi, lo)
    for _ in range(32):
        if lo < hi:
            mid = lo + (hi - lo + 1) // 2
            U, A, B, C = _limbsum2(keys >= mid.to(tl.int32), a, b, c)
            good = _reaches(U, A, B, C, tu, ta, tb, tc, tie_up, top_p)
            lo = tl.where(good, mid, lo)
            hi = tl.where(good, hi, mid - 1)
    return lo, found


# ---------------------------------------------------------------------------------------------
# threshold searches over the whole row (when the candidates overflow their slots)


@triton.jit
def _thresholds(lo, hi, jt, NT: tl.constexpr):
    """NT keys lo, lo + step, ... (clamped to hi) with step = ceil((hi - lo) / (NT - 1)); int64 scalars in."""
    step = (hi - lo + NT - 2) // (NT - 1)
    step = tl.maximum(step, 1)
    m = tl.minimum(lo + jt.to(tl.int64) * step, hi)
    return m.to(tl.int32), step


@triton.jit
def _narrow(lo, hi, step, n_true, NT: tl.constexpr):
    """The new interval after NT thresholds lo + j step, of which the first n_true passed."""
    new_lo = tl.minimum(lo + (n_true - 1).to(tl.int64) * step, hi)
    new_hi = tl.where(n_true < NT, tl.minimum(lo + n_true.to(tl.int64) * step, hi) - 1, hi)
    return new_lo, new_hi


@triton.jit
def _topk_rows(lp, V, k, lo, hi, BLOCK: tl.constexpr, NT: tl.constexpr, ROUNDS: tl.constexpr):
    """The key of the row's k-th largest logit in [lo, hi] (count(>= lo) >= k known): NT
    thresholds per pass over the row."""
    lanes = tl.arange(0, BLOCK)
    jt = tl.arange(0, NT)
    for _ in range(ROUNDS):
        if lo < hi:
            m, step = _thresholds(lo, hi, jt, NT)
            cnt = tl.zeros([NT], dtype=tl.int32)
            for start in range(0, V, BLOCK):
                offs = start + lanes
                ok = offs < V
                key = order_key(tl.load(lp + offs, mask=ok, other=float("-inf")))
                cnt += tl.sum(((key[:, None] >= m[None, :]) & ok[:, None]).to(tl.int32), axis=0)
            lo, hi = _narrow(lo, hi, step, tl.sum((cnt >= k).to(tl.int32), axis=0), NT)
    return lo


@triton.jit
def _topp_rows(lp, V, td, zmax, r, Q, tk_key, top_p, lo, hi, BLOCK: tl.constexpr, NT: tl.constexpr, ROUNDS: tl.constexpr):
    """(kappa, found) as `_search_mass`, with NT thresholds per pass over the row."""
    lanes = tl.arange(0, BLOCK)
    jt = tl.arange(0, NT)
    found = tl.sum(tl.zeros([NT], dtype=tl.int32), axis=0)
    checked = found
    tu, ta, tb, tc, tie_up = _midpoint(top_p)
    for _ in range(ROUNDS + 1):
        if (lo < hi) | (checked == 0):
            m, step = _thresholds(lo, hi, jt, NT)
            U = tl.zeros([NT], dtype=tl.int32)
            A = tl.zeros([NT], dtype=tl.int32)
            B = tl.zeros([NT], dtype=tl.int32)
            C = tl.zeros([NT], dtype=tl.int32)
            for start in range(0, V, BLOCK):
                offs = start + lanes
                ok = offs < V
                x = tl.load(lp + offs, mask=ok, other=float("-inf"))
                key = order_key(x)
                a, b, c = _split3(tl.where(ok & (key >= tk_key), _p_of(x, td, zmax, r) / Q, 0.0))
                sel = key[:, None] >= m[None, :]
                A += tl.sum(tl.where(sel, a[:, None], 0), axis=0)
                B += tl.sum(tl.where(sel, b[:, None], 0), axis=0)
                C += tl.sum(tl.where(sel, c[:, None], 0), axis=0)
                U, A, B, C = _carry(U, A, B, C)
            n_true = tl.sum(_reaches(U, A, B, C, tu, ta, tb, tc, tie_up, top_p).to(tl.int32), axis=0)
            if checked == 0:
                found = (n_true > 0).to(tl.int32)  # the first threshold is lo itself
                checked = found * 0 + 1
            if found == 0:
                hi = lo
            else:
                lo, hi = _narrow(lo, hi, step, n_true, NT)
    return lo, found


# ---------------------------------------------------------------------------------------------
# which searches a row took (recorded for tests), in either path

PATH_TOPK_CANDIDATES = 1  # the k-th largest found among the candidates on chip
PATH_TOPK_ROWS = 2  # the candidates overflowed: threshold passes over the row
PATH_TOPP_CANDIDATES = 4
PATH_TOPP_BAD_GUESS = 8  # the estimated lower bound did not reach top_p exactly
PATH_TOPP_ROWS = 16
PATH_TOKEN_CANDIDATES = 32  # the token drawn among the candidates (else one more pass over the row)
PATH_CHUNKED = 64  # the small-batch path: the row was cut into chunks over several programs
# the same flags as the kernels read them (a jit function reads constexpr globals only)
_PATH_TOPK_CANDIDATES = tl.constexpr(PATH_TOPK_CANDIDATES)
_PATH_TOPK_ROWS = tl.constexpr(PATH_TOPK_ROWS)
_PATH_TOPP_CANDIDATES = tl.constexpr(PATH_TOPP_CANDIDATES)
_PATH_TOPP_BAD_GUESS = tl.constexpr(PATH_TOPP_BAD_GUESS)
_PATH_TOPP_ROWS = tl.constexpr(PATH_TOPP_ROWS)
_PATH_TOKEN_CANDIDATES = tl.constexpr(PATH_TOKEN_CANDIDATES)
_PATH_CHUNKED = tl.constexpr(PATH_CHUNKED)


# ---------------------------------------------------------------------------------------------
# the thresholds a row keeps: among its candidates when they are complete, else over the whole row


@triton.jit
def _topk_threshold(lp, V, k, cx, valid, complete, lo_k, kmax, path, SEARCH_L: tl.constexpr, NT: tl.constexpr, ROUNDS: tl.constexpr):
    """(the k-th largest logit's key, path): bisected among the candidates cx (valid) when they
    hold every element >= lo_k (complete), else searched over the row."""
    if complete:
        tk_key = _search_count(order_key(cx), valid, k, lo_k, kmax.to(tl.int64)).to(tl.int32)
        path = path | _PATH_TOPK_CANDIDATES
    else:
        path = path | _PATH_TOPK_ROWS
        tk_key = _topk_rows(lp, V, k, lo_k, kmax.to(tl.int64), SEARCH_L, NT, ROUNDS).to(tl.int32)
    return tk_key, path


@triton.jit
def _mass_of_candidates(cx, valid, td, zmax, r, tk_key):
    """Q, the exact sum of p over keep_k, when the candidates hold all of keep_k."""
    a, b, c = _split3(_p_of(cx, td, zmax, r))
    U, A, B, C = _limbsum2(valid & (order_key(cx) >= tk_key), a, b, c)
    return _fixed_to_float(U, A, B, C)


@triton.jit
def _topp_threshold(
    lp, V, cx, valid, have, td, zmax, r, Q, tk_key, top_p, kmin, lo_p, kmax, path,
    SEARCH_L: tl.constexpr, NT: tl.constexpr, ROUNDS: tl.constexpr,
):
    """(tp, found, have, path): the threshold on q = p / Q, from kappa bisected among the
    candidates (have: they hold every element >= lo_p) or over the whole row from the smallest key
    of keep_k (they overflowed, or lo_p was a guess above it that does not reach top_p: have
    becomes 0); found = 0 when the whole of keep_k does not reach top_p (every q is kept, tp unused)."""
    lo_base = tl.maximum(kmin, tk_key).to(tl.int64)
    guessed = lo_p > lo_base
    tp_key = lo_p
    found = tk_key * 0
    if have != 0:
        ckey = tl.where(valid, order_key(cx), _MIN_KEY)
        a, b, c = _split3(tl.where(ckey >= tk_key, _p_of(cx, td, zmax, r) / Q, 0.0))
        tp_key, found = _search_mass(ckey, a, b, c, lo_p, kmax.to(tl.int64), top_p)
        path = path | _PATH_TOPP_CANDIDATES
        if (found == 0) & guessed:
            have = have * 0  # the guess was too high: search the whole row
            path = path | _PATH_TOPP_BAD_GUESS
    if have == 0:
        path = path | _PATH_TOPP_ROWS
        tp_key, found = _topp_rows(lp, V, td, zmax, r, Q, tk_key, top_p, lo_base, kmax.to(tl.int64), SEARCH_L, NT, ROUNDS)
    tp = td * 0.0
    if found != 0:
        tp = _p_of(from_order_key(tp_key.to(tl.int32)), td, zmax, r) / Q
    return tp, found, have, path
