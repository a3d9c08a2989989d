"""A sweep of the SM90 Gluon `sparse_attention` kernel over bf16 caches (kernels/sparse_attention_gluon.py): each of its
launch variants timed beside the tl kernel (kernels/sparse_attention.py) and its default configuration at V4-Flash
decode sizes, so that a GPU says which variant the defaults should take. Not a bench module (no OPS): the runner
leaves it out; `deepinfer bench ops` keeps its own rows.

`python -m deepinfer_cuda.bench.sparse_attention_sweep --sweep [VARIANT ...]` on an SM90 GPU (all when none named;
sparse_gluon_bf16 is the one), as `python -m deepinfer_cuda.bench.gemm --sweep` runs the GEMM tiles:
`deepinfer bench compile --arch sm90 --sweep sparse_gluon_bf16` compiles the same launches without a GPU first.

What it runs, and how: bench/v4_attention.py's decode cases (ctx 32k, a window of 128 rows and a top-512 list of 1 KiB
bf16 rows a query, 64 heads of 512; B1, B64, B256), timed as `deepinfer bench ops` times them (a CUDA graph of
runner.GRAPH_CALLS calls, L2 flushed before each replay by the timer), the rate against the copy bandwidth measured
as bench ops measures it (runner.measure_copy_tbs) over the case's bytes (v4_attention's count). Each row: the plan it
ran (splits, tile), microseconds a call, % of copy, and the largest difference of its output from the tl kernel's (a
variant that skipped work would time fast: it shows here). One table at the end.
"""

from __future__ import annotations

import torch

from deepinfer_cuda.bench import v4_attention as v4

# variant -> the Gluon launch's keyword arguments (launch_sparse_attention_gluon: tile_rows, early_release,
# fused_combine, persistent, num_splits); "default" is the kernel as the option runs it. Forced split counts apply to
# every batch (B256 splits too): the table shows what they cost where the plan would not choose them. Ten variants at
# three batches compile 9 Gluon kernels (variants share a kernel where only the grid differs): kept few for a run of
# about two minutes on an H100 with the compiles (an aim: the sweep has not run on a GPU yet).
SWEEP = {
    "sparse_gluon_bf16": {
        "default": {},
        "r32": {"tile_rows": 32},  # 32-row tiles in four stages (the other stage release: bench ops' _late rows)
        "fused": {"fused_combine": True},  # the split partials merged by the kernel's last split (no combine launch)
        "fused_r32": {"tile_rows": 32, "fused_combine": True},
        "splits1": {"num_splits": 1},  # no split: B64 on 64 SMs, no partials, no combine
        "splits4_fused": {"num_splits": 4, "fused_combine": True},
        "splits20_r32_fused": {"tile_rows": 32, "num_splits": 20, "fused_combine": True},  # B1: one 32-row tile a split
        "persistent": {"persistent": True},  # a program an SM over (query, split) items, the loader running on into the next
        "persistent_fused": {"persistent": True, "fused_combine": True},
        "persistent_splits5_fused": {"persistent": True, "num_splits": 5, "fused_combine": True},  # B64: 320 items of 2 tiles
    },
    # the loader's L2 prefetch of the tile two ahead (sparse_attention_gluon.L2_PREFETCH): more of the gather in flight
    # beside the stages' copies; with it the B64 split choices again (two splits fill 128 SMs, one leaves half idle)
    "sparse_gluon_l2": {
        "default": {},
        "l2_prefetch": {"l2_prefetch": True},
        "l2_prefetch_splits1": {"l2_prefetch": True, "num_splits": 1},
        "l2_prefetch_splits2": {"l2_prefetch": True, "num_splits": 2},
        "l2_prefetch_r32": {"l2_prefetch": True, "tile_rows": 32},
    },
}
BATCHES = (1, 64, 256)
CONTEXT = 32768


def case_name(batch: int) -> str:
    return f"decode_B{batch}_ctx{CONTEXT // 1024}k_w128+top512_H64_D512_bf16"


