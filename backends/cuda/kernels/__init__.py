"""The cuda backend's Triton kernels, one module per op family.

A registration module is any module of this package that defines `REGISTRATIONS`: a list of
`Registration`s (op name, wrapper with the op's exact signature, formats/dtypes it serves, a note
for the coverage table); `plugin.py` registers them all. The modules are found by iterating the
package, so a new kernel module is registered by existing: no list to extend. Helper modules
(`common`, `precise_math`) define no REGISTRATIONS and say so in their docstrings; what both
backends share lives in `deepinfer.triton_common`.
"""

from __future__ import annotations

from deepinfer import discovery


def registrations():
    """Every Registration of this package's registration modules (importing them imports triton)."""
    return discovery.registrations(__name__)
