"""Cases for DeepSeek-V4.1's own ops: cache_round, cache_pack and cache_unpack (its three cache formats), hc_pre_delayed, candidate_blocks,
indexer_topk_in_blocks, engram_hash and engram_gate_add. Small shapes: each runs in seconds under the interpreter."""

from __future__ import annotations

from functools import partial

import torch

from deepinfer_conformance.cases import Case, randint, randn
from deepinfer_conformance.cases.v4 import hc_pre_inputs, indexer_topk_inputs

DTYPES = (torch.float32, torch.bfloat16)


def cache_round_inputs(gen, dtype, *, shape: tuple[int, ...], fmt: str, spread: float = 1.0):
    """Values whose groups span several binades (a per-channel magnitude of 2^U(-spread, spread)), some groups all zero."""
    x = randn(gen, *shape, dtype=torch.float64) * torch.exp2(spread * (2 * torch.rand(*shape, generator=gen, dtype=torch.float64) - 1))
    x[..., :1, : min(16, shape[-1])] = 0  # a zero group: the scale's floor
    return {"x": x.to(dtype), "fmt": fmt}


def cache_pack_inputs(gen, dtype, *, shape: tuple[int, ...], fmt: str, spread: float = 1.0):
    """cache_round's values, one of them -0.0 (its sign bit is stored)."""
    inputs = cache_round_inputs(gen, dtype, shape=shape, fmt=fmt, spread=spread)
    inputs["x"][..., -1:, 1] = -0.0
    return inputs


def cache_unpack_inputs(gen, dtype, *, shape: tuple[int, ...], fmt: str, spread: float = 1.0):
    """Rows the reference packed from cache_pack's values (every code and scale byte a quantiser writes), and
    the output to read them into."""
    from deepinfer.ops.cache_storage import cache_pack

    x = cache_pack_inputs(gen, torch.float32, shape=shape, fmt=fmt, spread=spread)["x"]
    return {"rows": cache_pack(x, fmt=fmt), "out": torch.zeros(shape, dtype=dtype), "fmt": fmt}


def hc_pre_delayed_inputs(gen, dtype, **kw):
    """hc_pre's inputs and a previous site's pre (sigmoid + eps: in (0, 1 + eps))."""
    inputs = hc_pre_inputs(gen, dtype, **kw)
    tokens, streams = inputs["x"].shape[:2]
    return {"x": inputs.pop("x"), "prev_pre": torch.sigmoid(randn(gen, tokens, streams)) + 1e-6, **inputs}


def candidate_inputs(gen, dtype, *, seqs, block_size: int, top_blocks: int, heads: int = 8, dim: int = 32, **weights):
    """Indexer inputs (ratio 1: one entry per token, as the release's candidate source; weights: indexer_topk_inputs'
    weights_dtype and scale_sign) and the block sizes."""
    inputs = indexer_topk_inputs(gen, dtype, seqs=seqs, top_k=1, ratio=1, heads=heads, dim=dim, **weights)
    inputs.pop("top_k")
    return {**inputs, "block_size": block_size, "top_blocks": top_blocks}


