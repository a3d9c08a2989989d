"""Conformance cases from other installed packages: the modules of the entry-point group
`deepinfer.conformance_cases`, each with a `CASES` list of `deepinfer_conformance.cases.Case`, like
the modules of `cases/`.

Their goldens are not stored anywhere: every conformance run computes them at its start from the
float64 reference, with the code that writes the packaged set (`generate.build`), into the run's
temporary folder, and the workers read that folder beside the packaged one. An op package so ships
recipes, never tensors, and needs no generation step; its cases check the backends against its
reference as installed (the packaged set is frozen instead, and `generate --check` catches a core
reference that drifts).

Each module is loaded inside its own try: one that fails to import, has no `CASES`, holds cases for
an op nobody declared, reuses a case id or whose recipes or reference fail is a failure (the run
shows it as an error row), and the other packages' cases still run.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from deepinfer.discovery import entry_points_of
from deepinfer.plugins import PluginFailure
from deepinfer.registry import all_ops
from deepinfer_conformance import generate
from deepinfer_conformance.cases import Case
from deepinfer_conformance.golden_io import CaseRecord

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

CASES_GROUP = "deepinfer.conformance_cases"


def module_cases(ep: EntryPoint, taken: set[str]) -> list[Case]:
    """The `CASES` of one entry point's module, checked: Case objects, for declared ops, with ids
    not in `taken` and not repeated. Raises ValueError naming what is wrong."""
    module = ep.load()
    cases = getattr(module, "CASES", None)
    if cases is None:
        raise ValueError(f"module {module.__name__} has no CASES list")
    cases = list(cases)
    strangers = sorted({type(c).__name__ for c in cases if not isinstance(c, Case)})
    if strangers:
        raise ValueError(f"CASES holds {', '.join(strangers)} objects, not deepinfer_conformance.cases.Case")
    undeclared = sorted({c.op for c in cases} - set(all_ops()))
    if undeclared:
        raise ValueError(f"cases for undeclared op(s) {', '.join(undeclared)} (is the op package that declares them installed? see `deepinfer backends`)")
    ids = [c.id for c in cases]
    clashing = sorted({i for i in ids if i in taken or ids.count(i) > 1})
    if clashing:
        raise ValueError(f"case ids already taken: {', '.join(clashing)}")
    return cases


def write_goldens(folder: Path, taken: set[str]) -> tuple[list[Path], list[PluginFailure]]:
    """Compute the goldens of every out-of-tree case into `folder` (a golden set like the packaged
    one). `taken`: the case ids of the golden set the run already has. Returns the folder to read
    beside the packaged one ([] when there are no out-of-tree cases) and the packages that failed."""
    files: dict[str, dict[str, torch.Tensor]] = {}
    records: list[CaseRecord] = []
    failures: list[PluginFailure] = []
    taken = set(taken)
    deterministic = torch.are_deterministic_algorithms_enabled()
    for ep in entry_points_of(CASES_GROUP):
        try:
            cases = module_cases(ep, taken)
            torch.use_deterministic_algorithms(True)  # as `generate` writes the packaged set
            try:
                module_files, module_records = generate.build(cases)
            finally:
                torch.use_deterministic_algorithms(deterministic)
        except (Exception, SystemExit) as exc:  # one broken case package must not take the others down
            failures.append(PluginFailure(f"{ep.name} = {ep.value} (conformance cases)", f"{type(exc).__name__}: {exc}"))
            continue
        taken.update(c.id for c in cases)
        for op, tensors in module_files.items():
            files.setdefault(op, {}).update(tensors)
        records += module_records
    if not records:
        return [], failures
    generate.write(folder, files, records)
    return [folder], failures
