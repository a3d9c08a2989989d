"""Expert-parallel load balancing (EPLB): where each MoE layer's physical experts live.

With expert parallelism every rank ("GPU" below) holds `num_replicas / num_gpus` physical experts
of each MoE layer. A physical expert is a copy of one logical expert (the checkpoint's experts);
`num_replicas - num_logical` of them are redundant copies of the busiest experts. `rebalance`
chooses the copies and their places from a measured load (tokens routed to each logical expert),
following the policy DeepSeek published with its EPLB:

- hierarchical (when the expert groups divide evenly over the nodes): pack the expert groups onto
  the nodes so that the nodes carry equal load (a group never straddles nodes, which keeps
  group-limited routing's traffic inside a node), replicate experts within each node, then pack
  each node's physical experts onto its GPUs;
- global (otherwise): replicate experts over the whole cluster, then pack them onto the GPUs.

Both packing steps are `balanced_packing`: the heaviest item goes to the lightest pack that still
has room. Replication (`replicate_experts`) repeatedly gives one more copy to the expert with the
highest load per copy. Everything runs on the CPU in float64 with fixed tie-breaking (the lowest
index wins), so every rank computes the same maps from the same load.

Maps (per MoE layer; the leading `layers` dimension counts MoE layers only, in model order):
  phy2log [layers, num_replicas]     logical expert held by each physical expert
  log2phy [layers, logical, max_rep] physical copies of each logical expert, ascending, -1 padded
  logcnt  [layers, logical]          copies of each logical expert (>= 1)
Rank r holds physical experts [r * L, (r + 1) * L) with L = num_replicas // num_gpus.
"""

from __future__ import annotations

import torch

__all__ = [
    "ExpertLoadCounter",
    "balanced_packing",
    "default_phy2log",
    "gpu_loads",
    "imbalance",
    "log2phy_of",
    "rebalance",
    "replicate_experts",
    "uses_hierarchical",
]


def uses_hierarchical(num_groups: int, num_nodes: int) -> bool:
    """DeepSeek's rule: the hierarchical policy when the expert groups divide evenly over the nodes."""
    return num_groups % num_nodes == 0


