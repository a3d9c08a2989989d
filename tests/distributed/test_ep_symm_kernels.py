"""The cuda backend's symmetric-memory EP exchange (deepinfer_cuda.kernels.moe_ep_symm) in the
Triton interpreter, with W ranks simulated in one process.

Each "rank" has its own SymmetricExchange; its symmetric buffers are plain CPU tensors shared by a
fake allocator, so the "peer pointers" the kernels cast from int64 are real addresses of the other
ranks' tensors (the interpreter supports the int -> pointer cast). The ranks' dispatch/combine
step generators run in lockstep: every rank runs to its next barrier before any goes on.
Dispatch must equal the NCCL path's bit for bit (the one-rank dispatch of all ranks' tokens, cut at
the expert shards; row_of_slot in the send layout), in both modes (latency: rows past the last
offset are padding; throughput) and with or without a token bound. Combine must equal, bit for bit,
its own order of additions (`partial_sums`: per owner rank in k order, rounded to the partial's
dtype, then over the ranks, then each rank's `add` row), and the one-rank combine within the op's tolerance.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from triton_mode import kernel_module, require_interpreter

require_interpreter()
symm = kernel_module("deepinfer_cuda.kernels.moe_ep_symm")


class FakeWorld:
    """Symmetric allocations for W simulated ranks, paired like torch's rendezvous: the k-th
    allocation of every rank meets the k-th of the others (a collective), which must have the same
    size in bytes (torch: "Expected reqs[r].buffer_size == reqs[0].buffer_size"). Every rank gets its
    own CPU tensor and the same list of their addresses."""

    def __init__(self, size: int):
        self.size = size
        self.allocations: list[tuple[str, list[torch.Tensor]]] = []  # k-th collective allocation
        self.requests: list[list[tuple[str, int]]] = [[] for _ in range(size)]  # per rank: (name, nbytes)

    def buffers(self, rank: int) -> "FakeBuffers":
        return FakeBuffers(self, rank)

    def names(self) -> list[str]:
        return [name for name, _ in self.allocations]


class FakeBuffers:
    def __init__(self, world: FakeWorld, rank: int):
        self.world, self.rank = world, rank

    def alloc(self, name: str, nbytes: int):
        w = self.world
        k = len(w.requests[self.rank])
        w.requests[self.rank].append((name, nbytes))
        if k == len(w.allocations):
            w.allocations.append((name, [torch.full((nbytes,), 0xAB, dtype=torch.uint8) for _ in range(w.size)]))
        got_name, tensors = w.allocations[k]
        assert (got_name, tensors[0].numel()) == (name, nbytes), (
            f"rank {self.rank}'s allocation {k} is {name} of {nbytes} bytes; another rank's is {got_name} of {tensors[0].numel()}")
        ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
        return symm.SymmetricBuffer(tensors[self.rank], ptrs)

    def barrier(self):
        raise AssertionError("lockstep() drives the barriers")


def lockstep(generators, order=None):
    """Run one step generator per rank, all to their next yield (barrier) before any goes on.
    order(epoch, ranks) -> the ranks in the order their segments run in that epoch (default: rank
    order): a rank runs everything up to its next barrier before the next rank starts, so a rank
    that goes first after a barrier does its work (e.g. writes into the peers' buffers for the NEXT
    op) before the others do what follows the same barrier (e.g. read their buffers)."""
    results = [None] * len(generators)
    live = dict(enumerate(generators))
    epoch = 0
    while live:
        ranks = list(live)
        for rank in (order(epoch, ranks) if order else ranks):
            try:
                next(live[rank])
            except StopIteration as stop:
                results[rank] = stop.value
                del live[rank]
        epoch += 1
    return results


def make_eps(size: int, experts: int, bound=None):
    from deepinfer.distributed import ExpertParallel

    eps = []
    for rank in range(size):
        ep = ExpertParallel(None, experts)
        ep.rank, ep.size, ep.experts_per_rank = rank, size, experts // size
        ep.token_bound = bound
        eps.append(ep)
    return eps


def make_states(size: int):
    world = FakeWorld(size)
    return world, [symm.SymmetricState(world.buffers(rank), torch.device("cpu"), size) for rank in range(size)]


def make_group(size: int, experts: int, states=None, bound=None):
    world, states = (None, states) if states is not None else make_states(size)
    exchanges = [symm.SymmetricExchange(ep, st) for ep, st in zip(make_eps(size, experts, bound), states)]
    return world, exchanges


def one_rank(xs, ids, experts):
    from deepinfer.ops.moe import dispatch

    return dispatch(torch.cat(xs), torch.cat(ids), num_experts=experts)


def check_dispatch(outs, xs, ids, experts, label=""):
    """Each rank's (expert_x, offsets, row_of_slot) against the one-rank layout cut at the shards."""
    size = len(outs)
    L = experts // size
    want_x, want_off, _ = one_rank(xs, ids, experts)
    for r, (expert_x, offsets, row_of_slot) in enumerate(outs):
        lo, hi = int(want_off[r * L]), int(want_off[(r + 1) * L])
        assert expert_x.dtype == xs[r].dtype and expert_x.shape[0] >= hi - lo, (label, r)
        assert torch.equal(expert_x[: hi - lo].view(torch.uint8), want_x[lo:hi].view(torch.uint8)), (label, r)
        assert torch.equal(offsets, (want_off[r * L:(r + 1) * L + 1] - lo).to(torch.int32)), (label, r)
        send_layout = symm.local.dispatch(xs[r], ids[r], num_experts=experts)[2]  # the NCCL path's row_of_slot
        assert torch.equal(row_of_slot, send_layout), (label, r)


