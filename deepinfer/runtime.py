"""Choosing a backend and resolving every op for it, once, at start-up."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from deepinfer.plugins import BackendError, BackendSpec, Plugins, load_plugins
from deepinfer.registry import OpTable, ResolveContext

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """The selected backend, its device and its resolved op table."""

    backend: BackendSpec
    device: torch.device
    ops: OpTable
    plugins: Plugins
    chosen_by: str  # how the backend was chosen, for the user: "requested" or "auto: ..."


def open_runtime(
    backend: str = "auto",
    *,
    dtype: torch.dtype = torch.bfloat16,
    ep_size: int = 1,
    allow_fallback: bool = False,
    interpret: bool = False,
    plugins: Plugins | None = None,
) -> Runtime:
    """Select `backend` ("auto" picks the available one of highest priority: cuda, ascend, reference),
    check its probe, collect its kernels and resolve every op. Raises BackendError / RegistryError
    with a one-line message."""
    plugins = plugins or load_plugins()
    if backend == "auto":
        spec, tried = plugins.auto()
        skipped = "; ".join(f"{n} unavailable: {a.reason}" for n, a in tried if not a.available)
        chosen_by = f"auto-selected {spec.name}" + (f" ({skipped})" if skipped else "")
    else:
        spec = plugins.require(backend, interpret=interpret)
        chosen_by = f"backend {spec.name} (requested)"
    device = torch.device(spec.device(interpret))
    registry = plugins.registry(spec.name, interpret=interpret)
    ctx = ResolveContext(backend=spec.name, device=device, dtype=dtype, ep_size=ep_size)
    ops = registry.resolve(ctx, allow_fallback=allow_fallback)
    return Runtime(spec, device, ops, plugins, chosen_by)


__all__ = ["Runtime", "open_runtime", "BackendError"]
