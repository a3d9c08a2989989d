"""Triton kernels: cache_pack / cache_unpack (DeepSeek-V4.1's caches stored as code and scale bytes).

The tensor is viewed as rows of C channels and each row as groups of GROUP consecutive channels; a program
packs (or unpacks) BLOCK_G groups with `deepinfer.triton_cache_rounding.pack_groups` / `unpack_groups`,
bit-exact with the reference (the rounding is `cache_round`'s float32 arithmetic; the codes and scale bytes
are integers). Elementwise apart from each group's amax (a max: exact in any order), so batch-invariant as
it is. Unpack stores rounded to the output dtype to nearest even (bit arithmetic for bfloat16 under the
interpreter, whose cast truncates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.cache_rounding import GROUP
from deepinfer.triton_cache_rounding import pack_groups, pack_layout, unpack_groups, unpack_layout
from deepinfer.triton_common import cdiv, interpreting, to_bf16_rne
from deepinfer_cuda.kernels.common import Registration, pdl_launch, pdl_prologue

_GROUPS_PER_PROGRAM = 128  # 4096 channels of 32 per program: a memory-bound elementwise pass


@triton.jit
def _pack_kernel(
    x_ptr, rows_ptr, n_groups, groups_per_row, C, stride_x, W, FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    pack_groups(x_ptr, rows_ptr, g, n_groups, groups_per_row, C, stride_x, W, FMT, GROUP)


@triton.jit
def _unpack_kernel(
    rows_ptr, out_ptr, n_groups, groups_per_row, C, W, FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, MANUAL_RNE: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    values, offsets, ok = unpack_groups(rows_ptr, g, n_groups, groups_per_row, C, W, FMT, GROUP)
    if MANUAL_RNE:
        tl.store(out_ptr + offsets, to_bf16_rne(values), mask=ok)
    else:
        tl.store(out_ptr + offsets, values.to(out_ptr.dtype.element_ty), mask=ok)


def cache_pack(x: torch.Tensor, *, fmt: str) -> torch.Tensor:
    rows, out, groups_per_row, n_groups = pack_layout(x, fmt)
    if x.numel() == 0:
        return out
    _pack_kernel[(cdiv(n_groups, _GROUPS_PER_PROGRAM),)](
        rows, out, n_groups, groups_per_row, x.shape[-1], rows.stride(0), out.shape[-1],
        FMT=fmt, GROUP=GROUP[fmt], BLOCK_G=_GROUPS_PER_PROGRAM, **pdl_launch(rows.device),
    )  # fmt: skip
    return out


def cache_unpack(rows: torch.Tensor, out: torch.Tensor, *, fmt: str) -> torch.Tensor:
    flat_rows, dense, groups_per_row, n_groups = unpack_layout(rows, out, fmt)
    if out.numel() == 0:
        return out
    _unpack_kernel[(cdiv(n_groups, _GROUPS_PER_PROGRAM),)](
        flat_rows, dense, n_groups, groups_per_row, out.shape[-1], flat_rows.shape[-1],
        FMT=fmt, GROUP=GROUP[fmt], BLOCK_G=_GROUPS_PER_PROGRAM, MANUAL_RNE=out.dtype == torch.bfloat16 and interpreting(), **pdl_launch(flat_rows.device),
    )  # fmt: skip
    if dense is not out:
        out.copy_(dense)
    return out


REGISTRATIONS = [
    Registration(
        op="cache_pack",
        fn=cache_pack,
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        note="Triton: groups of channels per program, cache_round's rounding, codes and scale bytes stored (bit-exact)",
        batch_invariant=True,  # each group alone; its amax is a max
    ),
    Registration(
        op="cache_unpack",
        fn=cache_unpack,
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        note="Triton: groups of channels per program, integer e4m3 / e2m1 decode times the group's scale (bit-exact)",
        batch_invariant=True,
    ),
]
