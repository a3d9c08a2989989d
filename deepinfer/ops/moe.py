"""Mixture-of-experts routing: the gate, and moving tokens to their experts and back."""

from __future__ import annotations

import torch

from deepinfer.distributed.expert_parallel import as_expert_parallel, ep_size_of
from deepinfer.registry import ALLCLOSE, EXACT, op

SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")


def _gate_canonicalize(kwargs, outputs):
    """Sort each row's ids ascending and carry the weights along: the top-k order is free."""
    ids, order = torch.sort(outputs["topk_ids"], dim=-1, stable=True)
    return {**outputs, "topk_ids": ids, "topk_weights": outputs["topk_weights"].gather(-1, order)}


@op(
    family="moe",
    outputs=("topk_weights", "topk_ids"),
    compare={"topk_weights": ALLCLOSE, "topk_ids": EXACT},
    canonicalize=_gate_canonicalize,
)
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
    """Route each token to top_k of E experts, as DeepSeek's reference Gate does.

    logits: [T, E] router output (float32). scores s = softmax(logits) | sigmoid(logits) |
    sqrt(softplus(logits)). Selection scores s' = s + correction_bias (bias [E], only for selecting).
    With n_group > 1, experts form n_group consecutive groups; a group's score is the sum of its
    top-2 s' when a bias is given and its max otherwise; all but the best topk_group groups are
    masked with -inf (DeepSeek's reference; transformers' 0.0 fill differs once s' < 0).
    topk_ids = top_k of s' (descending); weights = s at those ids (no bias); when renormalize,
    weights /= their sum; then weights *= routed_scaling_factor.
    Equal scores (groups or experts) rank by lowest index. Computed in float32 (float64 for
    float64 logits). Returns (topk_weights [T, top_k] float32 (float64 for float64 logits),
    topk_ids [T, top_k] int32). The order of the top_k entries is not part of the contract (the
    conformance suite sorts each row by id).

    Hash routing (DeepSeek-V4's first layers): hash_table [V, top_k] integer (the checkpoint's
    tid2eid, ids in [0, E)) and token_ids [T] integer (each token's id, < V), together. Then
    topk_ids = hash_table[token_ids] in the table's order and nothing is selected (no bias, no
    groups: correction_bias None and n_group 1); the weights are the scores s at those ids,
    renormalised and scaled as above. The lookup is the kernel's, so a hash-routed layer's routing is
    one launch after the router's GEMM (it was a lookup, scores, a gather, a sum, a division and a
    scaling in torch).
    """
    num_experts = logits.shape[-1]
    check_gate_args(num_experts, top_k, score_func, correction_bias, n_group, topk_group)
    check_hash_routing(logits, top_k, correction_bias, n_group, hash_table, token_ids)
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scores = expert_scores(logits.to(acc), score_func)
    if hash_table is not None:
        topk_ids = hash_table[token_ids.long()].long()
    else:
        selection = scores if correction_bias is None else scores + correction_bias.to(acc)
        if n_group > 1:
            selection = _mask_losing_groups(selection, n_group, topk_group, by_top2=correction_bias is not None)
        topk_ids = _top_indices(selection, top_k)
    weights = scores.gather(-1, topk_ids)  # the bias only selects; it never weighs
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * routed_scaling_factor, topk_ids.to(torch.int32)


