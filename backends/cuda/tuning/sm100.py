"""Kernel configurations for sm100 (B200/B300, Blackwell): {op: {variant: {...}}}; missing entries fall back to default.py.

NONE of these was measured on SM100 hardware: no Blackwell GPU has been lent. Each entry is chosen
by reasoning about the hardware and checked only by ahead-of-time compilation (`deepinfer bench
compile --arch sm100`: compiles, no spills, registers, shared memory, matrix instruction class).
Replace an entry by a measured one as soon as an SM100 runs it (`python -m deepinfer_cuda.bench.gemm --sweep`).

What the choices rest on (Triton's Blackwell tutorials 09-persistent-matmul and
10-block-scaled-matmul, and the SM100 matmul configurations they and FlagGems/vLLM use):
- tcgen05.mma accumulates in tensor memory (TMEM, 128 lanes x 512 columns of 32 bits per SM), not in
  registers, and issues from one thread: the MMA tile is 128 rows (M = 64 exists but halves the
  rate), N up to 256. The registers only see the accumulator in the epilogue, so a 128 x 256 float32
  tile needs 8 warps (256 registers/thread with 4) and a 128 x 128 one fits 4 or 8.
- 228 KB of shared memory per SM (227 KB per block): one more pipeline stage than SM90 at the same
  tile where it fits under the 200 KB budget of `kernels/gemm.py` (`_fit_shared_memory`).
- Block-scaled MMA (kind::mxf8f6f4 / mxf4) needs both operands in MX formats and a 128-row M side:
  the mxfp8 and mxfp4_a8 kernels put the weight tile there (BLOCK_N = 128) and the tokens on the N side.
- Decode (<= 64 rows per expert) is weight streaming, memory-bound: the tile only needs enough
  bytes in flight; 16-row tiles run mma.sync (tcgen05 needs M >= 64) at no cost to the bound.
"""

