"""`deepinfer backends`: every installed backend, whether it can run here and why, and its op coverage."""

from __future__ import annotations

import argparse
import json

from deepinfer.plugins import Plugins, load_plugins
from deepinfer.registry import Registry, all_ops


def add_parser(sub) -> None:
    p = sub.add_parser("backends", help="list backends, their availability and op coverage", description=__doc__)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


def collect(plugins: Plugins) -> dict:
    ops = all_ops()
    report = {"backends": [], "plugin_failures": [f.__dict__ for f in plugins.failures]}
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
        }
        # Coverage is what the plugin registers; kernels are only collected for a usable backend
        # (registering may import device libraries), or in interpreter mode where that is possible.
        interpret = not found.available and plugins.probe(name, interpret=True).available
        if found.available or interpret:
            try:
                registry = plugins.registry(name, interpret=interpret, registry=Registry(ops))
                entry["coverage"] = {
                    op: sorted({k.note or "kernel" for k in kernels}) for op, kernels in registry.coverage(name).items()
                }
                entry["coverage_source"] = "registered" if found.available else "registered (interpreter mode)"
                try:
                    entry["env"] = plugins.env_report(name)
                except Exception as exc:  # a report that fails is shown, not fatal
                    entry["env"] = {"error": f"{type(exc).__name__}: {exc}"}
            except Exception as exc:
                entry["coverage_error"] = f"{type(exc).__name__}: {exc}"
        report["backends"].append(entry)
    return report


def run(args: argparse.Namespace) -> int:
    report = collect(load_plugins())
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    ops = list(all_ops())
    for b in report["backends"]:
        state = "available" if b["available"] else "unavailable"
        print(f"{b['name']:<10} {state:<11} {b['reason']}")
        if b["hint"] and not b["available"]:
            print(f"{'':<10} {'':<11} hint: {b['hint']}")
        if b.get("env"):
            print(f"{'':<22}" + ", ".join(f"{k} {v}" for k, v in b["env"].items()))
        if b.get("coverage_error"):
            print(f"{'':<22}kernels failed to register: {b['coverage_error']}")
    for f in report["plugin_failures"]:
        print(f"plugin {f['entry_point']} failed to load: {f['error']}")
    names = [b["name"] for b in report["backends"]]
    print("\nop coverage (kernels registered per backend; '-' none)")
    width = max(len(o) for o in ops) + 2
    print("op".ljust(width) + "".join(n.ljust(22) for n in names))
    for op in ops:
        cells = []
        for b in report["backends"]:
            if not b["coverage"]:
                cells.append("n/a (unavailable)" if not b["available"] else "-")
            else:
                notes = b["coverage"].get(op) or []
                cells.append(", ".join(notes) if notes else "-")
        print(op.ljust(width) + "".join(c[:21].ljust(22) for c in cells))
    for b in report["backends"]:
        if b["coverage"]:
            covered = sum(1 for op in ops if b["coverage"].get(op))
            print(f"{b['name']}: {covered}/{len(ops)} ops covered ({b.get('coverage_source')})")
    return 0
