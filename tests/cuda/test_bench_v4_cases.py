"""The V4 bench modules on the CPU: their case lists are well-formed and cover V4-Flash's sizes, their
torch peers compute the reference ops (at shrunk sizes, through the very setup functions the
cases use), and their byte and flop counts match hand-counted cases. The timings need the H200."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops import kv_cache_format
from deepinfer.ops.compressor import compress_kv, norm_rope_kv_write
from deepinfer.ops.indexer import indexer_topk
from deepinfer.ops.sparse_attention import sparse_attention
from deepinfer.registry import all_ops
from deepinfer_cuda.bench import v4_attention, v4_decode_plan, v4_misc

CPU = torch.device("cpu")


@pytest.mark.parametrize("module", [v4_attention, v4_misc, v4_decode_plan], ids=lambda m: m.__name__)
def test_cases_are_well_formed(module):
    names = [(c.op, c.name) for c in module.CASES]
    assert len(set(names)) == len(names)
    assert {c.op for c in module.CASES} == set(module.OPS) <= set(all_ops())
    for case in module.CASES:
        assert case.peer is not None and case.peer_name and case.bound in ("memory", "compute")
        assert all(callable(f) for f in (case.setup, case.kernel, case.peer, case.bytes, case.flops))
        assert getattr(case, "graph", False) == ("decode" in case.name or case.name.startswith(("T1_", "T16_", "T64_", "T256_"))), case.name


def test_the_cases_cover_v4_flash_sizes():
    names = {(c.op, c.name) for c in v4_attention.CASES + v4_misc.CASES}
    for ctx in (4, 32):
        for batch in (1, 64, 256):
            assert ("sparse_attention", f"decode_B{batch}_ctx{ctx}k_w128+top512_H64_D512_bf16") in names
    for ctx in (4, 32, 64):
        assert ("indexer_topk", f"decode_B64_ctx{ctx}k_H64_D128_top512_bf16") in names
    assert {n for op, n in names if op == "compress_kv"} >= {"decode_B256_CSA_r4_overlap_D512_f32", "prefill_T8192_HCA_r128_D512_f32"}
    for op, tokens in (("hc_pre", (1, 16, 64, 1024, 8192)), ("hc_head", (1, 64, 1024)), ("hc_post", (1, 64, 1024, 8192))):
        assert {n for o, n in names if o == op and not n.endswith("_normed")} == {f"T{t}_N4_D4096_bf16" for t in tokens}
    assert {n for o, n in names if o == "hc_pre" and n.endswith("_normed")} == {f"T{t}_N4_D4096_bf16_normed" for t in (1, 64, 256, 8192)}
    assert {n for o, n in names if o == "head_norm_rope"} == {f"decode_B{b}_H64_D512_r64_bf16" for b in (1, 64, 256)}
    assert {c.name.split("_")[0] for c in v4_misc.CASES if c.op == "clamped_silu_and_mul"} == {"T384", "T1536", "T49152"}
    prefills = {(c.op, c.bound) for c in v4_attention.CASES if c.name.startswith("prefill")}
    assert prefills == {("sparse_attention", "compute"), ("compress_kv", "memory"), ("indexer_topk", "compute")}
    fp8 = {(c.op, c.bound) for c in v4_attention.CASES if c.name.endswith("fp8kv")}  # the FP8 cache (kv_cache_dtype="fp8")
    assert fp8 == {("sparse_attention", "compute"), ("indexer_topk", "memory"), ("indexer_topk", "compute")}
    # the indexer's prefill cases, each with its multi_query twin (the same inputs, the other score schedule)
    indexer_prefills = {n for op, n in names if op == "indexer_topk" and n.startswith("prefill")}
    for ctx, t in ((32, 4096), (64, 8192)):
        for kv in ("bf16", "fp8kv"):
            assert {f"prefill_T{t}_ctx{ctx}k_H64_D128_top512_{kv}", f"prefill_T{t}_ctx{ctx}k_H64_D128_top512_{kv}_query_loop"} <= indexer_prefills


def test_decode_plan_bytes_are_its_inputs_and_outputs():
    """The plan's bytes: every input read once and every output written once (at a shrunk context: 4 pages)."""
    s = v4_decode_plan._setup(3, 256)(CPU)
    out = v4_decode_plan._peer(s)
    assert v4_decode_plan._bytes(s) == sum(t.numel() * t.element_size() for t in (*s["inputs"], *out))


@pytest.mark.parametrize("batch, ctx, chunk, kv_dtype", [(2, 1024, 1, torch.bfloat16), (1, 2048, 64, torch.bfloat16), (1, 300, 200, torch.bfloat16),
                                                       (2, 1024, 1, torch.float8_e4m3fn)])  # fmt: skip
