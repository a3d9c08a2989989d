"""Opening a benchmark's runtime in deterministic mode, where its comparisons need it.

`bench speculative` and `bench prefix-reuse` compare each request's greedy tokens across engines (with speculation
and without; with tiers and without), which holds bit for bit only with batch-invariant kernels. A backend without
one for an op is a one-line error saying why the benchmark asks for them and what --no-deterministic measures.
"""

from __future__ import annotations

from deepinfer.registry import RegistryError


def open_deterministic_runtime(backend: str, dtype, deterministic: bool, why: str, instead: str, **options):
    """open_runtime(backend, dtype=dtype, deterministic=deterministic, **options); in deterministic mode a missing
    batch-invariant kernel is "<the problem>: <why>; --no-deterministic <instead>"."""
    from deepinfer.runtime import open_runtime

    try:
        return open_runtime(backend, dtype=dtype, deterministic=deterministic, **options)
    except RegistryError as exc:
        if not deterministic or not str(exc).startswith("deterministic mode:"):
            raise
        problem = str(exc).split(";")[0]
        raise RegistryError(f"{problem}: {why}; --no-deterministic {instead}") from None
