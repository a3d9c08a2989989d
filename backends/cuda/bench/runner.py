"""`deepinfer bench ops --backend cuda`: the machine's ceilings, every kernel and its torch peer, in one run.

1. Ceilings, measured here and now: device-to-device copy bandwidth (a 2 GiB copy, bytes read plus
   bytes written) and the cuBLAS bf16 matmul rate (8192^3 through torch.matmul).
2. Cases: the `CASES` list of every bench module of this package (one per op family), found by
   iterating the package: a bench module is one that declares the `OPS` it benches, and its rows sit
   in the table by its `TABLE_ORDER`; the other modules are helpers. A bench module that fails to
   import becomes a row carrying its error; a case whose setup or kernel fails becomes a row too:
   one broken kernel never hides the others.
3. Per case: build the inputs once, run kernel and peer once (compilation, autotuning), then time
   both (median, CUDA events), and report time, achieved TB/s and TFLOP/s, the fraction of the
   relevant ceiling (copy bandwidth for memory-bound cases, the matmul rate for compute-bound ones)
   and the peer's time over the kernel's.

Correctness is the conformance suite's business, not this runner's. Not a bench module (no OPS).
"""

from __future__ import annotations

import ast
import datetime
import gc
import importlib
import importlib.util
import json
import math
import platform
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from deepinfer.discovery import module_names
from deepinfer.errors import UserError

PACKAGE = "deepinfer_cuda.bench"
COPY_BYTES = 2 << 30  # 2 GiB copied: 4 GiB moved
MATMUL_N = 8192


@dataclass
class Ceilings:
    copy_tbs: float  # TB/s, bytes read + written
    matmul_tflops: float  # bf16, cuBLAS through torch.matmul
    copy_how: str = f"device-to-device copy of {COPY_BYTES >> 30} GiB, bytes read + written"
    matmul_how: str = f"bf16 torch.matmul {MATMUL_N}^3 (cuBLAS)"


@dataclass
class Row:
    op: str
    case: str
    status: str = "ok"  # ok | error
    bound: str = "memory"
    kernel_ms: float | None = None
    tbs: float | None = None
    tflops: float | None = None
    fraction: float | None = None  # of the relevant ceiling
    ceiling: str | None = None  # "copy" | "matmul"
    peer_name: str | None = None
    peer_ms: float | None = None
    speedup: float | None = None  # peer_ms / kernel_ms
    timing: str = "stream"  # "stream": each call timed on the stream; "graph": from a CUDA graph replay
    bytes: float | None = None
    flops: float | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Machine, timing, ceilings


def _default_timer(fn: Callable[[], Any]) -> float:
    from deepinfer_cuda.bench.common import time_ms

    return time_ms(fn)


GRAPH_CALLS = 20  # calls captured in one CUDA graph for graph-timed cases


def graph_time_ms(fn: Callable[[], Any]) -> float:
    """Milliseconds per call with `GRAPH_CALLS` calls captured in one CUDA graph, so that host launch
    overhead is out of the figure (decode-sized calls are otherwise launch-bound). The inputs stay in
    L2 between the calls of one replay, as they would when the previous kernel of a decode step wrote them."""
    from deepinfer_cuda.bench.common import time_ms

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm: compilation and allocator pools outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    torch.cuda.synchronize()
    ms = time_ms(graph.replay) / GRAPH_CALLS
    del graph
    return ms


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()  # tensors held in reference cycles (a case's closures) go before the cache is emptied
        torch.cuda.empty_cache()


def measure_copy_tbs(device: torch.device, timer: Callable[[Callable[[], Any]], float]) -> float:
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * COPY_BYTES / (ms * 1e-3) / 1e12


def measure_matmul_tflops(device: torch.device, timer: Callable[[Callable[[], Any]], float]) -> float:
    n = MATMUL_N
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    ms = timer(lambda: torch.matmul(a, b, out=c))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "device": str(device),
        "argv": list(sys.argv),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as exc:  # the runner reports, it does not need triton itself
        info["triton"] = f"unavailable ({type(exc).__name__})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["capability"] = f"{props.major}.{props.minor}"
        info["multiprocessors"] = props.multi_processor_count
        info["memory_gib"] = round(props.total_memory / 2**30, 1)
    else:
        info["gpu"] = None
    return info