def plan_label(state: dict, launch: dict) -> str:
    """The plan a launch runs on this state: its splits and tile."""
    from deepinfer_cuda.kernels import sparse_attention_gluon

    q = state["q"]
    p = sparse_attention_gluon.plan(q.shape[0], q.shape[1], state["indices"].shape[1], state["extra_indices"].shape[1], q.device,
                                    launch.get("num_splits"), launch.get("tile_rows"))
    label = f"{p.num_splits} split{'s' if p.num_splits > 1 else ''} x {p.block_n} rows/{p.stages} st"
    return label + (", persistent" if launch.get("persistent") else "")


def sweep(device: torch.device, variants=None) -> list[dict]:
    """Every variant of each named sweep at BATCHES, beside the tl kernel; prints one line a row as it goes, then the table."""
    from deepinfer_cuda.bench.common import time_ms
    from deepinfer_cuda.bench.runner import graph_time_ms, measure_copy_tbs

    copy_tbs = measure_copy_tbs(device, time_ms)
    print(f"copy bandwidth {copy_tbs:.3f} TB/s (bytes read + written)", flush=True)
    rows = []
    for name in variants or SWEEP:
        for batch in BATCHES:
            rows += _sweep_batch(name, batch, device, copy_tbs, graph_time_ms)
            torch.cuda.empty_cache()
    print(format_table(rows), flush=True)
    return rows


def _sweep_batch(name: str, batch: int, device: torch.device, copy_tbs: float, timer) -> list[dict]:
    state = v4._sparse_setup(batch, CONTEXT)(device)
    nbytes = v4._sparse_bytes(state)
    want = v4._sparse_kernel(state)  # the tl kernel's output: every row's reference
    torch.cuda.synchronize(device)
    runs = [("tl kernel", "-", v4._sparse_kernel)]
    runs += [(f"gluon {label}", None, v4._sparse_kernel_bf16_gluon(**launch)) for label, launch in SWEEP[name].items()]
    launches = {f"gluon {label}": launch for label, launch in SWEEP[name].items()}
    rows = []
    for label, plan, call in runs:
        row = {"sweep": name, "batch": batch, "variant": label, "plan": plan, "us": None, "copy_pct": None, "max_diff_tl": None, "error": None}
        try:
            if plan is None:
                row["plan"] = plan_label(state, launches[label])
            got = call(state)
            torch.cuda.synchronize(device)
            row["max_diff_tl"] = (got.float() - want.float()).abs().max().item()
            del got
            ms = timer(lambda: call(state))
            row["us"] = ms * 1e3
            row["copy_pct"] = 100.0 * nbytes / (ms * 1e-3) / 1e12 / copy_tbs
        except Exception as exc:  # noqa: BLE001 - a variant that fails is a row, not the end of the sweep
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            torch.cuda.synchronize(device)
        print(f"sweep {name} {case_name(batch)} {_line(row)}", flush=True)
        rows.append(row)
    return rows


def _line(row: dict) -> str:
    if row["error"] is not None:
        return f"{row['variant']:28s} {row['plan'] or '':26s} ERROR {row['error']}"
    return f"{row['variant']:28s} {row['plan']:26s} {row['us']:8.1f} us {row['copy_pct']:6.1f}% copy  max|out - tl| {row['max_diff_tl']:.3g}"


def format_table(rows: list[dict]) -> str:
    """One table: a row per (batch, variant)."""
    head = f"{'batch':>5s}  {'variant':28s} {'plan':26s} {'us':>8s} {'% copy':>7s}  max|out - tl|"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["error"] is not None:
            lines.append(f"{r['batch']:5d}  {r['variant']:28s} {r['plan'] or '':26s} ERROR {r['error']}")
        else:
            lines.append(f"{r['batch']:5d}  {r['variant']:28s} {r['plan']:26s} {r['us']:8.1f} {r['copy_pct']:6.1f}%  {r['max_diff_tl']:.3g}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description="the SM90 Gluon sparse_attention (bf16 caches): its launch variants timed on a GPU")
    p.add_argument("--sweep", nargs="*", default=[], help=f"sweeps to run (all when none named): {', '.join(SWEEP)}")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    unknown = [v for v in args.sweep if v not in SWEEP]
    if unknown:
        p.error(f"unknown sweep(s) {', '.join(unknown)}; known: {', '.join(SWEEP)}")
    rows = sweep(torch.device("cuda"), args.sweep or None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
