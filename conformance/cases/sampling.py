"""Cases for the sampling ops: sample, apply_token_bitmask and rejection_sample."""

from __future__ import annotations

from functools import partial

import torch

from deepinfer.ops.sampling import sample
from deepinfer_conformance.cases import Case, randint, randn

# One row's sampling parameters: (temperature, top_k, top_p, min_p). top_k 0, top_p 1.0, min_p 0.0: off.
GREEDY = (0.0, 0, 1.0, 0.0)
MIXED_ROWS = [
    GREEDY,
    (1.0, 0, 1.0, 0.0),  # temperature only
    (0.7, 0, 1.0, 0.0),
    (1.0, 1, 1.0, 0.0),  # top_k = 1: argmax whatever the noise
    (1.0, 20, 1.0, 0.0),
    (1.3, 0, 1.0, 0.0),  # top_p = 1.0 stated explicitly: no filter
    (1.0, 0, 0.9, 0.0),
    (0.6, 0, 0.5, 0.0),
    (1.0, 0, 1.0, 0.1),  # min_p
    (0.8, 50, 0.9, 0.05),  # every filter at once
    (0.0, 5, 0.5, 0.2),  # greedy: the filters do not apply
    (1.5, 1000, 1.0, 0.0),  # top_k >= V: off
    (1.0, -1, 1.0, 0.0),  # top_k < 0: off
    (2.0, 0, 0.95, 0.0),
    (1.0, 0, 1.0, 0.5),
    (1.0, 5, 0.3, 0.0),
    (0.05, 0, 1.0, 0.0),  # near-greedy temperature: z spans hundreds
]


def sample_inputs(gen, dtype, *, vocab: int, rows: list[tuple[float, int, float, float]], masked_rows: int = 0, top_at_end: int = 0):
    """Logits with a realistic spread (randn * 3) and one request per row. The first
    `masked_rows` rows carry structured-output -inf logits: row 0 keeps a single token, the
    others about half the vocabulary. top_at_end: each row's that many largest logits moved to its
    end (the same values, the largest in the row's last chunk)."""
    batch = len(rows)
    logits = randn(gen, batch, vocab, dtype=dtype, scale=3.0)
    for r in range(batch if top_at_end else 0):
        rest = torch.ones(vocab, dtype=torch.bool)
        top = logits[r].topk(top_at_end).indices
        rest[top] = False
        logits[r] = torch.cat((logits[r, rest], logits[r, top]))
    for r in range(masked_rows):
        forbidden = torch.rand(vocab, generator=gen) < 0.5 if r else torch.arange(vocab) != vocab // 3
        logits[r, forbidden] = float("-inf")
    temperature, top_k, top_p, min_p = zip(*rows)
    return {
        "logits": logits,
        "temperature": torch.tensor(temperature, dtype=torch.float32),
        "top_k": torch.tensor(top_k, dtype=torch.int32),
        "top_p": torch.tensor(top_p, dtype=torch.float32),
        "min_p": torch.tensor(min_p, dtype=torch.float32),
        # Any int64 seed, negatives included (their high 32 bits are all ones).
        "seeds": randint(gen, -(2**62), 2**62, batch),
        "positions": randint(gen, 0, 200_000, batch),
    }


def bitmask_inputs(gen, dtype, *, rows: int, vocab: int):
    """Row 0 allows everything, row 1 one token (v = 31: the int32 sign bit), row 2 only the bit-31
    tokens (31, 63, ...), the rest random words (about half of them negative)."""
    words = (vocab + 31) // 32
    bitmask = randint(gen, -(2**31), 2**31, rows, words, dtype=torch.int32)
    bitmask[0] = -1
    bitmask[1] = 0
    bitmask[1, 0] = -(2**31)
    bitmask[2] = -(2**31)
    return {"logits": randn(gen, rows, vocab, dtype=dtype, scale=3.0), "bitmask": bitmask}


SAMPLE_RECIPES = [
    ("b17_v1000_mixed", partial(sample_inputs, vocab=1000, rows=MIXED_ROWS)),
    # A vocabulary not a multiple of 32, with structured-output -inf logits in rows 0 to 3.
    ("b12_v1003_mixed_masked",
     partial(sample_inputs, vocab=1003, rows=[(1.0, 0, 1.0, 0.0), (0.7, 20, 0.9, 0.0), GREEDY, (1.0, 0, 0.9, 0.1)] + MIXED_ROWS[1:9], masked_rows=4)),
    # Rows of many chunks (every other case is one chunk): a nucleus row (the cuda kernel's second pass with either
    # table), one plain-temperature row, each row's 8 largest logits at its end, so that the token comes from the
    # chunks the finish compacts last. 32771 logits: cuda's 9 chunks (interpreter's table) or 17 (SM90's), more than
    # its finish compacts at once (8 / 16 chunks' segments), the last chunk shorter; not a multiple of 32. DeepSeek-V3's
    # 129280-token rows are `deepinfer bench ops`' size.
    ("b2_v32771", partial(sample_inputs, vocab=32771, rows=[(0.7, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.0)], top_at_end=8)),
    ("b1_v1003_greedy", partial(sample_inputs, vocab=1003, rows=[GREEDY])),
]

BITMASK_RECIPES = [
    ("b6_v1003", partial(bitmask_inputs, rows=6, vocab=1003)),
    ("b5_v4099", partial(bitmask_inputs, rows=5, vocab=4099)),  # one token in the last, partial word
    ("b3_v33", partial(bitmask_inputs, rows=3, vocab=33)),
]


