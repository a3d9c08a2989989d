"""The ascend `sample` kernel's small-batch path, which `sampling.sample` takes for at most half as
many rows as vector cores (and V > 256): the row path there (one program per row) would leave most
cores idle while one streams a 129280-logit row several times. Not a registration module: `sample`
is registered by `sampling`, which chooses the path.

Each row is cut into NCH chunks (multiples of 256 logits; NCH = the vector cores per row,
num_vectorcore // B, the count `vector_grid` caps at), and every pass that streams the row runs on
the B x NCH (row, chunk) items of `vector_grid(B * NCH)` programs; one-program-per-row kernels sit
between them. Eight launches (a row with nothing to do in one returns at once), a few B x NCH
workspace arrays allocated from the shapes:
scan        (chunks) the chunk's maximum with its first index and its smallest key; unfiltered
            rows also the chunk's argmax of z + g; top-k rows the maxima of G groups of its
            lanes (NCH x G ~ BLOCK group maxima a row, each over ~V / BLOCK logits, as tight
            as the row path's lane maxima).
sums        (chunks) M from the chunks' maxima; the chunk's limbs of S and its coarse-bracket
            sums; top-k rows: the k-th largest group maximum (a bound found alike by every
            program of the row) and the chunk's elements >= it appended in index order
            (tl.cumsum offsets) to its segment of SEG slots, NCH_P x SEG = the row path's 2048
            candidates.
plan        (rows) greedy and unfiltered rows: the lowest index among the best chunks, done.
            Filtered: r = 1 / S, the bracket, the top-k threshold among the candidates
            ([NCH_P, SEG] on chip; the whole-row search when a segment overflowed).
mass        (chunks; top-p rows whose keep_k no candidates hold) the chunk's limbs of Q and its
            refined estimates.
collect     (chunks; the same rows) Q and the guessed bound (alike in every program), the
            chunk's elements >= it into its segment.
finish      (rows) the top-p threshold among the candidates (the whole-row search when they
            overflowed or the guess was too high); the token among the candidates when they
            hold every kept element.
token       (chunks; the other rows: min-p alone, the fallbacks) the chunk's argmax of z + g
            over its kept elements.
combine     (rows) every row's token: the decided one, or the best chunk's (lowest index).
The token is the row path's bit for bit: S and Q are exact fixed-point sums (the chunks'
normalised limbs add up to the same limbs in any order); the thresholds are exact searches
whose answer does not depend on the bound the candidates were collected at (that only decides
whether they overflow, i.e. which search runs); z, p, q, the noise and the keep rules are the
row path's elementwise expressions; an argmax with ties to the lowest index is the same over
chunks as over lanes. The threshold searches stay one program per row (bisections over the
candidates on chip); so do the whole-row fallbacks, as in the row path: a nucleus of more than
~2048 logits (a flat distribution) still costs one program ~10 passes over the row. Checked
under the interpreter only: on triton-ascend the equality also assumes the shared expressions
compile to the same instructions in both paths. The scan of unfiltered rows holds the three lane
vectors of the row path's pass 1 beside the hash's (~28 live [BLOCK] vectors: 56 KB on A2/A3,
112 KB on 950).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.triton_common import cdiv, next_power_of_2, order_key
from deepinfer_ascend.kernels.common import current, launch_options, vector_grid
from deepinfer_ascend.kernels.sampling_math import (
    _MAX_KEY,
    _MIN_KEY,
    _PATH_CHUNKED,
    _PATH_TOKEN_CANDIDATES,
    NATIVE_U32,
    _carry,
    _coarse_bracket,
    _coarse_thresholds,
    _first_pass,
    _fixed_to_float,
    _guessed_bound,
    _kept,
    _kept_mass_pass,
    _lowest_index_of_max,
    _mass_of_candidates,
    _normaliser_tile,
    _perturbed,
    _refined_thresholds,
    _row_hash,
    _row_rules,
    _search_count,
    _token_pass,
    _topk_threshold,
    _topp_threshold,
    _words,
)

_CHUNK_ALIGN = 256  # chunks start at multiples of 256 logits (1 KB)
_MAX_CHUNKS = 256  # a row's candidate segments stay >= 8 slots of the 2048 held on chip

# the per-row plan the row kernels hand on: float32 and int32 columns
_F_M = tl.constexpr(0)  # the row maximum
_F_R = tl.constexpr(1)  # 1 / S
_F_Q = tl.constexpr(2)  # the top-p renormaliser
_F_TP = tl.constexpr(3)  # the top-p threshold on q
_F_XLO = tl.constexpr(4)  # the coarse bracket of the top-p threshold (logits)
_F_XHI = tl.constexpr(5)
_I_FLAGS = tl.constexpr(0)
_I_TOKEN = tl.constexpr(1)
_I_PATH = tl.constexpr(2)
_I_TK = tl.constexpr(3)  # the top-k threshold's key
_I_LOK = tl.constexpr(4)  # the lower bound the top-k candidates were collected at
_I_LOP = tl.constexpr(5)  # the lower bound the top-p candidates were collected at
_I_KMIN = tl.constexpr(6)
_PLAN_W = tl.constexpr(8)
# plan flags
_DONE = tl.constexpr(1)  # the token is decided
_HAVE_K = tl.constexpr(2)  # the top-k candidates hold every element of keep_k
_NEED_Q = tl.constexpr(4)  # top-p without such candidates: a pass for Q, then a collection at a guess
_BRACKET = tl.constexpr(8)  # the coarse bracket of the top-p threshold was found
_TOKEN_PASS = tl.constexpr(16)  # the token needs a pass over the row (the candidates do not hold every kept element)
_TP_ON = tl.constexpr(32)


@triton.jit
def _chunk_span(item, NCH, CH, V):
    """(row, chunk, start, end) of a (row, chunk) item."""
    chunk = item % NCH
    c0 = chunk * CH
    return item // NCH, chunk, c0, tl.minimum(c0 + CH, V)


@triton.jit
def _plan_of(plan_f_ptr, plan_i_ptr, row):
    """A row's plan: (its float32 columns, its int32 columns, its flags)."""
    plan_i = plan_i_ptr + row * _PLAN_W
    return plan_f_ptr + row * _PLAN_W, plan_i, tl.load(plan_i + _I_FLAGS)


