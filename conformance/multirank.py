"""Multi-rank conformance: the golden dispatch/combine cases split across an expert-parallel group.

    python -m deepinfer_conformance.multirank --backend reference --ep 2
    python -m deepinfer_conformance.multirank --backend cuda --ep 2 --interpret [--op combine] [--case t1_k8_e16_d96]
    python -m deepinfer_conformance.multirank --backend cuda --ep 2 --ep-path nccl   # GPU: force one EP path

The parent starts `--ep` rank processes on this host with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR=127.0.0.1, a free MASTER_PORT), so `deepinfer.distributed.init_distributed`
forms the group exactly as under torchrun: gloo for CPU tensors (the reference backend, or any
backend under --interpret), NCCL / HCCL on devices. Each rank resolves the backend's kernels with
ep_size = --ep (so the EP kernels are chosen), takes its contiguous slice of each case's tokens
(torch.tensor_split: ranks may get no tokens, e.g. the one-token cases) and runs them with an
`ExpertParallel` over the group:

- dispatch: each rank's outputs (received rows, offsets over its local experts, row_of_slot in its
  send layout) are reassembled into the one-rank layout (rows and offsets concatenated in rank
  order; each slot's send-layout row mapped to its global row) and compared EXACTLY with the
  golden outputs.
- combine: each rank dispatches its slice of the case's routing over the group (the routing is
  rebuilt from the case's recipe and checked against the stored row_of_slot), takes the golden
  expert_out rows of its own experts as its experts' results (and its tokens' rows of `add`, where
  the case has one), and combines; the ranks' outputs, concatenated, are compared with the golden
  output within the op's tolerance.

`--ep-path nccl|symm` passes the backend option ep_path to the ranks (`--backend-option KEY=VALUE`
any other): which of a backend's EP implementations the registry picks (the cuda backend:
all_to_all_single over NCCL, or symmetric memory on one host, which is the default where it
applies); run both to check both. A forced path that cannot run fails the run with its reason.

The table has the single-rank runner's columns (backend shown as "<backend> ep<N>"). Exit status 0
when every case passes. A rank that fails, hangs past --timeout in a collective, or never starts
fails the run with its message; no run hangs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from deepinfer.errors import UserError
from deepinfer.options import parse_assignments
from deepinfer_conformance.golden_io import GOLDEN_DIR, CaseRecord, GoldenTensors, read_cases
from deepinfer_conformance.runner import Row, format_table, measure_case, summary, write_json

OPS = ("dispatch", "combine")
DEFAULT_TIMEOUT_S = 60.0


def token_slices(tokens: int, ranks: int) -> list[tuple[int, int]]:
    """Rank r's tokens [start, end): torch.tensor_split's contiguous, near-equal split."""
    sizes = [len(p) for p in torch.tensor_split(torch.arange(tokens), ranks)]
    starts = [sum(sizes[:r]) for r in range(ranks)]
    return [(s, s + n) for s, n in zip(starts, sizes)]


def expert_offsets(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The one-rank dispatch's expert_offsets [E + 1] (int64) for a routing."""
    counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=num_experts)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def combine_routing(case: CaseRecord, row_of_slot: torch.Tensor, top_k: int, ranks: int) -> tuple[torch.Tensor, int, str]:
    """(topk_ids [T, K], num_experts, how) for a combine case: the case's routing, rebuilt from its
    recipe (the first draw of its seeded generator) and checked against the stored row_of_slot.
    Should the recipe not reproduce it, every slot becomes its own expert (slot s -> expert
    row_of_slot[s]), a routing whose dispatch layout is exactly the stored one."""
    from deepinfer_conformance.cases import moe as moe_cases

    recipe = dict(moe_cases.COMBINE_RECIPES).get(case.name)
    if isinstance(recipe, partial) and {"tokens", "experts", "top_k"} <= set(recipe.keywords):
        kw = recipe.keywords
        gen = torch.Generator().manual_seed(case.seed)
        ids = moe_cases.routing(gen, kw["tokens"], kw["experts"], kw["top_k"], kw.get("pattern", "random"))
        if ids.numel() == row_of_slot.numel() and torch.equal(moe_cases.slot_rows(ids), row_of_slot.to(torch.int32)):
            return ids, int(kw["experts"]), "recipe routing"
    slots = row_of_slot.numel()
    experts = max(ranks, -(-slots // ranks) * ranks)
    return row_of_slot.to(torch.int32).view(-1, top_k), experts, "one expert per row"


# ---------------------------------------------------------------------------------------------
# one rank


def rank_main(backend: str, out_dir: Path, golden_dir: Path, interpret: bool, ops: list[str], names: list[str] | None, timeout_s: float,
              options: dict[str, str] | None = None) -> int:
    from deepinfer.distributed import DistributedError, ExpertParallel, destroy_distributed, init_distributed
    from deepinfer.plugins import load_plugins
    from deepinfer.registry import ResolveContext

    plugins = load_plugins()
    spec = plugins.require(backend, interpret=interpret)
    options = spec.resolve_options(options)
    dist_ctx = init_distributed(timeout_s, device=spec.device(interpret))
    if dist_ctx is None:
        raise UserError("multirank worker started without WORLD_SIZE > 1")
    rank, ranks, device = dist_ctx.rank, dist_ctx.world_size, dist_ctx.device
    registry = plugins.registry(backend, interpret=interpret, options=options)
    golden = GoldenTensors(golden_dir)
    outputs: dict[str, torch.Tensor] = {}
    results: dict[str, dict] = {}
    broken = None
    for case in select_cases(golden_dir, ops, names):
        if broken is not None:
            results[case.id] = {"status": "error", "error": f"not run: the group failed in {broken}"}
            continue
        ctx = ResolveContext(backend=backend, device=device, dtype=case.torch_dtype, ep_size=ranks, options=options)
        kernels = {op: registry.choose(ctx, op) for op in ({"dispatch"} | {case.op})}  # a forced path that cannot run: one line
        missing = [op for op, k in kernels.items() if k is None]
        if missing:
            results[case.id] = {"status": "missing", "error": f"no {backend} kernel for {', '.join(missing)} in {case.dtype} at ep_size {ranks}"}
            continue
        inputs = golden.inputs(case)
        start = time.perf_counter()
        try:
            if case.op == "dispatch":
                ids, experts = inputs["topk_ids"], case.params["num_experts"]
            else:
                ids, experts, how = combine_routing(case, inputs["row_of_slot"], inputs["topk_weights"].shape[1], ranks)
            if experts % ranks:
                results[case.id] = {"status": "skip", "error": f"{experts} experts do not shard over {ranks} ranks"}
                continue
            ep = ExpertParallel(dist_ctx.group, experts, timeout_s=timeout_s)
            a, b = token_slices(ids.shape[0], ranks)[rank]
            ids_r = ids[a:b].to(device)
            if case.op == "dispatch":
                expert_x, offsets_r, row_of_slot_r = kernels["dispatch"].fn(inputs["x"][a:b].to(device), ids_r, num_experts=experts, ep_group=ep)
                produced = (expert_x[: int(offsets_r[-1])], offsets_r, row_of_slot_r)  # rows past the last offset: padding
                names_out = ("expert_x", "expert_offsets", "row_of_slot")
                note = kernels["dispatch"].note
            else:
                dummy = torch.zeros(b - a, 1, dtype=case.torch_dtype, device=device)
                _, offsets_r, row_of_slot_r = kernels["dispatch"].fn(dummy, ids_r, num_experts=experts, ep_group=ep)
                bounds = expert_offsets(ids, experts)
                lo, hi = int(bounds[rank * ep.experts_per_rank]), int(bounds[(rank + 1) * ep.experts_per_rank])
                if int(offsets_r[-1]) != hi - lo:
                    raise AssertionError(f"dispatch delivered {int(offsets_r[-1])} rows to rank {rank}, its experts have {hi - lo}")
                expert_out = inputs["expert_out"][lo:hi].to(device)
                add = {"add": inputs["add"][a:b].to(device)} if "add" in inputs else {}
                produced = (kernels["combine"].fn(expert_out, inputs["topk_weights"][a:b].to(device), row_of_slot_r, ep_group=ep, **add),)
                names_out = ("out",)
                note = f"{kernels['combine'].note}; {how}"
            if case.op == "combine" and ep.pending:
                raise AssertionError(f"{ep.pending} dispatch exchange(s) left without their combine")
            if device.type != "cpu":
                getattr(torch, device.type).synchronize()
        except DistributedError as exc:
            broken = case.id
            results[case.id] = {"status": "error", "error": str(exc)}
            continue
        except Exception as exc:
            last = traceback.extract_tb(exc.__traceback__)[-1]
            results[case.id] = {"status": "error", "error": f"{type(exc).__name__}: {exc} ({Path(last.filename).name}:{last.lineno})"}
            continue
        for name, value in zip(names_out, produced):
            outputs[f"{case.id}::{name}"] = value.detach().to("cpu").contiguous()
        results[case.id] = {"status": "ran", "note": note, "seconds": round(time.perf_counter() - start, 4), "experts": experts}
    save_file(outputs, str(out_dir / f"rank{rank}.safetensors"))
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "ranks": ranks, "cases": results}, indent=1))
    if broken is None:
        destroy_distributed()
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(3)  # a failed collective can leave the group unable to shut down cleanly


