"""The distribution's packages, found rather than listed; everything else is in pyproject.toml.

pyproject.toml's `[tool.setuptools] package-dir` maps each top-level package onto its folder
(deepinfer_cuda = backends/cuda, ...). setuptools' `packages.find` cannot rename a folder into a
package, so this file walks each mapped folder with `find_packages` and prefixes what it finds. A
new subpackage (an op family folder, a backend's bench/ or tuning/) touches no list; a new
top-level package is one package-dir entry.
"""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.config.pyprojecttoml import load_file  # its own TOML reader: Python 3.10 has no tomllib

ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = load_file(ROOT / "pyproject.toml")["tool"]["setuptools"]["package-dir"]


def packages() -> list[str]:
    found = []
    for package, folder in PACKAGE_DIR.items():
        if package:  # "" = "." is the root the mapped packages hang from, not a package
            found += [package] + [f"{package}.{sub}" for sub in find_packages(str(ROOT / folder))]
    return found


if __name__ == "__main__":  # (setuptools runs this file as __main__; tests import packages())
    setup(packages=packages())
