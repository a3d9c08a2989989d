"""Reading and writing the golden set: `<op>.safetensors` per op plus one `manifest.json` per folder.

Tensor keys are `<case id>::in::<argument>` and `<case id>::out::<output>`; the manifest holds each
case's plain parameters, compare modes, tolerance and reduction length. A tensor bit-identical to one
stored earlier in the same op's file (a rope table two cases share, the integer outputs of a recipe's
two dtypes) is stored once: the later case's `stored_as` maps its `in::<argument>` / `out::<output>`
to the key that holds it. A parameter that is a torch.dtype (linear's out_dtype) is stored as {"dtype": name}
(JSON has no dtype) and read back as the dtype.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
MANIFEST = "manifest.json"
SEP = "::"


@dataclass
class CaseRecord:
    id: str
    op: str
    name: str
    dtype: str
    seed: int
    params: dict[str, Any]  # plain (non-tensor) keyword arguments
    tensor_inputs: list[str]
    outputs: list[str]  # outputs stored as tensors (None outputs are listed in none_outputs)
    none_outputs: list[str]
    compare: dict[str, str]
    rtol: float
    atol: float
    reduction_length: int
    fmt: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    stored_as: dict[str, str] = field(default_factory=dict)  # "in::x" -> the key of the identical tensor stored for another case

    def tensor_key(self, kind: str, name: str) -> str:
        """The key of this case's input ("in") or output ("out") `name` in its op's file."""
        return self.stored_as.get(f"{kind}{SEP}{name}", key(self.id, kind, name))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def atol_scaled(self) -> float:
        return self.atol * self.reduction_length


def key(case_id: str, kind: str, name: str) -> str:
    return f"{case_id}{SEP}{kind}{SEP}{name}"


def split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the tensors, the plain parameters as the manifest stores them: dtypes encoded, `decode_param`)."""
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    params = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    for k, v in params.items():
        if not (_is_plain(v) or isinstance(v, torch.dtype)):
            raise TypeError(f"case argument {k!r} is a {type(v).__name__}: only tensors, plain values, tuples of them and dtypes are stored")
    return tensors, {k: _encode_param(v) for k, v in params.items()}


def _encode_param(value: Any) -> Any:
    return {"dtype": str(value).removeprefix("torch.")} if isinstance(value, torch.dtype) else value


def decode_param(value: Any) -> Any:
    """A stored parameter as the op takes it: {"dtype": name} is that torch.dtype, anything else itself."""
    if isinstance(value, dict) and set(value) == {"dtype"}:
        return getattr(torch, value["dtype"])
    return value


def _is_plain(value: Any) -> bool:
    """None, a bool, int, float or str, or a tuple of such (nested: e.g. decode_plan's compressor kinds)."""
    return value is None or isinstance(value, (bool, int, float, str)) or (isinstance(value, tuple) and all(map(_is_plain, value)))


def _as_tuples(value: Any) -> Any:
    """A parameter as the case gave it: JSON wrote its tuples as lists."""
    return tuple(map(_as_tuples, value)) if isinstance(value, list) else value


def read_manifest(golden_dir: Path = GOLDEN_DIR) -> dict[str, Any]:
    path = Path(golden_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no golden manifest at {path}; run `python -m deepinfer_conformance.generate`")
    return json.loads(path.read_text())


def read_cases(golden_dir: Path = GOLDEN_DIR) -> list[CaseRecord]:
    return [CaseRecord(**{**c, "params": {k: _as_tuples(v) for k, v in c["params"].items()}}) for c in read_manifest(golden_dir)["cases"]]


class GoldenTensors:
    """Lazily loads each op's safetensors file once."""

    def __init__(self, golden_dir: Path = GOLDEN_DIR):
        self.dir = Path(golden_dir)
        self._files: dict[str, dict[str, torch.Tensor]] = {}

    def _file(self, op: str) -> dict[str, torch.Tensor]:
        if op not in self._files:
            self._files[op] = load_file(str(self.dir / f"{op}.safetensors"))
        return self._files[op]

    def inputs(self, case: CaseRecord) -> dict[str, Any]:
        tensors = self._file(case.op)
        kwargs = {name: tensors[case.tensor_key("in", name)].clone() for name in case.tensor_inputs}  # (a kernel may write in place)
        kwargs.update({name: decode_param(value) for name, value in case.params.items()})
        return kwargs

    def outputs(self, case: CaseRecord) -> dict[str, torch.Tensor | None]:
        tensors = self._file(case.op)
        out: dict[str, torch.Tensor | None] = {name: tensors[case.tensor_key("out", name)] for name in case.outputs}
        out.update({name: None for name in case.none_outputs})
        return out


class GoldenSet:
    """Several golden folders read as one set: the packaged one (or `--golden`) and the folder of
    out-of-tree cases a conformance run computes at its start (out_of_tree.py). A case id in two
    folders is an error."""

    def __init__(self, dirs: Sequence[Path]):
        self.dirs = [Path(d) for d in dirs]
        self.cases: list[CaseRecord] = []
        self._tensors: dict[str, GoldenTensors] = {}
        for folder in self.dirs:
            tensors = GoldenTensors(folder)
            for case in read_cases(folder):
                if case.id in self._tensors:
                    raise ValueError(f"golden case {case.id} is in both {self._tensors[case.id].dir} and {folder}")
                self.cases.append(case)
                self._tensors[case.id] = tensors

    def inputs(self, case: CaseRecord) -> dict[str, Any]:
        return self._tensors[case.id].inputs(case)

    def outputs(self, case: CaseRecord) -> dict[str, torch.Tensor | None]:
        return self._tensors[case.id].outputs(case)


def record_to_json(record: CaseRecord) -> dict[str, Any]:
    return asdict(record)