# ---------------------------------------------------------------------------------------------
# Cases


@dataclass
class ModuleFailure:
    """A bench module that could not be loaded, as a row, and the ops it declares (None: unknown)."""

    row: Row
    covers: tuple[str, ...] | None

    def concerns(self, ops: set[str] | None) -> bool:
        """Shown under an --op filter when the module benches one of those ops, or nobody knows what it benches."""
        return ops is None or self.covers is None or bool(set(self.covers) & ops)


def load_cases(modules: Iterable[str] | None = None, package: str = PACKAGE) -> tuple[list[Any], list[ModuleFailure]]:
    """The CASES of the bench modules, module after module in TABLE_ORDER (then in the order found).

    `modules` None: every module of `package`, found by iterating it (a new bench module touches no
    list); those that declare no `OPS` are helpers (this runner, common, compile_check) and are left
    out. Named `modules`: each must be a bench module. A bench module that fails to import, or has no
    CASES list, becomes a ModuleFailure (a discovered module that fails to import counts as a bench
    module when its source assigns OPS or cannot be read: `declared_ops`).
    """
    discovered = modules is None
    names = module_names(package) if discovered else list(modules)
    found: list[tuple[float, int, list[Any]]] = []
    failures: list[ModuleFailure] = []
    for position, name in enumerate(names):
        try:
            module = importlib.import_module(f"{package}.{name}")
        except Exception as exc:  # SyntaxError, ImportError: reported, never fatal
            may_bench, covers = declared_ops(package, name)
            if may_bench or not discovered:
                failures.append(ModuleFailure(_error_row(name, exc), covers))
            continue
        if discovered and not hasattr(module, "OPS"):
            continue  # a helper module
        try:
            cases = list(getattr(module, "CASES"))
        except Exception as exc:  # a missing CASES
            failures.append(ModuleFailure(_error_row(name, exc), getattr(module, "OPS", None)))
            continue
        found.append((getattr(module, "TABLE_ORDER", math.inf), position, cases))
    found.sort(key=lambda entry: entry[:2])
    return [case for _, _, cases in found for case in cases], failures


def declared_ops(package: str, name: str) -> tuple[bool, tuple[str, ...] | None]:
    """What a module that failed to import declares, read from its source without running it:
    (whether it may be a bench module: it assigns `OPS`, or its source cannot be read or parsed;
    the ops of its `OPS` literal, None where unknown)."""
    try:
        spec = importlib.util.find_spec(f"{package}.{name}")
        tree = ast.parse(Path(spec.origin).read_text())
    except Exception:  # no spec, no file, a SyntaxError
        return True, None
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "OPS" for t in targets):
            try:
                return True, tuple(ast.literal_eval(value))
            except Exception:  # not a literal (or not a sequence of names)
                return True, None
    return False, None


def _error_row(name: str, exc: Exception) -> Row:
    return Row(op=f"({name})", case="import", status="error", error=f"{type(exc).__name__}: {exc}".splitlines()[0])


def _rate(amount: float | None, ms: float | None, unit: float) -> float | None:
    if amount is None or ms is None or ms <= 0 or not math.isfinite(ms):
        return None
    return amount / (ms * 1e-3) / unit


def _timed(fn: Callable[[], Any], row: Row, who: str, timer, graph_timer) -> float:
    if row.timing == "graph":
        try:
            return float(graph_timer(fn))
        except Exception as exc:  # capture refused (a host sync in the op, say): time it on the stream
            row.notes.append(f"{who}: CUDA graph timing failed ({type(exc).__name__}: {exc}); timed on the stream".splitlines()[0])
            row.timing = "stream"  # the peer too, so both are timed alike
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    return float(timer(fn))