def check_gate_args(num_experts, top_k, score_func, correction_bias, n_group, topk_group) -> None:
    """Reject gate parameters outside the op's meaning (backends' kernels call it too, so every backend
    refuses the same inputs with the same message)."""
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func {score_func!r} is not one of {SCORE_FUNCS}")
    if n_group < 1 or num_experts % n_group != 0:
        raise ValueError(f"n_group={n_group} does not divide the {num_experts} experts")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    if n_group > 1 and correction_bias is not None and num_experts // n_group < 2:
        raise ValueError("group score with a correction bias is a top-2 sum: groups need at least 2 experts")
    kept_experts = topk_group * (num_experts // n_group)
    if not 1 <= top_k <= kept_experts:
        raise ValueError(f"top_k={top_k} must be in [1, {kept_experts}] (experts in the kept groups)")
    if correction_bias is not None and correction_bias.shape != (num_experts,):
        raise ValueError(f"correction_bias has shape {tuple(correction_bias.shape)}, expected ({num_experts},)")


def check_hash_routing(logits, top_k, correction_bias, n_group, hash_table, token_ids) -> None:
    """The gate's hash-routing arguments (every backend's check; no host synchronisation)."""
    if (hash_table is None) != (token_ids is None):
        raise ValueError("hash_table and token_ids go together")
    if hash_table is None:
        return
    if hash_table.dim() != 2 or hash_table.shape[1] != top_k or hash_table.is_floating_point():
        raise ValueError(f"hash_table must be an integer [V, top_k={top_k}] table, got {tuple(hash_table.shape)} {hash_table.dtype}")
    if token_ids.shape != logits.shape[:-1] or token_ids.is_floating_point():
        raise ValueError(f"token_ids must be integer ids shaped like the logits' tokens {tuple(logits.shape[:-1])}, got {tuple(token_ids.shape)}")
    if correction_bias is not None or n_group != 1:
        raise ValueError("hash routing selects nothing: it takes no correction_bias and no expert groups")


def expert_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """The gate's per-expert scores (softmax | sigmoid | sqrt(softplus))."""
    if score_func == "softmax":
        return logits.softmax(dim=-1)
    if score_func == "sigmoid":
        return logits.sigmoid()
    return torch.nn.functional.softplus(logits).sqrt()


def _top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row; a stable sort makes ties go to the lowest index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def _mask_losing_groups(selection: torch.Tensor, n_group: int, topk_group: int, *, by_top2: bool) -> torch.Tensor:
    """Keep the topk_group best expert groups; the others get -inf, as DeepSeek's reference does.

    (-inf, not 0.0: with a bias, s' can be negative, and a 0.0 fill would let masked experts win.)
    """
    grouped = selection.reshape(selection.shape[0], n_group, -1)
    if by_top2:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, _top_indices(group_scores, topk_group), True)
    return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(1)


