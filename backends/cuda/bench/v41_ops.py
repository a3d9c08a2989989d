"""Benchmarks of the ops DeepSeek-V4.1 added, at V4.1-Flash sizes: cache_round, cache_pack, cache_unpack,
hc_pre_delayed, candidate_blocks, indexer_topk_in_blocks, engram_hash, engram_gate_add.

Every op runs in decode steps (B = 1, 64 and 256 sequences, one token each: graph-timed) and in prefill
(`prefill_T8192`: the first 8192 tokens of one sequence). Activations bf16, as the model passes them.

cache_round (the caches' rounding applied to values): the window KV [T, 512] in "fp8" (e4m3, a power-of-two
scale per 32) and the index queries [T, 32, 128] in "mxfp4" (e2m1, a power-of-two scale per 32). Bytes: x
read, out written. Flops: 3 per value (the group max, the division, the rescale). Memory-bound.
cache_pack (values to stored rows): what a step writes, per token a window row [512] in "fp8" (528 bytes),
a compressed entry [512] in "nvfp4" (e2m1, an e4m3 scale per 16: 288 bytes) and an index key [128] in
"mxfp4" (68 bytes) (layer 20, ratio 1: one entry and key per token). Bytes: x read, rows written. Flops: 2
per value (group max, division). Memory-bound.
cache_unpack (stored rows to bf16 values): what a step reads, a sequence's 128 window rows and (ratio 1)
its 8192 entries and index keys at 8k tokens of context; prefill reads the 8192 rows it wrote. Bytes: rows
read, values written. Flops: 1 per value (code times scale). Memory-bound.
hc_pre_delayed (hyper-connections collapsing with the previous site's pre): N = 4 streams of D = 5120, the
mixing projection fn [24, 20480] float32, 20 Sinkhorn iterations. Bytes: x, prev_pre and the parameters
read once, the bf16 layer input and pre / post / comb (float32) written. Flops: 2 * T * N*D * (24 + 2)
(projection, sum of squares, collapse), Sinkhorn's few hundred per token left out. Memory-bound.
candidate_blocks (layer 20's indexer scores pooled into blocks of 8, the best 2048 kept) and
indexer_topk_in_blocks (a Reindex layer's top 512 inside those blocks): 32 index heads of 128 (bf16, as
cache_unpack gives them), float32 head weights; decode at 32k tokens of context (ratio 1: 32768 keys a
sequence, 4096 blocks of which 2048 are candidates), prefill over the keys visible at each position. Blocks
are made as candidate_blocks makes them (the newest kept, the rest picked at random among the visible).
Bytes: each sequence's keys once (candidate_blocks: every visible key; in blocks: the keys inside some
query's blocks, once a sequence), its entry table, the queries, weights, block lists and ids. Flops: 2 * H
* (D + 1) per (query, scored key). Decode memory-bound; prefill reuses every key across queries:
compute-bound.
engram_hash (a token's 24 table rows from its last 4 compressed ids: n-grams of 2, 3, 4 x 8 heads, layer 1's
constants): integer work only (0 flops); bytes: ids read, constants, rows (int64) written. Memory-bound
(launch-bound at decode).
engram_gate_add (each of the 4 streams adds the Engram value through a gate of its key's agreement): bf16
streams, keys [T, 4, 5120] and value [T, 5120], float32 q / k weights [4, 5120]. Bytes: streams, keys, value
and weights read, streams written. Flops: 10 per stream value (the weighted dot, two sums of squares, the
gated add). Memory-bound.

The peers are the reference ops themselves (deepinfer.ops...). The candidate ones run over chunks of queries
(whole, indexer_topk_in_blocks' [T, blocks, E] membership test would take 137 GB at prefill) and loop over
sequences with a host synchronisation each (`index_scores`): their graph capture fails and the runner times
them on the stream, as its note says.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from deepinfer.ops.cache_storage import row_bytes
from deepinfer_cuda.bench.common import BenchCase

OPS = (
    "cache_round", "cache_pack", "cache_unpack", "hc_pre_delayed", "candidate_blocks", "indexer_topk_in_blocks", "engram_hash", "engram_gate_add",
)  # fmt: skip  # what this bench module covers: the runner finds it by this
TABLE_ORDER = 90  # where its rows sit in `deepinfer bench ops`: after the V4 ops

BATCHES, PREFILL = (1, 64, 256), 8192
HEAD_DIM, WINDOW = 512, 128
INDEX_HEADS, INDEX_DIM, TOP_K = 32, 128, 512
BLOCK_SIZE, TOP_BLOCKS = 8, 2048
CANDIDATE_CTX, UNPACK_CTX = 32768, 8192  # decode contexts (tokens; ratio 1, so as many entries)
STREAMS, HIDDEN = 4, 5120
MIX = (2 + STREAMS) * STREAMS
NORM_EPS, HC_EPS, SINKHORN_ITERS = 1e-20, 1e-6, 20  # V4.1's rms_norm_eps is 1e-20 (sic)
PEER_BYTES = 1 << 30  # the candidate peers' working set per chunk of queries
ENGRAM_LAYER, MAX_NGRAM, ENGRAM_HEADS, ENGRAM_VOCAB, COMPRESSED_VOCAB = 1, 4, 8, 16_000_000, 99092


@dataclass(frozen=True)
class GraphCase(BenchCase):
    """Decode-sized: timed from a CUDA graph replay."""

    graph: bool = True


def _gen(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


def _values(shape: tuple, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=_gen(device))


# cache_round ---------------------------------------------------------------------------------------


def _round_setup(shape: tuple, fmt: str):
    def setup(device: torch.device) -> dict:
        return {"x": _values(shape, device), "fmt": fmt}

    return setup


def _round_kernel(s: dict):
    from deepinfer_cuda.kernels.cache_rounding import cache_round

    return cache_round(s["x"], fmt=s["fmt"])


def _round_peer(s: dict):
    from deepinfer.ops.cache_rounding import cache_round

    return cache_round(s["x"], fmt=s["fmt"])


def _round_bytes(s: dict) -> float:
    return 2.0 * s["x"].numel() * s["x"].element_size()


def _round_flops(s: dict) -> float:
    return 3.0 * s["x"].numel()


# cache_pack / cache_unpack -------------------------------------------------------------------------


def _pack_setup(tokens: int, channels: int, fmt: str):
    return _round_setup((tokens, channels), fmt)


def _pack_kernel(s: dict):
    from deepinfer_cuda.kernels.cache_storage import cache_pack

    return cache_pack(s["x"], fmt=s["fmt"])


def _pack_peer(s: dict):
    from deepinfer.ops.cache_storage import cache_pack

    return cache_pack(s["x"], fmt=s["fmt"])


def _pack_bytes(s: dict) -> float:
    x = s["x"]
    rows = x.numel() // x.shape[-1]
    return x.numel() * x.element_size() + rows * row_bytes(x.shape[-1], s["fmt"])


def _pack_flops(s: dict) -> float:
    return 2.0 * s["x"].numel()


def _unpack_setup(rows: int, channels: int, fmt: str):
    """`rows` stored rows of real values (packed by the reference), and the bf16 values to fill."""

    def setup(device: torch.device) -> dict:
        from deepinfer.ops.cache_storage import cache_pack

        return {
            "rows": cache_pack(_values((rows, channels), device), fmt=fmt),
            "out": torch.empty(rows, channels, device=device, dtype=torch.bfloat16),
            "fmt": fmt,
        }

    return setup


def _unpack_kernel(s: dict):
    from deepinfer_cuda.kernels.cache_storage import cache_unpack

    return cache_unpack(s["rows"], s["out"], fmt=s["fmt"])


def _unpack_peer(s: dict):
    from deepinfer.ops.cache_storage import cache_unpack

    return cache_unpack(s["rows"], s["out"], fmt=s["fmt"])


def _unpack_bytes(s: dict) -> float:
    return s["rows"].numel() + s["out"].numel() * s["out"].element_size()


def _unpack_flops(s: dict) -> float:
    return float(s["out"].numel())


# hc_pre_delayed ------------------------------------------------------------------------------------


def _hc_setup(tokens: int, hidden: int = HIDDEN):
    def setup(device: torch.device) -> dict:
        g = _gen(device)
        return {
            "x": torch.randn(tokens, STREAMS, hidden, device=device, dtype=torch.bfloat16, generator=g),
            "prev_pre": torch.softmax(torch.randn(tokens, STREAMS, device=device, generator=g), dim=-1),
            "fn": torch.randn(MIX, STREAMS * hidden, device=device, generator=g) * (STREAMS * hidden) ** -0.5,
            "base": 0.5 * torch.randn(MIX, device=device, generator=g),
            "scale": 1 + 0.2 * torch.randn(3, device=device, generator=g),
        }

    return setup


def _hc_args(s: dict) -> tuple:
    return s["x"], s["prev_pre"], s["fn"], s["base"], s["scale"]


_HC_KW = dict(norm_eps=NORM_EPS, hc_eps=HC_EPS, sinkhorn_iters=SINKHORN_ITERS)


def _hc_kernel(s: dict):
    from deepinfer_cuda.kernels.hyper_connection import hc_pre_delayed

    return hc_pre_delayed(*_hc_args(s), **_HC_KW)


def _hc_peer(s: dict):
    from deepinfer.ops.hyper_connection import hc_pre_delayed

    return hc_pre_delayed(*_hc_args(s), **_HC_KW)


def _hc_bytes(s: dict) -> float:
    x, (tokens, _, hidden) = s["x"], s["x"].shape
    params = (s["fn"].numel() + s["base"].numel() + s["scale"].numel()) * 4
    written = hidden * x.element_size() + (2 * STREAMS + STREAMS * STREAMS) * 4  # layer input, pre, post, comb
    return x.numel() * x.element_size() + params + tokens * (STREAMS * 4 + written)


def _hc_flops(s: dict) -> float:
    return 2.0 * s["x"].numel() * (MIX + 2)


# candidate_blocks / indexer_topk_in_blocks ---------------------------------------------------------


def _candidate_setup(batch: int, ctx: int, chunk: int = 1, top_blocks: int = TOP_BLOCKS, block_size: int = BLOCK_SIZE):
    """`batch` sequences of `ctx` keys (ratio 1), the last `chunk` positions' queries, and each query's
    candidate blocks: its newest block and random others among its visible ones, top_blocks in all."""

    def setup(device: torch.device) -> dict:
        g = _gen(device)
        tokens = batch * chunk
        pos = (ctx - chunk + torch.arange(chunk, device=device)).repeat(batch)
        visible = pos + 1
        n_blocks = -(-ctx // block_size)
        ids = torch.arange(n_blocks, device=device)
        newest = (visible - 1) // block_size
        pick = torch.rand(tokens, n_blocks, device=device, generator=g)
        pick = pick.masked_fill(ids[None, :] > newest[:, None], -1).masked_fill(ids[None, :] == newest[:, None], 2)
        ranked = pick.topk(min(top_blocks, n_blocks), dim=-1)
        blocks = torch.full((tokens, top_blocks), -1, dtype=torch.int32, device=device)
        blocks[:, : ranked.indices.shape[1]] = torch.where(ranked.values >= 0, ranked.indices, -1).to(torch.int32)
        return {
            "q": torch.randn(tokens, INDEX_HEADS, INDEX_DIM, device=device, dtype=torch.bfloat16, generator=g),
            "weights": torch.randn(tokens, INDEX_HEADS, device=device, generator=g) * (INDEX_HEADS * INDEX_DIM) ** -0.5,
            "index_keys": torch.randn(batch * ctx, INDEX_DIM, device=device, dtype=torch.bfloat16, generator=g),
            "entry_rows": torch.arange(batch * ctx, device=device, dtype=torch.int32).view(batch, ctx),
            "token_seq": torch.arange(batch, device=device, dtype=torch.int32).repeat_interleave(chunk),
            "num_visible": visible.to(torch.int32),
            "blocks": blocks,
            "block_size": block_size,
            "top_blocks": top_blocks,
        }

    return setup


def _index_args(s: dict) -> tuple:
    return s["q"], s["weights"], s["index_keys"], s["entry_rows"], s["token_seq"], s["num_visible"]


def _blocks_kernel(s: dict):
    from deepinfer_cuda.kernels.candidates import candidate_blocks

    return candidate_blocks(*_index_args(s), block_size=s["block_size"], top_blocks=s["top_blocks"])


def _in_query_chunks(op, s: dict, per_query_bytes: int, *per_query: torch.Tensor, **kw) -> torch.Tensor:
    """The reference op over chunks of queries whose float32 scores (and membership masks) stay under
    PEER_BYTES: each query's result is its own, so the chunks' concatenation is the whole call's."""
    step = max(1, PEER_BYTES // per_query_bytes)
    q, weights, keys, entry_rows, token_seq, num_visible = _index_args(s)
    return torch.cat([op(q[lo : lo + step], weights[lo : lo + step], keys, entry_rows, token_seq[lo : lo + step], num_visible[lo : lo + step],
                         *(t[lo : lo + step] for t in per_query), **kw)
                      for lo in range(0, q.shape[0], step)])  # fmt: skip


def _scores_bytes(s: dict) -> int:
    return 2 * INDEX_HEADS * s["entry_rows"].shape[1] * 4  # a query's per-head products and their relu


def _blocks_peer(s: dict):
    from deepinfer.ops.candidates import candidate_blocks

    return _in_query_chunks(candidate_blocks, s, _scores_bytes(s), block_size=s["block_size"], top_blocks=s["top_blocks"])


def _in_blocks_kernel(s: dict):
    from deepinfer_cuda.kernels.candidates import indexer_topk_in_blocks

    return indexer_topk_in_blocks(*_index_args(s), s["blocks"], top_k=TOP_K, block_size=s["block_size"])


def _in_blocks_peer(s: dict):
    from deepinfer.ops.candidates import indexer_topk_in_blocks

    per_query = max(_scores_bytes(s), s["top_blocks"] * s["entry_rows"].shape[1])  # or its [blocks, E] membership test
    return _in_query_chunks(indexer_topk_in_blocks, s, per_query, s["blocks"], top_k=TOP_K, block_size=s["block_size"])


def _query_bytes(s: dict, ids: int) -> int:
    q = s["q"]
    return q.shape[0] * (INDEX_HEADS * INDEX_DIM * q.element_size() + INDEX_HEADS * 4 + ids * 4 + 8)  # q, weights, ids, seq + visible


def _key_bytes(keys: int, s: dict) -> int:
    return keys * (INDEX_DIM * s["index_keys"].element_size() + 4)  # the key and its table entry


def _blocks_bytes(s: dict) -> float:
    # every key some query of its sequence sees, once: the newest query's visible count per sequence
    newest = s["num_visible"].view(s["entry_rows"].shape[0], -1)[:, -1]
    return _key_bytes(int(newest.sum()), s) + _query_bytes(s, s["top_blocks"])


def _blocks_flops(s: dict) -> float:
    return 2.0 * INDEX_HEADS * (INDEX_DIM + 1) * float(s["num_visible"].sum())


def _scored_per_query(s: dict) -> torch.Tensor:
    """[T] the visible keys inside each query's blocks."""
    size, blocks = s["block_size"], s["blocks"].long()
    first = blocks * size
    last = torch.minimum(first + size, s["num_visible"].long()[:, None])
    return torch.where(blocks >= 0, (last - first).clamp(min=0), 0).sum(-1)


def _in_blocks_bytes(s: dict) -> float:
    # the keys inside some query's blocks, once a sequence
    batch, n_blocks = s["entry_rows"].shape[0], -(-s["entry_rows"].shape[1] // s["block_size"])
    seq, blocks = s["token_seq"].long(), s["blocks"].long()
    used = torch.zeros(batch, n_blocks + 1, dtype=torch.bool, device=blocks.device)
    used[seq[:, None].expand_as(blocks), torch.where(blocks >= 0, blocks, n_blocks)] = True
    keys = int(used[:, :n_blocks].sum()) * s["block_size"]  # (a sequence's last block may be partly visible: counted whole)
    return _key_bytes(keys, s) + _query_bytes(s, TOP_K) + s["blocks"].numel() * 4


def _in_blocks_flops(s: dict) -> float:
    return 2.0 * INDEX_HEADS * (INDEX_DIM + 1) * float(_scored_per_query(s).sum())


# engram_hash / engram_gate_add ---------------------------------------------------------------------


def _hash_setup(tokens: int):
    def setup(device: torch.device) -> dict:
        from deepinfer.model.deepseek_v41.engram import hash_constants

        config = SimpleNamespace(engram_layer_ids=[ENGRAM_LAYER], engram_max_ngram_size=MAX_NGRAM, engram_n_heads=ENGRAM_HEADS,
                                 engram_vocab_size=ENGRAM_VOCAB)  # fmt: skip  # the fields hash_constants reads
        multipliers, primes, offsets = (t.to(device) for t in hash_constants(config, COMPRESSED_VOCAB)[0])
        ids = torch.randint(0, COMPRESSED_VOCAB, (tokens, MAX_NGRAM), device=device, generator=_gen(device))
        return {"ngram_ids": ids, "multipliers": multipliers, "primes": primes, "offsets": offsets}

    return setup


def _hash_args(s: dict) -> tuple:
    return s["ngram_ids"], s["multipliers"], s["primes"], s["offsets"]


def _hash_kernel(s: dict):
    from deepinfer_cuda.kernels.engram import engram_hash

    return engram_hash(*_hash_args(s))


def _hash_peer(s: dict):
    from deepinfer.ops.engram import engram_hash

    return engram_hash(*_hash_args(s))


def _hash_bytes(s: dict) -> float:
    constants = (s["multipliers"].numel() + s["primes"].numel() + s["offsets"].numel()) * 8
    return s["ngram_ids"].numel() * 8 + constants + s["ngram_ids"].shape[0] * s["primes"].numel() * 8


def _hash_flops(s: dict) -> float:
    return 0.0  # integer multiplies, xors and remainders only


def _gate_setup(tokens: int, hidden: int = HIDDEN):
    def setup(device: torch.device) -> dict:
        g = _gen(device)
        bf16 = dict(device=device, dtype=torch.bfloat16, generator=g)
        return {
            "streams": torch.randn(tokens, STREAMS, hidden, **bf16),
            "keys": torch.randn(tokens, STREAMS, hidden, **bf16),
            "value": torch.randn(tokens, hidden, **bf16),
            "q_weight": 1 + 0.1 * torch.randn(STREAMS, hidden, device=device, generator=g),
            "k_weight": 1 + 0.1 * torch.randn(STREAMS, hidden, device=device, generator=g),
        }

    return setup


def _gate_args(s: dict) -> tuple:
    return s["streams"], s["keys"], s["value"], s["q_weight"], s["k_weight"]


def _gate_kernel(s: dict):
    from deepinfer_cuda.kernels.engram import engram_gate_add

    return engram_gate_add(*_gate_args(s), eps=NORM_EPS)


def _gate_peer(s: dict):
    from deepinfer.ops.engram import engram_gate_add

    return engram_gate_add(*_gate_args(s), eps=NORM_EPS)


def _gate_bytes(s: dict) -> float:
    streams, value = s["streams"], s["value"]
    weights = (s["q_weight"].numel() + s["k_weight"].numel()) * 4
    return 3 * streams.numel() * streams.element_size() + value.numel() * value.element_size() + weights  # streams read and written, keys


def _gate_flops(s: dict) -> float:
    return 10.0 * s["streams"].numel()


ROUND = (_round_kernel, _round_peer, "torch reference (deepinfer.ops.cache_rounding)", _round_flops, _round_bytes)
PACK = (_pack_kernel, _pack_peer, "torch reference (deepinfer.ops.cache_storage)", _pack_flops, _pack_bytes)
UNPACK = (_unpack_kernel, _unpack_peer, "torch reference (deepinfer.ops.cache_storage)", _unpack_flops, _unpack_bytes)
HC = (_hc_kernel, _hc_peer, "torch reference (deepinfer.ops.hyper_connection)", _hc_flops, _hc_bytes)
BLOCKS = (_blocks_kernel, _blocks_peer, "torch reference (deepinfer.ops.candidates; a host sync per sequence)", _blocks_flops, _blocks_bytes)
IN_BLOCKS = (_in_blocks_kernel, _in_blocks_peer, "torch reference (deepinfer.ops.candidates; a host sync per sequence)", _in_blocks_flops,
             _in_blocks_bytes)  # fmt: skip
HASH = (_hash_kernel, _hash_peer, "torch reference (deepinfer.ops.engram)", _hash_flops, _hash_bytes)
GATE = (_gate_kernel, _gate_peer, "torch reference (deepinfer.ops.engram)", _gate_flops, _gate_bytes)

# (what the rows are, channels, format) of the caches a step writes and reads
WINDOW_ROWS, ENTRIES, INDEX_KEYS = ("window", HEAD_DIM, "fp8"), ("entries", HEAD_DIM, "nvfp4"), ("index_keys", INDEX_DIM, "mxfp4")


def _decode_and_prefill(op: str, label: str, setup, spec: tuple, **kw) -> list:
    """B = 1, 64, 256 graph-timed decode cases (a token each) and the prefill chunk: setup(tokens) builds each."""
    return [*[GraphCase(op, f"decode_B{b}_{label}", setup(b), *spec, **kw) for b in BATCHES],
            BenchCase(op, f"prefill_T{PREFILL}_{label}", setup(PREFILL), *spec, **kw)]  # fmt: skip


def _unpack_cases(what: str, channels: int, fmt: str) -> list:
    # decode: a sequence's window ring, or its whole history at UNPACK_CTX tokens; prefill: the rows it wrote
    per_seq = WINDOW if what == "window" else UNPACK_CTX
    ctx = "" if what == "window" else f"_ctx{UNPACK_CTX // 1024}k"
    return [*[GraphCase("cache_unpack", f"decode_B{b}{ctx}_{what}_R{b * per_seq}_D{channels}_{fmt}", _unpack_setup(b * per_seq, channels, fmt), *UNPACK)
              for b in BATCHES],
            BenchCase("cache_unpack", f"prefill_T{PREFILL}_{what}_D{channels}_{fmt}", _unpack_setup(PREFILL, channels, fmt), *UNPACK)]  # fmt: skip


CANDIDATE_LABEL = f"ctx{CANDIDATE_CTX // 1024}k_H{INDEX_HEADS}_D{INDEX_DIM}_bs{BLOCK_SIZE}"

CASES = [
    *_decode_and_prefill("cache_round", f"window_D{HEAD_DIM}_fp8", lambda t: _round_setup((t, HEAD_DIM), "fp8"), ROUND),
    *_decode_and_prefill("cache_round", f"index_q_H{INDEX_HEADS}_D{INDEX_DIM}_mxfp4", lambda t: _round_setup((t, INDEX_HEADS, INDEX_DIM), "mxfp4"), ROUND),
    *[case for what, channels, fmt in (WINDOW_ROWS, ENTRIES, INDEX_KEYS)
      for case in _decode_and_prefill("cache_pack", f"{what}_D{channels}_{fmt}", lambda t, c=channels, f=fmt: _pack_setup(t, c, f), PACK)],
    *[case for spec in (WINDOW_ROWS, ENTRIES, INDEX_KEYS) for case in _unpack_cases(*spec)],
    *_decode_and_prefill("hc_pre_delayed", f"N{STREAMS}_D{HIDDEN}_bf16", _hc_setup, HC),
    *[GraphCase("candidate_blocks", f"decode_B{b}_{CANDIDATE_LABEL}_top{TOP_BLOCKS}", _candidate_setup(b, CANDIDATE_CTX), *BLOCKS) for b in BATCHES],
    BenchCase("candidate_blocks", f"prefill_T{PREFILL}_H{INDEX_HEADS}_D{INDEX_DIM}_bs{BLOCK_SIZE}_top{TOP_BLOCKS}",
              _candidate_setup(1, PREFILL, PREFILL), *BLOCKS, bound="compute"),
    *[GraphCase("indexer_topk_in_blocks", f"decode_B{b}_{CANDIDATE_LABEL}_top{TOP_K}", _candidate_setup(b, CANDIDATE_CTX), *IN_BLOCKS) for b in BATCHES],
    BenchCase("indexer_topk_in_blocks", f"prefill_T{PREFILL}_H{INDEX_HEADS}_D{INDEX_DIM}_bs{BLOCK_SIZE}_top{TOP_K}",
              _candidate_setup(1, PREFILL, PREFILL), *IN_BLOCKS, bound="compute"),
    *_decode_and_prefill("engram_hash", f"M{MAX_NGRAM}_heads{(MAX_NGRAM - 1) * ENGRAM_HEADS}_int64", _hash_setup, HASH),
    *_decode_and_prefill("engram_gate_add", f"N{STREAMS}_D{HIDDEN}_bf16", _gate_setup, GATE),
]  # fmt: skip