@triton.jit
def _cast_kernel(src_ptr, dst_ptr, N, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=i < N).to(dst_ptr.dtype.element_ty), mask=i < N)


def triton_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t.to(dtype) as a Triton kernel's .to() rounds (the interpreter truncates float32 -> bfloat16,
    a GPU rounds to nearest even): the kernels' own rounding, so the sums below can be compared bit
    for bit."""
    if t.dtype == dtype:
        return t
    out = torch.empty(t.shape, dtype=dtype)
    _cast_kernel[(1,)](t.contiguous(), out, t.numel(), BLOCK=triton.next_power_of_2(max(t.numel(), 1)))
    return out


def partial_sums(expert_outs, weights, ids, xs, experts, adds=None):
    """The symmetric-memory combine's order of additions, in torch: owner r's partial for token t is
    the sum over its slots in k order (float32, float64 for float64) rounded to the partial's dtype;
    the token's result adds the partials of its owners in rank order, then its row of `adds` (each
    rank's addend, concatenated) if given, and is rounded once."""
    size = len(expert_outs)
    L = experts // size
    _, want_off, full_slots = one_rank(xs, ids, experts)
    dtype = expert_outs[0].dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    wire = symm._wire_dtype(dtype)
    all_ids = torch.cat(ids).long()
    all_w = torch.cat(weights)
    rows = full_slots.view(all_ids.shape).long()
    D = expert_outs[0].shape[-1]
    out = torch.zeros(all_ids.shape[0], D, dtype=acc)
    for t in range(all_ids.shape[0]):
        for r in range(size):
            ks = [k for k in range(all_ids.shape[1]) if int(all_ids[t, k]) // L == r]
            if not ks:
                continue
            part = torch.zeros(D, dtype=acc)
            for k in ks:
                part = part + all_w[t, k].to(acc) * expert_outs[r][int(rows[t, k]) - int(want_off[r * L])].to(acc)
            out[t] = out[t] + triton_cast(part, wire).to(acc)
        if adds is not None:
            out[t] = out[t] + torch.cat(adds)[t].to(acc)
    return triton_cast(out, dtype)


def check_combine(combined, expert_outs, weights, ids, xs, experts, label="", adds=None):
    from deepinfer.ops.moe import combine as ref_combine

    want = partial_sums(expert_outs, weights, ids, xs, experts, adds)
    assert torch.equal(torch.cat(combined), want), label
    _, want_off, full_slots = one_rank(xs, ids, experts)
    size = len(expert_outs)
    L = experts // size
    full_out = torch.cat([eo[: int(want_off[(r + 1) * L] - want_off[r * L])] for r, eo in enumerate(expert_outs)])
    ref = ref_combine(full_out, torch.cat(weights), full_slots, add=None if adds is None else torch.cat(adds))
    torch.testing.assert_close(torch.cat(combined).float(), ref.float(), rtol=1.6e-2, atol=2e-2)


@pytest.fixture(params=["latency", "throughput"])
def mode(request, monkeypatch):
    """Both expand modes: latency (the default for these sizes) and throughput (no latency slots)."""
    if request.param == "throughput":
        monkeypatch.setattr(symm, "LATENCY_SLOTS", 0)
    return request.param


# Each shape in both modes (the `mode` fixture), the token bound alternating over the shapes (pairwise:
# the interpreter is slow), so each mode runs with and without it.
@pytest.mark.parametrize(
    "size, experts, tokens, top_k, dim, dtype, bounded",
    [
        (2, 8, [5, 3], 3, 24, torch.bfloat16, False),
        (2, 16, [0, 7], 4, 10, torch.float32, True),  # a rank without tokens
        (4, 8, [2, 0, 6, 1], 2, 33, torch.float8_e4m3fn, False),  # fp8 as raw bytes, odd row length
        (3, 6, [4, 4, 4], 6, 8, torch.float16, True),  # every token on every expert
        (4, 8, [2, 0, 6, 1], 2, 33, torch.float8_e4m3fn, True),  # the 4-rank case bounded too
    ],
)
def test_symmetric_dispatch_and_combine(size, experts, tokens, top_k, dim, dtype, bounded, mode):
    gen = torch.Generator().manual_seed(sum(tokens) * 31 + size)
    xs = [torch.randn(t, dim, generator=gen).to(dtype) for t in tokens]
    ids = [torch.rand(t, experts, generator=gen).topk(top_k, dim=-1).indices.to(torch.int32) for t in tokens]
    world, exchanges = make_group(size, experts, bound=max(tokens) + 2 if bounded else None)
    for step in range(3):  # parities 0, 1, 0: buffers are reused
        outs = lockstep([ex.dispatch_steps(x, i) for ex, x, i in zip(exchanges, xs, ids)])
        check_dispatch(outs, xs, ids, experts, step)
        if mode == "throughput":
            assert all(o[0].shape[0] == int(o[1][-1]) for o in outs)  # sized exactly
        weights = [torch.rand(t, top_k, generator=gen) for t in tokens]
        expert_outs = [(o[0].float() * (1 + r) + 0.5).to(torch.bfloat16) for r, o in enumerate(outs)]
        combined = lockstep([ex.combine_steps(eo, w, o[2]) for ex, eo, w, o in zip(exchanges, expert_outs, weights, outs)])
        check_combine(combined, expert_outs, weights, ids, xs, experts, step)
        assert all(ex.ep.pending == 0 for ex in exchanges)
        xs = [x.flip(0) for x in xs]  # different rows next round


def test_combine_adds_each_ranks_addend_after_the_partials(mode):
    """`add` (a shared expert's output: each rank's own tokens' rows, a strided view) joins each token's sum
    after its owners' partials, rounded once with them; a rank without tokens passes an empty one."""
    gen = torch.Generator().manual_seed(5)
    tokens, experts, top_k, dim = [5, 0, 3], 6, 2, 20
    xs = [torch.randn(t, dim, generator=gen).to(torch.bfloat16) for t in tokens]
    ids = [torch.rand(t, experts, generator=gen).topk(top_k, dim=-1).indices.to(torch.int32) for t in tokens]
    _, exchanges = make_group(3, experts)
    outs = lockstep([ex.dispatch_steps(x, i) for ex, x, i in zip(exchanges, xs, ids)])
    weights = [torch.rand(t, top_k, generator=gen) for t in tokens]
    expert_outs = [(o[0].float() * (1 + r) + 0.5).to(torch.bfloat16) for r, o in enumerate(outs)]
    adds = [(3 * torch.randn(t, dim + 4, generator=gen)).to(torch.bfloat16)[:, :dim] for t in tokens]
    combined = lockstep([ex.combine_steps(eo, w, o[2], a) for ex, eo, w, o, a in zip(exchanges, expert_outs, weights, outs, adds)])
    check_combine(combined, expert_outs, weights, ids, xs, experts, adds=adds)


def test_duplicate_experts_in_a_token_keep_slot_order(mode):
    """Routing with the same expert twice in a token (not what a gate makes, but the op allows it)."""
    ids = [torch.tensor([[1, 1, 2], [0, 3, 3]], dtype=torch.int32), torch.tensor([[3, 3, 3]], dtype=torch.int32)]
    xs = [torch.randn(2, 6), torch.randn(1, 6)]
    _, exchanges = make_group(2, 4)
    outs = lockstep([ex.dispatch_steps(x, i) for ex, x, i in zip(exchanges, xs, ids)])
    check_dispatch(outs, xs, ids, 4)


def test_buffers_grow_collectively_and_combines_may_come_late(monkeypatch):
    # The first buffers hold 64 KiB here instead of 1 MiB: the same growth path with 24 tokens instead
    # of 300 (the interpreter's cost is per token program).
    monkeypatch.setattr(symm, "_MIN_BYTES", 1 << 16)
    world, exchanges = make_group(2, 4)
    gen = torch.Generator().manual_seed(0)
    small = [torch.randn(2, 8, generator=gen) for _ in range(2)]
    ids_small = [torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)] * 2
    first = lockstep([ex.dispatch_steps(x, i) for ex, x, i in zip(exchanges, small, ids_small)])
    big = [torch.randn(24, 1024, generator=gen) for _ in range(2)]  # 24 tokens x 4 KiB rows: past the first 64 KiB
    ids_big = [torch.randint(0, 4, (24, 1), generator=gen, dtype=torch.int32)] * 2
    second = lockstep([ex.dispatch_steps(x, i) for ex, x, i in zip(exchanges, big, ids_big)])
    check_dispatch(second, big, ids_big, 4)
    third = lockstep([ex.dispatch_steps(x, i) for ex, x, i in zip(exchanges, big, ids_big)])  # parity 0 again: tok0 grows
    check_dispatch(third, big, ids_big, 4)
    names = world.names()
    assert names.count("tok0") == 2 and names.count("tok1") == 1, names
    st = exchanges[0].state
    assert st.current[("tok", 0)].nbytes >= 2 * 24 * 4096 and st.current[("tok", 1)].nbytes >= 2 * 24 * 4096
    assert len(st.kept) == st.allocations == len(world.allocations)  # the outgrown buffer is kept, never freed
    # the first dispatch's combine, after two more dispatches: nothing it reads was reused
    weights = [torch.rand(2, 2, generator=gen) for _ in range(2)]
    eos = [o[0].to(torch.bfloat16) for o in first]
    got = lockstep([ex.combine_steps(eo, w, o[2]) for ex, eo, w, o in zip(exchanges, eos, weights, first)])
    check_combine(got, eos, weights, ids_small, small, 4)


