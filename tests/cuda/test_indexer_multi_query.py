"""The cuda indexer's prefill score schedule "multi_query" (`_indexer_scores_multi_query_kernel`: several queries per
dot, a pipelined loop over query groups) against "query_loop" (`_indexer_scores_kernel`, which the golden set checks).

Scores of every visible (query, entry) must be the same bits: bfloat16 and float32, FP8 keys, head counts that are not
a power of two (padded), one long sequence and several sequences in one batch with programs across their boundaries
(each runs the group loop once per sequence), token counts that are not a multiple of the group (the last group's
queries past T are clamped loads, never stored), causal visible counts (programs past the diagonal exit early, groups
before a program's first visible query are skipped), tables wider than any count and entry blocks past the table's
end, at the interpreter's wide entry block and at small GPU-like ones. Selection is unchanged: the ids are equal.

Bit for bit in the interpreter, where the product of a (query, head, entry) is the same float32 number in either
tile (conftest rounds the interpreter's dots once from float64) and the new kernel sums each query's heads over the
last axis of [BLOCK_E, QN, BLOCK_H], the old kernel's [BLOCK_E, BLOCK_H] sum per query. On a GPU the head sums run in
other reduction trees (the accumulator's layout differs with N): there the scores are compared to float32 rounding
and the ids are not compared.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops import kv_cache_format

from triton_mode import GPU, kernel_module, mode, require_interpreter_or_gpu


@pytest.fixture(scope="module")
def device():
    return require_interpreter_or_gpu()


@pytest.fixture(scope="module")
def ix():
    return kernel_module("deepinfer_cuda.kernels.indexer")


def _batch(g: torch.Generator, dtype: torch.dtype, fp8: bool, heads: int, dim: int, queries: list[int], entries: list[int], width: int,
           pool: int = 700) -> dict:  # fmt: skip
    """Sequences of entries[b] entries (distinct shuffled pool rows, -1 after them in a `width`-wide table), each with the
    queries[b] last positions of a causal prefill: query i of n sees entries[b] - (n - 1 - i) entries (at least 0)."""
    keys = torch.randn(pool, dim, generator=g)
    table = torch.full((len(entries), width), -1, dtype=torch.int32)
    seq, visible = [], []
    for b, (n_queries, n_entries) in enumerate(zip(queries, entries)):
        table[b, :n_entries] = torch.randperm(pool, generator=g)[:n_entries].to(torch.int32)
        seq += [b] * n_queries
        visible += [max(0, n_entries - (n_queries - 1 - i)) for i in range(n_queries)]
    tokens = len(seq)
    return dict(
        q=torch.randn(tokens, heads, dim, generator=g).to(dtype),
        weights=torch.randn(tokens, heads, generator=g).to(torch.bfloat16),
        index_keys=kv_cache_format.quantize_rows(keys) if fp8 else keys.to(dtype),
        entry_rows=table,
        token_seq=torch.tensor(seq, dtype=torch.int32),
        num_visible=torch.tensor(visible, dtype=torch.int32),
    )


def _scores(ix, device, inputs: dict, schedule: str, multi_query: dict | None = None) -> torch.Tensor:
    on = {name: t.to(device) for name, t in inputs.items()}
    return ix.score_entries(*on.values(), weights_scale=64**-0.5, prefill_schedule=schedule, multi_query=multi_query).cpu()


def _assert_same_scores(old: torch.Tensor, new: torch.Tensor, num_visible: torch.Tensor) -> None:
    seen = torch.arange(old.shape[1])[None, :] < num_visible[:, None]  # (nothing past num_visible is written)
    assert seen.any()
    if mode() == GPU:
        torch.testing.assert_close(new[seen], old[seen], rtol=1e-5, atol=1e-5 * float(old[seen].abs().max()))
    else:
        assert torch.equal(new[seen], old[seen]), f"{int((new[seen] != old[seen]).sum())} of {int(seen.sum())} scores differ"


# (queries per sequence, entries per sequence, table width): one sequence of 37 queries (T not a multiple of the
# group: 9 groups of 4 and one query), the causal diagonal inside the table; three sequences of 9 / 7 / 6 queries
# (7 a sequence: programs of 8 queries straddle both boundaries, groups of 4 too), one of them seeing a table's
# first entries only; a sequence of 5 queries all seeing nothing but the first ones (most programs exit early)
LAYOUTS = {
    "one_sequence": ([37], [300], 310),
    "three_sequences": ([9, 7, 6], [260, 131, 40], 270),
    "short_context": ([5, 6], [3, 200], 200),
}
# The interpreter's wide entry block (as wide as the table), and small GPU-like tiles: several entry blocks per sequence,
# query blocks of 8 or 16, groups of 2
TILES = {"wide": None, "e32_t8": {"block_e": 32, "block_t": 8}, "e16_t16_qn2": {"block_e": 16, "block_t": 16, "queries": 2}}


@pytest.mark.parametrize("tiles", list(TILES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("keys", ["same", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_multi_query_scores_equal_the_query_loop(ix, device, dtype, keys, layout, tiles):
    g = torch.Generator().manual_seed(21)
    queries, entries, width = LAYOUTS[layout]
    inputs = _batch(g, dtype, keys == "fp8", heads=12, dim=32, queries=queries, entries=entries, width=width)
    old = _scores(ix, device, inputs, "query_loop")
    _assert_same_scores(old, _scores(ix, device, inputs, "multi_query", TILES[tiles]), inputs["num_visible"])


@pytest.mark.parametrize("queries", [2, 4])
@pytest.mark.parametrize("keys", ["same", "fp8"])
def test_multi_query_at_v4_width(ix, device, keys, queries):
    # V4's 64 heads (N = 2 or 4 x 64), D 128 (no padding: the kernel's unmasked loads): two sequences, the GPU's entry
    # block of 128 and query blocks of 16 (some of them straddling the two sequences)
    g = torch.Generator().manual_seed(22)
    inputs = _batch(g, torch.bfloat16, keys == "fp8", heads=64, dim=128, queries=[21, 19], entries=[300, 170], width=300)
    old = _scores(ix, device, inputs, "query_loop")
    tiles = {"block_e": 128, "block_t": 16, "queries": queries}
    _assert_same_scores(old, _scores(ix, device, inputs, "multi_query", tiles), inputs["num_visible"])


def test_multi_query_leaves_past_num_visible_unwritten(ix, device):
    # Sentinel-filled scores: every column at or past num_visible keeps its sentinel (the selection never reads it).
    g = torch.Generator().manual_seed(23)
    inputs = _batch(g, torch.bfloat16, False, heads=12, dim=32, queries=[9, 7, 6], entries=[260, 131, 40], width=270)
    q, weights, keys, rows, seq, visible = (t.to(device) for t in inputs.values())
    scores = torch.full((22, 270), 7.0, device=device)
    plan = ix._multi_query_plan(22, 3, 270, 16, {"block_e": 32, "block_t": 8})
    ix._launch_multi_query(q, weights, keys, keys, rows, seq, visible, scores, 1.0, False, False, 16, 32, plan)
    unseen = torch.arange(270)[None, :] >= inputs["num_visible"][:, None]
    assert (scores.cpu()[unseen] == 7.0).all() and (scores.cpu()[~unseen] != 7.0).all()


@pytest.mark.parametrize("keys", ["same", "fp8"])
def test_multi_query_selects_the_same_ids(ix, device, keys):
    g = torch.Generator().manual_seed(24)
    inputs = _batch(g, torch.bfloat16, keys == "fp8", heads=12, dim=32, queries=[9, 7, 6], entries=[260, 131, 40], width=270)
    on = [t.to(device) for t in inputs.values()]
    old = ix.launch_indexer_topk(*on, 16, weights_scale=0.125, prefill_schedule="query_loop").cpu()
    new = ix.launch_indexer_topk(*on, 16, weights_scale=0.125, prefill_schedule="multi_query", multi_query={"block_e": 32, "block_t": 8}).cpu()
    if mode() != GPU:
        assert torch.equal(new, old)
    assert (old >= 0).sum() == (new >= 0).sum()


def test_multi_query_plan(ix):
    # V4 prefill (64 heads) with groups of 4: N 256, 64 queries a program; 128 heads: groups of 2 (N at most 256); a decode
    # batch (one query a sequence) and fewer queries a sequence than a group: None (the query loop); T past 65535 x 64:
    # wider query blocks
    gpu = {"block_e": 128}
    assert ix._multi_query_plan(8192, 1, 16384, 64, gpu) == {**ix.MULTI_QUERY_GPU, "queries": 4, "block_t": 64}
    assert ix._multi_query_plan(8192, 1, 16384, 128, {"queries": 4})["queries"] == 2
    assert ix._multi_query_plan(64, 64, 8192, 64, gpu) is None
    assert ix._multi_query_plan(192, 64, 8192, 64, {**gpu, "queries": 4}) is None
    assert ix._multi_query_plan(40, 2, 300, 16, gpu)["block_t"] == 32
    assert ix._multi_query_plan(1 << 22, 1, 1 << 20, 64, gpu)["block_t"] == 128
    with pytest.raises(ValueError, match="queries, block_e"):
        ix._multi_query_plan(8192, 1, 16384, 64, {"stages": 3})


def test_schedule_names_decode_and_the_deterministic_kernel(ix, device, monkeypatch):
    # An unknown name lists the valid ones; with PREFILL_SCHEDULE = "multi_query" the default kernel takes it for a
    # prefill, a decode batch keeps the query loop, and deterministic mode (invariant) keeps the query loop.
    g = torch.Generator().manual_seed(25)
    prefill = [t.to(device) for t in _batch(g, torch.bfloat16, False, heads=4, dim=16, queries=[8], entries=[20], width=20).values()]
    decode = [t.to(device) for t in _batch(g, torch.bfloat16, False, heads=4, dim=16, queries=[1, 1], entries=[20, 9], width=20).values()]
    with pytest.raises(ValueError, match="query_loop, multi_query"):
        ix.score_entries(*prefill, prefill_schedule="heads_as_n")
    launched = []
    real = ix._launch_multi_query
    monkeypatch.setattr(ix, "_launch_multi_query", lambda *a: launched.append(a[-1]["queries"]) or real(*a))
    monkeypatch.setattr(ix, "PREFILL_SCHEDULE", "multi_query")
    ix.indexer_topk(*prefill, top_k=4)
    ix.indexer_topk(*decode, top_k=4)
    ix.indexer_topk_invariant(*prefill, top_k=4)
    assert launched == [ix.MULTI_QUERY_GPU["queries"]]
