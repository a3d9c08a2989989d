"""The distribution's packages are found, not listed: every folder with an __init__.py under a
package-dir root is a package, and a non-editable install holds all of them and the golden set."""

from __future__ import annotations

import runpy
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _found_packages() -> set[str]:
    return set(runpy.run_path(str(ROOT / "setup.py"), run_name="not_main")["packages"]())


def _package_folders() -> set[str]:
    mapping = runpy.run_path(str(ROOT / "setup.py"), run_name="not_main")["PACKAGE_DIR"]
    names = set()
    for package, folder in mapping.items():
        if not package:
            continue
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            names.add(".".join((package, *rel.parts)) if rel.parts else package)
    return names


def test_every_package_folder_is_found():
    assert _found_packages() == _package_folders()
    assert {"deepinfer.ops", "deepinfer_cuda.kernels", "deepinfer_cuda.bench", "deepinfer_ascend.kernels", "deepinfer_conformance.cases"} <= _found_packages()


def test_a_new_subpackage_is_found_without_a_list(tmp_path):
    """setup.py in a copy of the tree with one more subpackage: found, with no list edited."""
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    for folder in ("deepinfer", "backends", "conformance"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("golden", "__pycache__"))
    (tmp_path / "backends" / "cuda" / "newpart").mkdir()
    (tmp_path / "backends" / "cuda" / "newpart" / "__init__.py").write_text("")
    assert "deepinfer_cuda.newpart" in runpy.run_path(str(tmp_path / "setup.py"), run_name="not_main")["packages"]()


def test_a_regular_install_holds_every_package_and_the_golden_set(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("deepinfer", "backends", "conformance"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index", "--target", str(target), str(src)],
        check=True, capture_output=True,
    )
    for package in _package_folders():
        assert (target.joinpath(*package.split(".")) / "__init__.py").is_file(), package
    golden = target / "deepinfer_conformance" / "golden"
    assert (golden / "manifest.json").is_file()
    assert sorted(p.name for p in golden.glob("*.safetensors")) == sorted(p.name for p in (ROOT / "conformance" / "golden").glob("*.safetensors"))