def test_a_dispatch_past_the_token_bound_is_refused():
    _, exchanges = make_group(2, 4, bound=3)
    with pytest.raises(ValueError, match="token_bound is 3"):
        next(exchanges[0].dispatch_steps(torch.randn(4, 8), torch.zeros(4, 1, dtype=torch.int32)))


def test_never_chosen_off_cuda_under_auto():
    from deepinfer.registry import ResolveContext

    ctx = ResolveContext("cuda", torch.device("cpu"), ep_size=2)
    assert symm.unusable_reason(ctx) is not None and symm.chosen(ctx) is False


def test_ep_path_option(monkeypatch):
    """ep_path (backend option, default from DEEPINFER_EP_PATH): nccl never takes this path, symm
    always does, and where it cannot run resolve fails with one line instead of a fallback."""
    from deepinfer.options import BackendOptionError
    from deepinfer.registry import Registry, RegistryError, ResolveContext
    from deepinfer_cuda.options import OPTIONS

    def ctx(path):
        return ResolveContext("cuda", torch.device("cpu"), ep_size=2, options={"ep_path": path})

    assert symm.chosen(ctx("nccl")) is False and symm.chosen(ctx("symm")) is True
    registry = Registry()
    registry.register_all("cuda", symm.REGISTRATIONS)
    with pytest.raises(RegistryError, match="ep_path=symm, but the symmetric-memory EP path cannot run") as err:
        registry.choose(ctx("symm"), "dispatch")
    assert "\n" not in str(err.value)
    assert registry.choose(ctx("auto"), "dispatch") is None  # not chosen: the NCCL path (not registered here) would serve
    monkeypatch.setenv("DEEPINFER_EP_PATH", "bogus")
    with pytest.raises(BackendOptionError, match="DEEPINFER_EP_PATH"):
        from deepinfer.options import resolve_options

        resolve_options("cuda", OPTIONS)


