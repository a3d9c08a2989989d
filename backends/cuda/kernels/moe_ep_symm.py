"""Expert-parallel `dispatch` / `combine` within one host over torch symmetric memory (NVLink peer
stores), moving each token row ONCE per destination rank, as DeepEP's intranode kernels do.

Why: the NCCL path (`moe_ep`) sends every (token, k) copy through all_to_all_single, so a token
whose K experts sit on one peer crosses the link K times; on 2 H200s with top-8 of 256 experts that
is ~4 copies of each row per peer. Here a token row crosses to a peer once, with its expert ids;
the owner makes the expert-sorted copies in its own memory. Combine is the mirror image: the owner
sums the weighted outputs of its experts for each token and sends ONE partial row back; the source
adds the partials of the ranks its experts live on.

Results: dispatch's rows and offsets equal the NCCL path's (the same layout: by local expert, then
source rank, then the source's slot order); combine is the same weighted sum in another order of
additions (per owner rank in k order, then over the ranks in rank order, then `add`, in float32, rounded once),
so it matches within the op's tolerance, deterministically. Checked by the multi-rank
conformance cases (`python -m deepinfer_conformance.multirank --backend cuda --ep 2 --ep-path symm`).

The token bound. Every rank writes its token t into region (its rank, t) of each peer's buffers,
so all ranks must agree on the region size B >= every rank's T: `ep.token_bound` when the caller
sets it (the same value on every rank; the benchmark does), otherwise each dispatch first publishes
its T to every rank, passes a barrier and reads the W counts on the host (one host synchronisation).

Per process group and device (`SymmetricState`, created collectively on the first dispatch, shared by
every ExpertParallel over that group), all symmetric; dispatch's in two parities (dispatch number
mod 2), combine's in one (see `combine_steps`); grown on demand by powers of two, never freed (see
`SymmetricState`):
- `meta[p]` int32: each source's T [W], each source token's K expert ids [W*B*K], and in throughput
  mode each slot's rank among its source's slots of its expert [W*B*K] and each source's counts
  per expert [W, E];
- `tok[p]`  bytes [W*B, row]: source s's token t at row s*B + t (rows of peers only);
- `wts`  [W*B, K] the sources' top-k weights (combine), in their dtype;
- `back` float32 [W*B, row]: owner r's partial sum for this rank's token t at row r*B + t;
- `counts`  int32 [2, W]: the T's, when no token bound is set.

dispatch (rank `me` of W, L = E / W experts per rank, parity p); two modes by the slot count W*B*K
  0. without a token bound: publish T, barrier, host read of the W counts: B = max T.
  1. send: one kernel, a program per (token, column split): its K ids to every rank's meta[p]; its
     row to every OTHER rank that owns one of its experts (tok[p], row me*B + t); one extra program
     publishes T. Throughput mode first counts this rank's slots per expert (the one-rank dispatch's
     count + scan kernels) and also sends each slot's rank to its owner, the per-expert counts to
     every rank, and writes row_of_slot (the send layout).
  2. barrier.
  3. expand: one kernel, a program per (source s, token t, column split), reading meta[p]: each of
     the token's slots on a local expert gets its row in the expert-sorted layout, and the token's
     row (from x for s = me, else from tok[p]) is stored there, one scalar-guarded copy per local
     slot; `slot_row` (private, [W*B, K]) keeps that row (or -1) for the combine; L + 1 more
     programs write expert_offsets.
     - latency (W*B*K <= LATENCY_SLOTS): rows found by counting the matching slots of all sources
       (W*B*K ids from L2, per program); the own tokens' programs write row_of_slot. expert_x is
       allocated at its capacity W*B*min(K, L) rows (rows past expert_offsets[L] are padding, as
       the dispatch contract allows): with a token bound no host synchronisation at all, so a
       dispatch can be captured in a CUDA graph;
     - throughput: row = start of the expert + its rows from lower sources (both from the published
       counts) + the slot's rank; one host read of the published counts sizes expert_x exactly.
combine
  1. this rank's top-k weights to every rank's wts; barrier;
  2. one kernel, a program per (source s, token t, column split) with rows here: the weighted sum
     over its local slots in k order, in float32 (float64 for float64), stored unrounded to back of
     rank s; barrier;
  3. one kernel, a program per (token, column split): the partials of the ranks that own one of the
     token's experts, added in rank order, then the token's `add` row (this rank's tokens' addend, a
     shared expert's output) when given; rounded once.

Races: a peer writes meta/tok[p] again only in dispatch n+2, after a barrier of dispatch n+1 that
this rank passes only after its expand of dispatch n (barriers are kernels on the stream, release /
acquire at system scope). Across combines one buffer is enough (two barriers per combine). Nothing a combine reads lives in a
dispatch's buffers, so any number of dispatches may await their combines. expert_x is an ordinary
allocation of the caller's.

Chosen by the backend option `ep_path` (deepinfer_cuda.options; default from DEEPINFER_EP_PATH):
under `auto` its `when` takes it only on CUDA devices with ep_size > 1, all ranks on this host
(LOCAL_WORLD_SIZE = WORLD_SIZE = ep_size, peer access between the devices) and torch's symmetric
memory present; `symm` always takes it, and where it cannot run resolve fails with the reason
(`unusable`); `nccl` never. Both registrations declare `capturable_with_token_bound`.
Never uses NVLink multicast (multimem): only unicast peer pointers and the handle's barrier.

No programmatic dependent launch (PDL, deepinfer_cuda.kernels.common), unlike the backend's other
kernels: these kernels order themselves against peer ranks through symmetric-memory stores and the
handle's barriers (system-scope release / acquire between kernels on the stream), not only through
the stream. A PDL launch lets a kernel be resident before its predecessor has finished, which is
safe only where its first act is griddepcontrol.wait on that predecessor; here the ordering that
matters is across devices, so they keep plain stream-ordered launches. The local kernels they call
(deepinfer_cuda.kernels.moe's count and scan) take PDL as everywhere: a kernel launched without it
is waited for in full.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generator

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from deepinfer.distributed.expert_parallel import EP_PRIORITY, ExpertParallel, as_expert_parallel
from deepinfer.errors import UserError
from deepinfer.ops.moe import check_combine_add
from deepinfer.triton_common import next_power_of_2
from deepinfer_cuda.kernels import moe as local
from deepinfer_cuda.kernels.common import Registration
from deepinfer_cuda.options import EP_PATH

SYMM_PRIORITY = EP_PRIORITY + 10  # above the NCCL path when its `when` holds
_MIN_BYTES = 1 << 20
# Latency mode up to this many slots (W*B*K): each expand program reads them all (32 KiB of ids, from
# L2), and expert_x is allocated at capacity; past it, the count + scan kernels and one host read.
LATENCY_SLOTS = 8192  # (the engine's EP CUDA graphs need W * max_num_seqs * K within it)
_SCAN = 1024  # ids per step of a latency-mode program's count


# ---------------------------------------------------------------------------------------------
# kernels: dispatch


@triton.jit
def _publish_count_kernel(counts_ptrs, offset, T):
    # program w: this rank's T into rank w's counts at element `offset`
    w = tl.program_id(0)
    base = tl.load(counts_ptrs + w).to(tl.pointer_type(tl.int32))
    tl.store(base + offset, T)


@triton.jit
def _send_kernel(
    x_ptr, ids_ptr, tok_ptrs, meta_ptrs,
    rank_ptr, prefix_ptr, totals_ptr, row_of_slot_ptr,
    T, D, E, L, W, me, B, n_tiles, stride_x, cols_per_split, ranks_off, tots_off,
    K: tl.constexpr,
    TILE_S: tl.constexpr,
    COUNTED: tl.constexpr,  # throughput mode: the one-rank count + scan of this rank's slots ran
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    split = tl.program_id(1)
    if t == T:  # the extra program: this rank's token count (and per-expert counts), to every rank
        if split == 0:
            ex = tl.arange(0, BLOCK_E)
            for r in range(W):
                meta = tl.load(meta_ptrs + r).to(tl.pointer_type(tl.int32))
                tl.store(meta + me, T)
                if COUNTED:
                    tl.store(meta + tots_off + me * E + ex, tl.load(totals_ptr + ex, mask=ex < E), mask=ex < E)
    else:
        kk = tl.arange(0, BLOCK_K)
        k_ok = kk < K
        slot = t * K + kk
        eid = tl.load(ids_ptr + slot, mask=k_ok, other=0)
        owner = tl.where(k_ok, eid // L, -1)
        row = (me * B + t).to(tl.int64)
        if split == 0:
            if COUNTED:  # each slot's rank among this rank's slots of its expert; row_of_slot
                rk = tl.load(rank_ptr + slot, mask=k_ok, other=0)
                rk += tl.load(prefix_ptr + eid.to(tl.int64) * n_tiles + slot // TILE_S, mask=k_ok, other=0)
                ex = tl.arange(0, BLOCK_E)
                tot = tl.load(totals_ptr + ex, mask=ex < E, other=0)
                first = tl.sum(tl.where(ex[None, :] == eid[:, None], (tl.cumsum(tot, axis=0) - tot)[None, :], 0), axis=1)
                tl.store(row_of_slot_ptr + slot, first + rk, mask=k_ok)
            for r in range(W):  # the ids go to every rank (small): a receiver needs no per-source count
                meta = tl.load(meta_ptrs + r).to(tl.pointer_type(tl.int32))
                tl.store(meta + W + row * K + kk, eid, mask=k_ok)
                if COUNTED:
                    tl.store(meta + ranks_off + row * K + kk, rk, mask=k_ok & (owner == r))
        src = x_ptr + t.to(tl.int64) * stride_x
        col0 = split * cols_per_split
        col_end = tl.minimum(col0 + cols_per_split, D)
        for r in range(W):
            if (r != me) & (tl.max((owner == r).to(tl.int32), axis=0) > 0):
                dst = tl.load(tok_ptrs + r).to(tl.pointer_type(x_ptr.dtype.element_ty)) + row * D
                for c in range(col0, col_end, BLOCK_D):
                    cols = c + tl.arange(0, BLOCK_D)
                    c_ok = cols < col_end
                    tl.store(dst + cols, tl.load(src + cols, mask=c_ok), mask=c_ok)


@triton.jit
def _expand_kernel(
    x_ptr, tok_ptr, meta_ptr, out_ptr, slot_row_ptr, offsets_ptr, row_of_slot_ptr,
    D, E, L, W, me, B, stride_x, cols_per_split, ranks_off, tots_off,
    K: tl.constexpr,
    LATENCY: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_SCAN: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)  # s * B + t; W * B + l: expert_offsets[l]
    split = tl.program_id(1)
    lx = tl.arange(0, BLOCK_L)
    if not LATENCY:  # rows per (source, local expert), from the sources' published counts
        ws = tl.arange(0, BLOCK_W)
        C = tl.load(meta_ptr + tots_off + ws[:, None] * E + me * L + lx[None, :], mask=(ws < W)[:, None] & (lx < L)[None, :], other=0)
        col_tot = tl.sum(C, axis=0)
        start = tl.cumsum(col_tot, axis=0) - col_tot  # local expert l's first row
    if pid >= W * B:
        if split == 0:
            le = pid - W * B
            if LATENCY:  # valid slots of every source on a lower local expert
                n = tl.zeros([BLOCK_SCAN], dtype=tl.int32)
                for s2 in range(W):
                    n2 = tl.load(meta_ptr + s2) * K
                    for j0 in range(0, n2, BLOCK_SCAN):
                        j = j0 + tl.arange(0, BLOCK_SCAN)
                        l2 = tl.load(meta_ptr + W + s2 * B * K + j, mask=j < n2, other=-1) - me * L
                        n += ((l2 >= 0) & (l2 < le)).to(tl.int32)
                tl.store(offsets_ptr + le, tl.sum(n, axis=0))
            else:
                tl.store(offsets_ptr + le, tl.sum(tl.where(lx < le, col_tot, 0), axis=0))
    else:
        s = pid // B
        t = pid % B
        kk = tl.arange(0, BLOCK_K)
        k_ok = kk < K
        valid = kk < tl.where(t < tl.load(meta_ptr + s), K, 0)  # (a vector & a scalar bool is not a mask in the interpreter)
        pos = pid * K + kk  # slot order: source, token, k
        eid = tl.load(meta_ptr + W + pos, mask=valid, other=-1)
        le = eid - me * L
        mine = valid & (le >= 0) & (le < L)
        if LATENCY:  # row = slots of lower local experts + earlier slots of the same one, all sources
            below = tl.zeros([BLOCK_K], dtype=tl.int32)
            for s2 in range(W):
                n2 = tl.load(meta_ptr + s2) * K
                for j0 in range(0, n2, BLOCK_SCAN):
                    j = j0 + tl.arange(0, BLOCK_SCAN)
                    l2 = tl.load(meta_ptr + W + s2 * B * K + j, mask=j < n2, other=-1) - me * L
                    ours = ((l2 >= 0) & (l2 < L))[None, :]
                    before = (s2 * B * K + j)[None, :] < pos[:, None]
                    below += tl.sum((ours & ((l2[None, :] < le[:, None]) | ((l2[None, :] == le[:, None]) & before))).to(tl.int32), axis=1)
            dest = below
            if (s == me) & (split == 0):  # row_of_slot: the row in this rank's send layout (global ids)
                n_me = tl.load(meta_ptr + me) * K
                sent = tl.zeros([BLOCK_K], dtype=tl.int32)
                for j0 in range(0, n_me, BLOCK_SCAN):
                    j = j0 + tl.arange(0, BLOCK_SCAN)
                    e2 = tl.load(meta_ptr + W + me * B * K + j, mask=j < n_me, other=E)
                    earlier = (me * B * K + j)[None, :] < pos[:, None]
                    sent += tl.sum(((e2[None, :] < eid[:, None]) | ((e2[None, :] == eid[:, None]) & earlier)).to(tl.int32), axis=1)
                tl.store(row_of_slot_ptr + t * K + kk, sent, mask=valid)
        else:  # start of its expert + rows of the expert from lower sources + its rank in its source
            lower = tl.sum(tl.where((ws < s)[:, None], C, 0), axis=0)
            hit = lx[None, :] == le[:, None]
            dest = tl.sum(tl.where(hit, (start + lower)[None, :], 0), axis=1) + tl.load(meta_ptr + ranks_off + pos, mask=mine, other=0)
        if split == 0:
            tl.store(slot_row_ptr + pos, tl.where(mine, dest, -1), mask=k_ok)
        if s == me:
            src = x_ptr + t.to(tl.int64) * stride_x
        else:
            src = tok_ptr + pid.to(tl.int64) * D
        col0 = split * cols_per_split
        col_end = tl.minimum(col0 + cols_per_split, D)
        if tl.max(mine.to(tl.int32), axis=0) > 0:
            for c in range(col0, col_end, BLOCK_D):
                cols = c + tl.arange(0, BLOCK_D)
                c_ok = cols < col_end
                v = tl.load(src + cols, mask=c_ok)  # read once, stored to each local slot's row
                for k in tl.static_range(K):  # a scalar branch per slot: no work for another rank's slots
                    if tl.sum(tl.where((kk == k) & mine, 1, 0), axis=0) > 0:
                        d = tl.sum(tl.where(kk == k, dest, 0), axis=0).to(tl.int64)
                        tl.store(out_ptr + d * D + cols, v, mask=c_ok)



# ---------------------------------------------------------------------------------------------
# kernels: combine


@triton.jit
def _send_weights_kernel(w_ptr, wts_ptrs, W, me, B, K: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < K
    w = tl.load(w_ptr + t * K + kk, mask=k_ok)
    row = (me * B + t).to(tl.int64)
    for r in range(W):
        tl.store(tl.load(wts_ptrs + r).to(tl.pointer_type(w_ptr.dtype.element_ty)) + row * K + kk, w, mask=k_ok)


@triton.jit
def _reduce_back_kernel(
    src_ptr, wts_ptr, slot_row_ptr, back_ptrs, wire_ptr,
    n_rows, D, me, B, stride_src, cols_per_split,
    K: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)  # s * B + t
    split = tl.program_id(1)
    s = pid // B
    kk = tl.arange(0, BLOCK_K)
    rows = tl.load(slot_row_ptr + pid * K + kk, mask=kk < K, other=-1)
    if tl.max(rows, axis=0) >= 0:
        dst = tl.load(back_ptrs + s).to(tl.pointer_type(wire_ptr.dtype.element_ty)) + (me * B + pid % B).to(tl.int64) * D
        col0 = split * cols_per_split
        col_end = tl.minimum(col0 + cols_per_split, D)
        for c in range(col0, col_end, BLOCK_D):
            cols = c + tl.arange(0, BLOCK_D)
            c_ok = cols < col_end
            acc = tl.zeros([BLOCK_D], dtype=ACC)
            for k in tl.static_range(K):  # k order: the partial does not depend on the batch
                r = tl.load(slot_row_ptr + pid * K + k)
                if (r >= 0) & (r < n_rows):
                    w = tl.load(wts_ptr + pid * K + k).to(ACC)
                    acc += w * tl.load(src_ptr + r.to(tl.int64) * stride_src + cols, mask=c_ok, other=0.0).to(ACC)
            tl.store(dst + cols, acc.to(wire_ptr.dtype.element_ty), mask=c_ok)


@triton.jit
def _sum_back_kernel(
    back_ptr, ids_ptr, add_ptr, out_ptr,
    D, L, W, B, stride_add, stride_out, cols_per_split,
    K: tl.constexpr,
    ACC: tl.constexpr,
    HAS_ADD: tl.constexpr,  # add_ptr: [T, D] added after the partials (else unused)
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    split = tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    owner = tl.load(ids_ptr + t * K + kk, mask=kk < K, other=-L) // L
    col0 = split * cols_per_split
    col_end = tl.minimum(col0 + cols_per_split, D)
    for c in range(col0, col_end, BLOCK_D):
        cols = c + tl.arange(0, BLOCK_D)
        c_ok = cols < col_end
        acc = tl.zeros([BLOCK_D], dtype=ACC)
        for r in range(W):  # rank order: the sum does not depend on the batch
            if tl.max((owner == r).to(tl.int32), axis=0) > 0:
                acc += tl.load(back_ptr + (r * B + t).to(tl.int64) * D + cols, mask=c_ok, other=0.0).to(ACC)
        if HAS_ADD:
            acc += tl.load(add_ptr + t.to(tl.int64) * stride_add + cols, mask=c_ok, other=0.0).to(ACC)
        tl.store(out_ptr + t.to(tl.int64) * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=c_ok)


# ---------------------------------------------------------------------------------------------
# symmetric buffers: the real ones (torch symmetric memory) and the interface tests fake


@dataclass
class SymmetricBuffer:
    """One symmetric allocation: this rank's bytes and every rank's base address (int64 [W], on
    the device, for kernels)."""

    local: torch.Tensor  # uint8 [nbytes]
    ptrs: torch.Tensor  # int64 [W]
    handle: object = None

    @property
    def nbytes(self) -> int:
        return self.local.numel()


class SymmetricMemoryUnavailable(UserError):
    """torch symmetric memory cannot serve this run (the reason says why)."""


def _symm_module():
    """torch.distributed._symmetric_memory, checked for what this path uses (the API moved
    between torch versions: 2.5 introduced it, later versions made the group registration implicit)."""
    try:
        import torch.distributed._symmetric_memory as symm
        from torch._C._distributed_c10d import _SymmetricMemory
    except Exception as exc:  # a torch built without distributed / symmetric memory
        raise SymmetricMemoryUnavailable(f"torch {torch.__version__} has no symmetric memory ({type(exc).__name__}: {exc})") from None
    missing = [name for name in ("empty", "rendezvous") if not hasattr(symm, name)]
    missing += [f"_SymmetricMemory.{name}" for name in ("buffer_ptrs", "barrier") if not hasattr(_SymmetricMemory, name)]
    if missing:
        raise SymmetricMemoryUnavailable(f"torch {torch.__version__}'s symmetric memory lacks {', '.join(missing)}")
    return symm


def _rendezvous(symm, tensor: torch.Tensor, group):
    """symm.rendezvous(tensor, group), registering the group first on torch versions that need it."""
    import warnings

    try:
        return symm.rendezvous(tensor, group)
    except Exception as first:
        enable = getattr(symm, "enable_symm_mem_for_group", None)
        if enable is None:
            raise SymmetricMemoryUnavailable(f"symmetric memory rendezvous failed: {type(first).__name__}: {first}") from first
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated (and unneeded) in newer torch
            enable(group.group_name)
        try:
            return symm.rendezvous(tensor, group)
        except Exception as exc:
            raise SymmetricMemoryUnavailable(f"symmetric memory rendezvous failed: {type(exc).__name__}: {exc}") from exc


class TorchSymmetricMemory:
    """Symmetric allocations over an EP group's process group (collective calls: every rank makes
    the same ones in the same order) and the device barrier of the first one (the counts)."""

    def __init__(self, group, device: torch.device, timeout_s: float | None):
        self.symm = _symm_module()
        self.group = group
        self.device = device
        self.timeout_ms = int((timeout_s or 300.0) * 1000)
        self._barrier_handle = None

    def alloc(self, name: str, nbytes: int) -> SymmetricBuffer:
        tensor = self.symm.empty(nbytes, dtype=torch.uint8, device=self.device)
        handle = _rendezvous(self.symm, tensor, self.group)
        ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=self.device)
        if self._barrier_handle is None:
            self._barrier_handle = handle
        return SymmetricBuffer(tensor, ptrs, handle)

    def barrier(self) -> None:
        # A kernel on the current stream: every rank signals every other and waits for their
        # signals (release/acquire at system scope), so writes made before it on any rank's
        # stream are visible after it on every rank's stream. Traps after timeout_ms.
        self._barrier_handle.barrier(0, self.timeout_ms)  # (channel, timeout_ms)


def _grown(need: int) -> int:
    return max(_MIN_BYTES, next_power_of_2(need))


def _word_dtype(row_bytes: int, *tensors: torch.Tensor) -> torch.dtype:
    """The widest integer word that divides a row and every tensor's address, for moving raw bits
    whatever the dtype (fp8 included)."""
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if row_bytes % size == 0 and all(t.data_ptr() % size == 0 for t in tensors):
            return dtype
    return torch.int8


def _as_words(t: torch.Tensor, rows: int, row_bytes: int, word: torch.dtype) -> torch.Tensor:
    """A contiguous tensor (or raw bytes) as [rows, row_bytes / word size] words."""
    size = torch.empty(0, dtype=word).element_size()
    return t.reshape(-1).view(torch.uint8)[: rows * row_bytes].view(word).view(rows, row_bytes // size)


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a combine partial travels in: the accumulator (float32; float64 for float64). A bf16
    partial lost too much where the owners' partials cancel (4 bf16 ulps on 2 H200s, over the op's
    tolerance): one rounding, at the end, as the one-rank combine."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class _SymmExchange:
    """What a dispatch leaves for its combine (kept in the ExpertParallel, keyed by row_of_slot)."""

    row_of_slot: torch.Tensor
    state: "SymmetricState"
    bound: int  # B: the token regions' size
    tokens: int  # T of this rank
    top_k: int
    ids: torch.Tensor  # [T, K] int32: this rank's routing (which ranks hold its partials)
    slot_row: torch.Tensor  # [W*B, K] int32: each source slot's row in expert_x here, or -1
    rows: int  # expert_x's rows (its capacity in latency mode)


class SymmetricState:
    """The symmetric buffers of one process group on one device, shared by every ExpertParallel
    over that group (`state_of`), and the dispatch / combine counters their parities follow.

    Nothing allocated here is ever freed (growth keeps the old buffer in `kept`). torch's
    `symm_mem.empty` takes memory from a caching pool, and a block keeps the rendezvous it had:
    a freed block handed out again comes back with its OLD peers' addresses, and its `rendezvous`
    returns at once instead of meeting the other ranks. Ranks free at different times (garbage
    collection), so one rank would pair a reused block with stale peers while another starts a
    real rendezvous that meets the wrong allocation (seen on 2 H200s: "Expected
    reqs[r].buffer_size == reqs[0].buffer_size", and counts read from the wrong peer buffers).
    Capacities grow by powers of two, so what is kept is at most about twice what is in use.

    Every allocation is collective: all ranks make the same ones, in the same order, with the same
    sizes in bytes, decided from what every rank knows alike (W, K, the row size and the token
    bound B, which every rank has the same of).
    """

    def __init__(self, buffers, device: torch.device, size: int):
        self.buffers = buffers
        self.device = device
        self.size = size
        self.kept: list[object] = []  # every allocation, for the life of the process
        self.current: dict[tuple[str, int], SymmetricBuffer] = {}  # (name, parity) -> its buffer now
        self.host_counts: torch.Tensor | None = None  # pinned (CUDA) int32 [W]: the T read's target
        self.dispatches = 0
        self.combines = 0
        self.allocations = 0

    def ensure(self, name: str, parity: int, nbytes: int) -> SymmetricBuffer:
        """The (name, parity) buffer, at least nbytes (a collective allocation when it grows)."""
        buf = self.current.get((name, parity))
        if buf is None or buf.nbytes < nbytes:
            # Not zeroed: a peer may write into it as soon as its own allocation returns (before a
            # zero_ here would run); every reader reads only what this step's writers wrote.
            buf = self.current[(name, parity)] = self.buffers.alloc(f"{name}{parity}", _grown(nbytes))
            self.kept.append(buf)
            self.allocations += 1
        return buf

    def barrier(self) -> None:
        self.buffers.barrier()

    def start_forward(self) -> None:
        # Every forward's first dispatch uses parity 0, on every rank, whatever ran before (a
        # graph replay does not advance the count): skipping one parity is safe between forwards,
        # as a combine (two barriers) separates any two dispatches of a model.
        self.dispatches += self.dispatches % 2


class SymmetricExchange:
    """The symmetric-memory exchange of one ExpertParallel (see the module docstring) over the
    buffers of its process group (`SymmetricState`, shared with the group's other ExpertParallels).

    `dispatch_steps` / `combine_steps` are generators that yield where every rank must pass a
    barrier; `dispatch` / `combine` run them with the real barrier. `ep.phase_marker` (None, or a
    callable taking a phase name) is called at the end of each phase (the bench's opt-in breakdown).
    """

    def __init__(self, ep: ExpertParallel, state: SymmetricState):
        self.ep = ep
        self.state = state
        self.device = state.device

    def _mark(self, name: str) -> None:
        marker = getattr(self.ep, "phase_marker", None)
        if marker is not None:
            marker(name)

    def start_forward(self) -> None:
        self.state.start_forward()

    # -- dispatch --------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return run_steps(self.dispatch_steps(x, topk_ids), self.state.barrier)

    def _token_bound(self, T: int, parity: int) -> Generator[None, None, int]:
        """B: ep.token_bound, else the max T over the ranks (publish, barrier, one host read)."""
        ep, st, W = self.ep, self.state, self.ep.size
        bound = getattr(ep, "token_bound", None)
        if bound is not None:
            if T > bound:
                raise ValueError(
                    f"dispatch of {T} tokens over an expert-parallel group whose token_bound is {bound} (raise token_bound, the same on every rank)"
                )
            return max(int(bound), 1)
        counts = st.ensure("counts", 0, 2 * W * 4)
        _publish_count_kernel[(W,)](counts.ptrs, parity * W + ep.rank, T)
        yield  # barrier: every rank's T is in every counts buffer
        if st.host_counts is None or st.host_counts.numel() < W:
            st.host_counts = torch.empty(W, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        host = st.host_counts[:W]
        host.copy_(counts.local.view(torch.int32)[parity * W:(parity + 1) * W], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        bound = max(int(host.max()), 1)
        self._mark("token bound")
        return bound

    def dispatch_steps(self, x: torch.Tensor, topk_ids: torch.Tensor) -> Generator[None, None, tuple]:
        ep, st = self.ep, self.state
        W, E, L, me = ep.size, ep.num_experts, ep.experts_per_rank, ep.rank
        T, K = topk_ids.shape
        D = x.shape[-1]
        parity = st.dispatches % 2
        st.dispatches += 1
        B = yield from self._token_bound(T, parity)
        x2 = x.reshape(T, D)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        ids = topk_ids.to(torch.int32).contiguous()
        row_bytes = D * x.element_size()
        latency = W * B * K <= LATENCY_SLOTS
        ranks_off = W + W * B * K  # meta: T's [W] | ids [W*B*K] | (throughput) slot ranks | per-expert counts
        tots_off = ranks_off + (0 if latency else W * B * K)
        meta = st.ensure("meta", parity, (tots_off + (0 if latency else W * E)) * 4)
        tok = st.ensure("tok", parity, W * B * row_bytes)
        word = _word_dtype(row_bytes, x2)
        cfg = local._cfg("dispatch", "tokens", self.device)
        xw = _as_words(x2, T, row_bytes, word)
        Dw = xw.shape[1]
        block_d = local._block_d(max(Dw, 1), xw.element_size(), cfg)
        row_of_slot = torch.empty(T * K, dtype=torch.int32, device=self.device)
        dummy = row_of_slot  # for the pointer arguments a mode does not read
        if latency:
            counted = None
        elif T:
            counted = local.count_slots(ids, E)
        else:  # no slots: only the (zero) per-expert counts to publish
            counted = local.SlotCounts(ids.view(-1), dummy, dummy, torch.zeros(E, dtype=torch.int32, device=self.device), 1, 1)
        per, splits = local._column_split(T, Dw, block_d, cfg["target_programs"]) if Dw else (0, 1)
        _send_kernel[(T + 1, splits)](
            xw, ids, tok.ptrs, meta.ptrs,
            *((counted.rank, counted.prefix, counted.totals) if counted else (dummy, dummy, dummy)), row_of_slot,
            T, Dw, E, L, W, me, B, counted.n_tiles if counted else 1, xw.stride(0) if T else Dw, per, ranks_off, tots_off,
            K=K, TILE_S=counted.tile_s if counted else 1, COUNTED=not latency,
            BLOCK_E=next_power_of_2(E), BLOCK_K=next_power_of_2(K), BLOCK_D=block_d, num_warps=cfg["copy_warps"],
        )  # fmt: skip
        self._mark("send")
        yield  # barrier: every token row and every id is at its destination
        self._mark("barrier")
        metas = meta.local.view(torch.int32)
        slot_row = torch.empty(W * B, K, dtype=torch.int32, device=self.device)
        offsets = torch.empty(L + 1, dtype=torch.int32, device=self.device)
        if latency:
            rows = W * B * min(K, L)
        else:  # the host synchronisation of throughput mode: rows arriving here, from the published counts
            counts = metas[tots_off:tots_off + W * E].view(W, W, L)[:, me]
            rows = int(counts.sum())
            self._mark("host read")
        expert_x = torch.empty(rows, D, dtype=x.dtype, device=self.device)
        out = _as_words(expert_x, rows, row_bytes, word)
        tok_words = _as_words(tok.local, W * B, row_bytes, word)
        per, splits = local._column_split(W * B, Dw, block_d, cfg["target_programs"]) if Dw else (0, 1)
        _expand_kernel[(W * B + L + 1, splits)](
            xw, tok_words, metas, out, slot_row, offsets, row_of_slot,
            Dw, E, L, W, me, B, xw.stride(0) if T else Dw, per, ranks_off, tots_off,
            K=K, LATENCY=latency, BLOCK_K=next_power_of_2(K), BLOCK_L=next_power_of_2(L), BLOCK_W=next_power_of_2(W),
            BLOCK_SCAN=_SCAN, BLOCK_D=block_d, num_warps=cfg["copy_warps"],
        )  # fmt: skip
        self._mark("expand")
        ep._remember(_SymmExchange(row_of_slot, st, B, T, K, ids, slot_row, rows))
        return expert_x, offsets, row_of_slot

    # -- combine ---------------------------------------------------------------------------

    def combine(self, expert_out: torch.Tensor, topk_weights: torch.Tensor, row_of_slot: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        return run_steps(self.combine_steps(expert_out, topk_weights, row_of_slot, add), self.state.barrier)

    def combine_steps(
        self, expert_out: torch.Tensor, topk_weights: torch.Tensor, row_of_slot: torch.Tensor, add: torch.Tensor | None = None
    ) -> Generator[None, None, torch.Tensor]:
        ep, st = self.ep, self.state
        record = ep._take(row_of_slot)
        if not isinstance(record, _SymmExchange) or record.state is not st:
            raise ValueError("expert-parallel combine: the matching dispatch did not run over symmetric memory (resolve dispatch and combine together)")
        W, L, me, B, T, K = ep.size, ep.experts_per_rank, ep.rank, record.bound, record.tokens, record.top_k
        if tuple(topk_weights.shape) != (T, K):
            raise ValueError(f"combine got topk_weights {tuple(topk_weights.shape)}; the matching dispatch had {T} tokens x top-{K}")
        R = expert_out.shape[0]
        if R > record.rows:
            raise ValueError(f"combine got {R} expert rows; the matching dispatch delivered at most {record.rows} to this rank")
        D = expert_out.shape[-1]
        st.combines += 1
        wire = _wire_dtype(expert_out.dtype)
        acc = tl.float64 if expert_out.dtype == torch.float64 else tl.float32
        weights = topk_weights.contiguous()
        # One buffer each, no parities: a combine's weights are read in the segment after the one that
        # writes them, its partials likewise, and the next write of either comes a segment later.
        wts = st.ensure("wts", 0, W * B * K * weights.element_size())
        back = st.ensure("back", 0, W * B * D * torch.empty(0, dtype=wire).element_size())
        if T:
            _send_weights_kernel[(T,)](weights, wts.ptrs, W, me, B, K=K, BLOCK_K=next_power_of_2(K))
        self._mark("weights")
        yield  # barrier: every source's weights are here
        self._mark("barrier 1")
        back_rows = back.local.view(wire)[: W * B * D].view(W * B, D)
        cfg = local._cfg("combine", "tokens", self.device)
        block_d = local._block_d(max(D, 1), max(expert_out.element_size(), 2), cfg)
        if D:
            src = expert_out.reshape(R, D)
            if src.stride(-1) != 1:
                src = src.contiguous()
            per, splits = local._column_split(W * B, D, block_d, cfg["target_programs"])
            _reduce_back_kernel[(W * B, splits)](
                src, wts.local.view(weights.dtype), record.slot_row, back.ptrs, back_rows,
                R, D, me, B, src.stride(0) if R else D, per,
                K=K, ACC=acc, BLOCK_K=next_power_of_2(K), BLOCK_D=block_d, num_warps=cfg["num_warps"],
            )  # fmt: skip
        self._mark("reduce + send back")
        yield  # barrier: every partial is at its source
        self._mark("barrier 2")
        out = torch.empty(T, D, dtype=expert_out.dtype, device=self.device)
        if T and D:
            if add is not None and add.stride(-1) != 1:
                add = add.contiguous()
            per, splits = local._column_split(T, D, block_d, cfg["target_programs"])
            _sum_back_kernel[(T, splits)](
                back_rows, record.ids, out if add is None else add, out, D, L, W, B, 0 if add is None else add.stride(0), out.stride(0), per,
                K=K, ACC=acc, HAS_ADD=add is not None, BLOCK_K=next_power_of_2(K), BLOCK_D=block_d, num_warps=cfg["num_warps"],
            )  # fmt: skip
        self._mark("sum")
        return out


def run_steps(steps: Generator, barrier: Callable[[], None]):
    """Run a step generator on one rank: barrier() at each yield; return its value."""
    try:
        while True:
            next(steps)
            barrier()
    except StopIteration as stop:
        return stop.value


# ---------------------------------------------------------------------------------------------
# the ops and their registration


_STATES: dict[tuple[int, str], tuple[object, SymmetricState]] = {}  # (id(group), device) -> (group, state)


def state_of(group, device: torch.device, timeout_s: float | None) -> SymmetricState:
    """The symmetric buffers of a process group on a device, created (collectively) on first use
    and kept for the life of the process (the group is held, so its id stays unique)."""
    key = (id(group), str(device))
    entry = _STATES.get(key)
    if entry is None:
        size = dist.get_world_size(group)
        entry = _STATES[key] = (group, SymmetricState(TorchSymmetricMemory(group, device, timeout_s), device, size))
    return entry[1]


def exchange_of(ep: ExpertParallel, device: torch.device) -> SymmetricExchange:
    """The ExpertParallel's symmetric exchange, over its process group's shared buffers."""
    exchange = ep.transports.get("symm")
    if exchange is None:
        exchange = ep.transports["symm"] = SymmetricExchange(ep, state_of(ep.group, device, ep.timeout_s))
    return exchange


def dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    num_experts: int,
    ep_group: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EP dispatch over symmetric memory (see the module docstring). In latency mode expert_x has
    more rows than expert_offsets[-1]: the rest is padding."""
    ep = as_expert_parallel(ep_group, num_experts)
    if ep is None:
        return local.dispatch(x, topk_ids, num_experts=num_experts)
    if topk_ids.dim() != 2 or x.shape[0] != topk_ids.shape[0]:
        raise ValueError(f"dispatch: x {tuple(x.shape)} and topk_ids {tuple(topk_ids.shape)} do not match")
    return exchange_of(ep, x.device).dispatch(x, topk_ids)


def capturable_with_token_bound(ranks: int, bound: int, top_k: int) -> bool:
    """With ep_group.token_bound = bound (the same on every rank) and W*B*K <= LATENCY_SLOTS, dispatch
    and combine make no host synchronisation: the engine may capture EP decode steps in CUDA graphs
    (declared on both registrations below)."""
    return ranks * max(bound, 1) * top_k <= LATENCY_SLOTS


def combine(
    expert_out: torch.Tensor,
    topk_weights: torch.Tensor,
    row_of_slot: torch.Tensor,
    *,
    add: torch.Tensor | None = None,
    ep_group: object | None = None,
) -> torch.Tensor:
    ep = as_expert_parallel(ep_group)
    if ep is None:
        return local.combine(expert_out, topk_weights, row_of_slot, add=add)
    check_combine_add(add, expert_out, topk_weights)
    return exchange_of(ep, expert_out.device).combine(expert_out, topk_weights, row_of_slot, add)


def unusable_reason(ctx) -> str | None:
    """Why the symmetric-memory path cannot serve this context (None: it can)."""
    if ctx.ep_size <= 1:
        return "ep_size is 1"
    if torch.device(ctx.device).type != "cuda":
        return f"device {ctx.device} is not a CUDA device"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "Triton runs in the interpreter (TRITON_INTERPRET=1)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    world = os.environ.get("WORLD_SIZE")
    one_host = local_world is not None and world is not None and local_world.isdigit() and world.isdigit()
    if not one_host or int(local_world) != int(world) or int(world) != ctx.ep_size:
        return f"the EP group is not one host's ranks (WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local_world}, ep_size={ctx.ep_size})"
    n = int(local_world)
    if torch.cuda.device_count() < n:
        return f"{n} ranks but {torch.cuda.device_count()} visible CUDA devices"
    for a in range(n):
        for b in range(n):
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return f"CUDA device {a} cannot access device {b}'s memory (no peer access)"
    try:
        _symm_module()
    except SymmetricMemoryUnavailable as exc:
        return str(exc)
    return None


def chosen(ctx) -> bool:
    """The registrations' `when` (never raises): ep_size > 1 and the backend option ep_path is symm,
    or auto where this path can run (else the NCCL path serves)."""
    path = EP_PATH.value(ctx)
    if ctx.ep_size <= 1 or path == "nccl":
        return False
    return path == "symm" or unusable_reason(ctx) is None


def unusable(ctx) -> str | None:
    """Why the path, once chosen (ep_path=symm forces it), cannot run here: resolve's one-line error."""
    reason = unusable_reason(ctx)
    if reason is None:
        return None
    return f"backend option ep_path=symm, but the symmetric-memory EP path cannot run: {reason} (ep_path=auto or nccl uses all_to_all_single)"


def _forced_in_deterministic_mode(ctx) -> bool:
    return ctx.deterministic and ctx.ep_size > 1 and EP_PATH.value(ctx) == "symm"


def _not_invariant(ctx) -> str:
    return ("backend option ep_path=symm has no batch-invariant kernel (its per-owner partial sums follow where a token's "
            "redundant experts land, which follows its batch position); deterministic mode takes ep_path=auto or nccl")  # fmt: skip


REGISTRATIONS = [
    Registration(op="dispatch", fn=dispatch, when=chosen, unusable=unusable, priority=SYMM_PRIORITY,
                 capturable_with_token_bound=capturable_with_token_bound,
                 note="Triton count + one scatter kernel into the owners' symmetric-memory receive buffers (one host)"),
    Registration(op="combine", fn=combine, when=chosen, unusable=unusable, priority=SYMM_PRIORITY,
                 capturable_with_token_bound=capturable_with_token_bound,
                 note="Triton scatter back into the sources' symmetric-memory buffers + Triton fixed-order combine"),
]  # fmt: skip
# ep_path=symm forced in deterministic mode: a one-line refusal, not a silent switch to the NCCL path.
# (Listed as a candidate of deterministic mode only to say why it cannot serve.)
REGISTRATIONS += [
    Registration(op=op, fn=fn, when=_forced_in_deterministic_mode, unusable=_not_invariant, priority=SYMM_PRIORITY, batch_invariant=True,
                 capturable_with_token_bound=capturable_with_token_bound, note="(deterministic mode with ep_path=symm: refused, see docs/architecture.md)")
    for op, fn in (("dispatch", dispatch), ("combine", combine))
]  # fmt: skip