def rebalance(
    load: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place `num_replicas` physical experts over `num_gpus` GPUs in `num_nodes` nodes for `load`.

    load: [layers, logical] or [logical], tokens per logical expert (any real dtype, on any device).
    num_groups: the router's expert groups (`n_group`; 1 when routing is not group-limited).
    Returns (phy2log, log2phy, logcnt) as int64 CPU tensors (see the module docstring), without the
    layers dimension when `load` has none. Raises ValueError for sizes that do not divide.
    """
    if load.dim() not in (1, 2):
        raise ValueError(f"load must be [layers, logical] or [logical], got shape {tuple(load.shape)}")
    squeeze = load.dim() == 1
    weight = load.detach().to("cpu", torch.float64).reshape(-1, load.shape[-1])
    num_logical = weight.shape[1]
    _check_sizes(num_logical, num_replicas, num_groups, num_nodes, num_gpus)
    if uses_hierarchical(num_groups, num_nodes):
        phy2log = _hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:  # global: one group, one node, then the same steps
        phy2log = _hierarchical(weight, num_replicas, 1, 1, num_gpus)
    log2phy, logcnt = log2phy_of(phy2log, num_logical)
    if squeeze:
        return phy2log[0], log2phy[0], logcnt[0]
    return phy2log, log2phy, logcnt


def _check_sizes(num_logical: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    for name, value in (("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if num_replicas < num_logical:
        raise ValueError(f"num_replicas={num_replicas} is fewer than the {num_logical} logical experts: each needs a copy")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas={num_replicas} does not divide over num_gpus={num_gpus}")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus={num_gpus} does not divide over num_nodes={num_nodes}")
    if num_logical % num_groups:
        raise ValueError(f"the {num_logical} logical experts do not divide into num_groups={num_groups}")


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack n items of each row into `num_packs` packs of n / num_packs items, balancing the weight.

    Items go heaviest first (ties: lowest index first) to the lightest pack that still has room
    (ties: lowest pack). weight: [rows, n]. Returns (pack [rows, n], rank_in_pack [rows, n]) int64.
    """
    rows, items = weight.shape
    if items % num_packs:
        raise ValueError(f"{items} items do not divide into {num_packs} packs")
    capacity = items // num_packs
    pack = torch.empty(rows, items, dtype=torch.int64)
    rank = torch.empty(rows, items, dtype=torch.int64)
    if capacity == 1:  # one item per pack: keep the order
        pack[:] = torch.arange(items)
        rank.zero_()
        return pack, rank
    order = torch.sort(weight, dim=-1, descending=True, stable=True).indices.tolist()
    values = weight.tolist()
    for row in range(rows):
        loads = [0.0] * num_packs
        counts = [0] * num_packs
        row_pack, row_rank = [0] * items, [0] * items
        for item in order[row]:
            best = min((p for p in range(num_packs) if counts[p] < capacity), key=lambda p: (loads[p], p))
            row_pack[item], row_rank[item] = best, counts[best]
            loads[best] += values[row][item]
            counts[best] += 1
        pack[row] = torch.tensor(row_pack)
        rank[row] = torch.tensor(row_rank)
    return pack, rank


def replicate_experts(weight: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give `num_physical - n` extra copies to the experts of each row, one at a time, each to the
    expert whose load per copy is highest (ties: lowest index).

    weight: [rows, n]. Returns (phy2log [rows, num_physical], replica_rank [rows, num_physical],
    count [rows, n]); physical expert i < n is logical expert i.
    """
    rows, n = weight.shape
    phy2log = torch.arange(num_physical, dtype=torch.int64).repeat(rows, 1)
    replica = torch.zeros(rows, num_physical, dtype=torch.int64)
    count = torch.ones(rows, n, dtype=torch.int64)
    all_rows = torch.arange(rows)
    for i in range(n, num_physical):
        busiest = (weight / count).argmax(dim=-1)  # first maximum: the lowest index wins ties
        phy2log[:, i] = busiest
        replica[:, i] = count[all_rows, busiest]
        count[all_rows, busiest] += 1
    return phy2log, replica, count


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1], dtype=perm.dtype).expand_as(perm))
    return inv


def _hierarchical(weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int) -> torch.Tensor:
    """phy2log [layers, num_physical] by the hierarchical policy (num_groups = num_nodes = 1: global)."""
    layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    gpus_per_node = num_gpus // num_nodes
    phy_per_gpu = num_physical // num_gpus
    logical_per_node = num_logical // num_nodes
    phy_per_node = num_physical // num_nodes

    # 1. Expert groups onto nodes. "mlog" numbers logical experts node by node: node n holds
    #    mlog [n * logical_per_node, (n + 1) * logical_per_node).
    group_load = weight.unflatten(-1, (num_groups, group_size)).sum(-1)
    group_pack, group_rank = balanced_packing(group_load, num_nodes)
    group_slot = group_pack * groups_per_node + group_rank  # [layers, groups]: the group's place
    log2mlog = (group_slot.unsqueeze(-1) * group_size + torch.arange(group_size)).flatten(-2)
    mlog2log = _inverse(log2mlog)

    # 2. Copies within each node (rows: layer x node).
    mlog_load = weight.gather(-1, mlog2log).view(layers * num_nodes, logical_per_node)
    phy2mlog, _, mlogcnt = replicate_experts(mlog_load, phy_per_node)

    # 3. Each node's physical experts onto its GPUs, by load per copy.
    phy_load = (mlog_load / mlogcnt).gather(-1, phy2mlog)
    gpu_pack, gpu_rank = balanced_packing(phy_load, gpus_per_node)
    phy2pphy = gpu_pack * phy_per_gpu + gpu_rank  # physical expert -> its place on the node
    pphy2phy = _inverse(phy2pphy)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)  # node-local mlog of each placed expert
    node_base = torch.arange(0, num_logical, logical_per_node).view(1, -1, 1)
    pphy2mlog = (pphy2mlog.view(layers, num_nodes, -1) + node_base).flatten(-2)
    return mlog2log.gather(-1, pphy2mlog)


def log2phy_of(phy2log: torch.Tensor, num_logical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log2phy [layers, logical, max_rep] -1 padded, copies in ascending physical order; logcnt
    [layers, logical]) of phy2log [layers, P] (or [P]: then without the layers dimension)."""
    squeeze = phy2log.dim() == 1
    p2l = phy2log.detach().to("cpu", torch.int64).reshape(-1, phy2log.shape[-1])
    layers, num_physical = p2l.shape
    if p2l.numel() and (p2l.min() < 0 or p2l.max() >= num_logical):
        raise ValueError(f"phy2log holds ids outside [0, {num_logical})")
    logcnt = torch.zeros(layers, num_logical, dtype=torch.int64).scatter_add_(1, p2l, torch.ones_like(p2l))
    if (logcnt == 0).any():
        layer, expert = (logcnt == 0).nonzero()[0].tolist()
        raise ValueError(f"phy2log leaves logical expert {expert} of MoE layer {layer} without a copy")
    max_rep = int(logcnt.max())
    log2phy = torch.full((layers, num_logical, max_rep), -1, dtype=torch.int64)
    # The r-th copy of e (in physical order) is the r-th physical expert holding e.
    order = torch.sort(p2l, dim=-1, stable=True)  # by logical id, ties in physical order
    starts = torch.nn.functional.pad(logcnt.cumsum(-1), (1, 0))[:, :-1]
    rank = torch.arange(num_physical).expand(layers, -1) - starts.gather(-1, order.values)
    log2phy[torch.arange(layers).unsqueeze(-1), order.values, rank] = order.indices
    if squeeze:
        return log2phy[0], logcnt[0]
    return log2phy, logcnt


def default_phy2log(num_layers: int, num_logical: int, num_physical: int) -> torch.Tensor:
    """The placement without a measured load: physical expert p holds logical p mod num_logical
    (with no redundant experts, rank r holds logical experts [r * L, (r + 1) * L))."""
    if num_physical < num_logical:
        raise ValueError(f"{num_physical} physical experts cannot hold {num_logical} logical experts")
    return (torch.arange(num_physical, dtype=torch.int64) % num_logical).repeat(num_layers, 1)


def gpu_loads(load: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """The load each GPU serves when the tokens of expert e split evenly over its copies:
    [layers, num_gpus] (float64) for load [layers, logical] and phy2log [layers, P]."""
    weight = load.detach().to("cpu", torch.float64).reshape(-1, load.shape[-1])
    p2l = phy2log.detach().to("cpu", torch.int64).reshape(-1, phy2log.shape[-1])
    _, logcnt = log2phy_of(p2l, weight.shape[-1])
    per_phy = (weight / logcnt).gather(-1, p2l)
    return per_phy.view(p2l.shape[0], num_gpus, -1).sum(-1)


def imbalance(load: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> float:
    """max / mean GPU load, averaged over layers (1.0 = perfectly balanced)."""
    per_gpu = gpu_loads(load, phy2log, num_gpus)
    mean = per_gpu.mean(-1).clamp_min(1e-12)
    return float((per_gpu.amax(-1) / mean).mean())


class ExpertLoadCounter:
    """Tokens routed to each logical expert of each MoE layer, counted on the device.

    `counts` is one [layers, logical] int64 tensor; each MoE layer adds its top-k ids into its row
    with `index_add_` (no host synchronisation, so it also works inside captured CUDA graphs).
    `take()` returns the counts so far and starts again from zero.
    """

    def __init__(self, num_layers: int, num_logical: int, device: torch.device | str = "cpu"):
        self.counts = torch.zeros(num_layers, num_logical, dtype=torch.int64, device=device)

    def row(self, layer: int) -> torch.Tensor:
        return self.counts[layer]

    @staticmethod
    def record(row: torch.Tensor, topk_ids: torch.Tensor) -> None:
        ids = topk_ids.reshape(-1).long()
        row.index_add_(0, ids, torch.ones_like(ids))

    def take(self) -> torch.Tensor:
        counts = self.counts.clone()
        self.counts.zero_()
        return counts
