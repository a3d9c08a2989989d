"""The DeepSeek-V4 step plan (deepinfer/model/deepseek_v4/step.py): the vectorised plan_step equals, field by
field (values, dtypes, shapes), the former per-token loops kept below as the oracle, on random batches of decode
steps and prefill chunks (prefix hits, replay, shuffled pages) over every layer kind and several block sizes."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch

from deepinfer.bench.e2e_v4 import flash_config
from deepinfer.model.deepseek_v4.config import CSA, HCA, V4Config
from deepinfer.model.deepseek_v4.step import CompressorPlan, RatioPlan, SeqStep, V4Step, plan_step
from deepinfer.model.embedded import V4_CONFIG

CPU = torch.device("cpu")

# ---- the oracle: the former implementation of plan_step (Python loops per token and per entry), kept verbatim ----


def _ring_size(ratio: int, overlap: bool) -> int:
    return 2 * ratio if overlap else ratio


def _entry_row(pages: list[int], entry: int, ratio: int, block_size: int, rows: int) -> int:
    last = (entry + 1) * ratio - 1  # the entry lives in the block of its window's last token
    return pages[last // block_size] * rows + (last % block_size) // ratio


def plan_step_loops(config: V4Config, seqs: list[SeqStep], block_size: int, device: torch.device) -> V4Step:
    window = config.sliding_window
    positions, token_seq, window_rows, write_slots = [], [], [], []
    for b, s in enumerate(seqs):
        for p in range(s.start, s.start + s.length):
            positions.append(p)
            token_seq.append(b)
            window_rows.append([s.pages[q // block_size] * block_size + q % block_size if q >= 0 else -1
                                for q in range(p - window + 1, p + 1)])  # fmt: skip
            write_slots.append(s.pages[p // block_size] * block_size + p % block_size if p >= s.cached else -1)

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    step = V4Step(
        tensor(positions, torch.int64), tensor(token_seq, torch.int32), tensor(window_rows, torch.int32).view(-1, window), tensor(write_slots, torch.int64)
    )
    kinds = {(config.compress_ratio(i), config.layer_types[i] == CSA) for i in range(config.num_hidden_layers) if config.compress_ratio(i)}
    for ratio in sorted({r for r, _ in kinds}):
        rows = max(1, block_size // ratio)
        ends = [(s.start + s.length) // ratio for s in seqs]
        width = max(ends, default=0)
        table = [[_entry_row(s.pages, e, ratio, block_size, rows) for e in range(n)] + [-1] * (width - n) for s, n in zip(seqs, ends)]
        visible = [(p + 1) // ratio for p in positions]
        plan = RatioPlan(tensor(table, torch.int32).view(len(seqs), width), tensor(visible, torch.int32))
        if any(not overlap for r, overlap in kinds if r == ratio):
            all_rows = [[table[b][e] if e < n else -1 for e in range(width)] for b, n in zip(token_seq, visible)]
            plan.visible_rows = tensor(all_rows, torch.int32).view(len(positions), width)
        step.ratios[ratio] = plan
    indexer_kinds = {(r, True) for r, overlap in kinds if overlap}  # the CSA indexer's own compressor
    for ratio, overlap in sorted(kinds | indexer_kinds):
        step.compressors[(ratio, overlap)] = _plan_compressor_loops(seqs, ratio, overlap, block_size, tensor)
    return step


def _plan_compressor_loops(seqs: list[SeqStep], ratio: int, overlap: bool, block_size: int, tensor) -> CompressorPlan:
    ring = _ring_size(ratio, overlap)
    rows = max(1, block_size // ratio)
    history, order, window_starts, prev_starts, entry_positions, pool_rows, ring_rows, ring_tokens = ([] for _ in range(8))
    spans = [_history_span(s, ratio, overlap) for s in seqs]
    num_history = sum(stop - first for first, stop in spans)
    token_base, history_base = 0, 0
    for s, (first_pos, stop) in zip(seqs, spans):
        source_start = len(order)  # where this sequence's sources begin in the ordered buffer
        for p in range(first_pos, stop):
            history.append(s.slot * ring + p % ring)
            order.append(history_base + p - first_pos)
        history_base += stop - first_pos
        order.extend(num_history + token_base + i for i in range(s.length))

        def source_row(p: int) -> int:
            return source_start + p - first_pos

        end = s.start + s.length
        for w in range(max(s.start, s.cached) // ratio, end // ratio):
            window_starts.append(source_row(w * ratio))
            prev_starts.append(source_row((w - 1) * ratio) if overlap and w > 0 else -1)
            entry_positions.append(w * ratio)
            pool_rows.append(_entry_row(s.pages, w, ratio, block_size, rows))
        for p in range(max(s.start, end - ring), end):
            ring_rows.append(s.slot * ring + p % ring)
            ring_tokens.append(token_base + p - s.start)
        token_base += s.length
    i64 = torch.int64
    return CompressorPlan(
        tensor(history, i64), tensor(order, i64), tensor(window_starts, i64), tensor(prev_starts, i64),
        tensor(entry_positions, i64), tensor(pool_rows, i64), tensor(ring_rows, i64), tensor(ring_tokens, i64),
    )  # fmt: skip


def _history_span(s: SeqStep, ratio: int, overlap: bool) -> tuple[int, int]:
    """Positions before this step that the entries emitted this step pool: [first, s.start), read from the ring."""
    first_window = max(s.start, s.cached) // ratio
    first = first_window * ratio - (ratio if overlap and first_window > 0 else 0)
    return min(first, s.start), s.start


# ---- the cases -----------------------------------------------------------------------------------

CONFIGS = {
    "tiny-v4": V4Config.from_dict(V4_CONFIG),  # sliding, CSA 4, HCA 128, CSA; window 128
    "v4-flash": flash_config(),  # 43 layers: 2 sliding, then CSA 4 / HCA 128
    "small": V4Config.from_dict({**V4_CONFIG, "sliding_window": 16, "compress_rates": {CSA: 4, HCA: 16}}),  # many windows per sequence
    "shared-ratio": V4Config.from_dict({**V4_CONFIG, "sliding_window": 8, "compress_rates": {CSA: 8, HCA: 8}}),  # CSA and HCA at one ratio
}
BLOCK_SIZES = (16, 64, 128)


def random_seq(gen: random.Random, slot: int, block_size: int, decode: bool) -> tuple[int, int, int, int, int]:
    """(start, length, cached, slot, pages needed) of one sequence."""
    start = gen.choice([0, gen.randint(0, 40), gen.randint(0, 1500), gen.randint(1, 12) * 128 + gen.randint(-5, 5)])
    start = max(start, 0)
    length = 1 if decode else gen.choice([1, gen.randint(1, 40), gen.randint(1, 300)])
    cached = gen.choice([
        0,
        start,  # decode: everything before the step is paged
        gen.randint(0, start),  # a prefix below the start
        start // block_size * block_size,  # a prefix hit in whole blocks
        start + gen.randint(1, 200),  # replay: positions up to `cached` are paged and recomputed, maybe past this chunk
    ])  # fmt: skip
    end = start + length
    return start, length, cached, slot, -(-max(end, cached) // block_size) + gen.randint(0, 2)


def random_batch(gen: random.Random, block_size: int, decode: bool) -> list[SeqStep]:
    facts = [random_seq(gen, slot, block_size, decode) for slot in gen.sample(range(32), gen.randint(1, 6))]
    pages = list(range(sum(f[-1] for f in facts) * 2))
    gen.shuffle(pages)  # block tables in no order, not contiguous
    seqs = []
    for start, length, cached, slot, num_pages in facts:
        seqs.append(SeqStep(start, length, cached, slot, pages[:num_pages]))
        pages = pages[num_pages:]
    return seqs


def decode_batch(contexts: list[int], block_size: int, seed: int = 0) -> list[SeqStep]:
    """Sequences decoding their token at position `contexts[i]`, all before it paged, pages shuffled."""
    gen = random.Random(seed)
    pages = list(range(sum(c // block_size + 1 for c in contexts)))
    gen.shuffle(pages)
    seqs = []
    for slot, context in enumerate(contexts):
        num_pages = context // block_size + 1
        seqs.append(SeqStep(context, 1, context, slot, pages[:num_pages]))
        pages = pages[num_pages:]
    return seqs


def assert_same(new, old, where: str = "step") -> None:
    """Every field of two plans equal: tensors in value, dtype, shape (and contiguous), dicts key by key."""
    if isinstance(old, torch.Tensor):
        assert isinstance(new, torch.Tensor), where
        assert (new.dtype, new.shape) == (old.dtype, old.shape), f"{where}: {new.dtype} {tuple(new.shape)} vs {old.dtype} {tuple(old.shape)}"
        assert new.is_contiguous() and torch.equal(new, old), where
    elif isinstance(old, dict):
        assert list(new) == list(old), f"{where}: keys {list(new)} vs {list(old)}"
        for key in old:
            assert_same(new[key], old[key], f"{where}[{key}]")
    elif dataclasses.is_dataclass(old):
        assert type(new) is type(old), where
        for f in dataclasses.fields(old):
            assert_same(getattr(new, f.name), getattr(old, f.name), f"{where}.{f.name}")
    else:
        assert new == old, f"{where}: {new!r} vs {old!r}"


# ---- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_plan_equals_the_loops_on_random_batches(name, block_size):
    config = CONFIGS[name]
    gen = random.Random(f"{name}-{block_size}")
    for case in range(40):
        seqs = random_batch(gen, block_size, decode=case % 3 == 0)
        assert_same(plan_step(config, seqs, block_size, CPU), plan_step_loops(config, seqs, block_size, CPU), f"case {case}: {seqs}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_plan_equals_the_loops_at_the_edges(name):
    """An empty batch, the first token, a chunk that ends before the paged prefix it replays, a sequence without
    tokens, windows and entries closing exactly at block boundaries; and a block size of 24, which the caches refuse
    for ratios that do not divide it (plan_step still plans it as the loops did)."""
    config = CONFIGS[name]
    cases = [
        [],
        [(0, 1, 0, 0)],
        [(0, 64, 0, 3)],
        [(100, 37, 256, 1), (5, 1, 5, 0)],
        [(40, 0, 40, 2), (127, 2, 127, 1)],
        [(255, 1, 255, 0), (256, 128, 128, 5), (1023, 1, 1024, 4)],
    ]
    gen = random.Random(name)
    for block_size in (*BLOCK_SIZES, 24):
        for facts in cases:
            pages = list(range(500))
            gen.shuffle(pages)
            seqs = [SeqStep(*f, pages[70 * i : 70 * i + 70]) for i, f in enumerate(facts)]  # 70 pages: 1,120 positions at 16 a block
            assert_same(plan_step(config, seqs, block_size, CPU), plan_step_loops(config, seqs, block_size, CPU), f"{block_size}: {seqs}")


MIXED_CONTEXTS = random.Random(0).sample(range(100, 20000), 12)  # padding past the shortest sequence's entries


@pytest.mark.parametrize("contexts", [[32768] * 4, [4096] * 64, [4099] * 3, MIXED_CONTEXTS], ids=["4x32k", "64x4k", "3x4099", "12-mixed"])
def test_plan_equals_the_loops_at_v4_flash_decode(contexts):
    config = CONFIGS["v4-flash"]
    seqs = decode_batch(contexts, 64)
    assert_same(plan_step(config, seqs, 64, CPU), plan_step_loops(config, seqs, 64, CPU))


def test_plan_time_at_v4_flash_decode_sizes():
    """Prints how long a decode step's plan takes (no assertion: tests check behaviour, not speed)."""
    config = CONFIGS["v4-flash"]
    for batch, context in ((1, 4096), (64, 32768), (256, 4096), (256, 32768)):
        seqs = decode_batch([context] * batch, 64)
        times = []
        for _ in range(5):
            begin = time.perf_counter()
            plan_step(config, seqs, 64, CPU)
            times.append(time.perf_counter() - begin)
        print(f"plan_step, V4-Flash decode, batch {batch} x context {context}: {min(times) * 1e3:.2f} ms (best of 5, {torch.get_num_threads()} threads)")


