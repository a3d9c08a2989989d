"""Run one backend's kernels over the golden inputs, in a process of its own.

    python -m deepinfer_conformance.worker --backend NAME --out DIR [--golden DIR ...] [--interpret] [--op OP ...] [--backend-option KEY=VALUE ...]

Backends run in separate processes because their runtimes cannot share one (torch_npu refuses a
process that also holds CUDA). Writes DIR/NAME.safetensors (each case's canonicalised outputs, on
the CPU) and DIR/NAME.json (per case: status "ran" | "missing" | "no kernel" | "error" | "FAIL",
the kernel's note, the error message, seconds). The cases are those of every `--golden` folder (default: the
packaged set; the runner adds the folder of out-of-tree cases it computed).

A kernel must leave its inputs as it found them, except the argument its op declares `in_place`:
each input tensor is compared bit for bit with a copy taken before the call, and a changed one makes
the case "FAIL", naming the argument (`changed_inputs`), whatever the outputs.

Each case's kernel is chosen as an engine would choose it for the model the case stands for: the
backend's options, and the ModelFacts the case's call implies (`case_facts`: a gate case's routing,
an attention case's head sizes), so kernels that serve only some models are checked on exactly the
cases they would serve.

An op only some model types call (`OpSpec.model_types`, DeepSeek-V4's) that the backend has no
kernel for at all is "no kernel", not "missing": the backend still serves every other model, and
those models run there only through the explicit reference fallback (`--allow-fallback`). The
runner shows such rows and names the ops, and they do not fail the run; a backend that registers
a kernel for the op is held to every case of it again.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepinfer.errors import UserError
from deepinfer.ops import kv_cache_format
from deepinfer.options import parse_assignments
from deepinfer.plugins import load_plugins
from deepinfer.registry import ModelFacts, RegistryError, ResolveContext, all_ops
from deepinfer_conformance.golden_io import GOLDEN_DIR, GoldenSet, key

NO_KERNEL = "no kernel"  # status of a model-specific op the backend has no kernel for (see above)


def case_format(op, case) -> str | None:
    """The weight format the case's call runs in: its own, else the op's default `fmt` (a dense gemm case
    passes none), so the kernel checked is the one a model's call in that format dispatches to."""
    if case.fmt is not None or not op.formats:
        return case.fmt
    return inspect.signature(op.reference).parameters["fmt"].default


