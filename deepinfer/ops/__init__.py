"""Op families. Importing this package declares every op in `deepinfer.registry.OPS`.

One module per family; each holds the ops' signatures, meanings and pure-torch references.
"""

from deepinfer.ops import activation, attention, gemm, moe, norm, rope, sampling  # noqa: F401
