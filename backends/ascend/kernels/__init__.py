"""The ascend backend's Triton kernels (written for triton-ascend, checked under community Triton's
interpreter), one module per op family.

A registration module is any module of this package that defines `REGISTRATIONS` (a list of
deepinfer.registry.Registration); `plugin.py` registers them all. The modules are found by
iterating the package, so a new kernel module is registered by existing: no list to extend. The
helper module `common` defines no REGISTRATIONS and says so in its docstring; what both backends
share lives in `deepinfer.triton_common`.
"""

from __future__ import annotations

from deepinfer import discovery


def registrations():
    """Every Registration of this package's registration modules (importing them imports triton)."""
    return discovery.registrations(__name__)
