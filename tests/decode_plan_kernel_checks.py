"""Tests of a backend's decode_plan kernel (its kernel module, called directly) against the op's reference, the
torch plan DeepSeek-V4's decode step ran before the op (deepinfer/ops/decode_plan.py). Both backends' test files
import these tests and give them the fixtures `plan` (the kernel module) and `device`
(tests/cuda/test_decode_plan_kernel.py, tests/ascend/test_decode_plan_kernel.py).

Integer tables, so every output must equal the reference's exactly, dtype and shape included: on random decode
batches of every V4 test config and block size (model_v4's batches, as the engine gives them), with a device graph's
padding rows, rows with a cache slot but no state slot, block tables wider than the batch needs and the speculative
lookahead's longer rings; on DeepSeek-V4.1's call (entry tables only); on a batch of padding rows only, an empty
batch and block tables too narrow to hold one entry of a ratio.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from deepinfer.model.deepseek_v4.step import ring_sizes
from deepinfer.ops.decode_plan import OUTPUTS
from deepinfer.ops.decode_plan import decode_plan as reference
from deepinfer_conformance.golden_io import GoldenTensors, read_cases
from deepinfer_conformance.runner import measure_case

from model_v4.test_decode_plan import decode_seqs, device_inputs, edge_batch
from model_v4.test_step_plan import BLOCK_SIZES, CONFIGS, random_batch


def on(device, value):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def assert_plans_equal(plan, device, **inputs) -> None:
    want = reference(**inputs)
    got = plan.decode_plan(**{k: on(device, v) for k, v in inputs.items()})
    assert len(got) == len(OUTPUTS)
    for name, g, w in zip(OUTPUTS, got, want):
        g = g.cpu()
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), f"{name}: {g} vs {w}"


def v4_call(config, seqs, block_size: int, lookahead: int, extra_columns: int, padding: int, stateless: bool) -> dict:
    """decode_plan's arguments as DeepSeek-V4's decode step passes them (deepinfer.model.deepseek_v4.decode_plan)."""
    positions, tables, slots, states = device_inputs(seqs, block_size, extra_columns, padding)
    if stateless:  # every other row keeps its cache slot but has no state slot (a start-up probe's)
        states[::2] = -1
    rings = ring_sizes(config, lookahead)
    return dict(positions=positions, block_tables=tables, slot_mapping=slots, state_slots=states, block_size=block_size,
                window=config.sliding_window, ratios=tuple(sorted({r for r, _ in rings})),
                rings=tuple((r, o, n) for (r, o), n in sorted(rings.items())), groups=config.o_groups)  # fmt: skip


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1",
    reason="under the interpreter every golden case of both backends runs in tests/ascend/test_end_to_end.py's conformance runs",
)
def test_golden_cases_pass(plan, device):
    """Every golden case passes, as `deepinfer conformance` measures it (compiled on a GPU)."""
    golden = GoldenTensors()
    cases = [c for c in read_cases() if c.op == "decode_plan"]
    assert len(cases) >= 4
    for case in cases:
        produced = dict(zip(OUTPUTS, (t.cpu() for t in plan.decode_plan(**{k: on(device, v) for k, v in golden.inputs(case).items()}))))
        m = measure_case(case, produced, golden.outputs(case))
        assert m.ok, f"{case.id}: {m.detail}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_decode_batches_equal_the_reference(plan, device, name):
    config = CONFIGS[name]
    gen = random.Random(f"decode-plan-kernel-{name}")
    for i in range(6):
        block_size = BLOCK_SIZES[i % len(BLOCK_SIZES)]
        seqs = edge_batch(block_size, gen) if i < len(BLOCK_SIZES) else decode_seqs(random_batch(gen, block_size, decode=True))
        lookahead, extra, padding, stateless = gen.choice([0, 3]), gen.choice([0, 3]), gen.choice([0, 1, 5]), gen.random() < 0.5
        try:
            assert_plans_equal(plan, device, **v4_call(config, seqs, block_size, lookahead, extra, padding, stateless))
        except AssertionError as failure:
            raise AssertionError(f"batch {i} (block size {block_size}, lookahead {lookahead}, extra {extra}, padding {padding}, "
                                 f"stateless {stateless}): {seqs}") from failure  # fmt: skip


def test_v41_entry_tables_equal_the_reference(plan, device):
    """DeepSeek-V4.1's call (deepinfer.model.deepseek_v41.decode_plan): no window, no kinds, its ratios' entry tables."""
    gen = random.Random("decode-plan-kernel-v41")
    for block_size, ratios in ((16, (1, 2, 4)), (64, (2, 16)), (128, (4,))):
        seqs = decode_seqs(random_batch(gen, block_size, decode=True))
        positions, tables, slots, states = device_inputs(seqs, block_size, 2, 3)
        assert_plans_equal(plan, device, positions=positions, block_tables=tables, slot_mapping=slots, state_slots=states, block_size=block_size,
                           window=0, ratios=ratios, rings=(), groups=0)  # fmt: skip


def test_padding_only_empty_and_narrow_batches(plan, device):
    """Every row padding; no row at all (group_rows of 0s); block tables narrower than one entry of ratio 128 over pages
    of 16 (E_max 0), a window longer than one program's chunk."""
    i32, i64 = torch.int32, torch.int64
    common = dict(block_size=16, ratios=(4, 128), rings=((4, True, 8), (128, False, 128)), groups=3)
    padding = dict(positions=torch.full((3,), 7777), block_tables=torch.zeros(3, 5, dtype=i32), slot_mapping=torch.full((3,), -1),
                   state_slots=torch.full((3,), -1, dtype=i32))  # fmt: skip
    assert_plans_equal(plan, device, **padding, window=8, **common)
    empty = dict(positions=torch.zeros(0, dtype=i64), block_tables=torch.zeros(0, 5, dtype=i32), slot_mapping=torch.zeros(0, dtype=i64),
                 state_slots=torch.zeros(0, dtype=i32))  # fmt: skip
    assert_plans_equal(plan, device, **empty, window=8, **common)
    pages = torch.randperm(40, generator=torch.Generator().manual_seed(0))[:14].view(2, 7).to(i32)
    positions = torch.tensor([100, 47])
    slots = pages.long().gather(1, (positions // 16)[:, None])[:, 0] * 16 + positions % 16
    narrow = dict(positions=positions, block_tables=pages, slot_mapping=slots, state_slots=torch.tensor([1, 0], dtype=i32))
    assert_plans_equal(plan, device, **narrow, window=2000, **common)


def test_a_ring_that_splits_windows_is_a_one_line_error(plan, device):
    i32 = torch.int32
    inputs = dict(positions=torch.zeros(1, dtype=torch.int64), block_tables=torch.zeros(1, 2, dtype=i32), slot_mapping=torch.zeros(1, dtype=torch.int64),
                  state_slots=torch.zeros(1, dtype=i32))  # fmt: skip
    with pytest.raises(ValueError, match="a ring of 10 rows splits windows of 4 tokens"):
        plan.decode_plan(**{k: on(device, v) for k, v in inputs.items()}, block_size=16, window=4, ratios=(4,), rings=((4, True, 10),), groups=1)
    with pytest.raises(ValueError, match="decode_plan wants positions and slot_mapping int64"):
        plan.decode_plan(**{k: on(device, v.int()) for k, v in inputs.items()}, block_size=16, window=4, ratios=(4,), rings=(), groups=1)
