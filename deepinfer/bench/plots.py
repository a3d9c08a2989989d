"""PNG plots of benchmark files (matplotlib, an optional dependency: `pip install 'deepinfer[plots]'`),
drawn on any machine from the JSON the benchmarks write (the GPU machine need not have matplotlib):

- a `bench throughput` / `bench sweep` file: output tokens/s against time per output token, one
  point per concurrency (labelled), one line per (input, output) length pair, the Pareto front marked;
- a `bench e2e` file: decode step time against the HBM floor (the bytes a step must read at copy
  bandwidth) per batch size, with the share of the floor reached;
- a `bench serve` file: TTFT and TPOT (median and p99) against the achieved request throughput, one
  point per request rate (labelled);
- a `bench structured` file: the grammar-mask fill per step against batch size, and output tokens/s
  with 0/50/100% of the batch constrained.
"""

from __future__ import annotations

import json
from pathlib import Path

from deepinfer.errors import UserError


def require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise UserError("plots need matplotlib: pip install 'deepinfer[plots]' (or run `deepinfer bench plot FILE` where it is installed)") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def kind_of(data: dict, path: Path) -> str:
    if data.get("kind") in ("throughput", "serve", "structured"):
        return data["kind"]
    results = data.get("results")
    if isinstance(results, list) and results and isinstance(results[0], dict) and "deepinfer_step_ms" in results[0]:
        return "e2e"
    raise UserError(f"{path} is neither a `bench throughput`/`sweep`, a `bench serve` nor a `bench e2e` --json file")


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both (lower latency x, higher throughput y), by x."""
    front, best = [], float("-inf")
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if y > best:
            front.append((x, y))
            best = y
    return front


def plot_throughput(data: dict, out: Path) -> Path:
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups: dict[tuple, list] = {}
    for r in data["results"]:
        if r["tpot_ms"]["mean"] is not None:
            groups.setdefault((round(r["input_len"]), round(r["output_len"])), []).append(r)
    everything = []
    for (inp, outp), rows in sorted(groups.items()):
        rows.sort(key=lambda r: r["concurrency"])
        xs, ys = [r["tpot_ms"]["mean"] for r in rows], [r["output_tokens_per_s"] for r in rows]
        everything += list(zip(xs, ys))
        ax.plot(xs, ys, marker="o", label=f"in {inp} / out {outp}")
        for r, x, y in zip(rows, xs, ys):
            ax.annotate(str(r["concurrency"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if everything:
        fx, fy = zip(*pareto(everything))
        ax.plot(fx, fy, linestyle="--", color="grey", label="Pareto front")
    return _finish(plt, fig, ax, data, "time per output token (ms, mean)", "output tokens/s", "throughput vs per-token latency (labels: concurrency)", out)


def plot_e2e(data: dict, out: Path) -> Path:
    plt = require_matplotlib()
    rows = sorted(data["results"], key=lambda r: r["batch"])
    batches = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(batches, [r["deepinfer_step_ms"] for r in rows], marker="o", label="decode step")
    ax.plot(batches, [r["floor_ms"] for r in rows], marker="s", linestyle="--", label="HBM floor")
    for r in rows:
        share = r["floor_ms"] / r["deepinfer_step_ms"]
        ax.annotate(f"{share:.0%}", (r["batch"], r["deepinfer_step_ms"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xscale("log", base=2)
    return _finish(plt, fig, ax, data, "batch (requests)", "ms per decode step", "decode step vs HBM floor (labels: share of the floor)", out)


def plot_serve(data: dict, out: Path) -> Path:
    plt = require_matplotlib()
    rows = [r for r in data["results"] if r["ttft_ms"]["median"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["request_throughput"] for r in rows]
    for metric, style in (("ttft_ms", "o"), ("tpot_ms", "s")):
        for stat, line in (("median", "-"), ("p99", "--")):
            ys = [r[metric][stat] for r in rows]
            if all(y is not None for y in ys):
                ax.plot(xs, ys, marker=style, linestyle=line, label=f"{metric.removesuffix('_ms').upper()} {stat}")
    for r, x in zip(rows, xs):
        ax.annotate(str(r["request_rate"]), (x, r["ttft_ms"]["median"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_yscale("log")
    return _finish(plt, fig, ax, data, "achieved requests/s", "ms", "serving latency vs load (labels: request rate offered)", out)


def plot_structured(data: dict, out: Path) -> Path:
    plt = require_matplotlib()
    fig, (left, ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    masks = sorted(data["mask_fill"], key=lambda m: m["batch"])
    left.plot([m["batch"] for m in masks], [m["ms_per_step"] for m in masks], marker="o", label="mask fill (host)")
    left.set_xscale("log", base=2)
    left.set_xlabel("batch (constrained requests)")
    left.set_ylabel("ms per step (median)")
    left.set_title("grammar mask fill per step")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    runs = data["throughput"]
    if runs:
        labels = [f"{r['constrained']}/{r['batch']}" for r in runs]
        bars = ax.bar(labels, [r["output_tokens_per_s"] for r in runs])
        free = runs[0]["output_tokens_per_s"]
        for bar, r in zip(bars, runs):
            ax.annotate(f"{r['output_tokens_per_s'] / free - 1:+.1%}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)  # fmt: skip
    return _finish(plt, fig, ax, data, "constrained requests / batch", "output tokens/s", "decode throughput (labels: vs free)", out)


def _finish(plt, fig, ax, data: dict, xlabel: str, ylabel: str, what: str, out: Path) -> Path:
    """Labels, a title naming the machine and date of `data`, grid and legend; the PNG written to out."""
    machine = data.get("machine") or {}
    where = " ".join(str(v) for v in (machine.get("gpu") or machine.get("device"), machine.get("backend")) if v)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{what}\n{where} {machine.get('date', '')}".strip())
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_file(path: Path, out_dir: Path) -> Path:
    """The plot of one benchmark file, written to out_dir/<file stem>.png."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    out = out_dir / f"{path.stem}.png"
    return {"throughput": plot_throughput, "serve": plot_serve, "structured": plot_structured, "e2e": plot_e2e}[kind_of(data, path)](data, out)
