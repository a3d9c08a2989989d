"""The op registry: every hardware-dependent step of the engine is an op declared here once.

An op is declared by decorating its pure-torch reference with `@op(...)` in one of the modules of
`deepinfer.ops`, or in a module of a separately installed op package (entry-point group
`deepinfer.ops`, imported by `all_ops`). The reference defines what the op means; a backend registers
kernels for the ops it implements (`Registry.register_kernel`), and the engine resolves every op once
at start-up (`Registry.resolve`) into an `OpTable` whose attributes are plain callables, so a hot loop
pays a dict lookup at most (for ops with several weight formats), never a search.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch

from deepinfer.errors import UserError

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

    from deepinfer.plugins import PluginFailure

log = logging.getLogger(__name__)

ALLCLOSE = "allclose"  # |out - ref| <= atol * reduction_length + rtol * |ref|
EXACT = "exact"  # ids, masks, sampled tokens: bit-for-bit equal


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float  # multiplied by the op's reduction length for the case


# One table for every op (FlagGems' values for rtol); an op may override entries.
DEFAULT_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(rtol=1e-10, atol=1e-12),
    torch.float32: Tolerance(rtol=1.3e-6, atol=1e-6),
    torch.float16: Tolerance(rtol=1e-3, atol=1e-4),
    torch.bfloat16: Tolerance(rtol=1.6e-2, atol=1e-3),
}


@dataclass(frozen=True)
class OpSpec:
    """Everything the registry, the backends and the conformance suite know about one op."""

    name: str
    family: str
    reference: Callable[..., Any]
    outputs: tuple[str, ...]
    compare: Mapping[str, str]  # output name -> ALLCLOSE | EXACT
    reduction_length: Callable[[Mapping[str, Any]], int] = lambda kwargs: 1
    tolerances: Mapping[torch.dtype, Tolerance] = field(default_factory=lambda: dict(DEFAULT_TOLERANCES))
    formats: tuple[str, ...] = ()  # values of the op's `fmt` argument, when it has one
    # Outputs are canonicalised before comparison (e.g. rows a kernel may leave unwritten, or the
    # order of equal-score top-k ids). Receives the call's kwargs and the output dict.
    canonicalize: Callable[[Mapping[str, Any], dict[str, Any]], dict[str, Any]] | None = None
    # "float64": goldens come from the reference on float64-upcast inputs. "native": the op is
    # defined in its input precision (sampling: the noise and the argmax are specified in float32).
    golden_precision: str = "float64"
    in_place: str | None = None  # name of an argument the op writes into (and returns)
    # The dtype a call's outputs come back in when an argument of the call chooses it (linear's out_dtype), from
    # the call's keyword arguments; None (or no function): the case dtype. The golden set stores such a case's
    # outputs in that dtype and holds them to its tolerance.
    result_dtype: Callable[[Mapping[str, Any]], torch.dtype | None] | None = None
    # The model types whose layers call the op (empty: every model). A backend without a kernel for
    # it still opens for other models (`Registry.resolve`); DeepSeek-V4's ops name "deepseek_v4".
    model_types: tuple[str, ...] = ()
    doc: str = ""

    @property
    def signature(self) -> inspect.Signature:
        return inspect.signature(self.reference)

    @property
    def declared_in(self) -> str:
        """The module that declared the op (its reference's module)."""
        return self.reference.__module__

    @property
    def out_of_tree(self) -> bool:
        """Declared outside `deepinfer.ops`, by an op package: the core engine never calls it, so a
        backend without a kernel for it still opens (`Registry.resolve`)."""
        return not _inside(self.declared_in, CORE_OPS_PACKAGE)

    def needed_by(self, facts: "ModelFacts") -> bool:
        """Whether the model `facts` describe calls this op (unknown model: no)."""
        return not self.model_types or facts.model_type in self.model_types

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        return self.tolerances.get(dtype, DEFAULT_TOLERANCES.get(dtype, Tolerance(0.0, 0.0)))

    def name_outputs(self, result: Any) -> dict[str, Any]:
        values = result if isinstance(result, tuple) else (result,)
        if len(values) != len(self.outputs):
            raise TypeError(f"op {self.name!r} returned {len(values)} values, its spec names {self.outputs}")
        return dict(zip(self.outputs, values))


# The catalogue of every declared op, filled by the @op decorator as deepinfer.ops (and each op
# package) is imported.
OPS: dict[str, OpSpec] = {}
CORE_OPS_PACKAGE = "deepinfer.ops"
OP_PACKAGES_GROUP = "deepinfer.ops"  # entry-point group of out-of-tree op packages: each names a module that declares ops


def op(*, family: str, outputs: Iterable[str], compare: Mapping[str, str] | str = ALLCLOSE, **spec_fields):
    """Declare an op: the decorated function is its reference implementation."""

    def declare(reference: Callable) -> Callable:
        names = tuple(outputs)
        modes = {n: compare for n in names} if isinstance(compare, str) else dict(compare)
        missing = set(names) - set(modes)
        if missing:
            raise TypeError(f"op {reference.__name__!r}: no compare mode for outputs {sorted(missing)}")
        spec = OpSpec(
            name=reference.__name__,
            family=family,
            reference=reference,
            outputs=names,
            compare=modes,
            doc=inspect.getdoc(reference) or "",
            **spec_fields,
        )
        if spec.out_of_tree:
            importlib.import_module(CORE_OPS_PACKAGE)  # the core's names first: a clash is always the op package's
        known = OPS.get(spec.name)
        if known is not None and _where(known.reference) != _where(reference):  # (a module imported again redeclares its own)
            hint = "; an op package must give its ops names of their own" if spec.out_of_tree else ""
            raise ValueError(f"op {spec.name!r} is declared twice: in {known.declared_in} and in {spec.declared_in}{hint}")
        OPS[spec.name] = spec
        return reference

    return declare


def _where(fn: Callable) -> tuple[str, str]:
    return fn.__module__, fn.__qualname__


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def all_ops() -> dict[str, OpSpec]:
    """Every declared op, by name: deepinfer's own (the modules of `deepinfer.ops`) and those of
    the installed op packages (`op_package_failures` lists the packages that failed to load)."""
    importlib.import_module(CORE_OPS_PACKAGE)  # importing the package declares every core op
    op_package_failures()
    return dict(sorted(OPS.items()))


_op_package_failures: list[PluginFailure] | None = None  # None until the op packages were loaded


def op_package_failures() -> list[PluginFailure]:
    """Load the op packages (once per process) and return those that failed: `deepinfer backends`
    lists them with the plugin failures."""
    global _op_package_failures
    if _op_package_failures is None:
        from deepinfer.discovery import entry_points_of

        _op_package_failures = []  # set first: an op package that calls all_ops() while it loads does not recurse
        _op_package_failures += load_op_packages(entry_points_of(OP_PACKAGES_GROUP))
    return list(_op_package_failures)


def load_op_packages(eps: Iterable[EntryPoint]) -> list[PluginFailure]:
    """Import each op package module inside its own try, as plugins are loaded: one that fails to
    import, or declares an op under a name already taken, is a failure (logged) and declares
    nothing; the others load. Returns the failures."""
    from deepinfer.plugins import PluginFailure

    failures = []
    for ep in eps:
        try:
            ep.load()
        except (Exception, SystemExit) as exc:  # a broken op package (even one calling sys.exit) must not take the others down
            # What it declared before failing goes with it: the ops of its module, and of any module
            # whose import failed (Python drops those from sys.modules); ops of modules that loaded stay.
            dropped = [n for n, spec in OPS.items() if spec.declared_in not in sys.modules or _inside(spec.declared_in, ep.module)]
            for name in dropped:
                del OPS[name]
            failure = PluginFailure(f"{ep.name} = {ep.value} (op package)", f"{type(exc).__name__}: {exc}")
            log.warning("%s failed to load: %s", failure.entry_point, failure.error)
            failures.append(failure)
    return failures


class RegistryError(UserError):
    """A kernel that does not fit its op, or an op a backend cannot serve."""


@dataclass(frozen=True)
class ModelFacts:
    """Static facts of the model whose calls the ops will serve, for kernels that serve only some
    models (a fused gate that implements some routing functions, an attention kernel for some head
    sizes): every call the engine makes passes these. None is unknown: a kernel that depends on an
    unknown fact must not be chosen. The conformance worker fills them from each case's inputs."""

    model_type: str | None = None  # config.json's model_type: which model-specific ops are called
    # gate
    num_experts: int | None = None
    top_k: int | None = None
    score_func: str | None = None
    n_group: int | None = None
    topk_group: int | None = None
    renormalize: bool | None = None
    correction_bias: bool | None = None  # whether a correction bias is passed
    # attention
    num_heads: int | None = None  # query heads (mla_decode, prefill)
    kv_lora_rank: int | None = None  # mla_decode's latent width C
    qk_rope_head_dim: int | None = None  # mla_decode's rope width R
    qk_head_dim: int | None = None  # prefill's query/key head dim
    v_head_dim: int | None = None  # prefill's value head dim
    sliding_window: int | None = None  # 0: no window
    kv_block_size: int | None = None  # the paged cache's block size
    kv_cache_fp8: bool | None = None  # the paged cache holds FP8 rows (kv_cache_dtype="fp8", deepinfer.ops.kv_cache_format)


@dataclass(frozen=True)
class ResolveContext:
    """The static facts kernels are chosen by, known once at engine start-up.

    options: the backend's options (deepinfer.options), validated, every declared one present when
    the context comes from `open_runtime`; `when` predicates read them with `BackendOption.value`.
    model: what the model's calls will look like (ModelFacts), when known."""

    backend: str
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.bfloat16
    ep_size: int = 1
    options: Mapping[str, Any] = field(default_factory=dict)
    model: ModelFacts = field(default_factory=ModelFacts)
    # Deterministic mode: only batch-invariant kernels (Kernel.batch_invariant) may be chosen.
    deterministic: bool = False


@dataclass(frozen=True)
class Kernel:
    op: str
    backend: str
    fn: Callable[..., Any]
    formats: frozenset[str] | None = None  # None: every format of the op
    dtypes: frozenset[torch.dtype] | None = None  # None: every activation dtype
    when: Callable[[ResolveContext], bool] | None = None  # static predicate, e.g. "ep_size > 1"
    priority: int = 0  # among kernels that all apply, the highest wins
    note: str = ""  # shown in the coverage table: "torch_npu fast path", "Triton", ...
    # Why this kernel cannot run in a context where its `when` chose it (None: it can), e.g. an
    # option forces it where its transport is missing; resolve turns a reason into a one-line error.
    unusable: Callable[[ResolveContext], str | None] | None = None
    # Capability of an expert-parallel dispatch/combine: given the same token bound on every rank
    # (ranks, bound, top_k), it makes no host synchronisation, so device graphs may capture it.
    capturable_with_token_bound: Callable[[int, int, int], bool] | None = None
    # Its result for one request (a row, a sequence, a query) is bit for bit the same whatever else
    # the call holds: the batch's size and composition, the request's place in it, how its prefill
    # was chunked and whether its prefix came from the cache. Deterministic mode chooses only these.
    batch_invariant: bool = False

    def applies(self, ctx: ResolveContext, fmt: str | None) -> bool:
        if ctx.deterministic and not self.batch_invariant:
            return False
        if self.dtypes is not None and ctx.dtype not in self.dtypes:
            return False
        if fmt is not None and self.formats is not None and fmt not in self.formats:
            return False
        return self.when is None or bool(self.when(ctx))


def check_signature(spec: OpSpec, fn: Callable, backend: str) -> None:
    """A kernel takes exactly the op's parameters: same names, kinds and defaults, in order."""
    want = [(p.name, p.kind, p.default) for p in spec.signature.parameters.values()]
    try:
        got = [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
    except (TypeError, ValueError) as exc:
        raise RegistryError(f"backend {backend!r}: kernel for {spec.name!r} has no inspectable signature ({exc})")
    if got != want:
        raise RegistryError(
            f"backend {backend!r}: kernel {getattr(fn, '__qualname__', fn)!r} for op {spec.name!r} has signature "
            f"{inspect.signature(fn)}, the op's is {spec.signature}"
        )


@dataclass(frozen=True)
class Registration:
    """A kernel as a backend module lists it; `Registry.register_all` registers a list of them."""

    op: str
    fn: Callable[..., Any]
    formats: Iterable[str] | None = None
    dtypes: Iterable[torch.dtype] | None = None
    when: Callable[[ResolveContext], bool] | None = None
    note: str = ""
    priority: int = 0
    unusable: Callable[[ResolveContext], str | None] | None = None  # see Kernel
    capturable_with_token_bound: Callable[[int, int, int], bool] | None = None  # see Kernel
    batch_invariant: bool = False  # see Kernel


class Registry:
    """Kernels per backend and op. Filled through the `deepinfer_register_kernels` hook."""

    def __init__(self, ops: Mapping[str, OpSpec] | None = None):
        self.ops = dict(ops) if ops is not None else all_ops()
        self.kernels: dict[str, dict[str, list[Kernel]]] = {}

    def register_kernel(
        self,
        backend: str,
        op_name: str,
        fn: Callable,
        *,
        formats: Iterable[str] | None = None,
        dtypes: Iterable[torch.dtype] | None = None,
        when: Callable[[ResolveContext], bool] | None = None,
        priority: int = 0,
        note: str = "",
        unusable: Callable[[ResolveContext], str | None] | None = None,
        capturable_with_token_bound: Callable[[int, int, int], bool] | None = None,
        batch_invariant: bool = False,
    ) -> None:
        spec = self.ops.get(op_name)
        if spec is None:
            raise RegistryError(f"backend {backend!r} registers a kernel for unknown op {op_name!r}; known: {', '.join(self.ops)}")
        check_signature(spec, fn, backend)
        fmts = frozenset(formats) if formats is not None else None
        if fmts is not None and not fmts <= set(spec.formats):
            raise RegistryError(f"backend {backend!r}: op {op_name!r} has formats {spec.formats}, not {sorted(fmts - set(spec.formats))}")
        kernel = Kernel(
            op_name, backend, fn, fmts, frozenset(dtypes) if dtypes is not None else None, when, priority, note, unusable,
            capturable_with_token_bound, batch_invariant,
        )  # fmt: skip
        self.kernels.setdefault(backend, {}).setdefault(op_name, []).append(kernel)

    def register_all(self, backend: str, registrations: Iterable[Registration]) -> None:
        for r in registrations:
            self.register_kernel(
                backend, r.op, r.fn, formats=r.formats, dtypes=r.dtypes, when=r.when, priority=r.priority, note=r.note,
                unusable=r.unusable, capturable_with_token_bound=r.capturable_with_token_bound, batch_invariant=r.batch_invariant,
            )  # fmt: skip

    def candidates(self, backend: str, op_name: str) -> list[Kernel]:
        return self.kernels.get(backend, {}).get(op_name, [])

    def pick(self, ctx: ResolveContext, op_name: str, fmt: str | None = None) -> Kernel | None:
        """The kernel of highest priority whose dtypes, formats and `when` fit (None: none does)."""
        fitting = [k for k in self.candidates(ctx.backend, op_name) if k.applies(ctx, fmt)]
        return max(fitting, key=lambda k: k.priority) if fitting else None

    def choose(self, ctx: ResolveContext, op_name: str, fmt: str | None = None) -> Kernel | None:
        """`pick`, and a one-line RegistryError when the picked kernel says it cannot run here."""
        kernel = self.pick(ctx, op_name, fmt)
        reason = kernel.unusable(ctx) if kernel is not None and kernel.unusable is not None else None
        if reason is not None:
            label = op_name if fmt is None else f"{op_name}[{fmt}]"
            raise RegistryError(f"backend {ctx.backend!r} cannot serve op {label!r}: {reason}")
        return kernel

    def resolve(self, ctx: ResolveContext, *, allow_fallback: bool = False, only: Iterable[str] | None = None) -> "OpTable":
        """Choose one kernel per op (and per format) for this context, once.

        A missing kernel is an error naming the op and the backend, unless `allow_fallback`; then
        the reference serves that op and the fallback is logged once, here. Out-of-tree ops (declared
        by op packages, which the core never calls) and ops only another model type calls
        (`OpSpec.model_types`) are the exception when `only` is not given: one this backend has no
        kernel for is left out of the table, and calling it is that error. `allow_fallback` serves
        the former by the reference, never the latter: a DeepSeek-V3 run with the fallback allowed
        neither falls back to nor logs DeepSeek-V4's ops.

        In deterministic mode (`ctx.deterministic`) only batch-invariant kernels are chosen, and an
        op the model needs that has none is an error naming it, fallback allowed or not: the
        reference on another device is no invariant kernel, and a silent swap would break the promise.
        """
        chosen: dict[str, Callable | dict[str, Callable]] = {}
        kernels: dict[str, Kernel | None] = {}
        fallbacks: list[str] = []
        unserved: dict[str, str] = {}  # out-of-tree op -> the module that declared it
        for name in only if only is not None else self.ops:
            spec = self.ops[name]
            optional = ((spec.out_of_tree and not allow_fallback) or not spec.needed_by(ctx.model)) and only is None
            keys: list[str | None] = list(spec.formats) if spec.formats else [None]
            per_key: dict[str | None, Callable] = {}
            for key in keys:
                kernel = self.choose(ctx, name, key)
                label = name if key is None else f"{name}[{key}]"
                kernels[label] = kernel
                if kernel is None:
                    if optional:
                        continue
                    if ctx.deterministic and self.candidates(ctx.backend, name):
                        raise RegistryError(
                            f"deterministic mode: backend {ctx.backend!r} has no batch-invariant kernel for op {label!r} "
                            f"(dtype {str(ctx.dtype).removeprefix('torch.')}); run without --deterministic, or choose a backend "
                            "that has one (`deepinfer backends` marks them)"
                        )
                    if not allow_fallback or ctx.deterministic:
                        raise RegistryError(
                            f"backend {ctx.backend!r} has no kernel for op {label!r} (dtype {str(ctx.dtype).removeprefix('torch.')}); "
                            "implement it, or allow the reference fallback explicitly (--allow-fallback)"
                        )
                    fallbacks.append(label)
                    per_key[key] = spec.reference
                else:
                    per_key[key] = kernel.fn
            if not per_key:
                unserved[name] = f"out of tree in {spec.declared_in}" if spec.out_of_tree else f"for {', '.join(spec.model_types)} models"
                continue
            chosen[name] = per_key[None] if keys == [None] else {k: v for k, v in per_key.items() if k is not None}
        for label in fallbacks:
            log.warning("backend %r: op %s runs on the reference implementation (fallback allowed)", ctx.backend, label)
        if unserved:
            log.info("backend %r has no kernel for the op(s) %s (out of tree, or for other models): calling one is an error", ctx.backend, ", ".join(unserved))
        return OpTable(ctx, chosen, tuple(fallbacks), kernels, unserved)

    def coverage(self, backend: str) -> dict[str, list[Kernel]]:
        return {name: self.candidates(backend, name) for name in self.ops}


class OpTable:
    """Resolved ops: `table.rms_norm(...)`. Ops with weight formats dispatch on `fmt` by dict lookup."""

    def __init__(
        self,
        ctx: ResolveContext,
        chosen: Mapping[str, Callable | Mapping[str, Callable]],
        fallbacks: tuple[str, ...],
        kernels: Mapping[str, Kernel | None] | None = None,
        unserved: Mapping[str, str] | None = None,
    ):
        self.ctx = ctx
        self.fallbacks = fallbacks
        self._chosen = dict(chosen)
        self._kernels = dict(kernels or {})
        self._unserved = dict(unserved or {})  # ops left out (out of tree, or for other models) -> why, for the error
        for name, impl in chosen.items():
            setattr(self, name, impl if callable(impl) else _by_format(name, impl))

    def __contains__(self, name: str) -> bool:
        return name in self._chosen

    def __getattr__(self, name: str) -> Any:
        """Only reached for names that are not resolved ops: an op left out of the table (out of
        tree, or for another model type) is a one-line RegistryError, anything else an AttributeError."""
        why = self.__dict__.get("_unserved", {}).get(name)
        if why is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise RegistryError(
            f"backend {self.ctx.backend!r} has no kernel for op {name!r} (declared {why}); "
            "register one in a plugin's deepinfer_register_kernels, or allow the reference fallback explicitly (--allow-fallback)"
        )

    @property
    def deterministic(self) -> bool:
        """Every op resolved to a batch-invariant kernel: the model keeps its own glue invariant too."""
        return self.ctx.deterministic

    def kernel(self, name: str, fmt: str | None = None) -> Callable:
        impl = self._chosen[name]
        return impl if callable(impl) else impl[fmt]

    def registration(self, name: str, fmt: str | None = None) -> Kernel | None:
        """The registered kernel chosen for `name` (and `fmt`), with the capabilities it declares;
        None when the reference serves it as a fallback, or the op was not resolved."""
        return self._kernels.get(name if fmt is None else f"{name}[{fmt}]")


def _by_format(name: str, table: Mapping[str, Callable]) -> Callable:
    def call(*args, fmt: str, **kwargs):
        try:
            fn = table[fmt]
        except KeyError:
            raise RegistryError(f"op {name!r} has no kernel for format {fmt!r}; formats: {', '.join(table)}") from None
        return fn(*args, fmt=fmt, **kwargs)

    call.__name__ = name
    return call
