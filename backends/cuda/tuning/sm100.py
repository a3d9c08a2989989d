"""Kernel configurations for sm100: {op: {variant: {BLOCK_M: ..., num_warps: ..., num_stages: ...}}}.

Kernel modules add their entries here; an op/variant missing here falls back to default.py.
"""

CONFIGS: dict[str, dict[str, dict]] = {
    # gemm: see default.py. Not measured on SM100: the SM90 choices (tensor descriptors work there too).
    "gemm": {
        "dense_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
        "dense_large": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "tma": True},
        "fp8_block_small": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 5},
        "fp8_block_large": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4, "tma": True, "k_pairs": False},
        "mxfp4_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
        "mxfp4_large": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        "quant_act": {"BLOCK_R": 16, "num_warps": 4},
    },
    # prefill: not measured on SM100 (no Blackwell lent); the SM90 tiles (sm90.py), which fit its shared memory.
    "prefill": {
        "large_head": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "tma": True},
        "small_head": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "tma": True},
        "large_head_fp32": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "tma": True},
        "small_head_fp32": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "tma": True},
    },
    # mla_decode: not measured on SM100 yet; the H200 (sm90) choices, which fit SM100's 228 KB of shared memory too.
    "mla_decode": {
        "rows_le16": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "ctas_per_sm": 2, "min_tokens_per_split": 256, "max_splits": 64},
        "rows_le32": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "ctas_per_sm": 2, "min_tokens_per_split": 256, "max_splits": 64},
        "rows_le64": {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "ctas_per_sm": 1, "min_tokens_per_split": 256, "max_splits": 64},
        "rows_gt64": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "ctas_per_sm": 1, "min_tokens_per_split": 256, "max_splits": 64},
        "combine": {"num_warps": 4},
    },
    # sampling (deepinfer_cuda.kernels.sampling): as sm90 (not measured on SM100): 128 candidates and
    # 128 group maxima sorted in registers (default.py keeps them small for the interpreter).
    "sample": {"rows": {"BLOCK": 4096, "TILE_C": 128, "N_GROUPS": 128, "num_warps": 16}},
}
