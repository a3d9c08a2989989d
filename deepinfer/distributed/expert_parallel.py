"""Expert parallelism: the experts are sharded across the ranks of a group, tokens travel to them.

An `ExpertParallel` is the value passed as `ep_group=` to the `dispatch` and `combine` ops. Rank r
of a group of W ranks owns the L = num_experts / W physical experts [r*L, (r+1)*L) (physical:
logical experts plus their redundant replicas, as EPLB places them).

The exchange (what every backend's EP dispatch/combine does around its local permutation):

dispatch, on every rank
  1. local permutation (the op's one-rank dispatch): slots stably sorted by global expert id. As
     experts are numbered rank by rank, this SEND layout is grouped by destination rank.
  2. counts: one all_to_all of the per-expert counts ([W*L] -> [W sources, L local experts]), then
     the one host synchronisation of the step (the receive buffer's size and the split sizes).
  3. rows: all_to_all_single of the send layout; what arrives is ordered by (source rank, local
     expert, source slot).
  4. re-sort: blocks (source s, expert l) reordered to (l, s): each local expert's rows become
     contiguous, ordered by source rank, then source slot order -- exactly what the one-rank
     dispatch of all ranks' tokens, concatenated in rank order, gives for those experts.
combine, on every rank
  1. the inverse re-sort, back to (source rank, local expert) blocks;
  2. all_to_all_single with the split sizes swapped: each rank gets its own slots' results back, in
     its send layout;
  3. the op's one-rank combine over that layout (fixed k order, float32).

The split sizes and the re-sort of a dispatch are kept here, keyed by the identity of the
`row_of_slot` tensor the dispatch returned, until the matching combine takes them: the ops' outputs
stay plain tensors. Rows travel in their own dtype (bf16, fp16, float32, ...), or as raw bytes for
dtypes a collective library may lack (fp8): the exchange is exact.

Every rank of the group must call dispatch and combine for every MoE layer of every step, with
T = 0 when it has no tokens (attention data parallel), or the others wait for it until the process
group's timeout and then fail with a PeerFailure (a DistributedError: the failure is another rank's).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.distributed.group import DistContext, DistributedError, PeerFailure, _first_line, is_collective_error

log = logging.getLogger(__name__)

# Dtypes every collective library here (NCCL, HCCL, gloo) moves natively; others travel as bytes.
_NATIVE_WIRE = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32, torch.int64})
_MAX_PENDING = 64  # dispatches awaiting their combine; older ones are dropped (with a warning)


@contextmanager
def token_bound(groups, bound: int | None):
    """Set `token_bound` on every ExpertParallel in `groups` for the duration (None: unknown)."""
    groups = list(groups)
    before = [g.token_bound for g in groups]
    for g in groups:
        g.token_bound = bound
    try:
        yield
    finally:
        for g, b in zip(groups, before):
            g.token_bound = b


@dataclass
class _Exchange:
    """What a dispatch leaves for its combine."""

    row_of_slot: torch.Tensor  # the key, kept alive so its identity stays unique
    send_splits: list[int]  # rows this rank sent to each rank
    recv_splits: list[int]  # rows this rank received from each rank
    recv_counts: torch.Tensor  # [W sources, L local experts] int64, on the rows' device
    num_received: int  # R


class ExpertParallel:
    """An expert-parallel group: the process group, this rank's place in it, the expert shards.

    group: a torch.distributed ProcessGroup (None: a one-rank group, every expert local).
    num_experts: PHYSICAL experts in total (logical + redundant replicas); must divide by the size.
    """

    def __init__(self, group: dist.ProcessGroup | None, num_experts: int, *, timeout_s: float | None = None):
        self.group = group
        if group is None:
            self.rank, self.size = 0, 1
        else:
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        if num_experts < 1 or num_experts % self.size != 0:
            raise ValueError(f"{num_experts} experts cannot be sharded evenly over {self.size} expert-parallel ranks")
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // self.size
        self.timeout_s = timeout_s  # for error messages only: the group's own timeout governs
        self._pending: OrderedDict[int, _Exchange] = OrderedDict()
        self._backend = dist.get_backend(group) if group is not None else None
        # Per-group state of a backend's faster exchange (e.g. the cuda backend's symmetric-memory
        # buffers, under "symm"), created by that backend on first use.
        self.transports: dict[str, object] = {}
        # None, or an upper bound on the tokens ANY rank passes to one dispatch, set alike on every
        # rank (e.g. by a benchmark, or per step by a caller that knows every rank's batch): an
        # exchange that lays out fixed per-source regions (the cuda symmetric-memory path) then
        # needs no exchange of the token counts first. A dispatch of more tokens is an error.
        self.token_bound: int | None = None
        # Opt-in profiling (the EP bench's --phases): None, or a callable taking a phase name, which
        # the exchange calls at the end of each of its phases (e.g. to record a CUDA event there).
        self.phase_marker = None

    def _mark(self, name: str) -> None:
        if self.phase_marker is not None:
            self.phase_marker(name)

    def start_forward(self) -> None:
        """Called by the model at the start of each forward (every rank, every forward): a
        transport that alternates buffers between dispatches starts each forward on the same one,
        so a forward captured in a CUDA graph replays on the buffers the other ranks use."""
        for transport in self.transports.values():
            start = getattr(transport, "start_forward", None)
            if start is not None:
                start()

    @classmethod
    def from_context(cls, ctx: DistContext | None, num_experts: int) -> "ExpertParallel":
        """Expert parallelism over the whole run (None: one rank)."""
        if ctx is None:
            return cls(None, num_experts)
        return cls(ctx.group, num_experts, timeout_s=ctx.timeout_s)

    def local_experts(self) -> range:
        """The physical experts this rank owns and computes."""
        return range(self.rank * self.experts_per_rank, (self.rank + 1) * self.experts_per_rank)

    def owner(self, expert: int) -> int:
        """The rank that owns physical expert `expert`."""
        return expert // self.experts_per_rank

    @property
    def spans_ranks(self) -> bool:
        return self.size > 1

    @property
    def pending(self) -> int:
        """Dispatches whose combine has not run yet."""
        return len(self._pending)

    def __repr__(self) -> str:
        return f"ExpertParallel(rank={self.rank}, size={self.size}, num_experts={self.num_experts}, experts_per_rank={self.experts_per_rank})"

    # -----------------------------------------------------------------------------------------
    # The exchange. `send_x`, `send_offsets` and `row_of_slot` are a one-rank dispatch's outputs.

    def exchange_dispatch(self, send_x: torch.Tensor, send_offsets: torch.Tensor, row_of_slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Send each row of this rank's send layout to its expert's owner; return (expert_x [R, D]
        ordered by local expert, then source rank, then source slot; expert_offsets [L + 1] int32)."""
        W, L = self.size, self.experts_per_rank
        if send_offsets.numel() != self.num_experts + 1:
            raise ValueError(f"dispatch over {send_offsets.numel() - 1} experts, but ep_group shards {self.num_experts}")
        device = send_x.device
        send_counts = (send_offsets[1:] - send_offsets[:-1]).to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        self._all_to_all(recv_counts, send_counts, None, None, "dispatch (expert counts)")
        self._mark("counts all_to_all")
        # The one host synchronisation: the receive buffer's size and the split sizes.
        both = torch.stack([send_counts, recv_counts]).view(2, W, L).sum(-1).tolist()
        send_splits, recv_splits = both
        received = sum(recv_splits)
        self._mark("host read")
        recv_x = torch.empty(received, *send_x.shape[1:], dtype=send_x.dtype, device=device)
        self._all_to_all(recv_x, send_x, recv_splits, send_splits, "dispatch (rows)")
        self._mark("rows all_to_all")
        per_block = recv_counts.view(W, L)
        if L == 1 or W == 1:
            expert_x = recv_x  # (source, expert) blocks are already in (expert, source) order
        else:
            expert_x = recv_x.index_select(0, _block_transpose(per_block, received))
        expert_offsets = torch.zeros(L + 1, dtype=torch.int32, device=device)
        expert_offsets[1:] = per_block.sum(0).cumsum(0)
        self._mark("re-sort")
        self._remember(_Exchange(row_of_slot, send_splits, recv_splits, per_block, received))
        return expert_x, expert_offsets

    def exchange_combine(self, expert_out: torch.Tensor, row_of_slot: torch.Tensor) -> torch.Tensor:
        """Send each row of `expert_out` (dispatch's receive order) back to its source rank; return
        this rank's rows [T*K, D] in its send layout, where `row_of_slot` points."""
        exchange = self._take(row_of_slot)
        if not isinstance(exchange, _Exchange):
            raise ValueError("expert-parallel combine: the matching dispatch did not run over all_to_all_single (resolve dispatch and combine together)")
        if expert_out.shape[0] != exchange.num_received:
            raise ValueError(f"combine got {expert_out.shape[0]} expert rows; the matching dispatch delivered {exchange.num_received} to this rank")
        W, L = self.size, self.experts_per_rank
        if L == 1 or W == 1:
            back = expert_out
        else:
            back = expert_out.index_select(0, _block_transpose(exchange.recv_counts.t(), exchange.num_received))
        self._mark("re-sort")
        rows = torch.empty(row_of_slot.numel(), *expert_out.shape[1:], dtype=expert_out.dtype, device=expert_out.device)
        self._all_to_all(rows, back, exchange.send_splits, exchange.recv_splits, "combine (rows)")
        self._mark("rows all_to_all")
        return rows

    # -----------------------------------------------------------------------------------------

    def _remember(self, exchange: _Exchange) -> None:
        self._pending[id(exchange.row_of_slot)] = exchange
        if len(self._pending) > _MAX_PENDING:
            self._pending.popitem(last=False)
            log.warning("ExpertParallel: more than %d dispatches without a combine; the oldest was dropped", _MAX_PENDING)

    def _take(self, row_of_slot: torch.Tensor) -> _Exchange:
        exchange = self._pending.get(id(row_of_slot))
        if exchange is None or exchange.row_of_slot is not row_of_slot:
            raise ValueError(
                "expert-parallel combine: row_of_slot is not the tensor a pending dispatch of this ep_group returned "
                "(pass dispatch's row_of_slot itself, not a copy, to the combine of the same ep_group, once)"
            )
        del self._pending[id(row_of_slot)]
        return exchange

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, what: str) -> None:
        """all_to_all_single over the group, on whatever library it has; errors name the cause."""
        staged = self._backend == "gloo" and inp.device.type != "cpu"  # gloo moves CPU tensors only
        wire_out = out.cpu() if staged else out
        wire_in = inp.cpu() if staged else inp
        try:
            dist.all_to_all_single(_wire(wire_out), _wire(wire_in.contiguous()), out_splits, in_splits, group=self.group)
        except Exception as exc:
            after = f" (timeout {self.timeout_s:g} s)" if self.timeout_s else ""
            failed = f"expert-parallel {what} failed on rank {self.rank} of {self.size}{after}: {type(exc).__name__}: {_first_line(exc)}"
            if not is_collective_error(exc):  # this rank's own arguments (e.g. split sizes that do not add up)
                raise DistributedError(failed) from exc
            # A consequence, not a cause (the launcher reports the rank that failed first).
            raise PeerFailure(
                f"{failed}. A rank died, or did not reach this MoE layer: every rank must call dispatch and combine for "
                "every MoE layer of every step, with an empty batch when it has no tokens"
            ) from exc
        if staged:
            out.copy_(wire_out)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The tensor as a collective library moves it: itself, or its bytes (int8) for other dtypes."""
    if t.dtype in _NATIVE_WIRE:
        return t
    if t.dim() == 0 or not t.is_contiguous():
        raise ValueError(f"cannot send a {tuple(t.shape)} {t.dtype} tensor as bytes")
    return t.view(torch.int8) if t.dim() > 1 else t.view(torch.int8).view(t.shape[0], t.element_size())


def _block_transpose(counts: torch.Tensor, total: int) -> torch.Tensor:
    """Gather index that reorders rows laid out in blocks (i, j), i-major, into (j, i)-major order.

    counts [I, J]: rows of block (i, j). Returns index [total] (int64, on counts' device): row n of
    the reordered layout is row index[n] of the original. No host synchronisation (total is known).
    """
    flat = counts.reshape(-1)
    src_start = (flat.cumsum(0) - flat).view_as(counts)  # where block (i, j) starts, i-major
    by_j = counts.t().reshape(-1)
    dst_start = by_j.cumsum(0) - by_j  # where block (i, j) starts, j-major (enumerated j-major)
    shift = src_start.t().reshape(-1) - dst_start
    return torch.repeat_interleave(shift, by_j, output_size=total) + torch.arange(total, device=counts.device)


def as_expert_parallel(ep_group: object | None, num_experts: int | None = None) -> ExpertParallel | None:
    """The ExpertParallel a dispatch/combine must exchange over, or None when every expert is local
    (no group, or a group of one rank). A bare process group of several ranks is refused: the split
    sizes a dispatch leaves for its combine live in an ExpertParallel."""
    if ep_group is None:
        return None
    if isinstance(ep_group, ExpertParallel):
        if num_experts is not None and num_experts != ep_group.num_experts:
            raise ValueError(f"dispatch over num_experts={num_experts}, but ep_group shards {ep_group.num_experts} experts")
        return ep_group if ep_group.spans_ranks else None
    if dist.get_world_size(ep_group) <= 1:
        return None
    raise ValueError(
        "expert-parallel dispatch/combine across ranks takes a deepinfer.distributed.ExpertParallel as ep_group "
        f"(it holds a dispatch's split sizes until its combine), not a {type(ep_group).__name__}"
    )


def ep_size_of(ep_group: object | None) -> int:
    """Ranks in an ep_group value (None: 1)."""
    if ep_group is None:
        return 1
    if isinstance(ep_group, ExpertParallel):
        return ep_group.size
    return dist.get_world_size(ep_group)


EP_PRIORITY = 100  # above every local dispatch/combine kernel and fast path of a backend


def expert_parallel_kernels(local_dispatch, local_combine, *, library: str, local_note: str) -> list:
    """EP `dispatch` / `combine` kernels built from a backend's local ones: permute locally, then
    exchange rows over the ep_group (`ExpertParallel.exchange_*`, all_to_all_single over `library`).

    Registered only when ep_size > 1, above the backend's local kernels (which refuse a group of
    several ranks). With ep_group None or a one-rank group they are the local kernels.
    """
    from deepinfer.registry import Registration

    def dispatch(
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        num_experts: int,
        ep_group: object | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ep = as_expert_parallel(ep_group, num_experts)
        send_x, send_offsets, row_of_slot = local_dispatch(x, topk_ids, num_experts=num_experts)
        if ep is None:
            return send_x, send_offsets, row_of_slot
        ep._mark("local dispatch")
        expert_x, expert_offsets = ep.exchange_dispatch(send_x, send_offsets, row_of_slot)
        return expert_x, expert_offsets, row_of_slot

    def combine(
        expert_out: torch.Tensor,
        topk_weights: torch.Tensor,
        row_of_slot: torch.Tensor,
        *,
        add: torch.Tensor | None = None,
        ep_group: object | None = None,
    ) -> torch.Tensor:
        ep = as_expert_parallel(ep_group)
        if ep is not None:
            expert_out = ep.exchange_combine(expert_out, row_of_slot)  # this rank's slots, in its send layout
        out = local_combine(expert_out, topk_weights, row_of_slot, add=add)  # add: this rank's tokens', after the exchange
        if ep is not None:
            ep._mark("combine (local)")
        return out

    def multi_rank(ctx) -> bool:
        return ctx.ep_size > 1

    return [
        Registration(op="dispatch", fn=dispatch, when=multi_rank, priority=EP_PRIORITY,
                     note=f"{local_note} counting sort + all_to_all_single ({library}) across the EP group"),
        Registration(op="combine", fn=combine, when=multi_rank, priority=EP_PRIORITY,
                     note=f"all_to_all_single ({library}) back to the sources + {local_note} fixed-order combine"),
    ]