@triton.jit
def _row_max(cmax_ptr, ckmin_ptr, row, NCH, NCH_P: tl.constexpr):
    """(M, kmin) of a row from its chunks' maxima and smallest keys."""
    ch = tl.arange(0, NCH_P)
    on = ch < NCH
    M = tl.max(tl.load(cmax_ptr + row * NCH + ch, mask=on, other=float("-inf")), axis=0)
    kmin = tl.min(tl.load(ckmin_ptr + row * NCH + ch, mask=on, other=_MAX_KEY), axis=0)
    return M, kmin


@triton.jit
def _best_of_chunks(val_ptr, idx_ptr, row, NCH, NCH_P: tl.constexpr):
    """The lowest index among the chunks reaching the best value (0 when it is -inf)."""
    ch = tl.arange(0, NCH_P)
    on = ch < NCH
    vmax, token = _lowest_index_of_max(
        tl.load(val_ptr + row * NCH + ch, mask=on, other=float("-inf")), tl.load(idx_ptr + row * NCH + ch, mask=on, other=_MAX_KEY)
    )
    return tl.where(vmax == float("-inf"), 0, token)


@triton.jit
def _sum_of_chunks(limbs_ptr, row, NCH, NCH_P: tl.constexpr):
    """The chunks' exact fixed-point partial sums (normalised limbs, 4 per chunk) added and rounded
    to float32: the same bits as one sum over the row, in any order."""
    base = limbs_ptr + (row * NCH + tl.arange(0, NCH_P)) * 4
    on = tl.arange(0, NCH_P) < NCH
    U = tl.sum(tl.load(base, mask=on, other=0), axis=0)
    A = tl.sum(tl.load(base + 1, mask=on, other=0), axis=0)
    B = tl.sum(tl.load(base + 2, mask=on, other=0), axis=0)
    C = tl.sum(tl.load(base + 3, mask=on, other=0), axis=0)
    U, A, B, C = _carry(U, A, B, C)
    return _fixed_to_float(U, A, B, C)


@triton.jit
def _sum_of_chunk_vectors(vec_ptr, row, NCH, NCH_P: tl.constexpr, NT: tl.constexpr):
    """The sum over a row's chunks of their [NT] float32 estimates (coarse or refined masses)."""
    ch = tl.arange(0, NCH_P)[:, None]
    return tl.sum(tl.load(vec_ptr + (row * NCH + ch) * NT + tl.arange(0, NT)[None, :], mask=ch < NCH, other=0.0), axis=0)


@triton.jit
def _store_first_index_of_max(val_ptr, idx_ptr, item, val, idx):
    """A chunk's best value and the lowest index reaching it, for the row's combine."""
    vmax, vidx = _lowest_index_of_max(val, idx)
    tl.store(val_ptr + item, vmax)
    tl.store(idx_ptr + item, vidx)