@op(
    family="moe",
    outputs=("expert_x", "expert_offsets", "row_of_slot"),
    compare={"expert_x": EXACT, "expert_offsets": EXACT, "row_of_slot": EXACT},
)
def dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    num_experts: int,
    ep_group: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Permute token copies so that each expert's rows are contiguous; with an expert-parallel
    group, move them to the ranks that own their experts.

    x: [T, D]; topk_ids: [T, K] int32 in [0, num_experts). Slot t*K + k is token t's k-th choice.
    Slots are ordered by expert id, ties kept in slot order (a stable sort), so the layout is
    fully determined. Returns expert_x [T*K, D] (x's rows in that order), expert_offsets
    [num_experts + 1] int32 (expert e's rows are expert_offsets[e]:expert_offsets[e+1]; an expert
    with no tokens has an empty range) and row_of_slot [T*K] int32 (the expert_x row that holds
    slot t*K + k), with no host synchronisation.

    `ep_group`: None, or a group of one rank, means every expert is local (the above). A
    `deepinfer.distributed.ExpertParallel` of W > 1 ranks shards the num_experts PHYSICAL experts
    (topk_ids are physical ids): rank r owns the L = num_experts / W experts [r*L, (r+1)*L). Every
    rank of the group must call dispatch (with T = 0 when it has no tokens). Each rank lays its
    slots out as above (its send layout: grouped by destination rank, as the expert ids are),
    exchanges the per-expert counts (one all_to_all; the one host synchronisation, to size the
    receive buffer) and then the rows (all_to_all_single), and returns expert_x [R, D]: the R rows
    it received for its L local experts, ordered by local expert, then by source rank, then by the
    source's slot order (exactly what the one-rank dispatch of all ranks' tokens, concatenated in
    rank order, gives for those experts); expert_offsets [L + 1] int32 over its local experts; and
    row_of_slot [T*K] int32: the row of slot t*K + k in this rank's send layout. The exchange's
    split sizes stay in `ep_group`, keyed by this row_of_slot tensor, until the matching `combine`.
    A backend's EP path may return more than R rows (e.g. a receive buffer sized for the most rows
    that can arrive, to avoid a host synchronisation): rows past expert_offsets[L] are padding, as
    grouped_gemm's contiguous layout allows, and combine takes expert_out of either length.
    """
    ep = as_expert_parallel(ep_group, num_experts)
    expert_x, expert_offsets, row_of_slot = _permute_by_expert(x, topk_ids, num_experts)
    if ep is None:
        return expert_x, expert_offsets, row_of_slot
    # expert_x is this rank's send layout; rows leave for their experts' owners and are re-sorted there.
    expert_x, expert_offsets = ep.exchange_dispatch(expert_x, expert_offsets, row_of_slot)
    return expert_x, expert_offsets, row_of_slot


def _permute_by_expert(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one-rank dispatch: slots stably sorted by expert id, no host synchronisation."""
    num_slots = topk_ids.numel()
    slot_ids = topk_ids.reshape(-1).long()
    sorted_ids, slot_of_row = torch.sort(slot_ids, stable=True)
    expert_x = x[slot_of_row // topk_ids.shape[-1]]
    # Expert e starts after every slot with a smaller id; searchsorted stays on the device (no .item()).
    boundaries = torch.arange(num_experts + 1, device=topk_ids.device, dtype=sorted_ids.dtype)
    expert_offsets = torch.searchsorted(sorted_ids, boundaries).to(torch.int32)
    rows = torch.arange(num_slots, device=topk_ids.device, dtype=torch.int32)
    row_of_slot = torch.empty_like(rows).scatter_(0, slot_of_row, rows)  # the inverse permutation
    return expert_x, expert_offsets, row_of_slot


@op(family="moe", outputs=("out",), compare=ALLCLOSE, reduction_length=lambda kw: kw["topk_weights"].shape[-1] + (kw.get("add") is not None))
def combine(
    expert_out: torch.Tensor,
    topk_weights: torch.Tensor,
    row_of_slot: torch.Tensor,
    *,
    add: torch.Tensor | None = None,
    ep_group: object | None = None,
) -> torch.Tensor:
    """Weighted sum of each token's expert outputs: the inverse of `dispatch`.

    expert_out: [T*K, D] (rows in dispatch's order); topk_weights: [T, K] float32; row_of_slot:
    [T*K] int32 from dispatch. out[t] = sum over k = 0..K-1, in that order, of
    topk_weights[t, k] * expert_out[row_of_slot[t*K + k]], accumulated in float32 (a fixed order,
    so results do not depend on the batch). float64 expert_out accumulates in float64. Returns
    [T, D] in expert_out's dtype.

    add: None, or [T, D] in expert_out's dtype (a shared expert's output): added to token t's sum
    after its K routed terms, in the same accumulation, before the one cast to the output dtype:
    out[t] = (sum_k ... + add[t]) rounded once (no launch of its own, no second rounding).

    With a `deepinfer.distributed.ExpertParallel` `ep_group` of W > 1 ranks (the one the matching
    dispatch used; every rank of the group must call combine): expert_out [R, D] holds the results
    of the rows this rank's dispatch received, in their order. Each row goes back to its source
    rank (the inverse all_to_all_single, with the split sizes the dispatch left in ep_group, found
    by the identity of row_of_slot: pass the tensor dispatch returned, once), which places it in its
    send layout; then out[t] is the sum above over this rank's T tokens, row_of_slot indexing the
    send layout. The result equals the one-rank combine of all ranks' tokens, row for row (a
    backend's EP path may add in another fixed order, e.g. per owner rank first: equal within the
    op's tolerance, still independent of the batch). `add` is this rank's [T, D], added here, after
    the exchange and the K routed terms.
    """
    check_combine_add(add, expert_out, topk_weights)
    ep = as_expert_parallel(ep_group)
    if ep is not None:
        expert_out = ep.exchange_combine(expert_out, row_of_slot)  # this rank's slots, in its send layout
    acc = torch.float64 if expert_out.dtype == torch.float64 else torch.float32
    tokens, top_k = topk_weights.shape
    per_slot = expert_out[row_of_slot.long()].to(acc).view(tokens, top_k, expert_out.shape[-1])  # (not -1: T may be 0)
    weights = topk_weights.to(acc)
    out = torch.zeros(tokens, expert_out.shape[-1], dtype=acc, device=expert_out.device)
    for k in range(top_k):  # a fixed order of additions, whatever the batch
        out += weights[:, k, None] * per_slot[:, k]
    if add is not None:  # after the routed terms, before the one rounding
        out += add.to(acc)
    return out.to(expert_out.dtype)


def check_combine_add(add: torch.Tensor | None, expert_out: torch.Tensor, topk_weights: torch.Tensor) -> None:
    """`combine`'s addend: None, or [T, D] in expert_out's dtype (no host synchronisation): every backend's check."""
    if add is None:
        return
    want = (topk_weights.shape[0], expert_out.shape[-1])
    if tuple(add.shape) != want or add.dtype != expert_out.dtype:
        raise ValueError(f"combine's add must be [T, D] = {list(want)} in expert_out's dtype {expert_out.dtype}; got {list(add.shape)} {add.dtype}")


def require_local_experts(ep_group) -> None:
    """For kernels that move tokens within one rank only: refuse an expert-parallel group of
    several ranks (the backend's EP kernel, chosen when ops are resolved with ep_size > 1, serves
    those), so a multi-rank run fails loudly instead of silently routing every token locally."""
    size = ep_size_of(ep_group)
    if size > 1:
        raise ValueError(
            f"this dispatch/combine kernel is local to one rank; an expert-parallel group of {size} ranks needs "
            f"the backend's EP kernel: resolve the ops with ep_size={size} (open_runtime(ep_size={size}))"
        )
