"""The references of apply_penalties, apply_token_bias and gather_logprobs against independent
computations: plain Python loops over every element, in float64 (vLLM's and OpenAI's definitions
written out), and the shapes they refuse."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.ops.logprobs import gather_logprobs
from deepinfer.ops.penalties import apply_penalties
from deepinfer.ops.token_bias import apply_token_bias


def pack(bits: list[list[bool]]) -> torch.Tensor:
    """Rows of bools as [R, ceil(V/32)] int32 words, bit v % 32 of word v // 32 (two's complement)."""
    out = []
    for row in bits:
        words = [sum(1 << i for i in range(32) if w * 32 + i < len(row) and row[w * 32 + i]) for w in range(-(-len(row) // 32))]
        out.append([w - 2**32 if w >= 2**31 else w for w in words])
    return torch.tensor(out, dtype=torch.int32)


def test_penalties_follow_the_definitions_in_float64():
    gen = torch.Generator().manual_seed(0)
    rows, vocab, slots = 5, 70, 3
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[0, 3] = float("-inf")
    counts = torch.randint(0, 3, (slots, vocab), generator=gen, dtype=torch.int32) * (torch.rand(slots, vocab, generator=gen) < 0.4)
    in_prompt = (torch.rand(slots, vocab, generator=gen) < 0.2).tolist()
    in_prompt[1][31] = in_prompt[1][63] = True  # the sign bit of words 0 and 1
    slot_of = [0, 1, -1, 2, 1]
    presence, frequency, repetition = [0.5, -1.0, 2.0, 0.0, 0.3], [0.25, 0.0, 1.0, -0.5, 0.7], [1.5, 0.6, 1.2, 1.0, 2.0]
    got = apply_penalties(logits.clone(), torch.tensor(slot_of), counts, pack(in_prompt), torch.tensor(presence), torch.tensor(frequency),
                          torch.tensor(repetition))  # fmt: skip
    for b in range(rows):
        for v in range(vocab):
            x = float(logits[b, v])
            s = slot_of[b]
            if s >= 0:
                c = int(counts[s, v])
                if c or in_prompt[s][v]:
                    x = x / repetition[b] if x > 0 else x * repetition[b]
                x -= frequency[b] * c
                x -= presence[b] * (c > 0)
            want, have = x, float(got[b, v])
            assert (want == have) if math.isinf(want) else abs(want - have) <= 1e-5 * max(1.0, abs(want)), (b, v, want, have)
    assert torch.equal(got[2], logits[2]), "a row without a slot is untouched"


def test_neutral_penalties_leave_logits_bit_for_bit():
    logits = torch.randn(3, 40)
    counts = torch.randint(0, 5, (2, 40), dtype=torch.int32)
    got = apply_penalties(logits.clone(), torch.tensor([0, 1, 0]), counts, torch.full((2, 2), -1, dtype=torch.int32), torch.zeros(3), torch.zeros(3),
                          torch.ones(3))  # fmt: skip
    assert torch.equal(got, logits)


def test_token_bias_follows_the_definition():
    logits = torch.randn(3, 20)
    recent = torch.tensor([[4, 5], [-1, 7], [-1, -1]])
    entries = [  # (row, token, value, prefix)
        (0, 2, 1.5, [-1, -1]),  # plain bias
        (0, 3, float("-inf"), [4, 5]),  # ban after "4 5": applies
        (0, 6, float("-inf"), [5, 5]),  # does not
        (0, 3, 2.0, [-1, -1]),  # bias on a banned token: banned wins
        (1, 9, float("-inf"), [-1, 7]),  # one-token prefix: applies
        (1, 10, float("-inf"), [6, 7]),  # needs two generated tokens, the row has one
        (2, 11, -3.25, [-1, -1]),
        (2, 12, float("-inf"), [-1, 0]),  # nothing generated: a prefix never matches
        (2, 13, float("-inf"), [-1, -1]),
        (2, 13, float("-inf"), [-1, -1]),  # listed twice
    ]
    rows, tokens, values, prefixes = (list(col) for col in zip(*entries))
    got = apply_token_bias(logits.clone(), torch.tensor(rows), torch.tensor(tokens), torch.tensor(values), torch.tensor(prefixes), recent)
    want = logits.clone().double()
    for r, t, v, p in entries:
        if all(q < 0 or q == int(recent[r, j]) for j, q in enumerate(p)) and not math.isinf(v):
            want[r, t] += v
    for r, t, v, p in entries:
        if all(q < 0 or q == int(recent[r, j]) for j, q in enumerate(p)) and math.isinf(v):
            want[r, t] = float("-inf")
    assert torch.equal(got, want.float())
    assert got[0, 3] == float("-inf") and got[0, 6] == logits[0, 6] and got[1, 10] == logits[1, 10] and got[2, 12] == logits[2, 12]


def test_logprobs_follow_the_definitions_in_float64():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 50, generator=gen) * 6).round() / 3  # ties
    logits[2, :10] = float("-inf")
    ids = torch.tensor([0, 7, 3, 49])
    token_lp, ranks, top_ids, top_lp = gather_logprobs(logits, ids, 6)
    for r in range(4):
        row = [float(x) for x in logits[r]]
        finite = [x for x in row if not math.isinf(x)]
        top = max(finite)
        lse = top + math.log(sum(math.exp(x - top) for x in finite))
        lp = [x - lse for x in row]
        t = int(ids[r])
        assert (token_lp[r] == lp[t]) if math.isinf(lp[t]) else abs(float(token_lp[r]) - lp[t]) < 1e-5
        assert int(ranks[r]) == sum(x >= row[t] for x in row)
        order = sorted(range(50), key=lambda v: (-row[v], v))[:6]
        assert top_ids[r].tolist() == order
        assert all(abs(float(top_lp[r, i]) - lp[v]) < 1e-5 for i, v in enumerate(order))
    assert gather_logprobs(logits, ids, 0)[2].shape == (4, 0)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: apply_penalties(torch.zeros(2, 40), torch.zeros(2, dtype=torch.int64), torch.zeros(1, 41, dtype=torch.int32),
                                 torch.zeros(1, 2, dtype=torch.int32), torch.zeros(2), torch.zeros(2), torch.ones(2)), "output_counts has shape"),
        (lambda: apply_penalties(torch.zeros(2, 40), torch.zeros(3, dtype=torch.int64), torch.zeros(1, 40, dtype=torch.int32),
                                 torch.zeros(1, 2, dtype=torch.int32), torch.zeros(2), torch.zeros(2), torch.ones(2)), "slots has shape"),
        (lambda: apply_token_bias(torch.zeros(2, 40), torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.zeros(2),
                                  torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, 0, dtype=torch.int64)), "must be \\[N\\] alike"),
        (lambda: apply_token_bias(torch.zeros(2, 40), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.zeros(1),
                                  torch.zeros(1, 0, dtype=torch.int64), torch.zeros(3, 0, dtype=torch.int64)), "recent_tokens has shape"),
        (lambda: gather_logprobs(torch.zeros(2, 40), torch.zeros(3, dtype=torch.int64), 1), "token_ids"),
        (lambda: gather_logprobs(torch.zeros(2, 40), torch.zeros(2, dtype=torch.int64), 65), "num_top must be an integer in \\[0, 40\\]"),
    ],
)  # fmt: skip
def test_bad_shapes_are_one_line_errors(call, message):
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert "\n" not in str(info.value)
