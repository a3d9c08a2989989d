"""Expert-parallel dispatch/combine benchmark, one process per rank (`deepinfer bench ops --ep N`).

Every rank runs `run_rank`; rank 0 prints the table and writes the JSON. Measured in one run:

- peer-to-peer copy bandwidth (where the backend has >= 2 devices on this host, on rank 0 while the
  others wait): a 1 GiB `dst_on_device1.copy_(src_on_device0)` (GB/s = bytes / time, median of 5),
  and both directions at once (device 0 -> 1 and 1 -> 0 on two streams; GB/s = 2 x bytes / time);
- for each T in `tokens` (per rank), hidden 7168, top-8 of 256 experts with uniform random routing
  (each token's 8 distinct experts drawn uniformly, per rank seed), rows of bf16 and of fp8 e4m3
  (moved as raw bytes): the time per dispatch and per combine of every EP implementation the
  backend registers for this ep size (on cuda: all_to_all_single over NCCL, and symmetric memory
  where it applies). Timing, as NCCL's tests do: after the warm-up iterations, a host barrier and a
  device synchronisation (both outside the timed region), then one small all_reduce on the stream
  (a device-side barrier that starts the ranks together), then `repeat` iterations back to back
  (dispatch, combine, dispatch, ...) with a device event (torch.Event: a CUDA event on cuda)
  recorded on the stream before and after every op (the wall clock on the CPU); nothing else is
  between the events of an op: no barrier, no host synchronisation of a previous iteration, no
  allocation of the bench's buffers. An op's time is the median over iterations of its (end -
  start) event interval, per rank; the MAX over ranks is reported (and, in the JSON, the loop's
  mean per iteration). Combine rows are always bf16 (expert outputs are bf16; fp8 applies to
  dispatch), so combine is reported for the bf16 rows only;
- the same rows with one plain `all_to_all_single` of the group (the rows already in send order,
  the split sizes known: no counting, no host synchronisation), as the peer;
- GB/s counts REMOTE bytes: rows whose expert lives on another rank x row bytes, per rank (the
  max over ranks), over the time (what all_to_all_single of the (token, k) rows moves: the issue's
  measure); the fraction is of the one-direction p2p bandwidth. "unique GB/s" counts each token row
  once per other rank that owns one of its experts: what an exchange that sends a token to a rank
  once (the symmetric-memory path) puts on the link, so its fraction of p2p is the link's use;
- every rank dispatches T tokens, so the bench sets `ExpertParallel.token_bound = T` (as a caller
  that knows every rank's batch would); for the symmetric-memory path the same rows are measured
  again without it ("T exchanged": each dispatch first exchanges the token counts, one host
  synchronisation), and, where the dispatch needs no host synchronisation (latency mode), inside a
  device graph captured by the backend (BackendSpec.graph_capture: a CUDA graph on cuda; a backend
  without one: those rows are left out, with a note): two dispatches (both buffer parities)
  captured once and replayed `repeat` times back to back, time per dispatch = the replays' time /
  (2 x repeat); combine likewise from a graph of two dispatch + combine pairs, minus the dispatches.

Every device call goes through torch's device-generic API (deepinfer.bench.device_api): no
device module is named here.

Phase breakdown (opt-in: `--phases`): for the bf16 rows, `repeat` more iterations with
`ExpertParallel.phase_marker` set, so the EP implementation records an event at the end of each of
its phases (symmetric memory: send, barrier, count (throughput mode), expand; weights, barrier 1,
reduce + send back, barrier 2, sum; the NCCL path: local dispatch, counts all_to_all, host read,
rows all_to_all, re-sort; re-sort, rows all_to_all, combine (local)); each phase's median, max over
ranks, is printed after the table and written to the JSON ("phases").
These iterations are separate from the timed ones (the extra events do not touch those numbers).

Targets (shown met / NOT met): >= 80% of the p2p bandwidth at 4096 tokens per rank; <= 40 us per
dispatch at 128 tokens per rank.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from deepinfer.bench.device_api import device_name, empty_cache, on_host, peer_access, side_stream, synchronize, timing_event

HIDDEN = 7168
TOP_K = 8
EXPERTS = 256
DEFAULT_TOKENS = (128, 4096)
P2P_BYTES = 1 << 30
TARGET_FRACTION = 0.80  # of p2p bandwidth, at TARGET_BW_TOKENS
TARGET_BW_TOKENS = 4096
TARGET_LATENCY_US = 40.0  # per dispatch, at TARGET_LATENCY_TOKENS
TARGET_LATENCY_TOKENS = 128
PEER = "all_to_all_single"  # the name of the plain collective's rows
SYMM = "symmetric memory"  # the cuda backend's intranode path


@dataclass
class Row:
    impl: str
    op: str  # dispatch | combine | all_to_all
    dtype: str  # bf16 | fp8
    tokens: int
    status: str = "ok"  # ok | error
    us: float | None = None  # max over ranks of the per-rank median
    us_per_rank: list[float] = field(default_factory=list)
    us_mean_iteration: float | None = None  # the loop's time / iterations (both ops and what is between them), max over ranks
    remote_bytes: int | None = None  # max over ranks
    gbs: float | None = None
    fraction_p2p: float | None = None
    unique_remote_bytes: int | None = None  # each token row once per other rank owning one of its experts, max over ranks
    unique_gbs: float | None = None
    unique_fraction_p2p: float | None = None
    target: str | None = None
    target_met: bool | None = None
    error: str | None = None


@dataclass
class Impl:
    name: str
    dispatch: object  # Kernel
    combine: object  # Kernel


def ep_implementations(registry, backend: str, device: torch.device, ep_size: int, options: dict[str, str] | None = None) -> list[Impl]:
    """The backend's EP dispatch/combine pairs for this ep size: kernels that apply at ep_size but
    not at 1 (paired by priority, highest first); for a backend whose one kernel serves any ep size
    (the reference), that kernel. Empty: the backend has no EP path. options: the backend's
    (e.g. the cuda backend's ep_path); a path an option forces where it cannot run is a one-line
    RegistryError, as when an engine resolves its ops."""
    from deepinfer.registry import RegistryError, ResolveContext

    at = ResolveContext(backend, device, torch.bfloat16, ep_size=ep_size, options=dict(options or {}))
    one = ResolveContext(backend, device, torch.bfloat16, ep_size=1, options=dict(options or {}))
    found = {}
    for op in ("dispatch", "combine"):
        for kernel in registry.candidates(backend, op):
            if kernel.applies(at, None) and not kernel.applies(one, None):
                reason = kernel.unusable(at) if kernel.unusable is not None else None
                if reason is not None:
                    raise RegistryError(f"backend {backend!r} cannot serve op {op!r}: {reason}")
                found.setdefault(kernel.priority, {})[op] = kernel
    impls = [Impl(_name(pair["dispatch"]), pair["dispatch"], pair["combine"]) for _, pair in sorted(found.items(), reverse=True) if len(pair) == 2]
    if impls:
        return impls
    d, c = registry.pick(at, "dispatch"), registry.pick(at, "combine")
    from deepinfer.registry import all_ops

    specs = all_ops()
    if d is not None and c is not None and d.fn is specs["dispatch"].reference and c.fn is specs["combine"].reference:
        return [Impl(f"{backend} ({PEER})", d, c)]
    return []


def _name(kernel) -> str:
    module = getattr(kernel.fn, "__module__", "")
    if module.endswith("moe_ep_symm"):
        return SYMM
    if "all_to_all_single" in kernel.note:
        library = kernel.note.split("all_to_all_single (", 1)[-1].split(")", 1)[0] if "all_to_all_single (" in kernel.note else ""
        return f"{PEER} path" + (f" ({library})" if library else "")
    return kernel.note or module


# ---------------------------------------------------------------------------------------------
# timing


class Marks:
    """Points on the device timeline: a device event recorded on the current stream per mark (the
    wall clock on the CPU). Callable with a name, so an EP implementation can take it as its
    `phase_marker`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.events = not on_host(device)
        self.items: list[tuple[str, object]] = []

    def __call__(self, name: str) -> None:
        if self.events:
            event = timing_event(self.device)
            event.record()
            self.items.append((name, event))
        else:
            self.items.append((name, time.perf_counter()))

    def times_us(self) -> list[tuple[str, float]]:
        """(name, microseconds since the first mark), after waiting for the last one."""
        if not self.items:
            return []
        if self.events:
            self.items[-1][1].synchronize()
            first = self.items[0][1]
            return [(name, first.elapsed_time(e) * 1e3) for name, e in self.items]
        t0 = self.items[0][1]
        return [(name, (t - t0) * 1e6) for name, t in self.items]


def start_together(device: torch.device, group) -> None:
    """Outside any timed region: a host barrier, the device idle, then a one-element all_reduce on
    the stream, so the first event recorded after this fires on every rank at about the same time."""
    dist.barrier(group=group)
    if not on_host(device):
        synchronize(device)
        dist.all_reduce(torch.zeros(1, device=device), group=group)


def intervals(times: list[tuple[str, float]], begin: str, end: str) -> list[float]:
    """The (end - begin) intervals of consecutive begin ... end mark pairs."""
    out, start = [], None
    for name, t in times:
        if name == begin:
            start = t
        elif name == end and start is not None:
            out.append(t - start)
            start = None
    return out


def phase_medians(times: list[tuple[str, float]], begins: dict[str, str]) -> dict[str, float]:
    """{"<op>: <phase>": median us} from marks where `begins` names the mark that starts each op
    (its value: the op); every other mark ends a phase that began at the previous mark. Phases of
    one name within one op are summed."""
    per: dict[str, list[float]] = {}
    op, prev, acc = None, None, {}
    for name, t in times:
        if name in begins:
            for key, v in acc.items():
                per.setdefault(key, []).append(v)
            op, prev, acc = begins[name], t, {}
            continue
        if op is None:
            continue
        key = f"{op}: {'rest' if name.endswith(' end') else name}"  # rest: from the op's last phase mark to its end mark
        acc[key] = acc.get(key, 0.0) + (t - prev)
        prev = t
    for key, v in acc.items():
        per.setdefault(key, []).append(v)
    return {k: statistics.median(v) for k, v in per.items()}


def measures_p2p(spec, interpret: bool) -> bool:
    """The p2p copy is measured where the backend has at least two devices on this host (never on the CPU)."""
    return (spec.local_devices(interpret) or 0) >= 2


def p2p_bandwidth(device_type: str, reps: int = 5) -> dict:
    """Device 0 -> device 1 copy bandwidth of a 1 GiB buffer, one direction and both at once (GB/s)."""
    d0, d1 = torch.device(device_type, 0), torch.device(device_type, 1)
    result = {"bytes": P2P_BYTES, "peer_access": peer_access(device_type, 0, 1), **_p2p_rates(d0, d1, P2P_BYTES, reps)}
    empty_cache(d1)  # the buffers went with _p2p_rates' return
    empty_cache(d0)
    result["how"] = (
        f"dst_on_{device_type}1.copy_(src_on_{device_type}0) of 1 GiB (median of 5); bidirectional: both directions on two streams at once, bytes of both"
    )
    return result


def _p2p_rates(d0: torch.device, d1: torch.device, n: int, reps: int) -> dict:
    """GB/s of an n-byte copy d0 -> d1 alone and of both directions at once, median of `reps`."""
    src0, dst1 = torch.empty(n, dtype=torch.uint8, device=d0), torch.empty(n, dtype=torch.uint8, device=d1)
    src1, dst0 = torch.empty(n, dtype=torch.uint8, device=d1), torch.empty(n, dtype=torch.uint8, device=d0)

    def sync():
        synchronize(d0)
        synchronize(d1)

    def one():
        dst1.copy_(src0)

    def both():
        s0, s1 = side_stream(d0), side_stream(d1)
        with s0:
            dst1.copy_(src0, non_blocking=True)
        with s1:
            dst0.copy_(src1, non_blocking=True)

    result = {}
    for name, fn, moved in (("unidirectional_gbs", one, n), ("bidirectional_gbs", both, 2 * n)):
        fn()
        times = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        result[name] = moved / statistics.median(times) / 1e9
    return result


# ---------------------------------------------------------------------------------------------
# one rank


def _routing_ids(gen: torch.Generator, tokens: int) -> torch.Tensor:
    return torch.rand(tokens, EXPERTS, generator=gen).topk(TOP_K, dim=-1).indices.to(torch.int32)


def routing(rank: int, tokens: int, device: torch.device):
    gen = torch.Generator().manual_seed(1000 + 7919 * rank + tokens)
    ids = _routing_ids(gen, tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    weights = torch.rand(tokens, TOP_K, generator=gen)
    return ids.to(device), x.to(device), weights.to(device), ids


def traffic(ranks: int, tokens: int) -> dict:
    """Rows that leave each rank, from every rank's routing (seeded, so any rank can redo it):
    "sent": per rank, rows to each rank ((token, k) copies); "dispatch": (the most (token, k) rows a
    rank sends to other ranks, the most token rows it sends counting a token once per other rank it
    reaches); "combine": the same for what comes back (rows a rank received from other ranks; token
    rows it holds for other ranks, one partial each)."""
    L = EXPERTS // ranks
    reach = []  # [T, W] bool per rank: token t has an expert on rank r
    sent = []
    for r in range(ranks):
        owner = _routing_ids(torch.Generator().manual_seed(1000 + 7919 * r + tokens), tokens).long() // L
        sent.append(torch.bincount(owner.reshape(-1), minlength=ranks))
        reach.append(torch.zeros(tokens, ranks, dtype=torch.bool).scatter_(1, owner, True))
    others = [[s for s in range(ranks) if s != r] for r in range(ranks)]
    return {
        "sent": sent,
        "dispatch": (max(int(sum(sent[r][o] for o in others[r])) for r in range(ranks)),
                     max(int(sum(reach[r][:, o].sum() for o in others[r])) for r in range(ranks))),
        "combine": (max(int(sum(sent[s][r] for s in others[r])) for r in range(ranks)),
                    max(int(sum(reach[s][:, r].sum() for s in others[r])) for r in range(ranks))),
    }


def ep_iterations(impl, x, ids, weights, ep, n: int, marks=None):
    """n iterations of dispatch + combine back to back; `marks` (a Marks) brackets each op with
    "dispatch"/"dispatch end" and "combine"/"combine end". Returns the last dispatch's offsets."""
    mark = marks or (lambda name: None)
    offsets = None
    for _ in range(n):
        mark("dispatch")
        expert_x, offsets, row_of_slot = impl.dispatch.fn(x, ids, num_experts=EXPERTS, ep_group=ep)
        mark("dispatch end")
        expert_out = expert_x if expert_x.dtype == torch.bfloat16 else expert_x.to(torch.bfloat16)
        mark("combine")
        impl.combine.fn(expert_out, weights, row_of_slot, ep_group=ep)
        mark("combine end")
    return offsets


def _variants(impl, T: int, can_capture: bool) -> tuple[list[tuple[str, int | None, bool]], list[str]]:
    """(row label, token_bound, in a device graph) to measure an implementation with, and the labels
    left out: every one with the bound (all ranks dispatch T tokens); the symmetric-memory path also
    without it, and at the latency target's size inside a graph (the cuda backend's: a CUDA graph)
    where the backend can capture one (`can_capture`), else that row is left out, never faked."""
    out, left_out = [(impl.name, T, False)], []
    if impl.name == SYMM:
        out.append((f"{SYMM} (T exchanged)", None, False))
        if T == TARGET_LATENCY_TOKENS:
            (out if can_capture else left_out).append((f"{SYMM} (CUDA graph)", T, True))
    return out, [label for label, _, _ in left_out]


def _eager_times(impl, x, ids, weights, ep, device, group, warmup, repeat, phases):
    """(error, dispatch us, combine us, mean us per iteration, phase medians) on this rank."""
    try:
        ep_iterations(impl, x, ids, weights, ep, warmup)  # compiles, allocates, grows buffers
        start_together(device, group)
        marks = Marks(device)
        ep_iterations(impl, x, ids, weights, ep, repeat, marks)
        stamps = marks.times_us()
        dispatch = statistics.median(intervals(stamps, "dispatch", "dispatch end"))
        combine = statistics.median(intervals(stamps, "combine", "combine end"))
        mean = stamps[-1][1] / repeat
        phase_us = None
        if phases:
            start_together(device, group)
            marks = Marks(device)
            ep.phase_marker = marks
            try:
                ep_iterations(impl, x, ids, weights, ep, repeat, marks)
            finally:
                ep.phase_marker = None
            phase_us = phase_medians(marks.times_us(), {"dispatch": "dispatch", "combine": "combine"})
        return None, dispatch, combine, mean, phase_us
    except Exception as exc:  # one implementation failing must not hide the others
        if _is_group_failure(exc):
            raise
        return _one_line(exc), None, None, None, None


def _graph_times(impl, x, ids, weights, ep, device, group, warmup, repeat, capture):
    """As _eager_times, from device graphs (`capture`: the backend's GraphCapture): two dispatches
    (both buffer parities), and two dispatch + combine pairs, each captured once (after the eager
    warm-up, so no warm-up inside the capture) and replayed `repeat` times back to back."""

    def dispatches():
        for _ in range(2):
            ep._take(impl.dispatch.fn(x, ids, num_experts=EXPERTS, ep_group=ep)[2])  # no combine: drop its record

    def pairs():
        ep_iterations(impl, x, ids, weights, ep, 2)

    try:
        ep_iterations(impl, x, ids, weights, ep, warmup)
        times = []
        for body in (dispatches, pairs):
            synchronize(device)
            graph, _ = capture.capture(body, device=device, pool=capture.new_pool(device), warmups=0)
            graph.replay()
            start_together(device, group)
            marks = Marks(device)
            marks("begin")
            for _ in range(repeat):
                graph.replay()
            marks("end")
            times.append(marks.times_us()[-1][1] / repeat)
            del graph
        dispatch = times[0] / 2
        return None, dispatch, max(times[1] / 2 - dispatch, 0.0), times[1] / 2, None
    except Exception as exc:
        if _is_group_failure(exc):
            raise
        return _one_line(exc), None, None, None, None


def _is_group_failure(exc: BaseException) -> bool:
    from deepinfer.distributed import DistributedError

    return isinstance(exc, DistributedError)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def run_rank(*, backend: str, interpret: bool, ops: list[str], tokens: list[int], repeat: int, warmup: int,
             timeout_s: float, json_path: Path | None, progress=print, phases: bool = False, backend_options: dict[str, str] | None = None) -> dict | None:
    """One rank of `deepinfer bench ops --ep N`. backend_options: the backend's options (validated
    here, e.g. the cuda backend's ep_path: which EP paths are measured)."""
    from deepinfer.distributed import ExpertParallel, destroy_distributed, init_distributed
    from deepinfer.errors import UserError
    from deepinfer.plugins import load_plugins

    plugins = load_plugins()
    spec = plugins.require(backend, interpret=interpret)
    options = spec.resolve_options(backend_options)
    ctx = init_distributed(timeout_s, device=spec.device(interpret))
    if ctx is None:
        raise UserError("the expert-parallel benchmark needs several ranks (run it with --ep N, N > 1)")
    rank, W, device, group = ctx.rank, ctx.world_size, ctx.device, ctx.group
    if EXPERTS % W:
        raise UserError(f"{EXPERTS} experts do not shard over --ep {W}")
    registry = plugins.registry(backend, interpret=interpret, options=options)
    impls = ep_implementations(registry, backend, device, W, options)
    if not impls:
        raise UserError(f"backend {backend!r} has no expert-parallel dispatch/combine at ep {W}")
    say = progress if rank == 0 else (lambda *a, **k: None)

    capture = spec.graph_capture if not interpret else None  # as open_runtime gives it: the interpreter runs on the CPU
    notes: list[str] = []
    p2p = None
    if measures_p2p(spec, interpret):
        if rank == 0:
            say(f"measuring peer-to-peer copy bandwidth {device.type} 0 -> {device.type} 1 (1 GiB) ...")
            p2p = p2p_bandwidth(device.type)
        box = [p2p]
        dist.broadcast_object_list(box, src=0, group=group)
        p2p = box[0]
    rows: list[Row] = []
    phase_rows: list[dict] = []
    ep = ExpertParallel(group, EXPERTS, timeout_s=timeout_s)

    def gather(values):
        out = [None] * W
        dist.all_gather_object(out, values, group=group)
        return out

    for T in tokens:
        ids, x_bf16, weights, _ = routing(rank, T, device)
        moved = traffic(W, T)
        for dtype_name, x in (("bf16", x_bf16), ("fp8", x_bf16.to(torch.float8_e4m3fn))):
            row_bytes = HIDDEN * x.element_size()
            for impl in impls:
                variants, left_out = _variants(impl, T, capture is not None)
                for label in left_out:
                    note = f"{label}: not measured, backend {backend!r} captures no device graphs" + (" under --interpret (the CPU)" if interpret else "")
                    if note not in notes:
                        notes.append(note)
                        say(f"  {note}")
                for label, bound, graph in variants:
                    say(f"  {label}: T={T} {dtype_name} ...")
                    ep.token_bound = bound
                    if graph:
                        mine = _graph_times(impl, x, ids, weights, ep, device, group, warmup, repeat, capture)
                    else:
                        mine = _eager_times(impl, x, ids, weights, ep, device, group, warmup, repeat, phases and dtype_name == "bf16")
                    per_rank = gather(mine)
                    errors = [p[0] for p in per_rank if p[0]]
                    for op, col in (("dispatch", 1), ("combine", 2)):
                        if op not in ops or (op == "combine" and dtype_name != "bf16"):
                            continue
                        if errors:
                            rows.append(Row(label, op, dtype_name, T, status="error", error=errors[0]))
                            continue
                        rows_moved, unique_moved = moved[op]  # max over ranks; combine: what goes back (bf16)
                        rows.append(_row(label, op, dtype_name, T, [p[col] for p in per_rank], rows_moved * row_bytes, p2p, unique_moved * row_bytes))
                        means = [p[3] for p in per_rank]
                        rows[-1].us_mean_iteration = max(means) if None not in means else None
                    if not errors and all(p[4] for p in per_rank):
                        for key in per_rank[0][4]:
                            values = [p[4].get(key) for p in per_rank]
                            if None in values:
                                continue
                            op, phase = key.split(": ", 1)
                            phase_rows.append({"impl": label, "dtype": dtype_name, "tokens": T, "op": op, "phase": phase,
                                               "us": max(values), "us_per_rank": values})
            ep.token_bound = None
            # the plain collective of the same rows, as the peer
            rows.append(_a2a_row(x, moved["sent"][rank], row_bytes, rank, W, group, device, warmup, repeat, dtype_name, T, p2p, gather))
    result = {
        "backend": backend,
        "backend_options": options,
        "ep": W,
        "device": f"cpu ({platform.processor() or platform.machine()})" if on_host(device) else device_name(device),
        "process_group": ctx.backend,
        "torch": torch.__version__,
        "shape": {"hidden": HIDDEN, "top_k": TOP_K, "experts": EXPERTS, "routing": "uniform random, distinct experts per token"},
        "iterations": {"warmup": warmup, "timed": repeat, "statistic": "median per rank, max over ranks",
                       "how": "iterations back to back after one device-side barrier; device events before and after each op (the wall clock on the CPU)"},
        "p2p": p2p,
        "targets": {
            "bandwidth": f">= {TARGET_FRACTION:.0%} of p2p GB/s at {TARGET_BW_TOKENS} tokens per rank",
            "latency": f"<= {TARGET_LATENCY_US:g} us per dispatch at {TARGET_LATENCY_TOKENS} tokens per rank",
        },
        "implementations": [{"name": i.name, "dispatch": i.dispatch.note, "combine": i.combine.note, "priority": i.dispatch.priority} for i in impls],
        "rows": [asdict(r) for r in rows],
        "phases": phase_rows if phases else None,
        "notes": notes,  # rows left out, and why
    }
    if rank == 0:
        print(format_table(result))
        if json_path is not None:
            json_path.write_text(json.dumps(result, indent=1))
    dist.barrier(group=group)
    destroy_distributed()
    return result if rank == 0 else None


def _row(impl, op, dtype_name, T, per_rank_us, remote_bytes, p2p, unique_bytes=None) -> Row:
    us = max(per_rank_us)
    row = Row(impl, op, dtype_name, T, us=us, us_per_rank=per_rank_us, remote_bytes=remote_bytes, unique_remote_bytes=unique_bytes)
    row.gbs = remote_bytes / (us * 1e-6) / 1e9 if us > 0 else None
    row.unique_gbs = unique_bytes / (us * 1e-6) / 1e9 if us > 0 and unique_bytes is not None else None
    if p2p and row.gbs is not None:
        row.fraction_p2p = row.gbs / p2p["unidirectional_gbs"]
        if row.unique_gbs is not None:
            row.unique_fraction_p2p = row.unique_gbs / p2p["unidirectional_gbs"]
    if T == TARGET_BW_TOKENS and op != "all_to_all":
        row.target = f">= {TARGET_FRACTION:.0%} p2p"
        row.target_met = None if row.fraction_p2p is None else row.fraction_p2p >= TARGET_FRACTION
    if T == TARGET_LATENCY_TOKENS and op == "dispatch":
        row.target = f"<= {TARGET_LATENCY_US:g} us"
        row.target_met = us <= TARGET_LATENCY_US
    return row


def _a2a_row(x, sent, row_bytes, rank, W, group, device, warmup, repeat, dtype_name, T, p2p, gather) -> Row:
    from deepinfer.distributed.expert_parallel import _wire

    send_splits = sent.tolist()
    counts_in = torch.tensor(send_splits, dtype=torch.int64, device=x.device)
    counts_out = torch.empty_like(counts_in)
    dist.all_to_all_single(counts_out, counts_in, group=group)
    recv_splits = counts_out.tolist()
    send = _wire(x).repeat_interleave(TOP_K, dim=0)[: sum(send_splits)].contiguous()  # T*K rows in send order
    recv = send.new_empty(sum(recv_splits), send.shape[1])
    times = []
    error = None
    try:
        for _ in range(warmup):
            dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
        start_together(device, group)
        marks = Marks(device)
        for _ in range(repeat):
            marks("a2a")
            dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
            marks("a2a end")
        times = intervals(marks.times_us(), "a2a", "a2a end")
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    remote = (sum(send_splits) - send_splits[rank]) * row_bytes
    per_rank = gather((error, statistics.median(times) if times else None, remote))
    errors = [p[0] for p in per_rank if p[0]]
    name = f"{PEER} ({dist.get_backend(group)})"
    if errors:
        return Row(name, "all_to_all", dtype_name, T, status="error", error=errors[0])
    return _row(name, "all_to_all", dtype_name, T, [p[1] for p in per_rank], max(p[2] for p in per_rank), p2p)


# ---------------------------------------------------------------------------------------------
# report


def format_table(result: dict) -> str:
    p2p = result["p2p"]
    lines = [f"expert-parallel dispatch/combine: backend {result['backend']}, ep {result['ep']}, {result['device']}, "
             f"hidden {HIDDEN}, top-{TOP_K} of {EXPERTS} experts (uniform), {result['process_group']}"]
    if p2p:
        lines.append(f"p2p device 0 -> device 1: {p2p['unidirectional_gbs']:.0f} GB/s one way, {p2p['bidirectional_gbs']:.0f} GB/s both ways at once")
    else:
        lines.append("p2p: not measured (needs 2 devices of the backend on this host); no fraction of p2p")
    head = (f"{'implementation':<34} {'op':<10} {'rows':<5} {'tokens':>6} {'us':>10} {'remote MB':>10} {'GB/s':>8} {'% p2p':>6} "
            f"{'unique MB':>10} {'GB/s':>8} {'% p2p':>6}  target")
    lines += [head, "-" * len(head)]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"{r['impl']:<34} {r['op']:<10} {r['dtype']:<5} {r['tokens']:>6} error: {r['error']}")
            continue
        frac = f"{r['fraction_p2p'] * 100:5.1f}%" if r["fraction_p2p"] is not None else "     -"
        gbs = f"{r['gbs']:8.1f}" if r["gbs"] is not None else "       -"
        target = ""
        if r["target"]:
            target = f"{r['target']}: " + ("met" if r["target_met"] else ("NOT met" if r["target_met"] is False else "n/a"))
        if r.get("unique_remote_bytes") is not None:
            ufrac = f"{r['unique_fraction_p2p'] * 100:5.1f}%" if r.get("unique_fraction_p2p") is not None else "     -"
            unique = f"{r['unique_remote_bytes'] / 1e6:10.2f} {r['unique_gbs']:8.1f} {ufrac}"
        else:
            unique = f"{'-':>10} {'-':>8} {'-':>6}"
        row = f"{r['impl']:<34} {r['op']:<10} {r['dtype']:<5} {r['tokens']:>6} {r['us']:10.1f} {r['remote_bytes'] / 1e6:10.2f}"
        lines.append(f"{row} {gbs} {frac} {unique}  {target}")
    lines.append("us: median per rank over the timed iterations (back to back, device events around each op; in a graph: replays' time / ops), max over ranks; "
                 "GB/s: remote (token, k) rows' bytes per rank (max over ranks) / us (the target's measure); unique: each token row once per other rank "
                 "it reaches (what the symmetric-memory path moves); combine rows are bf16 (expert outputs)")
    lines += [f"note: {note}" for note in result.get("notes") or []]
    if result.get("phases"):
        lines.append("")
        lines.append("phases (bf16 rows; us: median over iterations, max over ranks; per rank in brackets)")
        head = f"{'implementation':<34} {'tokens':>6} {'op':<9} {'phase':<20} {'us':>9}  per rank"
        lines += [head, "-" * len(head)]
        for ph in result["phases"]:
            per = ", ".join(f"{v:.1f}" for v in ph["us_per_rank"])
            lines.append(f"{ph['impl']:<34} {ph['tokens']:>6} {ph['op']:<9} {ph['phase']:<20} {ph['us']:9.1f}  [{per}]")
    return "\n".join(lines)
