"""DeepSeek-V4's KV compressor: one compressed entry per window of `ratio` tokens, a gated pooling.

Each token contributes a projected value and a gate logit per channel (the projections are plain
`linear` calls); window w's entry pools its tokens' values with a per-channel softmax over the
gate logits plus a learned per-slot bias. CSA layers (ratio 4) use overlapping windows: the
projections are twice as wide, and entry w pools the first half of window w-1's tokens with the
second half of window w's (2 * ratio slots). HCA layers (ratio 128) pool one window. The entry is
then RMS-normed, its last rope channels rotated at position w * ratio, and written to its pool row,
in one op (`norm_rope_kv_write`).
"""

from __future__ import annotations

import torch

from deepinfer.ops import kv_cache_format
from deepinfer.ops.attention import dequantized_cache, kv_cache_write
from deepinfer.ops.norm import rms_norm
from deepinfer.ops.rope import rope
from deepinfer.ops.sparse_attention import V4, V4_AND_V41
from deepinfer.registry import ALLCLOSE, op


def check_compress_kv_args(kv, gate, position_bias, window_starts, prev_starts, ratio, overlap) -> None:
    """`compress_kv`'s shapes (no host synchronisation): every backend's check."""
    if kv.dim() != 2 or kv.shape != gate.shape:
        raise ValueError(f"kv and gate must both be [N, W], got {tuple(kv.shape)} and {tuple(gate.shape)}")
    if position_bias.shape != (ratio, kv.shape[1]):
        raise ValueError(f"position_bias must be [ratio={ratio}, {kv.shape[1]}], got {tuple(position_bias.shape)}")
    if overlap and kv.shape[1] % 2:
        raise ValueError(f"overlapping windows need an even projection width (two series), got {kv.shape[1]}")
    if window_starts.dim() != 1 or prev_starts.shape != window_starts.shape:
        raise ValueError(f"window_starts and prev_starts must both be [E], got {tuple(window_starts.shape)} and {tuple(prev_starts.shape)}")


@op(family="attention", outputs=("out",), compare=ALLCLOSE, reduction_length=lambda kw: 2 * kw["ratio"], model_types=V4_AND_V41)
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
    """Compressed entries of E windows whose tokens are rows of kv / gate.

    kv, gate: [N, W] per-token projections (W = 2D with overlap, else D); position_bias: [ratio, W]
    float32; window_starts: [E] int64, the row of each window's first token (its ratio tokens are the
    rows that follow), or -1: no window (entry e is skipped: its output row is zeros whatever kv and
    gate hold, and kernels read nothing for it; a decode step passes one entry per sequence, -1 where
    no window closes, so that its shapes and launches do not depend on the data); prev_starts: [E] int64, with overlap the row of the previous
    window's first token, -1 for a sequence's first window (those slots then weigh nothing); ignored
    without overlap and for skipped entries.
    Without overlap, entry e, channel c: softmax over slots j < ratio of gate[s+j, c] + bias[j, c],
    weighing kv[s+j, c]. With overlap (D = W/2): slots j < ratio take kv[p+j, c] and
    gate[p+j, c] + bias[j, c] (p = prev_starts[e], first half), slots ratio + j take kv[s+j, D+c] and
    gate[s+j, D+c] + bias[j, D+c] (second half); one softmax over the 2 * ratio slots.
    Returns [E, D] in kv's dtype; computed in float32 (float64 for float64 kv).
    """
    check_compress_kv_args(kv, gate, position_bias, window_starts, prev_starts, ratio, overlap)
    dim = kv.shape[1] // 2 if overlap else kv.shape[1]
    if kv.shape[0] == 0:  # no rows: every entry is skipped (its contract), nothing to read
        return torch.zeros(window_starts.shape[0], dim, dtype=kv.dtype, device=kv.device)
    acc = torch.float64 if kv.dtype == torch.float64 else torch.float32
    taken = window_starts >= 0
    last = kv.shape[0] - 1  # a skipped entry reads row 0.. (clamped), then its result is dropped: no data-dependent shapes
    slots = torch.arange(ratio, device=kv.device)
    rows = (torch.where(taken, window_starts, 0).long()[:, None] + slots).clamp(max=last)  # [E, ratio]
    values, logits = kv.to(acc)[rows], gate.to(acc)[rows] + position_bias.to(acc)  # [E, ratio, W]
    if overlap:
        half = kv.shape[1] // 2
        has_prev = (prev_starts >= 0) & taken
        prev_rows = (torch.where(has_prev, prev_starts, 0).long()[:, None] + slots).clamp(max=last)
        prev_values = kv.to(acc)[prev_rows][..., :half]
        prev_logits = (gate.to(acc)[prev_rows] + position_bias.to(acc))[..., :half]
        prev_logits = prev_logits.masked_fill(~has_prev[:, None, None], float("-inf"))
        values = torch.cat((prev_values, values[..., half:]), dim=1)  # [E, 2 * ratio, D]
        logits = torch.cat((prev_logits, logits[..., half:]), dim=1)
    weights = torch.softmax(logits, dim=1)
    pooled = (weights * values).sum(dim=1)
    return torch.where(taken[:, None], pooled, 0).to(kv.dtype)