def test_sparse_attention_peer_is_the_reference(batch, ctx, chunk, kv_dtype):
    s = v4_attention._sparse_setup(batch, ctx, chunk, kv_dtype)(CPU)
    extra = dict(extra_kv=s["extra_kv"], extra_indices=s["extra_indices"])
    ref = sparse_attention(s["q"], s["kv"], s["indices"], s["sinks"], softmax_scale=v4_attention.SCALE, **extra)
    assert torch.allclose(v4_attention._sparse_peer(s).float(), ref.float(), atol=1e-2, rtol=1e-2)
    assert s["indices"].shape == (batch * chunk, 128) and s["extra_indices"].shape[1] == min(512, ctx // 4)
    window = s["indices"][-1]
    assert (window >= 0).all() and torch.unique(window).numel() == 128  # the last query's 128 window rows, distinct


def test_sparse_attention_bytes_and_flops_by_hand():
    s = v4_attention._sparse_setup(2, 1024)(CPU)  # 2 queries, each 128 window rows + all 256 entries (fewer than 512)
    rows = 2 * (128 + 256)
    assert s["distinct_rows"] == s["pairs"] == rows
    # rows of 512 bf16, q read and out written (2 x 64 x 512 bf16), the int32 lists, 64 float32 sinks
    assert v4_attention._sparse_bytes(s) == rows * 1024 + 2 * (2 * 64 * 512 * 2) + 2 * (128 + 256) * 4 + 64 * 4
    assert v4_attention._sparse_flops(s) == 4 * 64 * 512 * rows
    fp8 = v4_attention._sparse_setup(2, 1024, kv_dtype=torch.float8_e4m3fn)(CPU)  # rows of 512 e4m3 values and a float32 scale
    assert fp8["kv"].shape[1] == 528 and v4_attention._sparse_bytes(fp8) == v4_attention._sparse_bytes(s) - rows * (1024 - 528)


@pytest.mark.parametrize("batch, ctx, chunk, kv_dtype", [(3, 1024, 1, torch.bfloat16), (1, 2048, 64, torch.bfloat16), (3, 1024, 1, torch.float8_e4m3fn)])
def test_indexer_peer_is_the_reference(batch, ctx, chunk, kv_dtype):
    s = v4_attention._indexer_setup(batch, ctx, chunk, kv_dtype)(CPU)
    ref = indexer_topk(*v4_attention._indexer_args(s), top_k=v4_attention.TOP_K)
    assert torch.equal(v4_attention._indexer_peer(s), ref)  # both write the ids ascending, -1 last


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_indexer_prefill_twins_select_alike(kv_dtype):
    # the prefill cases' kernels (the default, the query-loop twin, a sweep's multi_query sizes) at a shrunk chunk: 64
    # queries over 512 keys
    s = v4_attention._indexer_setup(1, 2048, 64, kv_dtype)(CPU)
    want = v4_attention._indexer_schedule("query_loop")(s)
    assert torch.equal(v4_attention._indexer_kernel(s), want)
    assert torch.equal(v4_attention._indexer_schedule("multi_query", {"queries": 2, "block_e": 128, "num_stages": 4})(s), want)


def test_indexer_bytes_and_flops_by_hand():
    s = v4_attention._indexer_setup(3, 1024)(CPU)  # 3 sequences of 256 keys, one query each
    # keys of 128 bf16 and their int32 table rows; per query: q 64 x 128 bf16, 64 float32 weights, 512 int32 ids, seq + visible
    assert v4_attention._indexer_bytes(s) == 3 * 256 * (256 + 4) + 3 * (64 * 128 * 2 + 64 * 4 + 512 * 4 + 8)
    assert v4_attention._indexer_flops(s) == 2 * 64 * 129 * 3 * 256
    fp8 = v4_attention._indexer_setup(3, 1024, kv_dtype=torch.float8_e4m3fn)(CPU)  # keys of 128 e4m3 values and a float32 scale
    assert v4_attention._indexer_bytes(fp8) == v4_attention._indexer_bytes(s) - 3 * 256 * (256 - 144)


@pytest.mark.parametrize("ratio, overlap, entries, decode", [(4, True, 8, True), (128, False, 3, True), (4, True, 16, False), (128, False, 2, False)])
def test_compress_kv_cases(ratio, overlap, entries, decode):
    s = v4_attention._compress_setup(ratio, overlap, entries, decode)(CPU)
    ref = compress_kv(*v4_attention._compress_args(s), ratio=ratio, overlap=overlap)
    assert torch.equal(v4_attention._compress_peer(s), ref) and ref.shape == (entries, 512)
    if overlap and not decode:
        assert s["prev_starts"][0] == -1 and s["prev_starts"][1] == 0  # a sequence's first window has no previous one
    slots = 2 * ratio if overlap else ratio
    # kv and gate values pooled (float32), the bias, the starts (two lists with overlap), the float32 entries
    expected = 2 * entries * slots * 512 * 4 + ratio * s["kv"].shape[1] * 4 + entries * 8 * (2 if overlap else 1) + entries * 512 * 4
    assert v4_attention._compress_bytes(s) == expected and v4_attention._compress_flops(s) == 5 * entries * slots * 512


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_norm_rope_kv_write_cases(kv_dtype):
    s = v4_attention._emit_setup(5, kv_dtype)(CPU)
    pool = s["pool"].clone()
    want = norm_rope_kv_write(s["x"], s["weight"], s["positions"], s["table"], pool, s["slots"], eps=v4_attention.NORM_EPS)
    got = v4_attention._emit_peer(s).view_as(want)
    rows = lambda cache: kv_cache_format.dequantize_rows(cache.view(-1, cache.shape[-1])[s["slots"]])  # noqa: E731
    assert torch.allclose(rows(got), rows(want), rtol=0.13 if kv_dtype != torch.bfloat16 else 1e-2, atol=1e-2)
    # the float32 entries, the weight, a table row of 64 float32 per entry, its position and slot, the pool rows written
    row_bytes = 1024 if kv_dtype == torch.bfloat16 else 528
    assert v4_attention._emit_bytes(s) == 5 * (512 * 4 + 64 * 4 + 16 + row_bytes) + 512 * 4
    assert v4_attention._emit_flops(s) == 5 * (4 * 512 + 3 * 64)


def test_misc_peers_and_counts():
    s = v4_misc._hc_setup(3)(CPU)
    layer_input, post, comb = v4_misc._pre_peer(s)
    assert layer_input.shape == (3, 4096) and post.shape == (3, 4) and comb.shape == (3, 4, 4)
    assert v4_misc._post_peer(s).shape == (3, 4, 4096)
    # hc_pre: x (3 x 4 x 4096 bf16), fn + base + scale float32, per token the bf16 layer input and 4 + 16 float32 mixings
    assert v4_misc._pre_bytes(s) == 3 * 16384 * 2 + (24 * 16384 + 24 + 3) * 4 + 3 * (4096 * 2 + 20 * 4)
    assert v4_misc._pre_flops(s) == 2 * 3 * 16384 * 26
    # hc_post: streams read and written, y read, post and comb read
    assert v4_misc._post_bytes(s) == 2 * 3 * 16384 * 2 + 3 * 4096 * 2 + 3 * 20 * 4 and v4_misc._post_flops(s) == 10 * 3 * 16384
    # hc_head: x read, the head's fn [4, 16384] + base + scale and the norm weight float32, the normed bf16 row written
    assert v4_misc._head_peer(s).shape == (3, 4096)
    assert v4_misc._head_bytes(s) == 3 * 16384 * 2 + (4 * 16384 + 4 + 1 + 4096) * 4 + 3 * 4096 * 2 and v4_misc._head_flops(s) == 2 * 3 * 16384 * 6
    a = v4_misc._act_setup(5)(CPU)
    assert v4_misc._act_peer(a).shape == (5, 2048) and v4_misc._act_bytes(a) == 1.5 * 5 * 4096 * 2 and v4_misc._act_flops(a) == 3 * 5 * 4096


def test_padded_decode_cases_count_only_what_is_listed():
    # An HCA layer's list padded to E_max with extra_lengths, and an indexer table wider than its keys:
    # the peers are the references, the bytes those of the listed rows and visible keys only.
    hca = v4_attention._hca_setup(2, 1024, 64, kv_dtype=torch.bfloat16)(CPU)  # 8 entries each in a 64-wide list
    assert hca["extra_indices"].shape == (2, 64) and hca["extra_lengths"].tolist() == [8, 8]
    assert (hca["extra_indices"][:, 8:] == -1).all() and hca["distinct_rows"] == hca["pairs"] == 2 * (128 + 8)
    ref = sparse_attention(hca["q"], hca["kv"], hca["indices"], hca["sinks"], softmax_scale=v4_attention.SCALE, extra_kv=hca["extra_kv"],
                           extra_indices=hca["extra_indices"], extra_lengths=hca["extra_lengths"])  # fmt: skip
    assert torch.allclose(v4_attention._sparse_peer(hca).float(), ref.float(), atol=1e-2, rtol=1e-2)
    assert v4_attention._sparse_bytes(hca) == 2 * (128 + 8) * 1024 + 2 * (2 * 64 * 512 * 2) + (2 * 128 + 2 * 8 + 2) * 4 + 64 * 4
    wide = v4_attention._indexer_setup(2, 1024, emax=1000)(CPU)  # 256 keys each in a 1000-wide table
    assert wide["entry_rows"].shape == (2, 1000)
    assert torch.equal(v4_attention._indexer_peer(wide), indexer_topk(*v4_attention._indexer_args(wide), top_k=v4_attention.TOP_K))
    narrow = v4_attention._indexer_setup(2, 1024)(CPU)
    assert v4_attention._indexer_bytes(wide) == v4_attention._indexer_bytes(narrow)
