"""Tests of a backend's apply_penalties, apply_token_bias and gather_logprobs kernels (its kernel
modules, called directly) against the references and the golden set. Both backends' test files
import these tests and give them the fixtures `processing` and `logprobs` (the kernel modules) and
`device` (tests/cuda/test_logits_processing_kernels.py, tests/ascend/test_logits_processing_kernels.py).

Random inputs beyond the golden cases: vocabularies not a multiple of any block (and below 32),
rows without a history slot, slots shared by rows, entries with and without prefixes, no entries
at all, -inf logits, exact ties, no top tokens asked for. The processing ops are float32 steps the
kernels repeat exactly, so they must equal the reference bit for bit; gather_logprobs' ids and
ranks must be equal, its log-probabilities within 2e-6 (a float32 log-sum-exp in another order).
"""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer.ops import logprobs as logprobs_ref
from deepinfer.ops import penalties as penalties_ref
from deepinfer.ops import token_bias as token_bias_ref
from deepinfer_conformance.golden_io import GoldenTensors, read_cases
from deepinfer_conformance.runner import measure_case

OPS = ("apply_penalties", "apply_token_bias", "gather_logprobs")


def on(device, value):
    return value.to(device) if isinstance(value, torch.Tensor) else value


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="under the interpreter every golden case of both backends runs in tests/ascend/test_end_to_end.py's conformance runs")
def test_golden_cases_pass(processing, logprobs, device):
    """Every golden case of the three ops passes, as `deepinfer conformance` measures it (compiled on a GPU)."""
    golden = GoldenTensors()
    cases = [c for c in read_cases() if c.op in OPS]
    assert len(cases) >= 12
    for case in cases:
        kernel = getattr(logprobs if case.op == "gather_logprobs" else processing, case.op)
        inputs = golden.inputs(case)
        result = kernel(**{k: on(device, v) for k, v in inputs.items()})
        names = ("logits",) if case.op != "gather_logprobs" else ("token_logprobs", "token_ranks", "top_ids", "top_logprobs")
        produced = dict(zip(names, (t.cpu() for t in (result if isinstance(result, tuple) else (result,)))))
        m = measure_case(case, produced, golden.outputs(case))
        assert m.ok, f"{case.id}: {m.detail}"


def penalty_inputs(gen, rows: int, vocab: int, slots: int):
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[torch.rand(rows, vocab, generator=gen) < 0.1] = float("-inf")
    counts = torch.randint(0, 4, (slots, vocab), generator=gen, dtype=torch.int32) * (torch.rand(slots, vocab, generator=gen) < 0.3)
    words = torch.randint(-(2**31), 2**31, (slots, (vocab + 31) // 32), generator=gen, dtype=torch.int64).to(torch.int32)
    return dict(
        logits=logits,
        slots=torch.randint(-1, slots, (rows,), generator=gen),
        output_counts=counts,
        prompt_mask=words,
        presence_penalty=torch.rand(rows, generator=gen) * 4 - 2,
        frequency_penalty=torch.rand(rows, generator=gen) * 4 - 2,
        repetition_penalty=torch.rand(rows, generator=gen) * 1.8 + 0.2,
    )


@pytest.mark.parametrize("rows, vocab, slots", [(1, 7, 1), (5, 300, 3), (3, 4099, 4)])
def test_penalties_equal_the_reference(processing, device, rows, vocab, slots):
    gen = torch.Generator().manual_seed(rows * vocab)
    inputs = penalty_inputs(gen, rows, vocab, slots)
    want = penalties_ref.apply_penalties(**{k: v.clone() for k, v in inputs.items()})
    on_device = {k: on(device, v) for k, v in inputs.items()}
    got = processing.apply_penalties(**on_device)
    assert got.data_ptr() == on_device["logits"].data_ptr(), "in place"
    assert torch.equal(got.cpu(), want)
    unchanged = (inputs["slots"] < 0).nonzero().flatten()
    assert torch.equal(got.cpu()[unchanged], inputs["logits"][unchanged])


def bias_inputs(gen, rows: int, vocab: int, width: int, entries: int):
    recent = torch.randint(-1, vocab, (rows, width), generator=gen)
    entry_rows = torch.randint(0, rows, (entries,), generator=gen)
    prefixes = torch.where(torch.rand(entries, width, generator=gen) < 0.5, recent[entry_rows], torch.randint(-1, vocab, (entries, width), generator=gen))
    values = torch.where(torch.rand(entries, generator=gen) < 0.4, float("-inf"), torch.rand(entries, generator=gen) * 200 - 100)
    # Unique (row, token) pairs for the finite values: tokens drawn without replacement per row.
    tokens = torch.empty(entries, dtype=torch.int64)
    for r in range(rows):
        mine = (entry_rows == r).nonzero().flatten()
        assert mine.numel() <= vocab, "more entries in a row than tokens"
        tokens[mine] = torch.randperm(vocab, generator=gen)[: mine.numel()]
    return dict(logits=torch.randn(rows, vocab, generator=gen), rows=entry_rows, tokens=tokens, values=values.float(), prefixes=prefixes,
                recent_tokens=recent)  # fmt: skip


@pytest.mark.parametrize("rows, vocab, width, entries", [(2, 9, 0, 5), (4, 257, 3, 300), (3, 1000, 1, 0)])
def test_token_bias_equals_the_reference(processing, device, rows, vocab, width, entries):
    gen = torch.Generator().manual_seed(rows + vocab + width + entries)
    inputs = bias_inputs(gen, rows, vocab, width, entries)
    want = token_bias_ref.apply_token_bias(**{k: v.clone() for k, v in inputs.items()})
    got = processing.apply_token_bias(**{k: on(device, v) for k, v in inputs.items()})
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("rows, vocab, num_top", [(1, 5, 5), (6, 700, 7), (3, 3000, 0), (0, 50, 3)])
def test_logprobs_equal_the_reference(logprobs, device, rows, vocab, num_top):
    gen = torch.Generator().manual_seed(rows * 31 + vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 4 * 2).round() / 2  # exact ties everywhere
    if rows > 1:
        logits[1, torch.rand(vocab, generator=gen) < 0.5] = float("-inf")
        logits[1, 0] = 1.0
    token_ids = torch.randint(0, vocab, (rows,), generator=gen)
    want = logprobs_ref.gather_logprobs(logits, token_ids, num_top)
    got = [t.cpu() for t in logprobs.gather_logprobs(on(device, logits), on(device, token_ids), num_top)]
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), "ranks and top ids are exact"
    for g, w in ((got[0], want[0]), (got[3], want[3])):
        assert torch.equal(torch.isfinite(g), torch.isfinite(w)) and torch.allclose(g, w, rtol=2e-6, atol=2e-6)


def test_shapes_are_one_line_errors(processing, logprobs, device):
    logits = torch.zeros(2, 40, device=device)
    with pytest.raises(ValueError, match="prompt_mask has shape"):
        processing.apply_penalties(logits, *(on(device, t) for t in (torch.zeros(2, dtype=torch.int64), torch.zeros(3, 40, dtype=torch.int32),
                                             torch.zeros(3, 1, dtype=torch.int32), torch.zeros(2), torch.zeros(2), torch.ones(2))))  # fmt: skip
    with pytest.raises(ValueError, match="prefixes has shape"):
        processing.apply_token_bias(logits, *(on(device, t) for t in (torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                                              torch.zeros(1), torch.zeros(1, 3, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64))))  # fmt: skip
    with pytest.raises(ValueError, match="num_top must be an integer"):
        logprobs.gather_logprobs(logits, on(device, torch.zeros(2, dtype=torch.int64)), 41)
