"""Triton kernels: `apply_penalties` and `apply_token_bias`, what runs on the logits before `sample`.

apply_penalties: grid (B, cdiv(V, BLOCK)), in place. A program whose row has no history slot
  returns at once; the others read their tile of logits, of the slot's counts and of its prompt
  bitmask once (deepinfer.triton_logits.penalize: the op's float32 steps, IEEE division). Compiled
  with enable_fp_fusion=False: x - frequency * count is the reference's rounded product, then the
  difference, never one fused multiply-add.

apply_token_bias: two launches over the entries, BLOCK of them per program: the finite biases
  (load, add, store: at most one applies per row and token, the op's promise, so no two programs
  write one logit), then the bans (a store of -inf, which any number of programs may repeat). Two
  launches, so that a bias's load-add-store never races a ban's store on the same logit: the ban
  wins either way, as the op says. Each entry compares its prefix with its row's recent tokens in
  registers.

Both are batch-invariant as they are: every logit's result depends on its own row's inputs only.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from deepinfer.ops.penalties import penalty_kernel_args
from deepinfer.ops.token_bias import token_bias_kernel_args
from deepinfer.triton_common import interpreting, next_power_of_2
from deepinfer.triton_logits import bias_entries, penalize, store_bias
from deepinfer_cuda.kernels.common import Registration, pdl_launch, pdl_prologue
from deepinfer_cuda.tuning import config


@lru_cache(maxsize=None)
def _cfg(op: str, variant: str, device: torch.device) -> dict:
    return config(op, variant, device)


def _no_fusion() -> dict:
    """Launch options that keep a * b + c two roundings on a GPU (the interpreter never fuses)."""
    return {} if interpreting() else {"enable_fp_fusion": False}


@triton.jit
def _penalties_kernel(
    logits_ptr, stride_l, slots_ptr, counts_ptr, stride_c, mask_ptr, stride_m,
    presence_ptr, frequency_ptr, repetition_ptr, V,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot >= 0:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < V
        lp = logits_ptr + row.to(tl.int64) * stride_l + offs
        x = tl.load(lp, mask=ok, other=0.0)
        counts = tl.load(counts_ptr + slot * stride_c + offs, mask=ok, other=0)
        words = tl.load(mask_ptr + slot * stride_m + offs // 32, mask=ok, other=0)
        p = tl.load(presence_ptr + row)
        f = tl.load(frequency_ptr + row)
        r = tl.load(repetition_ptr + row)
        tl.store(lp, penalize(x, counts, words, offs, p, f, r), mask=ok)


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
    cfg = _cfg("apply_penalties", "rows", logits.device)
    _penalties_kernel[(rows, triton.cdiv(vocab, cfg["BLOCK"]))](
        logits, logits.stride(0), slots, counts, counts.stride(0), mask, mask.stride(0), *params, vocab,
        BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"], **_no_fusion(), **pdl_launch(logits.device),
    )
    return logits


@triton.jit
def _token_bias_kernel(
    logits_ptr, stride_l, rows_ptr, tokens_ptr, values_ptr, prefixes_ptr, recent_ptr, N, P,
    BANS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    entries = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
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
    cfg = _cfg("apply_token_bias", "entries", logits.device)
    for bans in (False, True):
        _token_bias_kernel[(triton.cdiv(n, cfg["BLOCK"]),)](
            logits, logits.stride(0), *args, n, width,
            BANS=bans, BLOCK=cfg["BLOCK"], BLOCK_P=next_power_of_2(max(width, 1)), num_warps=cfg["num_warps"], **pdl_launch(logits.device),
        )
    return logits


REGISTRATIONS = [
    Registration(op="apply_penalties", fn=apply_penalties, note="Triton (in place, tiles of rows with a history slot)", batch_invariant=True),
    Registration(op="apply_token_bias", fn=apply_token_bias, note="Triton (in place: biases, then bans; prefixes matched in registers)",
                 batch_invariant=True),
]  # fmt: skip