def bench_case(
    case: Any,
    device: torch.device,
    ceilings: Ceilings,
    timer: Callable[[Callable[[], Any]], float],
    graph_timer: Callable[[Callable[[], Any]], float] = graph_time_ms,
) -> Row:
    row = Row(op=case.op, case=case.name, bound=getattr(case, "bound", "memory"), peer_name=case.peer_name if case.peer is not None else None)
    row.timing = "graph" if getattr(case, "graph", False) else "stream"
    state = None
    try:
        stage = "setup"
        state = case.setup(device)
        stage = "first run"
        case.kernel(state)
        _sync(device)
        stage = "timing"
        row.kernel_ms = _timed(lambda: case.kernel(state), row, "kernel", timer, graph_timer)
        stage = "work count"
        row.bytes = float(case.bytes(state))
        row.flops = float(case.flops(state))
    except Exception as exc:
        row.status = "error"
        row.error = f"{stage}: {type(exc).__name__}: {exc}".splitlines()[0]
        row.notes.append(traceback.format_exc(limit=6))
        state = None
        _free(device)
        return row
    row.tbs = _rate(row.bytes, row.kernel_ms, 1e12)
    row.tflops = _rate(row.flops, row.kernel_ms, 1e12)
    if row.bound == "compute":
        row.ceiling = "matmul"
        row.fraction = row.tflops / ceilings.matmul_tflops if row.tflops is not None and ceilings.matmul_tflops > 0 else None
    else:
        row.ceiling = "copy"
        row.fraction = row.tbs / ceilings.copy_tbs if row.tbs is not None and ceilings.copy_tbs > 0 else None
    if case.peer is not None:
        try:
            case.peer(state)
            _sync(device)
            row.peer_ms = _timed(lambda: case.peer(state), row, "peer", timer, graph_timer)
            row.speedup = row.peer_ms / row.kernel_ms if row.kernel_ms else None
        except Exception as exc:  # a peer that cannot run (OOM, missing torch op) is a note, not an error
            row.notes.append(f"peer failed: {type(exc).__name__}: {exc}".splitlines()[0])
    state = None
    _free(device)
    return row


# ---------------------------------------------------------------------------------------------
# Report


COLUMNS = ("op", "case", "kernel ms", "TB/s", "TFLOP/s", "% ceiling", "peer", "peer ms", "speedup")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_row(row: Row) -> list[str]:
    if row.status != "ok":
        return [row.op, row.case, "ERROR", "", "", "", "", "", row.error or ""]
    pct = "-" if row.fraction is None else f"{100 * row.fraction:.1f}% {row.ceiling}"
    return [
        row.op,
        row.case + (" (graph)" if row.timing == "graph" else ""),
        _fmt(row.kernel_ms, ".4f"),
        _fmt(row.tbs, ".3f"),
        _fmt(row.tflops, ".1f"),
        pct,
        row.peer_name or "-",
        _fmt(row.peer_ms, ".4f"),
        "-" if row.speedup is None else f"{row.speedup:.2f}x",
    ]


def format_table(rows: list[Row]) -> str:
    cells = [list(COLUMNS)] + [format_row(r) for r in rows]
    # The last column of an error row holds the message: let it run past the column width.
    widths = [max(len(c[i]) for c in cells if not (c[2] == "ERROR" and i == len(COLUMNS) - 1)) for i in range(len(COLUMNS))]
    right = {2, 3, 4, 5, 7, 8}
    lines = []
    for n, c in enumerate(cells):
        parts = [c[i].rjust(widths[i]) if i in right and c[2] != "ERROR" else c[i].ljust(widths[i]) for i in range(len(COLUMNS))]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_ceilings(c: Ceilings) -> str:
    return f"ceilings: copy {c.copy_tbs:.3f} TB/s ({c.copy_how}); matmul {c.matmul_tflops:.1f} TFLOP/s ({c.matmul_how})"


def report(machine: dict, ceilings: Ceilings, rows: list[Row]) -> dict:
    return {
        "machine": machine,
        "ceilings": {"copy_tbs": ceilings.copy_tbs, "copy_how": ceilings.copy_how, "matmul_tflops": ceilings.matmul_tflops, "matmul_how": ceilings.matmul_how},
        "results": [{k: v for k, v in r.__dict__.items()} for r in rows],
    }


def _plot_module():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise UserError(f"--plot needs matplotlib ({exc}); install it (pip install matplotlib) or leave --plot out")
    return plt


