"""The cuda backend's DeepSeek-V4 attention kernels (sparse_attention, indexer_topk) beyond the golden set.

sparse_attention: a single decode query at V4's width (64 heads of 512) over a window and an E_max-wide
list of compressed entries, split into many row blocks (forced, and as the GPU plan splits it), with
`extra_lengths` and real rows listed after each length (they must not be read). indexer_topk's
selection: rows whose top-k boundary falls among equal scores (zeros of both signs, negatives)
spread over several chunks, so that the chunked selection (each chunk's candidates, then the
candidates' selection, three launches) must keep the reference's tie rule (lowest id first); rows
seeing none, fewer than k and exactly k entries; garbage (NaN, huge) past num_visible, never read.
indexer_topk's scores from bfloat16 weights and weights_scale: the model's float32 product, bit for bit.

Runs in the interpreter (the default under pytest) or, with TRITON_INTERPRET=0, on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops.indexer import _top_ids_lowest_first
from deepinfer.ops.indexer import indexer_topk as ref_indexer_topk
from deepinfer.ops.sparse_attention import sparse_attention as ref_sparse_attention

from triton_mode import kernel_module, require_interpreter_or_gpu


@pytest.fixture(scope="module")
def device():
    return require_interpreter_or_gpu()


@pytest.fixture(scope="module")
def sa():
    return kernel_module("deepinfer_cuda.kernels.sparse_attention")


@pytest.fixture(scope="module")
def ix():
    return kernel_module("deepinfer_cuda.kernels.indexer")


def _reference_selection(scores: torch.Tensor, num_visible: torch.Tensor, top_k: int) -> torch.Tensor:
    width = scores.shape[1]
    masked = scores.double().masked_fill(torch.arange(width)[None, :] >= num_visible.long()[:, None], float("-inf"))
    out = torch.full((scores.shape[0], top_k), -1, dtype=torch.int32)
    k = min(top_k, width)
    out[:, :k] = _top_ids_lowest_first(masked, k).to(torch.int32)
    return out


def _tie_heavy_scores(g: torch.Generator, rows: int, width: int) -> torch.Tensor:
    """Scores drawn from a few values (+0.0, -0.0, +-0.5, +-1.5, 2.0, randn): long runs of equal scores."""
    values = torch.tensor([0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.0])
    pick = torch.randint(0, values.numel() + 1, (rows, width), generator=g)
    scores = torch.randn(rows, width, generator=g)
    tied = pick < values.numel()
    scores[tied] = values[pick[tied].clamp(max=values.numel() - 1)]
    return scores


@pytest.mark.parametrize("chunk", [None, 32])  # one launch; 300 entries in chunks of 32: three launches
def test_select_topk_keeps_the_tie_rule_across_chunks(ix, device, chunk):
    g = torch.Generator().manual_seed(1)
    top_k, width = 8, 300
    scores = _tie_heavy_scores(g, 9, width)
    scores[5, :] = 0.0  # every score equal: the lowest ids
    scores[6, :] = 0.0  # +0.0 and -0.0 are one value: the boundary among zeros of both signs, lowest ids first
    scores[6, ::3] = -0.0
    scores[6, [40, 170, 290]] = 1.0
    num_visible = torch.tensor([300, 257, 8, 5, 0, 300, 300, 33, 1], dtype=torch.int32)
    for row, nv in enumerate(num_visible.tolist()):  # past num_visible: never read (nothing writes it)
        scores[row, nv:] = torch.where(torch.arange(width - nv) % 2 == 0, float("nan"), 1e30)
    got = ix.select_topk(scores.to(device), num_visible.to(device), top_k, chunk=chunk).cpu()
    assert torch.equal(got, _reference_selection(scores, num_visible, top_k))


def test_select_topk_top_k_above_the_row(ix, device):
    g = torch.Generator().manual_seed(2)
    scores = _tie_heavy_scores(g, 3, 20)
    num_visible = torch.tensor([20, 7, 0], dtype=torch.int32)
    got = ix.select_topk(scores.to(device), num_visible.to(device), 32).cpu()
    assert torch.equal(got, _reference_selection(scores, num_visible, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_topk_chunked_selection_matches_the_reference(ix, device, dtype):
    # Two sequences of 200 and 90 entries in a 260-wide table (a decode plan's E_max), zeros common
    # (keys pointing away from every head score exactly 0): chunks of 64 entries, top 16.
    g = torch.Generator().manual_seed(3)
    heads, dim, pool, top_k = 4, 16, 320, 16
    keys = torch.randn(pool, dim, generator=g, dtype=torch.float64)
    keys[:, 0] = torch.where(torch.rand(pool, generator=g) < 0.5, -8.0, 8.0)
    q = torch.randn(3, heads, dim, generator=g, dtype=torch.float64)
    q[..., 0] = 4.0 + q[..., 0].abs()
    weights = torch.rand(3, heads, generator=g) * 0.1
    rows = torch.randperm(pool, generator=g).to(torch.int32)
    table = torch.full((2, 260), -1, dtype=torch.int32)
    table[0, :200], table[1, :90] = rows[:200], rows[200:290]
    args = (q.to(dtype), weights, keys.to(dtype), table, torch.tensor([0, 1, 0], dtype=torch.int32), torch.tensor([200, 90, 150], dtype=torch.int32))
    want = ref_indexer_topk(*args, top_k=top_k)
    got = ix.launch_indexer_topk(*(a.to(device) for a in args), top_k, select_chunk=64).cpu()
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_take_bf16_weights_and_their_scale_as_the_model_multiplied_them(ix, device, dtype):
    """bfloat16 weights (weights_proj's output) and weights_scale: the scores of the model's float32 product
    weights.float() * scale, bit for bit (so no selection, and no greedy token, moves)."""
    g = torch.Generator().manual_seed(4)
    heads, dim, pool, scale = 8, 32, 40, 8**-0.5 * 32**-0.5
    q = torch.randn(3, heads, dim, generator=g).to(dtype)
    keys = torch.randn(pool, dim, generator=g).to(dtype)
    weights = torch.randn(3, heads, generator=g).to(torch.bfloat16)
    table = torch.randperm(pool, generator=g)[:30].to(torch.int32).view(2, 15)
    seq, visible = torch.tensor([0, 1, 1], dtype=torch.int32), torch.tensor([15, 9, 12], dtype=torch.int32)
    rest = [a.to(device) for a in (keys, table, seq, visible)]
    got = ix.score_entries(q.to(device), weights.to(device), *rest, weights_scale=scale).cpu()
    want = ix.score_entries(q.to(device), (weights.float() * scale).to(device), *rest).cpu()
    seen = torch.arange(15)[None, :] < visible[:, None]
    assert torch.equal(got[seen], want[seen])


def _decode_lists(g: torch.Generator, rows: int, xrows: int, window: int, emax: int, visible: list[int]):
    """One query per entry of `visible`: a full window of distinct rows, and an emax-wide entry list
    whose first visible[t] ids are distinct rows and the rest real rows too (garbage past the length)."""
    win = torch.stack([torch.randperm(rows, generator=g)[:window] for _ in visible]).to(torch.int32)
    ext = torch.randint(0, xrows, (len(visible), emax), generator=g, dtype=torch.int32)
    for t, n in enumerate(visible):
        ext[t, :n] = torch.randperm(xrows, generator=g)[:n].to(torch.int32)
    return win, ext, torch.tensor(visible, dtype=torch.int32)


@pytest.mark.parametrize("num_splits", [None, 7, 20])
def test_sparse_attention_single_query_many_splits_with_lengths(sa, device, num_splits):
    # V4-Flash decode widths: 64 heads of 512, a 128-row window and an E_max of 256 HCA entries, 37
    # visible; the plan's splits (the interpreter: few "SMs") and forced ones, some of them empty.
    g = torch.Generator().manual_seed(4)
    heads, dim = 64, 512
    kv, xkv = torch.randn(600, dim, generator=g).to(torch.bfloat16), torch.randn(300, dim, generator=g).to(torch.bfloat16)
    win, ext, lengths = _decode_lists(g, 600, 300, 128, 256, [37])
    q, sinks = torch.randn(1, heads, dim, generator=g).to(torch.bfloat16), torch.randn(heads, generator=g)
    want = ref_sparse_attention(q.double(), kv.double(), win, sinks, softmax_scale=dim**-0.5, extra_kv=xkv.double(), extra_indices=ext,
                                extra_lengths=lengths)  # fmt: skip
    on = lambda t: t.to(device)  # noqa: E731
    got = sa.launch_sparse_attention(on(q), on(kv), on(win), on(sinks), dim**-0.5, on(xkv), on(ext), on(lengths), num_splits=num_splits).cpu()
    err = (got.double() - want).abs().max().item()
    assert err < 2e-2, err
    unread = sa.launch_sparse_attention(on(q), on(kv), on(win), on(sinks), dim**-0.5, on(xkv), on(ext), num_splits=num_splits).cpu()
    assert (unread.double() - want).abs().max().item() > 10 * err  # the garbage past the length matters when read


def test_sparse_attention_invariant_ignores_lengths_padding(sa, device):
    # Deterministic mode: a list cut by extra_lengths gives the bits of the same list padded with -1.
    g = torch.Generator().manual_seed(5)
    heads, dim = 16, 64
    kv, xkv = torch.randn(200, dim, generator=g), torch.randn(100, dim, generator=g)
    win, ext, lengths = _decode_lists(g, 200, 100, 32, 80, [50, 3, 0])
    padded = ext.masked_fill(torch.arange(80)[None, :] >= lengths[:, None], -1)
    q, sinks = torch.randn(3, heads, dim, generator=g), torch.randn(heads, generator=g)
    on = lambda t: t.to(device)  # noqa: E731
    cut = sa.sparse_attention_invariant(on(q), on(kv), on(win), on(sinks), softmax_scale=0.125, extra_kv=on(xkv), extra_indices=on(ext),
                                        extra_lengths=on(lengths))  # fmt: skip
    full = sa.sparse_attention_invariant(on(q), on(kv), on(win), on(sinks), softmax_scale=0.125, extra_kv=on(xkv), extra_indices=on(padded))
    assert torch.equal(cut.cpu(), full.cpu())


def test_the_decode_plan_fills_the_gpu_for_one_query(sa, monkeypatch):
    # One V4-Flash decode query on 132 SMs: 16-head programs, a split per 32-row block of the window
    # and the 512 selected entries (80 programs, each one row block), where 20 programs took 2 blocks.
    monkeypatch.setattr(sa, "num_sms", lambda device: 132)
    cfg = sa.plan(1, 64, 128, 512, False, torch.device("cpu"))
    assert (cfg["BLOCK_H"], cfg["BLOCK_N"], cfg["head_blocks"], cfg["num_splits"], cfg["num_warps"]) == (16, 32, 4, 20, 8)
    assert sa.plan(1, 64, 128, 512, False, torch.device("cpu"), invariant=True)["num_splits"] == 1
    big = sa.plan(256, 64, 128, 512, False, torch.device("cpu"))
    assert (big["BLOCK_H"], big["num_splits"]) == (64, 1)


def test_a_window_only_call_over_an_fp8_cache_keeps_16_bit_dots(sa, device, monkeypatch):
    # A sliding layer (no extra list) over an FP8 cache: its bf16 tiles run on the tensor cores; the extra
    # list's placeholder once counted as a second dtype and put these calls on float32 dots (16-head tiles).
    from deepinfer.ops import kv_cache_format

    plans = []
    real = sa.plan
    monkeypatch.setattr(sa, "plan", lambda *a, **k: plans.append(a[4]) or real(*a, **k))
    g = torch.Generator().manual_seed(6)
    heads, dim = 16, 64
    kv = kv_cache_format.quantize_rows(torch.randn(40, dim, generator=g))
    win = torch.randint(0, 40, (3, 8), generator=g, dtype=torch.int32)
    q, sinks = torch.randn(3, heads, dim, generator=g).to(torch.bfloat16), torch.randn(heads, generator=g)
    on = lambda t: t.to(device)  # noqa: E731
    got = sa.launch_sparse_attention(on(q), on(kv), on(win), on(sinks), 0.125).cpu()
    assert plans == [False]
    want = ref_sparse_attention(q.double(), kv_cache_format.dequantize_rows(kv).double(), win, sinks, softmax_scale=0.125)
    assert (got.double() - want).abs().max().item() < 3e-2
