"""Backends are pluggy plugins, discovered through the entry-point group `deepinfer.backends`.

The built-in backends (reference, cuda, ascend) register exactly as a third-party package would.
Each entry point is loaded inside its own try: a broken plugin is reported, never fatal to the
others (pluggy's own loader has no try/except). Hooks take keyword arguments only, so a spec can
grow without breaking plugins.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable

import pluggy

from deepinfer.errors import UserError
from deepinfer.registry import Registry

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "deepinfer.backends"
hookspec = pluggy.HookspecMarker("deepinfer")
hookimpl = pluggy.HookimplMarker("deepinfer")


@dataclass(frozen=True)
class Availability:
    """What a probe found. `hint` says how to fix it when unavailable."""

    available: bool
    reason: str
    hint: str = ""
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BackendSpec:
    """A backend as declared by `deepinfer_add_backends`: light, nothing imported or started yet.

    probe(interpret) must not start the device: it checks imports, drivers and device counts.
    With interpret=True it answers whether the backend's Triton kernels can run under
    TRITON_INTERPRET=1 on the CPU (how CI checks kernels on machines without the hardware).
    """

    name: str
    device_type: str  # torch device type its tensors live on: "cpu", "cuda", "npu"
    probe: Callable[..., Availability]
    description: str = ""
    kv_block_size: int = 64  # the paged KV cache block size this backend prefers
    auto_priority: int = 0  # backend="auto" tries backends from the highest priority down
    plugin: str = ""  # the entry point that declared it

    def device(self, interpret: bool = False) -> str:
        return "cpu" if interpret else self.device_type


class Hooks:
    """The hook specifications a backend plugin may implement."""

    @hookspec
    def deepinfer_add_backends(self, register: Callable[[BackendSpec], None]) -> None:
        """Declare backends: call register(BackendSpec(...)) for each. Must stay light."""

    @hookspec
    def deepinfer_register_kernels(self, backend: BackendSpec, registry: Registry, interpret: bool) -> None:
        """Register kernels for `backend` (only called once its probe passed): registry.register_kernel(...)."""

    @hookspec(firstresult=True)
    def deepinfer_tuning_configs(self, backend: BackendSpec, op: str, device_name: str) -> dict | None:
        """Kernel configuration for an op on a device (tile sizes, warps, stages), or None for the default."""

    @hookspec
    def deepinfer_env_report(self, backend: BackendSpec) -> dict[str, str] | None:
        """Facts for `deepinfer backends` (versions, device names, core counts)."""


@dataclass(frozen=True)
class PluginFailure:
    entry_point: str
    error: str


class BackendError(UserError):
    """Unknown or unavailable backend; the message is one line with a hint."""


class Plugins:
    """The plugin manager plus what discovery found."""

    def __init__(self, load_entry_points: bool = True, extra_plugins: tuple[Any, ...] = ()):
        self.pm = pluggy.PluginManager("deepinfer")
        self.pm.add_hookspecs(Hooks)
        self.failures: list[PluginFailure] = []
        self.backends: dict[str, BackendSpec] = {}
        if load_entry_points:
            self._load_entry_points()
        for plugin in extra_plugins:
            self.pm.register(plugin)
        self._collect_backends()

    def _load_entry_points(self) -> None:
        for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if self.pm.get_plugin(ep.name) is not None:
                continue  # the same distribution seen twice on sys.path
            try:
                module = ep.load()
                self.pm.register(module, name=ep.name)
            except Exception as exc:  # a broken plugin must not take the others down
                self.failures.append(PluginFailure(f"{ep.name} = {ep.value}", f"{type(exc).__name__}: {exc}"))
                log.warning("backend plugin %s failed to load: %s: %s", ep.name, type(exc).__name__, exc)

    def _collect_backends(self) -> None:
        for impl in self.pm.hook.deepinfer_add_backends.get_hookimpls():
            plugin_name = self.pm.get_name(impl.plugin) or impl.plugin_name

            def register(spec: BackendSpec, _plugin=plugin_name) -> None:
                if spec.name in self.backends:
                    self.failures.append(PluginFailure(_plugin, f"backend {spec.name!r} is already declared by {self.backends[spec.name].plugin}"))
                    return
                self.backends[spec.name] = BackendSpec(**{**spec.__dict__, "plugin": _plugin})

            try:
                impl.function(register=register)
            except Exception as exc:
                self.failures.append(PluginFailure(plugin_name, f"deepinfer_add_backends raised {type(exc).__name__}: {exc}"))

    def backend(self, name: str) -> BackendSpec:
        if name not in self.backends:
            known = ", ".join(sorted(self.backends)) or "none"
            raise BackendError(f"unknown backend {name!r}; installed backends: {known} (see `deepinfer backends`)")
        return self.backends[name]

    def probe(self, name: str, interpret: bool = False) -> Availability:
        spec = self.backend(name)
        try:
            return spec.probe(interpret=interpret)
        except Exception as exc:  # a probe that crashes is a finding, not a crash
            return Availability(False, f"probe raised {type(exc).__name__}: {exc}", f"report this to the {spec.plugin} plugin's authors")

    def require(self, name: str, interpret: bool = False) -> BackendSpec:
        """The backend, or a one-line BackendError saying why it cannot run and how to fix it."""
        spec = self.backend(name)
        found = self.probe(name, interpret)
        if not found.available:
            hint = f"; {found.hint}" if found.hint else ""
            raise BackendError(f"backend {name!r} is not available: {found.reason}{hint}")
        return spec

    def auto(self) -> tuple[BackendSpec, list[tuple[str, Availability]]]:
        """backend="auto": the available backend of highest priority (cuda, then ascend, then reference)."""
        tried = []
        for spec in sorted(self.backends.values(), key=lambda s: -s.auto_priority):
            found = self.probe(spec.name)
            tried.append((spec.name, found))
            if found.available:
                return spec, tried
        raise BackendError("no backend is available: " + "; ".join(f"{n}: {a.reason}" for n, a in tried))

    def registry(self, name: str, interpret: bool = False, registry: Registry | None = None) -> Registry:
        """A registry holding the kernels `name` registers (call only after its probe passed)."""
        spec = self.backend(name)
        registry = registry if registry is not None else Registry()
        self.pm.hook.deepinfer_register_kernels(backend=spec, registry=registry, interpret=interpret)
        return registry

    def tuning_config(self, name: str, op: str, device_name: str) -> dict | None:
        return self.pm.hook.deepinfer_tuning_configs(backend=self.backend(name), op=op, device_name=device_name)

    def env_report(self, name: str) -> dict[str, str]:
        report: dict[str, str] = {}
        for part in self.pm.hook.deepinfer_env_report(backend=self.backend(name)):
            report.update(part or {})
        return report


def load_plugins() -> Plugins:
    return Plugins()


def import_optional(module: str):
    """Import a module a probe looks for; return (module, None) or (None, the exception)."""
    try:
        return importlib.import_module(module), None
    except Exception as exc:  # ImportError, OSError from missing shared libraries, RuntimeError, ...
        return None, exc
