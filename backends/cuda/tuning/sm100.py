"""Kernel configurations for sm100: {op: {variant: {BLOCK_M: ..., num_warps: ..., num_stages: ...}}}.

Kernel modules add their entries here; an op/variant missing here falls back to default.py.

No Blackwell GPU has been lent yet, so nothing here is measured on SM100: gemm, prefill, mla_decode
and sample take the H200's (sm90) choices, which fit SM100's 228 KB of shared memory too (the
tensor-descriptor paths work there as well). `deepinfer bench compile --arch sm100` checks that they
compile. Replace an entry by its own dict once it is measured on SM100.
"""

from deepinfer_cuda.tuning.sm90 import CONFIGS as SM90

CONFIGS: dict[str, dict[str, dict]] = {op: SM90[op] for op in ("gemm", "prefill", "mla_decode", "sample")}
