"""Kernel configurations for sm90: {op: {variant: {BLOCK_M: ..., num_warps: ..., num_stages: ...}}}.

Kernel modules add their entries here; an op/variant missing here falls back to default.py.
"""

CONFIGS: dict[str, dict[str, dict]] = {
    # rope: measured on an H200 2026-11-30 (T16384 H128 D64 bf16): 16384-element tiles, 16 warps: 95% of copy vs 90% at the default.
    "rope": {"tokens": {"tile_elems": 16384, "bytes_per_thread": 64, "min_warps": 4, "max_warps": 16, "min_programs": 264, "min_tile_elems": 1024}},
    # gemm: see default.py. Measured on the H200, Triton 3.6, 2026-11-30 (`python -m
    # deepinfer_cuda.bench.gemm --sweep`, then the bench runner): tma = tensor-descriptor kernel
    # (bf16 8x4096x7168->4096: 691-796 TFLOP/s, 1.03x torch._grouped_mm, against 632 with pointer
    # loads); fp8 GEMM alone 828-940 TFLOP/s with tma, 975 with k_pairs at 3 stages (k_pairs not
    # yet checked for correctness on the GPU: off). Decode: dense_small 95% of copy bandwidth
    # (masked 64x16), fp8_block_small 82%; mxfp4_small 23% (dot_scaled; the upcast path: 12%).
    # Changed 2026-11-30 for spills found by the SM90 compile check, then re-measured on the H200: fp8_block_small
    # 4 -> 8 warps (4 spilled 252 B): fp8 masked decode 41% -> 60% of copy. dense_small stays at 4 warps (it spilled
    # 72 B until the split-K sum moved into the kernel, 2026-12-02: no spills since): 8 warps measured slower (masked 64x16 95% -> 92% of copy, contiguous
    # 88% -> 84%, linear 16x7168->36864 91% -> 85%). mxfp4_large BLOCK_K 128 -> 64 (spilled 400 B). mxfp8_large
    # is new (not measured): 128x64x64 (BLOCK_N 128 spills 548 B).
    # Re-swept on an H100 2026-12-06 at V4-Flash's decode GEMMs (CUDA graphs, weights rotated past L2;
    # docs/measurements/2026-12-06/h100_round3/): fp8_block_small 64x128 w8 s5 -> 64x64 w4 s6: batch 64 per layer
    # 194 -> 148 us over its 8 fp8 GEMMs (wq_b 37 -> 20 us, wkv 16 -> 11, wq_a 17 -> 11), batch 1 113 -> 108 us; in the
    # 8-layer e2e decode step 15.20 -> 14.93 ms at batch 64, batch 1 unchanged. Triton 3.9's sm90 compile of the new tile
    # spills 332-456 B at 64 rows (none at 16): measured faster on the H100's Triton 3.6 anyway. dense_small s4 -> s5:
    # the 129280-wide head at batch 1 401 -> 341 us (the 64-row tile fits 3 stages either way).
    "gemm": {
        "dense_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 8, "num_warps": 4, "num_stages": 5},
        "dense_large": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "tma": True},
        "fp8_block_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 6},
        "fp8_block_large": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4, "tma": True, "k_pairs": False},
        # fp8_block_large_short_k: prefill tiles for K <= 1024 (gemm.py's SHORT_K: DeepSeek-V4's wq_b and indexer wq_b, 8 K
        # steps a tile, where pipeline fill and epilogue weigh most). On an H100 (2026-12-07, `python -m
        # deepinfer_cuda.bench.gemm --sweep fp8_v4_prefill`, 8192 rows, the quantiser included, outputs equal): 64 x 128 of
        # 4 warps (two CTAs a SM) wq_b 0.792 ms against 0.865 for fp8_block_large's tile, the indexer's wq_b 0.202 against
        # 0.234; at K 2048-8192 fp8_block_large's tile was the fastest or within 1% (docs/measurements/2026-12-07/h100_round12/).
        "fp8_block_large_short_k": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4, "tma": True,
                                    "k_pairs": False},
        # fp8_block_medium (65-256 rows: large decode batches): 64 x 128 through TMA, no split-K. The large entry's 128 x 128
        # tile left 2 x N/128 programs at 256 rows, so the planner split K onto the pointer kernel (0.35 TB/s). Swept on an
        # H100 (2026-12-07, V4-Flash's 7 fp8 projections at 256 rows, 6 tiles; docs/measurements/2026-12-07/): one layer's
        # fp8 GEMMs 284 us (the large entry) -> 174 us (64 x 128 TMA; 128 x 128 TMA 186, 128 x 64 TMA 195, the decode
        # tile 218); decode batch 256 ctx 4096 18.89 -> 17.71 ms in the same lease.
        "fp8_block_medium": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 5, "tma": True, "split_k": False},
        "mxfp4_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
        "mxfp4_large": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        "mxfp8_large": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        # mxfp4_a8 (W4A8 MX, Triton's dot_scaled emulation: e2m1 and e4m3 upcast to bf16, wgmma): NEW, NOT MEASURED on
        # the H200; chosen by the compile check only (Triton 3.9): decode 64x64x128 w4 s3 192 regs (K 256 spills 148 B),
        # prefill 128x64x64 w8 s3 228 regs (BLOCK_N 128 spills 56 B, 128x128x128 796 B).
        "mxfp4_a8_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
        "mxfp4_a8_large": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        # Deterministic mode's one entry for every row count (dense only; the other formats take their _small).
        # Swept on the H200 2026-12-02 (docs/measurements/2026-12-02/deterministic_h200/: the 8-layer e2e model's decode GEMMs
        # at batch 1/64/256 against the default plans): 64x128x128 w8 s4 0.94/1.04/0.90x the default's time;
        # dense_small's 64x64x256 w4 s4 1.28/1.43/1.13x; 16- and 32-row tiles lose at batch 256 (1.06-1.79x).
        "dense_invariant": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4},
        # float32 dense (the MoE router, 2048 -> 64 experts), swept on the H200 2026-12-02 (measurements/2026-12-02/router_gemm_h200/,
        # weights rotated past L2, CUDA graphs): every 2-warp candidate 8-16 us at 1/64/256 rows (torch.mm fp32 4.3/8.6/8.9 us);
        # these 8.2/8.7 us (small), 12.8 us at 256 rows (large), 9.8/10.6/15.4 us (invariant). The bf16 entries it took before
        # spent 43-83 us per call in the e2e decode profile.
        "dense_f32_small": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 2, "num_stages": 3, "min_iters_per_split": 2},
        "dense_f32_large": {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 2, "num_stages": 3, "min_iters_per_split": 2},
        "dense_f32_invariant": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 2, "num_stages": 3, "min_iters_per_split": 2},
        "quant_act": {"BLOCK_R": 16, "num_warps": 4, "elems_per_thread": 8},
        # The register dequant path (MX_MODE 3: the weight tile dequantised to bf16 in registers is wgmma's A
        # operand, BLOCK_N weight rows its M side; x^T tokens its N side; mxfp4_a8 takes mxfp4's entries).
        # First chosen by compiling for sm90 (Triton 3.9, unit strides specialised as the launcher does;
        # registers, spills, shared memory, SASS instructions per weight element in the K loop), then swept on
        # the H200 (2026-12-01, measurements/2026-12-01/v4_fp8_mxfp4_h200/mxfp4_speed.json, V4-Flash experts): prefill 8192x6 tokens w13 256 experts
        # 128x128x128 w8 s3 6.09 ms (271 TFLOP/s, 0.62x bf16) beat 256x128x64 (6.95 ms) and 128x64x128 (6.77);
        # decode masked 16 tokens x 256 experts: 64x128x128 w4 s4 1.20 ms (0.45 of copy on the packed bytes),
        # split_target_per_sm 4 1.16 ms but 7% slower on the contiguous 64-token case, so not taken.
        # Decode (16-token tiles): 128x128 w4 s4 191 regs, 42 KB, 5.0 instructions per element (64x256 5.2, 128x256
        # w8 5.2); the 64-row tile of a 48-token expert 252 regs. Prefill: BLOCK_M 256 tokens (a 192-token
        # expert in one tile: one dequant per weight tile) x 128 weight rows x K 64, w8 s3: 212 regs, 107 KB
        # (K 128 at s2 spills 48 B; 256x256 spills); the H200 preferred 128x128x128 w8 s3 (above).
        # w_tma: the packed weight tiles through TMA (an H100, 2026-12-06, V4-Flash's expert GEMMs at decode batch
        # 64 / 256, 256 experts, random top-6): w13 880 -> 787 us, w2 431 -> 394 us at batch 64 (2.01 -> 2.25 TB/s);
        # dequantisation removed altogether left the pointer kernel at 2.02 TB/s: its loads, not its ALU work,
        # set the rate. K 256 with 3 stages was 4% faster at batch 256, 3% slower at 64.
        "mxfp4_reg_small": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4, "w_tma": True},
        # w_tma on the prefill tile too: V4-Flash's 8 x 8192 prefill 1.567 -> 1.535 s on an H100 (2026-12-06).
        "mxfp4_reg_large": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "w_tma": True},
        # The Gluon kernel (gemm_mxfp4_gluon.py, mxfp4_path=gluon): consumer warps and a producer warp.
        # Prefill (_large): 8 consumer warps (two warpgroups over 128 weight rows), one CTA per SM; measured 1.41-1.50x the
        # tl kernel on an H100 (2026-12-06). Decode (_small), 2026-12-06: the 8-warp tile (0.72-0.83x the tl kernel) ran one
        # CTA per SM (Triton's default register cap for a warp-specialised kernel, 168 x 384 threads, fills the SM), its two
        # warpgroups joined by a bar.sync after every wgmma wait, and each program's prologue (the scale strip, the ring's
        # fill) and epilogue idle on the SM. Now one consumer warpgroup, maxnreg 128 (consumer 232 registers after
        # setmaxnreg, no spills): two CTAs per SM (ctas_per_sm halves the shared-memory budget: 7 stages at K 4096, 8 at
        # 2048); min_block_m: 8-row tiles (wgmma N = 8) where the bucket has <= 2 rows per expert (batch 64 x top-6 over
        # 256 experts). Measured on an H100 (2026-12-06, docs/measurements/2026-12-06/round8/h100_call3/mxdec.txt; outputs
        # equal to the tl kernel's): V4-Flash's experts w13 / w2 at 64 and 256 tokens x top-6, 1.05-1.20x the tl kernel
        # (2.34-2.66 TB/s against 2.22-2.25); 64-row weight tiles (3 CTAs/SM) and 16-row token tiles were no better overall,
        # the old 8-warp tile 0.73-0.87x. auto: mxfp4_path=auto takes it for decode too (the 8-layer e2e decode step at
        # batch 64 / 256: 13.01 -> 11.78 / 19.24 -> 18.30 ms).
        # K steps of 256 (2026-12-07, an H100; stages fit to shared memory: 3 of 24 KiB at 16-row tiles and K 4096, against 7
        # of 12 KiB with K steps of 128): V4 w13 at batch 256 0.923 -> 0.887 ms (`--sweep mxfp4_gluon_small`), the 7-layer e2e decode step at batch
        # 256, ctx 32768, 14.89 -> 14.47 ms in one lease (conformance of grouped_gemm passed with it). The 8-row tiles
        # (batch 64) keep K steps of 128 (`min_block_m_BLOCK_K`): 256 was not measured there.
        "mxfp4_gluon_small": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 256, "GROUP_M": 8, "num_warps": 4, "num_stages": 8, "producer_regs": 40,
                              "maxnreg": 128, "ctas_per_sm": 2, "min_block_m": 8, "min_block_m_BLOCK_K": 128, "auto": True},
        # Prefill tile 128 tokens x 256 weight rows, 3 stages: on an H100 (2026-12-07, `python -m deepinfer_cuda.bench.gemm
        # --sweep mxfp4_gluon_large`, V4 w13 at 256 experts x 192 rows) 3.48-3.54 ms against 4.02-4.06 for 128 x 128 x 4
        # stages, 3.73 for 64 x 256, 4.22 for 64 x 128, 4.47 / 4.96 for 256 tokens x 128 / 64 rows (not profiled further).
        # tail_tiles (gemm_mxfp4_gluon.py's module docstring): contiguous calls as a launch of the 128-row tiles and one of
        # 64-row tiles for each expert's remainder of at most 64 rows. On an H100 (2026-12-07, the sweep above, outputs equal
        # to the table's without it): 192 rows an expert 3.75 -> 3.13 ms, a router's uneven split (159-231 rows) 3.78 ->
        # 3.62 ms; `conformance --op grouped_gemm` passed with it (16 cases); the 8-layer prefill of 8 x 8192 tokens 0.954
        # -> 0.942 s (docs/measurements/2026-12-07/h100_round12/).
        # persistent (gemm_mxfp4_gluon.py's module docstring: one program per SM walking tiles, the ring running on across
        # them so the next tile's loads overlap this one's epilogue): off. On an H100 (2026-12-07, h100_round12/e) its outputs
        # equal the table's and grouped_gemm's conformance passed with it, but it was no faster: V4 w13 at 192 rows an
        # expert 3.45 ms at 3 stages (3.25 at 4) against 3.42, a router's split 3.96 (3.89) against 3.83, the 8-layer
        # prefill 0.944 / 0.967 s against 0.866 / 0.948. Its producer warp maps every tile itself (a prefix sum over the
        # experts), so it takes 64 registers (40 spilled 88 bytes, 56 8 bytes); the consumers get 216.
        "mxfp4_gluon_large": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "producer_regs": 40,
                              "tail_tiles": True, "persistent": False, "persistent_producer_regs": 64},
        # The Gluon fp8_block kernel (gemm_fp8_gluon.py, fp8_path=gluon): chosen by the sm90 compile check (Triton 3.9 and
        # 3.6, no spills) and by counting; measured once (H200, 2026-12-07: 768 TFLOP/s at 8 x 4096 rows, 7168 -> 4096,
        # against the tl kernel's 788; docs/performance.md), not tuned on a GPU. BLOCK_M is 64 rows per consumer warpgroup (wgmma's M); BLOCK_N
        # divides 128 (one weight scale per N block); each consumer warpgroup 232 registers (acc and product: 128).
        # BLOCK_N 128 everywhere: m64n128k32 wgmmas read 96 B of shared memory per clock at the fp8 rate (n64: all 128 of
        # it), and a tile re-reads its rows of x from L2 once per N block (at 256 decode rows x 4096 columns, 128 x 64
        # tiles would read 64 MB of x from L2 for 16 MB of weights; 128 x 128 with two K splits 32 MB).
        # Prefill (_large): 128 x 128, two consumers, 6 stages (192 KiB), one persistent program per SM (the 256 x 128 tile,
        # two 64-row waves per warpgroup, spilled in the mainloop until its promotions were ordered: a schedule option
        # below). Large decode batches
        # (_medium, 65-256 rows per expert): the same tile, K split where the tiles leave SMs idle (`choose_split`: at least
        # 2 groups a split, a split costed as one group; float32 partials, then gemm.py's split-K sum, deterministic).
        # Decode (_small): 64 x 128, one consumer warpgroup, 8 stages (192 KiB in flight per SM), K split likewise.
        "fp8_gluon_small": {"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8, "consumers": 1, "num_stages": 8, "consumer_regs": 232,
                            "split_k": True, "min_kb_per_split": 2, "split_cost": 1},
        "fp8_gluon_medium": {"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8, "consumers": 2, "num_stages": 6, "consumer_regs": 232,
                             "split_k": True, "min_kb_per_split": 2, "split_cost": 1},
        # Schedule options (gemm_fp8_gluon.py's module docstring): "overlap" (the next 128-K group's wgmma issued before this
        # group's promotion: two product register sets, consumers at 240 registers), BLOCK_N 256 (two column halves) or
        # BLOCK_M 256 with "waves" 2, "tma_store" (the epilogue by TMA). Each gives the former entry's output bit for bit.
        # `python -m deepinfer_cuda.bench.gemm --sweep fp8_gluon_large` on an H100 (2026-12-07, GEMM alone, pre-quantised
        # x; docs/measurements/2026-12-07/h100_round14/c/fp8g_sweep.txt): 128 x 256 with the TMA store (3 stages, fit_stages)
        # 962-1091 TFLOP/s over the contiguous 8 x 4096 (7168 -> 4096: 1029) and V4-Flash's six prefill projections,
        # against the former 128 x 128 entry's 608-862 and the tl kernel's 716-869; overlap + TMA store 868-1062 (868 at the
        # contiguous shape); outputs equal to the tl kernel's at every shape.
        "fp8_gluon_large": {"BLOCK_M": 128, "BLOCK_N": 256, "GROUP_M": 8, "consumers": 2, "num_stages": 4, "consumer_regs": 240,
                            "overlap": False, "waves": 1, "tma_store": True},
        # mxfp8 (e4m3 weights): decode 128x128 w4 s4 189 regs, 67 KB, 6.5 per element; prefill 256x128x64 w8 s3 210 regs.
        "mxfp8_reg_small": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
        "mxfp8_reg_large": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},  # as mxfp4's (not swept)
        # fp8_block32 (W8A16, V4.1's dense projections): mxfp8's register kernel (the same e4m3 weight tile and bf16 x^T), the
        # scale row shared by 32 weight rows. NOT MEASURED; chosen by the sm90 compile check (Triton 3.9): decode 64x64x128
        # w4 s4 (119 regs at 8x1280->32768, 168 on wo_a's 64-row groups), since mxfp8's 64x128x128 w4 spills 800 B on
        # 64-row contiguous groups (w8: 210 regs, no spills, the other candidate); prefill 128x64x128 w8 s3 (164 regs, no
        # spills in the linear and the contiguous grouped case), since mxfp8's 128x128x128 spills 248 B in the contiguous
        # layout (128x128x64 s3 224 B, 128x128x128 s2 136 B).
        "fp8_block32_reg_small": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
        "fp8_block32_reg_large": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    },
    # prefill: tma = K/V tiles through TMA descriptors. bf16 tiles measured on the H200 (2026-11-30):
    # 128x64 w8 s3 + TMA 432 TFLOP/s at B4x4096 H16 192/128; 64x64 w4 s3 + TMA 447 at d128 (2 CTAs/SM).
    "prefill": {
        "large_head": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "tma": True},
        "small_head": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "tma": True},
        "large_head_fp32": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "tma": True},
        "small_head_fp32": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "tma": True},
    },
    # mla_decode: measured on an H200 2026-11-30 (B128 ctx4096 page64 bf16; bench/attention_decode.py sweep).
    # fused_combine (the last split program merges): 173.8 -> 167.9 us at 16 heads (3, 4, 6 splits: 199-183 us).
    # rows_le16 (16 heads, S=1): BLOCK_N 64, 4 warps, 2 stages, 2 CTAs/SM -> 2 splits: 173 us incl. combine,
    # 3.52 TB/s (split kernel alone 161-166 us); BLOCK_N 32 / 3-4 stages / 2 or 8 warps / 128-wide tiles all slower.
    # rows_le32 (S=2): same tile, 215 us. rows_le64 (S=4, 64 rows): 8 warps, one split, 311 us.
    # rows_gt64 (128 heads): 64x64 tiles, 8 warps, 2 stages, one split: 570 us = 256 TFLOP/s (4 warps or 16 spill:
    # 1017 / 1200 us; BLOCK_N 32: 804 us).
    # wide_combine (2026-12-02, measurements/2026-12-02/round2_h200/call3_mla_wide/mla_sweep.txt, graph replays): fewer (row tile, request) groups
    # than SMs and >= 8 splits merge in the wide kernel: B1 ctx8192 H16 41 -> 17-23 us, H128 140 -> 35 us; from 2
    # splits it was slower at B64/B128 H16 (98 -> 112, 168 -> 200 us). 16 heads take up to 256 splits: B1 ctx65536
    # 75 -> 49 us (64 splits -> 205), B1 ctx32768 46 -> 36 us; 128 heads gained nothing past 64.
    "mla_decode": {
        # fp8_num_warps: an FP8 cache's tile is converted in registers; with 4 warps the H16 split kernel
        # spilled 680 B (255 regs, sm90 compile check); 8 warps: no spills (fp8 decode had measured 392 us vs bf16 168).
        "rows_le16": {
            "BLOCK_N": 64, "num_warps": 4, "fp8_num_warps": 8, "num_stages": 2,
            "ctas_per_sm": 2, "min_tokens_per_split": 256, "max_splits": 256, "fused_combine": True, "wide_combine": True,
        },
        "rows_le32": {
            "BLOCK_N": 64, "num_warps": 4, "fp8_num_warps": 8, "num_stages": 2,
            "ctas_per_sm": 2, "min_tokens_per_split": 256, "max_splits": 256, "fused_combine": True, "wide_combine": True,
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
    },
    # moe / sampling (deepinfer_cuda.kernels.moe, .sampling): measured on an H200 2026-11-30
    # (bench/moe.py --sweep, bench/sampling.py --sweep). dispatch T4096 K8 D7168 bf16: 180-185 us for
    # every block_bytes 2-16 KiB x 4-8 warps (16 warps slower); combine: 131-135 us (4.0 TB/s) for
    # 2-8 KiB x 4-16 warps, 16 KiB slower.
    # 2026-12-03 (measurements/2026-12-03/round2_h200/call3_final_sample_dispatch/followup.txt): 8192-element count tiles halve the counting sort
    # (28.3 -> 15.5 us; 4096/4 warps 19.2, 32768 38.0): dispatch 176 -> 163 us. Streaming stores: no gain (174 us).
    "dispatch": {"tokens": {"count_tile_elems": 8192, "count_warps": 8, "block_bytes": 8192, "target_programs": 1024, "copy_warps": 8}},
    "combine": {"tokens": {"block_bytes": 4096, "target_programs": 1024, "num_warps": 16}},
    # sample: measured on the H200 2026-11-30 (`python -m deepinfer_cuda.bench.sampling --sweep`, 5 configurations):
    # 2048-logit chunks, 4 warps is the best geometric mean (B256 top-k/top-p 388 us, greedy 85, temperature 177,
    # top-p peaked 535; B16 in a graph 53 us); 4096/4 warps is faster for top-k (367) but 6x slower for peaked top-p.
    # The first pass split in two kernels (2026-12-03, measurements/2026-12-03/round2_h200/, graph replays): greedy and
    # unfiltered rows in 512 programs (greedy B256 47-48 us against torch.argmax's 48, was 60 in one kernel); filtered
    # rows in 1024 programs of 2 warps, the next chunk's load issued first (top-k/top-p 382 us, was 377; 4 warps 456,
    # 8 warps 691; a chunk a program 451-559).
    "sample": {"chunks": {"BLOCK": 2048, "N_GROUPS": 64, "SEG": 128, "CAP": 4096, "TILE_C": 128, "num_warps": 4, "row_warps": 8,
                          "pass1_programs": 512, "filter_programs": 1024, "filter_prefetch": True, "filter_warps": 2}},
}
