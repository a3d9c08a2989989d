"""Triton helpers that both backends' logits-processing kernels share: a tile of `apply_penalties`,
the entry test of `apply_token_bias`, and the row passes of `gather_logprobs`.

The backends differ in how they cut the work into programs (cuda: one program per row or tile;
ascend: one persistent program per vector core looping over tiles), not in what a tile computes,
so the arithmetic lives here once. Backend-neutral like `deepinfer.triton_common`: only the Triton
language both community Triton and triton-ascend compile. The core never imports this module.
"""

from __future__ import annotations

import triton
import triton.language as tl

_NO_ID = tl.constexpr(2**31 - 1)


@triton.jit
def penalize(x, counts, prompt_words, offs, presence, frequency, repetition):
    """apply_penalties on a tile of one row: x float32 logits, counts their int32 generation counts,
    prompt_words the prompt bitmask's words holding them (word offs // 32), in the op's order:
    repetition on seen tokens (IEEE division, as torch's), x - frequency * count, x - presence."""
    generated = counts > 0
    seen = generated | (((prompt_words >> (offs % 32)) & 1) != 0)  # arithmetic shift: bit 31 reads right
    x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x)
    x = x - frequency * counts.to(tl.float32)
    return tl.where(generated, x - presence, x)


@triton.jit
def bias_entries(rows_ptr, tokens_ptr, values_ptr, prefixes_ptr, recent_ptr, entries, n, P, BLOCK_P: tl.constexpr):
    """The entries `entries` ([BLOCK_N] indices, those >= n masked off) of apply_token_bias: their
    rows, tokens and values, and whether each applies (its prefix matches its row's recent tokens)."""
    ok = entries < n
    rows = tl.load(rows_ptr + entries, mask=ok, other=0)
    tokens = tl.load(tokens_ptr + entries, mask=ok, other=0)
    values = tl.load(values_ptr + entries, mask=ok, other=0.0)
    j = tl.arange(0, BLOCK_P)
    cell = ok[:, None] & (j < P)[None, :]
    prefix = tl.load(prefixes_ptr + entries[:, None] * P + j[None, :], mask=cell, other=-1)
    recent = tl.load(recent_ptr + rows[:, None] * P + j[None, :], mask=cell, other=-1)
    matched = tl.min(((prefix < 0) | (prefix == recent)).to(tl.int32), axis=1)
    return rows, tokens, values, ok & (matched == 1)


@triton.jit
def store_bias(logits_ptr, stride_l, rows, tokens, values, applies, BANS: tl.constexpr, BLOCK: tl.constexpr):
    """One pass of apply_token_bias over a tile of entries: the applying bans' -inf (BANS), else the
    applying finite values added (bans go last, so a ban wins over any bias)."""
    ban = values == float("-inf")
    where = logits_ptr + rows * stride_l + tokens
    if BANS:
        tl.store(where, tl.full([BLOCK], float("-inf"), tl.float32), mask=applies & ban)
    else:
        add = applies & (ban == 0)
        tl.store(where, tl.load(where, mask=add, other=0.0) + values, mask=add)


@triton.jit
def row_logsumexp_and_rank(row_ptr, V, chosen, BLOCK: tl.constexpr):
    """(log-sum-exp of the row's V logits, how many of them are >= `chosen`): one pass, a running
    maximum and rescaled sum per lane (float32), the lanes merged at the end. -inf logits add 0."""
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < V
        x = tl.load(row_ptr + offs, mask=ok, other=float("-inf"))
        new_m = tl.maximum(m, x)
        finite = new_m > float("-inf")
        shift = tl.where(finite, new_m, 0.0)  # lanes still all -inf subtract 0, never -inf - -inf
        s = tl.where(finite, s * tl.exp(m - shift) + tl.exp(x - shift), s)
        m = new_m
        count += (ok & (x >= chosen)).to(tl.int32)
    top = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - top), axis=0)
    return top + tl.log(total), tl.sum(count, axis=0)


@triton.jit
def row_next_top(row_ptr, V, prev_x, prev_id, BLOCK: tl.constexpr):
    """The row's next logit after (prev_x, prev_id) in the order of gather_logprobs' top ids
    (descending logit, ascending id among equals): the largest x with x < prev_x, or x == prev_x and
    a larger id; the lowest id among equals. Returns (its logit, its id); start from (+inf, -1)."""
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.full([BLOCK], _NO_ID, tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
        after = (offs < V) & ((x < prev_x) | ((x == prev_x) & (offs > prev_id)))
        # Each lane sees ascending ids: a strictly larger value, or the first of an equal one, wins.
        take = after & ((x > best) | ((x == best) & (best_id == _NO_ID)))
        best = tl.where(take, x, best)
        best_id = tl.where(take, offs, best_id)
    value = tl.max(best, axis=0)
    return value, tl.min(tl.where((best == value) & (best_id != _NO_ID), best_id, _NO_ID), axis=0)
