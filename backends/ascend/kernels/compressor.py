"""Ascend Triton kernel: compress_kv (DeepSeek-V4's KV compressor: a gated softmax pooling per window).

Entry e, channel c pools the kv values of its window's slots with a softmax over the slots of
gate + position_bias, per channel (deepinfer.ops.compressor.compress_kv). Memory-bound: each
window's kv / gate rows are read once, the entry written once.

Grid: `vector_grid(n_tiles)` programs, each looping over its tiles. A tile is BLOCK_E entries x
BLOCK_D channels; the program walks the window's slots one at a time (a loop over RATIO, not
unrolled: HCA has 128 slots), loading per slot a [BLOCK_E, BLOCK_D] block of kv and of gate (the
rows window_starts[e] + j, channels contiguous) and the bias row, and folds it into an online
softmax in float32: running maximum m, denominator and numerator rescaled by exp(m_old - m_new).
The current window's slots come first (with overlap: channels D..2D), so m is finite from slot 0
on; with overlap the previous window's slots follow (rows prev_starts[e] + j, channels 0..D), their
logits -inf where prev_starts[e] < 0, which adds exactly nothing. A window start of -1 (a decode
step's sequence whose window does not close) masks the entry's loads off: its numerator stays 0 and
it stores zeros. out = numerator / denominator,
rounded to kv's dtype by `to_output`. The slot order is fixed: the reduction order does not depend
on the grid.

Buffer budget: about 10 float32 [BLOCK_E, BLOCK_D] values live (running m, denominator, numerator,
the slot's value, logit, bias, two exps, the new maximum, the mask): 40 bytes per element under
half the unified buffer: 2048-element tiles on A2/A3 and on 950 (rounded down to a power of two).

Deterministic mode (`compress_kv_invariant`): an element's result is its own online softmax over
its slots in a fixed order, whatever the tile; but BLOCK_E follows the entry count, so calls with
other counts run other compiled kernels, and whether the compiler contracts `den * alpha + p` and
`num * alpha + p * v` into FMAs alike in each is not guaranteed. The invariant kernel always takes
the most entries the buffer holds (BLOCK_E from the channels and the chip only). Cost: a few
masked rows in a small call.

Index arithmetic is int32 (row * stride; IDX64 switches to int64 when kv or gate has >= 2^31
elements). window_starts / prev_starts are read on the device: no host synchronisation. float64
inputs (a test dtype; no float64 on the vector units) go to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.compressor import check_compress_kv_args
from deepinfer.ops.compressor import compress_kv as _reference
from deepinfer.triton_common import cdiv, last_dim_contiguous, next_power_of_2
from deepinfer_ascend.kernels.common import Registration, launch_options, tile_elems, to_output, vector_grid

_BYTES_PER_ELEM = 40
_MAX_COLS = 512  # channels per tile: wider entries are split into several tiles
INT32_LIMIT = 2**31


@triton.jit
def _compress_kv_kernel(
    kv_ptr, gate_ptr, bias_ptr, starts_ptr, prevs_ptr, out_ptr,
    E, D, n_tiles, d_tiles,
    stride_kv, stride_g, stride_b, stride_o,
    RATIO: tl.constexpr,
    OVERLAP: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IDX64: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    arange_e = tl.arange(0, BLOCK_E)
    arange_d = tl.arange(0, BLOCK_D)
    for tile in range(pid, n_tiles, nprog):
        offs_e = (tile // d_tiles) * BLOCK_E + arange_e
        offs_d = (tile % d_tiles) * BLOCK_D + arange_d
        e_ok = offs_e < E
        d_ok = offs_d < D
        out_ok = e_ok[:, None] & d_ok[None, :]
        if OVERLAP:
            col = offs_d + D  # the current window's slots: the second D channels
        else:
            col = offs_d
        if IDX64:
            start = tl.load(starts_ptr + offs_e, mask=e_ok, other=-1).to(tl.int64)
        else:
            start = tl.load(starts_ptr + offs_e, mask=e_ok, other=-1).to(tl.int32)
        ok = out_ok & (start >= 0)[:, None]  # a start of -1 skips the entry: nothing loaded, zeros stored
        start = tl.maximum(start, 0)
        kv_rows = kv_ptr + (start * stride_kv)[:, None] + col[None, :]
        g_rows = gate_ptr + (start * stride_g)[:, None] + col[None, :]
        b_row = bias_ptr + col
        # Slot 0 of the current window starts the online softmax (a finite maximum from the start).
        num = tl.load(kv_rows, mask=ok, other=0.0).to(tl.float32)
        m = tl.load(g_rows, mask=ok, other=0.0).to(tl.float32) + tl.load(b_row, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        den = tl.full([BLOCK_E, BLOCK_D], 1.0, tl.float32)
        for j in range(1, RATIO):
            v = tl.load(kv_rows + j * stride_kv, mask=ok, other=0.0).to(tl.float32)
            lg = tl.load(g_rows + j * stride_g, mask=ok, other=0.0).to(tl.float32)
            lg += tl.load(b_row + j * stride_b, mask=d_ok, other=0.0).to(tl.float32)[None, :]
            m_new = tl.maximum(m, lg)
            alpha = tl.exp(m - m_new)
            p = tl.exp(lg - m_new)
            den = den * alpha + p
            num = num * alpha + p * v
            m = m_new
        if OVERLAP:
            # The previous window's first D channels; none (prev < 0): its logits are -inf, p = 0.
            if IDX64:
                prev = tl.load(prevs_ptr + offs_e, mask=e_ok, other=-1).to(tl.int64)
            else:
                prev = tl.load(prevs_ptr + offs_e, mask=e_ok, other=-1).to(tl.int32)
            has = prev >= 0
            p_ok = ok & has[:, None]
            prev = tl.maximum(prev, 0)
            pkv_rows = kv_ptr + (prev * stride_kv)[:, None] + offs_d[None, :]
            pg_rows = gate_ptr + (prev * stride_g)[:, None] + offs_d[None, :]
            pb_row = bias_ptr + offs_d
            for j in range(0, RATIO):
                v = tl.load(pkv_rows + j * stride_kv, mask=p_ok, other=0.0).to(tl.float32)
                lg = tl.load(pg_rows + j * stride_g, mask=p_ok, other=0.0).to(tl.float32)
                lg += tl.load(pb_row + j * stride_b, mask=d_ok, other=0.0).to(tl.float32)[None, :]
                lg = tl.where(p_ok, lg, float("-inf"))
                m_new = tl.maximum(m, lg)
                alpha = tl.exp(m - m_new)
                p = tl.exp(lg - m_new)
                den = den * alpha + p
                num = num * alpha + p * v
                m = m_new
        out = num / den
        if IDX64:
            dst = out_ptr + (offs_e.to(tl.int64) * stride_o)[:, None] + offs_d[None, :]
        else:
            dst = out_ptr + (offs_e * stride_o)[:, None] + offs_d[None, :]
        tl.store(dst, to_output(out, out_ptr), mask=out_ok)


def compress_kv(
    kv: torch.Tensor,
    gate: torch.Tensor,
    position_bias: torch.Tensor,
    window_starts: torch.Tensor,
    prev_starts: torch.Tensor,
    *,
    ratio: int,
    overlap: bool,
) -> torch.Tensor:
    return _compress_kv(kv, gate, position_bias, window_starts, prev_starts, ratio, overlap, invariant=False)


def compress_kv_invariant(
    kv: torch.Tensor,
    gate: torch.Tensor,
    position_bias: torch.Tensor,
    window_starts: torch.Tensor,
    prev_starts: torch.Tensor,
    *,
    ratio: int,
    overlap: bool,
) -> torch.Tensor:
    return _compress_kv(kv, gate, position_bias, window_starts, prev_starts, ratio, overlap, invariant=True)


def _compress_kv(kv, gate, position_bias, window_starts, prev_starts, ratio, overlap, invariant):
    """invariant: BLOCK_E is the most entries the buffer takes, whatever E (deterministic mode)."""
    check_compress_kv_args(kv, gate, position_bias, window_starts, prev_starts, ratio, overlap)
    if kv.dtype == torch.float64:
        return _reference(kv, gate, position_bias, window_starts, prev_starts, ratio=ratio, overlap=overlap)
    width = kv.shape[1]
    dim = width // 2 if overlap else width
    entries = window_starts.shape[0]
    out = torch.empty(entries, dim, dtype=kv.dtype, device=kv.device)
    if entries == 0 or dim == 0:
        return out
    kv, gate, position_bias = last_dim_contiguous(kv, gate, position_bias)
    window_starts = window_starts.contiguous()
    prev_starts = prev_starts.contiguous() if overlap else window_starts
    block_d = max(min(next_power_of_2(dim), _MAX_COLS), 32 // kv.element_size())
    most = tile_elems(_BYTES_PER_ELEM) // block_d
    block_e = max(1, most if invariant else min(most, next_power_of_2(entries)))
    d_tiles = cdiv(dim, block_d)
    n_tiles = cdiv(entries, block_e) * d_tiles
    idx64 = max(kv.shape[0] * kv.stride(0), gate.shape[0] * gate.stride(0), entries * dim) + width >= INT32_LIMIT
    _compress_kv_kernel[(vector_grid(n_tiles),)](
        kv, gate, position_bias, window_starts, prev_starts, out,
        entries, dim, n_tiles, d_tiles,
        kv.stride(0), gate.stride(0), position_bias.stride(0), out.stride(0),
        RATIO=ratio, OVERLAP=bool(overlap),
        BLOCK_E=block_e, BLOCK_D=block_d,
        IDX64=idx64,
        **launch_options(),
    )
    return out


REGISTRATIONS = [
    Registration(
        op="compress_kv",
        fn=compress_kv,
        note="Triton (ascend): persistent vector grid, entry x channel tiles, online softmax over the slots",
    ),
    Registration(
        op="compress_kv",
        fn=compress_kv_invariant,
        priority=-1,
        batch_invariant=True,
        note="Triton (ascend): the kernel above with BLOCK_E fixed by the channels and the buffer (not by the entry count)",
    ),
]
