"""Run one backend's kernels over the golden inputs, in a process of its own.

    python -m deepinfer_conformance.worker --backend NAME --out DIR [--interpret] [--op OP ...]

Backends run in separate processes because their runtimes cannot share one (torch_npu refuses a
process that also holds CUDA). Writes DIR/NAME.safetensors (each case's canonicalised outputs, on
the CPU) and DIR/NAME.json (per case: status "ran" | "missing" | "error", the kernel's note, the
error message, seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepinfer.errors import UserError
from deepinfer.plugins import load_plugins
from deepinfer.registry import ResolveContext, all_ops
from deepinfer_conformance.golden_io import GOLDEN_DIR, GoldenTensors, key, read_cases


def to_device(kwargs: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def run_backend(backend: str, out_dir: Path, golden_dir: Path = GOLDEN_DIR, interpret: bool = False, ops_filter: list[str] | None = None) -> dict:
    plugins = load_plugins()
    spec = plugins.require(backend, interpret=interpret)
    device = torch.device(spec.device(interpret))
    registry = plugins.registry(backend, interpret=interpret)
    ops = all_ops()
    golden = GoldenTensors(golden_dir)
    outputs: dict[str, torch.Tensor] = {}
    results: dict[str, dict] = {}
    for case in read_cases(golden_dir):
        if ops_filter and case.op not in ops_filter:
            continue
        op = ops[case.op]
        ctx = ResolveContext(backend=backend, device=device, dtype=case.torch_dtype)
        kernel = registry.pick(ctx, case.op, case.fmt)
        if kernel is None:
            fmt = f"[{case.fmt}]" if case.fmt else ""
            results[case.id] = {"status": "missing", "error": f"no {backend} kernel for {case.op}{fmt} in {case.dtype}"}
            continue
        kwargs = to_device(golden.inputs(case), device)
        start = time.perf_counter()
        try:
            produced = op.name_outputs(kernel.fn(**kwargs))
            if op.canonicalize is not None:
                produced = op.canonicalize(kwargs, produced)
            if device.type != "cpu":
                getattr(torch, device.type).synchronize()
        except Exception as exc:
            last = traceback.extract_tb(exc.__traceback__)[-1]
            results[case.id] = {"status": "error", "note": kernel.note, "error": f"{type(exc).__name__}: {exc} ({Path(last.filename).name}:{last.lineno})"}
            continue
        for name, value in produced.items():
            if value is not None:
                outputs[key(case.id, "out", name)] = value.detach().to("cpu").contiguous()
        results[case.id] = {"status": "ran", "note": kernel.note, "seconds": round(time.perf_counter() - start, 4), "none_outputs": [n for n, v in produced.items() if v is None]}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(outputs, str(out_dir / f"{backend}.safetensors"))
    report = {"backend": backend, "device": str(device), "interpret": interpret, "cases": results}
    (out_dir / f"{backend}.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepinfer_conformance.worker")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--golden", type=Path, default=GOLDEN_DIR)
    parser.add_argument("--interpret", action="store_true")
    parser.add_argument("--op", action="append", default=None)
    args = parser.parse_args(argv)
    try:
        run_backend(args.backend, args.out, args.golden, args.interpret, args.op)
    except UserError as exc:
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