def test_an_upload_moves_the_whole_plan_in_one_call():
    """With the engine's staging (HostBatch.upload), a prefill chunk's plan reaches the device through ONE transfer
    of every table (one pageable copy per table made the host wait for the device's previous step each time):
    the same plan, field by field, as views of one packed buffer; the per-token tables (the window rows, the HCA layers'
    visible rows), the largest, are computed on the device from the uploaded block and entry tables instead of being
    uploaded."""
    from deepinfer.engine.host_staging import to_device

    config = CONFIGS["v4-flash"]
    gen = random.Random("upload")
    calls = []

    def upload(fields):
        calls.append(len(fields))
        return to_device(fields, CPU, pinned=False)

    for case in range(6):
        seqs = random_batch(gen, 64, decode=case % 3 == 0)
        calls.clear()
        staged = plan_step(config, seqs, 64, CPU, upload=upload)
        assert len(calls) == 1 and calls[0] >= 4, calls
        assert_same(staged, plan_step(config, seqs, 64, CPU), f"case {case}: {seqs}")
        computed = [staged.window_rows, *(plan.visible_rows for plan in staged.ratios.values())]
        tables = [t for plan in (staged, *staged.ratios.values(), *staged.compressors.values()) for t in vars(plan).values()
                  if isinstance(t, torch.Tensor) and t.numel() and not any(t is c for c in computed)]  # fmt: skip
        assert len({t.untyped_storage().data_ptr() for t in tables}) == 1  # one buffer: one copy
