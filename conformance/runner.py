"""Run backends over the golden set (each in its own worker process), compare, and report.

For every case and backend: the error against the golden output, as a fraction of the allowed
tolerance (allclose: max |out - ref| / (atol * reduction_length + rtol * |ref|); exact: the number
of differing elements), and pass/fail. With two or more backends, the same measure between each
backend and the first one. A case of a model-specific op the backend has no kernel for is a
"no kernel" row (worker.py): shown, named in the summary, and not a failure.

The cases are the golden set's (the packaged one, or `--golden`) plus those of the installed
out-of-tree case packages, whose goldens the run computes at its start (out_of_tree.py); a case
package that fails to load is an error row, and the other cases still run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from deepinfer.errors import UserError
from deepinfer.registry import EXACT
from deepinfer_conformance.golden_io import GOLDEN_DIR, CaseRecord, GoldenSet, key, read_cases
from deepinfer_conformance.out_of_tree import write_goldens
from deepinfer_conformance.worker import NO_KERNEL


@dataclass
class Measure:
    ok: bool
    score: float  # allclose: worst error over tolerance (<= 1 passes); exact: differing elements
    detail: str


@dataclass
class Row:
    case: str
    op: str
    name: str
    dtype: str
    backend: str
    status: str  # pass | FAIL | missing | no kernel | error
    score: float | None
    detail: str
    versus: str | None = None  # the backend compared against, for cross-backend rows
    cross_score: float | None = None
    cross_ok: bool | None = None


def measure(mode: str, out: torch.Tensor | None, ref: torch.Tensor | None, case: CaseRecord) -> Measure:
    if ref is None or out is None:
        same = ref is None and out is None
        return Measure(same, 0.0 if same else float("inf"), "" if same else "one side returned None")
    if out.shape != ref.shape:
        return Measure(False, float("inf"), f"shape {tuple(out.shape)} != {tuple(ref.shape)}")
    if mode == EXACT or not ref.is_floating_point():
        if out.dtype != ref.dtype:
            return Measure(False, float("inf"), f"dtype {out.dtype} != {ref.dtype}")
        a, b = out.double() if out.is_floating_point() else out, ref.double() if ref.is_floating_point() else ref
        differ = int((a != b).sum()) - (int((torch.isnan(a) & torch.isnan(b)).sum()) if a.is_floating_point() else 0)
        return Measure(differ == 0, float(differ), f"{differ}/{ref.numel()} differ" if differ else "identical")
    a, b = out.double(), ref.double()
    finite = torch.isfinite(b)
    # Non-finite reference values (-inf logits, say) must be matched exactly.
    if not torch.equal(torch.isfinite(a), finite) or not torch.equal(a[~finite], b[~finite]):
        return Measure(False, float("inf"), "non-finite values differ")
    err = (a - b).abs()[finite]
    bound = case.atol_scaled() + case.rtol * b.abs()[finite]
    score = float((err / bound).max()) if err.numel() else 0.0
    rel = float(err.norm() / b[finite].norm().clamp_min(1e-30)) if err.numel() else 0.0
    return Measure(score <= 1.0, score, f"max|err| {float(err.max()) if err.numel() else 0:.3g}, rel {rel:.2g}")


def measure_case(case: CaseRecord, produced: dict[str, torch.Tensor | None], reference: dict[str, torch.Tensor | None]) -> Measure:
    parts = [measure(case.compare[name], produced.get(name), ref, case) for name, ref in reference.items()]
    worst = max(parts, key=lambda m: m.score)
    return Measure(all(p.ok for p in parts), worst.score, worst.detail)


def worker_command(
    backend: str, out_dir: Path, golden_dirs: list[Path], interpret: bool, ops: list[str] | None, options: dict[str, str] | None = None,
    deterministic: bool = False,
):
    """The command line and environment of one backend's worker process."""
    cmd = [sys.executable, "-m", "deepinfer_conformance.worker", "--backend", backend, "--out", str(out_dir)]
    if deterministic:
        cmd.append("--deterministic")
    for folder in golden_dirs:
        cmd += ["--golden", str(folder)]
    if interpret:
        cmd.append("--interpret")
    for op in ops or []:
        cmd += ["--op", op]
    for name, value in (options or {}).items():
        cmd += ["--backend-option", f"{name}={value}"]
    env = dict(os.environ)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return cmd, env


