"""Find a package's modules by iterating it, so that adding one (an op family, a backend's kernel
module, a conformance case module) touches no hand-kept list. Imports nothing but the standard
library: the core uses it for its op families, the backends for their kernel modules."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from types import ModuleType


def submodules(package: str) -> list[ModuleType]:
    """Every module and subpackage directly inside `package` (a dotted name), imported, in name
    order; names that start with an underscore (private helpers) are left out."""
    pkg = importlib.import_module(package)
    names = sorted(info.name for info in pkgutil.iter_modules(pkg.__path__) if not info.name.startswith("_"))
    return [importlib.import_module(f"{package}.{name}") for name in names]


def registration_modules(package: str) -> list[ModuleType]:
    """The modules of a backend's kernel package that define `REGISTRATIONS`; the others are its
    helpers (their docstrings say "Not a registration module")."""
    return [m for m in submodules(package) if hasattr(m, "REGISTRATIONS")]


def registrations(package: str) -> Iterator:
    """Every `deepinfer.registry.Registration` of the package's registration modules, module by module."""
    for module in registration_modules(package):
        yield from module.REGISTRATIONS