def _orders():
    """Segment orders after each barrier: rank order, reversed, and seeded random permutations."""
    rng = torch.Generator().manual_seed(7)
    return {
        "rank order": None,
        "reversed": lambda epoch, ranks: ranks[::-1],
        "alternating": lambda epoch, ranks: ranks if epoch % 2 else ranks[::-1],
        "random": lambda epoch, ranks: [ranks[i] for i in torch.randperm(len(ranks), generator=rng).tolist()],
    }


def _two_in_flight(ex, xs, ids, weights, r):
    """One rank's program: two dispatches, then both combines (two micro-batches in flight), then one
    more dispatch + combine (parity 0 again). Returns what each op gave."""
    d0 = yield from ex.dispatch_steps(xs[0], ids[0])
    d1 = yield from ex.dispatch_steps(xs[1], ids[1])
    eo0 = (d0[0].float() * (1 + r) + 0.5).to(torch.bfloat16)  # read only now: d1 must not have overwritten d0's rows
    eo1 = (d1[0].float() * (2 + r) - 0.25).to(torch.bfloat16)
    c0 = yield from ex.combine_steps(eo0, weights[0], d0[2])
    c1 = yield from ex.combine_steps(eo1, weights[1], d1[2])
    d2 = yield from ex.dispatch_steps(xs[0], ids[0])
    eo2 = (d2[0].float() * (1 + r) + 0.5).to(torch.bfloat16)
    c2 = yield from ex.combine_steps(eo2, weights[0], d2[2])
    return (eo0, eo1, eo2), (c0, c1, c2), (d0, d1, d2)