def run_workers(
    backends: list[str], out_dir: Path, golden_dirs: list[Path], interpret: bool, ops: list[str] | None, shares: dict[str, dict[str, str]],
    deterministic: bool = False,
) -> dict[str, dict]:
    """Every backend's worker at once (each its own process, so several cores or devices work
    together); their reports by backend. The first backend (in the given order) whose worker failed
    is a one-line UserError naming it."""
    procs = {}
    for b in backends:
        cmd, env = worker_command(b, out_dir, golden_dirs, interpret, ops, shares[b], deterministic)
        procs[b] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr = {b: proc.communicate()[1] for b, proc in procs.items()}
    for b, proc in procs.items():
        if proc.returncode != 0:
            lines = [line for line in stderr[b].strip().splitlines() if line.strip()]
            message = lines[-1].removeprefix("deepinfer: error: ") if lines else f"worker exited {proc.returncode}"
            raise UserError(message if repr(b) in message else f"backend {b!r}: {message}")  # name it once
    return {b: json.loads((out_dir / f"{b}.json").read_text()) for b in backends}


def load_produced(out_dir: Path, backend: str, case: CaseRecord, status: dict) -> dict[str, torch.Tensor | None]:
    tensors = load_file(str(out_dir / f"{backend}.safetensors"))
    produced: dict[str, torch.Tensor | None] = {n: tensors.get(key(case.id, "out", n)) for n in case.outputs}
    produced.update({n: None for n in status.get("none_outputs", [])})
    return produced


def options_per_backend(backends: list[str], options: dict[str, str] | None) -> dict[str, dict[str, str]]:
    """Each backend's share of `options`: the ones it declares, checked. An option none of the
    backends declares is an error (the comparison needs the same option for each backend that has it)."""
    from deepinfer.options import BackendOptionError
    from deepinfer.plugins import load_plugins

    if not options:
        return {b: {} for b in backends}  # each worker checks its backend (and its options' defaults) itself
    plugins = load_plugins()
    specs = {b: plugins.backend(b) for b in backends}
    shares = {b: {k: v for k, v in (options or {}).items() if k in {o.name for o in spec.options}} for b, spec in specs.items()}
    unknown = sorted(set(options or {}) - {k for share in shares.values() for k in share})
    if unknown:
        known = ", ".join(f"{b}: {', '.join(o.name for o in s.options) or 'none'}" for b, s in specs.items())
        raise BackendOptionError(f"no backend of this run has option {unknown[0]!r} ({known}; see `deepinfer backends`)")
    for b, spec in specs.items():
        spec.resolve_options(shares[b])  # bad values: one line now, before any worker starts
    return shares


def run(
    backends: list[str], *, interpret: bool = False, ops: list[str] | None = None, golden_dir: Path = GOLDEN_DIR, options: dict[str, str] | None = None,
    deterministic: bool = False,
) -> list[Row]:
    """options: backend options (`--backend-option`), each passed to the backends that declare it.
    deterministic: check the kernels deterministic mode chooses (the batch-invariant ones); an op
    with none is a "missing" row."""
    shares = options_per_backend(backends, options)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="deepinfer-conformance-") as tmp:
        out_dir = Path(tmp)
        extra, failures = write_goldens(out_dir / "out_of_tree_golden", taken={c.id for c in read_cases(golden_dir)})
        golden = GoldenSet([golden_dir, *extra])
        cases = [c for c in golden.cases if not ops or c.op in ops]
        if ops:
            unknown = set(ops) - {c.op for c in golden.cases}
            if unknown:
                raise UserError(f"no conformance cases for op(s) {', '.join(sorted(unknown))}")
        rows += [Row(f.entry_point, "-", "-", "-", "-", "error", None, f"{f.entry_point} failed to load: {f.error}") for f in failures]
        reports = run_workers(backends, out_dir, golden.dirs, interpret, ops, shares, deterministic)
        produced_by = {b: {} for b in backends}
        for case in cases:
            reference = golden.outputs(case)
            for b in backends:
                status = reports[b]["cases"].get(case.id, {"status": "missing", "error": "not run"})
                if status["status"] != "ran":
                    rows.append(Row(case.id, case.op, case.name, case.dtype, b, status["status"], None, status.get("error", "")))
                    continue
                produced = load_produced(out_dir, b, case, status)
                produced_by[b][case.id] = produced
                m = measure_case(case, produced, reference)
                row = Row(case.id, case.op, case.name, case.dtype, b, "pass" if m.ok else "FAIL", m.score, m.detail)
                first = backends[0]
                if b != first and case.id in produced_by[first]:
                    cross = measure_case(case, produced, produced_by[first][case.id])
                    row.versus, row.cross_score, row.cross_ok = first, cross.score, cross.ok
                rows.append(row)
    return rows


