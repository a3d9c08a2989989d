"""Ascend Triton kernel: `rms_norm`, with the residual add fused in front of it.

Grid: `vector_grid(n_tiles)` programs (one per vector core); each loops over its tiles
(`for tile in range(pid, n_tiles, num_programs)`).

Tiling: a tile is BLOCK_T rows x BLOCK_D columns. When a whole row fits (next_power_of_2(D) <= the
column budget) a tile holds BLOCK_T full rows and the row is read once: h = x + residual (rounded
to x's dtype, as the reference rounds it), mean of h^2 in float32, out = h * rstd * weight.
Otherwise (DeepSeek-V3's hidden size 7168 on A2/A3) a tile is one row, walked twice in BLOCK_D
chunks: pass 1 writes h and sums h^2, pass 2 recomputes h from x and residual (bit-identical to the
h written; no read-after-write of global memory inside a program) and writes out.

Buffer budget: about 5 float32 values live per tile element (x, residual, h, weight, out) plus the
input-dtype copies: 24 bytes x BLOCK_T x BLOCK_D kept under half of the unified buffer
(96 KB on A2/A3 -> 4096 elements, 128 KB on 950 -> 4096 elements, power of two).

Outputs are rounded to nearest even (`common.to_output`, shared with the other vector kernels): bfloat16 by
hand on the float32 bits, since the interpreter's cast truncates and triton-ascend's default
rounding mode is not documented.

Deterministic mode (`rms_norm_invariant`): BLOCK_T above follows T (fewer rows per tile for a
short batch), and a row's sum of squares is a tl.sum over the tile's axis 1, whose reduction tree
the hardware may choose by the tile's shape. The invariant kernel always takes the most rows the
buffer holds (BLOCK_T from D and the chip only); the chunked path already has one row per tile.
Cost: a small batch's tile is mostly masked rows (no memory traffic; a few idle vector lanes).

float64 inputs (a test dtype; Ascend vector units have no float64 arithmetic) go to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.norm import rms_norm as _reference
from deepinfer.triton_common import cdiv, next_power_of_2
from deepinfer_ascend.kernels.common import Registration, launch_options, tile_elems, to_output, vector_grid

_BYTES_PER_ELEM = 24


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, h_ptr,
    T, D, stride_x, stride_r, stride_o, stride_h, eps,
    HAS_RES: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNKED: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_tiles = tl.cdiv(T, BLOCK_T)
    rows_ar = tl.arange(0, BLOCK_T)
    cols_ar = tl.arange(0, BLOCK_D)
    for tile in range(pid, n_tiles, nprog):
        rows = tile * BLOCK_T + rows_ar
        r_ok = rows < T
        if CHUNKED:
            # one row (BLOCK_T == 1), two passes over its column chunks
            ss = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            for c in range(0, D, BLOCK_D):
                cols = c + cols_ar
                ok = r_ok[:, None] & (cols < D)[None, :]
                x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
                if HAS_RES:
                    r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=ok, other=0.0)
                    h = to_output(x.to(tl.float32) + r.to(tl.float32), h_ptr)
                    tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h, mask=ok)
                else:
                    h = x
                hf = h.to(tl.float32)
                ss += hf * hf
            rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=1) / D + eps)
            for c in range(0, D, BLOCK_D):
                cols = c + cols_ar
                c_ok = cols < D
                ok = r_ok[:, None] & c_ok[None, :]
                x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
                if HAS_RES:
                    r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=ok, other=0.0)
                    h = to_output(x.to(tl.float32) + r.to(tl.float32), h_ptr)
                else:
                    h = x
                w = tl.load(w_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
                out = h.to(tl.float32) * rstd[:, None] * w[None, :]
                tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], to_output(out, out_ptr), mask=ok)
        else:
            c_ok = cols_ar < D
            ok = r_ok[:, None] & c_ok[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols_ar[None, :], mask=ok, other=0.0)
            if HAS_RES:
                r = tl.load(r_ptr + rows[:, None] * stride_r + cols_ar[None, :], mask=ok, other=0.0)
                h = to_output(x.to(tl.float32) + r.to(tl.float32), h_ptr)
                tl.store(h_ptr + rows[:, None] * stride_h + cols_ar[None, :], h, mask=ok)
            else:
                h = x
            hf = h.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=1) / D + eps)
            w = tl.load(w_ptr + cols_ar, mask=c_ok, other=0.0).to(tl.float32)
            out = hf * rstd[:, None] * w[None, :]
            tl.store(out_ptr + rows[:, None] * stride_o + cols_ar[None, :], to_output(out, out_ptr), mask=ok)


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    t2 = t.reshape(-1, D)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _rms_norm(x, weight, eps, residual, invariant=False)


def rms_norm_invariant(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _rms_norm(x, weight, eps, residual, invariant=True)


def _rms_norm(x, weight, eps, residual, invariant):
    """invariant: BLOCK_T is the most rows the buffer takes, whatever T (deterministic mode)."""
    D = x.shape[-1]
    if x.dtype == torch.float64 or x.numel() >= 2**31:
        # no float64 on the vector units; int32 offsets: the reference takes these
        return _reference(x, weight, eps=eps, residual=residual)
    x2 = _rows(x, D)
    T = x2.shape[0]
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    h = None
    if residual is not None:
        r2 = _rows(residual, D)
        h = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0 or D == 0:
        if D == 0:
            out.zero_()
        return out.reshape(x.shape), (None if h is None else h.reshape(x.shape))
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    elems = tile_elems(_BYTES_PER_ELEM)
    block_d = max(next_power_of_2(D), 32 // x.element_size())  # rows of at least 32 bytes
    chunked = block_d > elems
    if chunked:
        block_d, block_t = elems, 1
    else:
        block_t = max(1, elems // block_d if invariant else min(elems // block_d, next_power_of_2(T)))
    n_tiles = cdiv(T, block_t)
    _rms_norm_kernel[(vector_grid(n_tiles),)](
        x2, r2 if h is not None else x2, w, out, h if h is not None else out,
        T, D, x2.stride(0), (r2 if h is not None else x2).stride(0), out.stride(0), (h if h is not None else out).stride(0), float(eps),
        HAS_RES=h is not None, BLOCK_T=block_t, BLOCK_D=block_d, CHUNKED=chunked,
        **launch_options(),
    )
    return out.reshape(x.shape), (None if h is None else h.reshape(x.shape))


REGISTRATIONS = [
    Registration(
        op="rms_norm",
        fn=rms_norm,
        note="Triton (ascend): persistent vector grid, rows in one tile or two chunked passes, float32 statistics",
    ),
    Registration(
        op="rms_norm",
        fn=rms_norm_invariant,
        priority=-1,
        batch_invariant=True,
        note="Triton (ascend): the kernel above with BLOCK_T fixed by D and the buffer (not by T)",
    ),
]
