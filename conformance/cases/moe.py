"""Cases for the moe ops: gate, dispatch and combine."""

from __future__ import annotations

from functools import partial

import torch

from deepinfer_conformance.cases import Case, randn

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


def gate_inputs(gen, dtype, *, tokens: int, experts: int, top_k: int, bias: tuple[float, float] | None = None, **params):
    """Router logits (float32 whatever the case dtype: routers run in float32) and the gate's
    parameters; `bias` = (mean, spread) of a random correction bias."""
    kw = {"logits": randn(gen, tokens, experts, scale=2.0), "top_k": top_k, **params}
    if bias is not None:
        mean, spread = bias
        kw["correction_bias"] = (mean + randn(gen, experts, dtype=torch.float64, scale=spread)).float()
    return kw


def hash_gate_inputs(gen, dtype, *, tokens: int, experts: int, top_k: int, vocab: int, table_dtype=torch.int64, **params):
    """Router logits and a hash-routing table ([vocab, top_k] distinct experts per row, as V4's tid2eid) with
    the tokens' ids (one id repeated: two tokens share their experts, not their weights)."""
    kw = gate_inputs(gen, dtype, tokens=tokens, experts=experts, top_k=top_k, **params)
    kw["hash_table"] = distinct_ids(gen, vocab, experts, top_k).to(table_dtype)
    ids = torch.randint(0, vocab, (tokens,), generator=gen, dtype=torch.int64)
    ids[-1] = ids[0]
    kw["token_ids"] = ids
    return kw


def slot_rows(topk_ids: torch.Tensor) -> torch.Tensor:
    """row_of_slot as dispatch defines it: the rank of each slot in a stable sort by expert id."""
    order = torch.sort(topk_ids.flatten().long(), stable=True).indices
    return torch.argsort(order).to(torch.int32)


def distinct_ids(gen, tokens: int, experts: int, top_k: int) -> torch.Tensor:
    """Each token's top_k distinct experts, uniformly at random."""
    return torch.rand(tokens, experts, generator=gen).argsort(dim=-1)[:, :top_k].to(torch.int32)


def routing(gen, tokens: int, experts: int, top_k: int, pattern: str) -> torch.Tensor:
    if pattern == "random":
        return distinct_ids(gen, tokens, experts, top_k)
    if pattern == "one_expert":  # every copy of every token lands on expert 3 (K = 1)
        return torch.full((tokens, top_k), 3, dtype=torch.int32)
    if pattern == "skip_experts":  # experts 0, 5 and the last get no tokens
        pool = torch.tensor([e for e in range(experts) if e not in (0, 5, experts - 1)])
        return pool[distinct_ids(gen, tokens, len(pool), top_k).long()].to(torch.int32)
    raise ValueError(f"unknown routing pattern {pattern!r}")


def dispatch_inputs(gen, dtype, *, tokens: int, dim: int, experts: int, top_k: int, pattern: str = "random"):
    return {
        "x": randn(gen, tokens, dim, dtype=dtype),
        "topk_ids": routing(gen, tokens, experts, top_k, pattern),
        "num_experts": experts,
    }


def combine_inputs(gen, dtype, *, tokens: int, dim: int, experts: int, top_k: int, pattern: str = "random", shared: bool = False):
    """The routing is the generator's first draw (the multi-rank runner rebuilds it); shared: a shared expert's
    output as `add`, drawn last."""
    topk_ids = routing(gen, tokens, experts, top_k, pattern)
    weights = torch.rand(tokens, top_k, generator=gen, dtype=torch.float64)
    kw = {
        "expert_out": randn(gen, tokens * top_k, dim, dtype=dtype, scale=3.0),
        "topk_weights": (2.5 * weights / weights.sum(-1, keepdim=True)).float(),
        "row_of_slot": slot_rows(topk_ids),
    }
    if shared:
        kw["add"] = randn(gen, tokens, dim, dtype=dtype, scale=3.0)
    return kw


