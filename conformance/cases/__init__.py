"""Conformance cases: named, seeded recipes for an op's inputs, one module per op family, each with a
`CASES` list (every module of this package must have one; `all_cases` finds them by iterating it).

A case's `make(gen, dtype)` returns the op's keyword arguments: tensors drawn from `gen` (a seeded
torch.Generator) in the case's dtype, and plain parameters. Cases cover the edges, not only the
happy path; each must run in seconds under the Triton interpreter on a CPU.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Case:
    op: str
    name: str
    dtype: torch.dtype
    make: Callable[[torch.Generator, torch.dtype], dict[str, Any]]

    @property
    def id(self) -> str:
        return f"{self.op}.{self.name}.{str(self.dtype).removeprefix('torch.')}"

    @property
    def seed(self) -> int:
        """Stable across runs and machines, and the recipe's (op.name), not the case's: a recipe's dtypes
        draw the same numbers (`randn` draws float64, then casts), so what does not depend on the dtype
        (integer tensors, float32 parameters, integer outputs) is one tensor, stored once (golden_io)."""
        return zlib.crc32(f"{self.op}.{self.name}".encode())

    def inputs(self) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(self.seed)
        return self.make(gen, self.dtype)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def drawn_as(recipe: str, make):
    """`make` drawing from recipe `recipe`'s seed (an "op.name" of the same op): the inputs both draw first are
    equal, so the golden set stores them once (and outputs that do not depend on what is drawn after them)."""
    return lambda gen, dtype: make(torch.Generator().manual_seed(zlib.crc32(recipe.encode())), dtype)


def randint(gen: torch.Generator, low: int, high: int, *shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=gen, dtype=torch.int64).to(dtype)


def all_cases() -> list[Case]:
    """The `CASES` of every module of this package (found by iterating it: a new case module is
    picked up by existing), in module order: the packaged golden set's cases. Installed packages'
    cases are out_of_tree.py's."""
    from deepinfer.discovery import submodules

    cases = [c for module in submodules(__name__) for c in module.CASES]
    ids = [c.id for c in cases]
    duplicated = {i for i in ids if ids.count(i) > 1}
    if duplicated:
        raise ValueError(f"conformance case ids are not unique: {sorted(duplicated)}")
    return cases
