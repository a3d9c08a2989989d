"""Expert-parallel `dispatch` / `combine` within one host: rows stored straight into the peers'
memory (torch symmetric memory over NVLink) instead of NCCL's all_to_all_single.

Why: the NCCL path (`moe_ep`) moves the send layout with all_to_all_single and then re-sorts the
received blocks on the receiver; on 2 H200s it reached 293 of 393 GB/s peer-to-peer at 4096 tokens
and 46 us per dispatch at 128. Here every (token, k) row is stored once, by the sender, at its
FINAL row in the owner's receive buffer; nothing is staged, nothing re-sorted.

The results are bit-identical to the NCCL path (same rows, same order; the exchange is a copy of
raw words), so the multi-rank conformance cases check both
(`python -m deepinfer_conformance.multirank --backend cuda --ep 2 --ep-path symm|nccl`).

Per process group and device (`SymmetricState`, created on the first dispatch, collectively, and
shared by every ExpertParallel over that group; `ep.transports["symm"]` is the ExpertParallel's view):

- `counts`: symmetric int32 [2 parities][W sources, E + 1]: row s holds source s's per-expert
  counts and its token count T_s. The first allocation's device barrier orders every step below.
- `rows[p]`: symmetric receive buffer (bytes) of parity p, and `maps[p]`: symmetric int32
  [2, capacity]: for each received row, its source rank and its row in the source's send layout.
- `back[p]`: symmetric combine buffer (bytes): a source's rows come back here in its send layout.
  Capacities are in bytes and grow on demand (a collective allocation that every rank decides
  identically, as each sees every rank's counts), never shrink, and are never freed (see
  `SymmetricState`: torch's symmetric-memory pool would hand a freed block back with its old
  rendezvous).

dispatch (rank `me` of W, L = E / W experts per rank; parity p = dispatch number mod 2)
  1. count + scan of the slots per expert (the two kernels of `deepinfer_cuda.kernels.moe`);
  2. publish: one kernel stores this rank's E counts and T into row `me` of every rank's counts[p];
  3. barrier; one host read of counts[p] (into a pinned buffer; the one host synchronisation:
     R, and whether a buffer must grow);
  4. scatter: ONE kernel, a program per (token, column split): each of the token's K slots gets
     its send-layout row (row_of_slot, as the local dispatch numbers it) and its final row in the
     owner's layout, start(expert) + rows from lower source ranks + its rank among this source's
     slots of the expert, all from counts[p]; the token row is stored there (peer address from an
     int64 tensor of base pointers, cast to a pointer in the kernel), and (me, send row) into the
     owner's maps[p];
  5. barrier. expert_x is a view of rows[p] (no copy); expert_offsets come from the kernel.
combine (parity q = combine number mod 2)
  1. one kernel, a program per received row: stored straight into its source's back[q] at the row
     maps[p] names (the source's send layout);
  2. barrier; the local fixed-order combine (`deepinfer_cuda.kernels.moe.combine`) over back[q].

Lifetimes: expert_x is a view of the process group's receive buffer: it is valid until the NEXT
dispatch on the same process group, whichever ExpertParallel makes it (the one after that
overwrites its memory; copy it out to keep it longer), and the combine of a dispatch must run
before the second dispatch after it (checked). Double buffering
(two parities) is what makes one barrier per step enough: a peer writes parity p again only after
every rank has passed a barrier that follows its use of parity p's previous contents in stream
order.

Not registered where it cannot run (no CUDA, no torch symmetric memory); where registered, its
`when` takes it only on CUDA devices with ep_size > 1, all ranks on this host (LOCAL_WORLD_SIZE =
WORLD_SIZE = ep_size, peer access between the devices), and DEEPINFER_EP_PATH not "nccl"
(DEEPINFER_EP_PATH=symm makes an unusable symmetric memory an error instead of a fallback).
Never uses NVLink multicast (multimem): only unicast peer pointers and the handle's barrier.
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
from deepinfer_cuda.kernels import moe as local
from deepinfer_cuda.kernels.common import Registration, next_power_of_2

EP_PATH_ENV = "DEEPINFER_EP_PATH"  # auto (default) | nccl | symm
EP_PATHS = ("auto", "nccl", "symm")
SYMM_PRIORITY = EP_PRIORITY + 10  # above the NCCL path when its `when` holds
_MIN_BYTES = 1 << 20


# ---------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _publish_counts_kernel(totals_ptr, peer_ptrs, offset, T, E, BLOCK_E: tl.constexpr):
    # program w: this rank's [E counts, T] into rank w's counts buffer at element `offset`
    w = tl.program_id(0)
    base = tl.load(peer_ptrs + w).to(tl.pointer_type(tl.int32)) + offset
    ex = tl.arange(0, BLOCK_E)
    c = tl.load(totals_ptr + ex, mask=ex < E, other=0)
    tl.store(base + ex, c, mask=ex < E)
    tl.store(base + E, T)


@triton.jit
def _dispatch_scatter_kernel(
    x_ptr, ids_ptr, rank_ptr, prefix_ptr, counts_ptr,
    row_ptrs, src_rank_ptrs, src_row_ptrs,
    row_of_slot_ptr, offsets_ptr,
    D, E, L, W, me, n_tiles, stride_x, cstride, cols_per_split,
    K: tl.constexpr,
    TILE_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    split = tl.program_id(1)
    ex = tl.arange(0, BLOCK_E)
    e_ok = ex < E
    ws = tl.arange(0, BLOCK_W)
    C = tl.load(counts_ptr + ws[:, None] * cstride + ex[None, :], mask=(ws < W)[:, None] & e_ok[None, :], other=0)
    col_tot = tl.sum(C, axis=0)  # rows of expert e from all sources
    mine = tl.sum(tl.where(ws[:, None] == me, C, 0), axis=0)  # this rank's slots per expert
    before = tl.sum(tl.where(ws[:, None] < me, C, 0), axis=0)  # rows of expert e from lower ranks
    excl_all = tl.cumsum(col_tot, axis=0) - col_tot
    my_excl = tl.cumsum(mine, axis=0) - mine  # expert e's first row in this rank's send layout
    if (t == 0) & (split == 0):
        first = me * L
        base = tl.sum(tl.where(ex < first, col_tot, 0), axis=0)
        own = (ex >= first) & (ex < first + L)
        tl.store(offsets_ptr + (ex - first), excl_all - base, mask=own)
        tl.store(offsets_ptr + L, tl.sum(tl.where(own, col_tot, 0), axis=0))
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < K
    slot = t * K + kk
    eid = tl.load(ids_ptr + slot, mask=k_ok, other=0)
    rk = tl.load(rank_ptr + slot, mask=k_ok, other=0)
    rk += tl.load(prefix_ptr + eid.to(tl.int64) * n_tiles + slot // TILE_S, mask=k_ok, other=0)  # among this rank's slots of e
    hit = ex[None, :] == eid[:, None]
    row_local = tl.sum(tl.where(hit, my_excl[None, :], 0), axis=1) + rk
    owner = eid // L
    owner_base = tl.sum(tl.where(ex[None, :] < (owner * L)[:, None], col_tot[None, :], 0), axis=1)
    dest = tl.sum(tl.where(hit, (excl_all + before)[None, :], 0), axis=1) - owner_base + rk
    if split == 0:
        tl.store(row_of_slot_ptr + slot, row_local, mask=k_ok)
        src_rank_base = tl.load(src_rank_ptrs + owner, mask=k_ok, other=0).to(tl.pointer_type(tl.int32))
        tl.store(src_rank_base + dest, tl.zeros([BLOCK_K], dtype=tl.int32) + me, mask=k_ok)
        src_row_base = tl.load(src_row_ptrs + owner, mask=k_ok, other=0).to(tl.pointer_type(tl.int32))
        tl.store(src_row_base + dest, row_local, mask=k_ok)
    dst_base = tl.load(row_ptrs + owner, mask=k_ok, other=0).to(tl.pointer_type(x_ptr.dtype.element_ty))
    dst = dst_base[:, None] + dest.to(tl.int64)[:, None] * D
    src = x_ptr + t.to(tl.int64) * stride_x
    col0 = split * cols_per_split
    col_end = tl.minimum(col0 + cols_per_split, D)
    for c in range(col0, col_end, BLOCK_D):
        cols = c + tl.arange(0, BLOCK_D)
        c_ok = cols < col_end
        v = tl.load(src + cols, mask=c_ok)
        tl.store(dst + cols[None, :], tl.broadcast_to(v[None, :], [BLOCK_K, BLOCK_D]), mask=k_ok[:, None] & c_ok[None, :])


@triton.jit
def _combine_scatter_kernel(
    src_ptr, src_rank_ptr, src_row_ptr, peer_ptrs,
    D, stride_src, cols_per_split,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    split = tl.program_id(1)
    s = tl.load(src_rank_ptr + i)
    row = tl.load(src_row_ptr + i)
    base = tl.load(peer_ptrs + s).to(tl.pointer_type(src_ptr.dtype.element_ty))
    dst = base + row.to(tl.int64) * D
    src = src_ptr + i.to(tl.int64) * stride_src
    col0 = split * cols_per_split
    col_end = tl.minimum(col0 + cols_per_split, D)
    for c in range(col0, col_end, BLOCK_D):
        cols = c + tl.arange(0, BLOCK_D)
        c_ok = cols < col_end
        tl.store(dst + cols, tl.load(src + cols, mask=c_ok), mask=c_ok)


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


def _words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous [N, D] tensor as [N, D'] integer words (the widest that divides a row and the
    address), for moving raw bits whatever the dtype (fp8 included)."""
    raw = t.view(torch.uint8)  # [N, D * element size]
    row_bytes = raw.shape[1]
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if row_bytes % size == 0 and t.data_ptr() % size == 0:
            return raw.view(dtype)
    return raw.view(torch.int8)


