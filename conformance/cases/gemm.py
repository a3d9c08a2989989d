"""Cases for the gemm ops: linear and grouped_gemm, in the dense, fp8_block, mxfp4, mxfp8, mxfp4_a8 and fp8_block32 formats.

Quantised weights are made by the project's own quantisers from seeded float32 weights whose
magnitude varies from row to row, so the fp8 block scales and the e8m0 scales differ.
"""

from __future__ import annotations

from functools import partial

import torch

from deepinfer.ops.quant import quantize_weight_fp8_block, quantize_weight_fp8_block32, quantize_weight_mxfp4, quantize_weight_mxfp8
from deepinfer_conformance.cases import Case, drawn_as, randn

FLOAT_DTYPES = (torch.float32, torch.bfloat16)
QUANT_DTYPES = (torch.bfloat16,)  # fp8 / mxfp4 / mxfp8 weights serve bf16 activations


def make_weight(gen, dtype, *lead: int, n: int, k: int, fmt: str) -> dict:
    """A weight [*lead, N, K] with row scales spread over two decades, stored in `fmt`."""
    row_scale = 10 ** (torch.rand(*lead, n, 1, generator=gen, dtype=torch.float64) * 2 - 2)
    w = (randn(gen, *lead, n, k, dtype=torch.float64) * row_scale).float()
    if fmt == "dense":
        return {"weight": w.to(dtype)}
    quantize = {
        "fp8_block": quantize_weight_fp8_block, "mxfp4": quantize_weight_mxfp4, "mxfp8": quantize_weight_mxfp8, "mxfp4_a8": quantize_weight_mxfp4,
        "fp8_block32": quantize_weight_fp8_block32,
    }[fmt]  # fmt: skip
    weight, scale = quantize(w)
    return {"weight": weight, "weight_scale": scale, "fmt": fmt}


def activations(gen, dtype, *shape: int, wide_columns: int = 0) -> torch.Tensor:
    """Standard normal activations; `wide_columns` random columns are 1000x larger (large dynamic range)."""
    x = randn(gen, *shape, dtype=torch.float64)
    if wide_columns:
        columns = torch.randperm(shape[-1], generator=gen)[:wide_columns]
        x[..., columns] *= 1e3
    return x.to(dtype)


def linear_inputs(gen, dtype, *, t: int, n: int, k: int, fmt: str = "dense", wide_columns: int = 0):
    return {"x": activations(gen, dtype, t, k, wide_columns=wide_columns), **make_weight(gen, dtype, n=n, k=k, fmt=fmt)}


def router_inputs(gen, dtype, *, t: int, n: int, k: int):
    """A MoE router's call: activations in the case dtype, a float32 dense weight, float32 logits (out_dtype)."""
    return {"x": activations(gen, dtype, t, k), **make_weight(gen, torch.float32, n=n, k=k, fmt="dense"), "out_dtype": torch.float32}


def contiguous_inputs(gen, dtype, *, rows_per_expert: list[int], padding: int, n: int, k: int, fmt: str = "dense"):
    """Contiguous layout: expert e owns rows_per_expert[e] rows; `padding` rows follow the last expert."""
    offsets = torch.tensor([0, *rows_per_expert], dtype=torch.int64).cumsum(0).to(torch.int32)
    m = int(offsets[-1]) + padding
    experts = len(rows_per_expert)
    return {"x": activations(gen, dtype, m, k), **make_weight(gen, dtype, experts, n=n, k=k, fmt=fmt), "expert_offsets": offsets}


def masked_inputs(gen, dtype, *, masked_m: list[int], max_m: int, n: int, k: int, fmt: str = "dense"):
    """Masked layout: x [E, max_m, K], expert e's first masked_m[e] rows are valid."""
    experts = len(masked_m)
    return {
        "x": activations(gen, dtype, experts, max_m, k),
        **make_weight(gen, dtype, experts, n=n, k=k, fmt=fmt),
        "masked_m": torch.tensor(masked_m, dtype=torch.int32),
    }


# Expert 1 and 5 get no tokens; 9 padding rows after the last expert.
UNEVEN = [5, 0, 12, 3, 8, 0, 1, 11]
ALL_ON_ONE = [0, 0, 0, 37, 0, 0, 0, 0]

FLOAT_RECIPES = [
    ("linear", "t1_n160_k256", partial(linear_inputs, t=1, n=160, k=256)),  # decode: float32 splits K (3 ways interpreted, 4 on SM90)
    ("linear", "t33_n192_k320", partial(linear_inputs, t=33, n=192, k=320)),
    # N and K not multiples of any backend's tiles (16..256), each at least one full tile.
    ("grouped_gemm", "contiguous_e8_empty_expert_padding", partial(contiguous_inputs, rows_per_expert=UNEVEN, padding=9, n=80, k=144)),
    ("grouped_gemm", "contiguous_e8_all_on_one_expert", partial(contiguous_inputs, rows_per_expert=ALL_ON_ONE, padding=3, n=96, k=64)),
    ("grouped_gemm", "masked_e4_m16", partial(masked_inputs, masked_m=[0, 16, 5, 1], max_m=16, n=96, k=160)),
]