def rejection_inputs(gen, dtype, *, vocab: int, requests: list[tuple[tuple[float, int, float, float], int, int]], masked: tuple[int, ...] = ()):
    """Speculative verification. requests: (sampling parameters, drafts k, accepted a), a <= k; the
    request owns k draft rows then its bonus row. Drafts are built from the reference's own tokens:
    the first a drafts are what `sample` draws at their rows (accepted), the next one (if a < k) a
    token it does not draw there (rejected: the correction is that row's token), later drafts random
    (never reached); a = k: every draft accepted, the bonus row sampled. The bonus row's draft is -1.
    Requests listed in `masked` carry structured-output -inf logits on about half the vocabulary."""
    counts = [k + 1 for _, k, _ in requests]
    rows = sum(counts)
    logits = randn(gen, rows, vocab, dtype=dtype, scale=3.0)
    cu_rows = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    for b in masked:
        forbidden = torch.rand(counts[b], vocab, generator=gen) < 0.5
        forbidden[:, 0] = False  # one token at least stays allowed
        logits[cu_rows[b] : cu_rows[b + 1]][forbidden] = float("-inf")
    temperature, top_k, top_p, min_p = zip(*(params for params, _, _ in requests))
    inputs = {
        "logits": logits,
        "draft_tokens": randint(gen, 0, vocab, rows),
        "cu_rows": cu_rows,
        "temperature": torch.tensor(temperature, dtype=torch.float32),
        "top_k": torch.tensor(top_k, dtype=torch.int32),
        "top_p": torch.tensor(top_p, dtype=torch.float32),
        "min_p": torch.tensor(min_p, dtype=torch.float32),
        "seeds": randint(gen, -(2**62), 2**62, len(requests)),
        "positions": randint(gen, 0, 200_000, len(requests)),
    }
    # The token `sample` draws at every row (the op's rule: the request's parameters and seed, its
    # position plus the row's index within the request).
    owner = torch.repeat_interleave(torch.arange(len(requests)), torch.tensor(counts))
    index = torch.arange(rows) - cu_rows[:-1].long()[owner]
    per_row = [inputs[n][owner] for n in ("temperature", "top_k", "top_p", "min_p", "seeds")]
    drawn = sample(logits.float(), *per_row, inputs["positions"][owner] + index)
    draft = inputs["draft_tokens"]
    for b, (_, k, accepted) in enumerate(requests):
        start = int(cu_rows[b])
        draft[start : start + accepted] = drawn[start : start + accepted]
        if accepted < k:
            draft[start + accepted] = (drawn[start + accepted] + 1 + randint(gen, 0, vocab - 1, 1)) % vocab
        draft[start + k] = -1
    return inputs


TEMPERATURE_ONLY = (1.0, 0, 1.0, 0.0)
REJECTION_RECIPES = [
    # Greedy requests (drafts = the argmax): 4 of 4 accepted (bonus row), no drafts, 2 of 5, the first rejected, 1 of 1.
    ("b5_v1003_greedy", partial(rejection_inputs, vocab=1003, requests=[(GREEDY, 4, 4), (GREEDY, 0, 0), (GREEDY, 5, 2), (GREEDY, 3, 0), (GREEDY, 1, 1)])),
    # Sampled requests with every filter, structured-output -inf logits in requests 0 and 4.
    ("b7_v1003_sampled",
     partial(rejection_inputs, vocab=1003, masked=(0, 4), requests=[
         (TEMPERATURE_ONLY, 3, 3), ((0.7, 20, 0.9, 0.0), 3, 1), ((1.0, 0, 0.9, 0.1), 2, 0), ((0.8, 50, 0.9, 0.05), 0, 0),
         ((1.0, 5, 0.3, 0.0), 4, 2), ((1.0, 0, 1.0, 0.5), 2, 2), ((0.6, 0, 0.5, 0.0), 2, 1)])),
    # Every draft accepted: each request's bonus row is sampled.
    ("b4_v1000_all_accepted",
     partial(rejection_inputs, vocab=1000, requests=[(TEMPERATURE_ONLY, 2, 2), ((1.0, 20, 1.0, 0.0), 3, 3), (GREEDY, 2, 2), ((2.0, 0, 0.95, 0.0), 1, 1)])),
    # The first draft rejected in every request: the correction at row 0, -1 after it.
    ("b4_v1000_first_rejected",
     partial(rejection_inputs, vocab=1000, requests=[((0.7, 0, 1.0, 0.0), 2, 0), ((1.0, 1, 1.0, 0.0), 3, 0), ((1.0, 0, 1.0, 0.1), 1, 0), (GREEDY, 2, 0)])),
    # (rows of many chunks are `sample`'s b2_v32771 case: the rows are sampled by that kernel, and the accept scan
    # reads only tokens; at that size each row costs seconds in the interpreter, in every conformance pass of CI)
    # One request, no drafts: one row, the bonus token.
    ("b1_v1003_no_drafts", partial(rejection_inputs, vocab=1003, requests=[((0.8, 50, 0.9, 0.05), 0, 0)])),
]

CASES = [Case("sample", name, torch.float32, make) for name, make in SAMPLE_RECIPES] + [
    Case("apply_token_bitmask", name, dtype, make) for name, make in BITMASK_RECIPES for dtype in (torch.float32, torch.bfloat16)
] + [Case("rejection_sample", name, torch.float32, make) for name, make in REJECTION_RECIPES]