def check_norm_rope_kv_write_args(x, weight, positions, cos_sin_cache, kv_cache, slot_mapping) -> None:
    """`norm_rope_kv_write`'s shapes (no host synchronisation): every backend's check."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [T, D] and weight [D], got {tuple(x.shape)} and {tuple(weight.shape)}")
    rope_dim = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rope_dim % 2 or rope_dim > x.shape[1]:
        raise ValueError(f"cos_sin_cache must be [max_positions, R], R even and at most D={x.shape[1]}, got {tuple(cos_sin_cache.shape)}")
    if kv_cache.dim() != 3 or kv_cache_format.value_width(kv_cache) != x.shape[1]:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, {x.shape[1]}] (+16 for FP8), got {tuple(kv_cache.shape)} {kv_cache.dtype}")
    if positions.shape != (x.shape[0],) or slot_mapping.shape != (x.shape[0],):
        raise ValueError(f"positions and slot_mapping must both be [T={x.shape[0]}], got {tuple(positions.shape)} and {tuple(slot_mapping.shape)}")


# The output is normalised (magnitude ~ weight) and its rope channels sum two products: rope's length.
@op(
    family="attention",
    outputs=("kv_cache",),
    compare=ALLCLOSE,
    reduction_length=lambda kw: 2,
    in_place="kv_cache",
    canonicalize=dequantized_cache,
    model_types=V4,
)
def norm_rope_kv_write(
    x: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    eps: float,
) -> torch.Tensor:
    """RMS-norm each row of x, rotate its last R channels at its position, write it to its cache slot.

    x: [T, D] rows in any float dtype (the compressor passes compress_kv's float32 entries as they
    are); weight: [D] float32; positions: [T] int64; cos_sin_cache: [max_positions, R] float32 (rope's
    table, R even, R <= D); kv_cache: [num_blocks, block_size, D] (D + 16 for FP8), written in place
    and returned; slot_mapping: [T] int64, a negative slot skips the row (its position is not read).
    Row t: n = x[t] / sqrt(mean(x[t]^2) + eps) * weight (`rms_norm`); n's last R channels rotated in
    DeepSeek's interleaved pairs at positions[t] (`rope`, interleaved=True); the row stored at slot
    slot_mapping[t] as `kv_cache_write` stores it (cast to the cache dtype, or quantised with the row's
    own scale in an FP8 cache). Computed in float32 (float64 for float64 x) and rounded once, at the
    store: no intermediate value is rounded to x's or the cache's dtype.

    Why one op, and not folded into compress_kv: this is a decode step's compressor emission (three
    ops and two copies before), whose launches, not its bytes, cost. The norm needs a whole row, which
    compress_kv's kernels split across programs by channel blocks (an HCA window is 128 rows of values
    and 128 of gate logits, 512 channels each: one program per entry would serialise the step's largest
    read); a separate row-wise op reads the E x D float32 entries back (kilobytes) for one launch, and
    keeps compress_kv a pooling.
    """
    check_norm_rope_kv_write_args(x, weight, positions, cos_sin_cache, kv_cache, slot_mapping)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    normed, _ = rms_norm(x.to(acc), weight, eps=eps)
    nope = x.shape[1] - cos_sin_cache.shape[-1]
    rotated = rope(normed[:, None, nope:], torch.where(slot_mapping >= 0, positions, 0), cos_sin_cache, interleaved=True)[:, 0]
    return kv_cache_write(normed[:, :nope], rotated, kv_cache, slot_mapping)