def _check_two_in_flight(size=3, experts=6, tokens=(4, 0, 5), top_k=2, dim=20, order=None, bound=None):
    gen = torch.Generator().manual_seed(11)
    xs = [[torch.randn(t, dim, generator=gen).to(torch.bfloat16) for t in tokens] for _ in range(2)]
    ids = [[torch.rand(t, experts, generator=gen).topk(top_k, dim=-1).indices.to(torch.int32) for t in tokens] for _ in range(2)]
    weights = [[torch.rand(t, top_k, generator=gen) for t in tokens] for _ in range(2)]
    _, exchanges = make_group(size, experts, bound=bound)
    outs = lockstep([_two_in_flight(ex, [xs[0][r], xs[1][r]], [ids[0][r], ids[1][r]], [weights[0][r], weights[1][r]], r)
                     for r, ex in enumerate(exchanges)], order)
    for n, b in enumerate((0, 1, 0)):
        check_dispatch([o[2][n] for o in outs], xs[b], ids[b], experts, n)
        check_combine([o[1][n] for o in outs], [o[0][n] for o in outs], weights[b], ids[b], xs[b], experts, n)


# Each order with both modes (the `mode` fixture); the token bound alternates over the orders, so each
# mode runs with and without it (pairwise rather than every combination: the interpreter is slow).
@pytest.mark.parametrize("order, bounded", [("rank order", False), ("reversed", True), ("alternating", False), ("random", True)])
def test_any_order_of_the_ranks_between_barriers_gives_the_same_rows(order, bounded, mode):
    """After each barrier the ranks' work up to the next one runs rank by rank in the given order, so
    a rank that runs first writes the peers' buffers for its NEXT step (counts, ids and rows of the
    next dispatch, weights, partial sums) before the others finish the current one; with two
    dispatches in flight."""
    _check_two_in_flight(order=_orders()[order], bound=6 if bounded else None)


def test_the_schedules_catch_a_peer_writing_before_a_rank_is_ready(monkeypatch):
    """The harness catches the race this path once had: a buffer zeroed by its rank after the
    collective allocation, while a peer that returned from the allocation first already wrote into it."""
    ensure = symm.SymmetricState.ensure

    def zeroing_ensure(self, name, parity, nbytes):
        before = self.allocations
        buf = ensure(self, name, parity, nbytes)
        if self.allocations != before:
            buf.local.zero_()
        return buf

    monkeypatch.setattr(symm.SymmetricState, "ensure", zeroing_ensure)
    with pytest.raises(AssertionError):
        _check_two_in_flight()


@pytest.mark.parametrize("name", ["tok", "meta"])
def test_the_schedules_catch_single_buffering(monkeypatch, name):
    """With a token bound a rank's expand of one dispatch and its send of the next share a segment:
    one buffer of either would be overwritten by a peer before this rank reads it."""
    ensure = symm.SymmetricState.ensure
    monkeypatch.setattr(symm.SymmetricState, "ensure", lambda self, n, parity, nbytes: ensure(self, n, 0 if n == name else parity, nbytes))
    with pytest.raises(AssertionError):
        _check_two_in_flight(bound=6)


