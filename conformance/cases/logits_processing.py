"""Cases for what runs on the logits before `sample` and beside it: apply_penalties, apply_token_bias
and gather_logprobs."""

from __future__ import annotations

from functools import partial

import torch

from deepinfer_conformance.cases import Case, randint, randn

NEG_INF = float("-inf")

# One row's penalties: (slot, presence, frequency, repetition); slot -1: no history, left unchanged.
PENALTY_ROWS = [
    (0, 0.0, 0.0, 1.0),  # neutral: bit for bit unchanged
    (1, 0.0, 0.0, 1.3),  # repetition > 1: seen positive logits shrink, negative ones grow
    (2, 0.0, 0.0, 0.7),  # repetition < 1
    (3, 0.0, 0.5, 1.0),  # frequency: times the count
    (4, -1.5, 0.0, 1.0),  # negative presence: seen tokens favoured
    (5, 2.0, -2.0, 1.8),  # all three at their bounds
    (-1, 1.0, 1.0, 2.0),  # no slot: untouched whatever the parameters
    (1, 0.4, 0.3, 1.2),  # a slot shared with another row
]


def penalty_inputs(gen, dtype, *, vocab: int, rows: list[tuple[int, float, float, float]], num_slots: int, masked: bool = False):
    """Logits randn * 3; per slot, counts mostly zero with some small and a few large (up to 300),
    the prompt's bits set for about a tenth of the vocabulary (bit 31 included). masked: a quarter
    of each row's logits -inf."""
    batch = len(rows)
    logits = randn(gen, batch, vocab, dtype=dtype, scale=3.0)
    if masked:
        logits[torch.rand(batch, vocab, generator=gen) < 0.25] = NEG_INF
    counts = randint(gen, 1, 6, num_slots, vocab, dtype=torch.int32)
    counts[torch.rand(num_slots, vocab, generator=gen) < 0.85] = 0
    counts[torch.rand(num_slots, vocab, generator=gen) < 0.01] = 300
    in_prompt = torch.rand(num_slots, vocab, generator=gen) < 0.1
    in_prompt[:, 31 if vocab > 31 else 0] = True
    words = (vocab + 31) // 32
    bits = torch.zeros(num_slots, words * 32, dtype=torch.int64)
    bits[:, :vocab] = in_prompt.long()
    packed = (bits.view(num_slots, words, 32) << torch.arange(32)).sum(-1)
    prompt_mask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    slots, presence, frequency, repetition = zip(*rows)
    return {
        "logits": logits,
        "slots": torch.tensor(slots, dtype=torch.int64),
        "output_counts": counts,
        "prompt_mask": prompt_mask,
        "presence_penalty": torch.tensor(presence, dtype=torch.float32),
        "frequency_penalty": torch.tensor(frequency, dtype=torch.float32),
        "repetition_penalty": torch.tensor(repetition, dtype=torch.float32),
    }


def bias_inputs(gen, dtype, *, batch: int, vocab: int, width: int, num_bias: int, num_bans: int):
    """Entries of every kind: finite biases (unique per row and token, values in [-100, 100]),
    unconditional bans, bans with a prefix that matches the row's recent tokens and one that does
    not, a ban on a token that also has a bias (banned wins), a ban listed twice. Recent tokens: -1
    where a row generated fewer than `width` (row 0 generated none)."""
    logits = randn(gen, batch, vocab, dtype=dtype, scale=3.0)
    recent = randint(gen, 0, vocab, batch, width)
    if width:
        recent[0] = -1
        recent[1, 0] = -1
    rows, tokens, values, prefixes = [], [], [], []
    for r in range(batch):
        picked = torch.randperm(vocab, generator=gen)[:num_bias].tolist()
        for t in picked:
            rows.append(r), tokens.append(t), values.append(float(torch.empty(1).uniform_(-100, 100, generator=gen)))
            prefixes.append([-1] * width)
        rows.append(r), tokens.append(picked[0]), values.append(NEG_INF), prefixes.append([-1] * width)  # banned beside its bias
    for _ in range(num_bans):
        r = int(randint(gen, 0, batch, 1))
        prefix = [-1] * width
        if width:
            n = int(randint(gen, 1, width + 1, 1))
            matches = bool(randint(gen, 0, 2, 1))
            prefix[width - n :] = recent[r, width - n :].tolist()
            if not matches:
                prefix[-1] = (prefix[-1] + 1) % vocab
        rows.append(r), tokens.append(int(randint(gen, 0, vocab, 1))), values.append(NEG_INF), prefixes.append(prefix)
    rows.append(rows[-1]), tokens.append(tokens[-1]), values.append(NEG_INF), prefixes.append(prefixes[-1])  # listed twice
    return {
        "logits": logits,
        "rows": torch.tensor(rows, dtype=torch.int64),
        "tokens": torch.tensor(tokens, dtype=torch.int64),
        "values": torch.tensor(values, dtype=torch.float32),
        "prefixes": torch.tensor(prefixes, dtype=torch.int64).reshape(len(rows), width),
        "recent_tokens": recent,
    }


