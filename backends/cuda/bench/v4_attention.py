"""Benchmarks of DeepSeek-V4's attention ops at V4-Flash sizes: sparse_attention, compress_kv, norm_rope_kv_write,
indexer_topk.

V4-Flash: 64 query heads of D = 512 (rope 64) over one shared KV row per token, window 128, CSA
layers (ratio 4, overlapping windows) whose indexer (64 heads of 128) picks the top 512 compressed
entries, HCA layers (ratio 128); caches paged in blocks of 64 tokens (16 CSA entries per block),
handed out in a shuffled order as a paged allocator leaves them; bf16 caches, and for a few
decode cases (`_fp8kv`) the FP8 cache (kv_cache_dtype="fp8": e4m3 rows with the token's float32
scale and padding inline, 528 bytes per 512-wide row, 144 per indexer key; deepinfer.ops.kv_cache_format).

sparse_attention (scale D^-1/2, one sink per head): decode, T = batch queries (one per sequence)
at the last position of a `ctx`-token context, each listing its window's 128 rows and 512 entries
the indexer could pick (random distinct ones among the ctx/4 of its sequence, ascending); a
prefill chunk, the last 4096 queries of a 32k context, each listing its window and 512 of the
entries visible at its position. Bytes: every distinct listed row (in its cache format) read once (decode: no two
queries share one; prefill: the chunk's window rows and pool rows are shared), q read, out
written, the id lists read. Flops: 4 * H * D per listed (query, row) pair (QK^T and PV). Decode
does 4 * 64 * 512 flops per 1 KiB row read, 128 flop/byte, under the H200's ~180 (matmul rate over
copy bandwidth): memory-bound; FP8 rows (528 bytes) nearly double that to 248 flop/byte, over the ridge:
those cases count as compute-bound, as does the prefill chunk, which reuses every row across
queries. An HCA layer's decode (`hca256_emax8192`): each query lists its window and all 256 entries
of a 32k context in an 8192-wide list (a device plan's E_max at max_model_len 1M), -1 after them and
`extra_lengths` = 256: what the padding costs (its ids are not read, not counted). The `_fp8kv_gluon` cases time the
same FP8 inputs through backend option sparse_attention_path=gluon's function (the SM90 Gluon kernel where it serves
the call, else the tl kernel). The `_bf16_gluon` cases time the bf16 inputs through the SM90 Gluon kernel over bf16
caches (sparse_attention_gluon.py, what sparse_attention_path=gluon runs for them), called directly: a call it does
not serve is an error row saying why, never the tl kernel timed again; `_r32` with its 32-row tiles in four stages,
`_late` with the FP8 kernel's stage release (the choices it leaves to a GPU's numbers). Peer: the
reference's arithmetic (float32 gather, FP8 rows dequantised, einsum, softmax with the sink) without
its host-side bounds check (so the decode peer is graph-timed like the kernel), in chunks of queries
whose float32 gathered rows stay under 1 GiB (at T = 4096 the whole gather would be 5.4 GB).

compress_kv (float32 projections, as the model passes them): decode, every one of 256 sequences
closes a window this step (CSA: the previous and current windows' 8 source rows of width 1024;
HCA: the window's 128 rows of width 512); prefill, the entries of the first 8192 tokens of a
sequence (CSA 2048 entries, HCA 64). Bytes: the kv and gate values each entry pools (entries x
slots x D, float32) read once, the position bias, the starts, the entries written. Flops: 5 per
pooled value (bias add, exp, weight multiply, two sums). Memory-bound. Peer: the reference op
(vectorised torch, no host synchronisation).

norm_rope_kv_write (the compressor's emission: compress_kv's float32 entries normed, their 64 rope
channels rotated, written to a CSA pool of 16 rows a block, rows shuffled): decode, one entry for 1
or 256 sequences, into a bf16 pool and (`fp8pool`) an FP8 one. Bytes: the entries (float32), the
norm weight, each entry's table row (64 float32), its position and pool row, the pool rows written
(in the pool's format). Flops: 4 per channel (square, sum, two scalings) and 3 more per rope channel.
Memory-bound (and launch-bound in a decode step: this op replaces rms_norm, rope, kv_cache_write and
two copies). Peer: the reference's arithmetic (float32 norm and rope, cast or quantised rows
scattered into the pool) without its host-side bounds check, so it is graph-timed like the kernel.

indexer_topk (bf16 queries and keys, float32 weights, top 512): decode, one query per sequence
for 1 or 64 sequences of 4k, 32k and 64k tokens (1024, 8192, 16384 keys each), and (`emax65536`)
32k-token sequences whose entry tables are 65536 wide (a device plan at max_model_len 256k: the
8192 visible keys are the work; the table's -1 columns are not counted); a prefill chunk, the
last 4096 queries of one 32k-token sequence and the last 8192 of a 64k one (each sees the keys complete at its
position; bf16 and FP8 keys) under the default prefill score schedule (multi_query), each also (`_query_loop`) under the
query loop, and a few of multi_query's sizes (`_multi_query_QN*_E*_s*`: queries per dot, entries per program, pipeline
stages) at 64k. Bytes:
each sequence's keys once, its entry table, the queries, weights and ids (the float32 score matrix
the kernel writes and reads back is the implementation's, not counted). Flops: 2 * H * (D + 1) per
(query, visible key): the dot products, relu and weighting. Decode: 64 flop/byte, memory-bound;
prefill: every key serves 4096 queries, compute-bound. Peer: the reference's arithmetic and tie rule
(`_top_ids_lowest_first`) vectorised over queries (the reference loops over sequences with host
synchronisations), in chunks whose [t, H, E] float32 products stay under 1 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.ops import kv_cache_format
from deepinfer_cuda.bench.common import BenchCase

OPS = ("sparse_attention", "compress_kv", "norm_rope_kv_write", "head_norm_rope", "indexer_topk")  # what this bench module covers: the runner finds it by this
TABLE_ORDER = 70  # where its rows sit in `deepinfer bench ops`: after the V3-shaped families

HEADS, DIM = 64, 512
WINDOW, CSA_RATIO, HCA_RATIO, TOP_K = 128, 4, 128, 512
INDEX_HEADS, INDEX_DIM = 64, 128
PAGE = 64  # tokens per KV block
SCALE = DIM**-0.5
FP8 = torch.float8_e4m3fn  # an FP8 KV cache (kv_cache_dtype="fp8"): e4m3 rows with the token's float32 scale inline
PEER_BYTES = 1 << 30  # the chunked peers' largest float32 intermediate


@dataclass(frozen=True)
class GraphCase(BenchCase):
    """Decode-sized: timed from a CUDA graph replay (the kernels are graph-safe; so are the peers)."""

    graph: bool = True


def _gen(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


def _paged_rows(entries: int, per_page: int, batch: int, g: torch.Generator, device: torch.device) -> tuple[torch.Tensor, int]:
    """[batch, entries] flat cache rows of each sequence's entries 0..entries-1, `per_page` per page,
    pages shuffled over the whole cache; and the cache's rows."""
    pages = -(-entries // per_page)
    order = torch.randperm(batch * pages, device=device, generator=g).view(batch, pages)
    e = torch.arange(entries, device=device)
    return order[:, e // per_page] * per_page + e % per_page, batch * pages * per_page


def _cache(rows: int, width: int, dtype: torch.dtype, g: torch.Generator, device: torch.device, chunk: int = 1 << 16) -> torch.Tensor:
    """[rows, width] N(0, 1) cache rows in `dtype`; an FP8 cache's rows quantised with their scales
    ([rows, width + 4], deepinfer.ops.kv_cache_format), `chunk` rows at a time."""
    if not kv_cache_format.is_fp8(dtype):
        return torch.randn(rows, width, device=device, dtype=dtype, generator=g)
    out = torch.empty(rows, kv_cache_format.row_width(width, dtype), device=device, dtype=dtype)
    for lo in range(0, rows, chunk):
        out[lo : lo + chunk] = kv_cache_format.quantize_rows(torch.randn(min(chunk, rows - lo), width, device=device, generator=g))
    return out


def _random_subset(visible: torch.Tensor, width: int, k: int, g: torch.Generator) -> torch.Tensor:
    """[T, k] ascending random distinct ids below visible[t] (of `width`), -1 where fewer are visible."""
    keys = torch.rand(visible.shape[0], width, device=visible.device, generator=g)
    keys = keys.masked_fill(torch.arange(width, device=visible.device)[None, :] >= visible[:, None], -1.0)
    top = keys.topk(min(k, width), dim=1)
    ids = torch.where(top.values >= 0, top.indices, width).sort(dim=1).values
    return torch.where(ids < width, ids, -1)


# ---------------------------------------------------------------------------------------------- sparse_attention


def _sparse_setup(batch: int, ctx: int, chunk: int = 1, kv_dtype: torch.dtype = torch.bfloat16):
    """`batch` sequences of `ctx` tokens; the last `chunk` tokens of each query (decode: chunk 1);
    caches of `kv_dtype` (bf16, or float8_e4m3fn: an FP8 cache's rows with their scales)."""

    def setup(device: torch.device) -> dict:
        g = _gen(device)
        tokens = batch * chunk
        pos = (ctx - chunk + torch.arange(chunk, device=device)).repeat(batch)  # [T] positions
        seq = torch.arange(batch, device=device).repeat_interleave(chunk)
        # Window rows: only the blocks the chunk's windows touch exist, each sequence's shuffled.
        first = max(0, ctx - chunk - WINDOW + 1)
        swa_rows, swa_size = _paged_rows(ctx - first + PAGE, PAGE, batch, g, device)  # rows of positions first.. (first // PAGE aligned)
        start = first // PAGE * PAGE
        win = pos[:, None] - WINDOW + 1 + torch.arange(WINDOW, device=device)[None, :]  # [T, 128] positions
        window = torch.where(win >= 0, swa_rows[seq[:, None], (win - start).clamp(min=0)], -1)
        # Compressed entries: ctx / 4 per sequence, 16 per block; each query lists 512 of those visible.
        entries = ctx // CSA_RATIO
        pool_rows, pool_size = _paged_rows(entries, PAGE // CSA_RATIO, batch, g, device)
        chosen = _random_subset((pos + 1) // CSA_RATIO, entries, TOP_K, g)
        extra = torch.where(chosen >= 0, pool_rows[seq[:, None], chosen.clamp(min=0)], -1)
        state = {
            "q": torch.randn(tokens, HEADS, DIM, device=device, dtype=torch.bfloat16, generator=g),
            "kv": _cache(swa_size, DIM, kv_dtype, g, device),
            "indices": window.to(torch.int32).contiguous(),
            "extra_kv": _cache(pool_size, DIM, kv_dtype, g, device),
            "extra_indices": extra.to(torch.int32).contiguous(),
            "sinks": torch.randn(HEADS, device=device, dtype=torch.float32, generator=g),
        }
        state["distinct_rows"] = sum(int(torch.unique(state[k][state[k] >= 0]).numel()) for k in ("indices", "extra_indices"))
        state["pairs"] = sum(int((state[k] >= 0).sum()) for k in ("indices", "extra_indices"))
        return state

    return setup


def _hca_setup(batch: int, ctx: int, emax: int, kv_dtype: torch.dtype = FP8):
    """A V4 decode step's HCA layer: `batch` sequences of `ctx` tokens, each query listing its window
    and every one of its ctx / 128 compressed entries, in a list as wide as the device plan makes it
    (E_max = `emax`: a max_model_len of 128 * emax), -1 after them, with extra_lengths."""

    def setup(device: torch.device) -> dict:
        state = _sparse_setup(batch, ctx, kv_dtype=kv_dtype)(device)
        g = _gen(device)
        entries = ctx // HCA_RATIO
        pool_rows, pool_size = _paged_rows(entries, 1, batch, g, device)  # one HCA entry per other block: rows of their own
        extra = torch.full((batch, emax), -1, dtype=torch.int32, device=device)
        extra[:, :entries] = pool_rows.to(torch.int32)
        state["extra_kv"] = _cache(pool_size, DIM, kv_dtype, g, device)
        state["extra_indices"] = extra
        state["extra_lengths"] = torch.full((batch,), entries, dtype=torch.int32, device=device)
        state["distinct_rows"] = sum(int(torch.unique(state[k][state[k] >= 0]).numel()) for k in ("indices", "extra_indices"))
        state["pairs"] = sum(int((state[k] >= 0).sum()) for k in ("indices", "extra_indices"))
        return state

    return setup


def _sparse_kernel(s: dict):
    from deepinfer_cuda.kernels.sparse_attention import sparse_attention

    return sparse_attention(s["q"], s["kv"], s["indices"], s["sinks"], softmax_scale=SCALE, extra_kv=s["extra_kv"], extra_indices=s["extra_indices"],
                            extra_lengths=s.get("extra_lengths"))  # fmt: skip


def _sparse_kernel_gluon(s: dict):
    """What backend option sparse_attention_path=gluon runs: the SM90 Gluon kernel of the cache's format where it serves
    the call, else the tl kernel."""
    from deepinfer_cuda.kernels.sparse_attention_path import sparse_attention

    return sparse_attention(s["q"], s["kv"], s["indices"], s["sinks"], softmax_scale=SCALE, extra_kv=s["extra_kv"], extra_indices=s["extra_indices"],
                            extra_lengths=s.get("extra_lengths"))  # fmt: skip


def _sparse_kernel_bf16_gluon(**launch):
    """One call of the SM90 Gluon kernel over bf16 caches with these launch arguments (launch_sparse_attention_gluon's:
    tile_rows, early_release, fused_combine, persistent, num_splits; absent: its defaults); an error where it does not
    serve the call."""

    def kernel(s: dict):
        from deepinfer_cuda.kernels import sparse_attention_gluon

        args = (s["q"], s["kv"], s["indices"], s["sinks"], SCALE, s["extra_kv"], s["extra_indices"], s.get("extra_lengths"))
        out = sparse_attention_gluon.launch_sparse_attention_gluon(*args, **launch)
        if out is None:
            why = sparse_attention_gluon.not_served(s["q"], s["kv"], s["indices"], s["extra_kv"], s["extra_indices"])
            raise RuntimeError(f"sparse_attention_gluon does not serve the call: {why}")
        return out

    return kernel


def _sparse_peer(s: dict) -> torch.Tensor:
    q, sinks = s["q"], s["sinks"]
    out = torch.empty_like(q)
    width = s["indices"].shape[1] + s["extra_indices"].shape[1]
    step = max(1, PEER_BYTES // (width * DIM * 4))
    for lo in range(0, q.shape[0], step):
        idx, xidx = s["indices"][lo : lo + step], s["extra_indices"][lo : lo + step]  # (-1 after each HCA list's length)
        rows = torch.cat([kv_cache_format.dequantize_rows(c[i.clamp(min=0).long()]) for c, i in ((s["kv"], idx), (s["extra_kv"], xidx))], dim=1)
        valid = torch.cat((idx >= 0, xidx >= 0), dim=1)
        scores = torch.einsum("thd,tkd->thk", q[lo : lo + step].float(), rows) * SCALE
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        sink = sinks[None, :, None].expand(scores.shape[0], -1, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        out[lo : lo + step] = torch.einsum("thk,tkd->thd", probs, rows).to(q.dtype)
    return out


def _sparse_bytes(s: dict) -> float:
    q = s["q"]
    lengths = s.get("extra_lengths")  # (the ids after a length are never read)
    lists = (s["indices"].numel() + (s["extra_indices"].numel() if lengths is None else int(lengths.sum()) + lengths.numel())) * 4
    row = s["kv"].shape[1] * s["kv"].element_size()  # 1024 bytes in bf16, 528 in fp8 (values, scale, padding)
    return s["distinct_rows"] * row + 2 * q.numel() * q.element_size() + lists + s["sinks"].numel() * 4


def _sparse_flops(s: dict) -> float:
    return 4.0 * HEADS * DIM * s["pairs"]


# ---------------------------------------------------------------------------------------------- compress_kv


def _compress_setup(ratio: int, overlap: bool, entries: int, decode: bool):
    """Decode: `entries` sequences, each closing one window from its own contiguous sources; prefill:
    the first `entries` windows of one sequence."""

    def setup(device: torch.device) -> dict:
        g = _gen(device)
        width = 2 * DIM if overlap else DIM
        e = torch.arange(entries, device=device)
        if decode:
            span = 2 * ratio if overlap else ratio  # history rows (the previous window with overlap) + the window
            rows, starts = entries * span, e * span + (ratio if overlap else 0)
            prev = starts - ratio if overlap else starts
        else:
            rows, starts = entries * ratio, e * ratio
            prev = torch.where(e > 0, starts - ratio, -1) if overlap else starts
        return {
            "kv": torch.randn(rows, width, device=device, generator=g),
            "gate": torch.randn(rows, width, device=device, generator=g),
            "position_bias": 0.5 * torch.randn(ratio, width, device=device, generator=g),
            "window_starts": starts.contiguous(),
            "prev_starts": prev.contiguous(),
            "ratio": ratio,
            "overlap": overlap,
        }

    return setup


def _compress_args(s: dict) -> tuple:
    return s["kv"], s["gate"], s["position_bias"], s["window_starts"], s["prev_starts"]


def _compress_kernel(s: dict):
    from deepinfer_cuda.kernels.compressor import compress_kv

    return compress_kv(*_compress_args(s), ratio=s["ratio"], overlap=s["overlap"])


def _compress_peer(s: dict):
    from deepinfer.ops.compressor import compress_kv

    return compress_kv(*_compress_args(s), ratio=s["ratio"], overlap=s["overlap"])


def _pooled(s: dict) -> int:
    """Values pooled: entries x slots x D."""
    slots = 2 * s["ratio"] if s["overlap"] else s["ratio"]
    return s["window_starts"].numel() * slots * DIM


def _compress_bytes(s: dict) -> float:
    entries = s["window_starts"].numel()
    starts = entries * 8 * (2 if s["overlap"] else 1)
    return 2 * _pooled(s) * 4 + s["position_bias"].numel() * 4 + starts + entries * DIM * s["kv"].element_size()


def _compress_flops(s: dict) -> float:
    return 5.0 * _pooled(s)


# ---------------------------------------------------------------------------------------------- norm_rope_kv_write

ROPE_DIM, NORM_EPS = 64, 1e-6


def _emit_setup(entries: int, kv_dtype: torch.dtype = torch.bfloat16):
    """`entries` closing windows' float32 entries, each to its own shuffled row of a CSA pool (16 rows a block)."""

    def setup(device: torch.device) -> dict:
        g = _gen(device)
        per_block = PAGE // CSA_RATIO
        rows = -(-entries // per_block) * per_block
        return {
            "x": torch.randn(entries, DIM, device=device, generator=g),
            "weight": 1 + 0.1 * torch.randn(DIM, device=device, generator=g),
            "positions": torch.randint(0, 32768, (entries,), device=device, generator=g),
            "table": torch.randn(32768, ROPE_DIM, device=device, generator=g),
            "pool": _cache(rows, DIM, kv_dtype, g, device).view(rows // per_block, per_block, -1),
            "slots": torch.randperm(rows, device=device, generator=g)[:entries],
        }

    return setup


def _emit_args(s: dict) -> tuple:
    return s["x"], s["weight"], s["positions"], s["table"], s["pool"], s["slots"]


def _emit_kernel(s: dict):
    from deepinfer_cuda.kernels.norm_rope_kv_write import norm_rope_kv_write

    return norm_rope_kv_write(*_emit_args(s), eps=NORM_EPS)


def _emit_peer(s: dict):
    from deepinfer.ops.rope import rope

    x, pool = s["x"], s["pool"]
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * s["weight"]
    rotated = rope(normed[:, None, DIM - ROPE_DIM :], s["positions"], s["table"], interleaved=True)[:, 0]
    rows = torch.cat((normed[:, : DIM - ROPE_DIM], rotated), dim=-1)
    rows = kv_cache_format.quantize_rows(rows) if kv_cache_format.is_fp8(pool) else rows.to(pool.dtype)
    pool.view(-1, pool.shape[-1]).view(torch.uint8).index_copy_(0, s["slots"], rows.view(torch.uint8))  # (bytes: no float8 index_copy)
    return pool


def _emit_bytes(s: dict) -> float:
    entries, pool = s["x"].shape[0], s["pool"]
    return entries * (DIM * 4 + ROPE_DIM * 4 + 8 + 8 + pool.shape[-1] * pool.element_size()) + DIM * 4


def _emit_flops(s: dict) -> float:
    return s["x"].shape[0] * (4.0 * DIM + 3.0 * ROPE_DIM)


# ---------------------------------------------------------------------------------------------- head_norm_rope

HEADS = 64  # V4-Flash's query heads


def _heads_setup(tokens: int):
    """q of `tokens` decode tokens: 64 heads of 512 channels (bf16), normed and their last 64 rotated in place."""

    def setup(device: torch.device) -> dict:
        g = _gen(device)
        return {
            "q": torch.randn(tokens, HEADS, DIM, device=device, generator=g).to(torch.bfloat16),
            "positions": torch.randint(0, 32768, (tokens,), device=device, generator=g),
            "table": torch.randn(32768, ROPE_DIM, device=device, generator=g),
        }

    return setup


def _heads_kernel(s: dict):
    from deepinfer_cuda.kernels.head_norm_rope import head_norm_rope

    return head_norm_rope(s["q"], s["positions"], s["table"], eps=NORM_EPS)


def _heads_peer(s: dict):
    """What the model ran before the op: rms_norm over the heads, rope on the tail, the tail copied back (torch)."""
    from deepinfer.ops.norm import rms_norm
    from deepinfer.ops.rope import rope

    q = s["q"]
    normed, _ = rms_norm(q.view(-1, DIM), torch.ones(DIM, device=q.device), eps=NORM_EPS)
    normed = normed.view(q.shape)
    normed[..., DIM - ROPE_DIM :].copy_(rope(normed[..., DIM - ROPE_DIM :], s["positions"], s["table"], interleaved=True))
    return normed


def _heads_bytes(s: dict) -> float:
    q = s["q"]
    return 2 * q.numel() * q.element_size() + q.shape[0] * (ROPE_DIM * 4 + 8)


def _heads_flops(s: dict) -> float:
    return s["q"].shape[0] * HEADS * (4.0 * DIM + 3.0 * ROPE_DIM)


# ---------------------------------------------------------------------------------------------- indexer_topk


def _indexer_setup(batch: int, ctx: int, chunk: int = 1, kv_dtype: torch.dtype = torch.bfloat16, emax: int | None = None):
    """`batch` sequences of `ctx` tokens (ctx / 4 keys each), the last `chunk` tokens' queries; with
    `emax`, entry tables as wide as a decode plan makes them (-1 after each sequence's keys)."""

    def setup(device: torch.device) -> dict:
        g = _gen(device)
        entries = ctx // CSA_RATIO
        rows, size = _paged_rows(entries, PAGE // CSA_RATIO, batch, g, device)
        if emax is not None:
            rows = torch.cat((rows, torch.full((batch, emax - entries), -1, dtype=rows.dtype, device=device)), dim=1)
        pos = (ctx - chunk + torch.arange(chunk, device=device)).repeat(batch)
        tokens = batch * chunk
        return {
            "q": torch.randn(tokens, INDEX_HEADS, INDEX_DIM, device=device, dtype=torch.bfloat16, generator=g),
            "weights": torch.randn(tokens, INDEX_HEADS, device=device, generator=g) * (INDEX_HEADS * INDEX_DIM) ** -0.5,
            "index_keys": _cache(size, INDEX_DIM, kv_dtype, g, device),
            "entry_rows": rows.to(torch.int32).contiguous(),
            "token_seq": torch.arange(batch, device=device, dtype=torch.int32).repeat_interleave(chunk),
            "num_visible": ((pos + 1) // CSA_RATIO).to(torch.int32),
        }

    return setup


def _indexer_args(s: dict) -> tuple:
    return s["q"], s["weights"], s["index_keys"], s["entry_rows"], s["token_seq"], s["num_visible"]


def _indexer_kernel(s: dict):
    from deepinfer_cuda.kernels.indexer import indexer_topk

    return indexer_topk(*_indexer_args(s), top_k=TOP_K)


def _indexer_schedule(schedule: str, multi_query: dict | None = None):
    """The kernel under the prefill score schedule `schedule` whatever PREFILL_SCHEDULE says ("multi_query" with
    MULTI_QUERY_GPU's sizes, `multi_query`'s where given): a default case's twin, on the same inputs."""

    def kernel(s: dict):
        from deepinfer_cuda.kernels.indexer import launch_indexer_topk

        return launch_indexer_topk(*_indexer_args(s), TOP_K, prefill_schedule=schedule, multi_query=multi_query)

    return kernel


def _indexer_peer(s: dict) -> torch.Tensor:
    from deepinfer.ops.indexer import _top_ids_lowest_first

    q, weights, keys, rows = s["q"], s["weights"], s["index_keys"], s["entry_rows"]
    tokens, heads, _ = q.shape
    rows = rows[:, : int(s["num_visible"].max())]  # (the columns past every query's visible entries score nothing)
    entries = rows.shape[1]
    scores = torch.empty(tokens, entries, device=q.device)
    shared = kv_cache_format.dequantize_rows(keys[rows[0].long()]) if rows.shape[0] == 1 else None  # one sequence: its keys once
    step = max(1, PEER_BYTES // (heads * entries * 4))
    for lo in range(0, tokens, step):
        qc = q[lo : lo + step].float()
        if shared is not None:
            logits = torch.einsum("thd,ed->the", qc, shared)
        else:
            logits = torch.einsum("thd,ted->the", qc, kv_cache_format.dequantize_rows(keys[rows[s["token_seq"][lo : lo + step].long()].long()]))
        scores[lo : lo + step] = (torch.relu(logits) * weights[lo : lo + step, :, None]).sum(dim=1)
    visible = torch.arange(entries, device=q.device)[None, :] < s["num_visible"].long()[:, None]
    out = torch.full((tokens, TOP_K), -1, dtype=torch.int32, device=q.device)
    ids = _top_ids_lowest_first(scores.masked_fill(~visible, float("-inf")), min(TOP_K, entries))
    out[:, : min(TOP_K, entries)] = torch.where(ids >= 0, rows.long()[s["token_seq"].long()[:, None], ids.clamp(min=0)], -1).to(torch.int32)
    return out


def _indexer_bytes(s: dict) -> float:
    tokens = s["q"].shape[0]
    # each sequence's keys (256 or 144 bytes) and their table entries once (not a wider table's -1 columns)
    keys = int((s["entry_rows"] >= 0).sum()) * (s["index_keys"].shape[1] * s["index_keys"].element_size() + 4)
    per_query = INDEX_HEADS * INDEX_DIM * s["q"].element_size() + INDEX_HEADS * 4 + TOP_K * 4 + 8  # q, weights, ids, seq + visible
    return keys + tokens * per_query


def _indexer_flops(s: dict) -> float:
    return 2.0 * INDEX_HEADS * (INDEX_DIM + 1) * float(s["num_visible"].sum())


SPARSE = (_sparse_kernel, _sparse_peer, "torch: the reference's float32 gather + einsum (no bounds check; chunks of <= 1 GiB)", _sparse_flops, _sparse_bytes)
COMPRESS = (_compress_kernel, _compress_peer, "torch reference (deepinfer.ops.compressor)", _compress_flops, _compress_bytes)
HEADS_NORM_ROPE = (_heads_kernel, _heads_peer, "torch: rms_norm over the heads, rope on the tail, the tail copied back (the model's earlier path)",
                   _heads_flops, _heads_bytes)  # fmt: skip
EMIT = (_emit_kernel, _emit_peer, "torch: the reference's float32 norm and rope, rows cast or quantised and scattered (no bounds check)", _emit_flops,
        _emit_bytes)  # fmt: skip
INDEXER = (_indexer_kernel, _indexer_peer, "torch: the reference's scores and tie rule, vectorised over queries", _indexer_flops, _indexer_bytes)

CASES = [
    *[GraphCase("sparse_attention", f"decode_B{b}_ctx{ctx // 1024}k_w128+top512_H64_D512_bf16", _sparse_setup(b, ctx), *SPARSE)
      for ctx in (4096, 32768) for b in (1, 64, 256)],
    *[GraphCase("sparse_attention", f"decode_B{b}_ctx32k_w128+top512_H64_D512_fp8kv", _sparse_setup(b, 32768, kv_dtype=FP8), *SPARSE, bound="compute")
      for b in (1, 64, 256)],
    # An HCA layer of a decode step served with max_model_len 1M: 256 visible entries in an 8192-wide list (extra_lengths)
    *[GraphCase("sparse_attention", f"decode_B{b}_ctx32k_w128+hca256_emax8192_H64_D512_fp8kv", _hca_setup(b, 32768, 8192), *SPARSE, bound="compute")
      for b in (1, 64)],
    # the same FP8 cases under sparse_attention_path=gluon (SM90: the warp-specialised Gluon kernel)
    *[GraphCase("sparse_attention", f"decode_B{b}_ctx32k_w128+top512_H64_D512_fp8kv_gluon", _sparse_setup(b, 32768, kv_dtype=FP8),
                _sparse_kernel_gluon, *SPARSE[1:], bound="compute") for b in (1, 64, 256)],
    GraphCase("sparse_attention", "decode_B64_ctx32k_w128+hca256_emax8192_H64_D512_fp8kv_gluon", _hca_setup(64, 32768, 8192), _sparse_kernel_gluon,
              *SPARSE[1:], bound="compute"),
    # the bf16 cases on the SM90 Gluon kernel over bf16 caches (timed on an H200, 2026-12-07), beside the tl rows above; its other
    # tile and stage release at B64 and B256
    *[GraphCase("sparse_attention", f"decode_B{b}_ctx32k_w128+top512_H64_D512_bf16_gluon", _sparse_setup(b, 32768), _sparse_kernel_bf16_gluon(),
                *SPARSE[1:]) for b in (1, 64, 256)],
    *[GraphCase("sparse_attention", f"decode_B{b}_ctx32k_w128+top512_H64_D512_bf16_gluon{suffix}", _sparse_setup(b, 32768),
                _sparse_kernel_bf16_gluon(**launch), *SPARSE[1:])
      for b in (64, 256) for suffix, launch in (("_r32", {"tile_rows": 32}), ("_late", {"early_release": False}))],
    BenchCase("sparse_attention", "prefill_T4096_ctx32k_w128+top512_H64_D512_bf16", _sparse_setup(1, 32768, 4096), *SPARSE, bound="compute"),
    GraphCase("compress_kv", "decode_B256_CSA_r4_overlap_D512_f32", _compress_setup(CSA_RATIO, True, 256, decode=True), *COMPRESS),
    GraphCase("compress_kv", "decode_B256_HCA_r128_D512_f32", _compress_setup(HCA_RATIO, False, 256, decode=True), *COMPRESS),
    BenchCase("compress_kv", "prefill_T8192_CSA_r4_overlap_D512_f32", _compress_setup(CSA_RATIO, True, 8192 // CSA_RATIO, decode=False), *COMPRESS),
    BenchCase("compress_kv", "prefill_T8192_HCA_r128_D512_f32", _compress_setup(HCA_RATIO, False, 8192 // HCA_RATIO, decode=False), *COMPRESS),
    *[GraphCase("norm_rope_kv_write", f"decode_B{b}_D512_r64_bf16", _emit_setup(b), *EMIT) for b in (1, 256)],
    GraphCase("norm_rope_kv_write", "decode_B256_D512_r64_fp8pool", _emit_setup(256, FP8), *EMIT),
    *[GraphCase("head_norm_rope", f"decode_B{b}_H64_D512_r64_bf16", _heads_setup(b), *HEADS_NORM_ROPE) for b in (1, 64, 256)],
    *[GraphCase("indexer_topk", f"decode_B64_ctx{ctx // 1024}k_H64_D128_top512_bf16", _indexer_setup(64, ctx), *INDEXER) for ctx in (4096, 32768, 65536)],
    *[GraphCase("indexer_topk", f"decode_B{b}_ctx32k_H64_D128_top512_fp8kv", _indexer_setup(b, 32768, kv_dtype=FP8), *INDEXER) for b in (1, 64)],
    GraphCase("indexer_topk", "decode_B1_ctx32k_H64_D128_top512_bf16", _indexer_setup(1, 32768), *INDEXER),
    # 8192 visible keys in a table as wide as max_model_len 256k makes it (65536 entries): the work is the visible keys'
    *[GraphCase("indexer_topk", f"decode_B{b}_ctx32k_emax65536_H64_D128_top512_fp8kv", _indexer_setup(b, 32768, kv_dtype=FP8, emax=65536), *INDEXER)
      for b in (1, 64)],
    # prefill chunks of one sequence (the last 4096 queries of 32k tokens, 8192 of 64k; bf16 and FP8 keys), each under the
    # default (PREFILL_SCHEDULE: multi_query) and (`_query_loop`) the query loop, on the same inputs
    *[BenchCase("indexer_topk", f"prefill_T{t}_ctx{ctx // 1024}k_H64_D128_top512_{kv}{twin}", _indexer_setup(1, ctx, t, kv_dtype=dtype), kernel,
                *INDEXER[1:], bound="compute")
      for t, ctx in ((4096, 32768), (8192, 65536)) for kv, dtype in (("bf16", torch.bfloat16), ("fp8kv", FP8))
      for twin, kernel in (("", _indexer_kernel), ("_query_loop", _indexer_schedule("query_loop")))],
    # a small sweep of the multi_query sizes (queries per dot, entries per program, pipeline stages) at the 64k prefill
    *[BenchCase("indexer_topk", f"prefill_T8192_ctx64k_H64_D128_top512_bf16_multi_query_QN{qn}_E{e}_s{st}", _indexer_setup(1, 65536, 8192),
                _indexer_schedule("multi_query", {"queries": qn, "block_e": e, "num_stages": st}), *INDEXER[1:], bound="compute")
      for qn, e, st in ((4, 128, 2), (2, 128, 3), (2, 128, 4), (4, 64, 3))],
]  # fmt: skip