def test_new_expert_parallels_on_one_group_alternating_dtypes_and_widths_share_the_buffers():
    """As the multi-rank conformance runs: a new ExpertParallel per case over the same process group,
    float32 then bf16 (then fp8, fp16), different row widths and expert counts, some cases dispatch
    only. Every case must equal the one-rank layout; every allocation must pair across the ranks
    (FakeWorld checks the sizes), and the group's buffers are reused, not re-allocated per case."""
    size = 2
    world, states = make_states(size)
    gen = torch.Generator().manual_seed(5)
    cases = [  # experts, tokens per rank, top_k, dim, dtype, combine too
        (16, [17, 16], 8, 96, torch.float32, False),
        (16, [17, 16], 8, 96, torch.bfloat16, False),
        (16, [1, 0], 8, 96, torch.float32, True),
        (16, [1, 0], 8, 96, torch.bfloat16, True),
        (64, [10, 10], 6, 64, torch.float8_e4m3fn, False),
        (8, [6, 6], 1, 33, torch.float16, True),
        (64, [10, 10], 6, 64, torch.float32, True),
    ]
    for n, (experts, tokens, top_k, dim, dtype, with_combine) in enumerate(cases):
        _, exchanges = make_group(size, experts, states=states)
        xs = [torch.randn(t, dim, generator=gen).to(dtype) for t in tokens]
        ids = [torch.rand(t, experts, generator=gen).topk(top_k, dim=-1).indices.to(torch.int32) for t in tokens]
        order = _orders()["alternating" if n % 2 else "reversed"]
        outs = lockstep([ex.dispatch_steps(x, i) for ex, x, i in zip(exchanges, xs, ids)], order)
        check_dispatch(outs, xs, ids, experts, n)
        assert all(o[0].shape[1] == dim for o in outs)
        if with_combine:
            weights = [torch.rand(t, top_k, generator=gen) for t in tokens]
            eos = [o[0].float().mul(1.5).to(torch.bfloat16) for o in outs]
            got = lockstep([ex.combine_steps(eo, w, o[2]) for ex, eo, w, o in zip(exchanges, eos, weights, outs)], order)
            check_combine(got, eos, weights, ids, xs, experts, n)
    names = world.names()
    assert names.count("counts0") == 1, names
    assert len(names) <= 7, names  # counts, meta and tok of both parities, wts, back: once each, nothing per case
    assert states[0].dispatches == len(cases) and world.requests[0] == world.requests[1]


def test_each_forward_starts_its_dispatches_on_parity_zero():
    """A forward captured in a CUDA graph keeps the parities it was captured with; start_forward
    makes every forward (eager or captured, on any rank) start on parity 0, and the rows stay
    right when forwards of an odd number of dispatches follow each other."""
    world, exchanges = make_group(2, 4, bound=3)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(3, 8, generator=gen) for _ in range(2)]
    ids = [torch.randint(0, 4, (3, 2), generator=gen, dtype=torch.int32) for _ in range(2)]
    st = exchanges[0].state
    for forward in range(3):
        for ex in exchanges:
            ex.start_forward()
        assert all(ex.state.dispatches % 2 == 0 for ex in exchanges)
        outs = lockstep([ex.dispatch_steps(x, i) for ex, x, i in zip(exchanges, xs, ids)])  # one dispatch per forward
        check_dispatch(outs, xs, ids, 4, forward)
        weights = [torch.rand(3, 2, generator=gen) for _ in range(2)]
        eos = [o[0].to(torch.bfloat16) for o in outs]
        got = lockstep([ex.combine_steps(eo, w, o[2]) for ex, eo, w, o in zip(exchanges, eos, weights, outs)])
        check_combine(got, eos, weights, ids, xs, 4, forward)
    assert st.dispatches == 5  # 0 -> 1, aligned to 2 -> 3, aligned to 4 -> 5
    assert symm.capturable_with_token_bound(2, 256, 8) and not symm.capturable_with_token_bound(8, 256, 8)
    assert all(r.capturable_with_token_bound is symm.capturable_with_token_bound for r in symm.REGISTRATIONS)  # declared, not an attribute
