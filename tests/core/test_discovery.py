"""Op families, conformance case modules and backends' kernel modules are found by iterating their
package: a new module registers by existing; helpers are recognisable; the core stays triton-free."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.discovery import module_names, registration_modules, submodules

from waits import HANG_S


def test_submodules_imports_every_public_module_of_a_package(tmp_path, monkeypatch):
    pkg = tmp_path / "discovered_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "beta.py").write_text("NAME = 'beta'\n")
    (pkg / "alpha.py").write_text("NAME = 'alpha'\n")
    (pkg / "_helper.py").write_text("raise AssertionError('private modules are not imported')\n")
    (pkg / "sub" / "__init__.py").write_text("NAME = 'sub'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [m.NAME for m in submodules("discovered_pkg")] == ["alpha", "beta", "sub"]


def test_module_names_lists_the_modules_without_importing_them(tmp_path, monkeypatch):
    """For callers that import each module in a try of their own (the cuda bench runner): a module
    that fails to import is still listed, and listing it does not raise."""
    pkg = tmp_path / "listed_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "broken.py").write_text("raise ImportError('not imported by module_names')\n")
    (pkg / "alpha.py").write_text("")
    (pkg / "_private.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert module_names("listed_pkg") == ["alpha", "broken", "sub"]
    assert "listed_pkg.broken" not in sys.modules


def test_every_op_family_module_is_imported():
    from deepinfer import ops

    folder = Path(ops.__file__).parent
    families = {p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")}
    assert families and all(f"deepinfer.ops.{name}" in sys.modules for name in families)


def test_every_conformance_case_module_contributes_its_cases():
    from deepinfer_conformance import cases

    folder = Path(cases.__file__).parent
    ops_by_module = {p.stem: {c.op for c in __import__(f"deepinfer_conformance.cases.{p.stem}", fromlist=["CASES"]).CASES}
                     for p in folder.glob("*.py") if not p.stem.startswith("_")}
    found = {c.op for c in cases.all_cases()}
    assert set().union(*ops_by_module.values()) == found


@pytest.mark.parametrize("package", ["deepinfer_cuda.kernels", "deepinfer_ascend.kernels"])
def test_kernel_modules_register_or_say_they_are_helpers(package):
    """A kernel module without REGISTRATIONS is a helper, and its docstring says so: a module that
    forgot its REGISTRATIONS cannot pass for one."""
    kernels = __import__(package, fromlist=["registrations"])
    registered = {m.__name__ for m in registration_modules(package)}
    for module in submodules(package):
        if module.__name__ not in registered:
            assert "Not a registration module" in " ".join((module.__doc__ or "").split()), module.__name__
    assert {r.op for r in kernels.registrations()} >= {"rms_norm", "mla_decode", "linear", "sample"}


def test_the_shared_triton_module_imports_only_triton_and_torch():
    import deepinfer.triton_common as shared

    tree = ast.parse(inspect.getsource(shared))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module != "__future__"}
    assert imported <= {"os", "triton", "torch"}, imported
    code = inspect.getsource(shared).replace(shared.__doc__, "")
    assert "extra" not in code and "libdevice" not in code  # (triton.language.extra: vendor-specific)


def test_the_core_does_not_import_the_shared_triton_module():
    code = (
        "import sys, deepinfer, deepinfer.ops, deepinfer.registry, deepinfer.plugins, deepinfer.engine, deepinfer.cli.main\n"
        "assert 'deepinfer.triton_common' not in sys.modules, 'the core imported deepinfer.triton_common'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