QUANT_RECIPES = [
    # N 576 (DeepSeek-V3's kv_a rows): the fp8 scale grid is 5x4, its last row a partial (64-row) block (the model's K,
    # 7168, is `deepinfer bench ops`' size; split-K decode is the k1024 case below).
    ("linear", "fp8_block_t3_n576_k512", partial(linear_inputs, t=3, n=576, k=512, fmt="fp8_block")),
    ("linear", "fp8_block_t1_n200_k320_partial_blocks", partial(linear_inputs, t=1, n=200, k=320, fmt="fp8_block")),
    ("linear", "fp8_block_t5_n256_k1024_large_range", partial(linear_inputs, t=5, n=256, k=1024, fmt="fp8_block", wide_columns=24)),
    ("linear", "mxfp4_t7_n256_k512", partial(linear_inputs, t=7, n=256, k=512, fmt="mxfp4")),
    # N 192: a partial 128-row scale block (and a partial 128-wide tile); K 256: two scale groups.
    ("grouped_gemm", "fp8_block_contiguous_e8_empty_expert_padding",
     partial(contiguous_inputs, rows_per_expert=UNEVEN, padding=9, n=192, k=256, fmt="fp8_block")),
    ("grouped_gemm", "fp8_block_masked_e4_m8", partial(masked_inputs, masked_m=[3, 0, 8, 1], max_m=8, n=192, k=256, fmt="fp8_block")),
    # K 512: the smallest K the SM90 Gluon kernel (mxfp4_path=gluon) serves, so its conformance run exercises it; N 64: a partial 128-row tile.
    ("grouped_gemm", "mxfp4_contiguous_e8_empty_expert_padding_k512", partial(contiguous_inputs, rows_per_expert=UNEVEN, padding=5, n=64, k=512, fmt="mxfp4")),
    ("grouped_gemm", "mxfp4_masked_e4_m8_k512", partial(masked_inputs, masked_m=[8, 2, 0, 5], max_m=8, n=64, k=512, fmt="mxfp4")),
    # mxfp8 (W8A16): K not a multiple of 128 (a partial K block of 32-groups), large activation range.
    ("linear", "mxfp8_t7_n256_k480_large_range", partial(linear_inputs, t=7, n=256, k=480, fmt="mxfp8", wide_columns=12)),
    ("grouped_gemm", "mxfp8_contiguous_e8_empty_expert_padding", partial(contiguous_inputs, rows_per_expert=UNEVEN, padding=9, n=128, k=256, fmt="mxfp8")),
    ("grouped_gemm", "mxfp8_masked_e4_m8", partial(masked_inputs, masked_m=[8, 2, 0, 5], max_m=8, n=192, k=256, fmt="mxfp8")),
    # mxfp4_a8 (W4A8 MX, mxfp4 weights with MX FP8 activations): kept small; K 480 leaves a partial K block of 32-groups.
    ("linear", "mxfp4_a8_t5_n128_k480_large_range", partial(linear_inputs, t=5, n=128, k=480, fmt="mxfp4_a8", wide_columns=8)),
    ("grouped_gemm", "mxfp4_a8_contiguous_e8_empty_expert_padding", partial(contiguous_inputs, rows_per_expert=UNEVEN, padding=9, n=64, k=256, fmt="mxfp4_a8")),
    ("grouped_gemm", "mxfp4_a8_masked_e4_m8", partial(masked_inputs, masked_m=[8, 2, 0, 5], max_m=8, n=128, k=256, fmt="mxfp4_a8")),
]

# fp8_block32 (W8A16, DeepSeek-V4.1's e4m3 weights with e8m0 per 32x32 block; x unquantised): kept tiny (the golden
# set's 25 MB). N 80 and K 112 leave partial 32-row and 32-column edge blocks; the grouped cases are wo_a's grouped
# projection (a few groups, contiguous) and a masked decode layout, N 48 a partial block row per expert.
BLOCK32_RECIPES = [
    ("linear", "fp8_block32_t3_n80_k112_partial_blocks", partial(linear_inputs, t=3, n=80, k=112, fmt="fp8_block32", wide_columns=4)),
    ("grouped_gemm", "fp8_block32_contiguous_e3_empty_group", partial(contiguous_inputs, rows_per_expert=[5, 0, 7], padding=2, n=48, k=64, fmt="fp8_block32")),
    ("grouped_gemm", "fp8_block32_masked_e3_m8", partial(masked_inputs, masked_m=[3, 0, 8], max_m=8, n=40, k=96, fmt="fp8_block32")),
]

# out_dtype: a decode token's bf16 activations times a float32 router weight, returned in float32 and held to float32's
# tolerance (the op's result_dtype). Drawn as t1_n160_k256: its bf16 case's x and its float32 case's weight, stored once.
OUT_DTYPE_RECIPES = [("linear", "router_t1_n160_k256_f32_weight_out_f32", drawn_as("linear.t1_n160_k256", partial(router_inputs, t=1, n=160, k=256)))]

CASES = (
    [Case(op, name, dtype, make) for op, name, make in FLOAT_RECIPES for dtype in FLOAT_DTYPES]
    + [Case(op, name, dtype, make) for op, name, make in QUANT_RECIPES for dtype in QUANT_DTYPES]
    + [Case(op, name, dtype, make) for op, name, make in BLOCK32_RECIPES for dtype in QUANT_DTYPES]
    + [Case("linear", BLOCK32_RECIPES[0][1], torch.float32, BLOCK32_RECIPES[0][2])]  # float32 activations: the upcast path
    + [Case(op, name, torch.bfloat16, make) for op, name, make in OUT_DTYPE_RECIPES]
)