def select_cases(golden_dir: Path, ops: list[str], names: list[str] | None) -> list[CaseRecord]:
    cases = [c for c in read_cases(golden_dir) if c.op in ops and (not names or c.name in names)]
    if not cases:
        raise UserError(f"no golden cases for op(s) {', '.join(ops)}" + (f" named {', '.join(names)}" if names else ""))
    return cases


# ---------------------------------------------------------------------------------------------
# the parent: start the ranks, reassemble, compare


def launch_ranks(argv: list[str], ranks: int, *, env: dict[str, str] | None = None, wall_s: float = 600.0) -> list[tuple[int, str]]:
    """Start `ranks` processes `python -m deepinfer_conformance.multirank <argv>` with torchrun's
    environment on 127.0.0.1; return (exit code, stderr) per rank. Ranks still running `wall_s`
    seconds after the start are killed (exit code -9)."""
    from deepinfer.distributed import free_port, rank_env

    port = free_port()
    procs = []
    for rank in range(ranks):
        rank_environ = {**os.environ, **(env or {}), **rank_env(rank, ranks, port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "deepinfer_conformance.multirank", *argv],
                                      env=rank_environ, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + wall_s
    results = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        results.append((p.returncode, err))
    return results


def run(backend: str, ranks: int, *, interpret: bool = False, ops: list[str] | None = None, names: list[str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S, golden_dir: Path = GOLDEN_DIR, ep_path: str | None = None,
        options: dict[str, str] | None = None) -> list[Row]:
    """Run the golden dispatch/combine cases split over `ranks` ranks; one Row per case.
    ep_path: the backend option ep_path for the ranks (None: its default); options: other backend options."""
    if ranks < 2:
        raise UserError("--ep must be at least 2 (the single-rank runner covers one rank)")
    ops = [op for op in OPS if not ops or op in ops]
    cases = select_cases(golden_dir, ops, names)
    label = f"{backend} ep{ranks}" + (f" {ep_path}" if ep_path else "")
    with tempfile.TemporaryDirectory(prefix="deepinfer-multirank-") as tmp:
        out_dir = Path(tmp)
        argv = ["--rank-worker", "--backend", backend, "--out", str(out_dir), "--golden", str(golden_dir), "--timeout", str(timeout_s)]
        argv += ["--interpret"] if interpret else []
        for op in ops:
            argv += ["--op", op]
        for name in names or []:
            argv += ["--case", name]
        options = {**(options or {}), **({"ep_path": ep_path} if ep_path else {})}
        for name, value in options.items():
            argv += ["--backend-option", f"{name}={value}"]
        env = {"TRITON_INTERPRET": "1"} if interpret else {}
        exits = launch_ranks(argv, ranks, env=env, wall_s=timeout_s * 2 + 30 * len(cases))
        reports, failed = {}, []
        for rank, (code, err) in enumerate(exits):
            path = out_dir / f"rank{rank}.json"
            if not path.is_file():
                lines = [l for l in err.strip().splitlines() if l.strip()]
                failed.append((rank, lines[-1].removeprefix("deepinfer: error: ") if lines else f"exit code {code}"))
                continue
            reports[rank] = (json.loads(path.read_text())["cases"], load_file(str(out_dir / f"rank{rank}.safetensors")))
        if failed:
            raise UserError(ranks_failed_message(backend, ranks, failed))
        golden = GoldenTensors(golden_dir)
        return [compare_case(case, reports, golden, label, ranks) for case in cases]


def ranks_failed_message(backend: str, ranks: int, failed: list[tuple[int, str]]) -> str:
    """One line for the ranks that wrote no report: each distinct error once, with the ranks that gave
    it. An error that already names the backend ("backend 'x' is not available: ...") is said as it
    is; otherwise the line starts with "backend 'x' at ep N:"."""
    by_error: dict[str, list[int]] = {}
    for rank, error in failed:
        by_error.setdefault(error, []).append(rank)
    named = f"backend {backend!r} "
    parts = []
    for error, which in by_error.items():
        who = f"rank{'s' if len(which) > 1 else ''} {', '.join(map(str, which))}"
        parts.append(f"{error} (at ep {ranks}: {who} wrote no report)" if error.startswith(named) else f"{who} wrote no report ({error})")
    line = "; ".join(parts)
    return line if any(error.startswith(named) for error in by_error) else f"backend {backend!r} at ep {ranks}: {line}"


def compare_case(case: CaseRecord, reports: dict, golden: GoldenTensors, label: str, ranks: int) -> Row:
    statuses = [reports[r][0].get(case.id, {"status": "missing", "error": "not run"}) for r in range(ranks)]
    bad = next((s for s in statuses if s["status"] != "ran"), None)
    if bad is not None:
        return Row(case.id, case.op, case.name, case.dtype, label, bad["status"], None, bad.get("error", ""))
    names = ("expert_x", "expert_offsets", "row_of_slot") if case.op == "dispatch" else ("out",)
    parts = {name: [reports[r][1][f"{case.id}::{name}"] for r in range(ranks)] for name in names}
    inputs = golden.inputs(case)
    try:
        produced = reassemble_dispatch(parts, inputs["topk_ids"], statuses[0]["experts"], ranks) if case.op == "dispatch" else {"out": torch.cat(parts["out"])}
    except Exception as exc:  # a rank's outputs that do not fit together (wrong shapes, counts)
        return Row(case.id, case.op, case.name, case.dtype, label, "FAIL", float("inf"), f"cannot reassemble: {type(exc).__name__}: {exc}")
    m = measure_case(case, produced, golden.outputs(case))
    return Row(case.id, case.op, case.name, case.dtype, label, "pass" if m.ok else "FAIL", m.score, m.detail)


def reassemble_dispatch(parts: dict[str, list[torch.Tensor]], topk_ids: torch.Tensor, experts: int, ranks: int) -> dict[str, torch.Tensor]:
    """The one-rank dispatch layout from the ranks' outputs.

    Rank r's expert_x holds global rows of its experts in order, so expert_x and expert_offsets
    concatenate; slot s of rank r (expert e, row p in r's send layout, which starts expert e at
    send_offsets_r[e]) is global row offsets[e] + (rows of e sent by ranks before r) + (p - send_offsets_r[e]).
    """
    per_rank = experts // ranks
    bases = [0]
    for x in parts["expert_x"]:
        bases.append(bases[-1] + x.shape[0])
    pieces = [torch.zeros(1, dtype=torch.int32)]
    for r, off in enumerate(parts["expert_offsets"]):
        if off.shape != (per_rank + 1,) or int(off[-1]) != parts["expert_x"][r].shape[0]:
            end = int(off[-1]) if off.numel() else "-"
            raise ValueError(f"rank {r}: expert_offsets {tuple(off.shape)} ending at {end} for {parts['expert_x'][r].shape[0]} rows")
        pieces.append(off[1:] + bases[r])
    offsets = torch.cat(pieces).to(torch.int32)
    row_of_slot = torch.empty(topk_ids.numel(), dtype=torch.int64)
    sent_before = torch.zeros(experts, dtype=torch.int64)
    for r, (a, b) in enumerate(token_slices(topk_ids.shape[0], ranks)):
        ids_r = topk_ids[a:b].reshape(-1).long()
        send_offsets = expert_offsets(topk_ids[a:b], experts)
        local = parts["row_of_slot"][r].long()
        if local.shape != ids_r.shape:
            raise ValueError(f"rank {r}: row_of_slot has shape {tuple(local.shape)}, its slots are {tuple(ids_r.shape)}")
        row_of_slot[a * topk_ids.shape[1]: b * topk_ids.shape[1]] = offsets[ids_r].long() + sent_before[ids_r] + local - send_offsets[ids_r]
        sent_before += send_offsets[1:] - send_offsets[:-1]
    return {"expert_x": torch.cat(parts["expert_x"]), "expert_offsets": offsets, "row_of_slot": row_of_slot.to(parts["row_of_slot"][0].dtype)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepinfer_conformance.multirank", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--ep", type=int, default=2, help="ranks in the expert-parallel group (default 2)")
    parser.add_argument("--interpret", action="store_true", help="run the backend's Triton kernels under TRITON_INTERPRET=1 on the CPU (gloo)")
    parser.add_argument("--op", action="append", choices=OPS, default=None)
    parser.add_argument("--case", action="append", default=None, help="only cases of this name (e.g. t1_k8_e16_d96)")
    parser.add_argument("--ep-path", choices=("auto", "nccl", "symm"), default=None,
                        help="which EP implementation the ranks use (backend option ep_path): "
                             "nccl = all_to_all_single, symm = symmetric memory (cuda, one host)")
    parser.add_argument("--backend-option", action="append", default=None, metavar="KEY=VALUE", help="a backend option for the ranks (repeatable)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds a rank waits in a collective or at the rendezvous")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    parser.add_argument("--golden", type=Path, default=GOLDEN_DIR)
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.rank_worker:
            return rank_main(args.backend, args.out, args.golden, args.interpret, args.op or list(OPS), args.case, args.timeout,
                             parse_assignments(args.backend_option))
        rows = run(args.backend, args.ep, interpret=args.interpret, ops=args.op, names=args.case, timeout_s=args.timeout, golden_dir=args.golden,
                   ep_path=args.ep_path, options=parse_assignments(args.backend_option))
    except UserError as exc:
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(format_table(rows))
    text, _ = summary(rows)
    ok = all(r.status in ("pass", "skip") for r in rows)  # skip: the case's experts do not shard over --ep
    print(text)
    if args.json:
        write_json(rows, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
