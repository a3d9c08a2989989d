"""Triton kernel: compress_kv (DeepSeek-V4's KV compressor: a gated softmax pooling per window).

Entry e, channel c pools the kv values of its window's slots with a softmax over the slots of
gate + position_bias, per channel (deepinfer.ops.compressor.compress_kv). Memory-bound: each
window's kv / gate rows are read once, the entry written once.

Grid: (entry blocks, channel blocks). A program loads a [BLOCK_E, RATIO, BLOCK_D] tile of kv and
of gate (rows window_starts[e] + j gathered by the entry's start, channels contiguous, so every
row segment is one contiguous 16-byte-vector load) and the bias tile [RATIO, BLOCK_D] once; the
softmax is then one tl.max and two tl.sum along the slot axis (a fixed reduction order, no online
rescaling): out = sum_j exp(l_j - m) v_j / sum_j exp(l_j - m). With overlap a second tile holds the
previous window's slots (rows prev_starts[e] + j, the first D channels; the current window's come
from channels D..2D), masked to -inf logits where prev_starts[e] < 0; the maximum always includes
the current window's slots, so it is finite. A window start of -1 (a decode step's sequence whose
window does not close) masks the entry's loads off and stores zeros; a program whose entries are all
skipped loads only the starts, so a decode step costs what its closing windows read. exp is libdevice's on the GPU (within 1 ulp: the
gate logits span hundreds with large gates, where the approximate exp's relative error grows with
the argument), numpy's under the interpreter.

Tiles are sized by elements (the slot axis padded to a power of two): a few thousand per program
on a GPU (HCA's 128 slots: one entry x 32 channels; CSA's 2 x 4 slots: 8 entries x 128 channels),
larger under the interpreter (fewer programs).
Row offsets are int64 (rows x width can pass 2^31). window_starts / prev_starts are read on the
device: no host synchronisation (CUDA-graph safe). Computed in float32 (float64 for float64 kv);
bfloat16 outputs are rounded to nearest even by bit arithmetic under the interpreter (its casts
truncate).

Deterministic mode (`compress_kv_invariant`): BLOCK_E is the tile's full tile // (RATIO_PAD *
BLOCK_D) entries whatever the number of entries (the default lowers it to the entries of the call),
so the sums along the slot axis of the [BLOCK_E, RATIO, BLOCK_D] tile keep one reduction tree on a
GPU; BLOCK_D follows D and the ratio only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.compressor import check_compress_kv_args
from deepinfer.triton_common import cdiv, interpreting, last_dim_contiguous, next_power_of_2, to_bf16_rne
from deepinfer_cuda.kernels.common import Registration, pdl_launch, pdl_prologue
from deepinfer_cuda.kernels.precise_math import precise_exp

_GPU_TILE = 4096  # elements of one [BLOCK_E, RATIO, BLOCK_D] tile on a GPU (two of them with overlap)
_INTERPRET_TILE = 65536  # under the interpreter: few, large programs
_MAX_BLOCK_D = 128  # channels per program on a GPU


@triton.jit
def _compress_kv_kernel(
    kv_ptr, gate_ptr, bias_ptr, starts_ptr, prevs_ptr, out_ptr,
    E, D,
    stride_kv, stride_g, stride_b, stride_o,
    RATIO: tl.constexpr,
    BLOCK_R: tl.constexpr,
    OVERLAP: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    MANUAL_RNE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    pid_e = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_j = tl.arange(0, BLOCK_R)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    e_ok = offs_e < E
    j_ok = offs_j < RATIO
    d_ok = offs_d < D
    ok = e_ok[:, None, None] & j_ok[None, :, None] & d_ok[None, None, :]
    jd_ok = j_ok[:, None] & d_ok[None, :]
    # The current window: rows start + j; with overlap its slots are the second D channels.
    if OVERLAP:
        col = offs_d + D
    else:
        col = offs_d
    # A start of -1 skips the entry (no window closes there): its lanes load nothing and it stores zeros; a
    # program whose entries are all skipped does not load the bias either (decode: most sequences close no window).
    start = tl.load(starts_ptr + offs_e, mask=e_ok, other=-1).to(tl.int64)
    taken = start >= 0
    ok = ok & taken[:, None, None]
    any_taken = tl.max(taken.to(tl.int32), axis=0)
    jd_ok = jd_ok & ((offs_j[:, None] * 0 + any_taken) > 0)  # (a scalar mask broadcast with `&` upsets the interpreter)
    rows = tl.maximum(start, 0)[:, None, None] + offs_j[None, :, None]
    value = tl.load(kv_ptr + rows * stride_kv + col[None, None, :], mask=ok, other=0.0).to(ACC)
    logit = tl.load(gate_ptr + rows * stride_g + col[None, None, :], mask=ok, other=0.0).to(ACC)
    bias = tl.load(bias_ptr + offs_j[:, None] * stride_b + col[None, :], mask=jd_ok, other=0.0).to(ACC)
    logit = tl.where(ok, logit + bias[None, :, :], float("-inf"))
    m = tl.max(logit, axis=1)
    if OVERLAP:
        # The previous window's first D channels; no previous window: its slots weigh nothing.
        prev = tl.load(prevs_ptr + offs_e, mask=e_ok, other=-1).to(tl.int64)
        p_ok = ok & (prev >= 0)[:, None, None]
        p_rows = tl.maximum(prev, 0)[:, None, None] + offs_j[None, :, None]
        p_value = tl.load(kv_ptr + p_rows * stride_kv + offs_d[None, None, :], mask=p_ok, other=0.0).to(ACC)
        p_logit = tl.load(gate_ptr + p_rows * stride_g + offs_d[None, None, :], mask=p_ok, other=0.0).to(ACC)
        p_bias = tl.load(bias_ptr + offs_j[:, None] * stride_b + offs_d[None, :], mask=jd_ok, other=0.0).to(ACC)
        p_logit = tl.where(p_ok, p_logit + p_bias[None, :, :], float("-inf"))
        m = tl.maximum(m, tl.max(p_logit, axis=1))
    m = tl.where(m == float("-inf"), 0.0, m)  # lanes past E or D, and skipped entries (zeros: num = den = 0)
    w = precise_exp(logit - m[:, None, :], LIBDEVICE)
    num = tl.sum(w * value, axis=1)
    den = tl.sum(w, axis=1)
    if OVERLAP:
        p_w = precise_exp(p_logit - m[:, None, :], LIBDEVICE)
        num += tl.sum(p_w * p_value, axis=1)
        den += tl.sum(p_w, axis=1)
    out = num / tl.where(den > 0.0, den, 1.0)
    out_ok = e_ok[:, None] & d_ok[None, :]
    dst = out_ptr + offs_e.to(tl.int64)[:, None] * stride_o + offs_d[None, :]
    if MANUAL_RNE:
        tl.store(dst, to_bf16_rne(out), mask=out_ok)
    else:
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_ok)


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
    return launch_compress_kv(kv, gate, position_bias, window_starts, prev_starts, ratio, overlap)


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
    return launch_compress_kv(kv, gate, position_bias, window_starts, prev_starts, ratio, overlap, invariant=True)


def launch_compress_kv(kv, gate, position_bias, window_starts, prev_starts, ratio, overlap, *, invariant: bool = False) -> torch.Tensor:
    """compress_kv; invariant: one entry tile for every number of entries (deterministic mode)."""
    check_compress_kv_args(kv, gate, position_bias, window_starts, prev_starts, ratio, overlap)
    width = kv.shape[1]
    dim = width // 2 if overlap else width
    entries = window_starts.shape[0]
    out = torch.empty(entries, dim, dtype=kv.dtype, device=kv.device)
    if entries == 0 or dim == 0:
        return out
    kv, gate, position_bias = last_dim_contiguous(kv, gate, position_bias)
    window_starts = window_starts.contiguous()
    prev_starts = prev_starts.contiguous() if overlap else window_starts
    block_r = next_power_of_2(ratio)
    tile = _INTERPRET_TILE if interpreting() else _GPU_TILE
    block_d = max(1, min(next_power_of_2(dim), tile // block_r))
    if not interpreting():
        block_d = min(block_d, _MAX_BLOCK_D)
    block_e = max(1, tile // (block_r * block_d))
    if not invariant:
        block_e = min(block_e, next_power_of_2(entries))
    grid = (cdiv(entries, block_e), cdiv(dim, block_d))
    _compress_kv_kernel[grid](
        kv, gate, position_bias, window_starts, prev_starts, out,
        entries, dim,
        kv.stride(0), gate.stride(0), position_bias.stride(0), out.stride(0),
        RATIO=ratio, BLOCK_R=block_r, OVERLAP=bool(overlap),
        ACC=tl.float64 if kv.dtype == torch.float64 else tl.float32,
        BLOCK_E=block_e, BLOCK_D=block_d,
        LIBDEVICE=not interpreting(),
        MANUAL_RNE=interpreting() and kv.dtype == torch.bfloat16,
        num_warps=4, **pdl_launch(kv.device),
    )
    return out


REGISTRATIONS = [
    Registration(
        op="compress_kv",
        fn=compress_kv,
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        note="Triton: [entries x slots x channels] tiles, one-shot softmax along the slots",
    ),
    Registration(
        op="compress_kv",
        fn=compress_kv_invariant,
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        priority=-1,
        batch_invariant=True,
        note="Triton: [entries x slots x channels] tiles, one-shot softmax along the slots; one entry tile for every number of entries",
    ),
]
