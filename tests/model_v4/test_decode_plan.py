"""A DeepSeek-V4 decode step's device plan (deepinfer/model/deepseek_v4/decode_plan.py) against the host plan (step.py):
table by table on the same decode batches, equal but for the documented padding (wider entry tables, one compressor
entry per sequence, padding rows that read and write nothing); the compressors pool the same tokens' ring rows; and
the plan is built without reading a device value on the host (FakeTensorMode on the meta device raises on any
`.item()`, `.tolist()`, `nonzero`, boolean mask, data-dependent shape or host-made tensor)."""

from __future__ import annotations

import random

import pytest
import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from deepinfer.model.deepseek_v4.decode_plan import RingPlan, plan_decode
from deepinfer.model.deepseek_v4.step import SeqStep, plan_step, ring_sizes
from deepinfer.runtime import open_runtime

from model_v4.test_step_plan import BLOCK_SIZES, CONFIGS, random_batch

CPU = torch.device("cpu")
OPS = open_runtime("reference", dtype=torch.float32).ops  # the plan's op: its reference


def device_inputs(seqs: list[SeqStep], block_size: int, extra_columns: int = 0, padding: int = 0, device=CPU):
    """The decode batch's device tensors as the engine gives them (block tables padded with page 0), plus `padding`
    rows as a device graph pads a batch (slot -1, no state slot, a stale position, a zero block table)."""
    width = max(len(s.pages) for s in seqs) + extra_columns
    tables = [s.pages + [0] * (width - len(s.pages)) for s in seqs] + [[0] * width] * padding
    positions = [s.start for s in seqs] + [7777] * padding
    slots = [s.pages[s.start // block_size] * block_size + s.start % block_size for s in seqs] + [-1] * padding
    return (torch.tensor(positions, device=device), torch.tensor(tables, dtype=torch.int32, device=device),
            torch.tensor(slots, device=device), torch.tensor([s.slot for s in seqs] + [-1] * padding, dtype=torch.int32, device=device))  # fmt: skip


def decode_seqs(seqs: list[SeqStep]) -> list[SeqStep]:
    """The batch as decode steps: one token each, nothing replayed (paged up to at most the token)."""
    return [SeqStep(s.start, 1, min(s.cached, s.start), s.slot, s.pages) for s in seqs]


def assert_device_plan_is_the_host_plan(config, seqs: list[SeqStep], block_size: int, lookahead: int, extra_columns: int, padding: int) -> None:
    rings = ring_sizes(config, lookahead)
    host = plan_step(config, seqs, block_size, CPU, rings=rings)
    dev = plan_decode(OPS, config, *device_inputs(seqs, block_size, extra_columns, padding), block_size, rings)
    n, rows = len(seqs), len(seqs) + padding

    def same(got, want, what):
        assert got.dtype == want.dtype and torch.equal(got, want), f"{what}: {got} vs {want}"

    for name in ("positions", "token_seq", "window_rows", "write_slots"):
        same(getattr(dev, name)[:n], getattr(host, name), name)
    assert (dev.window_rows[n:] == -1).all() and (dev.write_slots[n:] == -1).all() and (dev.positions[n:] == 0).all(), "padding rows"
    assert dev.token_seq.tolist() == list(range(rows))
    assert dev.group_rows.dtype == torch.int32 and dev.group_rows.tolist() == [rows] * config.o_groups, "the output projection's masked counts"

    assert list(dev.ratios) == list(host.ratios)
    width = max(len(s.pages) for s in seqs) + extra_columns
    for ratio, want in host.ratios.items():
        got = dev.ratios[ratio]
        assert got.entry_rows.shape == (rows, width * block_size // ratio), "E_max: the entries the block tables hold"
        used = want.entry_rows.shape[1]
        same(got.entry_rows[:n, :used], want.entry_rows, f"entry_rows[{ratio}]")
        assert (got.entry_rows[:n, used:] == -1).all() and (got.entry_rows[n:] == -1).all(), f"entry_rows[{ratio}] padding"
        same(got.num_visible[:n], want.num_visible, f"num_visible[{ratio}]")
        assert (got.num_visible[n:] == 0).all()
        assert (got.visible_rows is None) == (want.visible_rows is None)
        if want.visible_rows is not None:
            same(got.visible_rows[:n, :used], want.visible_rows, f"visible_rows[{ratio}]")
            assert (got.visible_rows[:n, used:] == -1).all() and (got.visible_rows[n:] == -1).all()

    assert list(dev.compressors) == list(host.compressors)
    for (ratio, overlap), want in host.compressors.items():
        got, ring = dev.compressors[(ratio, overlap)], rings[(ratio, overlap)]
        assert isinstance(got, RingPlan) and all(t.shape == (rows,) for t in vars(got).values())
        # The ring rows written: every token's (a decode token is the newest of its sequence), none for padding.
        same(got.ring_rows[:n][want.ring_tokens], want.ring_rows, f"ring_rows{(ratio, overlap)}")
        assert want.ring_tokens.tolist() == list(range(n)) and (got.ring_rows[n:] == -1).all()
        # The entries emitted: where a window closes, in token order, the host plan's; -1 (none) elsewhere.
        closing = got.window_starts >= 0
        assert not closing[n:].any() and torch.equal(closing, got.pool_rows >= 0)
        same(got.pool_rows[closing], want.pool_rows, f"pool_rows{(ratio, overlap)}")
        same(got.positions[closing], want.positions, f"positions{(ratio, overlap)}")
        assert (got.positions[~closing] == 0).all() and (got.prev_starts[~closing] == -1).all()
        # Each entry pools the same tokens: the host plan's ordered sources, as ring rows of their positions, at its
        # window (and previous window) are the ring rows the device plan names, consecutive.
        token_rows = torch.tensor([s.slot * ring + s.start % ring for s in seqs])
        source_rows = torch.cat((want.history, token_rows))[want.order]
        slots = torch.arange(ratio)
        same(got.window_starts[closing][:, None] + slots, source_rows[want.window_starts[:, None] + slots], f"windows{(ratio, overlap)}")
        has_prev = want.prev_starts >= 0
        same(got.prev_starts[closing] >= 0, has_prev, f"prev{(ratio, overlap)}")
        same(got.prev_starts[closing][has_prev][:, None] + slots, source_rows[want.prev_starts[has_prev][:, None] + slots], f"prev{(ratio, overlap)}")


def edge_batch(block_size: int, gen: random.Random) -> list[SeqStep]:
    """Decode tokens at the edges: the first position, a page's last and first rows, a CSA window closing (its
    first, with no previous window, and later ones), an HCA window (ratio 128) closing and just past one."""
    positions = [0, 2, 3, 7, block_size - 1, block_size, 2 * block_size - 1, 127, 128, 255, 383, 511, 1000, 1023]
    pages = list(range(2000))
    gen.shuffle(pages)
    seqs = []
    for slot, p in enumerate(positions):
        num_pages = p // block_size + 1 + gen.randint(0, 2)
        seqs.append(SeqStep(p, 1, gen.choice([p, p // block_size * block_size, 0]), slot, pages[:num_pages]))
        pages = pages[num_pages:]
    gen.shuffle(seqs)
    return seqs


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_device_plan_is_the_host_plan_on_decode_batches(name, block_size):
    """Random decode batches and the edge batch, rings with and without a speculative lookahead (3: rounded up to
    whole windows), block tables wider than the batch needs and a device graph's padding rows."""
    config = CONFIGS[name]
    gen = random.Random(f"decode-{name}-{block_size}")
    batches = [edge_batch(block_size, gen)] + [decode_seqs(random_batch(gen, block_size, decode=True)) for _ in range(12)]
    for i, seqs in enumerate(batches):
        lookahead, extra, padding = gen.choice([0, 3]), gen.choice([0, 3]), gen.choice([0, 1, 5])
        try:
            assert_device_plan_is_the_host_plan(config, seqs, block_size, lookahead, extra, padding)
        except AssertionError as failure:
            raise AssertionError(f"batch {i} (lookahead {lookahead}, extra columns {extra}, padding {padding}): {seqs}") from failure


def test_a_row_without_a_state_slot_keeps_no_compressor_state():
    """A row with a cache slot but no state slot (-1: a start-up probe's) writes its KV but no ring row and no entry."""
    config, block_size = CONFIGS["tiny-v4"], 16
    seqs = [SeqStep(127, 1, 127, 0, list(range(8))), SeqStep(127, 1, 127, -1, list(range(8, 16)))]
    plan = plan_decode(OPS, config, *device_inputs(seqs, block_size), block_size, ring_sizes(config))
    assert (plan.write_slots >= 0).all()
    for kind, ring in plan.compressors.items():
        assert ring.ring_rows[0] >= 0 and ring.ring_rows[1] == -1, kind
        assert ring.window_starts[0] >= 0 and ring.window_starts[1] == -1 and ring.pool_rows[1] == -1, kind  # 128 tokens: both ratios close


def test_a_ring_that_splits_windows_is_refused():
    config, block_size = CONFIGS["tiny-v4"], 16
    rings = {**ring_sizes(config), (4, True): 10}
    with pytest.raises(ValueError, match="a ring of 10 rows splits windows of 4 tokens"):
        plan_decode(OPS, config, *device_inputs([SeqStep(5, 1, 5, 0, [0])], block_size), block_size, rings)


# ---- no host reads ---------------------------------------------------------------------------------------------------


# torch 2.13 names a host read of a device fake FakeTensorDeviceMismatchError; torch 2.11 (the GPU machine) has no such class
_DEVICE_MISMATCH = getattr(fake_tensor, "FakeTensorDeviceMismatchError", None)
HOST_READS = (DataDependentOutputException, DynamicOutputShapeException) + ((_DEVICE_MISMATCH,) if _DEVICE_MISMATCH else ())


def without_host_reads(fn, *tensors: torch.Tensor):
    """fn(*tensors) with the tensors as fakes on the meta device (FakeTensorMode: shapes and dtypes, no values): reading
    a value on the host (`.item()`, `.tolist()`, `int()`, `bool()`) raises DataDependentOutputException, a shape that
    depends on values (`nonzero`, a boolean mask) DynamicOutputShapeException, and a tensor made on the host or copied
    to it FakeTensorDeviceMismatchError (HOST_READS). Returns fn's result (fakes)."""
    with FakeTensorMode():
        return fn(*(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors))


@pytest.mark.parametrize("name", ["tiny-v4", "v4-flash"])
def test_the_device_plan_reads_nothing_on_the_host(name):
    config, block_size = CONFIGS[name], 64
    seqs = edge_batch(block_size, random.Random(0))
    inputs = device_inputs(seqs, block_size, extra_columns=2, padding=3)
    plan = without_host_reads(lambda *t: plan_decode(OPS, config, *t, block_size, ring_sizes(config, 3)), *inputs)
    rows = len(seqs) + 3
    assert plan.window_rows.device.type == "meta" and plan.window_rows.shape == (rows, config.sliding_window)
    for ratio, tables in plan.ratios.items():
        assert tables.entry_rows.device.type == "meta" and tables.entry_rows.shape == (rows, inputs[1].shape[1] * block_size // ratio)
    assert all(t.device.type == "meta" and t.shape == (rows,) for ring in plan.compressors.values() for t in vars(ring).values())


@pytest.mark.parametrize("reads", [
    lambda p: p.max().item(),
    lambda p: p.tolist(),
    lambda p: torch.arange(int(p.sum())),
    lambda p: p.nonzero(),
    lambda p: p[p > 3],
    lambda p: p.cpu() + p,
    lambda p: p + torch.tensor([1, 2, 3]),
], ids=["item", "tolist", "int", "nonzero", "mask", "cpu", "host-made"])  # fmt: skip
def test_the_host_read_check_catches_each_kind_of_read(reads):
    """The check above fails when a plan reads a value on the host: each way of doing so raises under it."""
    with pytest.raises(HOST_READS):
        without_host_reads(reads, torch.tensor([1, 5, 9]))