def logprob_inputs(gen, dtype, *, rows: int, vocab: int, num_top: int, special: bool = True):
    """Logits randn * 4; with `special`, row 1 has exact ties (values rounded to halves), row 2 a
    quarter of its logits -inf and one of them chosen, row 0's chosen token is its argmax."""
    logits = randn(gen, rows, vocab, dtype=dtype, scale=4.0)
    token_ids = randint(gen, 0, vocab, rows)
    if special:
        logits[1] = (logits[1] * 2).round() / 2
        masked = torch.rand(vocab, generator=gen) < 0.25
        masked[0] = False
        logits[2, masked] = NEG_INF
        token_ids[2] = int(masked.nonzero()[0])
        token_ids[0] = int(logits[0].argmax())
    return {"logits": logits, "token_ids": token_ids, "num_top": num_top}


PENALTY_RECIPES = [
    ("b8_v1003", partial(penalty_inputs, vocab=1003, rows=PENALTY_ROWS, num_slots=6)),
    ("b8_v1003_masked", partial(penalty_inputs, vocab=1003, rows=PENALTY_ROWS, num_slots=6, masked=True)),
    ("b3_v33", partial(penalty_inputs, vocab=33, rows=[(2, 0.5, 0.5, 1.5), (0, -0.5, 1.0, 0.9), (-1, 0.0, 0.0, 1.0)], num_slots=3)),
    # Rows of two full blocks (both backends' 2048 logits) and a partial third of 907, ending in a partial prompt-mask
    # word (DeepSeek-V3's 129280-token rows are `deepinfer bench ops`' size, not an edge).
    ("b2_v5003", partial(penalty_inputs, vocab=5003, rows=[(1, 0.3, 0.2, 1.1), (0, 0.0, 0.0, 1.0)], num_slots=2)),
]

BIAS_RECIPES = [
    ("b5_v1003_p3", partial(bias_inputs, batch=5, vocab=1003, width=3, num_bias=6, num_bans=24)),
    ("b4_v1000_p0", partial(bias_inputs, batch=4, vocab=1000, width=0, num_bias=9, num_bans=7)),
    ("b3_v33_p1", partial(bias_inputs, batch=3, vocab=33, width=1, num_bias=4, num_bans=10)),
    # 151 entries: several programs' tiles of entries on both backends (128 cuda, 64 ascend).
    ("b2_v5003_p2", partial(bias_inputs, batch=2, vocab=5003, width=2, num_bias=70, num_bans=8)),
]

LOGPROB_RECIPES = [
    ("r7_v1003_top5", partial(logprob_inputs, rows=7, vocab=1003, num_top=5)),
    ("r4_v1000_top0", partial(logprob_inputs, rows=4, vocab=1000, num_top=0)),
    ("r3_v64_top64", partial(logprob_inputs, rows=3, vocab=64, num_top=64)),  # every token, in order
    ("r2_v5003_top20", partial(logprob_inputs, rows=2, vocab=5003, num_top=20, special=False)),  # rows of several 2048-logit blocks
]

CASES = (
    [Case("apply_penalties", name, torch.float32, make) for name, make in PENALTY_RECIPES]
    + [Case("apply_token_bias", name, torch.float32, make) for name, make in BIAS_RECIPES]
    + [Case("gather_logprobs", name, torch.float32, make) for name, make in LOGPROB_RECIPES]
)
