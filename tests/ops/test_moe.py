"""The moe ops' references against independent per-token computations in Python floats."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.ops.moe import _gate_canonicalize, combine, dispatch, gate

# ---------------------------------------------------------------------------------------------
# gate
# ---------------------------------------------------------------------------------------------


def python_gate(logits, top_k, score_func, bias, n_group, topk_group, renormalize, scale):
    """DeepSeek's Gate, token by token over Python lists; ties go to the lowest index."""
    all_ids, all_weights = [], []
    for row in logits.double().tolist():
        if score_func == "softmax":
            top = max(row)
            exps = [math.exp(v - top) for v in row]
            scores = [e / sum(exps) for e in exps]
        elif score_func == "sigmoid":
            scores = [1 / (1 + math.exp(-v)) for v in row]
        else:
            scores = [math.sqrt(math.log1p(math.exp(v))) for v in row]
        select = [s + (bias[e] if bias is not None else 0.0) for e, s in enumerate(scores)]
        size = len(row) // n_group
        candidates = list(range(len(row)))
        if n_group > 1:
            group_score = []
            for g in range(n_group):
                members = sorted(select[g * size:(g + 1) * size], reverse=True)
                group_score.append(members[0] + members[1] if bias is not None else members[0])
            best_groups = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
            candidates = [e for e in candidates if e // size in best_groups]
        ids = sorted(candidates, key=lambda e: (-select[e], e))[:top_k]
        weights = [scores[e] for e in ids]
        if renormalize:
            weights = [w / sum(weights) for w in weights]
        all_ids.append(ids)
        all_weights.append([w * scale for w in weights])
    return all_weights, all_ids


GATE_CONFIGS = {
    "v3_sigmoid_grouped": dict(experts=256, top_k=8, score_func="sigmoid", bias=(0.0, 0.3), n_group=8, topk_group=4, renormalize=True, scale=2.5),
    "negative_bias_grouped": dict(experts=64, top_k=6, score_func="sigmoid", bias=(-0.9, 0.1), n_group=8, topk_group=2, renormalize=True, scale=2.5),
    "v2lite_softmax": dict(experts=64, top_k=6, score_func="softmax", bias=None, n_group=1, topk_group=1, renormalize=False, scale=1.0),
    "v2_softmax_grouped": dict(experts=160, top_k=6, score_func="softmax", bias=None, n_group=8, topk_group=3, renormalize=False, scale=16.0),
    "sqrtsoftplus": dict(experts=64, top_k=6, score_func="sqrtsoftplus", bias=(0.0, 0.2), n_group=1, topk_group=1, renormalize=True, scale=1.5),
    "top1": dict(experts=16, top_k=1, score_func="softmax", bias=None, n_group=1, topk_group=1, renormalize=False, scale=1.0),
}


def gate_case(name, tokens=9, seed=0):
    cfg = GATE_CONFIGS[name]
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, cfg["experts"], generator=gen, dtype=torch.float64) * 2
    bias = None
    if cfg["bias"] is not None:  # (mean, spread); a mean of -0.9 makes most s + bias < 0
        mean, spread = cfg["bias"]
        bias = mean + spread * torch.randn(cfg["experts"], generator=gen, dtype=torch.float64)
    kwargs = dict(top_k=cfg["top_k"], score_func=cfg["score_func"], correction_bias=bias, n_group=cfg["n_group"],
                  topk_group=cfg["topk_group"], renormalize=cfg["renormalize"], routed_scaling_factor=cfg["scale"])
    return logits, kwargs


def sorted_rows(weights, ids):
    """Rows ordered by expert id, as lists (the top-k order is not part of the contract)."""
    out_w, out_i = [], []
    for w_row, i_row in zip(weights, ids):
        pairs = sorted(zip(i_row, w_row))
        out_i.append([i for i, _ in pairs])
        out_w.append([w for _, w in pairs])
    return out_w, out_i


