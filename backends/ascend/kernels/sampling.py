"""Ascend Triton kernels: `sample` (greedy / temperature / top-k / top-p / min-p with the stateless
Gumbel noise of `sampling_uniform`) and `apply_token_bitmask`.

sample
    Two paths, chosen from the batch's shape alone and giving every row the same token bit for bit,
    so the op stays batch-invariant. Small batches (at most half as many rows as vector cores, and
    V > 256) take the chunked path of `sampling_chunked`, each row cut into chunks over several
    programs; the others take the row path below. What both paths compute alike (exact
    fixed-point sums, the noise hash, p, the threshold searches) is in `sampling_math`.

    Row path (more than half as many rows as vector cores, or V <= 256). Grid: `vector_grid(B)`
    programs, each looping over its rows (one row per iteration). A row is streamed from global
    memory in BLOCK-wide tiles; no sort, no scratch memory, no host synchronisation; every row
    takes its own parameters. Filter thresholds are found as float *keys* (float32 bits mapped to
    an order-preserving int32), so a threshold is always an element's value and ties behave as the
    reference's `>=`.

    pass 1      lane maxima with their first index: the row maximum M and the greedy token (lowest
                index among the maxima). Greedy rows, and rows that are all -inf, end here.
    pass 2      (top-p or min-p) S = sum exp(z - zmax), z = logits / t, summed exactly
                (`sampling_math`); r = 1 / S, p = exp(z - zmax) * r. For top-p the same pass
                estimates (float32) the mass above 16 logits zmax - 0.25 e^{0.3 j}: a coarse bracket
                of the top-p threshold.
    top-k       the k-th largest logit is >= the k-th largest lane maximum (the lane maxima are
                distinct elements), found on chip by bisection over the BLOCK lane keys. One pass
                collects every element >= that bound into per-lane slots ([CAND_R, CAND_L]: lane
                j's i-th hit at [i, j], in index order; no prefix sum, no scatter); the k-th
                largest key is then bisected among the candidates on chip.
    top-p       Q = sum of p over keep_k, q = p / Q. The reference keeps q >= the last q of the
                shortest descending prefix whose cumulative sum reaches top_p; equivalently the
                threshold is q(kappa) for the largest key kappa with
                round32(sum of q over keep_k with key >= kappa) >= top_p (q is monotone in the
                logit). With the top-k candidates (they hold all of keep_k) Q and kappa come from
                them. Otherwise a pass computes Q and refines the bracket (16 evenly spaced
                estimates); the lowest estimate that clearly reaches top_p is a guessed lower bound,
                a pass collects the elements above it, and kappa is bisected among them; the guess
                is then checked exactly (the mass above it reaches top_p) - a wrong guess costs the
                fallback. If the whole of keep_k does not reach top_p (rounding), every q is kept,
                as in the reference.
    min-p       p >= min_p * max p, max p = p(M) = r.
    token       argmax over the kept v of z[v] + g[v] (lowest index on ties), g = -log(-log(u)),
                u from the hash in the kernel; among the candidates when they hold every kept
                element (top-k or top-p on), else one more pass over the row.
    fallback    when a lane gets more than CAND_R candidates (top_k > BLOCK, a very flat nucleus,
                e.g. top_p 0.95 at temperature 2 over 129k tokens), the thresholds are searched over
                the whole row: 16 thresholds per pass ([SEARCH_L, 16] tiles), the key interval
                shrinking 15-fold per pass (<= 9 passes), and the token takes a last pass.

    Residual differences from the reference (documented, not hidden): exp and log are the
    device's (torch's CPU ones are its own vectorised versions; numpy's under the interpreter), and
    S and Q are exactly rounded sums where torch's float32 sums round along the way. p and q can
    therefore differ in the last bit, which changes a token only when a filter boundary is that
    close (a cumulative mass within ~1e-7 of top_p, p within an ulp of min_p * max p) or two
    perturbed values z + g are within an ulp; z, u, the top-k threshold and greedy are exact.

    Budget (half the unified buffer: 96 KB on A2/A3, 128 KB on 950): BLOCK from ~25 live [BLOCK]
    4-byte vectors (the hash in the last pass) -> 512 (A2/A3) / 1024 (950); candidates from ~10
    live [CAND_R, CAND_L] arrays -> 8 x 256 on both (the hash runs on one [CAND_L] row of slots at
    a time); the fallback's [256, 16] threshold tiles (4 live int32 arrays, 64 KB).

apply_token_bitmask
    Grid: `vector_grid(n_tiles)` programs over (row, block of BLOCK_W words) tiles, in place. A tile
    is [BLOCK_W, 32]: word w's bits against a column of bit indices, so logits are addressed
    contiguously (row offset w * 32 + bit) with no gather; the bit is read with an arithmetic shift
    and `& 1`, right for bit 31 (the sign bit) too. Forbidden logits get -inf by a masked store.
    float64 logits (a test dtype) go to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.sampling import apply_token_bitmask as _reference_bitmask
from deepinfer.triton_common import cdiv, next_power_of_2, order_key
from deepinfer_ascend.kernels.common import Registration, current, launch_options, vector_grid
from deepinfer_ascend.kernels.sampling_chunked import _chunking, _sample_chunked
from deepinfer_ascend.kernels.sampling_math import (
    _MAX_KEY,
    _MIN_KEY,
    _PATH_TOKEN_CANDIDATES,
    NATIVE_U32,
    _coarse_bracket,
    _coarse_thresholds,
    _first_pass,
    _fixed_to_float,
    _guessed_bound,
    _hash_uniform_halves,
    _keep_first_max,
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

_NT = 16  # thresholds per pass of a fallback search
_ROUNDS = 9  # fallback passes that narrow any int32 key interval to one key: 15^9 > 2^32
_SEARCH_LANES = 256  # tile of the fallback searches: [256, 16] threshold tiles
_CAND_LANES = 256  # candidate collection: lanes x slots per lane held on chip


@triton.jit
def _uniform_kernel(seed_ptr, pos_ptr, out_ptr, V, BLOCK: tl.constexpr, NATIVE_U32: tl.constexpr):
    """Test hook: sampling_uniform for one row per program."""
    row = tl.program_id(0)
    rl, rh = _row_hash(seed_ptr, pos_ptr, row, NATIVE_U32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + row * V + offs, _hash_uniform_halves(rl, rh, offs, NATIVE_U32), mask=offs < V)


# ---------------------------------------------------------------------------------------------
# sample: the row path's candidates, held on chip


@triton.jit
def _collect(lp, V, lo_key, R: tl.constexpr, L: tl.constexpr):
    """One pass: every element with key >= lo_key into per-lane slots ([R, L]: lane j's i-th hit at
    [i, j], in index order). Returns (values, indices, valid, the most hits of a lane): more than
    R means the slots are incomplete."""
    lanes = tl.arange(0, L)
    slots = tl.arange(0, R)
    cx = tl.full([R, L], float("-inf"), tl.float32)
    ci = tl.zeros([R, L], dtype=tl.int32)
    cnt = tl.zeros([L], dtype=tl.int32)
    for start in range(0, V, L):
        offs = start + lanes
        ok = offs < V
        x = tl.load(lp + offs, mask=ok, other=float("-inf"))
        hit = ok & (order_key(x) >= lo_key)
        put = (slots[:, None] == cnt[None, :]) & hit[None, :]
        cx = tl.where(put, x[None, :], cx)
        ci = tl.where(put, offs[None, :], ci)
        cnt += hit.to(tl.int32)
    valid = slots[:, None] < cnt[None, :]
    return cx, ci, valid, tl.max(cnt, axis=0)


# ---------------------------------------------------------------------------------------------
# sample: the kernel


@triton.jit
def _sample_kernel(
    logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr, out_ptr, path_ptr,
    B, V,
    BLOCK: tl.constexpr,  # streaming passes
    CAND_R: tl.constexpr,  # candidate slots per lane
    CAND_L: tl.constexpr,  # candidate lanes
    SEARCH_L: tl.constexpr,  # fallback search tile
    NT: tl.constexpr,
    ROUNDS: tl.constexpr,
    NATIVE_U32: tl.constexpr,
    RECORD_PATH: tl.constexpr,  # tests: which searches each row took (PATH_* flags)
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    for row in range(pid, B, nprog):
        path = tl.program_id(0) * 0
        lp = logits_ptr + row * stride_row
        td, greedy, k, k_on, top_p, p_on, min_p, m_on = _row_rules(temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V)

        # pass 1: lane maxima (first index per lane), the row maximum, the greedy token (the noise
        # comes later: no hash state yet)
        lane_max, lane_idx, lane_min, _, _ = _first_pass(lp, 0, V, 0, 0, td, False, BLOCK, NATIVE_U32)
        M, token = _lowest_index_of_max(lane_max, lane_idx)
        token = tl.where(M == float("-inf"), 0, token)  # all -inf: the reference's argmax is 0
        if (greedy == 0) & (M > float("-inf")):
            zmax = M / td
            kmax = order_key(M)
            kmin = tl.min(lane_min, axis=0)
            lane_key = order_key(lane_max)[None, :]  # [1, BLOCK]: distinct elements of the row
            # pass 2 (top-p, min-p): the softmax normaliser, summed exactly
            r = td * 0.0 + 1.0
            # top-p, a coarse bracket of its threshold: float32 estimates of the mass above NT logits
            xc = _coarse_thresholds(zmax, td, NT)
            x_lo = zmax * 0.0
            x_hi = zmax * 0.0
            bracket = kmin * 0
            if p_on | m_on:
                U = kmin * 0
                A = U
                Bl = U
                C = U
                coarse = tl.zeros([NT], dtype=tl.float32)
                for start in range(0, V, BLOCK):
                    offs = start + lanes
                    x = tl.load(lp + offs, mask=offs < V, other=float("-inf"))
                    U, A, Bl, C, coarse = _normaliser_tile(x, td, zmax, xc, p_on, U, A, Bl, C, coarse)
                S = _fixed_to_float(U, A, Bl, C)
                r = 1.0 / S
                x_lo, x_hi, bracket = _coarse_bracket(coarse, S, top_p, xc, M, NT)

            # candidates: a set {key >= lo} held on chip that is known to contain every kept element
            have = kmin * 0
            cx = tl.full([CAND_R, CAND_L], float("-inf"), tl.float32)
            ci = tl.zeros([CAND_R, CAND_L], dtype=tl.int32)
            valid = ci != 0
            n_slots = kmin * 0
            # keep_k: the k-th largest logit's key; it is >= the k-th largest lane maximum
            tk_key = kmin * 0 + _MIN_KEY
            if k_on:
                lo_k = kmin.to(tl.int64)
                if k <= BLOCK:
                    lo_k = _search_count(lane_key, lane_key == lane_key, k, lo_k, kmax.to(tl.int64))
                cx, ci, valid, n_slots = _collect(lp, V, lo_k.to(tl.int32), CAND_R, CAND_L)
                have = (n_slots <= CAND_R).to(tl.int32)
                tk_key, path = _topk_threshold(lp, V, k, cx, valid, have != 0, lo_k, kmax, path, SEARCH_L, NT, ROUNDS)
            # keep_p: q = p / Q over keep_k; threshold q(kappa) (see the module docstring)
            Q = td * 0.0 + 1.0
            tp = td * 0.0
            tp_on = kmin * 0
            if p_on:
                lo_p = tl.maximum(kmin, tk_key).to(tl.int64)
                if have != 0:
                    # keep_k lies within the candidates: Q from them
                    Q = _mass_of_candidates(cx, valid, td, zmax, r, tk_key)
                else:
                    # a pass for Q, which also refines the bracket: float32 estimates of the mass above
                    # NT logits evenly spaced in it; the largest one that clearly reaches top_p is a
                    # guess for a lower bound, checked exactly among the candidates
                    xf = _refined_thresholds(x_lo, x_hi, NT)
                    U, A, Bl, C, approx = _kept_mass_pass(lp, 0, V, td, zmax, r, tk_key, xf, bracket != 0, BLOCK, NT)
                    Q = _fixed_to_float(U, A, Bl, C)
                    lo_p = _guessed_bound(tl.maximum(kmin, tk_key), approx, xf, Q, top_p, bracket != 0, NT).to(tl.int64)
                    cx, ci, valid, n_slots = _collect(lp, V, lo_p.to(tl.int32), CAND_R, CAND_L)
                    have = (n_slots <= CAND_R).to(tl.int32)
                tp, tp_on, have, path = _topp_threshold(lp, V, cx, valid, have, td, zmax, r, Q, tk_key, top_p, kmin, lo_p, kmax, path, SEARCH_L, NT, ROUNDS)
            # keep_m: p >= min_p * max p, max p = p(M) = exp(0) * r
            thr = min_p * r
            # the token: argmax of z + g over the kept elements, lowest index on ties
            rl, rh = _row_hash(seed_ptr, pos_ptr, row, NATIVE_U32)
            if have != 0:
                # every kept element is a candidate; the slots are hashed one row of lanes at a
                # time (a [CAND_L] vector), so the hash's temporaries stay small
                path = path | _PATH_TOKEN_CANDIDATES
                ckeep = _kept(cx, valid, td, zmax, r, Q, tk_key, tp, tp_on, thr, p_on, m_on)
                slot_ar = tl.arange(0, CAND_R)[:, None]
                cbest = tl.full([CAND_L], float("-inf"), tl.float32)
                cbest_idx = tl.full([CAND_L], _MAX_KEY, tl.int32)
                for i in range(0, n_slots):
                    on = slot_ar == i
                    xi = tl.max(tl.where(on, cx, float("-inf")), axis=0)
                    ii = tl.max(tl.where(on, ci, 0), axis=0)
                    ki = tl.max(tl.where(on & ckeep, 1, 0), axis=0) > 0
                    # a lane's slots are in index order: ties keep the lowest index
                    cbest, cbest_idx = _keep_first_max(tl.where(ki, _perturbed(xi, td, rl, rh, ii, NATIVE_U32), float("-inf")), ii, cbest, cbest_idx)
                bmax, token = _lowest_index_of_max(cbest, cbest_idx)
            else:
                bmax, token = _token_pass(lp, 0, V, rl, rh, td, zmax, r, Q, tk_key, tp, tp_on, thr, p_on, m_on, BLOCK, NATIVE_U32)
            token = tl.where(bmax == float("-inf"), 0, token)  # nothing kept above -inf: index 0
        tl.store(out_ptr + row, token.to(tl.int64))
        if RECORD_PATH:
            tl.store(path_ptr + row, path)


def _sample_sizes() -> dict:
    """Tile sizes from the chip's unified buffer (half of it per kernel):
    BLOCK (streaming passes, the final one the widest: ~25 live [BLOCK] int32/float32 vectors of the
    hash and the rules) and CAND_R x CAND_L candidate slots (values, indices, keys, three limbs,
    masks and a selection: ~10 live [R, L] arrays of 4 bytes; the hash runs on one [L] row of
    slots at a time)."""
    budget = current().ub_bytes // 2
    block = 1 << ((budget // (25 * 4)).bit_length() - 1)
    block = max(256, min(block, 1024))  # <= 1024: the limb sums' int32 headroom
    cand_r = 1 << ((budget // (10 * 4 * _CAND_LANES)).bit_length() - 1)
    return dict(BLOCK=block, CAND_R=max(4, min(cand_r, 2048 // _CAND_LANES)), CAND_L=_CAND_LANES, SEARCH_L=_SEARCH_LANES, NT=_NT, ROUNDS=_ROUNDS)


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
    if all_greedy:  # every row greedy (the contract): the same kernels with zero temperatures, whose rows skip the filters
        temperature = torch.zeros_like(temperature)
    return _sample(logits, temperature, top_k, top_p, min_p, seeds, positions)


def _sample(logits, temperature, top_k, top_p, min_p, seeds, positions, paths=None, chunks=None, **sizes):
    """`sample` with tile sizes overridable (tests force the fallback paths with tiny candidate
    slots), the path forced (`chunks`: a chunk count for the small-batch path, 0 for the row
    kernel; None chooses from the batch) and, given `paths` (int32 [B]), the searches each row
    took recorded: PATH_* flags (`sampling_math`)."""
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    x = logits if logits.dtype == torch.float32 else logits.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    if (B - 1) * x.stride(0) + V >= 2**31:
        raise ValueError(f"sample (ascend Triton): logits of {B}x{V} exceed int32 offsets")
    sizes = {**_sample_sizes(), **sizes}
    rules = (
        temperature.to(torch.float32).contiguous(),
        top_k.to(torch.int32).contiguous(),
        top_p.to(torch.float32).contiguous(),
        min_p.to(torch.float32).contiguous(),
    )
    chunking = _chunking(B, V, chunks)
    if chunking is not None:
        return _sample_chunked(x, rules, seeds, positions, out, paths, *chunking, sizes)
    _sample_kernel[(vector_grid(B),)](
        x, x.stride(0), *rules,
        _words(seeds), _words(positions), out, paths if paths is not None else out,
        B, V,
        **sizes, NATIVE_U32=NATIVE_U32, RECORD_PATH=paths is not None,
        **launch_options(),
    )
    return out


def uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, native_u32: bool = NATIVE_U32) -> torch.Tensor:
    """The kernel's `sampling_uniform` (for tests: it must equal the reference bit for bit)."""
    B = seeds.shape[0]
    out = torch.empty(B, vocab_size, dtype=torch.float32, device=seeds.device)
    if B and vocab_size:
        _uniform_kernel[(B,)](_words(seeds), _words(positions), out, vocab_size, BLOCK=1024, NATIVE_U32=native_u32)
    return out


