"""`deepinfer backends`: every installed backend, whether it can run here and why, its op coverage
and its options.

Coverage is listed per backend, one op per line with the notes of its kernels, wrapped to the
terminal's width: kernel notes are sentences, and a table with a column per backend would cut them.
A kernel marked "(batch-invariant)" is one deterministic mode (`--deterministic`) may choose.
Then the backend's options (`--backend-option KEY=VALUE`, `LLM(backend_options=...)`): each one's
allowed values, its default and the environment variable that supplies the default, and what it does.
"""

from __future__ import annotations

import argparse
import json
import shutil
import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer.plugins import Plugins

INDENT = 2


def add_parser(sub) -> None:
    p = sub.add_parser("backends", help="list backends, their availability and op coverage", description=__doc__)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)


def collect(plugins: Plugins) -> dict:
    from deepinfer.registry import Registry, all_ops, op_package_failures

    ops = all_ops()
    report = {"backends": [], "plugin_failures": [f.__dict__ for f in [*plugins.failures, *op_package_failures()]]}
    for name, spec in sorted(plugins.backends.items()):
        found = plugins.probe(name)
        entry = {
            "name": name,
            "plugin": spec.plugin,
            "device": spec.device_type,
            "available": found.available,
            "reason": found.reason,
            "hint": found.hint,
            "details": {k: str(v) for k, v in found.details.items()},
            "coverage": {},
            "options": [o.describe() for o in spec.options],  # name, choices, default, env, help
        }
        # Coverage is what the plugin registers; kernels are only collected for a usable backend
        # (registering may import device libraries), or in interpreter mode where that is possible.
        interpret = not found.available and plugins.probe(name, interpret=True).available
        if found.available or interpret:
            try:
                registry = plugins.registry(name, interpret=interpret, registry=Registry(ops))
                coverage = registry.coverage(name)
                entry["coverage"] = {op: sorted({_label(k) for k in kernels}) for op, kernels in coverage.items()}
                entry["batch_invariant"] = {op: any(k.batch_invariant for k in kernels) for op, kernels in coverage.items()}
                entry["coverage_source"] = "device" if found.available else "interpreter"
                try:
                    entry["env"] = plugins.env_report(name)
                except Exception as exc:  # a report that fails is shown, not fatal
                    entry["env"] = {"error": f"{type(exc).__name__}: {exc}"}
            except Exception as exc:
                entry["coverage_error"] = f"{type(exc).__name__}: {exc}"
        report["backends"].append(entry)
    return report


def _label(kernel) -> str:
    return (kernel.note or "kernel") + (" (batch-invariant)" if kernel.batch_invariant else "")


def _wrap(text: str, width: int, first: str, rest: str) -> list[str]:
    return textwrap.wrap(text, width=width, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False) or [first.rstrip()]


def format_report(report: dict, ops: list[str], width: int) -> str:
    """The text `deepinfer backends` prints: availability per backend, plugin failures, then per
    backend its coverage (op, then its kernels' notes wrapped under each other) and its options.
    Nothing is cut."""
    lines: list[str] = []
    name_width = max((len(b["name"]) for b in report["backends"]), default=4) + 1
    pad = " " * (name_width + 13)  # under the reason: name, state (11) and two spaces
    for b in report["backends"]:
        state = "available" if b["available"] else "unavailable"
        lines += _wrap(b["reason"], width, f"{b['name']:<{name_width}} {state:<11} ", pad)
        if b["hint"] and not b["available"]:
            lines += _wrap(f"hint: {b['hint']}", width, pad, pad + "  ")
        if b.get("env"):
            lines += _wrap(", ".join(f"{k} {v}" for k, v in b["env"].items()), width, pad, pad)
        if b.get("coverage_error"):
            lines += _wrap(f"kernels failed to register: {b['coverage_error']}", width, pad, pad + "  ")
    for f in report["plugin_failures"]:
        lines += _wrap(f"plugin {f['entry_point']} failed to load: {f['error']}", width, "", "  ")
    for b in report["backends"]:
        lines.append("")
        lines += _coverage_lines(b, ops, width)
        lines += _option_lines(b, width)
    return "\n".join(lines)


def _coverage_lines(b: dict, ops: list[str], width: int) -> list[str]:
    """A backend's coverage: op, then its kernels' notes wrapped under each other."""
    if not b["coverage"]:
        why = "kernels failed to register" if b.get("coverage_error") else "unavailable here, and not runnable in the Triton interpreter"
        return [f"{b['name']}: op coverage not collected ({why})"]
    covered = sum(1 for op in ops if b["coverage"].get(op))
    source = "" if b["coverage_source"] == "device" else " (as registered for the Triton interpreter: no device here)"
    invariant = sum(1 for op in ops if b.get("batch_invariant", {}).get(op))
    lines = _wrap(f"{b['name']}: {covered}/{len(ops)} ops covered, {invariant} with a batch-invariant kernel{source}", width, "", "  ")
    op_width = max(len(o) for o in ops) + 2
    for op in ops:
        notes = b["coverage"].get(op) or ["- (no kernel)"]
        first = " " * INDENT + op.ljust(op_width)
        rest = " " * (INDENT + op_width)
        for i, note in enumerate(notes):
            lines += _wrap(note, width, first if i == 0 else rest, rest + "  ")
    return lines


def _option_lines(b: dict, width: int) -> list[str]:
    """A backend's options: `name: a | b | c (default: a, or $VAR when set)`, its help under it."""
    options = b.get("options") or []
    if not options:
        return [f"options of {b['name']}: none"]
    lines = _wrap(f"options of {b['name']} (--backend-option KEY=VALUE, or LLM(backend_options={{...}})):", width, "", "  ")
    for o in options:
        default = f"default: {o['default']}" + (f", or ${o['env']} when set" if o.get("env") else "")
        lines += _wrap(f"{o['name']}: {' | '.join(o['choices'])} ({default})", width, " " * INDENT, " " * (INDENT + 4))
        lines += _wrap(o["help"], width, " " * (INDENT + 4), " " * (INDENT + 4))
    return lines


def run(args: argparse.Namespace) -> int:
    from deepinfer.plugins import load_plugins
    from deepinfer.registry import all_ops

    report = collect(load_plugins())
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    width = max(60, min(shutil.get_terminal_size((100, 24)).columns, 120))
    print(format_report(report, list(all_ops()), width))
    return 0
