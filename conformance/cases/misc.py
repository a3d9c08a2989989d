"""Cases for rms_norm, rope and silu_and_mul."""

from __future__ import annotations

from functools import partial

import torch

from deepinfer.ops.rope import rope_cos_sin_cache
from deepinfer_conformance.cases import Case, randint, randn

DTYPES = (torch.float32, torch.bfloat16)
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def rms_norm_inputs(gen, dtype, *, tokens: int, dim: int, residual: bool, scale: float = 1.0):
    kw = {
        "x": randn(gen, tokens, dim, dtype=dtype, scale=scale),
        "weight": (1 + randn(gen, dim, scale=0.1)).to(dtype),
        "eps": 1e-6,
    }
    if residual:
        kw["residual"] = randn(gen, tokens, dim, dtype=dtype, scale=scale)
    return kw


def rope_inputs(gen, dtype, *, tokens: int, heads: int, dim: int, interleaved: bool, scaling=None, max_pos: int = 256):
    return {
        "x": randn(gen, tokens, heads, dim, dtype=dtype),
        "positions": randint(gen, 0, max_pos, tokens),
        "cos_sin_cache": rope_cos_sin_cache(dim, max_pos, 10000.0, scaling),
        "interleaved": interleaved,
    }


def silu_inputs(gen, dtype, *, tokens: int, inter: int, scale: float = 1.0):
    return {"x": randn(gen, tokens, 2 * inter, dtype=dtype, scale=scale)}


RECIPES = [
    ("rms_norm", "t1_d7168", partial(rms_norm_inputs, tokens=1, dim=7168, residual=False)),
    ("rms_norm", "t9_d512_residual", partial(rms_norm_inputs, tokens=9, dim=512, residual=True)),
    ("rms_norm", "t5_d1536_large_range", partial(rms_norm_inputs, tokens=5, dim=1536, residual=True, scale=1e3)),
    ("rope", "t1_h1_d64_interleaved", partial(rope_inputs, tokens=1, heads=1, dim=64, interleaved=True)),
    ("rope", "t9_h16_d64_interleaved_yarn", partial(rope_inputs, tokens=9, heads=16, dim=64, interleaved=True, scaling=YARN)),
    ("rope", "t9_h4_d64_half", partial(rope_inputs, tokens=9, heads=4, dim=64, interleaved=False)),
    ("silu_and_mul", "t1_i2048", partial(silu_inputs, tokens=1, inter=2048)),
    ("silu_and_mul", "t9_i704_wide_range", partial(silu_inputs, tokens=9, inter=704, scale=20.0)),
]

CASES = [Case(op, name, dtype, make) for op, name, make in RECIPES for dtype in DTYPES]