GATE_RECIPES = [
    # DeepSeek-V3: sigmoid + bias, 8 groups of 32 scored by their top-2, 4 kept, renormalised, x2.5.
    # The bias spread (0.3) is as wide as the scores' own, so the kept groups decide the experts.
    ("v3_sigmoid_grouped_t7",
     partial(gate_inputs, tokens=7, experts=256, top_k=8, bias=(0.0, 0.3),
             score_func="sigmoid", n_group=8, topk_group=4, renormalize=True, routed_scaling_factor=2.5)),
    ("v3_sigmoid_grouped_t1",
     partial(gate_inputs, tokens=1, experts=256, top_k=8, bias=(0.0, 0.3),
             score_func="sigmoid", n_group=8, topk_group=4, renormalize=True, routed_scaling_factor=2.5)),
    # s + bias < 0 for most experts: filling losing groups with 0.0 instead of -inf would pick them.
    ("sigmoid_grouped_negative_bias",
     partial(gate_inputs, tokens=9, experts=64, top_k=6, bias=(-0.9, 0.1),
             score_func="sigmoid", n_group=8, topk_group=2, renormalize=True, routed_scaling_factor=2.5)),
    # DeepSeek-V2-Lite: softmax, greedy over 64 experts, no renormalisation.
    ("v2lite_softmax_greedy", partial(gate_inputs, tokens=13, experts=64, top_k=6, score_func="softmax")),
    # DeepSeek-V2: softmax, groups scored by their max (no bias), 3 of 8 kept, x16.
    ("v2_softmax_grouped_no_bias",
     partial(gate_inputs, tokens=11, experts=160, top_k=6, score_func="softmax", n_group=8, topk_group=3, routed_scaling_factor=16.0)),
    ("sqrtsoftplus_bias_renorm",
     partial(gate_inputs, tokens=10, experts=64, top_k=6, bias=(0.0, 0.2), score_func="sqrtsoftplus", renormalize=True, routed_scaling_factor=1.5)),
    ("softmax_top1", partial(gate_inputs, tokens=17, experts=16, top_k=1, score_func="softmax")),
    # Hash routing (V4's first layers): the experts from the table's row of each token id, weighed by sqrt(softplus)
    # scores, renormalised and scaled; and softmax scores of one given expert, an int32 table.
    ("v4_hash_sqrtsoftplus_renorm_t5",
     partial(hash_gate_inputs, tokens=5, experts=64, top_k=6, vocab=37, score_func="sqrtsoftplus", renormalize=True, routed_scaling_factor=1.5)),
    ("hash_softmax_top1_t3_int32_table", partial(hash_gate_inputs, tokens=3, experts=16, top_k=1, vocab=9, table_dtype=torch.int32, score_func="softmax")),
]

DISPATCH_RECIPES = [
    ("t33_k8_e16_d96", partial(dispatch_inputs, tokens=33, dim=96, experts=16, top_k=8)),
    ("t1_k8_e16_d96", partial(dispatch_inputs, tokens=1, dim=96, experts=16, top_k=8)),
    ("t12_k1_e8_one_expert", partial(dispatch_inputs, tokens=12, dim=64, experts=8, top_k=1, pattern="one_expert")),
    ("t20_k6_e64_empty_experts", partial(dispatch_inputs, tokens=20, dim=64, experts=64, top_k=6, pattern="skip_experts")),
]

COMBINE_RECIPES = [
    ("t33_k8_e16_d96", partial(combine_inputs, tokens=33, dim=96, experts=16, top_k=8)),
    ("t1_k8_e16_d96", partial(combine_inputs, tokens=1, dim=96, experts=16, top_k=8)),
    ("t12_k1_e8_one_expert", partial(combine_inputs, tokens=12, dim=64, experts=8, top_k=1, pattern="one_expert")),
    ("t20_k6_e64_empty_experts", partial(combine_inputs, tokens=20, dim=64, experts=64, top_k=6, pattern="skip_experts")),
    # A shared expert's output added after the routed terms, rounded once with them (V2/V3/V4's MoE).
    ("t5_k4_e8_d48_shared_add", partial(combine_inputs, tokens=5, dim=48, experts=8, top_k=4, shared=True)),
]

CASES = (
    [Case("gate", name, torch.float32, make) for name, make in GATE_RECIPES]
    + [Case("dispatch", name, dtype, make) for name, make in DISPATCH_RECIPES for dtype in ACTIVATION_DTYPES]
    + [Case("combine", name, dtype, make) for name, make in COMBINE_RECIPES for dtype in ACTIVATION_DTYPES]
)