@pytest.mark.parametrize("name", sorted(GATE_CONFIGS))
def test_gate_matches_per_token_python_float64(name):
    logits, kw = gate_case(name)
    bias_list = kw["correction_bias"].tolist() if kw["correction_bias"] is not None else None
    want_w, want_i = sorted_rows(*python_gate(logits, kw["top_k"], kw["score_func"], bias_list, kw["n_group"],
                                              kw["topk_group"], kw["renormalize"], kw["routed_scaling_factor"]))
    weights, ids = gate(logits, **kw)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float64
    got_w, got_i = sorted_rows(weights.tolist(), ids.tolist())
    assert got_i == want_i
    assert torch.allclose(torch.tensor(got_w), torch.tensor(want_w), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", sorted(GATE_CONFIGS))
def test_gate_float32_routes_like_float64(name):
    logits, kw = gate_case(name, seed=1)
    bias = kw["correction_bias"]
    w64, i64 = gate(logits, **kw)
    kw32 = {**kw, "correction_bias": None if bias is None else bias.float()}
    w32, i32 = gate(logits.float(), **kw32)
    assert w32.dtype == torch.float32
    c64 = _gate_canonicalize({}, {"topk_weights": w64, "topk_ids": i64})
    c32 = _gate_canonicalize({}, {"topk_weights": w32, "topk_ids": i32})
    assert torch.equal(c32["topk_ids"], c64["topk_ids"])
    assert torch.allclose(c32["topk_weights"].double(), c64["topk_weights"], rtol=1e-5, atol=1e-6)


def test_group_limited_routing_changes_the_choice():
    """On the V3-like config the group limit matters, so a gate without it would be caught."""
    logits, kw = gate_case("v3_sigmoid_grouped")
    _, grouped = gate(logits, **kw)
    _, flat = gate(logits, **{**kw, "n_group": 1, "topk_group": 1})
    assert not torch.equal(grouped.sort(-1).values, flat.sort(-1).values)


def test_losing_groups_are_masked_with_minus_inf_not_zero():
    # Two groups of four; the bias pushes every s + bias below zero. Group 0 wins on its top-2.
    logits = torch.tensor([[3.0, 2.0, -1.0, -2.0, 0.0, 0.0, -3.0, -3.0]], dtype=torch.float64)
    bias = torch.full((8,), -2.0, dtype=torch.float64)
    kw = dict(top_k=3, score_func="sigmoid", correction_bias=bias, n_group=2, topk_group=1)
    _, ids = gate(logits, **kw)
    assert sorted(ids[0].tolist()) == [0, 1, 2]  # DeepSeek: only the winning group's experts

    # transformers' variant fills the losing group with 0.0, which beats every negative s + bias.
    selection = (logits.sigmoid() + bias).view(1, 2, 4)
    zero_filled = torch.cat([selection[:, 0], torch.zeros(1, 4, dtype=torch.float64)], dim=-1)
    zero_fill_ids = zero_filled.topk(3, dim=-1).indices
    assert set(zero_fill_ids[0].tolist()) <= {4, 5, 6, 7}
    assert set(zero_fill_ids[0].tolist()).isdisjoint(ids[0].tolist())


def test_bias_selects_but_does_not_weigh():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0], dtype=torch.float64)
    weights, ids = gate(logits, top_k=2, score_func="sigmoid", correction_bias=bias, routed_scaling_factor=3.0)
    order = ids[0].argsort()
    assert ids[0][order].tolist() == [0, 3]
    assert torch.allclose(weights[0][order], 3.0 * torch.sigmoid(torch.tensor([2.0, -1.0], dtype=torch.float64)))


def test_gate_ties_go_to_the_lowest_index():
    logits = torch.zeros(2, 12)
    _, ids = gate(logits, top_k=3, score_func="softmax")
    assert ids.sort(-1).values.tolist() == [[0, 1, 2]] * 2
    _, ids = gate(logits, top_k=4, score_func="sigmoid", correction_bias=torch.zeros(12), n_group=3, topk_group=2)
    assert ids.sort(-1).values.tolist() == [[0, 1, 2, 3]] * 2


