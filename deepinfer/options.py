"""Backend options: what a backend lets the user choose (a kernel path, a simulated chip), declared
on its BackendSpec, validated once when the backend is opened, and carried to the kernels' `when`
predicates by the ResolveContext.

An option has a name, its allowed values, a default and a help line; it may name an environment
variable that supplies its default (documented with the option, e.g. for scripts that cannot pass
flags). Values come from `LLM(backend_options={...})`, `deepinfer run --backend-option KEY=VALUE`,
`deepinfer conformance --backend-option ...`, `deepinfer bench ops --backend-option ...` (the kernels
it times: the conformance-case timing and `--ep N`'s ranks) and `deepinfer bench e2e --backend-option
...` (deepinfer's side of the comparison); `deepinfer backends` lists each backend's options. Anything
wrong is a one-line BackendOptionError naming the option, the allowed values and the backend.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from deepinfer.errors import UserError


class BackendOptionError(UserError):
    """An unknown backend option, or a value it does not allow (one line)."""


@dataclass(frozen=True)
class BackendOption:
    name: str
    choices: tuple[str, ...]
    default: str
    help: str
    env: str | None = None  # an environment variable that supplies the default, when set

    def __post_init__(self):
        if self.default not in self.choices:
            raise ValueError(f"option {self.name!r}: default {self.default!r} is not one of {self.choices}")

    def value(self, ctx: Any) -> str:
        """This option's value in a ResolveContext (for `when` predicates: never raises). A context
        built without options (tests, benchmarks that pick kernels by hand) gets the default."""
        return ctx.options.get(self.name, self.default)

    def check(self, value: Any, backend: str, source: str | None = None) -> str:
        """`value` if allowed, else a one-line BackendOptionError. `source` names where it came from."""
        text = value.strip() if isinstance(value, str) else value
        if text not in self.choices:
            where = f" ({source})" if source else ""
            raise BackendOptionError(
                f"backend {backend!r} option {self.name}={value!r}{where} is not allowed; use one of: {', '.join(self.choices)}"
            )
        return text

    def default_for(self, backend: str, environ: Mapping[str, str]) -> str:
        """The default, or the environment variable's value when it is set (checked)."""
        if self.env and environ.get(self.env, "").strip():
            return self.check(environ[self.env], backend, f"from {self.env}")
        return self.default

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "choices": list(self.choices), "default": self.default, "env": self.env, "help": self.help}


def resolve_options(
    backend: str, declared: Iterable[BackendOption], given: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Every declared option's value: the given one, else its default (from its environment variable
    when set). An option the backend does not declare, or a value it does not allow, is an error."""
    declared = {o.name: o for o in declared}
    environ = os.environ if environ is None else environ
    given = dict(given or {})
    unknown = sorted(set(given) - set(declared))
    if unknown:
        known = ", ".join(sorted(declared)) or "none"
        raise BackendOptionError(f"backend {backend!r} has no option {unknown[0]!r}; its options: {known} (see `deepinfer backends`)")
    return {
        name: option.check(given[name], backend) if name in given else option.default_for(backend, environ)
        for name, option in declared.items()
    }


def parse_assignments(words: Iterable[str] | None, flag: str = "--backend-option") -> dict[str, str]:
    """KEY=VALUE words (a repeatable command-line flag) as a dict; a malformed word or a key given
    twice is a one-line error."""
    options: dict[str, str] = {}
    for word in words or ():
        key, sep, value = word.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise BackendOptionError(f"{flag} {word!r}: expected KEY=VALUE, e.g. {flag} ep_path=nccl")
        if key in options:
            raise BackendOptionError(f"{flag}: option {key!r} is given twice")
        options[key] = value
    return options
