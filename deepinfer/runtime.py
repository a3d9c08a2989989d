"""Choosing a backend and resolving every op for it, once, at start-up."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from deepinfer.device_graphs import GraphCapture
from deepinfer.plugins import BackendError, BackendSpec, Plugins, load_plugins
from deepinfer.registry import ModelFacts, OpTable, ResolveContext

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """The selected backend, its device and its resolved op table, and the device capabilities the
    engine asks for (None where the backend has none, or under the interpreter, where the device is
    the CPU whatever the backend)."""

    backend: BackendSpec
    device: torch.device
    ops: OpTable
    plugins: Plugins
    chosen_by: str  # which backend and how it was chosen, for the user: "cuda (requested)" or "auto-selected reference (...)"
    graph_capture: GraphCapture | None = None
    async_execution: bool = False
    compiles_on_first_use: bool = False  # the interpreter compiles nothing
    memory_info: Callable[[torch.device], tuple[int, int]] | None = None
    profiler_activity: str | None = None  # the torch.profiler activity of the device's kernels (`bench e2e --profile`)

    @property
    def options(self) -> Mapping[str, str]:
        """The backend's options as resolved (every declared one)."""
        return self.ops.ctx.options


def open_runtime(
    backend: str = "auto",
    *,
    dtype: torch.dtype = torch.bfloat16,
    ep_size: int = 1,
    allow_fallback: bool = False,
    interpret: bool = False,
    plugins: Plugins | None = None,
    options: Mapping[str, Any] | None = None,
    model: ModelFacts | Callable[[], ModelFacts | None] | None = None,
    deterministic: bool = False,
) -> Runtime:
    """Select `backend` ("auto" picks the available one of highest priority: cuda, ascend, reference),
    check its probe and its `options` (BackendSpec.options; unknown ones and bad values are errors),
    collect its kernels and resolve every op. `model`: what the model's calls will look like, for
    kernels that serve only some models, or a function giving it, called once the backend and its
    options passed (it may read a checkpoint's config). `deterministic`: resolve every op to a
    batch-invariant kernel (deepinfer.registry.Kernel.batch_invariant) or fail naming the op. Raises BackendError / BackendOptionError / RegistryError
    with a one-line message."""
    plugins = plugins or load_plugins()
    if backend == "auto":
        spec, tried = plugins.auto()
        skipped = "; ".join(f"{n} unavailable: {a.reason}" for n, a in tried if not a.available)
        chosen_by = f"auto-selected {spec.name}" + (f" ({skipped})" if skipped else "")
    else:
        spec = plugins.require(backend, interpret=interpret)
        chosen_by = f"{spec.name} (requested)"
    resolved = spec.resolve_options(options)
    device = torch.device(spec.device(interpret))
    registry = plugins.registry(spec.name, interpret=interpret, options=resolved)
    facts = model() if callable(model) else model
    facts = dataclasses.replace(facts or ModelFacts(), kv_block_size=spec.kv_block_size)
    ctx = ResolveContext(backend=spec.name, device=device, dtype=dtype, ep_size=ep_size, options=resolved, model=facts, deterministic=deterministic)
    ops = registry.resolve(ctx, allow_fallback=allow_fallback)
    on_device = not interpret
    return Runtime(
        spec, device, ops, plugins, chosen_by,
        graph_capture=spec.graph_capture if on_device else None,
        async_execution=spec.async_execution and on_device,
        compiles_on_first_use=spec.compiles_on_first_use and on_device,
        memory_info=spec.memory_info if on_device else None,
        profiler_activity=spec.profiler_activity if on_device else None,
    )  # fmt: skip


__all__ = ["Runtime", "open_runtime", "BackendError"]