@triton.jit
def _store_limbs(limbs_ptr, item, U, A, B, C):
    tl.store(limbs_ptr + item * 4, U)
    tl.store(limbs_ptr + item * 4 + 1, A)
    tl.store(limbs_ptr + item * 4 + 2, B)
    tl.store(limbs_ptr + item * 4 + 3, C)


@triton.jit
def _append(x_ptr, i_ptr, hit, x, offs, n, SEG: tl.constexpr):
    """The hit elements of a tile stored at slots n, n + 1, ... of a segment (index order); returns
    the new count (past SEG the segment has overflowed: the extra hits are counted, not stored)."""
    h = hit.to(tl.int32)
    pos = n + tl.cumsum(h, axis=0) - 1
    put = hit & (pos < SEG)
    tl.store(x_ptr + pos, x, mask=put)
    tl.store(i_ptr + pos, offs, mask=put)
    return n + tl.sum(h, axis=0)


@triton.jit
def _load_segments(seg_x_ptr, seg_i_ptr, seg_n_ptr, row, NCH, SEG: tl.constexpr, NCH_P: tl.constexpr):
    """A row's candidates on chip: [NCH_P, SEG] (chunk c's j-th hit at [c, j]); (values, indices,
    valid, the most hits of a chunk): more than SEG means the segments are incomplete."""
    ch = tl.arange(0, NCH_P)[:, None]
    s = tl.arange(0, SEG)[None, :]
    n = tl.load(seg_n_ptr + row * NCH + ch, mask=ch < NCH, other=0)
    valid = (ch < NCH) & (s < n)
    off = (row * NCH + ch) * SEG + s
    cx = tl.load(seg_x_ptr + off, mask=valid, other=float("-inf"))
    ci = tl.load(seg_i_ptr + off, mask=valid, other=0)
    return cx, ci, valid, tl.max(tl.max(n, axis=1), axis=0)


@triton.jit
def _topk_lower_bound(gkey_ptr, row, NCH, k, kmin, kmax, G: tl.constexpr, NCH_P: tl.constexpr):
    """A key <= the row's k-th largest: the k-th largest of its chunks' group maxima (distinct
    elements; as many groups as the row kernel's lanes), or kmin with fewer than k groups."""
    ch = tl.arange(0, NCH_P)[:, None]
    g = tl.arange(0, G)[None, :]
    keys = tl.load(gkey_ptr + (row * NCH + ch) * G + g, mask=(ch < NCH) & (g < G), other=_MIN_KEY)
    valid = keys > _MIN_KEY  # an empty group holds _MIN_KEY, below every element's key
    lo = kmin.to(tl.int64)
    if k <= tl.sum(tl.sum(valid.to(tl.int32), axis=1), axis=0):
        lo = _search_count(keys, valid, k, lo, kmax.to(tl.int64))
    return lo.to(tl.int32)


@triton.jit
def _candidate_token(
    seg_x_ptr, seg_i_ptr, seg_n_ptr, row, NCH, rl, rh, td, zmax, r, Q, tk_key, tp, tp_on, thr, p_on, m_on,
    SEG: tl.constexpr, RB: tl.constexpr, NATIVE_U32: tl.constexpr,
):
    """The argmax of z + g over the kept candidates (lowest index on ties), RB segments at a time
    from the workspace (the hash's temporaries stay [RB, SEG])."""
    best = td * 0.0 + float("-inf")
    best_idx = row * 0 + _MAX_KEY
    s = tl.arange(0, SEG)[None, :]
    for c0 in range(0, NCH, RB):
        ch = c0 + tl.arange(0, RB)[:, None]
        n = tl.load(seg_n_ptr + row * NCH + ch, mask=ch < NCH, other=0)
        ok = (ch < NCH) & (s < n)
        off = (row * NCH + ch) * SEG + s
        x = tl.load(seg_x_ptr + off, mask=ok, other=float("-inf"))
        idx = tl.load(seg_i_ptr + off, mask=ok, other=0)
        keep = _kept(x, ok, td, zmax, r, Q, tk_key, tp, tp_on, thr, p_on, m_on)
        val = tl.where(keep, _perturbed(x, td, rl, rh, idx, NATIVE_U32), float("-inf"))
        vmax = tl.max(tl.max(val, axis=1), axis=0)
        vidx = tl.min(tl.min(tl.where(val == vmax, idx, _MAX_KEY), axis=1), axis=0)
        better = (vmax > best) | ((vmax == best) & (vidx < best_idx))
        best = tl.where(better, vmax, best)
        best_idx = tl.where(better, vidx, best_idx)
    return tl.where(best == float("-inf"), 0, best_idx)


