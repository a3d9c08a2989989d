"""Ascend Triton kernels: `apply_penalties` and `apply_token_bias`, what runs on the logits before `sample`.

apply_penalties
    Grid: `vector_grid(n_tiles)` programs over (row, block of BLOCK logits) tiles, in place. A tile
    whose row has no history slot is skipped; the others read their logits, the slot's counts and
    its prompt bitmask words once and apply the op's float32 steps (deepinfer.triton_logits.penalize,
    the same arithmetic as the cuda kernel). Vector offsets stay in int32; a row's offset is one
    int64 scalar.

apply_token_bias
    Grid: `vector_grid(n_tiles)` programs over tiles of BLOCK entries, launched twice: the finite
    biases (load, add, store: at most one applies per row and token, the op's promise), then the bans
    (a store of -inf): two launches, so that a bias's load-add-store never races a ban's store on the
    same logit, and the ban wins, as the op says. Each entry compares its prefix with its row's
    recent tokens on chip.

Buffer budget: apply_penalties keeps about 6 live 4-byte values per logit (logits, counts, words,
the seen mask and the two where results), so BLOCK is the largest power of two within half the
unified buffer at 24 bytes per element (4096 on A2/A3 and 950), at most 2048; apply_token_bias
holds [BLOCK, P] prefixes and recent tokens, tiny.

Both are batch-invariant as they are: every logit's result depends on its own row's inputs only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.penalties import penalty_kernel_args
from deepinfer.ops.token_bias import token_bias_kernel_args
from deepinfer.triton_common import cdiv, next_power_of_2
from deepinfer.triton_logits import bias_entries, penalize, store_bias
from deepinfer_ascend.kernels.common import Registration, launch_options, tile_elems, vector_grid

_PENALTY_BYTES_PER_ELEM = 24
_MAX_BLOCK = 2048
_ENTRIES = 64  # bias entries per tile


@triton.jit
def _penalties_kernel(
    logits_ptr, stride_l, slots_ptr, counts_ptr, stride_c, mask_ptr, stride_m,
    presence_ptr, frequency_ptr, repetition_ptr, B, V,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    per_row = tl.cdiv(V, BLOCK)
    ar = tl.arange(0, BLOCK)
    for tile in range(pid, B * per_row, nprog):
        row = tile // per_row
        slot = tl.load(slots_ptr + row)
        if slot >= 0:
            offs = (tile % per_row) * BLOCK + ar
            ok = offs < V
            lp = logits_ptr + row.to(tl.int64) * stride_l
            x = tl.load(lp + offs, mask=ok, other=0.0)
            counts = tl.load(counts_ptr + slot * stride_c + offs, mask=ok, other=0)
            words = tl.load(mask_ptr + slot * stride_m + offs // 32, mask=ok, other=0)
            p = tl.load(presence_ptr + row)
            f = tl.load(frequency_ptr + row)
            r = tl.load(repetition_ptr + row)
            tl.store(lp + offs, penalize(x, counts, words, offs, p, f, r), mask=ok)


def apply_penalties(
    logits: torch.Tensor,
    slots: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    repetition_penalty: torch.Tensor,
) -> torch.Tensor:
    args = penalty_kernel_args(logits, slots, output_counts, prompt_mask, presence_penalty, frequency_penalty, repetition_penalty)
    if args is None:
        return logits
    rows, vocab = logits.shape
    slots, counts, mask, *params = args
    block = max(32, min(_MAX_BLOCK, tile_elems(_PENALTY_BYTES_PER_ELEM), next_power_of_2(vocab)))
    n_tiles = rows * cdiv(vocab, block)
    _penalties_kernel[(vector_grid(n_tiles),)](
        logits, logits.stride(0), slots, counts, counts.stride(0), mask, mask.stride(0), *params, rows, vocab,
        BLOCK=block, **launch_options(),
    )
    return logits


@triton.jit
def _token_bias_kernel(
    logits_ptr, stride_l, rows_ptr, tokens_ptr, values_ptr, prefixes_ptr, recent_ptr, N, P,
    BANS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ar = tl.arange(0, BLOCK)
    for tile in range(pid, tl.cdiv(N, BLOCK), nprog):
        entries = tile * BLOCK + ar
        rows, tokens, values, applies = bias_entries(rows_ptr, tokens_ptr, values_ptr, prefixes_ptr, recent_ptr, entries, N, P, BLOCK_P)
        store_bias(logits_ptr, stride_l, rows, tokens, values, applies, BANS, BLOCK)


def apply_token_bias(
    logits: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    values: torch.Tensor,
    prefixes: torch.Tensor,
    recent_tokens: torch.Tensor,
) -> torch.Tensor:
    args = token_bias_kernel_args(logits, rows, tokens, values, prefixes, recent_tokens)
    if args is None:
        return logits
    n, width = rows.shape[0], recent_tokens.shape[1]
    grid = (vector_grid(cdiv(n, _ENTRIES)),)
    for bans in (False, True):
        _token_bias_kernel[grid](
            logits, logits.stride(0), *args, n, width, BANS=bans, BLOCK=_ENTRIES, BLOCK_P=next_power_of_2(max(width, 1)), **launch_options(),
        )
    return logits


REGISTRATIONS = [
    Registration(op="apply_penalties", fn=apply_penalties, batch_invariant=True, note="Triton (ascend): in place, persistent grid over (row, block) tiles"),
    Registration(op="apply_token_bias", fn=apply_token_bias, batch_invariant=True,
                 note="Triton (ascend): in place, biases then bans over entry tiles, prefixes matched on chip"),
]  # fmt: skip
