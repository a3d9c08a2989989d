"""Host lists to device tensors through one packed copy (engine/host_staging.py)."""

import random

import pytest
import torch

from deepinfer.engine.host_staging import ALIGN, padded_rows, to_device


def test_every_field_comes_back_with_its_values_dtype_and_shape():
    fields = [([1, 2, 3], torch.int64), ([[1, 2], [3, 4], [5, 6]], torch.int32), ([], torch.int64), ([0.5, -1.5], torch.float32), ([7], torch.int32)]
    out = to_device(fields, torch.device("cpu"), pinned=False)
    for (values, dtype), t in zip(fields, out):
        assert t.dtype == dtype and torch.equal(t, torch.tensor(values, dtype=dtype))


def test_the_fields_share_one_buffer_each_on_an_aligned_offset():
    out = to_device([([1], torch.int32), ([2, 3, 4], torch.int64), ([1.0], torch.float32)], torch.device("cpu"), pinned=False)
    base = out[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in out), "one buffer, so one host-to-device copy"
    assert all(t.data_ptr() % ALIGN == 0 for t in out)
    out[1].add_(1)  # a field is its own slice: writing it leaves the others alone
    assert out[0].tolist() == [1] and out[1].tolist() == [3, 4, 5] and out[2].tolist() == [1.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_pinned_copy_reaches_the_device():
    out = to_device([([1, 2], torch.int64), ([[3]], torch.int32)], torch.device("cuda"), pinned=True)
    assert [t.device.type for t in out] == ["cuda", "cuda"] and out[0].tolist() == [1, 2] and out[1].tolist() == [[3]]


def test_padded_rows_are_the_rows_padded_with_zeros():
    rows = [[5, 1, 9], [], [2**31 - 1], [3, 3, 3, 3]]
    want = torch.tensor([[5, 1, 9, 0], [0, 0, 0, 0], [2**31 - 1, 0, 0, 0], [3, 3, 3, 3]], dtype=torch.int32)
    got = padded_rows(rows)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert padded_rows([[], []]).shape == (2, 0) and padded_rows([]).shape == (0, 0)
    (sent,) = to_device([(got, torch.int32)], torch.device("cpu"), pinned=False)  # a built tensor travels like a list
    assert torch.equal(sent, want)


def test_token_slots_match_the_per_token_loop():
    """token_slots (positions and paged cache slots of every token: tensor operations for a prefill chunk, a loop for a
    decode step's few rows) equals the per-token loop, on random batches: empty and long segments, shuffled pages, tables
    of different lengths."""
    from deepinfer.engine.host_staging import LOOP_TOKENS, flat_ints, token_slots

    gen = random.Random("slots")
    for case in range(40):
        block_size = gen.choice([1, 4, 16, 64])
        starts, lengths, tables = [], [], []
        for _ in range(gen.randint(1, 6)):
            start, n = gen.randint(0, 300), gen.choice([0, 1, 1, 7, gen.randint(1, 400)])
            pages = gen.sample(range(5000), -(-(start + n) // block_size) + gen.randint(0, 3))
            starts.append(start), lengths.append(n), tables.append(pages)
        positions, slots = token_slots(starts, lengths, tables, padded_rows(tables), block_size)
        want_positions = [p for start, n in zip(starts, lengths) for p in range(start, start + n)]
        want_slots = [pages[p // block_size] * block_size + p % block_size for start, n, pages in zip(starts, lengths, tables)
                      for p in range(start, start + n)]  # fmt: skip
        assert torch.as_tensor(positions).tolist() == want_positions and torch.as_tensor(slots).tolist() == want_slots, f"case {case}"
        assert isinstance(positions, list) == (sum(lengths) <= LOOP_TOKENS)  # a decode step's few rows: the loop
        if not isinstance(positions, list):
            assert positions.dtype == slots.dtype == torch.int64
    ids = [[3, 1], [], [7]]
    assert flat_ints(ids).tolist() == [3, 1, 7] and flat_ints([[]]).dtype == torch.int64
