"""Expert-parallel dispatch/combine over 2 and 4 gloo ranks on the CPU, against the one-rank reference.

Each multi-rank test starts its ranks as subprocesses of this very file
(`python test_ep_dispatch.py --rank-main SUITE --out DIR`) with torchrun's environment on
127.0.0.1 and a free port, so `init_distributed` forms the group as under torchrun. One launch runs
a whole suite of scenarios (process start-up dominates); each rank writes what it checked and every
failure to DIR/rank<r>.json, and the test asserts on those. Every rank generates the same full
batch (all ranks' tokens) from a seed, so it can compute the one-rank reference itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

THIS = Path(__file__).resolve()
COLLECTIVE_TIMEOUT_S = 5.0  # the short timeout of the failure tests (the rendezvous', or the collectives' once every rank has joined)


# ---------------------------------------------------------------------------------------------
# launching ranks


def launch(suite: str, world_size: int, out: Path, *, start: list[int] | None = None, env: dict | None = None,
           timeout_s: float | None = None, join_timeout_s: float | None = None, until: list[int] | None = None) -> list[tuple[int, str]]:
    """Start ranks `start` (default: all) of a `world_size` group running `suite`; return (exit code,
    stderr) per started rank once they have exited, or once the ranks `until` (indices into the
    started ones) have (the others are killed: exit code -9). timeout_s: the collectives' timeout,
    join_timeout_s: the rendezvous' (both default to the hang guard, so a slow start fails nothing)."""
    from deepinfer.distributed import free_port, rank_env

    from waits import HANG_S, wait_until  # (here, not at the top: the ranks run this file without tests/ on their path)

    port = free_port()
    timeouts = ["--timeout", str(timeout_s or HANG_S), "--join-timeout", str(join_timeout_s or HANG_S)]
    procs = []
    for rank in start if start is not None else range(world_size):
        environ = {**os.environ, **(env or {}), **rank_env(rank, world_size, port)}
        procs.append(subprocess.Popen([sys.executable, str(THIS), "--rank-main", suite, "--out", str(out), *timeouts],
                                      env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    awaited = [procs[i] for i in until] if until is not None else procs
    try:
        wait_until(lambda: all(p.poll() is not None for p in awaited), f"the {suite} ranks exiting")
    finally:
        for p in procs:  # only the processes this test started, by their handles
            if p.poll() is None:
                p.kill()
    return [(p.wait(), p.stderr.read()) for p in procs]


def rank_reports(out: Path, world_size: int, results) -> list[dict]:
    reports = []
    for rank in range(world_size):
        path = out / f"rank{rank}.json"
        assert path.is_file(), f"rank {rank} wrote no report: exit {results[rank][0]}\n{results[rank][1][-3000:]}"
        reports.append(json.loads(path.read_text()))
    return reports


# ---------------------------------------------------------------------------------------------
# the tests


@pytest.mark.parametrize("world_size", [2, 4])
def test_reference_dispatch_combine_match_the_one_rank_reference(tmp_path, world_size):
    results = launch("reference", world_size, tmp_path)
    reports = rank_reports(tmp_path, world_size, results)
    for rank, report in enumerate(reports):
        assert report["failures"] == [], f"rank {rank}:\n" + "\n".join(report["failures"])
        assert report["checked"] >= 20
    assert all(code == 0 for code, _ in results), [err[-2000:] for _, err in results]


@pytest.mark.parametrize("impl", ["cuda", "ascend"])
def test_triton_ep_kernels_match_the_one_rank_reference_in_the_interpreter(tmp_path, impl):
    results = launch(impl, 2, tmp_path, env={"TRITON_INTERPRET": "1"})
    for rank, report in enumerate(rank_reports(tmp_path, 2, results)):
        assert report["failures"] == [], f"rank {rank}:\n" + "\n".join(report["failures"])
        assert report["checked"] >= 4


def test_multirank_conformance_reference_ep2():
    from waits import HANG_S  # (here, not at the top: the ranks run this file without tests/ on their path)

    argv = ["--backend", "reference", "--ep", "2", "--timeout", str(HANG_S)]
    proc = subprocess.run([sys.executable, "-m", "deepinfer_conformance.multirank", *argv], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "18 pass"
    assert sum(" reference ep2 " in line and " pass " in line for line in lines) == 18


def test_multirank_conformance_cuda_interpret_ep2():
    from deepinfer.discovery import registration_modules

    assert "deepinfer_cuda.kernels.moe_ep" in {m.__name__ for m in registration_modules("deepinfer_cuda.kernels")}
    from deepinfer_conformance.multirank import run

    from waits import HANG_S  # (here, not at the top: the ranks run this file without tests/ on their path)

    names = ["t1_k8_e16_d96", "t12_k1_e8_one_expert", "t20_k6_e64_empty_experts", "t5_k4_e8_d48_shared_add"]  # the last: combine's add
    rows = run("cuda", 2, interpret=True, names=names, timeout_s=HANG_S)
    assert len(rows) == 14 and all(r.status == "pass" for r in rows), [(r.case, r.status, r.detail) for r in rows]


def test_multirank_reassembly_of_a_wrong_row_of_slot_fails():
    """The reassembly maps send-layout rows to global rows; a wrong one must not pass."""
    from deepinfer.ops.moe import dispatch
    from deepinfer_conformance.multirank import reassemble_dispatch, token_slices

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 8, (9, 2), generator=gen, dtype=torch.int32)
    x = torch.randn(9, 4, generator=gen)
    want = dispatch(x, ids, num_experts=8)
    parts = {"expert_x": [], "expert_offsets": [], "row_of_slot": []}
    for r, (a, b) in enumerate(token_slices(9, 2)):
        lo, hi = int(want[1][4 * r]), int(want[1][4 * r + 4])
        parts["expert_x"].append(want[0][lo:hi])
        parts["expert_offsets"].append(want[1][4 * r:4 * r + 5] - lo)
        parts["row_of_slot"].append(dispatch(x[a:b], ids[a:b], num_experts=8)[2])
    got = reassemble_dispatch(parts, ids, 8, 2)
    assert torch.equal(got["row_of_slot"], want[2]) and torch.equal(got["expert_offsets"], want[1]) and torch.equal(got["expert_x"], want[0])
    parts["row_of_slot"][1] = parts["row_of_slot"][1].flip(0)
    assert not torch.equal(reassemble_dispatch(parts, ids, 8, 2)["row_of_slot"], want[2])


def test_a_rank_that_never_joins_fails_the_others_within_the_timeout(tmp_path):
    """Rank 0 alone: its rendezvous times out (it exits by itself, saying so)."""
    results = launch("join-only", 2, tmp_path, start=[0], join_timeout_s=COLLECTIVE_TIMEOUT_S)
    code, err = results[0]
    assert code == 2, err
    assert "rank 0 of 2: the process group did not form" in err and "within 5 s" in err, err


def test_a_rank_that_never_reaches_dispatch_fails_the_others_within_the_timeout(tmp_path):
    """Both ranks join (however long they take to start); rank 1 then never calls dispatch, and rank
    0's dispatch times out (it exits by itself, saying so)."""
    results = launch("stall-rank1", 2, tmp_path, timeout_s=COLLECTIVE_TIMEOUT_S, until=[0])
    code, err = results[0]
    assert code == 3, err
    assert "PeerFailure: expert-parallel dispatch (expert counts) failed on rank 0 of 2 (timeout 5 s)" in err, err
    assert "every rank must call dispatch and combine" in err


def test_a_rank_that_dies_fails_the_others(tmp_path):
    results = launch("die-rank1", 2, tmp_path, timeout_s=COLLECTIVE_TIMEOUT_S, until=[0])
    code, err = results[0]
    assert code == 3, err
    # A consequence of rank 1's death, so the launcher reports rank 1 (cli/launch.py's PeerFailure).
    assert "PeerFailure: expert-parallel dispatch (expert counts) failed on rank 0 of 2" in err, err


# ---------------------------------------------------------------------------------------------
# one process: registry selection, one-rank groups, argument checks


def test_ep_kernels_win_only_when_ep_size_is_above_one():
    from deepinfer.registry import Registry, ResolveContext
    from deepinfer_ascend.kernels import moe as ascend_moe
    from deepinfer_ascend.kernels import moe_ep as ascend_moe_ep
    from deepinfer_cuda.kernels import moe as cuda_moe
    from deepinfer_cuda.kernels import moe_ep as cuda_moe_ep

    for backend, local, ep in (("cuda", cuda_moe, cuda_moe_ep), ("ascend", ascend_moe, ascend_moe_ep)):
        registry = Registry()
        registry.register_all(backend, local.REGISTRATIONS)
        registry.register_all(backend, ep.REGISTRATIONS)
        for op in ("dispatch", "combine"):
            assert registry.pick(ResolveContext(backend, dtype=torch.bfloat16), op).fn is getattr(local, op)
            assert registry.pick(ResolveContext(backend, dtype=torch.bfloat16, ep_size=2), op).fn is getattr(ep, op)


def test_reference_backend_resolves_its_references_at_any_ep_size():
    from deepinfer.ops import moe
    from deepinfer.runtime import open_runtime

    ops = open_runtime("reference", ep_size=4, dtype=torch.float32).ops
    assert ops.dispatch is moe.dispatch and ops.combine is moe.combine


def test_one_rank_expert_parallel_is_the_local_path_bit_for_bit():
    from deepinfer.distributed import ExpertParallel
    from deepinfer.ops.moe import combine, dispatch

    gen = torch.Generator().manual_seed(0)
    x, ids = torch.randn(7, 16, generator=gen), torch.randint(0, 8, (7, 3), generator=gen, dtype=torch.int32)
    ep = ExpertParallel(None, 8)
    assert (ep.rank, ep.size, ep.experts_per_rank, ep.local_experts()) == (0, 1, 8, range(0, 8))
    local, one = dispatch(x, ids, num_experts=8), dispatch(x, ids, num_experts=8, ep_group=ep)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(local, one))
    w = torch.rand(7, 3, generator=gen)
    assert torch.equal(combine(local[0], w, local[2]), combine(one[0], w, one[2], ep_group=ep))
    assert ep.pending == 0


def test_combine_of_zero_tokens():
    from deepinfer.ops.moe import combine, dispatch

    expert_x, _, row_of_slot = dispatch(torch.empty(0, 8), torch.empty(0, 4, dtype=torch.int32), num_experts=8)
    out = combine(expert_x, torch.empty(0, 4), row_of_slot)
    assert out.shape == (0, 8)


def test_expert_parallel_arguments_are_checked():
    from deepinfer.distributed import ExpertParallel
    from deepinfer.distributed.expert_parallel import as_expert_parallel

    with pytest.raises(ValueError, match="sharded"):
        ExpertParallel(None, 0)
    with pytest.raises(ValueError, match="num_experts=6"):
        as_expert_parallel(ExpertParallel(None, 8), 6)


@pytest.mark.parametrize(
    "cause, peer",
    [
        ("[pair.cc:537] Read error [127.0.0.1]:29500: Connection reset by peer", True),  # gloo: the peer died
        ("[unbound_buffer.cc:129] Timed out waiting 5000ms for recv operation to complete", True),  # gloo: it went silent
        ("Split sizes doesn't match total dim 0 size", False),  # this rank's own arguments
    ],
)
def test_a_failed_exchange_says_whether_a_peer_caused_it(monkeypatch, cause, peer):
    """A dispatch that fails because another rank died or stopped answering is a PeerFailure (the
    launcher then reports that rank, not this one); an error of this rank's own is not."""
    from deepinfer.distributed import DistributedError, ExpertParallel
    from deepinfer.distributed import expert_parallel as module
    from deepinfer.distributed.group import PeerFailure

    def all_to_all_single(*args, **kwargs):
        raise RuntimeError(cause)

    monkeypatch.setattr(module.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(module.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(module.dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(module.dist, "all_to_all_single", all_to_all_single)
    ep = ExpertParallel(object(), 4, timeout_s=5.0)
    send_x, offsets, row_of_slot = torch.zeros(2, 8), torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32), torch.arange(2)
    with pytest.raises(DistributedError) as caught:
        ep.exchange_dispatch(send_x, offsets, row_of_slot)
    assert isinstance(caught.value, PeerFailure) is peer
    assert "expert-parallel dispatch (expert counts) failed on rank 0 of 2 (timeout 5 s)" in str(caught.value)
    assert ("A rank died" in str(caught.value)) is peer


def test_init_distributed_reads_torchruns_environment(monkeypatch):
    from deepinfer.distributed import DistributedError, init_distributed

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert init_distributed() is None  # not under torchrun: one process
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_distributed() is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DistributedError, match="RANK is not set"):
        init_distributed()
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(DistributedError, match="MASTER_ADDR is not set"):
        init_distributed()
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(DistributedError, match="outside WORLD_SIZE=2"):
        init_distributed()


# ---------------------------------------------------------------------------------------------
# rank side: scenarios and their checks


@dataclass(frozen=True)
class Scenario:
    name: str
    tokens: Callable[[int], list[int]]  # tokens per rank, by world size
    top_k: int
    experts_per_rank: int
    dim: int
    route: str  # random | repeat | avoid | one_rank | one_expert


SCENARIOS = [
    Scenario("random", lambda w: [5, 3, 8, 1][:w], 3, 4, 16, "random"),
    Scenario("repeated_ids_in_a_token", lambda w: [6, 4, 2, 5][:w], 4, 2, 8, "repeat"),
    Scenario("experts_without_tokens", lambda w: [7, 5, 4, 6][:w], 2, 4, 8, "avoid"),  # expert 1 and the last rank's experts
    Scenario("all_tokens_to_one_ranks_experts", lambda w: [4, 6, 3, 2][:w], 3, 4, 8, "one_rank"),
    Scenario("a_rank_without_tokens", lambda w: [0, 5, 0, 3][:w], 2, 3, 8, "random"),
    Scenario("no_rank_has_tokens", lambda w: [0] * w, 4, 2, 8, "random"),
    Scenario("top1", lambda w: [9, 4, 6, 1][:w], 1, 2, 8, "random"),
    Scenario("top1_one_expert", lambda w: [3, 2, 5, 4][:w], 1, 2, 8, "one_expert"),
    Scenario("one_expert_per_rank", lambda w: [6, 2, 3, 5][:w], 2, 1, 8, "random"),
    Scenario("wider", lambda w: [40, 33, 17, 24][:w], 8, 8, 64, "random"),
]


def routing(gen: torch.Generator, tokens: int, top_k: int, experts: int, world_size: int, how: str) -> torch.Tensor:
    per_rank = experts // world_size
    if how == "random":  # distinct experts per token
        return torch.rand(tokens, experts, generator=gen).argsort(-1)[:, :top_k].to(torch.int32)
    if how == "repeat":  # experts drawn with replacement: a token may pick one expert twice
        return torch.randint(0, experts, (tokens, top_k), generator=gen, dtype=torch.int32)
    if how == "avoid":
        pool = torch.tensor([e for e in range(experts - per_rank) if e != 1])
        return pool[torch.randint(0, len(pool), (tokens, top_k), generator=gen)].to(torch.int32)
    if how == "one_rank":  # rank 1's experts only
        return (per_rank + torch.randint(0, per_rank, (tokens, top_k), generator=gen)).to(torch.int32)
    if how == "one_expert":
        return torch.full((tokens, top_k), experts - 1, dtype=torch.int32)
    raise ValueError(how)


def expert_scale(rows: torch.Tensor, offsets: torch.Tensor, first_expert: int) -> torch.Tensor:
    """A stand-in for the experts' computation that depends on which expert holds each row."""
    experts = torch.arange(offsets.numel() - 1) + first_expert
    of_row = torch.repeat_interleave(experts, (offsets[1:] - offsets[:-1]).long(), output_size=rows.shape[0])
    return (rows.float() * (1.0 + 0.25 * of_row[:, None])).to(rows.dtype)


def check_scenario(ep, impl, ref, sc: Scenario, dtype: torch.dtype, fail: Callable[[str], None]) -> None:
    """impl: the EP dispatch/combine under test; ref: the same backend's one-rank kernels."""
    W, r, L = ep.size, ep.rank, ep.experts_per_rank
    E, K = ep.num_experts, sc.top_k
    gen = torch.Generator().manual_seed(zlib.crc32(f"{sc.name}/{W}".encode()))
    counts = sc.tokens(W)
    xs = [torch.randn(t, sc.dim, generator=gen).to(dtype) for t in counts]
    if dtype == torch.float32:  # tag each row with its global token index: checks the order directly
        base = 0
        for x in xs:
            x[:, 0] = torch.arange(base, base + x.shape[0])
            base += x.shape[0]
    ids = [routing(gen, t, K, E, W, sc.route) for t in counts]
    weights = [torch.rand(t, K, generator=gen) for t in counts]
    a = sum(counts[:r])
    full_x, full_ids, full_w = torch.cat(xs), torch.cat(ids), torch.cat(weights)
    ref_x, ref_off, ref_rows = ref.dispatch(full_x, full_ids, num_experts=E)
    lo, hi = int(ref_off[r * L]), int(ref_off[(r + 1) * L])
    tag = f"{sc.name} {str(dtype).removeprefix('torch.')} rank {r}/{W}"

    expert_x, offsets, row_of_slot = impl.dispatch(xs[r], ids[r], num_experts=E, ep_group=ep)
    if not (expert_x.dtype == dtype and torch.equal(expert_x, ref_x[lo:hi])):
        fail(f"{tag}: expert_x {tuple(expert_x.shape)} differs from the one-rank rows {lo}:{hi} of its experts")
    want_off = (ref_off[r * L:(r + 1) * L + 1] - lo).to(torch.int32)
    if not (offsets.dtype == torch.int32 and torch.equal(offsets, want_off)):
        fail(f"{tag}: expert_offsets {offsets.tolist()} != {want_off.tolist()}")
    send_rows = ref.dispatch(xs[r], ids[r], num_experts=E)[2]
    if not (row_of_slot.dtype == torch.int32 and torch.equal(row_of_slot, send_rows)):
        fail(f"{tag}: row_of_slot is not the send layout")
    if dtype == torch.float32 and expert_x.shape[0]:
        for l in range(L):
            seg = expert_x[int(offsets[l]):int(offsets[l + 1]), 0]
            if not bool((seg[1:] >= seg[:-1]).all()):
                fail(f"{tag}: local expert {l}'s rows are not in (source rank, slot) order: tokens {seg.tolist()}")

    out = impl.combine(expert_scale(expert_x, offsets, r * L), weights[r], row_of_slot, ep_group=ep)
    want = ref.combine(expert_scale(ref_x, ref_off, 0), full_w, ref_rows)[a:a + counts[r]]
    if not (out.dtype == dtype and torch.equal(out, want)):
        err = (out.double() - want.double()).abs().max().item() if out.shape == want.shape and out.numel() else "shape"
        fail(f"{tag}: combine differs from the one-rank combine (max |err| {err})")
    if ep.pending:
        fail(f"{tag}: {ep.pending} exchange(s) left pending after combine")


def check_two_in_flight(ep, impl, fail) -> None:
    """Two dispatches before their combines, combined in the reverse order: the state is per row_of_slot."""
    gen = torch.Generator().manual_seed(11 + ep.rank)
    E = ep.num_experts
    batches = [(torch.randn(t, 8, generator=gen), torch.randint(0, E, (t, 2), generator=gen, dtype=torch.int32), torch.rand(t, 2, generator=gen))
               for t in (4 + ep.rank, 3)]
    solo = []
    for x, ids, w in batches:
        ex, off, rows = impl.dispatch(x, ids, num_experts=E, ep_group=ep)
        solo.append(impl.combine(expert_scale(ex, off, 0), w, rows, ep_group=ep))
    first = [impl.dispatch(x, ids, num_experts=E, ep_group=ep) for x, ids, _ in batches]
    outs = [None, None]
    for i in (1, 0):
        ex, off, rows = first[i]
        outs[i] = impl.combine(expert_scale(ex, off, 0), batches[i][2], rows, ep_group=ep)
    if not all(torch.equal(a, b) for a, b in zip(outs, solo)):
        fail(f"rank {ep.rank}: two dispatches in flight, combined in reverse order, differ from one at a time")
    try:  # a copy of row_of_slot is not the key: refused on every rank, before any collective
        ex, _, rows = impl.dispatch(batches[0][0], batches[0][1], num_experts=E, ep_group=ep)
        impl.combine(ex, batches[0][2], rows.clone(), ep_group=ep)
        fail(f"rank {ep.rank}: combine accepted a row_of_slot no dispatch returned")
    except ValueError as exc:
        if "row_of_slot is not the tensor" not in str(exc):
            fail(f"rank {ep.rank}: unexpected error {exc}")
        impl.combine(ex, batches[0][2], rows, ep_group=ep)  # the pending exchange completes with the real key


def check_bytes_on_the_wire(ep, fail) -> None:
    """float64 and fp8 rows travel as raw bytes (not every collective library has those dtypes): exact."""
    from deepinfer.ops import moe

    W, r = ep.size, ep.rank
    gen = torch.Generator().manual_seed(5)
    counts = [3 + s for s in range(W)]
    xs = [torch.randn(t, 8, generator=gen, dtype=torch.float64) * 50 for t in counts]
    ids = [torch.randint(0, ep.num_experts, (t, 2), generator=gen, dtype=torch.int32) for t in counts]
    full_ids = torch.cat(ids)
    ref_off = moe.dispatch(torch.cat(xs), full_ids, num_experts=ep.num_experts)[1]
    L = ep.experts_per_rank
    lo, hi = int(ref_off[r * L]), int(ref_off[(r + 1) * L])
    for dtype in (torch.float64, torch.float8_e4m3fn):
        full_x = torch.cat(xs).to(dtype)
        ref_x = moe.dispatch(full_x, full_ids, num_experts=ep.num_experts)[0]
        x_r = full_x[sum(counts[:r]):sum(counts[:r + 1])]
        got, _, rows = moe.dispatch(x_r, ids[r], num_experts=ep.num_experts, ep_group=ep)
        if not (got.dtype == dtype and torch.equal(got.view(torch.uint8), ref_x[lo:hi].view(torch.uint8))):
            fail(f"rank {r}: {dtype} rows changed on the wire")
        back = moe.combine(got, torch.ones(counts[r], 2), rows, ep_group=ep)
        want = moe.combine(ref_x, torch.ones(full_ids.shape[0], 2), moe.dispatch(full_x, full_ids, num_experts=ep.num_experts)[2])
        if not torch.equal(back.view(torch.uint8), want[sum(counts[:r]):sum(counts[:r + 1])].view(torch.uint8)):
            fail(f"rank {r}: {dtype} combine differs from the one-rank combine")


def check_group_arguments(ep, fail) -> None:
    import torch.distributed as dist

    from deepinfer.distributed import ExpertParallel
    from deepinfer.ops import moe

    try:
        ExpertParallel(ep.group, ep.size * 2 + 1)
        fail("an expert count that does not divide by the ranks was accepted")
    except ValueError:
        pass
    try:  # a bare process group of several ranks cannot carry the exchange state
        moe.dispatch(torch.randn(2, 4), torch.zeros(2, 1, dtype=torch.int32), num_experts=ep.num_experts, ep_group=dist.group.WORLD)
        fail("a bare process group was accepted as ep_group")
    except ValueError as exc:
        if "ExpertParallel" not in str(exc):
            fail(f"unexpected error for a bare process group: {exc}")


def short_timeout_group(timeout_s: float):
    """A group of every rank whose collectives time out after `timeout_s`, formed once all have joined
    (the rendezvous waited as long as starting took), so only what comes after is timed."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.new_group(timeout=timedelta(seconds=timeout_s))


def rank_main(suite: str, out: Path, timeout_s: float, join_timeout_s: float) -> int:
    from deepinfer.distributed import DistributedError, ExpertParallel, destroy_distributed, init_distributed

    rank = int(os.environ["RANK"])
    if suite == "die-rank1" and rank == 1:
        init_distributed(join_timeout_s, device="cpu")
        short_timeout_group(timeout_s)
        os._exit(1)
    try:
        ctx = init_distributed(join_timeout_s, device="cpu")
        if suite in ("join-only", "stall-rank1", "die-rank1"):
            group = short_timeout_group(timeout_s)
            if suite == "stall-rank1" and rank == 1:
                time.sleep(24 * 3600)  # joined, but never reaches the MoE layer, however long rank 0 takes (the test kills it once rank 0 has exited)
                return 0
            from deepinfer.ops import moe

            ep = ExpertParallel(group, 4, timeout_s=timeout_s)
            moe.dispatch(torch.randn(3, 8), torch.zeros(3, 1, dtype=torch.int32), num_experts=4, ep_group=ep)
            print("dispatch returned", file=sys.stderr)
            return 0
    except DistributedError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(3 if suite != "join-only" else 2)

    if suite == "reference":
        from deepinfer.ops import moe as impl

        ref = impl
    elif suite == "cuda":
        from deepinfer_cuda.kernels import moe_ep as impl

        ref = impl.local  # the Triton kernels' own one-rank results (the interpreter rounds bf16 its own way)
    elif suite == "ascend":
        from deepinfer_ascend.kernels import moe_ep as impl

        ref = impl.local
    else:
        raise SystemExit(f"unknown suite {suite}")
    scenarios = SCENARIOS if suite == "reference" else [s for s in SCENARIOS if s.name in ("random", "a_rank_without_tokens", "top1_one_expert")]
    failures: list[str] = []
    checked = 0
    for sc in scenarios:
        for dtype in (torch.float32, torch.bfloat16):
            ep = ExpertParallel(ctx.group, sc.experts_per_rank * ctx.world_size, timeout_s=timeout_s)
            try:
                check_scenario(ep, impl, ref, sc, dtype, failures.append)
            except DistributedError:
                raise
            except Exception as exc:  # deterministic on every rank for these inputs: the group stays in step
                failures.append(f"{sc.name} {dtype}: {type(exc).__name__}: {exc}")
            checked += 1
    if suite == "reference":
        ep = ExpertParallel(ctx.group, 2 * ctx.world_size, timeout_s=timeout_s)
        check_two_in_flight(ep, impl, failures.append)
        check_group_arguments(ep, failures.append)
        check_bytes_on_the_wire(ep, failures.append)
        checked += 3
    (out / f"rank{ctx.rank}.json").write_text(json.dumps({"rank": ctx.rank, "checked": checked, "failures": failures}))
    destroy_distributed()
    return 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--rank-main", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--join-timeout", type=float, required=True)
    args = parser.parse_args()
    sys.exit(rank_main(args.rank_main, args.out, args.timeout, args.join_timeout))
