"""Triton kernels: the MoE gate, and moving token copies to their experts (`dispatch`) and back (`combine`).

gate
    One program per BLOCK_T tokens holds their [BLOCK_T, E] router logits in registers (E <= a few
    hundred): scores (softmax / sigmoid / sqrt-softplus), the correction bias, the group-limited mask
    (group score = sum of the top-2 biased scores, or the max without a bias; losing groups -> -inf,
    as DeepSeek's reference), then top_k rounds of "max, lowest index among the maxima, mark taken"
    (what a stable descending sort picks, ties to the lowest index), renormalise and scale. Hash
    routing (V4's first layers) skips the selection: each token's ids are loaded from its row of the
    table (token ids read on the device) and weighed by their scores.

dispatch (a counting sort by expert, stable in slot order, no host synchronisation)
    1. count:  one program per tile of BLOCK_S slots: a one-hot [E, BLOCK_S] matrix and its running
               sum along the slots give, per slot, its rank among the tile's earlier slots of the same
               expert, and per expert the tile's count (stored expert-major, [E, n_tiles]).
    2. scan:   one program per expert: exclusive scan of its counts over the tiles (in tile order),
               and the expert's total.
    3. copy:   one program per (token, column split): the expert offsets (exclusive scan of the
               totals, E values from L2), each of the token's K slots' row = offset[e] +
               tile_prefix[e, tile] + rank_in_tile; row_of_slot is written, and the token's row is
               read once and stored to its K rows (16-byte vectors).
    Every step is deterministic, so the layout equals the reference's stable sort.

combine
    One program per (token, column split): K rows gathered through row_of_slot, weighted sum in the
    fixed order k = 0..K-1 in float32 (float64 for float64), then the token's `add` row (a shared
    expert's output) when given, cast to the output dtype once.

Deterministic mode: dispatch (integer counting and exact row copies) and combine (each output
element its own k-ordered sum; the column split only chooses which program computes it) are
batch-invariant as they are. The gate's default tile shrinks with T, and the softmax and
renormalising sums run over that [BLOCK_T, E] tile's axis, whose reduction tree follows the tile's
shape on a GPU; `gate_invariant` launches one tile (tile_elems // E tokens) for every T.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepinfer.ops.moe import SCORE_FUNCS, check_combine_add, check_gate_args, check_hash_routing, require_local_experts
from deepinfer.triton_common import cdiv, interpreting, log1p_from_log, next_power_of_2
from deepinfer_cuda.kernels.common import Registration, pdl_launch, pdl_prologue
from deepinfer_cuda.kernels.precise_math import precise_exp as _exp
from deepinfer_cuda.tuning import config

# ---------------------------------------------------------------------------------------------
# gate


@triton.jit
def _log1p(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.log1p(x)
    else:
        y = log1p_from_log(x)
    return y


@triton.jit
def _div(a, b):
    # IEEE-rounded division (Triton's `/` on float32 is the approximate div.full.f32);
    # div_rn is float32-only, and float64 `/` is already div.rn.f64.
    if a.dtype == tl.float64:
        y = a / b
    else:
        y = tl.math.div_rn(a, b)
    return y


@triton.jit
def _sqrt(x):
    if x.dtype == tl.float64:
        y = tl.sqrt(x)
    else:
        y = tl.math.sqrt_rn(x)
    return y


@triton.jit(do_not_specialize=["T"])
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
    LIBDEVICE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    tok = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    ex = tl.arange(0, BLOCK_E)
    t_ok = tok < T
    e_ok = ex < E
    ok = t_ok[:, None] & e_ok[None, :]
    x = tl.load(logits_ptr + tok.to(tl.int64)[:, None] * stride_t + ex[None, :], mask=ok, other=float("-inf"))
    if SCORE == 0:
        mx = tl.where(t_ok, tl.max(x, axis=1), 0.0)  # padding rows: no -inf - -inf
        num = _exp(x - mx[:, None], LIBDEVICE)
        num = tl.where(ok, num, 0.0)
        s = _div(num, tl.where(t_ok, tl.sum(num, axis=1), 1.0)[:, None])
    elif SCORE == 1:
        s = _div(tl.full(x.shape, 1.0, x.dtype), 1.0 + _exp(-x, LIBDEVICE))
    else:
        # torch's softplus (beta 1, threshold 20): x past the threshold, else log1p(exp(x)).
        sp = tl.where(x > 20.0, x, _log1p(_exp(x, LIBDEVICE), LIBDEVICE))
        s = _sqrt(sp)
    s = tl.where(ok, s, 0.0)
    if HAS_BIAS:
        b = tl.load(bias_ptr + ex, mask=e_ok, other=0.0).to(s.dtype)
        sel = s + b[None, :]
    else:
        sel = s
    sel = tl.where(e_ok[None, :], sel, float("-inf"))
    big = BLOCK_E + BLOCK_G

    if N_GROUP > 1:
        gid = ex // group_size  # padding columns get ids >= N_GROUP: in no group
        g_ar = tl.arange(0, BLOCK_G)
        gscore = tl.full([BLOCK_T, BLOCK_G], float("-inf"), sel.dtype)
        for g in tl.static_range(N_GROUP):
            v = tl.where((gid == g)[None, :], sel, float("-inf"))
            m1 = tl.max(v, axis=1)
            if HAS_BIAS:
                # top-2 sum: the best, plus the best of the rest (a tie counts twice, as topk(2) does)
                i1 = tl.min(tl.where(v == m1[:, None], ex[None, :], big), axis=1)
                m2 = tl.max(tl.where(ex[None, :] == i1[:, None], float("-inf"), v), axis=1)
                gs = m1 + m2
            else:
                gs = m1
            gscore = tl.where(g_ar[None, :] == g, gs[:, None], gscore)
        gkept = tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.int1)
        g_valid = (g_ar < N_GROUP)[None, :]
        for _ in tl.static_range(TOPK_GROUP):
            cand = tl.where(gkept, float("-inf"), gscore)
            mg = tl.max(tl.where(g_valid, cand, float("-inf")), axis=1)
            ig = tl.min(tl.where((cand == mg[:, None]) & g_valid & (gkept == 0), g_ar[None, :], big), axis=1)
            gkept = gkept | (g_ar[None, :] == ig[:, None])
        keep = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int1)
        for g in tl.static_range(N_GROUP):
            has_g = tl.max(tl.where(g_ar[None, :] == g, gkept.to(tl.int32), 0), axis=1) > 0
            keep = keep | ((gid == g)[None, :] & has_g[:, None])
        sel = tl.where(keep, sel, float("-inf"))

    k_ar = tl.arange(0, BLOCK_K)
    taken = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int1)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    wts = tl.zeros([BLOCK_T, BLOCK_K], dtype=s.dtype)
    if HASH:
        tid = tl.load(tok_ids_ptr + tok, mask=t_ok, other=0).to(tl.int64)
    for j in tl.static_range(TOP_K):
        if HASH:  # the table's j-th expert, weighed by its score (an exact masked sum picks it)
            ij = tl.load(table_ptr + tid * stride_table + j, mask=t_ok, other=0).to(tl.int32)
            hit = ex[None, :] == ij[:, None]
        else:
            cand = tl.where(taken, float("-inf"), sel)
            mv = tl.max(cand, axis=1)
            ij = tl.min(tl.where((cand == mv[:, None]) & (taken == 0) & e_ok[None, :], ex[None, :], big), axis=1)
            hit = ex[None, :] == ij[:, None]
            taken = taken | hit
        wj = tl.sum(tl.where(hit, s, 0.0), axis=1)
        ids = tl.where(k_ar[None, :] == j, ij[:, None], ids)
        wts = tl.where(k_ar[None, :] == j, wj[:, None], wts)
    if RENORM:
        wts = _div(wts, tl.sum(wts, axis=1)[:, None])
    wts = wts * scale
    out_ok = t_ok[:, None] & (k_ar < TOP_K)[None, :]
    out_off = tok.to(tl.int64)[:, None] * TOP_K + k_ar[None, :]
    tl.store(ids_ptr + out_off, ids, mask=out_ok)
    tl.store(w_ptr + out_off, wts.to(w_ptr.dtype.element_ty), mask=out_ok)


@lru_cache(maxsize=None)
def _cfg(op: str, variant: str, device: torch.device) -> dict:
    return config(op, variant, device)


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
    return _gate(logits, top_k, score_func, correction_bias, n_group, topk_group, renormalize, routed_scaling_factor, hash_table, token_ids)


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
    return _gate(
        logits, top_k, score_func, correction_bias, n_group, topk_group, renormalize, routed_scaling_factor, hash_table, token_ids, invariant=True
    )


def _gate(logits, top_k, score_func, correction_bias, n_group, topk_group, renormalize, routed_scaling_factor, hash_table=None, token_ids=None,
          invariant=False):  # fmt: skip
    """gate; invariant: one token tile for every T (deterministic mode)."""
    E = logits.shape[-1]
    check_gate_args(E, top_k, score_func, correction_bias, n_group, topk_group)
    check_hash_routing(logits, top_k, correction_bias, n_group, hash_table, token_ids)
    x = logits.reshape(-1, E)
    if x.stride(-1) != 1:
        x = x.contiguous()
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    if x.dtype != acc:
        x = x.to(acc)
    T = x.shape[0]
    weights = torch.empty(T, top_k, dtype=acc, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T == 0:
        return weights, ids
    bias = correction_bias.contiguous() if correction_bias is not None else x
    hashed = hash_table is not None
    table = (hash_table if hash_table.stride(-1) == 1 else hash_table.contiguous()) if hashed else ids  # (placeholders without hash routing)
    tok_ids = token_ids.reshape(-1).contiguous() if hashed else ids
    cfg = _cfg("gate", "tokens", logits.device)
    block_e = next_power_of_2(E)
    block_t = max(1, cfg["tile_elems"] // block_e)
    if not invariant:
        block_t = min(block_t, next_power_of_2(T))
    _gate_kernel[(triton.cdiv(T, block_t),)](
        x, bias, weights, ids, table, tok_ids,
        T, E, x.stride(0), E // n_group, float(routed_scaling_factor), table.stride(0),
        TOP_K=top_k, SCORE=SCORE_FUNCS.index(score_func), HASH=hashed, HAS_BIAS=correction_bias is not None,
        N_GROUP=n_group, TOPK_GROUP=topk_group, RENORM=bool(renormalize),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_G=next_power_of_2(n_group), BLOCK_K=next_power_of_2(top_k),
        LIBDEVICE=not interpreting(), num_warps=cfg["num_warps"], **pdl_launch(x.device),
    )
    return weights.reshape(*logits.shape[:-1], top_k), ids.reshape(*logits.shape[:-1], top_k)


# ---------------------------------------------------------------------------------------------
# dispatch


@triton.jit(do_not_specialize=["S", "n_tiles"])
def _dispatch_count_kernel(
    ids_ptr, rank_ptr, counts_ptr,
    S, E, n_tiles,
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    tile = tl.program_id(0)
    slot = tile * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = slot < S
    eid = tl.load(ids_ptr + slot, mask=s_ok, other=-1)
    ex = tl.arange(0, BLOCK_E)
    onehot = (ex[:, None] == eid[None, :]).to(tl.int32)  # [E, S]: slots along the fast axis
    running = tl.cumsum(onehot, axis=1)
    rank = tl.sum(onehot * running, axis=0) - 1  # earlier slots of this tile with the same expert
    tl.store(rank_ptr + slot, rank, mask=s_ok)
    cnt = tl.sum(onehot, axis=1)
    tl.store(counts_ptr + ex.to(tl.int64) * n_tiles + tile, cnt, mask=ex < E)


@triton.jit(do_not_specialize=["n_tiles"])
def _dispatch_scan_kernel(
    counts_ptr, prefix_ptr, totals_ptr,
    n_tiles,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    e = tl.program_id(0)
    base = e.to(tl.int64) * n_tiles
    total = tl.sum(tl.zeros([BLOCK_N], dtype=tl.int32), axis=0)
    for start in range(0, n_tiles, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        ok = offs < n_tiles
        c = tl.load(counts_ptr + base + offs, mask=ok, other=0)
        inc = tl.cumsum(c, axis=0)
        tl.store(prefix_ptr + base + offs, total + inc - c, mask=ok)
        total += tl.sum(c, axis=0)
    tl.store(totals_ptr + e, total)


@triton.jit(do_not_specialize=["n_tiles"])
def _dispatch_copy_kernel(
    x_ptr, ids_ptr, rank_ptr, prefix_ptr, totals_ptr,
    out_ptr, row_of_slot_ptr, offsets_ptr,
    D, E, n_tiles, stride_x, stride_out, cols_per_split,
    K: tl.constexpr,
    TILE_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    t = tl.program_id(0)
    split = tl.program_id(1)
    ex = tl.arange(0, BLOCK_E)
    e_ok = ex < E
    tot = tl.load(totals_ptr + ex, mask=e_ok, other=0)
    start_e = tl.cumsum(tot, axis=0) - tot  # exclusive scan: expert e's first row
    if (t == 0) & (split == 0):
        tl.store(offsets_ptr + ex, start_e, mask=e_ok)
        tl.store(offsets_ptr + E, tl.sum(tot, axis=0))
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < K
    slot = t * K + kk
    eid = tl.load(ids_ptr + slot, mask=k_ok, other=0)
    rank = tl.load(rank_ptr + slot, mask=k_ok, other=0)
    pre = tl.load(prefix_ptr + eid.to(tl.int64) * n_tiles + slot // TILE_S, mask=k_ok, other=0)
    first = tl.sum(tl.where(ex[None, :] == eid[:, None], start_e[None, :], 0), axis=1)
    row = first + pre + rank
    if split == 0:
        tl.store(row_of_slot_ptr + slot, row, mask=k_ok)
    dst = out_ptr + row.to(tl.int64)[:, None] * stride_out
    src = x_ptr + t.to(tl.int64) * stride_x
    col0 = split * cols_per_split
    col_end = tl.minimum(col0 + cols_per_split, D)
    for c in range(col0, col_end, BLOCK_D):
        cols = c + tl.arange(0, BLOCK_D)
        c_ok = cols < col_end
        v = tl.load(src + cols, mask=c_ok)
        tl.store(dst + cols[None, :], tl.broadcast_to(v[None, :], [BLOCK_K, BLOCK_D]), mask=k_ok[:, None] & c_ok[None, :])


def _column_split(T: int, D: int, block_d: int, target_programs: int) -> tuple[int, int]:
    """(columns per program, number of splits): enough programs to fill the GPU when T is small."""
    blocks = cdiv(D, block_d)
    splits = max(1, min(blocks, cdiv(target_programs, max(T, 1))))
    per = cdiv(blocks, splits) * block_d
    return per, cdiv(D, per)


def _block_d(D: int, elem_bytes: int, cfg: dict) -> int:
    return max(16 // elem_bytes, min(next_power_of_2(D), cfg["block_bytes"] // elem_bytes))


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
    D = x.shape[-1]
    S = T * K
    E = num_experts
    expert_x = torch.empty(S, D, dtype=x.dtype, device=device)
    offsets = torch.empty(E + 1, dtype=torch.int32, device=device)
    row_of_slot = torch.empty(S, dtype=torch.int32, device=device)
    if S == 0:
        offsets.zero_()
        return expert_x, offsets, row_of_slot
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    cfg = _cfg("dispatch", "tokens", device)
    layout = count_slots(topk_ids, E)
    block_d = _block_d(D, x.element_size(), cfg)
    per, splits = _column_split(T, D, block_d, cfg["target_programs"])
    _dispatch_copy_kernel[(T, splits)](
        x2, layout.ids, layout.rank, layout.prefix, layout.totals, expert_x, row_of_slot, offsets,
        D, E, layout.n_tiles, x2.stride(0), expert_x.stride(0), per,
        K=K, TILE_S=layout.tile_s, BLOCK_E=next_power_of_2(E), BLOCK_K=next_power_of_2(K), BLOCK_D=block_d,
        num_warps=cfg["copy_warps"], **pdl_launch(x2.device),
    )
    return expert_x, offsets, row_of_slot


@dataclass(frozen=True)
class SlotCounts:
    """Steps 1-2 of the dispatch (count, scan) for S = T*K > 0 slots: what a copy step needs to
    place slot s of expert e at row offset[e] + prefix[e, s // tile_s] + rank[s]."""

    ids: torch.Tensor  # [S] int32, contiguous
    rank: torch.Tensor  # [S] int32: earlier slots of the same expert within the slot's tile
    prefix: torch.Tensor  # [E, n_tiles] int32: slots of expert e in earlier tiles
    totals: torch.Tensor  # [E] int32: slots of expert e
    tile_s: int
    n_tiles: int


def count_slots(topk_ids: torch.Tensor, num_experts: int, totals: torch.Tensor | None = None) -> SlotCounts:
    """Count and scan the slots of `topk_ids` [T, K] (T*K > 0) per expert (two kernels, no host
    synchronisation). `totals`: an [E] int32 tensor to write the per-expert counts into (e.g. a
    slice of a buffer the counts are published from); default a new one."""
    device = topk_ids.device
    E = num_experts
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    ids = ids.contiguous()
    S = ids.numel()
    cfg = _cfg("dispatch", "tokens", device)
    block_e = next_power_of_2(E)
    tile_s = max(16, min(cfg["count_tile_elems"] // block_e, next_power_of_2(S)))
    n_tiles = cdiv(S, tile_s)
    rank = torch.empty(S, dtype=torch.int32, device=device)
    counts = torch.empty(E, n_tiles, dtype=torch.int32, device=device)
    prefix = torch.empty(E, n_tiles, dtype=torch.int32, device=device)
    if totals is None:
        totals = torch.empty(E, dtype=torch.int32, device=device)
    _dispatch_count_kernel[(n_tiles,)](
        ids, rank, counts, S, E, n_tiles, BLOCK_S=tile_s, BLOCK_E=block_e, num_warps=cfg["count_warps"], **pdl_launch(ids.device),
    )  # fmt: skip
    block_n = min(1024, next_power_of_2(cdiv(next_power_of_2(S), tile_s)))  # S's power-of-two bucket decides: one kernel per bucket
    _dispatch_scan_kernel[(E,)](counts, prefix, totals, n_tiles, BLOCK_N=block_n, num_warps=4, **pdl_launch(counts.device))
    return SlotCounts(ids, rank, prefix, totals, tile_s, n_tiles)


# ---------------------------------------------------------------------------------------------
# combine


@triton.jit
def _combine_kernel(
    src_ptr, w_ptr, row_of_slot_ptr, add_ptr, out_ptr,
    D, stride_src, stride_add, stride_out, cols_per_split,
    K: tl.constexpr,
    ACC: tl.constexpr,
    HAS_ADD: tl.constexpr,  # add_ptr: [T, D] added after the K routed terms (else unused)
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    t = tl.program_id(0)
    split = tl.program_id(1)
    col0 = split * cols_per_split
    col_end = tl.minimum(col0 + cols_per_split, D)
    for c in range(col0, col_end, BLOCK_D):
        cols = c + tl.arange(0, BLOCK_D)
        c_ok = cols < col_end
        acc = tl.zeros([BLOCK_D], dtype=ACC)
        for k in tl.static_range(K):  # k = 0..K-1 in order: the sum does not depend on the batch
            r = tl.load(row_of_slot_ptr + t * K + k).to(tl.int64)
            w = tl.load(w_ptr + t * K + k).to(ACC)
            v = tl.load(src_ptr + r * stride_src + cols, mask=c_ok, other=0.0).to(ACC)
            acc += w * v
        if HAS_ADD:
            acc += tl.load(add_ptr + t.to(tl.int64) * stride_add + cols, mask=c_ok, other=0.0).to(ACC)
        tl.store(out_ptr + t.to(tl.int64) * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=c_ok)


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
    T, K = topk_weights.shape
    D = expert_out.shape[-1]
    out = torch.empty(T, D, dtype=expert_out.dtype, device=expert_out.device)
    if T == 0 or D == 0:
        return out
    src = expert_out if expert_out.stride(-1) == 1 else expert_out.contiguous()
    w = topk_weights.contiguous()
    rows = row_of_slot.reshape(-1)
    if rows.dtype != torch.int32:
        rows = rows.to(torch.int32)
    rows = rows.contiguous()
    if add is not None and add.stride(-1) != 1:
        add = add.contiguous()
    acc = tl.float64 if expert_out.dtype == torch.float64 else tl.float32
    cfg = _cfg("combine", "tokens", expert_out.device)
    block_d = _block_d(D, expert_out.element_size(), cfg)
    per, splits = _column_split(T, D, block_d, cfg["target_programs"])
    _combine_kernel[(T, splits)](
        src, w, rows, out if add is None else add, out, D, src.stride(0), 0 if add is None else add.stride(0), out.stride(0), per,
        K=K, ACC=acc, HAS_ADD=add is not None, BLOCK_D=block_d, num_warps=cfg["num_warps"], **pdl_launch(src.device),
    )
    return out


REGISTRATIONS = [
    Registration(op="gate", fn=gate, note="Triton (fused scores, bias, group-limited top-k in registers)"),
    Registration(op="gate", fn=gate_invariant, priority=-1, batch_invariant=True,
                 note="Triton (fused scores, bias, group-limited top-k in registers; one tile of tile_elems // E tokens for every token count)"),
    # dispatch and combine: batch-invariant as they are (see the module docstring).
    Registration(op="dispatch", fn=dispatch, note="Triton (deterministic counting sort + row copy, no host sync)", batch_invariant=True),
    Registration(op="combine", fn=combine, note="Triton (gather K rows, fixed-order float32 sum, then add's row)", batch_invariant=True),
]  # fmt: skip
