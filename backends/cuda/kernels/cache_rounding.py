"""Triton kernel: cache_round (DeepSeek-V4.1's fp8 / nvfp4 / mxfp4 cache formats as a quantize-dequantize rounding).

The tensor is viewed as rows of C channels and each row as groups of GROUP consecutive channels (the
last one padded with zeros); a program rounds BLOCK_G groups, one group a row of its tile, with
`deepinfer.triton_cache_rounding.round_groups` (bit-exact with the reference: the formats are float32
arithmetic, divisions correctly rounded, scales on the float32 bits, e4m3 and e2m1 by integer
rounding and comparisons). Elementwise apart from each group's amax (a max: exact in any order), so
batch-invariant as it is. The store rounds to the output dtype to nearest even (bit arithmetic for
bfloat16 under the interpreter, whose cast truncates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.cache_rounding import CACHE_FORMATS, GROUP
from deepinfer.triton_cache_rounding import round_groups
from deepinfer.triton_common import cdiv, interpreting, to_bf16_rne
from deepinfer_cuda.kernels.common import Registration, pdl_launch, pdl_prologue

_GROUPS_PER_PROGRAM = 128  # 4096 channels of 32 per program: a memory-bound elementwise pass


@triton.jit
def _cache_round_kernel(
    x_ptr, out_ptr, n_groups, groups_per_row, C, stride_x,
    FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, MANUAL_RNE: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    row = g // groups_per_row
    col = (g % groups_per_row) * GROUP
    j = tl.arange(0, GROUP)
    ok = (g < n_groups)[:, None] & ((col[:, None] + j[None, :]) < C)
    x = tl.load(x_ptr + row[:, None] * stride_x + col[:, None] + j[None, :], mask=ok, other=0.0).to(tl.float32)
    y = round_groups(x, FMT)
    dst = out_ptr + row[:, None] * C + col[:, None] + j[None, :]
    if MANUAL_RNE:
        tl.store(dst, to_bf16_rne(y), mask=ok)
    else:
        tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=ok)


def cache_round(x: torch.Tensor, *, fmt: str) -> torch.Tensor:
    if fmt not in CACHE_FORMATS:
        raise ValueError(f"cache_round fmt {fmt!r} is not one of {CACHE_FORMATS}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    channels = x.shape[-1] if x.dim() else 1
    if x.numel() == 0:
        return out
    rows = x.reshape(-1, channels)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    group = GROUP[fmt]
    groups_per_row = cdiv(channels, group)
    n_groups = rows.shape[0] * groups_per_row
    _cache_round_kernel[(cdiv(n_groups, _GROUPS_PER_PROGRAM),)](
        rows, out, n_groups, groups_per_row, channels, rows.stride(0),
        FMT=fmt, GROUP=group, BLOCK_G=_GROUPS_PER_PROGRAM, MANUAL_RNE=x.dtype == torch.bfloat16 and interpreting(), **pdl_launch(rows.device),
    )  # fmt: skip
    return out

REGISTRATIONS = [
    Registration(
        op="cache_round",
        fn=cache_round,
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        note="Triton: groups of channels per program, float32 scale bits, integer e4m3 / midpoint e2m1 rounding (bit-exact)",
        batch_invariant=True,  # each group alone; its amax is a max
    )
]
