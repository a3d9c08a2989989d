"""Generate the golden set deterministically from the float64 reference.

    python -m deepinfer_conformance.generate            # rewrite conformance/golden/
    python -m deepinfer_conformance.generate --check    # verify the stored set is what the cases give

Each case's inputs are drawn from a generator seeded by the case id, in the case dtype. The
reference then runs on float64-upcast copies (integer, fp8 and packed tensors untouched; ops whose
golden_precision is "native", like sampling, run as given) and its outputs are stored in the case
dtype (or the one the call chooses, `OpSpec.result_dtype`: linear's out_dtype), after the op's canonicalisation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deepinfer.registry import OpSpec, all_ops
from deepinfer_conformance.cases import Case, all_cases
from deepinfer_conformance.golden_io import GOLDEN_DIR, MANIFEST, SEP, CaseRecord, GoldenTensors, key, read_cases, record_to_json, split_kwargs

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def upcast(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to(torch.float64) if isinstance(v, torch.Tensor) and v.dtype in FLOATS else v for k, v in kwargs.items()}


def output_dtype(spec: OpSpec, case: Case, kwargs: dict[str, Any]) -> torch.dtype:
    """The dtype a case's outputs are stored in and held to: the one its call chooses (`OpSpec.result_dtype`), else the case's."""
    chosen = spec.result_dtype(kwargs) if spec.result_dtype is not None else None
    return chosen or case.dtype


def run_golden(spec: OpSpec, case: Case, kwargs: dict[str, Any]) -> dict[str, torch.Tensor | None]:
    call = upcast(kwargs) if spec.golden_precision == "float64" else {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    outputs = spec.name_outputs(spec.reference(**call))
    if spec.canonicalize is not None:
        outputs = spec.canonicalize(kwargs, outputs)
    stored: dict[str, torch.Tensor | None] = {}
    for name, value in outputs.items():
        if value is not None and value.dtype == torch.float64 and spec.golden_precision == "float64":
            # An in-place op's output keeps the dtype of the buffer it writes (a bf16 cache fed float32 values).
            value = value.to(kwargs[spec.in_place].dtype if spec.in_place else output_dtype(spec, case, kwargs))
        stored[name] = value
    return stored


class OpFile:
    """One op's tensors as they will be stored: a tensor bit-identical to one already held (same
    dtype, shape and bytes) is not stored again; `add` returns the key that holds it."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self._by_content: dict[tuple, list[str]] = {}

    def add(self, name: str, t: torch.Tensor) -> str:
        t = t.contiguous()
        content = (t.dtype, tuple(t.shape), hashlib.sha256(_bytes(t).numpy().tobytes()).hexdigest())
        for held in self._by_content.get(content, []):
            if same_bits(self.tensors[held], t):
                return held
        self.tensors[name] = t
        self._by_content.setdefault(content, []).append(name)
        return name


def build(cases: list[Case]) -> tuple[dict[str, dict[str, torch.Tensor]], list[CaseRecord]]:
    ops = all_ops()
    files: dict[str, dict[str, torch.Tensor]] = {}
    op_files: dict[str, OpFile] = {}
    records = []
    for case in cases:
        spec = ops[case.op]
        kwargs = case.inputs()
        tensors, params = split_kwargs(kwargs)
        outputs = run_golden(spec, case, kwargs)
        tol = spec.tolerance(output_dtype(spec, case, kwargs))
        bucket = op_files.setdefault(case.op, OpFile(files.setdefault(case.op, {})))
        stored_as = {}
        for kind, named in (("in", tensors), ("out", outputs)):
            for name, t in named.items():
                if t is None:
                    continue
                own = key(case.id, kind, name)
                held = bucket.add(own, t)
                if held != own:
                    stored_as[f"{kind}{SEP}{name}"] = held
        records.append(
            CaseRecord(
                id=case.id,
                op=case.op,
                name=case.name,
                dtype=str(case.dtype).removeprefix("torch."),
                seed=case.seed,
                params=params,
                tensor_inputs=sorted(tensors),
                outputs=[n for n, t in outputs.items() if t is not None],
                none_outputs=[n for n, t in outputs.items() if t is None],
                compare=dict(spec.compare),
                rtol=tol.rtol,
                atol=tol.atol,
                reduction_length=int(spec.reduction_length(kwargs)),
                fmt=params.get("fmt"),
                stored_as=stored_as,
            )
        )
    return files, records


def write(golden_dir: Path, files: dict[str, dict[str, torch.Tensor]], records: list[CaseRecord]) -> None:
    golden_dir.mkdir(parents=True, exist_ok=True)
    for old in golden_dir.glob("*.safetensors"):
        if old.stem not in files:
            old.unlink()
    for op_name, tensors in files.items():
        save_file(tensors, str(golden_dir / f"{op_name}.safetensors"), metadata={"op": op_name})
    manifest = {
        "format": 2,  # 2: cases may have `stored_as` (golden_io)
        "generated_by": "python -m deepinfer_conformance.generate",
        "torch": torch.__version__.split("+")[0],
        "cases": [record_to_json(r) for r in records],
    }
    (golden_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def check(golden_dir: Path, files: dict[str, dict[str, torch.Tensor]], records: list[CaseRecord]) -> list[str]:
    """Differences between the stored golden set and a fresh generation (inputs bit-exact,
    outputs within a thousandth of their tolerance: float64 libm results may differ by an ulp
    across torch builds)."""
    problems = []
    stored = {r.id: r for r in read_cases(golden_dir)}
    fresh_ids = [r.id for r in records]
    if sorted(stored) != sorted(fresh_ids):
        problems.append(f"case list differs: missing {sorted(set(fresh_ids) - set(stored))}, stale {sorted(set(stored) - set(fresh_ids))}")
    golden = GoldenTensors(golden_dir)
    for record in records:
        if record.id not in stored:
            continue
        old_in = golden.inputs(stored[record.id])
        old_out = golden.outputs(stored[record.id])
        for name in record.tensor_inputs:
            if not same_bits(old_in[name], files[record.op][record.tensor_key("in", name)]):
                problems.append(f"{record.id}: input {name} differs")
        for name in record.outputs:
            new = files[record.op][record.tensor_key("out", name)]
            old = old_out[name]
            if record.compare[name] == "exact" or not old.is_floating_point():
                if not same_bits(old, new):
                    problems.append(f"{record.id}: output {name} differs")
            else:
                bound = 1e-3 * (record.atol_scaled() + record.rtol * old.double().abs())
                # equal values pass as they are (an -inf logit: -inf - -inf is nan, never within a bound)
                if not bool(((old.double() == new.double()) | ((old.double() - new.double()).abs() <= bound)).all()):
                    problems.append(f"{record.id}: output {name} differs beyond 1e-3 of its tolerance")
    return problems


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().flatten().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_bytes(a), _bytes(b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepinfer_conformance.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=GOLDEN_DIR, help="golden folder (default: the packaged one)")
    parser.add_argument("--check", action="store_true", help="verify instead of writing; exit 1 on any difference")
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    files, records = build(all_cases())
    if args.check:
        problems = check(args.out, files, records)
        for p in problems:
            print(p)
        print(f"{len(records)} cases checked, {len(problems)} differences")
        return 1 if problems else 0
    write(args.out, files, records)
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    print(f"wrote {len(records)} cases for {len(files)} ops to {args.out} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