def write_plot(plt, path: Path, machine: dict, rows: list[Row]) -> None:
    shown = [r for r in rows if r.status == "ok" and r.fraction is not None]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(shown) + 2), 5))
    labels = [f"{r.op}\n{r.case}" for r in shown]
    values = [100 * r.fraction for r in shown]
    colors = ["tab:blue" if r.ceiling == "copy" else "tab:orange" for r in shown]
    ax.bar(range(len(shown)), values, color=colors)
    ax.axhline(100, color="black", linewidth=0.8)
    ax.set_ylim(0, max([105.0] + [v + 5 for v in values]))
    ax.set_xticks(range(len(shown)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("% of ceiling")
    ax.bar([], [], color="tab:blue", label="memory-bound: % of copy bandwidth")
    ax.bar([], [], color="tab:orange", label="compute-bound: % of bf16 matmul rate")
    ax.legend(loc="lower right", fontsize=7)
    ax.set_title(f"deepinfer cuda kernels on {machine.get('gpu') or machine.get('device')} ({machine.get('date', '')[:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Entry point


def run(
    ops: list[str] | None = None,
    json_path: Path | str | None = None,
    plot_path: Path | str | None = None,
    *,
    device: torch.device | str | None = None,
    modules: Iterable[str] | None = None,
    package: str = PACKAGE,
    timer: Callable[[Callable[[], Any]], float] | None = None,
    graph_timer: Callable[[Callable[[], Any]], float] | None = None,
    out: Callable[[str], None] = print,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Measure ceilings and every (filtered) case; print the table; write JSON/plot. Returns the report."""
    from deepinfer.registry import all_ops

    known_ops = set(all_ops())
    wanted = set(ops) if ops else None
    if wanted is not None and wanted - known_ops:
        raise UserError(f"unknown op(s) {', '.join(sorted(wanted - known_ops))}; ops: {', '.join(sorted(known_ops))}")
    json_path = Path(json_path) if json_path is not None else None
    plot_path = Path(plot_path) if plot_path is not None else None
    for p in (json_path, plot_path):
        if p is not None and not p.parent.exists():
            raise UserError(f"cannot write {p}: folder {p.parent} does not exist")
    plt = _plot_module() if plot_path is not None else None  # fail before the long part
    if device is None:
        if not torch.cuda.is_available():
            raise UserError("the cuda benchmarks need an NVIDIA GPU, and torch sees none (torch.cuda.is_available() is False)")
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    timer = timer or _default_timer
    progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))

    cases, failures = load_cases(modules, package)
    selected = [c for c in cases if wanted is None or c.op in wanted]
    rows: list[Row] = [f.row for f in failures if f.concerns(wanted)]
    uncovered = sorted((wanted or set()) - {c.op for c in cases})

    machine = machine_info(device)
    out(f"machine: {machine.get('gpu') or device}, torch {machine['torch']}, triton {machine['triton']}, {machine['date']}")
    measured = {}
    for key, measure in (("copy_tbs", measure_copy_tbs), ("matmul_tflops", measure_matmul_tflops)):
        try:
            measured[key] = float(measure(device, timer))
        except Exception as exc:  # no ceiling: rates are still reported, fractions are not
            measured[key] = float("nan")
            out(f"note: measuring the {key} ceiling failed: {type(exc).__name__}: {exc}".splitlines()[0])
        _free(device)
    ceilings = Ceilings(**measured)
    out(format_ceilings(ceilings))
    for n, case in enumerate(selected, 1):
        progress(f"[{n}/{len(selected)}] {case.op} {case.name}")
        rows.append(bench_case(case, device, ceilings, timer, graph_timer or graph_time_ms))
    out(format_table(rows))
    for op_name in uncovered:
        out(f"note: no benchmark case covers op {op_name}")
    for r in rows:
        for note in r.notes:
            if not note.startswith("Traceback"):
                out(f"note: {r.op}/{r.case}: {note}")
    result = report(machine, ceilings, rows)
    result["uncovered_ops"] = uncovered
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=1, default=str))
        out(f"wrote {json_path}")
    if plot_path is not None:
        write_plot(plt, plot_path, machine, rows)
        out(f"wrote {plot_path}")
    return result
