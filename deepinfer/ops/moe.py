"""Mixture-of-experts routing: the gate, and moving tokens to their experts and back."""

from __future__ import annotations

import torch

from deepinfer.registry import ALLCLOSE, EXACT, op

SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")


def _gate_canonicalize(kwargs, outputs):
    raise NotImplementedError


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route each token to top_k of E experts, as DeepSeek's reference Gate does.

    logits: [T, E] router output (float32). scores s = softmax(logits) | sigmoid(logits) |
    sqrt(softplus(logits)). Selection scores s' = s + correction_bias (bias [E], only for selecting).
    With n_group > 1, experts form n_group consecutive groups; a group's score is the sum of its
    top-2 s' when a bias is given and its max otherwise; all but the best topk_group groups are
    masked with -inf (DeepSeek's reference; transformers' 0.0 fill differs once s' < 0).
    topk_ids = top_k of s' (descending); weights = s at those ids (no bias); when renormalize,
    weights /= their sum; then weights *= routed_scaling_factor.
    Returns (topk_weights [T, top_k] float32, topk_ids [T, top_k] int32). The order of the top_k
    entries is not part of the contract (the conformance suite sorts each row by id).
    """
    raise NotImplementedError


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
    """Permute token copies so that each expert's rows are contiguous.

    x: [T, D]; topk_ids: [T, K] int32 in [0, num_experts). Slot t*K + k is token t's k-th choice.
    Slots are ordered by expert id, ties kept in slot order (a stable sort), so the layout is
    fully determined. Returns expert_x [T*K, D] (x's rows in that order), expert_offsets
    [num_experts + 1] int32 (expert e's rows are expert_offsets[e]:expert_offsets[e+1]; an expert
    with no tokens has an empty range) and row_of_slot [T*K] int32 (the expert_x row that holds
    slot t*K + k), with no host synchronisation. `ep_group` (a torch.distributed process group)
    is the expert-parallel group; None means every expert is local.
    """
    raise NotImplementedError


@op(family="moe", outputs=("out",), compare=ALLCLOSE, reduction_length=lambda kw: kw["topk_weights"].shape[-1])
def combine(
    expert_out: torch.Tensor,
    topk_weights: torch.Tensor,
    row_of_slot: torch.Tensor,
    *,
    ep_group: object | None = None,
) -> torch.Tensor:
    """Weighted sum of each token's expert outputs: the inverse of `dispatch`.

    expert_out: [T*K, D] (rows in dispatch's order); topk_weights: [T, K] float32; row_of_slot:
    [T*K] int32 from dispatch. out[t] = sum over k = 0..K-1, in that order, of
    topk_weights[t, k] * expert_out[row_of_slot[t*K + k]], accumulated in float32 (a fixed order,
    so results do not depend on the batch). Returns [T, D] in expert_out's dtype.
    """
    raise NotImplementedError
