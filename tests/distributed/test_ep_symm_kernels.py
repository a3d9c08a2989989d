"""The cuda backend's symmetric-memory EP exchange (deepinfer_cuda.kernels.moe_ep_symm) in the
Triton interpreter, with W ranks simulated in one process.

Each "rank" has its own SymmetricExchange; its symmetric buffers are plain CPU tensors shared by a
fake allocator, so the "peer pointers" the kernels cast from int64 are real addresses of the other
ranks' tensors (the interpreter supports the int -> pointer cast). The ranks' dispatch/combine
step generators run in lockstep: every rank runs to its next barrier before any goes on. Results
must equal the NCCL path's bit for bit: the one-rank dispatch of all ranks' tokens, cut at the
expert shards, and the one-rank combine.
"""

from __future__ import annotations

import pytest
import torch

from triton_mode import kernel_module, require_interpreter

require_interpreter()
symm = kernel_module("deepinfer_cuda.kernels.moe_ep_symm")


class FakeWorld:
    """Symmetric allocations for W simulated ranks: the k-th alloc of a name gives every rank its
    own CPU tensor, and every rank the same list of their addresses."""

    def __init__(self, size: int):
        self.size = size
        self.allocations: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.barriers = 0

    def buffers(self, rank: int) -> "FakeBuffers":
        return FakeBuffers(self, rank)


class FakeBuffers:
    def __init__(self, world: FakeWorld, rank: int):
        self.world, self.rank, self.calls = world, rank, {}

    def alloc(self, name: str, nbytes: int):
        n = self.calls.get(name, 0)
        self.calls[name] = n + 1
        tensors = self.world.allocations.setdefault((name, n), [torch.full((nbytes,), 0xAB, dtype=torch.uint8) for _ in range(self.world.size)])
        assert all(t.numel() == nbytes for t in tensors), "ranks allocated different sizes"
        ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
        return symm.SymmetricBuffer(tensors[self.rank], ptrs)

    def barrier(self):
        raise AssertionError("lockstep() drives the barriers")


def lockstep(generators):
    """Run one step generator per rank, all to their next yield (barrier) before any goes on."""
    results = [None] * len(generators)
    live = dict(enumerate(generators))
    while live:
        for rank, gen in list(live.items()):
            try:
                next(gen)
            except StopIteration as stop:
                results[rank] = stop.value
                del live[rank]
    return results


def make_group(size: int, experts: int):
    from deepinfer.distributed import ExpertParallel

    world = FakeWorld(size)
    exchanges = []
    for rank in range(size):
        ep = ExpertParallel(None, experts)
        ep.rank, ep.size, ep.experts_per_rank = rank, size, experts // size
        exchanges.append(symm.SymmetricExchange(ep, world.buffers(rank), torch.device("cpu")))
    return world, exchanges


def one_rank(xs, ids, experts):
    from deepinfer.ops.moe import dispatch

    return dispatch(torch.cat(xs), torch.cat(ids), num_experts=experts)


