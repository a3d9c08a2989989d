"""Find a package's modules by iterating it, so that adding one (an op family, a backend's kernel
module, a conformance case module) touches no hand-kept list; and the modules other installed
packages contribute, through entry-point groups (backends, op packages, conformance cases). Imports
nothing but the standard library: the core uses it for its op families, the backends for their
kernel modules."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType


def module_names(package: str) -> list[str]:
    """The names of the modules and subpackages directly inside `package` (a dotted name, imported;
    its modules are not), in name order; names that start with an underscore (private helpers) are
    left out. For callers that import each module in a try of their own."""
    pkg = importlib.import_module(package)
    return sorted(info.name for info in pkgutil.iter_modules(pkg.__path__) if not info.name.startswith("_"))


def submodules(package: str) -> list[ModuleType]:
    """Every module and subpackage directly inside `package` (a dotted name), imported, in name
    order; names that start with an underscore (private helpers) are left out."""
    return [importlib.import_module(f"{package}.{name}") for name in module_names(package)]


def registration_modules(package: str) -> list[ModuleType]:
    """The modules of a backend's kernel package that define `REGISTRATIONS`; the others are its
    helpers (their docstrings say "Not a registration module")."""
    return [m for m in submodules(package) if hasattr(m, "REGISTRATIONS")]


def registrations(package: str) -> Iterator:
    """Every `deepinfer.registry.Registration` of the package's registration modules, module by module."""
    for module in registration_modules(package):
        yield from module.REGISTRATIONS


def entry_points_of(group: str) -> list[EntryPoint]:
    """The entry points of `group` in name order, each name once (the same distribution can be seen
    twice on sys.path). Loading them is the caller's: each inside its own try."""
    found: dict[str, EntryPoint] = {}
    for ep in sorted(entry_points(group=group), key=lambda e: e.name):
        found.setdefault(ep.name, ep)
    return list(found.values())
