"""What the ascend kernel modules share beyond `deepinfer.triton_common`: grid sizing by core count,
tile sizing by the on-chip buffer, compile options, dot precision and output rounding. Not a
registration module.

triton-ascend maps each program of the grid to a physical core: vector kernels launch
`num_vectorcore` programs and tl.dot kernels `num_aicore`, and every program loops over its share of
the tiles (a persistent grid). Last dimensions are 32-byte aligned; blocks must fit the on-chip
buffer; index arithmetic stays in int32 (int64 is slow there). Ascend-only compile options are
passed only when triton-ascend is the installed Triton, so the same source runs under community
Triton's interpreter.
"""

from __future__ import annotations

import importlib.metadata
import inspect

import torch
import triton
import triton.language as tl

from deepinfer.registry import Registration  # noqa: F401  (kernel modules import it from here)
from deepinfer.triton_common import e4m3_bits_to_f32
from deepinfer_ascend.device import current


def is_triton_ascend() -> bool:
    try:
        importlib.metadata.version("triton-ascend")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def launch_options(**ascend_only) -> dict:
    """Extra kernel-launch keyword arguments (e.g. multibuffer=True) for triton-ascend only."""
    return dict(ascend_only) if is_triton_ascend() else {}


def vector_grid(num_tiles: int) -> int:
    """Programs for a vector kernel: one per vector core, never more than there are tiles."""
    return max(1, min(num_tiles, current().num_vectorcore))


def cube_grid(num_tiles: int) -> int:
    """Programs for a tl.dot kernel: one per AI core, never more than there are tiles."""
    return max(1, min(num_tiles, current().num_aicore))


def tile_elems(bytes_per_elem: int) -> int:
    """Largest power-of-two tile (elements) whose live values, `bytes_per_elem` per element, use at
    most half the unified buffer (the other half is left to triton-ascend's double buffering)."""
    budget = current().ub_bytes // 2 // bytes_per_elem
    return 1 << (budget.bit_length() - 1)


def aligned(n: int, dtype: torch.dtype) -> int:
    """n rounded up so a row of n elements is a multiple of 32 bytes."""
    per = max(1, 32 // torch.empty((), dtype=dtype).element_size())
    return -(-n // per) * per


def dot_precision(dot_f32: bool):
    """float32 operands must not be truncated (tf32 / hf32): ask for "ieee" where tl.dot takes it."""
    if dot_f32 and "input_precision" in inspect.signature(tl.dot).parameters:
        return "ieee"
    return None


@triton.jit
def to_output(x, out_ptr):
    """float32 x in out_ptr's element type, rounded to nearest even like torch's `.to()`.

    bfloat16 is rounded by hand on the float32 bits: the Triton interpreter's float32 -> bfloat16
    cast truncates, and triton-ascend's default rounding is not documented; exact for finite
    values (subnormals may flush), infinities stay infinite. Other types use the plain cast.
    """
    if out_ptr.dtype.element_ty == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        rounded = (b + (0x7FFF + ((b >> 16) & 1))) & -65536
        y = tl.where(x == x, rounded, b).to(tl.float32, bitcast=True).to(tl.bfloat16)  # nan stays nan
    else:
        y = x.to(out_ptr.dtype.element_ty)
    return y


@triton.jit
def add_chunked_scores(
    scores, q_rows, q_ok, k_rows, k_ok, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, CHUNK: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr
):
    """scores [M, N] += q [M, WIDTH] . k [N, WIDTH]^T, loaded CHUNK columns at a time from the row
    pointers q_rows [M] and k_rows [N] (masks q_ok, k_ok): the attention kernels' way to keep the
    query and key tiles of a wide head (512) inside the unified buffer."""
    for c0 in tl.static_range(0, BLOCK_W, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        ok = offs < WIDTH
        qc = tl.load(q_rows[:, None] + offs[None, :], mask=q_ok[:, None] & ok[None, :], other=0.0)
        kc = tl.load(k_rows[:, None] + offs[None, :], mask=k_ok[:, None] & ok[None, :], other=0.0)
        if DOT_F32:
            qc = qc.to(tl.float32)
            kc = kc.to(tl.float32)
        scores = tl.dot(qc, tl.trans(kc), scores, input_precision=DOT_PRECISION)
    return scores


@triton.jit
def load_q_cols(q_rows, row_ok, col0, WIDTH: tl.constexpr, BLOCK: tl.constexpr, DOT_F32: tl.constexpr):
    """q[rows, col0 : col0 + BLOCK] (zeros past WIDTH), in the dot dtype."""
    offs = col0 + tl.arange(0, BLOCK)
    q = tl.load(q_rows[:, None] + offs[None, :], mask=row_ok[:, None] & (offs < WIDTH)[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    return q


@triton.jit
def load_kv_cols(rows, ok, col0, like, WIDTH: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr):
    """Columns col0 .. col0 + BLOCK - 1 of cache rows (zeros past WIDTH or for rows not ok) in
    `like`'s dtype. FP8: byte rows, their e4m3 values decoded exactly by integer arithmetic
    (A2/A3 have no float8 type), unscaled: the caller applies each row's scale."""
    offs = col0 + tl.arange(0, BLOCK)
    mask = ok[:, None] & (offs < WIDTH)[None, :]
    if FP8:
        t = e4m3_bits_to_f32(tl.load(rows[:, None] + offs[None, :], mask=mask, other=0).to(tl.int32))
    else:
        t = tl.load(rows[:, None] + offs[None, :], mask=mask, other=0.0)
    return t.to(like.dtype)