# ---------------------------------------------------------------------------------------------
# apply_token_bitmask

_BITMASK_WORDS = 64  # words per tile: [64, 32] logits


@triton.jit
def _bitmask_kernel(
    logits_ptr, mask_ptr,
    R, V, W, stride_l, stride_m,
    BLOCK_W: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    w_tiles = tl.cdiv(W, BLOCK_W)
    n_tiles = R * w_tiles
    bit = tl.arange(0, 32)
    w_ar = tl.arange(0, BLOCK_W)
    for tile in range(pid, n_tiles, nprog):
        row = tile // w_tiles
        words = (tile % w_tiles) * BLOCK_W + w_ar
        word = tl.load(mask_ptr + row * stride_m + words, mask=words < W, other=-1)
        allowed = ((word[:, None] >> bit[None, :]) & 1) != 0  # arithmetic shift: bit 31 reads right
        v = words[:, None] * 32 + bit[None, :]
        neg = tl.full([BLOCK_W, 32], float("-inf"), logits_ptr.dtype.element_ty)
        tl.store(logits_ptr + row * stride_l + v, neg, mask=(v < V) & (allowed == 0))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    if tuple(bitmask.shape) != (rows, (vocab + 31) // 32):
        raise ValueError(f"bitmask has shape {tuple(bitmask.shape)}, expected ({rows}, {(vocab + 31) // 32}) for logits {tuple(logits.shape)}")
    if rows == 0 or vocab == 0:
        return logits
    if logits.dtype == torch.float64 or logits.numel() >= 2**31:
        return _reference_bitmask(logits, bitmask)
    if logits.stride(-1) != 1:
        # in place on a non-unit-stride view: fill a contiguous copy, write it back
        tmp = logits.contiguous()
        apply_token_bitmask(tmp, bitmask)
        return logits.copy_(tmp)
    m = bitmask if bitmask.dtype == torch.int32 else bitmask.to(torch.int32)
    m = m if m.stride(-1) == 1 else m.contiguous()
    words = m.shape[1]
    block_w = max(1, min(_BITMASK_WORDS, next_power_of_2(words)))
    n_tiles = rows * cdiv(words, block_w)
    _bitmask_kernel[(vector_grid(n_tiles),)](
        logits, m, rows, vocab, words, logits.stride(0), m.stride(0),
        BLOCK_W=block_w, **launch_options(),
    )
    return logits


REGISTRATIONS = [
    # Invariant as it is: the row path (one row per loop iteration, tiles from the chip only) and the small-batch chunked
    # path give every row the same bits (exact fixed-point sums, exact searches, hashed noise), so the path may follow B.
    Registration(
        op="sample",
        fn=sample,
        batch_invariant=True,
        note="Triton (ascend): row per program iteration, small batches chunked over the vector cores; no sort: threshold searches over float keys, "
        "exact fixed-point sums, in-kernel hash noise",
    ),
    # Invariant as it is: no arithmetic, a row's forbidden logits set to -inf.
    Registration(op="apply_token_bitmask", fn=apply_token_bitmask, batch_invariant=True, note="Triton (ascend): in place, [words, 32] tiles"),
]
