"""Backends are pluggy plugins, discovered through the entry-point group `deepinfer.backends`.

The built-in backends (reference, cuda, ascend) register exactly as a third-party package would.
Each entry point is loaded inside its own try: a broken plugin is reported, never fatal to the
others (pluggy's own loader has no try/except). That includes a plugin that calls sys.exit() while
it is imported (SystemExit is a plugin failure like any other); KeyboardInterrupt is not caught: a
user's Ctrl-C during start-up stops the command. Hooks take keyword arguments only, so a spec can
grow without breaking plugins.

Loading plugins and declaring backends imports no torch (this module, the built-in plugins and their
probes import it inside the functions that need it): `deepinfer bench --help` loads every plugin to
list their subcommands and answers at once.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable, Mapping

import pluggy

from deepinfer.errors import UserError
from deepinfer.options import BackendOption, resolve_options

if TYPE_CHECKING:
    import torch

    from deepinfer.device_graphs import GraphCapture
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


BENCH_SCALES = ("device", "host")  # BackendSpec.bench_scale


@dataclass(frozen=True)
class BackendSpec:
    """A backend as declared by `deepinfer_add_backends`: light, nothing imported or started yet.

    probe(interpret) must not start the device: it checks imports, drivers and device counts.
    With interpret=True it answers whether the backend's Triton kernels can run under
    TRITON_INTERPRET=1 on the CPU (how CI checks kernels on machines without the hardware).

    Capabilities the core asks for instead of checking the device type: `options` (what the user
    may choose, deepinfer.options), `graph_capture` (device graphs for decode steps,
    deepinfer.device_graphs; None: every step runs eagerly), `async_execution` (the device runs queued
    work while the host goes on, so the engine schedules step n+1 while step n runs: deepinfer.engine.overlap),
    `compiles_on_first_use` (its kernels compile per shape when first called, so a server warms up
    before its first request: deepinfer.engine.warmup), `memory_info` ((free, total) bytes
    of a device, for the KV cache budget; None: the host's RAM is the budget), `device_count`
    (its devices on this host, counted without starting one; None: torch.<device_type>.device_count()),
    which `local_devices` answers with; `profiler_activity` (the torch.profiler.ProfilerActivity member
    that records its device's kernels, e.g. "CUDA", for `deepinfer bench e2e --profile`; None: the
    host's ops only) and `bench_scale` (the workload a benchmark's defaults are sized for: "device",
    an accelerator's, or "host", what a CPU of a few cores runs in minutes).
    """

    name: str
    device_type: str  # torch device type its tensors live on: "cpu", "cuda", "npu"
    probe: Callable[..., Availability]
    description: str = ""
    kv_block_size: int = 64  # the paged KV cache block size this backend prefers
    auto_priority: int = 0  # backend="auto" tries backends from the highest priority down
    # "module:function" that `deepinfer bench ops` runs for this backend (its own cases, ceilings and
    # peers), called as function(ops=..., json_path=..., plot_path=...); "" = time the conformance cases.
    bench_runner: str = ""
    plugin: str = ""  # the entry point that declared it
    options: tuple[BackendOption, ...] = ()
    graph_capture: GraphCapture | None = None
    async_execution: bool = False
    compiles_on_first_use: bool = False
    memory_info: Callable[[torch.device], tuple[int, int]] | None = None
    device_count: Callable[[], int] | None = None
    profiler_activity: str | None = None
    bench_scale: str = "device"

    def device(self, interpret: bool = False) -> str:
        return "cpu" if interpret else self.device_type

    def local_devices(self, interpret: bool = False) -> int | None:
        """How many devices of this backend this host has, for one rank each (`--ep N`); None when it
        runs on the CPU, which the ranks share. Every command that counts devices asks here."""
        if self.device(interpret) == "cpu":
            return None
        if self.device_count is not None:
            return int(self.device_count())
        import torch

        count = getattr(getattr(torch, self.device_type, None), "device_count", None)
        return int(count()) if count is not None else 0

    def resolve_options(self, given: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """Every option's value (given, else its default or its environment variable); one-line
        BackendOptionError for an unknown option or a value it does not allow."""
        return resolve_options(self.name, self.options, given, environ)


class Hooks:
    """The hook specifications a backend plugin may implement."""

    @hookspec
    def deepinfer_add_backends(self, register: Callable[[BackendSpec], None]) -> None:
        """Declare backends: call register(BackendSpec(...)) for each. Must stay light."""

    @hookspec
    def deepinfer_register_kernels(self, backend: BackendSpec, registry: Registry, interpret: bool, options: Mapping[str, str]) -> None:
        """Register kernels for `backend` (only called once its probe passed): registry.register_kernel(...).
        options: the backend's validated options (a kernel's choice by option belongs in its `when`)."""

    @hookspec
    def deepinfer_env_report(self, backend: BackendSpec) -> dict[str, str] | None:
        """Facts for `deepinfer backends` (versions, device names, core counts)."""

    @hookspec
    def deepinfer_add_bench_commands(self, add: Callable[..., Any]) -> None:
        """Add subcommands to `deepinfer bench`: parser = add(name, help=..., description=...) returns an
        argparse parser; add arguments and parser.set_defaults(func=handler), handler(args) -> exit code."""


@dataclass(frozen=True)
class PluginFailure:
    entry_point: str
    error: str


_LOGGED_FAILURES: set[PluginFailure] = set()  # each failure is logged once per process, however often plugins load


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
            except (Exception, SystemExit) as exc:  # a broken plugin (even one calling sys.exit) must not take the others down
                self._fail(PluginFailure(f"{ep.name} = {ep.value}", f"{type(exc).__name__}: {exc}"))

    def _collect_backends(self) -> None:
        for impl in self.pm.hook.deepinfer_add_backends.get_hookimpls():
            plugin_name = self.pm.get_name(impl.plugin) or impl.plugin_name

            def register(spec: BackendSpec, _plugin=plugin_name) -> None:
                if spec.name in self.backends:
                    self.failures.append(PluginFailure(_plugin, f"backend {spec.name!r} is already declared by {self.backends[spec.name].plugin}"))
                    return
                if spec.bench_scale not in BENCH_SCALES:
                    problem = f"backend {spec.name!r} declares bench_scale {spec.bench_scale!r}, not one of {', '.join(BENCH_SCALES)}"
                    self.failures.append(PluginFailure(_plugin, problem))
                    return
                self.backends[spec.name] = BackendSpec(**{**spec.__dict__, "plugin": _plugin})

            try:
                impl.function(register=register)
            except (Exception, SystemExit) as exc:
                self._fail(PluginFailure(plugin_name, f"deepinfer_add_backends raised {type(exc).__name__}: {exc}"))

    def _fail(self, failure: PluginFailure) -> None:
        """Record a plugin failure (`deepinfer backends` lists them) and log it, once per process."""
        self.failures.append(failure)
        if failure not in _LOGGED_FAILURES:
            _LOGGED_FAILURES.add(failure)
            log.warning("backend plugin %s failed: %s", failure.entry_point, failure.error)

    def add_bench_commands(self, add: Callable[..., Any]) -> None:
        """Let every plugin add its `deepinfer bench` subcommands; a plugin whose hook fails is a failure, not fatal."""
        for impl in self.pm.hook.deepinfer_add_bench_commands.get_hookimpls():
            plugin_name = self.pm.get_name(impl.plugin) or impl.plugin_name
            try:
                impl.function(add=add)
            except (Exception, SystemExit) as exc:
                self._fail(PluginFailure(plugin_name, f"deepinfer_add_bench_commands raised {type(exc).__name__}: {exc}"))

    def backend(self, name: str) -> BackendSpec:
        if name not in self.backends:
            known = ", ".join(sorted(self.backends)) or "none"
            raise BackendError(f"unknown backend {name!r}; installed backends: {known} (see `deepinfer backends`)")
        return self.backends[name]

    def probe(self, name: str, interpret: bool = False) -> Availability:
        spec = self.backend(name)
        try:
            return spec.probe(interpret=interpret)
        except (Exception, SystemExit) as exc:  # a probe that crashes is a finding, not a crash
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

    def registry(self, name: str, interpret: bool = False, registry: Registry | None = None, options: Mapping[str, Any] | None = None) -> Registry:
        """A registry holding the kernels `name` registers (call only after its probe passed).
        options: the backend's options (validated here; defaults for those not given)."""
        from deepinfer.registry import Registry  # imports torch: only once kernels are wanted

        spec = self.backend(name)
        registry = registry if registry is not None else Registry()
        options = spec.resolve_options(options)
        self.pm.hook.deepinfer_register_kernels(backend=spec, registry=registry, interpret=interpret, options=options)
        return registry

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
