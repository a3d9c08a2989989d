"""Default kernel configurations (any device, the interpreter included): {op: {variant: {...}}}.

Kernel modules add their entries here; an op/variant missing here falls back to default.py.
"""

CONFIGS: dict[str, dict[str, dict]] = {
    # gemm (linear + grouped_gemm, every format): <fmt>_small serves <= 64 rows per expert (decode:
    # weight streaming, BLOCK_M is a cap lowered to the rows), fp8_block_medium 65-256 (large decode batches), <fmt>_large the rest
    # (fp8_block_large_short_k, where an arch table has one, for K <= 1024: gemm.py's _shape_entry; none here). fp8 BLOCK_K is
    # always 128 (the scale group). quant_act: the fused fp8 activation quantiser, BLOCK_R rows (at most: fewer
    # rows take their power-of-two bucket) x one 128-column group per program, warps for elems_per_thread each.
    "gemm": {
        "dense_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
        "dense_large": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        # dense_f32: float32 operands (the MoE router: N = experts, a few MB of weights), summed with FMAs,
        # so thin K blocks (a wide float32 tile spills) and a deep split-K to spread one tile row over the SMs.
        "dense_f32_small": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3, "min_iters_per_split": 2},
        "dense_f32_large": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
        "fp8_block_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
        "fp8_block_large": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        "fp8_block_medium": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},  # = large: tuned per arch
        "mxfp4_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
        "mxfp4_large": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        "mxfp8_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
        "mxfp8_large": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        # mxfp4_a8 (W4A8 MX: mxfp4 weights, MX FP8 activations; the mxfp8 kernel path): as mxfp8. Not measured.
        "mxfp4_a8_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
        "mxfp4_a8_large": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        # The register dequant path (MX_MODE 3, swapped: BLOCK_N weight rows are the MMA's M side, BLOCK_M tokens
        # its N side; mxfp4_a8 takes mxfp4's entries). Small tiles here: the interpreter runs them.
        "mxfp4_reg_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
        "mxfp4_reg_large": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
        "mxfp8_reg_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
        "mxfp8_reg_large": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
        # fp8_block32 (W8A16, V4.1's e4m3 weights with e8m0 per 32x32 block; mxfp8's e4m3 weight tile, x unquantised):
        # as mxfp8's entries. Not measured.
        "fp8_block32_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
        "fp8_block32_large": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        "fp8_block32_reg_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
        "fp8_block32_reg_large": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
        "quant_act": {"BLOCK_R": 16, "num_warps": 4, "elems_per_thread": 8},
        # quant_act_mx: the two-term MX FP8 split of bf16 activations (native mx path), BLOCK_R rows x GROUPS*32 columns.
        "quant_act_mx": {"BLOCK_R": 16, "GROUPS": 4, "num_warps": 4},
    },
    # misc (memory-bound, rows in registers): tile_elems = elements per program, warps sized so each
    # thread holds bytes_per_thread of the tile (whole 16-byte vectors).
    # min_programs: tiles halve (down to min_tile_elems) until the grid has that many programs (decode batches).
    "rms_norm": {
        "rows": {"max_block_d": 16384, "tile_elems": 4096, "bytes_per_thread": 32, "min_warps": 4, "max_warps": 16, "loop_block_d": 4096, "min_programs": 264},
    },
    "rope": {"tokens": {"tile_elems": 4096, "bytes_per_thread": 32, "min_warps": 4, "max_warps": 8, "min_programs": 264, "min_tile_elems": 1024}},
    "silu_and_mul": {
        "rows": {"max_block_i": 2048, "tile_elems": 4096, "bytes_per_thread": 32, "min_warps": 4, "max_warps": 8, "min_programs": 264, "min_tile_elems": 1024},
    },
    # prefill (FA2 var-len causal): query block x key block; large_head = Dqk + Dv > 256 (DeepSeek 192/128).
    "prefill": {
        "large_head": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
        "small_head": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
        "large_head_fp32": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
        "small_head_fp32": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    },
    # attention (mla_decode: rows = S*H query rows per request; rows_le16/32/64 -> one row tile,
    # memory-bound; rows_gt64 -> BLOCK_M-row tiles, compute-bound). Splits: the count whose programs
    # fill ctas_per_sm * SMs resident slots best, each split >= min_tokens_per_split tokens.
    "mla_decode": {
        "rows_le16": {
            "BLOCK_N": 64, "num_warps": 4, "fp8_num_warps": 8, "num_stages": 2,
            "ctas_per_sm": 2, "min_tokens_per_split": 256, "max_splits": 64, "fused_combine": True, "wide_combine": True,
        },
        "rows_le32": {
            "BLOCK_N": 64, "num_warps": 4, "fp8_num_warps": 8, "num_stages": 2,
            "ctas_per_sm": 2, "min_tokens_per_split": 256, "max_splits": 64, "fused_combine": True, "wide_combine": True,
        },
        "rows_le64": {
            "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "ctas_per_sm": 1,
            "min_tokens_per_split": 256, "max_splits": 64, "fused_combine": True, "wide_combine": True,
        },
        "rows_gt64": {
            "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2,
            "ctas_per_sm": 1, "min_tokens_per_split": 256, "max_splits": 64, "fused_combine": True, "wide_combine": True,
        },
        "combine": {"num_warps": 4},
        # the SM90 Gluon kernel over the bf16 cache (mla_decode_gluon.py; these switches there: its docstring). The seesaw
        # schedule with early release (mla_decode_gluon_seesaw.py), 232 registers an attention warpgroup, 40 the loader's,
        # splits of >= 256 tokens, <= 64 of them: `python -m deepinfer_cuda.bench.gemm --sweep mla_gluon_bf16` (H100,
        # 2026-12-07: 284.5 against split_keys' 330.7 us at B128 ctx4096; conformance and GPU tests passed with it in the table)
        # "balanced": mla_decode_gluon_balanced.py's persistent grid (off: its GPU tests and conformance passed, but the sweep
        # timed it slower on an H100, 2026-12-07: B128 ctx4096 316.5-322.9 against 291.6 us, B32 60.4-68.6 against 52.5, B1
        # 61 against 22.1); "balanced_overhead_tiles": its schedule's cost of a segment in tiles
        "gluon_bf16": {"schedule": "seesaw_early_release", "attend_regs": 232, "load_regs": 40, "min_tokens_per_split": 256, "max_splits": 64,
                       "balanced": False, "balanced_overhead_tiles": 1},
        # the SM90 Gluon kernel over the FP8 cache (mla_decode_fp8_gluon.py). "keys_as_m": the calls of at most 16 query rows
        # on mla_decode_fp8_gluon_keys_m.py's kernel (keys as the wgmma's M, heads as its N). H100 2026-12-07: its GPU tests
        # and conformance --op mla_decode (16) passed with it on; 1.74-1.79x the split-keys kernel in CUDA graphs at 16 heads
        "gluon_fp8": {"keys_as_m": True},
    },
    "kv_cache_write": {"tokens": {"num_warps": 4}},
    # norm_rope_kv_write: one row of up to 512 float32 channels per program. Not measured.
    "norm_rope_kv_write": {"rows": {"num_warps": 4}},
    # head_norm_rope: whole heads of one token per program, tile_elems channels in all (4 of V4's 512-wide
    # query heads: 16 programs a token at 64 heads); more under the interpreter (it pays per operation). Not measured.
    "head_norm_rope": {"heads": {"tile_elems": 2048, "interpreter_tile_elems": 16384, "num_warps": 4}},
    # moe (deepinfer_cuda.kernels.moe): gate holds tile_elems router scores per program; dispatch's
    # count tile is count_tile_elems one-hot entries; copy/combine move block_bytes per row per step
    # and split the columns until target_programs programs run.
    "gate": {"tokens": {"tile_elems": 1024, "num_warps": 4}},
    "dispatch": {"tokens": {"count_tile_elems": 16384, "count_warps": 8, "block_bytes": 4096, "target_programs": 1024, "copy_warps": 8}},
    "combine": {"tokens": {"block_bytes": 4096, "target_programs": 1024, "num_warps": 8}},
    # sampling (deepinfer_cuda.kernels.sampling): sample cuts each row into cdiv(V, BLOCK) chunks, the
    # chunk passes sharing a row's chunks among a bounded number of programs (the keys the kernel
    # module's comment lists); N_GROUPS group maxima per chunk bound top-k (small here: the
    # interpreter's sort is slow); SEG candidate slots per chunk, CAP per row; TILE_C candidates
    # sorted in registers; row_warps for the per-row plan/finish kernels.
    "sample": {"chunks": {"BLOCK": 4096, "N_GROUPS": 32, "SEG": 256, "CAP": 4096, "TILE_C": 64, "num_warps": 8, "row_warps": 8}},
    "apply_token_bitmask": {"rows": {"BLOCK": 4096, "num_warps": 8}},
    # apply_penalties: B x cdiv(V, BLOCK) elementwise programs; apply_token_bias: BLOCK entries per
    # program; gather_logprobs: one program per row streaming BLOCK logits at a time.
    "apply_penalties": {"rows": {"BLOCK": 2048, "num_warps": 4}},
    "apply_token_bias": {"entries": {"BLOCK": 128, "num_warps": 4}},
    "gather_logprobs": {"rows": {"BLOCK": 2048, "num_warps": 8}},
}
