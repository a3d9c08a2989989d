"""The balanced persistent grid of the bf16 Gluon mla_decode (mla_decode_gluon_balanced.py, tuning switch "balanced";
not yet run on a GPU). On the CPU: its schedule kernel (under the interpreter) against a Python model of the cut (every
(request, key tile) in exactly one share, balance, segment indices and partial slots), a torch emulation of the
kernel's segment loop (outputs and partials) merged by its combine kernel (interpreter) against the reference op, a
model of its handshakes across segments (no deadlock, no stage refilled while read, q and the row-sum slots rewritten
only once read), and the switch reaching the launch. On an SM90 GPU (TRITON_INTERPRET=0): its output against the
default grid's."""

from __future__ import annotations

import math
import random

import pytest
import torch
from mbarrier_model import Barrier, run_interleaved

import deepinfer_cuda.kernels.mla_decode_gluon as g
import deepinfer_cuda.kernels.mla_decode_gluon_balanced as bal
import deepinfer_cuda.kernels.mla_decode_gluon_parts as parts

from triton_mode import GPU, mode

# ---------------------------------------------------------------------------------------------
# The schedule


def _model(lens: list[int], partitions: int, overhead: int):
    """The cut, unit by unit: each request's overhead units then its tiles laid end to end; share p takes units
    [p * payload, (p + 1) * payload). Returns each share's tiles [(request, tile)] and the payload."""
    units = []
    for b, n in enumerate(lens):
        tiles = math.ceil(max(n, 0) / 64)
        if tiles:
            units += [None] * overhead + [(b, t) for t in range(tiles)]
    payload = max(1, math.ceil(len(units) / partitions))
    return [[u for u in units[p * payload : (p + 1) * payload] if u is not None] for p in range(partitions)], payload


def _schedule(lens: list[int], partitions: int, overhead: int):
    meta = bal.schedule(torch.tensor(lens, dtype=torch.int32), partitions, overhead)
    sched, num_splits, slot_start = bal.unpack(meta, partitions, len(lens))
    return sched.tolist(), num_splits.tolist(), slot_start.tolist()


SCHEDULE_CASES = {
    "B128 ctx4096 equal, 66 shares": ([4096] * 128, 66),
    "B128 ctx4096 equal, 132 shares": ([4096] * 128, 132),
    "B1 ctx8192, 66 shares": ([8192], 66),
    "B1 ctx100, 66 shares (fewer tiles than shares)": ([100], 66),
    "empty and short requests": ([0, 1, 63, 64, 65, 0, 2000, 0, 129], 7),
    "all empty": ([0, 0, 0], 5),
    "one long among short": ([1] * 40 + [8192] + [3] * 40, 33),
    "B32 ctx2048 ragged": ([2048 - 37 * i for i in range(32)], 66),
    "random 200": ([random.Random(1).randint(0, 5000) for _ in range(200)], 132),
}


@pytest.mark.parametrize("overhead", [0, 1, 5])
@pytest.mark.parametrize("case", list(SCHEDULE_CASES))
def test_the_schedule_cuts_every_tile_once_and_balances(case, overhead):
    """The kernel's shares (decoded as its partitions walk them, `shares`) hold the model's tiles exactly: every
    (request, tile) once, in order, at most `payload` tiles a share (one tile over an even division plus the
    overhead's share); each request's segments numbered 0, 1, ... in order, num_splits their count (0 for an empty
    request), partial slots only for cut requests, disjoint, within max_slots."""
    lens, partitions = SCHEDULE_CASES[case]
    sched, num_splits, slot_start = _schedule(lens, partitions, overhead)
    want, payload = _model(lens, partitions, overhead)
    got = bal.shares(sched, lens, partitions)
    assert [[(b, t) for b, lo, hi, _ in segs for t in range(lo, hi)] for segs in got] == want
    tiles = [math.ceil(n / 64) for n in lens]
    assert sum(len(w) for w in want) == sum(tiles)
    nonempty = sum(1 for t in tiles if t)
    assert payload == max(1, math.ceil((sum(tiles) + overhead * nonempty) / partitions)) >= max(len(w) for w in want)
    assert payload <= max(1, sum(tiles) / partitions + 1 + overhead * nonempty / partitions)
    segments = {}
    for segs in got:
        for b, lo, hi, k in segs:
            segments.setdefault(b, []).append((lo, hi, k))
    for b, t in enumerate(tiles):
        segs = segments.get(b, [])
        assert num_splits[b] == len(segs) and [k for _, _, k in segs] == list(range(len(segs)))
        assert (segs[0][0], segs[-1][1]) == (0, t) if t else segs == []
    used = []
    for b, n in enumerate(num_splits):
        if n > 1:
            used += range(slot_start[b], slot_start[b] + n)
    assert sorted(used) == list(range(len(used))) and len(used) <= bal.max_slots(partitions)