@dataclass
class _SymmExchange:
    """What a dispatch leaves for its combine (kept in the ExpertParallel, keyed by row_of_slot)."""

    row_of_slot: torch.Tensor
    number: int  # which dispatch of the group's buffers (0, 1, ...)
    parity: int
    num_received: int  # R
    tokens: int  # T of this rank
    top_k: int
    max_tokens: int  # max T over the ranks
    state: "SymmetricState"
    maps: tuple  # the maps entry (buffer, rank ptrs, row ptrs, capacity) this dispatch wrote


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
    sizes in bytes, decided from what every rank knows alike (E, W, and the counts every rank reads).
    """

    def __init__(self, buffers, device: torch.device, size: int):
        self.buffers = buffers
        self.device = device
        self.size = size
        self.kept: list[object] = []  # every allocation, for the life of the process
        self.counts: SymmetricBuffer | None = None  # int32 [2 parities][half]: [W, E + 1] of each dispatch
        self.counts_half = 0  # int32 elements per parity
        self.host_counts: torch.Tensor | None = None  # pinned (CUDA) int32 [half]: the host read's target
        self.rows: list[SymmetricBuffer | None] = [None, None]
        self.maps: list[tuple[SymmetricBuffer, torch.Tensor, torch.Tensor, int] | None] = [None, None]  # buffer, rank ptrs, row ptrs, capacity
        self.back: list[SymmetricBuffer | None] = [None, None]
        self.dispatches = 0
        self.combines = 0
        self.allocations = 0

    def _alloc(self, name: str, nbytes: int) -> SymmetricBuffer:
        buf = self.buffers.alloc(name, nbytes)
        self.kept.append(buf)
        self.allocations += 1
        return buf

    def ensure_counts(self, cstride: int) -> SymmetricBuffer:
        need = self.size * cstride  # int32 per parity
        if self.counts is None or self.counts_half < need:
            nbytes = _grown(2 * need * 4)
            # Not zeroed: a peer may publish into it as soon as its own allocation returns (before a
            # zero_ here would run), and every dispatch writes all W rows of its region before reading.
            self.counts = self._alloc("counts", nbytes)
            self.counts_half = nbytes // 8
            pin = self.device.type == "cuda"
            self.host_counts = torch.empty(self.counts_half, dtype=torch.int32, pin_memory=pin)
        return self.counts

    def barrier(self) -> None:
        self.buffers.barrier()

    def ensure_rows(self, parity: int, need: int) -> SymmetricBuffer:
        buf = self.rows[parity]
        if buf is None or buf.nbytes < need:
            buf = self.rows[parity] = self._alloc(f"rows{parity}", _grown(need))
        return buf

    def ensure_maps(self, parity: int, rows: int):
        entry = self.maps[parity]
        if entry is None or entry[3] < rows:
            cap = _grown(rows * 8) // 8
            buf = self._alloc(f"maps{parity}", cap * 8)
            entry = self.maps[parity] = (buf, buf.ptrs, buf.ptrs + cap * 4, cap)
        return entry

    def ensure_back(self, parity: int, need: int) -> SymmetricBuffer:
        buf = self.back[parity]
        if buf is None or buf.nbytes < need:
            buf = self.back[parity] = self._alloc(f"back{parity}", _grown(need))
        return buf


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
        self.cstride = ep.num_experts + 1

    def _mark(self, name: str) -> None:
        marker = getattr(self.ep, "phase_marker", None)
        if marker is not None:
            marker(name)

    # -- dispatch --------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return run_steps(self.dispatch_steps(x, topk_ids), self.state.barrier)

    def dispatch_steps(self, x: torch.Tensor, topk_ids: torch.Tensor) -> Generator[None, None, tuple]:
        ep, st = self.ep, self.state
        W, E, L, me = ep.size, ep.num_experts, ep.experts_per_rank, ep.rank
        T, K = topk_ids.shape
        S = T * K
        D = x.shape[-1]
        number = st.dispatches
        parity = number % 2
        st.dispatches += 1
        cfg = local._cfg("dispatch", "tokens", self.device)
        counts_buf = st.ensure_counts(self.cstride)
        layout = local.count_slots(topk_ids, E) if S > 0 else None
        totals = layout.totals if layout is not None else torch.zeros(E, dtype=torch.int32, device=self.device)
        self._mark("count")
        region = parity * st.counts_half  # int32 offset of this dispatch's [W, E + 1] counts
        _publish_counts_kernel[(W,)](totals, counts_buf.ptrs, region + me * self.cstride, T, E, BLOCK_E=next_power_of_2(E))
        self._mark("publish")
        yield  # barrier: every rank's counts are in every counts buffer
        self._mark("barrier 1")
        n = W * self.cstride
        counts = counts_buf.local.view(torch.int32)[region:region + n]
        host = st.host_counts[:n]
        host.copy_(counts, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the one host synchronisation
        host = host.clone().view(W, self.cstride)  # the pinned buffer is reused by the next dispatch
        counts = counts.view(W, self.cstride)
        received = host[:, :E].sum(0).view(W, L).sum(1)  # rows each rank receives
        num_received, max_tokens = int(received[me]), int(host[:, E].max())
        most = int(received.max())
        self._mark("host read")
        x2 = x.reshape(T, D)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        row_bytes = D * x.element_size()
        rows = st.ensure_rows(parity, most * row_bytes)
        maps = st.ensure_maps(parity, most)
        _, rank_ptrs, row_ptrs, _ = maps
        expert_x = rows.local[: num_received * row_bytes].view(x.dtype).view(num_received, D)
        row_of_slot = torch.empty(S, dtype=torch.int32, device=self.device)
        if layout is not None:
            xw = _words(x2)
            Dw = xw.shape[1]
            block_d = local._block_d(max(Dw, 1), xw.element_size(), cfg)
            per, splits = local._column_split(T, Dw, block_d, cfg["target_programs"]) if Dw else (0, 1)
            expert_offsets = torch.empty(L + 1, dtype=torch.int32, device=self.device)
            _dispatch_scatter_kernel[(T, splits)](
                xw, layout.ids, layout.rank, layout.prefix, counts,
                rows.ptrs, rank_ptrs, row_ptrs, row_of_slot, expert_offsets,
                Dw, E, L, W, me, layout.n_tiles, xw.stride(0), self.cstride, per,
                K=K, TILE_S=layout.tile_s, BLOCK_E=next_power_of_2(E), BLOCK_W=next_power_of_2(W),
                BLOCK_K=next_power_of_2(K), BLOCK_D=block_d, num_warps=cfg["copy_warps"],
            )  # fmt: skip
        else:  # no slots on this rank (T = 0): only the receive side's offsets
            per_expert = host[:, :E].sum(0)[me * L:(me + 1) * L]
            expert_offsets = torch.cat([per_expert.new_zeros(1), per_expert.cumsum(0)]).to(torch.int32).to(self.device)
        self._mark("scatter")
        yield  # barrier: every row is in its owner's receive buffer
        self._mark("barrier 2")
        ep._remember(_SymmExchange(row_of_slot, number, parity, num_received, T, K, max_tokens, st, maps))
        return expert_x, expert_offsets, row_of_slot

    # -- combine ---------------------------------------------------------------------------

    def combine(self, expert_out: torch.Tensor, topk_weights: torch.Tensor, row_of_slot: torch.Tensor) -> torch.Tensor:
        return run_steps(self.combine_steps(expert_out, topk_weights, row_of_slot), self.state.barrier)

    def combine_steps(self, expert_out: torch.Tensor, topk_weights: torch.Tensor, row_of_slot: torch.Tensor) -> Generator[None, None, torch.Tensor]:
        st = self.state
        record = self.ep._take(row_of_slot)
        if not isinstance(record, _SymmExchange) or record.state is not st:
            raise ValueError("expert-parallel combine: the matching dispatch did not run over symmetric memory (resolve dispatch and combine together)")
        if st.dispatches - 1 - record.number >= 2:
            raise ValueError(
                f"symmetric-memory combine of dispatch {record.number} after dispatch {st.dispatches - 1}: its receive buffer was "
                "reused (a dispatch's combine must run before the second dispatch after it on the same process group)"
            )
        R = expert_out.shape[0]
        if R != record.num_received:
            raise ValueError(f"combine got {R} expert rows; the matching dispatch delivered {record.num_received} to this rank")
        D = expert_out.shape[-1]
        row_bytes = D * expert_out.element_size()
        parity = st.combines % 2
        st.combines += 1
        back = st.ensure_back(parity, record.max_tokens * record.top_k * row_bytes)
        if R > 0 and row_bytes > 0:
            src = expert_out.reshape(R, D)
            if not src.is_contiguous():
                src = src.contiguous()
            words = _words(src)
            Dw = words.shape[1]
            cfg = local._cfg("combine", "tokens", self.device)
            block_d = local._block_d(Dw, words.element_size(), cfg)
            per, splits = local._column_split(R, Dw, block_d, cfg["target_programs"])
            map_buf, _, _, cap = record.maps
            maps = map_buf.local.view(torch.int32)
            _combine_scatter_kernel[(R, splits)](
                words, maps[:cap], maps[cap:], back.ptrs, Dw, words.stride(0), per, BLOCK_D=block_d, num_warps=cfg["num_warps"],
            )
        self._mark("scatter back")
        yield  # barrier: this rank's rows are back in its combine buffer, in its send layout
        self._mark("barrier")
        S = record.tokens * record.top_k
        rows = back.local[: S * row_bytes].view(expert_out.dtype).view(S, D)
        out = local.combine(rows, topk_weights, row_of_slot)
        self._mark("combine (local)")
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
    """EP dispatch over symmetric memory. expert_x is a view of the group's receive buffer: valid
    until the next dispatch on this ep_group (copy it to keep it longer)."""
    ep = as_expert_parallel(ep_group, num_experts)
    if ep is None:
        return local.dispatch(x, topk_ids, num_experts=num_experts)
    if topk_ids.dim() != 2 or x.shape[0] != topk_ids.shape[0]:
        raise ValueError(f"dispatch: x {tuple(x.shape)} and topk_ids {tuple(topk_ids.shape)} do not match")
    return exchange_of(ep, x.device).dispatch(x, topk_ids)


def combine(
    expert_out: torch.Tensor,
    topk_weights: torch.Tensor,
    row_of_slot: torch.Tensor,
    *,
    ep_group: object | None = None,
) -> torch.Tensor:
    ep = as_expert_parallel(ep_group)
    if ep is None:
        return local.combine(expert_out, topk_weights, row_of_slot)
    return exchange_of(ep, expert_out.device).combine(expert_out, topk_weights, row_of_slot)


def ep_path() -> str:
    path = os.environ.get(EP_PATH_ENV, "auto").strip().lower() or "auto"
    if path not in EP_PATHS:
        raise UserError(f"{EP_PATH_ENV}={path!r}: expected one of {', '.join(EP_PATHS)}")
    return path


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
    if local_world is None or world is None or int(local_world) != int(world) or int(world) != ctx.ep_size:
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


def usable(ctx) -> bool:
    """The registration's `when`: ep_size > 1 on one host's CUDA devices with symmetric memory,
    unless DEEPINFER_EP_PATH=nccl; with DEEPINFER_EP_PATH=symm an unusable context is an error."""
    path = ep_path()
    if path == "nccl" or ctx.ep_size <= 1:
        return False
    reason = unusable_reason(ctx)
    if reason is not None and path == "symm":
        raise UserError(f"{EP_PATH_ENV}=symm, but the symmetric-memory EP path cannot run: {reason}")
    return reason is None


def _registrable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        _symm_module()
    except SymmetricMemoryUnavailable:
        return False
    return True


REGISTRATIONS = [
    Registration(op="dispatch", fn=dispatch, when=usable, priority=SYMM_PRIORITY,
                 note="Triton count + one scatter kernel into the owners' symmetric-memory receive buffers (one host)"),
    Registration(op="combine", fn=combine, when=usable, priority=SYMM_PRIORITY,
                 note="Triton scatter back into the sources' symmetric-memory buffers + Triton fixed-order combine"),
] if _registrable() else []  # fmt: skip