def test_gate_canonicalize_sorts_ids_and_carries_weights():
    outputs = {"topk_ids": torch.tensor([[5, 1, 3], [0, 9, 2]], dtype=torch.int32),
               "topk_weights": torch.tensor([[0.5, 0.1, 0.3], [0.0, 0.9, 0.2]])}
    canon = _gate_canonicalize({}, outputs)
    assert canon["topk_ids"].tolist() == [[1, 3, 5], [0, 2, 9]]
    assert torch.allclose(canon["topk_weights"], torch.tensor([[0.1, 0.3, 0.5], [0.0, 0.2, 0.9]]))


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(score_func="relu"), "score_func"),
        (dict(n_group=3), "n_group"),
        (dict(n_group=4, topk_group=5), "topk_group"),
        (dict(n_group=4, topk_group=1, top_k=5), "top_k"),
        (dict(top_k=0), "top_k"),
        (dict(correction_bias=torch.zeros(8)), "correction_bias"),
    ],
)
def test_gate_rejects_bad_arguments(bad, message):
    kw = dict(top_k=2, score_func="sigmoid", n_group=1, topk_group=1) | bad
    with pytest.raises(ValueError, match=message):
        gate(torch.randn(3, 16), **kw)


# ---------------------------------------------------------------------------------------------
# dispatch and combine
# ---------------------------------------------------------------------------------------------


def random_routing(tokens, experts, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, experts, generator=gen).argsort(-1)[:, :top_k].to(torch.int32)


