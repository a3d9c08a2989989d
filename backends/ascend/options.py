"""The ascend backend's options (deepinfer.options): declared on its BackendSpec, read by the
kernels' `when` predicates through the ResolveContext. Light: imported when the backend is declared."""

from __future__ import annotations

from deepinfer.options import BackendOption

NPU_FAST_PATHS = BackendOption(
    "npu_fast_paths",
    ("off", "on", "all"),
    "off",
    "torch_npu fused ops in place of the Triton kernels (never run on Ascend hardware yet): off = the Triton kernels "
    "serve every op (the checked path); on = the fast paths that follow the op contracts, where the chip, torch_npu "
    "and the model allow; all = also mla_decode's strided cache views and the 950's MXFP8 x MXFP4 linear (A8W4)",
)

SIM_CHIP = BackendOption(
    "sim_chip",
    ("910B", "950"),
    "910B",
    "under --interpret only: the chip whose core counts and on-chip buffer the kernels size themselves by",
    env="DEEPINFER_ASCEND_SIM_CHIP",
)

OPTIONS = (NPU_FAST_PATHS, SIM_CHIP)