def format_table(rows: list[Row]) -> str:
    cross = any(r.versus for r in rows)
    head = ["op", "case", "dtype", "backend", "err/tol", "status"] + (["vs first", "agree"] if cross else []) + ["detail"]
    body = []
    for r in rows:
        score = "-" if r.score is None else ("inf" if r.score == float("inf") else f"{r.score:.3g}")
        line = [r.op, r.name, r.dtype, r.backend, score, r.status]
        if cross:
            line += ["-" if r.cross_score is None else f"{r.cross_score:.3g}", "-" if r.cross_ok is None else ("yes" if r.cross_ok else "NO")]
        body.append(line + [r.detail])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]

    def fmt(cells) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])


def summary(rows: list[Row]) -> tuple[str, bool]:
    """One line: the rows per status, the cross-backend disagreements, and the ops each backend has
    no kernel for (model-specific ops: "no kernel" rows are no failure, and no pass either)."""
    by_status: dict[str, int] = {}
    unserved: dict[str, list[str]] = {}  # backend -> its "no kernel" ops
    for r in rows:
        by_status[r.status] = by_status.get(r.status, 0) + 1
        if r.status == NO_KERNEL and r.op not in unserved.setdefault(r.backend, []):
            unserved[r.backend].append(r.op)
    cross_bad = sum(1 for r in rows if r.cross_ok is False)
    ok = all(r.status in ("pass", NO_KERNEL) for r in rows) and cross_bad == 0
    parts = [f"{n} {s}" for s, n in sorted(by_status.items())]
    if cross_bad:
        parts.append(f"{cross_bad} cross-backend disagreements")
    text = ", ".join(parts)
    if unserved:
        from deepinfer.registry import all_ops

        ops = all_ops()
        models = sorted({m for names in unserved.values() for n in names for m in (ops[n].model_types if n in ops else ())})
        named = "; ".join(f"{b} has no kernel for {', '.join(sorted(names))}" for b, names in unserved.items())
        text += f" ({named}: {'/'.join(models) or 'model-specific'} ops, served there only through --allow-fallback)"
    return text, ok


_SCORES = ("score", "cross_score")


def write_json(rows: list[Row], path: Path) -> None:
    """The rows as a JSON list. JSON has no Infinity or NaN: a non-finite score (a shape or dtype
    mismatch, non-finite values that differ) is written as the string "inf", "-inf" or "nan";
    `read_json` turns it back into the float."""
    records = [asdict(r) for r in rows]
    for record in records:
        for name in _SCORES:
            value = record[name]
            if value is not None and not math.isfinite(value):
                record[name] = str(value)
    path.write_text(json.dumps(records, indent=1, allow_nan=False))


def read_json(path: Path) -> list[Row]:
    """Rows written by `write_json`, non-finite scores as floats again."""
    rows = []
    for record in json.loads(path.read_text()):
        for name in _SCORES:
            if isinstance(record.get(name), str):
                record[name] = float(record[name])
        rows.append(Row(**record))
    return rows