@pytest.mark.parametrize(
    "size, experts, tokens, top_k, dim, dtype",
    [
        (2, 8, [5, 3], 3, 24, torch.bfloat16),
        (2, 16, [0, 7], 4, 10, torch.float32),  # a rank without tokens
        (4, 8, [2, 0, 6, 1], 2, 33, torch.float8_e4m3fn),  # fp8 as raw bytes, odd row length
        (3, 6, [4, 4, 4], 6, 8, torch.float16),  # every token on every expert
    ],
)
def test_symmetric_dispatch_and_combine_equal_the_one_rank_layout(size, experts, tokens, top_k, dim, dtype):
    from deepinfer.ops.moe import combine as ref_combine

    gen = torch.Generator().manual_seed(sum(tokens) * 31 + size)
    L = experts // size
    xs = [torch.randn(t, dim, generator=gen).to(dtype) for t in tokens]
    ids = [torch.rand(t, experts, generator=gen).topk(top_k, dim=-1).indices.to(torch.int32) for t in tokens]
    world, exchanges = make_group(size, experts)
    for step in range(3):  # parities 0, 1, 0: buffers are reused
        outs = lockstep([ex.dispatch_steps(x, i) for ex, x, i in zip(exchanges, xs, ids)])
        want_x, want_off, _ = one_rank(xs, ids, experts)
        for r, (expert_x, offsets, row_of_slot) in enumerate(outs):
            lo, hi = int(want_off[r * L]), int(want_off[(r + 1) * L])
            assert torch.equal(expert_x.view(torch.uint8), want_x[lo:hi].view(torch.uint8)), (step, r)
            assert torch.equal(offsets, (want_off[r * L:(r + 1) * L + 1] - lo).to(torch.int32)), (step, r)
            local = symm.local.dispatch  # the NCCL path's row_of_slot: the local send layout
            assert torch.equal(row_of_slot, local(xs[r], ids[r], num_experts=experts)[2]), (step, r)
        # combine: each rank's experts "compute" a row-dependent function; compare with one rank
        weights = [torch.rand(t, top_k, generator=gen) for t in tokens]
        expert_outs = [(o[0].float() * (1 + r) + 0.5).to(torch.bfloat16) for r, o in enumerate(outs)]
        combined = lockstep([ex.combine_steps(eo, w, o[2]) for ex, eo, w, o in zip(exchanges, expert_outs, weights, outs)])
        full_out = torch.cat(expert_outs)
        _, _, full_slots = one_rank(xs, ids, experts)
        want = symm.local.combine(full_out, torch.cat(weights), full_slots)  # the NCCL path's local combine
        torch.testing.assert_close(want.float(), ref_combine(full_out, torch.cat(weights), full_slots).float(), rtol=1.6e-2, atol=1e-2)
        assert torch.equal(torch.cat(combined), want), step
        assert all(ex.ep.pending == 0 for ex in exchanges)
        xs = [x.flip(0) for x in xs]  # different rows next round


def test_buffers_grow_collectively_and_a_late_combine_is_refused():
    world, exchanges = make_group(2, 4)
    gen = torch.Generator().manual_seed(0)
    small = [torch.randn(2, 8, generator=gen) for _ in range(2)]
    ids_small = [torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)] * 2
    first = lockstep([ex.dispatch_steps(x, i) for ex, x, i in zip(exchanges, small, ids_small)])
    big = [torch.randn(300, 1024, generator=gen) for _ in range(2)]  # 300 tokens x 4 KiB rows: past the first 1 MiB
    ids_big = [torch.randint(0, 4, (300, 1), generator=gen, dtype=torch.int32)] * 2
    second = lockstep([ex.dispatch_steps(x, i) for ex, x, i in zip(exchanges, big, ids_big)])
    assert ("rows1", 0) in world.allocations and exchanges[0].rows[1].nbytes >= 600 * 4096 // 2
    want_x, want_off, _ = one_rank(big, ids_big, 4)
    assert torch.equal(torch.cat([o[0] for o in second]), want_x)
    lockstep([ex.dispatch_steps(x, i) for ex, x, i in zip(exchanges, small, ids_small)])  # a third: parity 0 again
    with pytest.raises(ValueError, match="receive buffer was reused"):
        next(exchanges[0].combine_steps(first[0][0], torch.ones(2, 2), first[0][2]))


def test_not_registered_without_cuda_and_never_chosen_off_cuda():
    from deepinfer.registry import ResolveContext

    if not torch.cuda.is_available():
        assert symm.REGISTRATIONS == []
    ctx = ResolveContext("cuda", torch.device("cpu"), ep_size=2)
    assert symm.unusable_reason(ctx) is not None and symm.usable(ctx) is False


def test_ep_path_env(monkeypatch):
    from deepinfer.errors import UserError
    from deepinfer.registry import ResolveContext

    ctx = ResolveContext("cuda", torch.device("cpu"), ep_size=2)
    monkeypatch.setenv(symm.EP_PATH_ENV, "symm")
    with pytest.raises(UserError, match="symmetric-memory EP path cannot run"):
        symm.usable(ctx)
    monkeypatch.setenv(symm.EP_PATH_ENV, "nccl")
    assert symm.usable(ctx) is False
    monkeypatch.setenv(symm.EP_PATH_ENV, "bogus")
    with pytest.raises(UserError, match="DEEPINFER_EP_PATH"):
        symm.usable(ctx)