def in_blocks_inputs(gen, dtype, *, seqs, block_size: int, blocks: int, top_k: int, heads: int = 8, dim: int = 32, **weights):
    """Indexer inputs (weights: indexer_topk_inputs' weights_dtype and scale_sign) and each query's candidate blocks (random
    ids, -1 padding among them)."""
    inputs = indexer_topk_inputs(gen, dtype, seqs=seqs, top_k=top_k, ratio=1, heads=heads, dim=dim, **weights)
    width = inputs["entry_rows"].shape[1]
    ids = randint(gen, -1, -(-width // block_size), inputs["q"].shape[0], blocks, dtype=torch.int32)
    return {**inputs, "blocks": ids, "block_size": block_size}


# The release's layer-1 constants (v41.md section 7) and a small table's.
RELEASE_MULTIPLIERS = (76632096046245, 4839876093313, 35959672319349, 73987337458391)
RELEASE_PRIMES = ((16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183),
                  (16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321),
                  (16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463))  # fmt: skip


def engram_hash_inputs(gen, dtype, *, tokens: int, vocab: int, multipliers, primes):
    p = torch.tensor(primes, dtype=torch.int64)
    offsets = (p.flatten().cumsum(0) - p.flatten()).view(p.shape)
    ids = randint(gen, 0, vocab, tokens, len(multipliers))
    ids[0, 1:] = 2  # the first token: every lookback is the pad
    return {"ngram_ids": ids, "multipliers": torch.tensor(multipliers, dtype=torch.int64), "primes": p, "offsets": offsets}


def engram_gate_inputs(gen, dtype, *, tokens: int, streams: int = 4, dim: int, masked: bool = False):
    inputs = {
        "streams": randn(gen, tokens, streams, dim, dtype=dtype, scale=3.0),
        "keys": randn(gen, tokens, streams, dim, dtype=dtype),
        "value": randn(gen, tokens, dim, dtype=dtype),
        "q_weight": (1 + randn(gen, streams, dim, dtype=torch.float64, scale=0.1)).to(dtype),
        "k_weight": (1 + randn(gen, streams, dim, dtype=torch.float64, scale=0.1)).to(dtype),
        "eps": 1e-20,
    }
    inputs["keys"][0, 0] = inputs["streams"][0, 0]  # a stream that agrees with its key: a gate near 1
    if masked:
        inputs["token_mask"] = torch.arange(tokens) % 3 != 1
    return inputs


RECIPES = [
    ("cache_round", "fp8_t5_c64_wide_range", partial(cache_round_inputs, shape=(5, 64), fmt="fp8", spread=12.0)),
    ("cache_round", "nvfp4_t3_c40_partial_group", partial(cache_round_inputs, shape=(3, 40), fmt="nvfp4")),
    ("cache_round", "mxfp4_t4_h2_c32", partial(cache_round_inputs, shape=(4, 2, 32), fmt="mxfp4", spread=4.0)),
    ("cache_pack", "fp8_t3_c64_wide_range", partial(cache_pack_inputs, shape=(3, 64), fmt="fp8", spread=12.0)),
    ("cache_pack", "nvfp4_t3_c40_partial_group", partial(cache_pack_inputs, shape=(3, 40), fmt="nvfp4")),
    ("cache_pack", "mxfp4_t2_h2_c48_partial_group", partial(cache_pack_inputs, shape=(2, 2, 48), fmt="mxfp4", spread=4.0)),
    ("cache_unpack", "fp8_t3_c40_partial_group", partial(cache_unpack_inputs, shape=(3, 40), fmt="fp8", spread=12.0)),
    ("cache_unpack", "nvfp4_t3_c64", partial(cache_unpack_inputs, shape=(3, 64), fmt="nvfp4", spread=4.0)),
    ("cache_unpack", "mxfp4_t2_h2_c48_partial_group", partial(cache_unpack_inputs, shape=(2, 2, 48), fmt="mxfp4", spread=4.0)),
    ("hc_pre_delayed", "t5_n4_d32_sinkhorn20", partial(hc_pre_delayed_inputs, tokens=5, dim=32)),
    ("hc_pre_delayed", "t3_n4_d16_large_residual", partial(hc_pre_delayed_inputs, tokens=3, dim=16, x_scale=100.0, spread=0.1)),
    ("candidate_blocks", "b2_block8_top3", partial(candidate_inputs, seqs=[(24, 3), (10, 2)], block_size=8, top_blocks=3)),
    ("candidate_blocks", "b1_block3_top8_more_than_blocks", partial(candidate_inputs, seqs=[(5, 4)], block_size=3, top_blocks=8)),
    ("indexer_topk_in_blocks", "b2_block4_top6", partial(in_blocks_inputs, seqs=[(30, 3), (12, 2)], block_size=4, blocks=3, top_k=6)),
    ("indexer_topk_in_blocks", "b1_block2_top4_few_blocks", partial(in_blocks_inputs, seqs=[(20, 4)], block_size=2, blocks=1, top_k=4)),
    # The model's weights (weights_proj's bfloat16 output, the scales in weights_scale, negated: a ranking a kernel that
    # dropped the scale would not give), as indexer_topk's case of that name.
    ("candidate_blocks", "bf16_weights_negative_scale_b1_block4_top2",
     partial(candidate_inputs, seqs=[(14, 2)], block_size=4, top_blocks=2, heads=4, dim=16, weights_dtype=torch.bfloat16, scale_sign=-1.0)),
    ("indexer_topk_in_blocks", "bf16_weights_negative_scale_b1_block4_top3",
     partial(in_blocks_inputs, seqs=[(14, 2)], block_size=4, blocks=2, top_k=3, heads=4, dim=16, weights_dtype=torch.bfloat16, scale_sign=-1.0)),
    ("engram_gate_add", "t5_n4_d32", partial(engram_gate_inputs, tokens=5, dim=32)),
    ("engram_gate_add", "t6_n4_d16_masked", partial(engram_gate_inputs, tokens=6, dim=16, masked=True)),
]  # fmt: skip

HASHES = [
    ("engram_hash", "release_layer1_t9", partial(engram_hash_inputs, tokens=9, vocab=99092, multipliers=RELEASE_MULTIPLIERS, primes=RELEASE_PRIMES)),
    ("engram_hash", "small_m3_h2_t4", partial(engram_hash_inputs, tokens=4, vocab=181, multipliers=(7, 11, 13), primes=((23, 29), (31, 37)))),
]

CASES = [Case(op, name, dtype, make) for op, name, make in RECIPES for dtype in DTYPES] + [Case(op, name, torch.float32, make) for op, name, make in HASHES]
