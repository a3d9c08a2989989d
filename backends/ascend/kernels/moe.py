"""Ascend Triton kernels: the MoE gate, and moving token copies to their experts (`dispatch`) and
back (`combine`). Every kernel runs on a persistent vector grid (`vector_grid(n_tiles)` programs,
each looping `for tile in range(pid, n_tiles, num_programs)`), int32 index arithmetic throughout.

gate
    A tile is BLOCK_T tokens x BLOCK_E experts of router logits (float32): scores (softmax /
    sigmoid / sqrt-softplus), the correction bias, the group-limited mask (group score = sum of
    the top-2 biased scores, or the max without a bias; losing groups -> -inf, as DeepSeek's
    reference), then top_k rounds of "max, lowest index among the maxima, mark taken" (what the
    reference's stable descending sort picks: ties to the lowest index), renormalise and scale.
    Hash routing (V4's first layers) skips the selection: each token's ids are loaded from its row
    of the table (token ids read on the device) and weighed by their scores.
    Budget: ~8 live float32/int32 values per tile element (logits, scores, selection, taken,
    candidates, masks) = 32 bytes x BLOCK_T x BLOCK_E under half the unified buffer: 2048
    elements (A2/A3: 96 KB budget; 950: 128 KB -> 4096), e.g. 8 (16) tokens of 256 experts.

dispatch (a counting sort by expert, stable in slot order; three launches, no host sync)
    1. count (vector grid over tiles of BLOCK_S = 64 slots): each slot's rank among the earlier
       slots of its tile with the same expert ([64, 64] compare matrix), and the tile's
       per-expert histogram ([64 experts, 64 slots] one-hot per expert chunk), stored [n_tiles, E].
    2. scan (one program): per chunk of 64 experts, the exclusive prefix of the histograms over the
       tiles (in tile order, [16 tiles, 64 experts] blocks with tl.cumsum along the tiles), the
       experts' totals and their exclusive scan -> expert_offsets [E + 1] int32.
    3. copy (vector grid over token x column-chunk tiles): slot t*K+k goes to row
       expert_offsets[e] + tile_prefix[tile, e] + rank; row_of_slot is written by the first chunk,
       and the token's row chunk is read once and stored to its K rows.
    Budget: [64, 64] int32 matrices (16 KB each); the copy tile is K x BLOCK_D <= 16 KB.
    Rows are copied as raw bits (float64 as int32 pairs, 1-byte types as int8): exact.

combine
    A tile is one token x BLOCK_D columns: its K rows gathered through row_of_slot, weighted sum in
    the fixed order k = 0..K-1 in float32, then the token's `add` row (a shared expert's output) when
    given, cast to the output dtype once. Budget: a few BLOCK_D float32 vectors (BLOCK_D <= 2048).

Deterministic mode: dispatch and combine are batch-invariant as they are (exact copies; a fixed
k order per token). The gate's BLOCK_T follows T, and its softmax normaliser and renormalisation
are tl.sum over a [BLOCK_T, ...] tile's axis 1, whose reduction tree the hardware may choose by
the tile's shape: `gate_invariant` always takes the most tokens the buffer holds (BLOCK_T from E
and the chip only). Cost: a decode batch's tile is mostly masked rows (a few idle vector lanes).

float64 logits / expert_out (a test dtype: the vector units have no float64 arithmetic) go to the
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.moe import SCORE_FUNCS, check_combine_add, check_gate_args, check_hash_routing, require_local_experts
from deepinfer.ops.moe import combine as _reference_combine
from deepinfer.ops.moe import gate as _reference_gate
from deepinfer.triton_common import cdiv, log1p_from_log, next_power_of_2
from deepinfer_ascend.kernels.common import Registration, launch_options, tile_elems, to_output, vector_grid

_INT32_LIMIT = 2**31

# ---------------------------------------------------------------------------------------------
# gate

_GATE_BYTES_PER_ELEM = 32


@triton.jit
def _gate_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, table_ptr, tok_ids_ptr,
    T, E, stride_t, group_size, scale, stride_table,
    TOP_K: tl.constexpr,
    SCORE: tl.constexpr,  # 0 softmax, 1 sigmoid, 2 sqrtsoftplus
    HASH: tl.constexpr,  # hash routing: token t's experts are table[tok_ids[t]] (nothing selected)
    HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_tiles = tl.cdiv(T, BLOCK_T)
    ex = tl.arange(0, BLOCK_E)
    e_ok = ex < E
    k_ar = tl.arange(0, BLOCK_K)
    big = BLOCK_E + BLOCK_G
    if HAS_BIAS:
        bias = tl.load(bias_ptr + ex, mask=e_ok, other=0.0).to(tl.float32)
    for tile in range(pid, n_tiles, nprog):
        tok = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = tok < T
        ok = t_ok[:, None] & e_ok[None, :]
        x = tl.load(logits_ptr + tok[:, None] * stride_t + ex[None, :], mask=ok, other=float("-inf"))
        if SCORE == 0:
            mx = tl.where(t_ok, tl.max(x, axis=1), 0.0)  # padding rows: no -inf - -inf
            num = tl.where(ok, tl.exp(x - mx[:, None]), 0.0)
            s = num / tl.where(t_ok, tl.sum(num, axis=1), 1.0)[:, None]
        elif SCORE == 1:
            s = 1.0 / (1.0 + tl.exp(-x))
        else:
            # torch's softplus (beta 1, threshold 20): x past the threshold, else log1p(exp(x))
            sp = tl.where(x > 20.0, x, log1p_from_log(tl.exp(tl.minimum(x, 20.0))))
            s = tl.sqrt(sp)
        s = tl.where(ok, s, 0.0)
        if HAS_BIAS:
            sel = s + bias[None, :]
        else:
            sel = s
        sel = tl.where(e_ok[None, :], sel, float("-inf"))

        if N_GROUP > 1:
            gid = ex // group_size  # padding columns get ids >= N_GROUP: in no group
            g_ar = tl.arange(0, BLOCK_G)
            g_valid = (g_ar < N_GROUP)[None, :]
            gscore = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
            for g in tl.static_range(N_GROUP):
                v = tl.where((gid == g)[None, :], sel, float("-inf"))
                m1 = tl.max(v, axis=1)
                if HAS_BIAS:
                    # top-2 sum: the best plus the best of the rest (a tie counts twice, as topk(2))
                    i1 = tl.min(tl.where(v == m1[:, None], ex[None, :], big), axis=1)
                    m2 = tl.max(tl.where(ex[None, :] == i1[:, None], float("-inf"), v), axis=1)
                    gs = m1 + m2
                else:
                    gs = m1
                gscore = tl.where(g_ar[None, :] == g, gs[:, None], gscore)
            gkept = tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.int32)
            for _ in tl.static_range(TOPK_GROUP):
                cand = tl.where((gkept == 0) & g_valid, gscore, float("-inf"))
                mg = tl.max(cand, axis=1)
                ig = tl.min(tl.where((cand == mg[:, None]) & g_valid & (gkept == 0), g_ar[None, :], big), axis=1)
                gkept = tl.where(g_ar[None, :] == ig[:, None], 1, gkept)
            keep = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
            for g in tl.static_range(N_GROUP):
                has_g = tl.max(tl.where(g_ar[None, :] == g, gkept, 0), axis=1)
                keep = tl.where((gid == g)[None, :] & (has_g[:, None] > 0), 1, keep)
            sel = tl.where(keep > 0, sel, float("-inf"))

        taken = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
        ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
        wts = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        if HASH:
            tid = tl.load(tok_ids_ptr + tok, mask=t_ok, other=0).to(tl.int32)  # (vocabularies are far below 2^31 rows)
        for j in tl.static_range(TOP_K):
            if HASH:  # the table's j-th expert, weighed by its score (an exact masked sum picks it)
                ij = tl.load(table_ptr + tid * stride_table + j, mask=t_ok, other=0).to(tl.int32)
                hit = ex[None, :] == ij[:, None]
            else:
                free = (taken == 0) & e_ok[None, :]
                cand = tl.where(free, sel, float("-inf"))
                mv = tl.max(cand, axis=1)
                ij = tl.min(tl.where((cand == mv[:, None]) & free, ex[None, :], big), axis=1)
                hit = ex[None, :] == ij[:, None]
                taken = tl.where(hit, 1, taken)
            wj = tl.sum(tl.where(hit, s, 0.0), axis=1)
            ids = tl.where(k_ar[None, :] == j, ij[:, None], ids)
            wts = tl.where(k_ar[None, :] == j, wj[:, None], wts)
        if RENORM:
            wts = wts / tl.where(t_ok, tl.sum(wts, axis=1), 1.0)[:, None]  # padding rows: no 0 / 0
        wts = wts * scale
        out_ok = t_ok[:, None] & (k_ar < TOP_K)[None, :]
        out_off = tok[:, None] * TOP_K + k_ar[None, :]
        tl.store(ids_ptr + out_off, ids, mask=out_ok)
        tl.store(w_ptr + out_off, wts, mask=out_ok)


def gate(
    logits: torch.Tensor,
    *,
    top_k: int,
    score_func: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = False,
    routed_scaling_factor: float = 1.0,
    hash_table: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _gate(logits, top_k, score_func, correction_bias, n_group, topk_group, renormalize, routed_scaling_factor, hash_table, token_ids, invariant=False)


def gate_invariant(
    logits: torch.Tensor,
    *,
    top_k: int,
    score_func: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = False,
    routed_scaling_factor: float = 1.0,
    hash_table: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _gate(logits, top_k, score_func, correction_bias, n_group, topk_group, renormalize, routed_scaling_factor, hash_table, token_ids, invariant=True)


def _gate(logits, top_k, score_func, correction_bias, n_group, topk_group, renormalize, routed_scaling_factor, hash_table, token_ids, invariant):
    """invariant: BLOCK_T is the most tokens the buffer takes, whatever T (deterministic mode)."""
    E = logits.shape[-1]
    check_gate_args(E, top_k, score_func, correction_bias, n_group, topk_group)
    check_hash_routing(logits, top_k, correction_bias, n_group, hash_table, token_ids)
    hashed = hash_table is not None
    if logits.dtype == torch.float64 or logits.numel() >= _INT32_LIMIT or (hashed and hash_table.numel() >= _INT32_LIMIT):
        return _reference_gate(
            logits, top_k=top_k, score_func=score_func, correction_bias=correction_bias, n_group=n_group,
            topk_group=topk_group, renormalize=renormalize, routed_scaling_factor=routed_scaling_factor, hash_table=hash_table, token_ids=token_ids,
        )
    x = logits.reshape(-1, E)
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    if x.stride(-1) != 1:
        x = x.contiguous()
    T = x.shape[0]
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T == 0:
        return weights.reshape(*logits.shape[:-1], top_k), ids.reshape(*logits.shape[:-1], top_k)
    bias = correction_bias.to(torch.float32).contiguous() if correction_bias is not None else x
    table = (hash_table if hash_table.stride(-1) == 1 else hash_table.contiguous()) if hashed else ids  # (placeholders without hash routing)
    tok_ids = token_ids.reshape(-1).contiguous() if hashed else ids
    block_e = max(next_power_of_2(E), 8)
    most = tile_elems(_GATE_BYTES_PER_ELEM) // block_e
    block_t = max(1, most if invariant else min(most, next_power_of_2(T)))
    n_tiles = cdiv(T, block_t)
    _gate_kernel[(vector_grid(n_tiles),)](
        x, bias, weights, ids, table, tok_ids,
        T, E, x.stride(0), E // n_group, float(routed_scaling_factor), table.stride(0),
        TOP_K=top_k, SCORE=SCORE_FUNCS.index(score_func), HASH=hashed, HAS_BIAS=correction_bias is not None,
        N_GROUP=n_group, TOPK_GROUP=topk_group, RENORM=bool(renormalize),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_G=max(next_power_of_2(n_group), 8), BLOCK_K=max(next_power_of_2(top_k), 8),
        **launch_options(),
    )
    return weights.reshape(*logits.shape[:-1], top_k), ids.reshape(*logits.shape[:-1], top_k)


# ---------------------------------------------------------------------------------------------
# dispatch

_COUNT_S = 64  # slots per count tile
_CHUNK_E = 64  # experts per histogram / scan chunk
_SCAN_N = 16  # tiles per scan block
_COPY_BYTES = 16 * 1024  # K x BLOCK_D copy tile


@triton.jit
def _dispatch_count_kernel(
    ids_ptr, rank_ptr, counts_ptr,
    S, E,
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_tiles = tl.cdiv(S, BLOCK_S)
    s_ar = tl.arange(0, BLOCK_S)
    e_ar = tl.arange(0, BLOCK_E)
    for tile in range(pid, n_tiles, nprog):
        slot = tile * BLOCK_S + s_ar
        s_ok = slot < S
        eid = tl.load(ids_ptr + slot, mask=s_ok, other=-1)
        # rank: earlier slots of this tile with the same expert (a stable order)
        same = (eid[:, None] == eid[None, :]) & (s_ar[None, :] < s_ar[:, None])
        rank = tl.sum(same.to(tl.int32), axis=1)
        tl.store(rank_ptr + slot, rank, mask=s_ok)
        for e0 in range(0, E, BLOCK_E):
            ex = e0 + e_ar
            onehot = (ex[:, None] == eid[None, :]).to(tl.int32)  # [experts, slots]
            tl.store(counts_ptr + tile * E + ex, tl.sum(onehot, axis=1), mask=ex < E)


@triton.jit
def _dispatch_scan_kernel(
    counts_ptr, prefix_ptr, offsets_ptr,
    E, n_tiles,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    # one program: the whole scan is small (n_tiles x E int32) and its order is fixed
    n_ar = tl.arange(0, BLOCK_N)
    e_ar = tl.arange(0, BLOCK_E)
    carry = tl.sum(tl.zeros([BLOCK_E], dtype=tl.int32), axis=0)
    for e0 in range(0, E, BLOCK_E):
        ex = e0 + e_ar
        e_ok = ex < E
        running = tl.zeros([BLOCK_E], dtype=tl.int32)
        for t0 in range(0, n_tiles, BLOCK_N):
            tiles = t0 + n_ar
            ok = (tiles < n_tiles)[:, None] & e_ok[None, :]
            off = tiles[:, None] * E + ex[None, :]
            c = tl.load(counts_ptr + off, mask=ok, other=0)
            tl.store(prefix_ptr + off, running[None, :] + tl.cumsum(c, axis=0) - c, mask=ok)
            running += tl.sum(c, axis=0)
        tl.store(offsets_ptr + ex, carry + tl.cumsum(running, axis=0) - running, mask=e_ok)
        carry += tl.sum(running, axis=0)
    tl.store(offsets_ptr + E, carry)


@triton.jit
def _dispatch_copy_kernel(
    x_ptr, ids_ptr, rank_ptr, prefix_ptr, offsets_ptr,
    out_ptr, row_of_slot_ptr,
    T, D, E, stride_x, stride_out,
    K: tl.constexpr,
    COUNT_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    d_tiles = tl.cdiv(D, BLOCK_D)
    n_tiles = T * d_tiles
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < K
    d_ar = tl.arange(0, BLOCK_D)
    for tile in range(pid, n_tiles, nprog):
        t = tile // d_tiles
        chunk = tile % d_tiles
        slot = t * K + kk
        eid = tl.load(ids_ptr + slot, mask=k_ok, other=0)
        rank = tl.load(rank_ptr + slot, mask=k_ok, other=0)
        pre = tl.load(prefix_ptr + (slot // COUNT_S) * E + eid, mask=k_ok, other=0)
        first = tl.load(offsets_ptr + eid, mask=k_ok, other=0)
        row = first + pre + rank
        if chunk == 0:
            tl.store(row_of_slot_ptr + slot, row, mask=k_ok)
        cols = chunk * BLOCK_D + d_ar
        c_ok = cols < D
        v = tl.load(x_ptr + t * stride_x + cols, mask=c_ok)
        tl.store(
            out_ptr + row[:, None] * stride_out + cols[None, :],
            tl.broadcast_to(v[None, :], [BLOCK_K, BLOCK_D]),
            mask=k_ok[:, None] & c_ok[None, :],
        )


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """A view whose rows copy exactly through loads and stores (no float64 / fp8 arithmetic types)."""
    if t.element_size() == 8:
        return t.view(torch.int32)
    if t.element_size() == 1:
        return t.view(torch.int8)
    return t


def dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    num_experts: int,
    ep_group: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    require_local_experts(ep_group)
    device = x.device
    T, K = topk_ids.shape
    S = T * K
    E = num_experts
    expert_x = torch.empty(S, x.shape[-1], dtype=x.dtype, device=device)
    offsets = torch.empty(E + 1, dtype=torch.int32, device=device)
    row_of_slot = torch.empty(S, dtype=torch.int32, device=device)
    if S == 0:
        offsets.zero_()
        return expert_x, offsets, row_of_slot
    xs = x if x.stride(-1) == 1 else x.contiguous()
    xb, ob = _as_bits(xs), _as_bits(expert_x)
    D = xb.shape[-1]
    if xb.numel() >= _INT32_LIMIT or ob.numel() >= _INT32_LIMIT:
        raise ValueError(f"dispatch (ascend Triton): {ob.numel()} elements exceed int32 offsets")
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    ids = ids.contiguous()
    n_tiles = cdiv(S, _COUNT_S)
    rank = torch.empty(S, dtype=torch.int32, device=device)
    counts = torch.empty(n_tiles, E, dtype=torch.int32, device=device)
    prefix = torch.empty(n_tiles, E, dtype=torch.int32, device=device)
    opts = launch_options()
    _dispatch_count_kernel[(vector_grid(n_tiles),)](ids, rank, counts, S, E, BLOCK_S=_COUNT_S, BLOCK_E=_CHUNK_E, **opts)
    _dispatch_scan_kernel[(1,)](counts, prefix, offsets, E, n_tiles, BLOCK_N=_SCAN_N, BLOCK_E=_CHUNK_E, **opts)
    block_k = max(next_power_of_2(K), 8)
    block_d = max(min(next_power_of_2(D), _COPY_BYTES // (block_k * xb.element_size())), 32 // xb.element_size())
    _dispatch_copy_kernel[(vector_grid(T * cdiv(D, block_d)),)](
        xb, ids, rank, prefix, offsets, ob, row_of_slot,
        T, D, E, xb.stride(0), ob.stride(0),
        K=K, COUNT_S=_COUNT_S, BLOCK_K=block_k, BLOCK_D=block_d, **opts,
    )
    return expert_x, offsets, row_of_slot


# ---------------------------------------------------------------------------------------------
# combine

_COMBINE_MAX_D = 2048


@triton.jit
def _combine_kernel(
    src_ptr, w_ptr, row_of_slot_ptr, add_ptr, out_ptr,
    T, D, stride_src, stride_add, stride_out,
    K: tl.constexpr,
    HAS_ADD: tl.constexpr,  # add_ptr: [T, D] added after the K routed terms (else unused)
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    d_tiles = tl.cdiv(D, BLOCK_D)
    n_tiles = T * d_tiles
    d_ar = tl.arange(0, BLOCK_D)
    for tile in range(pid, n_tiles, nprog):
        t = tile // d_tiles
        cols = (tile % d_tiles) * BLOCK_D + d_ar
        c_ok = cols < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for k in tl.static_range(K):  # k = 0..K-1 in order: the sum does not depend on the batch
            r = tl.load(row_of_slot_ptr + t * K + k)
            w = tl.load(w_ptr + t * K + k).to(tl.float32)
            v = tl.load(src_ptr + r * stride_src + cols, mask=c_ok, other=0.0).to(tl.float32)
            acc += w * v
        if HAS_ADD:
            acc += tl.load(add_ptr + t * stride_add + cols, mask=c_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_out + cols, to_output(acc, out_ptr), mask=c_ok)


def combine(
    expert_out: torch.Tensor,
    topk_weights: torch.Tensor,
    row_of_slot: torch.Tensor,
    *,
    add: torch.Tensor | None = None,
    ep_group: object | None = None,
) -> torch.Tensor:
    require_local_experts(ep_group)
    check_combine_add(add, expert_out, topk_weights)
    big = expert_out.numel() >= _INT32_LIMIT or (add is not None and add.numel() >= _INT32_LIMIT)
    if expert_out.dtype == torch.float64 or big:
        return _reference_combine(expert_out, topk_weights, row_of_slot, add=add, ep_group=ep_group)
    T, K = topk_weights.shape
    D = expert_out.shape[-1]
    out = torch.empty(T, D, dtype=expert_out.dtype, device=expert_out.device)
    if T == 0 or D == 0:
        return out
    if K == 0:  # an empty sum (plus the addend)
        return out.zero_() if add is None else out.copy_(add)
    src = expert_out if expert_out.stride(-1) == 1 else expert_out.contiguous()
    w = topk_weights.to(torch.float32).contiguous()
    rows = row_of_slot.reshape(-1)
    if rows.dtype != torch.int32:
        rows = rows.to(torch.int32)
    rows = rows.contiguous()
    if add is not None and add.stride(-1) != 1:
        add = add.contiguous()
    block_d = max(min(next_power_of_2(D), _COMBINE_MAX_D), 32 // src.element_size())
    _combine_kernel[(vector_grid(T * cdiv(D, block_d)),)](
        src, w, rows, out if add is None else add, out, T, D, src.stride(0), 0 if add is None else add.stride(0), out.stride(0),
        K=K, HAS_ADD=add is not None, BLOCK_D=block_d, **launch_options(),
    )
    return out



REGISTRATIONS = [
    Registration(op="gate", fn=gate, note="Triton (ascend): fused scores, bias, group-limited top-k per token tile, persistent vector grid"),
    Registration(op="gate", fn=gate_invariant, priority=-1, batch_invariant=True,
                 note="Triton (ascend): the gate above with BLOCK_T fixed by E and the buffer (not by T)"),
    # Invariant as it is: integer counts and exact row copies (a row's values never depend on the batch, only where it lands).
    Registration(op="dispatch", fn=dispatch, batch_invariant=True,
                 note="Triton (ascend): deterministic counting sort (count, one-program scan, row copy), no host sync"),
    # Invariant as it is: one token per tile row, its K rows summed in the fixed order k = 0..K-1, BLOCK_D from D only.
    Registration(op="combine", fn=combine, batch_invariant=True, note="Triton (ascend): K rows gathered per token, fixed-order float32 sum, then add's row"),
]
