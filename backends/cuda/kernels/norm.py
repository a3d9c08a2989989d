"""Triton kernels: rms_norm, with the residual add fused in front of it.

Memory-bound: each element of x (and residual) is read once, out (and the sum h) written once.
A program holds whole rows in registers (BLOCK_T rows of BLOCK_D = next_power_of_2(D) columns),
so one pass suffices: sum of squares in float32 (float64 for float64 inputs), then scale. Small D
packs several rows per program so each one moves enough bytes; the warps scale with the tile so
every thread issues 16-byte loads. Rows longer than `max_block_d` fall back to a two-pass loop
over column chunks (the second pass re-reads the inputs, which L2 mostly still holds).

The wrapper reads only shapes and strides: no host synchronisation (CUDA-graph safe).

Deterministic mode (the batch-invariant registration, `rms_norm_invariant`): the rows kernel with
one tile for every T, the full tile_elems // BLOCK_D rows and its warps, so each row's sum of
squares has the same reduction tree (a tl.sum over the tile's axis follows the tile's shape and
warps on a GPU) whatever the batch; the long-row loop already depends on D only.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from deepinfer.triton_common import next_power_of_2
from deepinfer_cuda.kernels.common import Registration, num_warps_for, pdl_launch, pdl_prologue
from deepinfer_cuda.tuning import config


@triton.jit(do_not_specialize=["T"])
def _rms_norm_rows_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, h_ptr,
    T, D,
    stride_x, stride_r, stride_out, stride_h,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    rows = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < T
    col_ok = cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        # The reference rounds the sum to the input dtype first; the statistics use that value.
        h = (x.to(ACC) + r.to(ACC)).to(x.dtype)
        tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h, mask=mask)
        hf = h.to(ACC)
    else:
        hf = x.to(ACC)
    mean_sq = tl.sum(hf * hf, axis=1) / D
    inv = 1.0 / tl.sqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(ACC)
    out = hf * inv[:, None] * w[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_long_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, h_ptr,
    D,
    stride_x, stride_r, stride_out, stride_h,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    acc = tl.zeros([BLOCK_D], dtype=ACC)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        ok = cols < D
        x = tl.load(x_row + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_row + cols, mask=ok, other=0.0)
            h = (x.to(ACC) + r.to(ACC)).to(x.dtype)
            tl.store(h_ptr + row * stride_h + cols, h, mask=ok)
            hf = h.to(ACC)
        else:
            hf = x.to(ACC)
        acc += hf * hf
    inv = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / D + eps)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        ok = cols < D
        x = tl.load(x_row + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            # Recomputed from the inputs rather than re-read from h: no cross-thread visibility question.
            r = tl.load(r_row + cols, mask=ok, other=0.0)
            hf = (x.to(ACC) + r.to(ACC)).to(x.dtype).to(ACC)
        else:
            hf = x.to(ACC)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(ACC)
        out = hf * inv * w
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@lru_cache(maxsize=None)
def _config(device: torch.device) -> dict:
    return config("rms_norm", "rows", device)


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """A 2-D [rows, D] view with unit column stride (a copy only when no such view exists)."""
    t2 = t.reshape(-1, D)
    return t2 if t2.stride(-1) == 1 or D == 1 else t2.contiguous()


def _rows_per_program(T: int, block_d: int, cfg: dict) -> int:
    # Several rows per program for narrow rows, but never so many that fewer than `min_programs`
    # programs remain (decode batches): the tile halves until the grid fills the machine. Decided for
    # T's power-of-two bucket: one kernel per bucket (what a start-up warm-up compiles).
    tile, bucket = cfg["tile_elems"], next_power_of_2(T)
    while True:
        block_t = max(1, min(tile // block_d, bucket))
        if block_t == 1 or triton.cdiv(bucket, block_t) >= cfg.get("min_programs", 1):
            return block_t
        tile //= 2


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return launch_rms_norm(x, weight, eps, residual)


def rms_norm_invariant(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return launch_rms_norm(x, weight, eps, residual, invariant=True)


def launch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, *, invariant: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rms_norm; invariant: one rows tile for every T (deterministic mode, see the module docstring)."""
    D = x.shape[-1]
    x2 = _rows(x, D)
    T = x2.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, D)
    if residual is not None:
        r2 = _rows(residual, D)
        h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        h2 = h.view(-1, D)
    else:
        r2, h, h2 = x2, None, out2  # placeholders, never touched (HAS_RESIDUAL is False)
    if T == 0 or D == 0:
        return out, h
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    cfg = _config(x.device)
    acc = _acc(x.dtype)
    block_d = next_power_of_2(D)
    if block_d <= cfg["max_block_d"]:
        block_t = max(1, cfg["tile_elems"] // block_d) if invariant else _rows_per_program(T, block_d, cfg)
        grid = (triton.cdiv(T, block_t),)
        _rms_norm_rows_kernel[grid](
            x2, r2, w, out2, h2, T, D,
            x2.stride(0), r2.stride(0), out2.stride(0), h2.stride(0), eps,
            HAS_RESIDUAL=residual is not None, ACC=acc, BLOCK_T=block_t, BLOCK_D=block_d,
            num_warps=num_warps_for(block_t * block_d, x.element_size(), cfg), **pdl_launch(x2.device),
        )
    else:
        chunk = cfg["loop_block_d"]
        _rms_norm_long_kernel[(T,)](
            x2, r2, w, out2, h2, D,
            x2.stride(0), r2.stride(0), out2.stride(0), h2.stride(0), eps,
            HAS_RESIDUAL=residual is not None, ACC=acc, BLOCK_D=chunk,
            num_warps=num_warps_for(chunk, x.element_size(), cfg), **pdl_launch(x2.device),
        )
    return out, h


REGISTRATIONS = [
    Registration(
        op="rms_norm",
        fn=rms_norm,
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        note="Triton (rows in registers, fused residual add)",
    ),
    Registration(
        op="rms_norm",
        fn=rms_norm_invariant,
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        priority=-1,
        batch_invariant=True,
        note="Triton (rows in registers, fused residual add; one tile of tile_elems // D rows for every row count)",
    ),
]