def test_equal_contexts_at_128_heads_get_125_tiles_a_share_not_128():
    """B128 ctx4096 over 66 shares a row tile (132 SMs): payload cdiv(8192 + 128 * overhead, 66) tiles: 125 without
    overhead (125 tiles at most a share), 127 with the table's 1 (126 tiles at most), against the default grid's 128 a SM;
    the cut requests take <= 2 * 65 slots."""
    for overhead, payload, most in ((0, 125, 125), (1, 127, 126)):
        want, got_payload = _model([4096] * 128, 66, overhead)
        assert got_payload == payload and max(len(w) for w in want) == most
        _, num_splits, _ = _schedule([4096] * 128, 66, overhead)
        assert sum(n for n in num_splits if n > 1) <= bal.max_slots(66)


# ---------------------------------------------------------------------------------------------
# The segment loop, emulated in torch, merged by the combine kernel


def _emulate(q_nope, q_rope, cache, block_table, seq_lens, scale, partitions, overhead):
    """The kernel's outputs: per share and row tile, per segment, the masked softmax over its keys (log2 domain, as the
    kernel); the normalised output where the request has one segment, else a partial and its lse in the segment's slot;
    then the balanced combine kernel (the interpreter) over them."""
    batch, s_len, heads, c = q_nope.shape
    rows = s_len * heads
    lens = seq_lens.tolist()
    sched, num_splits, slot_start = _schedule(lens, partitions, overhead)
    slots = bal.max_slots(partitions)
    out = torch.full((batch, s_len, heads, c), float("nan"), dtype=torch.float32)
    part_out = torch.full((slots, rows, c), float("nan"), dtype=torch.float32)
    part_lse = torch.full((slots, rows), float("nan"), dtype=torch.float32)
    q = torch.cat([q_nope, q_rope], dim=-1).double().reshape(batch, rows, -1)
    keys = cache.double()
    m = torch.arange(rows)
    for segs in bal.shares(sched, lens, partitions):
        for rt in range(math.ceil(rows / 64)):
            r = m[rt * 64 : (rt + 1) * 64]
            for b, lo, hi, k in segs:
                key_idx = torch.arange(lo * 64, min(hi * 64, lens[b]))
                kv = keys[block_table[b, key_idx // 64].long(), key_idx % 64]  # [keys, 576]
                scores = (q[b, r] @ kv.T) * scale * bal_log2e()
                visible = key_idx[None, :] < (lens[b] - s_len + r // heads + 1)[:, None]
                scores = scores.masked_fill(~visible, float("-inf"))
                mx = scores.max(dim=1).values
                safe = torch.where(mx == float("-inf"), 0.0, mx)
                p = torch.exp2(scores - safe[:, None])
                l_sum = p.sum(dim=1)
                has = l_sum > 0
                acc = (p @ kv[:, :c]) / torch.where(has, l_sum, 1.0)[:, None]
                if num_splits[b] == 1:
                    out[b].view(rows, c)[r] = acc.float()
                else:
                    slot = slot_start[b] + k
                    part_out[slot, r] = acc.float()
                    part_lse[slot, r] = torch.where(has, mx + torch.log2(torch.where(has, l_sum, 1.0)), float("-inf")).float()
    out = out.to(torch.bfloat16)
    bal.combine(part_out, part_lse, out, torch.tensor(num_splits, dtype=torch.int32), torch.tensor(slot_start, dtype=torch.int32))
    return out


def bal_log2e():
    return parts.LOG2E


@pytest.mark.parametrize("lens, heads, queries, partitions", [
    ([200, 64, 1, 130], 16, 1, 3),  # ragged, cut requests, a 1-token request
    ([2, 300, 65], 16, 2, 4),  # S = 2 (the causal mask), a request of its 2 new tokens only
    ([700], 128, 1, 5),  # one request over every share, two row tiles
    ([128, 128, 128, 128], 32, 1, 2),  # equal: two requests a share, none cut
])  # fmt: skip
def test_the_emulated_segment_loop_and_combine_match_the_reference(lens, heads, queries, partitions):
    from deepinfer.ops.attention import mla_decode as ref_mla_decode

    gen = torch.Generator().manual_seed(0)
    batch, ctx = len(lens), max(64, math.ceil(max(lens) / 64) * 64)
    pages = batch * (ctx // 64)
    cache = torch.randn(pages, 64, 576, generator=gen).to(torch.bfloat16)
    block_table = torch.randperm(pages, generator=gen).to(torch.int32).view(batch, ctx // 64)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q_nope = torch.randn(batch, queries, heads, 512, generator=gen).to(torch.bfloat16)
    q_rope = torch.randn(batch, queries, heads, 64, generator=gen).to(torch.bfloat16)
    got = _emulate(q_nope, q_rope, cache, block_table, seq_lens, 0.1, partitions, 1)
    want = ref_mla_decode(q_nope.float(), q_rope.float(), cache.float(), block_table, seq_lens, softmax_scale=0.1)
    assert torch.isfinite(got.float()).all()
    assert (got.float() - want).abs().max().item() <= 1e-2 * max(1.0, want.abs().max().item())


# ---------------------------------------------------------------------------------------------
# The handshakes across segments


class Persistent:
    """The kernel's waits and arrivals over a CTA's segments (tile counts), as its code makes them: the loader's global
    tile counter, each attention warpgroup's q staging and q_bar, its early-release seesaw tiles by global parity, its
    row sums through slot [segment parity][warpgroup] and sums_bar."""

    def __init__(self, segments: list[int]):
        self.segments = segments
        self.ready, self.empty = [Barrier(1), Barrier(1)], [Barrier(2), Barrier(2)]
        self.published, self.sums, self.q_bar = [Barrier(1), Barrier(1)], Barrier(2), Barrier(2)
        self.stage, self.landed, self.readers, self.in_flight = [None, None], [False, False], [set(), set()], []
        self.p_tile, self.p_read = None, True
        self.q_seg, self.q_readers = None, set()  # the segment whose q is staged; warpgroups scoring from it
        self.sum_slot = {}  # (parity, warpgroup) -> (segment, read by the other)
        self.taken_in = {0: [], 1: []}

    def loader(self):
        for tile in range(sum(self.segments)):
            t = tile % 2
            yield lambda t=t, tile=tile: self.empty[t].passed(((tile // 2) & 1) ^ 1)
            assert not self.readers[t], (tile, self.readers)
            self.stage[t], self.landed[t] = tile, False
            self.in_flight.append(t)

    def land(self, t):
        self.in_flight.remove(t)
        self.landed[t] = True
        self.ready[t].arrive()

    def read(self, w, t, tile):
        assert self.stage[t] == tile and self.landed[t], (w, t, tile, self.stage, self.landed)
        self.readers[t].add(w)

    def take_in_whole(self, w, k):
        yield lambda: self.published[1 - w].passed((k // 2) & 1)
        assert self.p_tile == k, (w, k, self.p_tile)
        self.read(w, k % 2, k)
        self.taken_in[w].append(k)
        yield lambda: True
        self.readers[k % 2].discard(w)
        self.p_read = True
        self.empty[k % 2].arrive()

    def own_tile(self, w, j, seg):
        t = j % 2
        yield lambda: self.ready[t].passed((j // 2) & 1)
        assert self.q_seg == seg
        self.read(w, t, j)
        self.q_readers.add(w)
        yield lambda: True
        self.readers[t].discard(w)
        self.q_readers.discard(w)
        assert self.p_read, (w, j, self.p_tile)
        self.p_tile, self.p_read = j, False
        self.published[w].arrive()
        self.read(w, t, j)
        yield lambda: True
        self.readers[t].discard(w)
        self.empty[t].arrive()

    def attend(self, w):
        n_before = 0  # the CTA's tiles before this segment (the kernel's g)
        for seg, n in enumerate(self.segments):
            assert not (self.q_readers - {w}), "q rewritten while the other scores"
            self.q_seg = seg  # (both stage their halves: the model keeps one)
            self.q_bar.arrive()
            yield lambda seg=seg: self.q_bar.passed(seg & 1)
            end = n_before + n
            if n_before % 2 == 1 - w:
                yield from self.take_in_whole(w, n_before)
            for j in range(n_before + (n_before + w) % 2, end, 2):
                yield from self.own_tile(w, j, seg)
                if j + 1 < end:
                    yield from self.take_in_whole(w, j + 1)
            slot = (seg % 2, w)
            assert slot not in self.sum_slot or self.sum_slot[slot][1], "row sums rewritten before read"
            self.sum_slot[slot] = (seg, False)
            self.sums.arrive()
            yield lambda seg=seg: self.sums.passed(seg & 1)
            other = self.sum_slot[(seg % 2, 1 - w)]
            assert other[0] == seg
            self.sum_slot[(seg % 2, 1 - w)] = (seg, True)
            n_before = end


def _run_persistent(segments, seed):
    k = Persistent(segments)
    run_interleaved(k, {"loader": k.loader(), "w0": k.attend(0), "w1": k.attend(1)}, seed, f"segments {segments}")
    total = sum(segments)
    assert k.taken_in[0] == list(range(1, total, 2)) and k.taken_in[1] == list(range(0, total, 2))
    assert all(b.pending == 0 for b in k.empty + k.ready + k.published)


@pytest.mark.parametrize("segments", [[1], [1, 1], [1, 1, 1, 1], [2, 3], [3, 2, 1], [1, 4, 1, 2], [5, 5], [2, 1, 1, 3, 2]])
def test_the_handshakes_across_segments_neither_deadlock_nor_race(segments):
    for seed in range(150):
        _run_persistent(segments, seed)


# ---------------------------------------------------------------------------------------------
# The switch


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.skipif(g.GLUON_IMPORT_ERROR is not None, reason="no Gluon for Hopper in this Triton")
def test_the_switch_reaches_the_launch(monkeypatch):
    """"balanced": True with the early-release seesaw launches the persistent grid with the entry's registers and
    overhead; off (the table) or with a forced split count the split grid; with another schedule it is an error."""
    launched = []
    monkeypatch.setattr(bal, "launch_balanced", lambda *a: launched.append(("balanced", a[-3:])) or "balanced")
    monkeypatch.setattr(parts, "launch", lambda *a, **kw: launched.append(("split", kw)) or "split")
    args = (_meta(2, 1, 128, 512), _meta(2, 1, 128, 64), _meta(8, 64, 576), _meta(2, 4, dtype=torch.int32), _meta(2, dtype=torch.int32), 0.1)
    table = g.config
    assert table("mla_decode", "gluon_bf16", None)["balanced"] is False
    assert g.launch_mla_decode_gluon(*args) == "split"
    switches = {"schedule": "seesaw_early_release", "balanced": True, "balanced_overhead_tiles": 3}
    monkeypatch.setattr(g, "config", lambda op, v, device=None: {**table(op, v, device), **switches})
    assert g.launch_mla_decode_gluon(*args) == "balanced" and launched[-1] == ("balanced", (232, 40, 3))
    assert g.launch_mla_decode_gluon(*args, num_splits=2) == "split"
    switches["schedule"] = "split_keys"
    with pytest.raises(ValueError, match="balanced wants schedule 'seesaw_early_release'"):
        g.launch_mla_decode_gluon(*args)


# ---------------------------------------------------------------------------------------------
# On an SM90 GPU: against the default grid

ON_SM90 = pytest.mark.skipif(mode() != GPU or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                             reason="runs on an SM90 GPU only (TRITON_INTERPRET=0 pytest tests/cuda/test_mla_decode_gluon_balanced.py)")


def _gpu_inputs(batch, heads, queries, ctx, lens, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = batch * (ctx // 64)
    cache = torch.randn(pages, 64, 576, device="cuda", generator=gen).to(torch.bfloat16)
    block_table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(batch, ctx // 64)
    if lens == "varied":
        seq_lens = torch.randint(max(queries, 1), ctx + 1, (batch,), device="cuda", generator=gen, dtype=torch.int32)
    else:
        seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    q_nope = torch.randn(batch, queries, heads, 512, device="cuda", generator=gen).to(torch.bfloat16)
    q_rope = torch.randn(batch, queries, heads, 64, device="cuda", generator=gen).to(torch.bfloat16)
    return q_nope, q_rope, cache, block_table, seq_lens


@ON_SM90
@pytest.mark.parametrize("batch, heads, queries, ctx, lens", [
    (128, 128, 1, 4096, [4096] * 128),  # the benchmark: equal contexts
    (128, 128, 1, 4096, "varied"),
    (1, 128, 1, 8192, [8192]),  # one request cut over every share
    (32, 128, 1, 2048, "varied"),
    (16, 64, 2, 2048, "varied"),  # S = 2 x 64 heads: the causal mask, two row tiles
    (6, 128, 1, 4096, [1, 2, 63, 65, 4096, 1000]),  # short requests, partial pages
])  # fmt: skip
def test_balanced_matches_the_default_grid_on_the_gpu(monkeypatch, batch, heads, queries, ctx, lens):
    """The balanced grid's output against the default grid's (same schedule, seesaw_early_release) and the reference op."""
    from deepinfer.ops.attention import mla_decode as ref_mla_decode

    args = _gpu_inputs(batch, heads, queries, ctx, lens)
    table = g.config
    switches = {"schedule": "seesaw_early_release"}
    monkeypatch.setattr(g, "config", lambda op, v, device=None: {**table(op, v, device), **(switches if v == "gluon_bf16" else {})})
    want = g.launch_mla_decode_gluon(*args, 192**-0.5)
    switches["balanced"] = True
    got = g.launch_mla_decode_gluon(*args, 192**-0.5)
    assert got is not None and torch.isfinite(got).all()
    assert (got.float() - want.float()).abs().max().item() <= 2e-2
    ref = ref_mla_decode(*(a.float() if a.is_floating_point() else a for a in args), softmax_scale=192**-0.5)
    assert (got.float() - ref).abs().max().item() <= 1.6e-2 * max(1.0, ref.abs().max().item())