@triton.jit
def _chunk_scan_kernel(
    logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr,
    cmax_ptr, cidx_ptr, ckmin_ptr, gkey_ptr, cbest_ptr, cbidx_ptr,
    B, V, CH, NCH,
    BLOCK: tl.constexpr, G: tl.constexpr, NATIVE_U32: tl.constexpr,
):
    """Pass 1, per (row, chunk): the chunk's maximum with its first index and its smallest key; for
    top-k rows the maxima of G groups of its lanes; for unfiltered rows its argmax of z + g."""
    lanes = tl.arange(0, BLOCK)
    for item in range(tl.program_id(0), B * NCH, tl.num_programs(0)):
        row, chunk, c0, c1 = _chunk_span(item, NCH, CH, V)
        lp = logits_ptr + row * stride_row
        td, greedy, k, k_on, top_p, p_on, min_p, m_on = _row_rules(temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V)
        unfiltered = (greedy == 0) & (k_on == 0) & (p_on == 0) & (m_on == 0)
        rl, rh = _row_hash(seed_ptr, pos_ptr, row, NATIVE_U32)
        lane_max, lane_idx, lane_min, best, best_idx = _first_pass(lp, c0, c1, rl, rh, td, unfiltered, BLOCK, NATIVE_U32)
        _store_first_index_of_max(cmax_ptr, cidx_ptr, item, lane_max, lane_idx)
        tl.store(ckmin_ptr + item, tl.min(lane_min, axis=0))
        if k_on & (greedy == 0):
            # a lane that held no element of the chunk (a chunk shorter than a tile) counts as no group member
            lane_key = tl.where(c0 + lanes < c1, order_key(lane_max), _MIN_KEY)
            tl.store(gkey_ptr + item * G + tl.arange(0, G), tl.max(tl.reshape(lane_key, [BLOCK // G, G]), axis=0))
        if unfiltered:
            _store_first_index_of_max(cbest_ptr, cbidx_ptr, item, best, best_idx)


@triton.jit
def _chunk_sums_kernel(
    logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, minp_ptr,
    cmax_ptr, ckmin_ptr, gkey_ptr, s_limbs_ptr, coarse_ptr, seg_x_ptr, seg_i_ptr, seg_n_ptr, plan_i_ptr,
    B, V, CH, NCH,
    BLOCK: tl.constexpr, G: tl.constexpr, SEG: tl.constexpr, NCH_P: tl.constexpr, NT: tl.constexpr,
):
    """Pass 2, per (row, chunk) of the filtered rows: the chunk's part of S (exact limbs) and of the
    top-p coarse bracket; for top-k rows its elements >= the row's bound of the k-th largest,
    appended in index order to its segment."""
    lanes = tl.arange(0, BLOCK)
    for item in range(tl.program_id(0), B * NCH, tl.num_programs(0)):
        row, chunk, c0, c1 = _chunk_span(item, NCH, CH, V)
        lp = logits_ptr + row * stride_row
        td, greedy, k, k_on, top_p, p_on, min_p, m_on = _row_rules(temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V)
        M, kmin = _row_max(cmax_ptr, ckmin_ptr, row, NCH, NCH_P)
        if (greedy == 0) & (M > float("-inf")) & (k_on | p_on | m_on):
            zmax = M / td
            lo_k = kmin
            if k_on:
                # every program of the row finds the same bound; the first chunk's keeps it for the plan
                lo_k = _topk_lower_bound(gkey_ptr, row, NCH, k, kmin, order_key(M), G, NCH_P)
                if chunk == 0:
                    tl.store(plan_i_ptr + row * _PLAN_W + _I_LOK, lo_k)
            xc = _coarse_thresholds(zmax, td, NT)
            U = kmin * 0
            A = U
            Bl = U
            C = U
            coarse = tl.zeros([NT], dtype=tl.float32)
            n = kmin * 0
            for start in range(c0, c1, BLOCK):
                offs = start + lanes
                ok = offs < c1
                x = tl.load(lp + offs, mask=ok, other=float("-inf"))
                if p_on | m_on:
                    U, A, Bl, C, coarse = _normaliser_tile(x, td, zmax, xc, p_on, U, A, Bl, C, coarse)
                if k_on:
                    n = _append(seg_x_ptr + item * SEG, seg_i_ptr + item * SEG, ok & (order_key(x) >= lo_k), x, offs, n, SEG)
            if p_on | m_on:
                _store_limbs(s_limbs_ptr, item, U, A, Bl, C)
            if p_on:
                tl.store(coarse_ptr + item * NT + tl.arange(0, NT), coarse)
            if k_on:
                tl.store(seg_n_ptr + item, n)


@triton.jit
def _row_plan_kernel(
    logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, minp_ptr,
    cmax_ptr, cidx_ptr, ckmin_ptr, cbest_ptr, cbidx_ptr, s_limbs_ptr, coarse_ptr, seg_x_ptr, seg_i_ptr, seg_n_ptr,
    plan_f_ptr, plan_i_ptr,
    B, V, NCH,
    SEG: tl.constexpr, NCH_P: tl.constexpr, SEARCH_L: tl.constexpr, NT: tl.constexpr, ROUNDS: tl.constexpr,
):
    """Per row, after pass 2: greedy and unfiltered rows get their token (the lowest index among
    the best chunks'); filtered rows S -> r, the coarse bracket of the top-p threshold, and the
    top-k threshold (among the candidates; the whole-row search when a segment overflowed)."""
    for row in range(tl.program_id(0), B, tl.num_programs(0)):
        lp = logits_ptr + row * stride_row
        td, greedy, k, k_on, top_p, p_on, min_p, m_on = _row_rules(temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V)
        M, kmin = _row_max(cmax_ptr, ckmin_ptr, row, NCH, NCH_P)
        # greedy: the lowest index among the chunks reaching M (all -inf: the reference's argmax is 0)
        token = _best_of_chunks(cmax_ptr, cidx_ptr, row, NCH, NCH_P)
        flags = kmin * 0 + _DONE
        path = kmin * 0 + _PATH_CHUNKED
        r = td * 0.0 + 1.0
        x_lo = td * 0.0
        x_hi = td * 0.0
        tk_key = kmin * 0 + _MIN_KEY
        if (greedy == 0) & (M > float("-inf")):
            if (k_on == 0) & (p_on == 0) & (m_on == 0):
                token = _best_of_chunks(cbest_ptr, cbidx_ptr, row, NCH, NCH_P)
            else:
                flags = kmin * 0
                zmax = M / td
                kmax = order_key(M)
                if p_on | m_on:
                    S = _sum_of_chunks(s_limbs_ptr, row, NCH, NCH_P)
                    r = 1.0 / S
                    if p_on:
                        coarse = _sum_of_chunk_vectors(coarse_ptr, row, NCH, NCH_P, NT)
                        x_lo, x_hi, bracket = _coarse_bracket(coarse, S, top_p, _coarse_thresholds(zmax, td, NT), M, NT)
                        if bracket != 0:
                            flags = flags | _BRACKET
                if k_on:
                    lo_k = tl.load(plan_i_ptr + row * _PLAN_W + _I_LOK).to(tl.int64)
                    cx, cidx, valid, n_max = _load_segments(seg_x_ptr, seg_i_ptr, seg_n_ptr, row, NCH, SEG, NCH_P)
                    if n_max <= SEG:
                        flags = flags | _HAVE_K
                    tk_key, path = _topk_threshold(lp, V, k, cx, valid, n_max <= SEG, lo_k, kmax, path, SEARCH_L, NT, ROUNDS)
                if p_on & ((flags & _HAVE_K) == 0):
                    flags = flags | _NEED_Q
        plan_f = plan_f_ptr + row * _PLAN_W
        tl.store(plan_f + _F_M, M)
        tl.store(plan_f + _F_R, r)
        tl.store(plan_f + _F_XLO, x_lo)
        tl.store(plan_f + _F_XHI, x_hi)
        plan_i = plan_i_ptr + row * _PLAN_W
        tl.store(plan_i + _I_FLAGS, flags)
        tl.store(plan_i + _I_TOKEN, token)
        tl.store(plan_i + _I_PATH, path)
        tl.store(plan_i + _I_TK, tk_key)
        tl.store(plan_i + _I_KMIN, kmin)


@triton.jit
def _chunk_mass_kernel(
    logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, minp_ptr, plan_f_ptr, plan_i_ptr, q_limbs_ptr, approx_ptr,
    B, V, CH, NCH,
    BLOCK: tl.constexpr, NT: tl.constexpr,
):
    """Pass 3, per (row, chunk) of the top-p rows whose keep_k is not held by candidates: the
    chunk's part of Q (exact limbs) and of the float32 estimates of the mass above NT logits evenly
    spaced in the coarse bracket."""
    for item in range(tl.program_id(0), B * NCH, tl.num_programs(0)):
        row, chunk, c0, c1 = _chunk_span(item, NCH, CH, V)
        plan_f, plan_i, flags = _plan_of(plan_f_ptr, plan_i_ptr, row)
        if (flags & _NEED_Q) != 0:
            td, greedy, k, k_on, top_p, p_on, min_p, m_on = _row_rules(temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V)
            xf = _refined_thresholds(tl.load(plan_f + _F_XLO), tl.load(plan_f + _F_XHI), NT)
            U, A, Bl, C, approx = _kept_mass_pass(
                logits_ptr + row * stride_row, c0, c1, td, tl.load(plan_f + _F_M) / td, tl.load(plan_f + _F_R), tl.load(plan_i + _I_TK), xf,
                (flags & _BRACKET) != 0, BLOCK, NT,
            )
            _store_limbs(q_limbs_ptr, item, U, A, Bl, C)
            tl.store(approx_ptr + item * NT + tl.arange(0, NT), approx)


@triton.jit
def _chunk_collect_kernel(
    logits_ptr, stride_row, topp_ptr, plan_f_ptr, plan_i_ptr, q_limbs_ptr, approx_ptr, seg_x_ptr, seg_i_ptr, seg_n_ptr,
    B, V, CH, NCH,
    BLOCK: tl.constexpr, SEG: tl.constexpr, NCH_P: tl.constexpr, NT: tl.constexpr,
):
    """Pass 4, per (row, chunk) of the same rows: Q and the guessed lower bound of the top-p
    threshold (the lowest estimate that clearly reaches top_p; every program of the row finds the
    same, the first chunk's keeps them for the plan), then the chunk's elements >= it appended to
    its segment."""
    lanes = tl.arange(0, BLOCK)
    for item in range(tl.program_id(0), B * NCH, tl.num_programs(0)):
        row, chunk, c0, c1 = _chunk_span(item, NCH, CH, V)
        plan_f, plan_i, flags = _plan_of(plan_f_ptr, plan_i_ptr, row)
        if (flags & _NEED_Q) != 0:
            lp = logits_ptr + row * stride_row
            Q = _sum_of_chunks(q_limbs_ptr, row, NCH, NCH_P)
            approx = _sum_of_chunk_vectors(approx_ptr, row, NCH, NCH_P, NT)
            xf = _refined_thresholds(tl.load(plan_f + _F_XLO), tl.load(plan_f + _F_XHI), NT)
            lo_base = tl.maximum(tl.load(plan_i + _I_KMIN), tl.load(plan_i + _I_TK))
            lo_p = _guessed_bound(lo_base, approx, xf, Q, tl.load(topp_ptr + row), (flags & _BRACKET) != 0, NT)
            if chunk == 0:
                tl.store(plan_f + _F_Q, Q)
                tl.store(plan_i + _I_LOP, lo_p)
            n = flags * 0
            for start in range(c0, c1, BLOCK):
                offs = start + lanes
                ok = offs < c1
                x = tl.load(lp + offs, mask=ok, other=float("-inf"))
                n = _append(seg_x_ptr + item * SEG, seg_i_ptr + item * SEG, ok & (order_key(x) >= lo_p), x, offs, n, SEG)
            tl.store(seg_n_ptr + item, n)


@triton.jit
def _row_finish_kernel(
    logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr,
    seg_x_ptr, seg_i_ptr, seg_n_ptr, plan_f_ptr, plan_i_ptr,
    B, V, NCH,
    SEG: tl.constexpr, NCH_P: tl.constexpr, RB: tl.constexpr, SEARCH_L: tl.constexpr, NT: tl.constexpr, ROUNDS: tl.constexpr,
    NATIVE_U32: tl.constexpr,
):
    """Per filtered row: the top-p threshold (among the candidates; the whole-row search when they
    overflowed or the guess was too high), then the token among the candidates when they hold every
    kept element (else the row is left to the token pass)."""
    for row in range(tl.program_id(0), B, tl.num_programs(0)):
        plan_f, plan_i, flags = _plan_of(plan_f_ptr, plan_i_ptr, row)
        if (flags & _DONE) == 0:
            lp = logits_ptr + row * stride_row
            td, greedy, k, k_on, top_p, p_on, min_p, m_on = _row_rules(temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V)
            M = tl.load(plan_f + _F_M)
            zmax = M / td
            kmax = order_key(M)
            r = tl.load(plan_f + _F_R)
            tk_key = tl.load(plan_i + _I_TK)
            kmin = tl.load(plan_i + _I_KMIN)
            path = tl.load(plan_i + _I_PATH)
            have = ((flags & _HAVE_K) != 0).to(tl.int32)
            cx = tl.full([NCH_P, SEG], float("-inf"), tl.float32)
            ci = tl.zeros([NCH_P, SEG], dtype=tl.int32)
            valid = ci != 0
            if k_on | p_on:
                # the segments hold the top-k candidates, or (_NEED_Q) those above the top-p guess
                cx, ci, valid, n_max = _load_segments(seg_x_ptr, seg_i_ptr, seg_n_ptr, row, NCH, SEG, NCH_P)
                if (flags & _NEED_Q) != 0:
                    have = (n_max <= SEG).to(tl.int32)
            Q = td * 0.0 + 1.0
            tp = td * 0.0
            tp_on = kmin * 0
            if p_on:
                lo_p = tl.maximum(kmin, tk_key).to(tl.int64)
                if (flags & _NEED_Q) != 0:
                    Q = tl.load(plan_f + _F_Q)
                    lo_p = tl.load(plan_i + _I_LOP).to(tl.int64)
                else:
                    # keep_k lies within the candidates: Q from them
                    Q = _mass_of_candidates(cx, valid, td, zmax, r, tk_key)
                tp, tp_on, have, path = _topp_threshold(lp, V, cx, valid, have, td, zmax, r, Q, tk_key, top_p, kmin, lo_p, kmax, path, SEARCH_L, NT, ROUNDS)
            thr = min_p * r
            if tp_on != 0:
                flags = flags | _TP_ON
            if have != 0:
                path = path | _PATH_TOKEN_CANDIDATES
                rl, rh = _row_hash(seed_ptr, pos_ptr, row, NATIVE_U32)
                token = _candidate_token(
                    seg_x_ptr, seg_i_ptr, seg_n_ptr, row, NCH, rl, rh, td, zmax, r, Q, tk_key, tp, tp_on, thr, p_on, m_on, SEG, RB, NATIVE_U32
                )
                tl.store(plan_i + _I_TOKEN, token)
                flags = flags | _DONE
            else:
                flags = flags | _TOKEN_PASS
            tl.store(plan_f + _F_Q, Q)
            tl.store(plan_f + _F_TP, tp)
            tl.store(plan_i + _I_FLAGS, flags)
            tl.store(plan_i + _I_PATH, path)


@triton.jit
def _chunk_token_kernel(
    logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr, plan_f_ptr, plan_i_ptr, cbest_ptr, cbidx_ptr,
    B, V, CH, NCH,
    BLOCK: tl.constexpr, NATIVE_U32: tl.constexpr,
):
    """The token pass, per (row, chunk) of the rows whose candidates do not hold every kept element:
    the chunk's argmax of z + g over its kept elements."""
    for item in range(tl.program_id(0), B * NCH, tl.num_programs(0)):
        row, chunk, c0, c1 = _chunk_span(item, NCH, CH, V)
        plan_f, plan_i, flags = _plan_of(plan_f_ptr, plan_i_ptr, row)
        if (flags & _TOKEN_PASS) != 0:
            td, greedy, k, k_on, top_p, p_on, min_p, m_on = _row_rules(temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V)
            r = tl.load(plan_f + _F_R)
            rl, rh = _row_hash(seed_ptr, pos_ptr, row, NATIVE_U32)
            bmax, bidx = _token_pass(
                logits_ptr + row * stride_row, c0, c1, rl, rh, td, tl.load(plan_f + _F_M) / td, r, tl.load(plan_f + _F_Q),
                tl.load(plan_i + _I_TK), tl.load(plan_f + _F_TP), (flags & _TP_ON) != 0, min_p * r, p_on, m_on, BLOCK, NATIVE_U32,
            )
            tl.store(cbest_ptr + item, bmax)
            tl.store(cbidx_ptr + item, bidx)


@triton.jit
def _row_token_kernel(
    plan_i_ptr, cbest_ptr, cbidx_ptr, out_ptr, path_ptr,
    B, NCH,
    NCH_P: tl.constexpr, RECORD_PATH: tl.constexpr,
):
    """Every row's token: decided by a row kernel, or the best of its chunks' in the token pass."""
    for row in range(tl.program_id(0), B, tl.num_programs(0)):
        plan_i = plan_i_ptr + row * _PLAN_W
        flags = tl.load(plan_i + _I_FLAGS)
        token = tl.load(plan_i + _I_TOKEN)
        if (flags & _TOKEN_PASS) != 0:
            token = _best_of_chunks(cbest_ptr, cbidx_ptr, row, NCH, NCH_P)
        tl.store(out_ptr + row, token.to(tl.int64))
        if RECORD_PATH:
            tl.store(path_ptr + row, tl.load(plan_i + _I_PATH))


def _chunking(B: int, V: int, chunks: int | None) -> tuple[int, int] | None:
    """(chunk length, chunks per row) for the small-batch path, or None for the row kernel.
    Automatic (chunks None): as many chunks per row as the vector cores left per row (the count
    the grid helper caps at), when that gives at least two; a forced count (tests) takes the path
    whatever the batch, 0 forces the row kernel. Chunks start at multiples of _CHUNK_ALIGN logits."""
    if chunks is not None and chunks <= 0:
        return None
    want = current().num_vectorcore // B if chunks is None else chunks
    want = max(1, min(want, _MAX_CHUNKS))
    length = cdiv(cdiv(V, want), _CHUNK_ALIGN) * _CHUNK_ALIGN
    n = cdiv(V, length)
    if chunks is None and n < 2:
        return None
    return length, n


def _sample_chunked(x, rules, seeds, positions, out, paths, length, n, sizes):
    """The small-batch path: eight launches over (row, chunk) items and rows (module docstring).
    The workspace is allocated from the shapes alone (no host synchronisation: graph capture)."""
    B, V = x.shape
    dev = x.device
    nch_p = next_power_of_2(n)
    block = sizes["BLOCK"]
    groups = min(block, max(8, block // nch_p))  # about BLOCK group maxima a row, as the row kernel's lanes
    seg = max(1, sizes["CAND_R"] * sizes["CAND_L"] // nch_p)  # [nch_p, seg] candidates on chip
    rb = max(1, min(nch_p, sizes["CAND_L"] // seg))  # segments hashed at a time by the candidate token
    nt, items = sizes["NT"], B * n

    def f32(*shape):
        return torch.empty(shape, dtype=torch.float32, device=dev)

    def i32(*shape):
        return torch.empty(shape, dtype=torch.int32, device=dev)

    cmax, cidx, ckmin, gkey, cbest, cbidx = f32(items), i32(items), i32(items), i32(items, groups), f32(items), i32(items)
    s_limbs, coarse, q_limbs, approx = i32(items, 4), f32(items, nt), i32(items, 4), f32(items, nt)
    seg_x, seg_i, seg_n = f32(items, seg), i32(items, seg), i32(items)
    plan_f, plan_i = f32(B, _PLAN_W.value), i32(B, _PLAN_W.value)
    seed_w, pos_w = _words(seeds), _words(positions)
    chunk_grid, row_grid = (vector_grid(items),), (vector_grid(B),)
    stream = (x, x.stride(0), *rules)
    opts = launch_options()
    _chunk_scan_kernel[chunk_grid](
        *stream, seed_w, pos_w, cmax, cidx, ckmin, gkey, cbest, cbidx, B, V, length, n,
        BLOCK=block, G=groups, NATIVE_U32=NATIVE_U32, **opts,
    )
    _chunk_sums_kernel[chunk_grid](
        *stream, cmax, ckmin, gkey, s_limbs, coarse, seg_x, seg_i, seg_n, plan_i, B, V, length, n,
        BLOCK=block, G=groups, SEG=seg, NCH_P=nch_p, NT=nt, **opts,
    )
    _row_plan_kernel[row_grid](
        *stream, cmax, cidx, ckmin, cbest, cbidx, s_limbs, coarse, seg_x, seg_i, seg_n, plan_f, plan_i, B, V, n,
        SEG=seg, NCH_P=nch_p, SEARCH_L=sizes["SEARCH_L"], NT=nt, ROUNDS=sizes["ROUNDS"], **opts,
    )
    _chunk_mass_kernel[chunk_grid](*stream, plan_f, plan_i, q_limbs, approx, B, V, length, n, BLOCK=block, NT=nt, **opts)
    _chunk_collect_kernel[chunk_grid](
        x, x.stride(0), rules[2], plan_f, plan_i, q_limbs, approx, seg_x, seg_i, seg_n, B, V, length, n,
        BLOCK=block, SEG=seg, NCH_P=nch_p, NT=nt, **opts,
    )
    _row_finish_kernel[row_grid](
        *stream, seed_w, pos_w, seg_x, seg_i, seg_n, plan_f, plan_i, B, V, n,
        SEG=seg, NCH_P=nch_p, RB=rb, SEARCH_L=sizes["SEARCH_L"], NT=nt, ROUNDS=sizes["ROUNDS"], NATIVE_U32=NATIVE_U32, **opts,
    )
    _chunk_token_kernel[chunk_grid](*stream, seed_w, pos_w, plan_f, plan_i, cbest, cbidx, B, V, length, n, BLOCK=block, NATIVE_U32=NATIVE_U32, **opts)
    _row_token_kernel[row_grid](plan_i, cbest, cbidx, out, paths if paths is not None else out, B, n, NCH_P=nch_p, RECORD_PATH=paths is not None, **opts)
    return out