CONFIGS: dict[str, dict[str, dict]] = {
    "gemm": {
        # decode, dense: SM90's measured tile (95% of copy on the H200); 16 x 256 + 256 x 64 bf16 = 40 KB a stage, 4 stages.
        "dense_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
        # prefill, dense: 128 x 256 tcgen05 tile through TMA, K 64 (128-byte rows, the TMA swizzle), 4 stages = 192 KB
        # (SM90 fits 3); 8 warps for the 128 x 256 float32 epilogue.
        "dense_large": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4, "tma": True},
        # decode, fp8_block: BLOCK_N 64 (SM90's 128 spills on SM100 with 16-row tiles: the float32 product of each
        # 128-K group is promoted in registers); 6 stages of 16 x 128 + 128 x 64 bytes keep the weight stream deep.
        "fp8_block_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 6},
        # prefill, fp8_block: 128 x 128 x 128 (one scale group per step) through TMA, 5 stages = 160 KB; 8 warps for the
        # per-group promotion (the product leaves TMEM every 128 K, as DeepGEMM's promotion does).
        "fp8_block_large": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 5, "tma": True, "k_pairs": False},
        "fp8_block_medium": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 5, "tma": True, "k_pairs": False},
        # mxfp4 (W4A16: x stays bf16, so Triton upcasts e2m1 and runs kind::f16): decode as SM90 (64 x 64 x 256, 4 stages).
        "mxfp4_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
        # prefill mxfp4: 128 x 128 with K 64 (SM90's K 128 spills 288 B on SM100: the upcast e2m1 tile lives in registers).
        "mxfp4_large": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4},
        # mxfp8 (both operands MX, block-scaled tcgen05): BLOCK_N = the MMA's 128-row side (weights), BLOCK_M its N side
        # (tokens, lowered to the rows: 16 for decode). The operands are pointer loads (no TMA yet), whose 64-bit address
        # tiles take registers: decode K 128 (128-byte e4m3 rows) needs 8 warps (4 spill 148 B); prefill takes K 64 (K 128
        # spills 764 B at 8 warps, 1940 B at 4; BLOCK_M 64 spills 232 B).
        "mxfp8_small": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 6},
        "mxfp8_large": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4},
        # mxfp4_a8 (W4A8 MX: mxfp4 weights, MX FP8 activations; e4m3 x e2m1 block-scaled tcgen05): the mxfp8 layout,
        # BLOCK_N 128 = the weight side (BLOCK_N 64 lowers to plain kind::f16). Compile check (Triton 3.9): decode
        # 64x128x128 w8 s6 128 regs (K 256: 249 regs at 8 warps, 452 B spills at 4); prefill 128x128x64 w8 s4 254 regs
        # (K 128 spills 184 B; BLOCK_M 64 x K 128: 236 regs, 0 spills, the fallback if 254 turns out to spill elsewhere).
        "mxfp4_a8_small": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 6},
        "mxfp4_a8_large": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4},
        # fp8_block32 (W8A16: x stays bf16, dot_scaled(bf16, e4m3) -> the e4m3 upcast and kind::f16, as mxfp4's): NOT MEASURED,
        # chosen by the compile check (Triton 3.9). Decode 64x64x128 w8 s3: 124 regs at 8 rows, 248 on wo_a's 64-row groups
        # (default's 4 warps spill 168 B there). Prefill 128x64x64 w8 s3: 249 / 230 regs, no spills (linear, contiguous
        # grouped); 128x128x128 s3 spills 2140 B, 128x128x64 72-724 B, 128x64x128 80 B.
        "fp8_block32_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        "fp8_block32_large": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        "quant_act": {"BLOCK_R": 16, "num_warps": 4, "elems_per_thread": 8},
        "quant_act_mx": {"BLOCK_R": 16, "GROUPS": 4, "num_warps": 4},
    },
    # prefill (FA2, K/V through TMA): SM90's tiles. BLOCK_N 128 at 192/128 head dims would need ~208 KB for 2 stages,
    # leaving no room for the third stage that hides the TMA latency; BLOCK_M 128 is tcgen05's native M.
    "prefill": {
        "large_head": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "tma": True},
        "small_head": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "tma": True},  # (no compile case: kept as SM90)
        "large_head_fp32": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "tma": True},
        "small_head_fp32": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "tma": True},
    },
    # mla_decode: SM90's choices. rows <= 64 are memory-bound (16-head tiles run mma.sync); rows_gt64 (128 heads)
    # keeps 64 x 64: a 128-row tile's 128 x 512 float32 output would take all of TMEM's 512 columns.
    "mla_decode": {
        "rows_le16": {
            "BLOCK_N": 64, "num_warps": 4, "fp8_num_warps": 8, "num_stages": 2, "ctas_per_sm": 2,
            "min_tokens_per_split": 256, "max_splits": 64, "wide_combine": True,
        },
        "rows_le32": {
            "BLOCK_N": 64, "num_warps": 4, "fp8_num_warps": 8, "num_stages": 2, "ctas_per_sm": 2,
            "min_tokens_per_split": 256, "max_splits": 64, "wide_combine": True,
        },
        "rows_le64": {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "ctas_per_sm": 1, "min_tokens_per_split": 256, "max_splits": 64, "wide_combine": True},
        "rows_gt64": {
            "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "ctas_per_sm": 1,
            "min_tokens_per_split": 256, "max_splits": 64, "wide_combine": True,
        },
        "combine": {"num_warps": 4},
    },
    # sample: SM90's entry but 4-warp filter programs: 2 warps spill here (not measured on SM100).
    "sample": {"chunks": {"BLOCK": 2048, "N_GROUPS": 64, "SEG": 128, "CAP": 4096, "TILE_C": 128, "num_warps": 4, "row_warps": 8,
                          "pass1_programs": 512, "filter_programs": 1024, "filter_prefetch": True, "filter_warps": 4}},
}
