"""The V4.1 ops' bench module on the CPU: its case list is well-formed and covers V4.1-Flash's decode and
prefill sizes, its torch peers run the reference ops (at shrunk sizes, through the very setup functions
the cases use), and its byte and flop counts match hand-counted cases. The timings need a GPU."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops.cache_rounding import cache_round
from deepinfer.ops.candidates import candidate_blocks, indexer_topk_in_blocks
from deepinfer.registry import all_ops
from deepinfer_cuda.bench import v41_ops

CPU = torch.device("cpu")


def test_cases_are_well_formed():
    names = [(c.op, c.name) for c in v41_ops.CASES]
    assert len(set(names)) == len(names)
    assert {c.op for c in v41_ops.CASES} == set(v41_ops.OPS) <= set(all_ops())
    for case in v41_ops.CASES:
        assert case.peer is not None and case.peer_name and case.bound in ("memory", "compute")
        assert all(callable(f) for f in (case.setup, case.kernel, case.peer, case.bytes, case.flops))
        assert getattr(case, "graph", False) == case.name.startswith("decode_"), case.name


def test_every_op_has_the_three_decode_batches_and_the_prefill_chunk():
    for op in v41_ops.OPS:
        names = [c.name for c in v41_ops.CASES if c.op == op]
        variants = sum(n.startswith("prefill_T8192_") for n in names)
        assert variants >= 1 and len(names) == 4 * variants, op
        for batch in (1, 64, 256):
            assert sum(n.startswith(f"decode_B{batch}_") for n in names) == variants, (op, batch)
    compute = {(c.op, c.name.split("_")[0]) for c in v41_ops.CASES if c.bound == "compute"}
    assert compute == {("candidate_blocks", "prefill"), ("indexer_topk_in_blocks", "prefill")}
    formats = {c.name.rsplit("_", 1)[1] for c in v41_ops.CASES if c.op in ("cache_pack", "cache_unpack")}
    assert formats == {"fp8", "nvfp4", "mxfp4"}


@pytest.mark.parametrize("channels, fmt", [(512, "fp8"), (512, "nvfp4"), (128, "mxfp4")])
def test_pack_and_unpack_peers_store_what_cache_round_gives(channels, fmt):
    packed = v41_ops._pack_setup(3, channels, fmt)(CPU)
    rows = v41_ops._pack_peer(packed)
    unpack = v41_ops._unpack_setup(3, channels, fmt)(CPU)
    assert torch.equal(unpack["rows"], rows)  # the same seeded values, packed by the reference
    assert torch.equal(v41_ops._unpack_peer(unpack), cache_round(packed["x"], fmt=fmt))
    width = {"fp8": 528, "nvfp4": 288, "mxfp4": 68}[fmt]
    assert v41_ops._pack_bytes(packed) == 3 * (channels * 2 + width) and v41_ops._unpack_bytes(unpack) == 3 * (width + channels * 2)
    r = v41_ops._round_setup((3, channels), fmt)(CPU)
    assert torch.equal(v41_ops._round_peer(r), cache_round(r["x"], fmt=fmt)) and v41_ops._round_bytes(r) == 2 * 3 * channels * 2


@pytest.mark.parametrize("batch, ctx, chunk, top_blocks", [(3, 256, 1, 8), (1, 64, 64, 4)])
def test_candidate_peers_in_chunks_are_the_reference(monkeypatch, batch, ctx, chunk, top_blocks):
    s = v41_ops._candidate_setup(batch, ctx, chunk, top_blocks=top_blocks)(CPU)
    blocks = s["blocks"]
    newest = (s["num_visible"].long() - 1) // v41_ops.BLOCK_SIZE
    assert (blocks.long() == newest[:, None]).any(-1).all() and (blocks.long() <= newest[:, None]).all()  # the newest kept, none unseen
    args = v41_ops._index_args(s)
    want_blocks = candidate_blocks(*args, block_size=v41_ops.BLOCK_SIZE, top_blocks=top_blocks)
    want_rows = indexer_topk_in_blocks(*args, blocks, top_k=v41_ops.TOP_K, block_size=v41_ops.BLOCK_SIZE)
    monkeypatch.setattr(v41_ops, "PEER_BYTES", 1)  # a query a chunk
    assert torch.equal(v41_ops._blocks_peer(s), want_blocks) and torch.equal(v41_ops._in_blocks_peer(s), want_rows)


def test_candidate_counts_by_hand():
    s = v41_ops._candidate_setup(2, 256, top_blocks=8)(CPU)  # one query per sequence, 256 keys, 8 of 32 blocks (64 keys) each
    per_query = 32 * 128 * 2 + 32 * 4 + 8  # q, weights, seq + visible
    key = 128 * 2 + 4  # a bf16 key and its table entry
    assert v41_ops._blocks_bytes(s) == 2 * 256 * key + 2 * (per_query + 8 * 4)
    assert v41_ops._blocks_flops(s) == 2 * 32 * 129 * 2 * 256
    assert v41_ops._in_blocks_bytes(s) == 2 * 64 * key + 2 * (per_query + 512 * 4) + 2 * 8 * 4
    assert v41_ops._in_blocks_flops(s) == 2 * 32 * 129 * 2 * 64


def test_stream_and_engram_peers_and_counts():
    h = v41_ops._hc_setup(3, hidden=64)(CPU)
    layer_input, pre, post, comb = v41_ops._hc_peer(h)
    assert layer_input.shape == (3, 64) and pre.shape == post.shape == (3, 4) and comb.shape == (3, 4, 4)
    # x (3 x 4 x 64 bf16), fn + base + scale float32, per token prev_pre read, the bf16 layer input and 4 + 4 + 16 float32 written
    assert v41_ops._hc_bytes(h) == 3 * 256 * 2 + (24 * 256 + 24 + 3) * 4 + 3 * (4 * 4 + 64 * 2 + 24 * 4)
    assert v41_ops._hc_flops(h) == 2 * 3 * 256 * 26
    g = v41_ops._gate_setup(5, hidden=64)(CPU)
    assert v41_ops._gate_peer(g).shape == (5, 4, 64)
    assert v41_ops._gate_bytes(g) == 3 * 5 * 256 * 2 + 5 * 64 * 2 + 2 * 256 * 4 and v41_ops._gate_flops(g) == 10 * 5 * 256
    e = v41_ops._hash_setup(5)(CPU)
    rows = v41_ops._hash_peer(e)
    assert rows.shape == (5, 24) and e["primes"].shape == (3, 8) and (e["primes"] > 16_000_000).all()
    assert v41_ops._hash_bytes(e) == 5 * 4 * 8 + (4 + 2 * 24) * 8 + 5 * 24 * 8 and v41_ops._hash_flops(e) == 0