@pytest.mark.parametrize("tokens, experts, top_k", [(33, 16, 8), (1, 16, 8), (20, 64, 6), (7, 4, 1)])
def test_dispatch_layout_is_the_stable_sort_by_expert(tokens, experts, top_k):
    x = torch.randn(tokens, 24)
    ids = random_routing(tokens, experts, top_k, seed=tokens)
    expert_x, offsets, row_of_slot = dispatch(x, ids, num_experts=experts)
    flat = ids.flatten().tolist()
    slot_of_row = sorted(range(len(flat)), key=lambda s: flat[s])  # Python's sort is stable
    assert expert_x.dtype == x.dtype and offsets.dtype == torch.int32 and row_of_slot.dtype == torch.int32
    assert torch.equal(expert_x, torch.stack([x[s // top_k] for s in slot_of_row]))
    assert row_of_slot.tolist() == [slot_of_row.index(s) for s in range(len(flat))]
    counts = [flat.count(e) for e in range(experts)]
    assert offsets.tolist() == [sum(counts[:e]) for e in range(experts + 1)]


def test_dispatch_empty_experts_and_a_single_expert():
    x = torch.randn(12, 8, dtype=torch.bfloat16)
    ids = torch.full((12, 1), 3, dtype=torch.int32)
    expert_x, offsets, row_of_slot = dispatch(x, ids, num_experts=8)
    assert offsets.tolist() == [0, 0, 0, 0, 12, 12, 12, 12, 12]
    assert torch.equal(expert_x, x) and row_of_slot.tolist() == list(range(12))


def test_dispatch_keeps_slot_order_within_an_expert():
    # Every token picks experts {1, 0}: expert 0 gets slots 1, 3, 5, ... in that order.
    ids = torch.tensor([[1, 0]] * 5, dtype=torch.int32)
    x = torch.arange(5, dtype=torch.float32)[:, None]
    expert_x, offsets, row_of_slot = dispatch(x, ids, num_experts=2)
    assert offsets.tolist() == [0, 5, 10]
    assert expert_x[:, 0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert row_of_slot.tolist() == [5, 0, 6, 1, 7, 2, 8, 3, 9, 4]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_dispatch_experts_combine_is_the_weighted_expert_sum(dtype):
    """Expert e scales its rows by (e + 1), found through expert_offsets; combine must return
    sum_k w[t, k] * (id[t, k] + 1) * x[t], computed here token by token in float64."""
    tokens, experts, top_k = 17, 16, 8
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, 40, generator=gen, dtype=torch.float64).to(dtype)
    ids = random_routing(tokens, experts, top_k, seed=4)
    weights = torch.rand(tokens, top_k, generator=gen)
    expert_x, offsets, row_of_slot = dispatch(x, ids, num_experts=experts)
    expert_out = torch.empty_like(expert_x)
    for e in range(experts):
        rows = slice(int(offsets[e]), int(offsets[e + 1]))
        expert_out[rows] = expert_x[rows] * (e + 1)
    out = combine(expert_out, weights, row_of_slot)
    assert out.dtype == dtype and out.shape == x.shape
    want = torch.zeros(tokens, 40, dtype=torch.float64)
    for t in range(tokens):
        for k in range(top_k):
            want[t] += float(weights[t, k]) * (int(ids[t, k]) + 1) * x[t].double()
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert torch.allclose(out.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_combine_identity_experts_returns_weighted_sum_of_x():
    x = torch.randn(9, 16, dtype=torch.float64)
    ids = random_routing(9, 8, 3, seed=5)
    weights = torch.rand(9, 3, dtype=torch.float64)
    expert_x, _, row_of_slot = dispatch(x, ids, num_experts=8)
    out = combine(expert_x, weights, row_of_slot)
    assert torch.allclose(out, weights.sum(-1, keepdim=True) * x, rtol=1e-13, atol=1e-13)


def test_combine_is_batch_invariant():
    """A token's output is bit-identical alone and inside a batch (fixed k order, float32)."""
    tokens, experts, top_k = 24, 16, 8
    x = torch.randn(tokens, 64, dtype=torch.bfloat16)
    ids = random_routing(tokens, experts, top_k, seed=6)
    weights = torch.rand(tokens, top_k)
    expert = lambda rows: (torch.tanh(rows.float()) * 3).to(rows.dtype)  # noqa: E731
    expert_x, _, row_of_slot = dispatch(x, ids, num_experts=experts)
    full = combine(expert(expert_x), weights, row_of_slot)
    for t in (0, 5, 23):
        one_x, _, one_rows = dispatch(x[t:t + 1], ids[t:t + 1], num_experts=experts)
        alone = combine(expert(one_x), weights[t:t + 1], one_rows)
        assert torch.equal(alone[0], full[t])


def test_moe_ops_never_read_device_values():
    """On the meta device there are no values: any host synchronisation (.item(), data-dependent
    shapes) would fail. dispatch, combine and gate must run through."""
    meta = torch.device("meta")
    ids = torch.empty(5, 3, dtype=torch.int32, device=meta)
    expert_x, offsets, row_of_slot = dispatch(torch.empty(5, 8, device=meta), ids, num_experts=16)
    assert expert_x.shape == (15, 8) and offsets.shape == (17,) and row_of_slot.shape == (15,)
    out = combine(torch.empty(15, 8, device=meta), torch.empty(5, 3, device=meta), row_of_slot)
    assert out.shape == (5, 8)
    weights, topk_ids = gate(torch.empty(5, 64, device=meta), top_k=6, score_func="sigmoid",
                             correction_bias=torch.empty(64, device=meta), n_group=8, topk_group=2, renormalize=True)
    assert weights.shape == topk_ids.shape == (5, 6)


def test_expert_parallel_groups_of_more_than_one_rank_are_refused(monkeypatch):
    group = object()  # stands in for a process group; its size comes from get_world_size
    x, ids = torch.randn(4, 8), random_routing(4, 8, 2, seed=7)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda g=None: 1)
    local = dispatch(x, ids, num_experts=8, ep_group=group)
    assert all(torch.equal(a, b) for a, b in zip(local, dispatch(x, ids, num_experts=8)))
    combine(local[0], torch.rand(4, 2), local[2], ep_group=group)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda g=None: 2)
    with pytest.raises(ValueError, match="expert-parallel"):
        dispatch(x, ids, num_experts=8, ep_group=group)
    with pytest.raises(ValueError, match="expert-parallel"):
        combine(local[0], torch.rand(4, 2), local[2], ep_group=group)


def test_combine_adds_in_k_order_in_float32():
    # 1 + 2^25 rounds back to 2^25 in float32, so k order gives 0; any other order (or float64) gives 1.
    expert_out = torch.tensor([[1.0], [2.0**25], [-(2.0**25)]])
    out = combine(expert_out, torch.ones(1, 3), torch.arange(3, dtype=torch.int32))
    assert out.tolist() == [[0.0]]
    assert combine(expert_out.double(), torch.ones(1, 3), torch.arange(3, dtype=torch.int32)).tolist() == [[1.0]]