def to_device(kwargs: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def snapshot_inputs(kwargs: dict, in_place: str | None) -> dict[str, torch.Tensor]:
    """Copies of the call's input tensors, except the argument the op declares it writes
    (`OpSpec.in_place`): a kernel must leave the others as it found them."""
    return {name: value.clone() for name, value in kwargs.items() if isinstance(value, torch.Tensor) and name != in_place}


def changed_inputs(before: dict[str, torch.Tensor], kwargs: dict) -> list[str]:
    """The inputs whose shape, dtype or bits differ from their copy in `before` (bits, not values:
    a NaN left in place is unchanged, a -0.0 written over 0.0 is a change)."""
    return [name for name, copy in before.items() if not _same_bits(copy, kwargs[name])]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def changed_message(changed: list[str], in_place: str | None) -> str:
    names = ", ".join(repr(n) for n in changed)
    allowed = f"the op writes {in_place!r} only" if in_place else "the op writes none of its inputs"
    return f"the kernel changed its input{'s' if len(changed) > 1 else ''} {names} ({allowed})"


def case_facts(op: str, kwargs: dict) -> ModelFacts:
    """The ModelFacts of the model a case stands for: what its call says about the model's routing
    (gate) and head sizes (prefill, mla_decode); nothing for the other ops."""
    spec = all_ops()[op]
    call = spec.signature.bind(**kwargs)
    call.apply_defaults()
    a = call.arguments
    if op == "gate":
        return ModelFacts(
            num_experts=a["logits"].shape[-1], top_k=a["top_k"], score_func=a["score_func"], n_group=a["n_group"],
            topk_group=a["topk_group"], renormalize=a["renormalize"], correction_bias=a["correction_bias"] is not None,
        )  # fmt: skip
    if op == "prefill":
        return ModelFacts(num_heads=a["q"].shape[1], qk_head_dim=a["q"].shape[-1], v_head_dim=a["v"].shape[-1], sliding_window=a["sliding_window"] or 0)
    if op == "mla_decode":
        return ModelFacts(
            num_heads=a["q_nope"].shape[2], kv_lora_rank=a["q_nope"].shape[-1], qk_rope_head_dim=a["q_rope"].shape[-1],
            sliding_window=a["sliding_window"] or 0, kv_block_size=a["kv_cache"].shape[1], kv_cache_fp8=kv_cache_format.is_fp8(a["kv_cache"]),
        )  # fmt: skip
    if spec.model_types:  # an op of some models only (DeepSeek-V4's): the case stands for the first
        return ModelFacts(model_type=spec.model_types[0])
    return ModelFacts()


def run_backend(
    backend: str, out_dir: Path, golden_dirs: Sequence[Path] = (GOLDEN_DIR,), interpret: bool = False, ops_filter: list[str] | None = None,
    options: dict[str, str] | None = None,
    deterministic: bool = False,
) -> dict:
    """options: the backend's options (unknown ones and bad values: one-line errors, before any case).
    deterministic: run the kernels deterministic mode chooses (the batch-invariant ones)."""
    plugins = load_plugins()
    spec = plugins.require(backend, interpret=interpret)
    device = torch.device(spec.device(interpret))
    options = spec.resolve_options(options)
    registry = plugins.registry(backend, interpret=interpret, options=options)
    ops = all_ops()
    golden = GoldenSet(golden_dirs)
    outputs: dict[str, torch.Tensor] = {}
    results: dict[str, dict] = {}
    for case in golden.cases:
        if ops_filter and case.op not in ops_filter:
            continue
        op = ops[case.op]
        inputs = golden.inputs(case)
        ctx = ResolveContext(backend=backend, device=device, dtype=case.torch_dtype, options=options, model=case_facts(case.op, inputs),
                             deterministic=deterministic)  # fmt: skip
        try:
            kernel = registry.choose(ctx, case.op, case_format(op, case))
        except RegistryError as exc:  # chosen by an option, but it cannot run here
            results[case.id] = {"status": "error", "error": str(exc)}
            continue
        if kernel is None and op.model_types and not registry.candidates(backend, case.op):
            models = ", ".join(op.model_types)
            results[case.id] = {
                "status": NO_KERNEL,
                "error": f"no {backend} kernel for {case.op} (an op of {models} models only; those run on {backend} only with --allow-fallback)",
            }
            continue
        if kernel is None:
            fmt = f"[{case.fmt}]" if case.fmt else ""
            which = "batch-invariant kernel" if deterministic else "kernel"
            results[case.id] = {"status": "missing", "error": f"no {backend} {which} for {case.op}{fmt} in {case.dtype}"}
            continue
        kwargs = to_device(inputs, device)
        before = snapshot_inputs(kwargs, op.in_place)
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
        seconds = round(time.perf_counter() - start, 4)
        changed = changed_inputs(before, kwargs)
        if changed:
            results[case.id] = {"status": "FAIL", "note": kernel.note, "error": changed_message(changed, op.in_place), "changed_inputs": changed}
            continue
        for name, value in produced.items():
            if value is not None:
                outputs[key(case.id, "out", name)] = value.detach().to("cpu").contiguous()
        none_outputs = [n for n, v in produced.items() if v is None]
        results[case.id] = {"status": "ran", "note": kernel.note, "seconds": seconds, "none_outputs": none_outputs}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(outputs, str(out_dir / f"{backend}.safetensors"))
    report = {"backend": backend, "device": str(device), "interpret": interpret, "deterministic": deterministic, "options": options, "cases": results}
    (out_dir / f"{backend}.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepinfer_conformance.worker")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--golden", type=Path, action="append", default=None, help="golden folder (repeatable; default: the packaged one)")
    parser.add_argument("--interpret", action="store_true")
    parser.add_argument("--op", action="append", default=None)
    parser.add_argument("--backend-option", action="append", default=None, metavar="KEY=VALUE")
    parser.add_argument("--deterministic", action="store_true")
    args = parser.parse_args(argv)
    try:
        run_backend(args.backend, args.out, args.golden or [GOLDEN_DIR], args.interpret, args.op, parse_assignments(args.backend_option),
                    args.deterministic)  # fmt: skip
    except UserError as exc:
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
