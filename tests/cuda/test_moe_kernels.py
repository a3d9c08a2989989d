"""The cuda backend's gate, dispatch and combine kernels under the Triton interpreter (CPU).

Shapes beyond the golden set, compared with the op references in deepinfer.ops.moe: gate configs
with and without groups and bias, every score function, exact ties, float64; dispatch with empty
experts, every slot on one expert, several count tiles, top_k = 1; combine in float32, bfloat16
and float64 over dispatch's layout.

tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported; tests/triton_mode.py fails
these tests loudly if the kernels in this process are not interpreted.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops import moe as ref

from triton_mode import kernel_module, require_interpreter


@pytest.fixture(scope="module")
def k():
    """The kernel module, checked to be decorated for the interpreter."""
    require_interpreter()
    return kernel_module("deepinfer_cuda.kernels.moe")


def _by_id(weights, ids):
    ids, order = torch.sort(ids, dim=-1, stable=True)
    return weights.gather(-1, order), ids


# ---------------------------------------------------------------------------------------------- gate

GATE_CASES = [
    # T, E, top_k, score_func, bias, n_group, topk_group, renormalize, scale
    (5, 256, 8, "sigmoid", True, 8, 4, True, 2.5),  # DeepSeek-V3
    (3, 64, 6, "softmax", False, 1, 1, False, 1.0),  # V2-Lite
    (9, 160, 6, "softmax", False, 8, 3, False, 16.0),  # groups of 20 (not a power of two)
    (4, 48, 6, "sqrtsoftplus", True, 1, 1, True, 1.5),
    (6, 96, 4, "sigmoid", True, 6, 2, True, 2.0),
    (2, 16, 1, "softmax", False, 1, 1, False, 1.0),
    (3, 40, 5, "sqrtsoftplus", False, 4, 4, False, 1.0),  # every group kept
]


@pytest.mark.parametrize("case", GATE_CASES, ids=lambda c: f"T{c[0]}_E{c[1]}_k{c[2]}_{c[3]}_g{c[5]}")
def test_gate_matches_reference(k, case):
    T, E, top_k, score, bias, G, TG, renorm, scale = case
    g = torch.Generator().manual_seed(E * 31 + top_k)
    logits = torch.randn(T, E, generator=g) * 2
    b = (torch.randn(E, generator=g) * 0.3 - 0.2) if bias else None  # negative biases too
    kw = dict(top_k=top_k, score_func=score, n_group=G, topk_group=TG, renormalize=renorm, routed_scaling_factor=scale)
    w, ids = k.gate(logits, correction_bias=b, **kw)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (T, top_k)
    wr, ir = ref.gate(logits.double(), correction_bias=None if b is None else b.double(), **kw)
    w, ids = _by_id(w, ids)
    wr, ir = _by_id(wr, ir)
    assert torch.equal(ids, ir)
    torch.testing.assert_close(w.double(), wr, rtol=1.3e-6, atol=1e-6)


def test_gate_ties_pick_lowest_index(k):
    # Exact ties among experts and among groups: the stable sort's choice (lowest index) is the contract.
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 1.0, 3.0, 3.0], [2.0] * 8, [0.0, 1.0] * 4])
    sigmoid_grouped = dict(top_k=2, n_group=2, topk_group=1, score_func="sigmoid", correction_bias=torch.zeros(8))
    for kw in (dict(top_k=3), dict(top_k=2, n_group=4, topk_group=2), sigmoid_grouped):
        w, ids = k.gate(logits, **kw)
        wr, ir = ref.gate(logits, **kw)
        assert torch.equal(_by_id(w, ids)[1], _by_id(wr, ir)[1]), kw


def test_gate_float64(k):
    logits = torch.randn(4, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(64, dtype=torch.float64) * 0.1
    kw = dict(top_k=6, score_func="sigmoid", correction_bias=bias, n_group=8, topk_group=3, renormalize=True, routed_scaling_factor=2.5)
    w, ids = k.gate(logits, **kw)
    wr, ir = ref.gate(logits, **kw)
    assert w.dtype == torch.float64
    w, ids = _by_id(w, ids)
    wr, ir = _by_id(wr, ir)
    assert torch.equal(ids, ir)
    torch.testing.assert_close(w, wr, rtol=1e-10, atol=1e-12)


def test_gate_checks_arguments(k):
    with pytest.raises(ValueError):
        k.gate(torch.randn(2, 10), top_k=2, n_group=3)


# ---------------------------------------------------------------------------------------------- dispatch / combine


def _ids(T, K, E, g, how):
    if how == "one_expert":
        return torch.full((T, K), E - 1, dtype=torch.int32)
    if how == "few_experts":  # most experts empty, repeated ids within a token too
        return torch.randint(0, 3, (T, K), generator=g, dtype=torch.int32) * (E // 3)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)


DISPATCH_CASES = [
    # T, K, E, D, dtype, ids
    (7, 8, 256, 40, torch.bfloat16, "random"),  # 56 slots, one count tile
    (90, 8, 256, 24, torch.float32, "random"),  # 720 slots: several count tiles of 64
    (33, 6, 64, 72, torch.bfloat16, "few_experts"),
    (12, 1, 8, 16, torch.float32, "one_expert"),
    (5, 4, 16, 8, torch.float64, "random"),
    (1, 8, 16, 5000, torch.bfloat16, "random"),  # one token, a long row split over columns
]


@pytest.mark.parametrize("case", DISPATCH_CASES, ids=lambda c: f"T{c[0]}_K{c[1]}_E{c[2]}_D{c[3]}_{str(c[4])[6:]}_{c[5]}")
def test_dispatch_and_combine_match_reference(k, case):
    T, K, E, D, dtype, how = case
    g = torch.Generator().manual_seed(T * 7 + K)
    x = torch.randn(T, D, generator=g).to(dtype)
    ids = _ids(T, K, E, g, how)
    got = k.dispatch(x, ids, num_experts=E)
    want = ref.dispatch(x, ids, num_experts=E)
    for name, a, b in zip(("expert_x", "expert_offsets", "row_of_slot"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name

    expert_out = torch.randn(T * K, D, generator=g).to(dtype)
    weights = torch.rand(T, K, generator=g)
    out = k.combine(expert_out, weights, got[2])
    assert out.dtype == dtype and out.shape == (T, D)
    exact = ref.combine(expert_out.double(), weights.double(), got[2])
    rtol, atol = {torch.float64: (1e-10, 1e-12), torch.float32: (1.3e-6, 1e-6), torch.bfloat16: (1.6e-2, 1e-3)}[dtype]
    torch.testing.assert_close(out.double(), exact, rtol=rtol, atol=atol * K)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_combine_adds_a_shared_expert_row_after_the_routed_terms(k, dtype):
    # add (a shared expert's output, here a strided view) joins each token's float32 sum after its K terms,
    # rounded once with it; a long row (several column blocks) and a token count that is not a power of two
    T, K, D = 9, 4, 3000
    g = torch.Generator().manual_seed(11)
    rows = torch.randperm(T * K, generator=g).to(torch.int32)
    expert_out = torch.randn(T * K, D, generator=g).to(dtype)
    weights = torch.rand(T, K, generator=g)
    add = (3 * torch.randn(T, D + 5, generator=g)).to(dtype)[:, :D]
    out = k.combine(expert_out, weights, rows, add=add)
    exact = ref.combine(expert_out.double(), weights.double(), rows, add=add.double())
    rtol, atol = {torch.float64: (1e-10, 1e-12), torch.float32: (1.3e-6, 1e-6), torch.bfloat16: (1.6e-2, 1e-3)}[dtype]
    torch.testing.assert_close(out.double(), exact, rtol=rtol, atol=atol * (K + 1))
    with pytest.raises(ValueError, match="combine's add must be"):
        k.combine(expert_out, weights, rows, add=add[:, 1:])


@pytest.mark.parametrize("tile_elems", [8192, 4096])
def test_dispatch_with_smaller_count_tiles(k, monkeypatch, tile_elems):
    # The SM90 table's 8192 (expert x slot) count elements: tiles of 32 slots at 256 experts (16 at 4096);
    # the same rows, offsets and slots as the reference over many tiles.
    import deepinfer_cuda.kernels.moe as moe

    original = moe._cfg
    monkeypatch.setattr(moe, "_cfg", lambda o, v, d: dict(original(o, v, d), count_tile_elems=tile_elems) if o == "dispatch" else original(o, v, d))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(90, 24, generator=g)
    ids = _ids(90, 8, 256, g, "random")
    for a, b in zip(k.dispatch(x, ids, num_experts=256), ref.dispatch(x, ids, num_experts=256)):
        assert torch.equal(a, b)


def test_dispatch_empty_batch(k):
    out = k.dispatch(torch.randn(0, 8), torch.empty(0, 4, dtype=torch.int32), num_experts=16)
    assert out[0].shape == (0, 8) and torch.equal(out[1], torch.zeros(17, dtype=torch.int32)) and out[2].numel() == 0


# ---------------------------------------------------------------------------------------------- registration and fallback


def test_registrations(k):
    from deepinfer.registry import all_ops, check_signature

    ops = all_ops()
    assert {r.op for r in k.REGISTRATIONS} == {"gate", "dispatch", "combine"}
    for r in k.REGISTRATIONS:
        check_signature(ops[r.op], r.fn, "cuda")
