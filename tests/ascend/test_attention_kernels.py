"""The ascend backend's mla_decode, prefill and kv_cache_write Triton kernels against the op references
(and the FP8-cache paths of sparse_attention and indexer_topk's scoring kernel, beyond the golden set).

The kernels run under community Triton's interpreter (TRITON_INTERPRET=1, numpy on the CPU), once
per simulated chip (DEEPINFER_ASCEND_SIM_CHIP=910B: 24 AI / 48 vector cores, 192 KB buffer; 950:
32 / 64, 256 KB), so the persistent grids, the in-kernel item loops and the buffer-budgeted tile
choices of both chips are exercised. Triton reads TRITON_INTERPRET when it decorates a kernel, so
each chip's cases run in one subprocess (this file, run as a script) that prints a JSON verdict per
case; the pytest functions below look their case up in it.

Shapes stay small (latent 64 + rope 16 mostly); the golden set covers latent 512 + rope 64. The
cases reach what the golden set does not: paged block sizes 16/32/128, forced splits (the combine
kernel merging empty partials), the wide combine of small batches (one and two chunks of splits,
partial chunks, empty splits, column blocks past the latent width) and the serial one with as many
splits (forced, deterministic mode; the plan's choice by batch in the plan test), S = 1..4 with
windows 1/5/40, S*H rows beyond one head block, the C-chunked score path, widths that are not
powers of two, mixed q/cache dtypes, q_len 0 requests, more tokens than cores (the persistent loops
wrap), float32 -> bfloat16 cache writes, strided inputs, and FP8 caches
(deepinfer.ops.kv_cache_format): byte-exact writes of hard rows, mla_decode's four column parts
with latent widths that leave parts empty, forced splits and head blocks, and sparse_attention with
one FP8 and one model-dtype list in the same softmax; sparse_attention's extra_lengths (real rows
after each length, never read), indexer_topk's selection over rows wider than a chunk (ties of
+0.0 and -0.0 at the boundary, garbage past num_visible) and its scores from bfloat16 weights scaled in
the kernel (the model's float32 product, bit for bit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from deepinfer.ops import kv_cache_format

try:
    import triton as _triton
    import triton.language as _tl

    @_triton.jit
    def _probe_kernel(x_ptr):  # the smallest kernel: can this Triton compile for a CUDA target here?
        _tl.store(x_ptr, _tl.load(x_ptr) + 1)

except ImportError:  # (the tests skip without triton)
    _probe_kernel = None

CHIPS = ("910B", "950")
TOL = {torch.float32: (1.3e-6, 1e-6), torch.bfloat16: (1.6e-2, 1e-3), torch.float16: (1e-3, 1e-4)}


# ----------------------------------------------------------------------------------------------
# Cases (run inside the worker subprocess)
# ----------------------------------------------------------------------------------------------


def _close(out, ref, dtypes, length):
    rtol, atol = TOL[max(dtypes, key=lambda d: TOL[d][0])]
    assert torch.isfinite(out).all(), "non-finite output"
    err = (out.double() - ref).abs()
    bound = atol * max(length, 1) + rtol * ref.abs()
    assert (err <= bound).all(), f"max err {err.max():.3g}, worst err/bound {(err / bound).max():.3g}"


def _fp8_rows(gen, shape):
    """Rows of random values and magnitudes (0.1 .. 10 per row) in the FP8 format: the row scales matter."""
    rows = torch.randn(*shape, generator=gen) * 10.0 ** (2 * torch.rand(*shape[:-1], 1, generator=gen) - 1)
    return kv_cache_format.quantize_rows(rows)


def _mla_inputs(gen, dtype, *, seq_lens, queries, heads, latent=64, rope=16, page=16, q_dtype=None, spare=2, extra_cols=1, fp8=False):
    pages = [-(-n // page) for n in seq_lens]
    num_blocks = sum(pages) + spare  # spare pages hold values no request may read
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(pages) + extra_cols, dtype=torch.int32)  # padding columns: page 0
    start = 0
    for b, count in enumerate(pages):
        table[b, :count] = order[start : start + count]
        start += count
    q_dtype = q_dtype or dtype
    batch = len(seq_lens)
    return {
        "q_nope": torch.randn(batch, queries, heads, latent, generator=gen).to(q_dtype),
        "q_rope": torch.randn(batch, queries, heads, rope, generator=gen).to(q_dtype),
        "kv_cache": _fp8_rows(gen, (num_blocks, page, latent + rope)) if fp8 else torch.randn(num_blocks, page, latent + rope, generator=gen).to(dtype),
        "block_table": table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
    }


@contextmanager
def _combine_launches():
    """Records which combine kernels a launch_mla_decode call launches ("serial", "wide")."""
    from deepinfer_ascend.kernels import mla_decode as mla

    launched = []
    kernels = {"serial": "_mla_decode_combine_kernel", "wide": "_mla_decode_wide_combine_kernel"}

    class Recorder:
        def __init__(self, kind, kernel):
            self.kind, self.kernel = kind, kernel

        def __getitem__(self, grid):
            launched.append(self.kind)
            return self.kernel[grid]

    saved = {name: getattr(mla, name) for name in kernels.values()}
    try:
        for kind, name in kernels.items():
            setattr(mla, name, Recorder(kind, saved[name]))
        yield launched
    finally:
        for name, kernel in saved.items():
            setattr(mla, name, kernel)


def _check_mla(inputs, *, window=None, scale=0.125, wrapper=False, combine=None, **kernel_kw):
    """combine: the combine kernels the call must launch ([] for none, e.g. ["wide"]); None: unchecked."""
    from deepinfer.ops.attention import mla_decode as ref_mla_decode
    from deepinfer_ascend.kernels import mla_decode as mla

    args = (inputs["q_nope"], inputs["q_rope"], inputs["kv_cache"], inputs["block_table"], inputs["seq_lens"])
    with _combine_launches() as launched:
        if wrapper:
            out = mla.mla_decode(*args, softmax_scale=scale, sliding_window=window)
        else:
            out = mla.launch_mla_decode(*args, scale, window, **kernel_kw)
    assert combine is None or launched == combine, f"combine kernels launched: {launched}, expected {combine}"
    fp8 = kv_cache_format.is_fp8(inputs["kv_cache"])
    ref = ref_mla_decode(  # (an FP8 cache is dequantised by the reference, in float64 for float64 q)
        inputs["q_nope"].double(), inputs["q_rope"].double(), inputs["kv_cache"] if fp8 else inputs["kv_cache"].double(),
        inputs["block_table"], inputs["seq_lens"], softmax_scale=scale, sliding_window=window,
    )
    assert out.dtype == inputs["q_nope"].dtype and out.shape == inputs["q_nope"].shape
    dtypes = (inputs["q_nope"].dtype,) if fp8 else (inputs["q_nope"].dtype, inputs["kv_cache"].dtype)
    _close(out, ref, dtypes, int(inputs["seq_lens"].max()))
    return out


def _mla_case(dtype, seed, window=None, wrapper=False, kernel_kw=None, combine=None, **shape):
    return lambda: _check_mla(
        _mla_inputs(torch.Generator().manual_seed(seed), dtype, **shape), window=window, wrapper=wrapper, combine=combine, **(kernel_kw or {})
    )


def _mla_deterministic():
    from deepinfer_ascend.kernels import mla_decode as mla

    d = _mla_inputs(torch.Generator().manual_seed(5), torch.float32, seq_lens=[40, 90], queries=1, heads=4)
    args = (d["q_nope"], d["q_rope"], d["kv_cache"], d["block_table"], d["seq_lens"], 0.1)
    a = mla.launch_mla_decode(*args, num_splits=4, tiles={"BLOCK_N": 16})
    b = mla.launch_mla_decode(*args, num_splits=4, tiles={"BLOCK_N": 16})
    assert torch.equal(a, b)


def _mla_wide_against_serial():
    """The wide combine: the same bits run to run, and the serial combine's values (another order of
    the same sums); forcing it in deterministic mode is refused."""
    from deepinfer_ascend.kernels import mla_decode as mla

    d = _mla_inputs(torch.Generator().manual_seed(12), torch.float32, seq_lens=[620, 30, 333], queries=2, heads=3, latent=96)
    args = (d["q_nope"], d["q_rope"], d["kv_cache"], d["block_table"], d["seq_lens"], 0.1)
    kw = {"num_splits": 40, "tiles": {"BLOCK_N": 16}}
    with _combine_launches() as launched:
        a = mla.launch_mla_decode(*args, **kw)
        b = mla.launch_mla_decode(*args, **kw)
        serial = mla.launch_mla_decode(*args, **kw, wide_combine=False)
    assert launched == ["wide", "wide", "serial"], launched
    assert torch.equal(a, b)
    torch.testing.assert_close(a, serial, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="deterministic mode"):
        mla.launch_mla_decode(*args, **kw, invariant=True, wide_combine=True)


def _prefill_inputs(gen, dtype, *, q_lens, k_lens, heads, qk_dim, v_dim):
    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    return {
        "q": torch.randn(sum(q_lens), heads, qk_dim, generator=gen).to(dtype),
        "k": torch.randn(sum(k_lens), heads, qk_dim, generator=gen).to(dtype),
        "v": torch.randn(sum(k_lens), heads, v_dim, generator=gen).to(dtype),
        "cu_seqlens_q": cu(q_lens),
        "cu_seqlens_k": cu(k_lens),
    }


def _prefill_case(dtype, seed, *, window=None, tiles=None, wrapper=False, **shape):
    def run():
        from deepinfer.ops.attention import prefill as ref_prefill
        from deepinfer_ascend.kernels import prefill as pf

        d = _prefill_inputs(torch.Generator().manual_seed(seed), dtype, **shape)
        scale = shape["qk_dim"] ** -0.5
        args = (d["q"], d["k"], d["v"], d["cu_seqlens_q"], d["cu_seqlens_k"])
        if wrapper:
            out = pf.prefill(*args, softmax_scale=scale, sliding_window=window)
        else:
            out = pf.launch_prefill(*args, scale, window, tiles=tiles)
        ref = ref_prefill(*(x.double() for x in args[:3]), *args[3:], softmax_scale=scale, sliding_window=window)
        assert out.dtype == dtype and out.shape == ref.shape
        _close(out, ref, (dtype,), max(shape["k_lens"]))

    return run


def _kv_write_case(src_dtype, cache_dtype, *, page, blocks, tokens, skip, strided=False, latent=48, rope=16, seed=1, hard_rows=False):
    """hard_rows: token 0 all zeros (the amax floor), token 1 x 1e4, token 2 x 1e-3 with a 1e-6 rope
    part (e4m3 subnormals and zeros beside larger values)."""

    def run():
        from deepinfer.ops.attention import kv_cache_write as ref_kv_cache_write
        from deepinfer_ascend.kernels import kv_cache as kvw

        gen = torch.Generator().manual_seed(seed)
        slots = torch.randperm(blocks * page, generator=gen)[:tokens].to(torch.int64)
        slots[skip] = -1
        if strided:  # kv_c and k_pe as column slices of one projection output (row stride > width)
            fused = torch.randn(tokens, latent + rope + 8, generator=gen).to(src_dtype)
            kv_c, k_pe = fused[:, :latent], fused[:, latent : latent + rope]
        else:
            kv_c = torch.randn(tokens, latent, generator=gen).to(src_dtype)
            k_pe = torch.randn(tokens, rope, generator=gen).to(src_dtype)
        if hard_rows:
            kv_c[0], k_pe[0] = 0.0, 0.0
            kv_c[1] *= 1e4
            kv_c[2] *= 1e-3
            k_pe[2] *= 1e-6
        fp8 = kv_cache_format.is_fp8(cache_dtype)
        cache = _fp8_rows(gen, (blocks, page, latent + rope)) if fp8 else torch.randn(blocks, page, latent + rope, generator=gen).to(cache_dtype)
        want = ref_kv_cache_write(kv_c, k_pe, cache.clone(), slots)
        got = cache.clone()
        ret = kvw.kv_cache_write(kv_c, k_pe, got, slots)
        assert ret.data_ptr() == got.data_ptr()
        if fp8:  # bit-exact: the e4m3 bytes and the scale's 4 bytes of every row
            got, want = got.view(torch.uint8), want.view(torch.uint8)
        assert torch.equal(got, want), f"max diff {(got.double() - want.double()).abs().max():.3g}"

    return run


def _kv_write_past_cache():
    """A slot past the cache (the reference raises) is skipped, not written out of bounds."""
    from deepinfer_ascend.kernels import kv_cache as kvw

    cache = torch.randn(2, 16, 80)
    padded = torch.zeros(3, 16, 80)
    padded[:2] = cache
    view = padded[:2]  # the third page stands for the memory past the cache
    kv_c, k_pe = torch.randn(2, 64), torch.randn(2, 16)
    kvw.kv_cache_write(kv_c, k_pe, view, torch.tensor([32, 5], dtype=torch.int64))
    assert torch.equal(padded[2], torch.zeros(16, 80))
    assert torch.equal(padded[0, 5], torch.cat((kv_c[1], k_pe[1])))
    assert torch.equal(padded[1], cache[1]) and torch.equal(padded[0, 6:], cache[0, 6:])


def _sparse_fp8_case(dtype, seed, *, kv_fp8, extra_fp8, tokens=3, heads=5, dim=48, rows=40, width=20, extra_rows=12, extra_width=6, num_splits=None):
    """sparse_attention with either list's cache FP8 (or both), -1 padding, a token listing nothing."""

    def run():
        from deepinfer.ops.sparse_attention import sparse_attention as ref_sparse_attention
        from deepinfer_ascend.kernels import sparse_attention as sa

        gen = torch.Generator().manual_seed(seed)

        def cache(n, fp8):
            return _fp8_rows(gen, (n, dim)) if fp8 else torch.randn(n, dim, generator=gen).to(dtype)

        def ids(n, k):
            out = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32)
            out[:, ::3] = -1
            out[-1] = -1  # the last token lists no row of this list
            return out

        q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
        kv, xkv = cache(rows, kv_fp8), cache(extra_rows, extra_fp8)
        indices, extra_indices = ids(rows, width), ids(extra_rows, extra_width)
        extra_indices[-1, 0] = 1  # ... but one of the other list
        sinks = torch.randn(heads, generator=gen)
        scale = dim**-0.5
        out = sa.launch_sparse_attention(q, kv, indices, sinks, scale, xkv, extra_indices, num_splits=num_splits)
        ref = ref_sparse_attention(
            q.double(), kv if kv_fp8 else kv.double(), indices, sinks, softmax_scale=scale,
            extra_kv=xkv if extra_fp8 else xkv.double(), extra_indices=extra_indices,
        )
        assert out.dtype == dtype and out.shape == q.shape
        _close(out, ref, (dtype,), width + extra_width)

    return run


def _sparse_lengths_case(seed, *, num_splits):
    """sparse_attention with extra_lengths: real rows listed after each length (never read), a length of 0."""

    def run():
        from deepinfer.ops.sparse_attention import sparse_attention as ref_sparse_attention
        from deepinfer_ascend.kernels import sparse_attention as sa

        gen = torch.Generator().manual_seed(seed)
        heads, dim = 4, 32
        kv, xkv = torch.randn(60, dim, generator=gen), torch.randn(50, dim, generator=gen)
        indices = torch.stack([torch.randperm(60, generator=gen)[:20] for _ in range(3)]).to(torch.int32)
        extra = torch.randint(0, 50, (3, 40), generator=gen, dtype=torch.int32)
        lengths = torch.tensor([33, 0, 7], dtype=torch.int32)
        q, sinks = torch.randn(3, heads, dim, generator=gen), torch.randn(heads, generator=gen)
        out = sa.launch_sparse_attention(q, kv, indices, sinks, 0.2, xkv, extra, lengths, num_splits=num_splits)
        ref = ref_sparse_attention(q.double(), kv.double(), indices, sinks, softmax_scale=0.2, extra_kv=xkv.double(), extra_indices=extra,
                                   extra_lengths=lengths)  # fmt: skip
        _close(out, ref, (torch.float32,), 60)
        unread = ref_sparse_attention(q.double(), kv.double(), indices, sinks, softmax_scale=0.2, extra_kv=xkv.double(), extra_indices=extra)
        assert (unread - ref).abs().max() > 1e-3  # the rows past the lengths would change the answer

    return run


def _select_chunks_case(seed, *, width, top_k):
    """indexer_topk's selection over rows wider than a chunk (candidates, then their selection), with
    runs of equal scores (+0.0 and -0.0 alike) at the boundary and garbage past num_visible."""

    def run():
        from deepinfer.ops.indexer import _top_ids_lowest_first
        from deepinfer_ascend.kernels import indexer as ix

        gen = torch.Generator().manual_seed(seed)
        rows = 3
        values = torch.tensor([0.0, -0.0, 0.5, -0.5, 2.0])
        scores = values[torch.randint(0, 5, (rows, width), generator=gen)]
        scores[0, torch.randperm(width, generator=gen)[:3]] = 4.0  # three above, the rest of the top among the 2.0s
        scores[1] = torch.where(torch.rand(width, generator=gen) < 0.5, 0.0, -0.0)
        num_visible = torch.tensor([width, width - 5, top_k // 2], dtype=torch.int32)
        for r, nv in enumerate(num_visible.tolist()):
            scores[r, nv:] = float("nan")
        table = (torch.arange(width, dtype=torch.int32) * 3 + 7)[None, :].repeat(2, 1)
        table[1] += 1
        seq = torch.tensor([1, 0, 1], dtype=torch.int32)
        got = ix.select(scores, num_visible, top_k, table, seq, False)
        masked = scores.double().masked_fill(torch.arange(width)[None, :] >= num_visible.long()[:, None], float("-inf"))
        ids = _top_ids_lowest_first(masked, top_k)
        want = torch.where(ids >= 0, table.long()[seq.long()[:, None], ids.clamp(min=0)], -1).to(torch.int32)
        assert torch.equal(got, want), (got, want)

    return run


def _scaled_weights_case(dtype, seed):
    """indexer_topk's scores from bfloat16 weights (weights_proj's output) and weights_scale: the scores of the model's
    float32 product weights.float() * scale, bit for bit (so no selection, and no greedy token, moves)."""

    def run():
        from deepinfer_ascend.kernels import indexer as ix

        gen = torch.Generator().manual_seed(seed)
        heads, dim, pool, scale = 8, 32, 40, 8**-0.5 * 32**-0.5
        q = torch.randn(3, heads, dim, generator=gen).to(dtype)
        keys = torch.randn(pool, dim, generator=gen).to(dtype)
        weights = torch.randn(3, heads, generator=gen).to(torch.bfloat16)
        table = torch.randperm(pool, generator=gen)[:30].to(torch.int32).view(2, 15)
        seq, visible = torch.tensor([0, 1, 1], dtype=torch.int32), torch.tensor([15, 9, 12], dtype=torch.int32)
        got, _ = ix.score_entries(q, weights, keys, table, seq, visible, scale)
        want, _ = ix.score_entries(q, weights.float() * scale, keys, table, seq, visible)
        seen = torch.arange(15)[None, :] < visible[:, None]
        assert torch.equal(got[seen], want[seen]), (got[seen] - want[seen]).abs().max()

    return run


F32, BF16, FP8 = torch.float32, torch.bfloat16, torch.float8_e4m3fn

CASES = {
    # mla_decode: 5 requests around page edges (page 16), 3 forced splits -> empty partials in the combine
    "mla_pages16_splits3_f32": _mla_case(F32, 1, seq_lens=[1, 15, 16, 17, 40], queries=1, heads=4, kernel_kw={"num_splits": 3}),
    "mla_pages16_splits3_bf16": _mla_case(BF16, 2, seq_lens=[1, 15, 16, 17, 40], queries=1, heads=4, kernel_kw={"num_splits": 3}),
    # S = 4 MTP rows (12 rows padded to 16), page 32, window 5, two splits
    "mla_s4_window5_page32_bf16": _mla_case(BF16, 3, window=5, seq_lens=[4, 70], queries=4, heads=3, page=32, kernel_kw={"num_splits": 2}),
    "mla_s3_window1_f32": _mla_case(F32, 4, window=1, seq_lens=[3, 33, 64], queries=3, heads=2, page=16, kernel_kw={"num_splits": 2}),
    "mla_s2_window40_page128_f32": _mla_case(
        F32, 5, window=40, seq_lens=[2, 65, 200], queries=2, heads=4, page=128, kernel_kw={"tiles": {"BLOCK_N": 32}, "num_splits": 3}
    ),
    # S*H = 2*40 = 80 rows: head blocks of 64 (small latent fits), default plan
    "mla_rows80_head_blocks_f32": _mla_case(F32, 6, seq_lens=[17, 130], queries=2, heads=40, page=64),
    # C-chunked scores (the A2 float32 path at full width), with a non-power-of-two latent (48 of 64)
    "mla_q_chunked_latent48_bf16": _mla_case(
        BF16, 7, seq_lens=[5, 50], queries=2, heads=4, latent=48, page=16, kernel_kw={"tiles": {"Q_CHUNK": 32, "BLOCK_N": 16}, "num_splits": 2}
    ),
    "mla_q_chunked_f32": _mla_case(
        F32, 8, window=9, seq_lens=[33, 20], queries=1, heads=16, latent=64, page=32, kernel_kw={"tiles": {"Q_CHUNK": 16, "BLOCK_N": 32}}
    ),
    "mla_mixed_q_f32_cache_bf16": _mla_case(BF16, 9, seq_lens=[20, 64], queries=1, heads=4, q_dtype=F32, page=16),
    # DeepSeek-V3 widths in the Ascend block size (128), the registered wrapper's own plan
    "mla_full_width_page128_bf16": _mla_case(BF16, 10, wrapper=True, seq_lens=[129, 300], queries=2, heads=8, latent=512, rope=64, page=128),
    "mla_full_width_page128_f32": _mla_case(F32, 11, wrapper=True, seq_lens=[1, 140], queries=1, heads=16, latent=512, rope=64, page=128),
    "mla_deterministic": _mla_deterministic,
    # The wide combine (small batches, >= 8 splits): 40 splits = two chunks (32 + 8), the short
    # requests' splits empty; 12 splits (a chunk of 16, partly masked) of MTP rows with a window, a
    # latent of 160 (three column blocks, the last partly past it); the wrapper's own plan.
    "mla_wide_splits40_empty_f32": _mla_case(
        F32, 13, seq_lens=[5, 600, 1], queries=1, heads=4, kernel_kw={"num_splits": 40, "tiles": {"BLOCK_N": 16}}, combine=["wide"]
    ),
    "mla_wide_splits12_s2_window40_latent160_bf16": _mla_case(
        BF16, 14, window=40, seq_lens=[2, 300, 77], queries=2, heads=3, latent=160, page=32,
        kernel_kw={"num_splits": 12, "tiles": {"BLOCK_N": 16}}, combine=["wide"],
    ),  # fmt: skip
    "mla_wide_default_plan_bf16": _mla_case(BF16, 15, wrapper=True, seq_lens=[3000, 40], queries=1, heads=16, page=128, combine=["wide"]),
    "mla_wide_against_serial": _mla_wide_against_serial,
    # The serial combine with as many splits: forced, and in deterministic mode (empty splits skipped)
    "mla_serial_forced_splits40_f32": _mla_case(
        F32, 16, seq_lens=[5, 600, 1], queries=1, heads=4, kernel_kw={"num_splits": 40, "tiles": {"BLOCK_N": 16}, "wide_combine": False},
        combine=["serial"],
    ),  # fmt: skip
    "mla_serial_invariant_splits40_bf16": _mla_case(
        BF16, 17, seq_lens=[5, 600, 1], queries=1, heads=4, kernel_kw={"num_splits": 40, "tiles": {"BLOCK_N": 16}, "invariant": True},
        combine=["serial"],
    ),  # fmt: skip
    # FP8 cache: four latent parts (latent 64 -> parts of 32, two of them wholly masked), row scales
    # over 1e-2 .. 1e2, forced splits, MTP rows with a window, two head blocks, the full width
    "mla_fp8_pages16_splits3_f32": _mla_case(F32, 21, fp8=True, seq_lens=[1, 15, 16, 17, 40], queries=1, heads=4, kernel_kw={"num_splits": 3}),
    "mla_fp8_s4_window5_page32_bf16": _mla_case(
        BF16, 22, fp8=True, window=5, seq_lens=[4, 70], queries=4, heads=3, page=32, kernel_kw={"num_splits": 2}
    ),
    "mla_fp8_rows24_head_blocks_latent48_f32": _mla_case(
        F32, 23, fp8=True, seq_lens=[2, 50], queries=2, heads=12, latent=48, page=16, kernel_kw={"tiles": {"BLOCK_H": 16}}
    ),
    "mla_fp8_full_width_page128_bf16": _mla_case(BF16, 24, fp8=True, wrapper=True, seq_lens=[129, 300], queries=2, heads=8, latent=512, rope=64, page=128),
    # prefill: d 64/64, a request with no queries, more items than cores (persistent loop wraps)
    "prefill_d64_qlen0_f32": _prefill_case(F32, 1, q_lens=[1, 0, 17, 9], k_lens=[1, 5, 17, 30], heads=4, qk_dim=64, v_dim=64),
    "prefill_d64_bf16_wrapper": _prefill_case(BF16, 2, wrapper=True, q_lens=[20, 3], k_lens=[20, 50], heads=3, qk_dim=64, v_dim=64),
    # 192/128 with 16 x 16 tiles: many query blocks, mask-free interior blocks, window edges
    "prefill_192_128_tiles16_f32": _prefill_case(F32, 3, tiles=(16, 16), q_lens=[5, 33, 40], k_lens=[5, 70, 40], heads=2, qk_dim=192, v_dim=128),
    "prefill_192_128_window7_bf16": _prefill_case(BF16, 4, window=7, tiles=(16, 32), q_lens=[5, 33, 40], k_lens=[5, 70, 40], heads=2, qk_dim=192, v_dim=128),
    "prefill_window1_f32": _prefill_case(F32, 5, window=1, tiles=(32, 16), q_lens=[9, 40], k_lens=[20, 40], heads=1, qk_dim=64, v_dim=64),
    "prefill_window40_default_tiles_bf16": _prefill_case(BF16, 6, window=40, q_lens=[70, 2], k_lens=[100, 90], heads=2, qk_dim=192, v_dim=128),
    # widths that are not powers of two: Dqk 80 = 64 + 16, Dv 48 padded to 64
    "prefill_dqk80_dv48_f32": _prefill_case(F32, 7, tiles=(16, 16), q_lens=[7, 20], k_lens=[30, 20], heads=2, qk_dim=80, v_dim=48),
    # kv_cache_write: 60 tokens > 48/64 vector cores, page 16 and 128, padding slots, casts, strides
    "kv_write_f32_page16_many_tokens": _kv_write_case(F32, F32, page=16, blocks=6, tokens=70, skip=[0, 5, 69]),
    "kv_write_bf16_page128": _kv_write_case(BF16, BF16, page=128, blocks=2, tokens=9, skip=[2, 6]),
    "kv_write_f32_to_bf16_rne": _kv_write_case(F32, BF16, page=16, blocks=5, tokens=9, skip=[3]),
    "kv_write_strided_f32": _kv_write_case(F32, F32, page=32, blocks=3, tokens=5, skip=[2], strided=True, latent=64),
    "kv_write_all_skipped": _kv_write_case(BF16, BF16, page=16, blocks=2, tokens=4, skip=[0, 1, 2, 3]),
    "kv_write_past_cache_skipped": _kv_write_past_cache,
    "kv_write_fp8_hard_rows_from_f32_many_tokens": _kv_write_case(F32, FP8, page=16, blocks=6, tokens=70, skip=[5, 69], hard_rows=True),
    "kv_write_fp8_hard_rows_from_bf16_strided_page128": _kv_write_case(
        BF16, FP8, page=128, blocks=2, tokens=9, skip=[4], strided=True, latent=64, hard_rows=True
    ),
    # sparse_attention: FP8 window rows with model-dtype compressed rows and the converse, both FP8 split
    "sparse_bf16_fp8_kv_plain_extra": _sparse_fp8_case(BF16, 31, kv_fp8=True, extra_fp8=False),
    # extra_lengths: per-token split ranges (3 forced splits over 2..5 blocks), garbage after each length, a length of 0
    "sparse_f32_lengths_splits3": _sparse_lengths_case(35, num_splits=3),
    # indexer_topk's selection: 5000 scores a row, chunks of 2048 (both chips) -> 3 launches' worth of candidates
    "indexer_select_chunks_ties_past_visible": _select_chunks_case(36, width=5000, top_k=8),
    # indexer_topk's scores: bfloat16 weights converted and scaled in the kernel, as the model's float32 product
    "indexer_scores_bf16_weights_scaled_f32": _scaled_weights_case(F32, 37),
    "indexer_scores_bf16_weights_scaled_bf16": _scaled_weights_case(BF16, 38),
    "sparse_f32_plain_kv_fp8_extra_splits3": _sparse_fp8_case(F32, 32, kv_fp8=False, extra_fp8=True, num_splits=3),
    "sparse_f32_fp8_both_d64_h20": _sparse_fp8_case(F32, 33, kv_fp8=True, extra_fp8=True, dim=64, heads=20),
}


def _worker() -> None:
    """Run every case under the interpreter for the chip in the environment; print one JSON line."""
    import traceback

    results = {}
    for name, case in CASES.items():
        try:
            case()
            results[name] = "ok"
        except Exception as exc:  # report, do not stop: each case has its own pytest verdict
            results[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
    print("RESULTS " + json.dumps(results))


def _compile_variants():
    """(name, kernel, pointer types, constexprs): every constexpr branch of the three kernel files,
    and the FP8 branches of sparse_attention's and indexer_topk's scoring kernels."""
    from deepinfer_ascend.kernels import indexer as ix
    from deepinfer_ascend.kernels import kv_cache as kvw
    from deepinfer_ascend.kernels import mla_decode as mla
    from deepinfer_ascend.kernels import prefill as pf
    from deepinfer_ascend.kernels import sparse_attention as sa

    mla_ptrs = {n: "*bf16" for n in ("q_nope_ptr", "q_rope_ptr", "kv_ptr", "scale_ptr", "out_ptr")}
    mla_ptrs.update(block_table_ptr="*i32", seq_lens_ptr="*i32", part_out_ptr="*fp32", part_lse_ptr="*fp32")
    mla_base = dict(
        S=2, H=4, C=48, R=16, BLOCK_C=64, BLOCK_R=16, PAGE=32, BLOCK_H=16, BLOCK_N=16, DOT_F32=False, DOT_PRECISION=None, MANUAL_RNE=False, FP8=False
    )
    mla_fp8_ptrs = {**mla_ptrs, "kv_ptr": "*u8", "scale_ptr": "*fp32"}
    mla_fp8 = {**mla_base, "BLOCK_C": 128, "BLOCK_R": 32, "Q_CHUNK": 32, "FP8": True}
    pf_ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    pf_ptrs.update(cu_q_ptr="*i32", cu_k_ptr="*i32")
    pf_base = dict(H=2, D_QK=48, D_V=24, BLOCK_M=16, BLOCK_N=16, BLOCK_D1=32, BLOCK_D2=16, BLOCK_DV=32, DOT_F32=False, DOT_PRECISION=None, MANUAL_RNE=False)
    kv_ptrs = {"kv_c_ptr": "*bf16", "k_pe_ptr": "*bf16", "cache_ptr": "*bf16", "scale_ptr": "*bf16", "slot_ptr": "*i64"}
    kv_base = dict(C=48, R=16, BLOCK_C=64, BLOCK_R=16, PAGE=128, MANUAL_RNE=False, FP8=False)
    kv_fp8_ptrs = {**kv_ptrs, "cache_ptr": "*u8", "scale_ptr": "*fp32"}
    sa_ptrs = {n: "*bf16" for n in ("q_ptr", "kv_ptr", "kv_scale_ptr", "xkv_ptr", "xkv_scale_ptr", "out_ptr")}
    sa_ptrs.update(idx_ptr="*i32", xidx_ptr="*i32", xlen_ptr="*i32", sinks_ptr="*fp32", part_out_ptr="*fp32", part_lse_ptr="*fp32", opos_ptr="*i64",
                   ocs_ptr="*fp32")  # fmt: skip
    sa_base = dict(H=8, D=48, HEAD_BLOCKS=1, BLOCK_H=16, BLOCK_N=16, BLOCK_D=64, Q_CHUNK=0, HAS_EXTRA=True, HAS_LENGTHS=False, DIRECT=True, DOT_F32=False,
                   DOT_PRECISION=None)  # fmt: skip
    sa_base.update(IDX64=False, FP8=False, XFP8=False, PARTS=False, ROPE=False, R=16)
    sa_fp8 = {**sa_base, "BLOCK_D": 128, "Q_CHUNK": 32, "PARTS": True}
    sa_fp8_kv_ptrs = {**sa_ptrs, "kv_ptr": "*u8", "kv_scale_ptr": "*fp32"}
    sa_fp8_both_ptrs = {**sa_fp8_kv_ptrs, "xkv_ptr": "*u8", "xkv_scale_ptr": "*fp32"}
    ix_ptrs = {"q_ptr": "*bf16", "w_ptr": "*bf16", "keys_ptr": "*bf16", "key_scale_ptr": "*bf16", "rows_ptr": "*i32", "seq_ptr": "*i32", "nv_ptr": "*i32"}
    ix_ptrs.update(scores_ptr="*fp32")
    ix_base = dict(BLOCK_H=16, BLOCK_D=32, BLOCK_E=32, DOT_F32=False, DOT_PRECISION=None, IDX64=False, FP8=False)
    ix_fp8_ptrs = {**ix_ptrs, "keys_ptr": "*u8", "key_scale_ptr": "*fp32"}
    sel_ptrs = {"src_ptr": "*fp32", "src_ids_ptr": "*fp32", "nv_ptr": "*i32", "dst_ptr": "*i32", "dst_ids_ptr": "*i32", "rows_ptr": "*i32",
                "seq_ptr": "*i32"}  # fmt: skip
    sel_base = dict(CHUNK=64, BLOCK_K=16, IDX64=False, ROWS=True)
    split = mla._mla_decode_split_kernel
    combine_ptrs = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16"}
    return [
        ("mla_resident_direct", split, mla_ptrs, {**mla_base, "Q_CHUNK": 0, "HAS_WINDOW": False, "DIRECT": True, "IDX64": False}),
        ("mla_resident_split_window_idx64", split, mla_ptrs, {**mla_base, "Q_CHUNK": 0, "HAS_WINDOW": True, "DIRECT": False, "IDX64": True}),
        ("mla_q_chunked_split_window", split, mla_ptrs, {**mla_base, "Q_CHUNK": 32, "HAS_WINDOW": True, "DIRECT": False, "IDX64": False}),
        ("mla_fp8_direct", split, mla_fp8_ptrs, {**mla_fp8, "HAS_WINDOW": False, "DIRECT": True, "IDX64": False}),
        ("mla_fp8_split_window_idx64", split, mla_fp8_ptrs, {**mla_fp8, "HAS_WINDOW": True, "DIRECT": False, "IDX64": True}),
        ("mla_combine", mla._mla_decode_combine_kernel, combine_ptrs, dict(ROWS=8, C=48, BLOCK_M=16, BLOCK_C=64, MANUAL_RNE=False)),
        # deterministic mode's variants: splits of at least 4 tiles, a combine that skips empty splits
        ("mla_invariant_split", split, mla_ptrs, {**mla_base, "Q_CHUNK": 0, "HAS_WINDOW": False, "DIRECT": False, "IDX64": False, "MIN_SPLIT_TILES": 4}),
        ("mla_combine_skip_empty", mla._mla_decode_combine_kernel, combine_ptrs,
         dict(ROWS=8, C=48, BLOCK_M=16, BLOCK_C=64, MANUAL_RNE=False, SKIP_EMPTY=True)),
        ("mla_wide_combine", mla._mla_decode_wide_combine_kernel, combine_ptrs, dict(C=48, CHUNK=32, BLOCK_CC=64, MANUAL_RNE=False)),
        ("mla_wide_combine_rne", mla._mla_decode_wide_combine_kernel, combine_ptrs, dict(C=160, CHUNK=16, BLOCK_CC=64, MANUAL_RNE=True)),
        ("prefill", pf._prefill_kernel, pf_ptrs, {**pf_base, "HAS_WINDOW": False, "IDX64": False}),
        ("prefill_window_idx64", pf._prefill_kernel, pf_ptrs, {**pf_base, "HAS_WINDOW": True, "IDX64": True}),
        ("prefill_one_dot", pf._prefill_kernel, pf_ptrs, {**pf_base, "D_QK": 32, "BLOCK_D2": 0, "HAS_WINDOW": True, "IDX64": False}),
        ("prefill_mask_all", pf._prefill_kernel, pf_ptrs, {**pf_base, "HAS_WINDOW": False, "IDX64": False, "MASK_ALL": True}),
        ("kv_write", kvw._kv_cache_write_kernel, kv_ptrs, {**kv_base, "IDX64": False}),
        ("kv_write_idx64", kvw._kv_cache_write_kernel, kv_ptrs, {**kv_base, "IDX64": True}),
        ("kv_write_fp8", kvw._kv_cache_write_kernel, kv_fp8_ptrs, {**kv_base, "BLOCK_R": 32, "IDX64": False, "FP8": True}),
        ("kv_write_fp8_idx64", kvw._kv_cache_write_kernel, kv_fp8_ptrs, {**kv_base, "BLOCK_R": 32, "IDX64": True, "FP8": True}),
        ("sparse_resident", sa._sparse_attention_kernel, sa_ptrs, sa_base),
        ("sparse_fp8_kv_plain_extra_split", sa._sparse_attention_kernel, sa_fp8_kv_ptrs, {**sa_fp8, "FP8": True, "DIRECT": False}),
        ("sparse_lengths_split", sa._sparse_attention_kernel, sa_ptrs, {**sa_base, "HAS_LENGTHS": True, "DIRECT": False}),
        ("sparse_fp8_lengths_split", sa._sparse_attention_kernel, sa_fp8_both_ptrs,
         {**sa_fp8, "FP8": True, "XFP8": True, "HAS_LENGTHS": True, "DIRECT": False}),
        ("sparse_fp8_both_idx64", sa._sparse_attention_kernel, sa_fp8_both_ptrs, {**sa_fp8, "FP8": True, "XFP8": True, "IDX64": True}),
        # the output's rope channels rotated back where it is written: in one split, and by the parts' merge
        ("sparse_rope_direct", sa._sparse_attention_kernel, sa_ptrs, {**sa_base, "ROPE": True}),
        ("sparse_fp8_rope_parts", sa._sparse_attention_kernel, sa_fp8_both_ptrs, {**sa_fp8, "FP8": True, "XFP8": True, "ROPE": True}),
        ("indexer_scores", ix._indexer_scores_kernel, ix_ptrs, ix_base),
        ("indexer_scores_fp8_idx64", ix._indexer_scores_kernel, ix_fp8_ptrs, {**ix_base, "FP8": True, "IDX64": True}),
        ("indexer_select_one_launch", ix._indexer_select_kernel, sel_ptrs, {**sel_base, "FIRST": True, "LAST": True}),
        ("indexer_select_chunk_candidates_idx64", ix._indexer_select_kernel, sel_ptrs, {**sel_base, "FIRST": True, "LAST": False, "IDX64": True}),
        ("indexer_select_over_candidates", ix._indexer_select_kernel, {**sel_ptrs, "src_ptr": "*i32", "src_ids_ptr": "*i32"},
         {**sel_base, "FIRST": False, "LAST": True}),
        ("indexer_select_ids", ix._indexer_select_kernel, sel_ptrs, {**sel_base, "FIRST": True, "LAST": True, "ROWS": False}),
    ]


def _compile_worker() -> None:
    """Build every kernel variant's TTIR with community Triton's real front end (a CUDA target, no
    GPU needed): it checks what the interpreter does not, e.g. that a value keeps its type across a
    data-dependent `if` or loop. The front end is where those errors are raised; the backend passes
    after it (to PTX and ptxas, for a GPU these kernels never run on) took most of this check's
    half-minute and are not run. Prints one JSON line: variant -> "ok" | error | "skip: ...".
    """
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)

    def build(fn, ptrs, constexprs):
        backend = make_backend(target)
        options = backend.parse_options({})
        signature = {n: "constexpr" if n in constexprs else ptrs.get(n, "fp32" if "scale" in n else "i32") for n in fn.arg_names}
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)

    try:
        build(_probe_kernel, {"x_ptr": "*fp32"}, {})
    except Exception as exc:  # no CUDA backend / ptxas in this Triton install: nothing to check with
        print("RESULTS " + json.dumps({name: f"skip: {type(exc).__name__}" for name, *_ in _compile_variants()}))
        return
    results = {}
    for name, fn, ptrs, constexprs in _compile_variants():
        try:
            build(fn, ptrs, constexprs)
            results[name] = "ok"
        except Exception as exc:
            results[name] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    print("RESULTS " + json.dumps(results))


# ----------------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------------


WORKERS = {chip: ("--worker", {"TRITON_INTERPRET": "1", "DEEPINFER_ASCEND_SIM_CHIP": chip}) for chip in CHIPS}
WORKERS["compile"] = ("--compile", {})


@lru_cache(maxsize=None)
def _results() -> dict:
    """Start every worker at once (they are independent; the wall time is the slowest one's), then
    collect each one's JSON line: {"910B": {...}, "950": {...}, "compile": {...}}."""
    from waits import HANG_S  # (here, not at the top: the script side runs without tests/ on its path)

    root = Path(__file__).resolve().parents[2]
    procs = {}
    for key, (mode, env_vars) in WORKERS.items():
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(env_vars)
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        procs[key] = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), mode], env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    results = {}
    for key, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        line = next((l for l in out.splitlines() if l.startswith("RESULTS ")), None)
        if line is None:
            results[key] = f"the {key} worker printed no results (exit {proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}"
        else:
            results[key] = json.loads(line[len("RESULTS "):])
    return results


def _worker_results(key: str) -> dict:
    got = _results()[key]
    if isinstance(got, str):
        raise AssertionError(got)
    return got


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("chip", CHIPS)
def test_kernel_case(chip, case):
    verdict = _worker_results(chip)[case]
    assert verdict == "ok", verdict


def test_kernels_compile_with_the_triton_frontend():
    results = _worker_results("compile")
    if all(v.startswith("skip: ") for v in results.values()):
        pytest.fail(f"this Triton cannot compile for a CUDA target ({next(iter(results.values()))}); the test extra's triton can")
    failed = {k: v for k, v in results.items() if v != "ok"}
    assert not failed, failed


def test_registrations_match_the_ops_and_yield_to_the_npu_path(monkeypatch):
    from deepinfer.registry import OPS, Registry, ResolveContext, all_ops, check_signature
    from deepinfer_ascend.kernels import kv_cache, mla_decode, prefill

    all_ops()
    regs = [*kv_cache.REGISTRATIONS, *mla_decode.REGISTRATIONS, *prefill.REGISTRATIONS]
    assert sorted({r.op for r in regs}) == ["kv_cache_write", "mla_decode", "prefill"]
    registry = Registry()
    registry.register_all("ascend", regs)
    ctx = ResolveContext(backend="ascend", options={"npu_fast_paths": "all"})
    for r in regs:
        check_signature(OPS[r.op], r.fn, "ascend")
        assert r.note.startswith("Triton (ascend)")
        # The Triton kernels serve whatever the torch_npu fast paths (higher priority) do not.
        assert r.when is None and registry.pick(ctx, r.op) is not None


@pytest.mark.parametrize("chip", CHIPS)
def test_tile_plans_fit_half_the_buffer(chip, monkeypatch):
    """Every planned block fits half the chip's unified buffer; BLOCK_N divides the page; the split
    count depends on shapes only and stays within the capacity's tiles."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("DEEPINFER_ASCEND_SIM_CHIP", chip)
    from deepinfer_ascend.device import current
    from deepinfer_ascend.kernels import indexer, mla_decode, prefill, sparse_attention

    half = current().ub_bytes // 2
    for page in (16, 64, 128, 256):
        for rows in (1, 16, 48, 128, 512):
            for e_dot in (2, 4):
                cfg = mla_decode.plan(4, rows, page, 32 * page, 512, 64, e_dot)
                assert cfg["bytes"] <= half and page % cfg["BLOCK_N"] == 0 and cfg["BLOCK_N"] >= 16
                assert 1 <= cfg["num_splits"] <= -(-32 * page // cfg["BLOCK_N"])
                assert cfg["head_blocks"] * cfg["BLOCK_H"] >= rows
    # The brief's example: bf16 16 heads, DeepSeek widths, Ascend page 128.
    cfg = mla_decode.plan(1, 16, 128, 4096, 512, 64, 2)
    assert (cfg["BLOCK_H"], cfg["Q_CHUNK"]) == (16, 0) and cfg["BLOCK_N"] == (64 if chip == "950" else 32)
    assert cfg["num_splits"] > 1  # one request cannot fill the AI cores alone
    assert mla_decode.plan(1, 16, 128, 4096, 512, 64, 4)["Q_CHUNK"] == (0 if chip == "950" else 128)
    assert mla_decode.plan(current().num_aicore, 16, 128, 4096, 512, 64, 2)["num_splits"] == 1
    # The wide combine: fewer serial-combine items (batch x 16-row blocks) than vector cores, >= 8
    # splits, never in deterministic mode; from the shapes alone.
    cores = current().num_vectorcore
    assert cfg["num_splits"] >= mla_decode.WIDE_MIN_SPLITS and cfg["wide_combine"]
    assert mla_decode.plan(1, 128, 128, 4096, 512, 64, 2, num_splits=8)["wide_combine"]  # 8 row blocks
    assert not mla_decode.plan(cores, 16, 128, 4096, 512, 64, 2, num_splits=8)["wide_combine"]
    assert not mla_decode.plan(cores // 8, 128, 128, 4096, 512, 64, 2, num_splits=8)["wide_combine"]
    assert not mla_decode.plan(1, 16, 128, 4096, 512, 64, 2, num_splits=mla_decode.WIDE_MIN_SPLITS - 1)["wide_combine"]
    assert not mla_decode.plan(1, 16, 128, 4096, 512, 64, 2, invariant=True)["wide_combine"]
    # FP8 caches with bf16 activations (the decode temporaries counted): four latent parts of 128
    for page in (16, 64, 128):
        for rows in (1, 16, 48, 128):
            cfg = mla_decode.plan(4, rows, page, 32 * page, 512, 64, 2, fp8=True)
            assert cfg["bytes"] <= half and page % cfg["BLOCK_N"] == 0 and cfg["Q_CHUNK"] * mla_decode.FP8_PARTS == cfg["BLOCK_C"] == 512
    cfg = sparse_attention.plan(1, 64, 512, 128, 512, 2, fp8=True)
    assert cfg["bytes"] <= half and cfg["Q_CHUNK"] * sparse_attention.PARTS == cfg["BLOCK_D"] == 512
    for e_dot in (2, 4):
        for fp8 in (False, True):
            block_e, block_d = indexer._score_blocks(64, 128, e_dot, fp8)
            assert indexer._score_bytes(64, block_d, block_e, e_dot, fp8) <= half and block_e >= 64
    for d_qk, d_v in ((192, 128), (64, 64)):
        d1, d2 = prefill._split_head_dim(d_qk)
        assert d1 + d2 == d_qk
        for e_dot in (2, 4):
            bm, bn = prefill.pick_tiles(d1 + d2, d_v, e_dot, half)
            assert prefill.tile_bytes(bm, bn, d1 + d2, d_v, e_dot) <= half


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker()
    elif "--compile" in sys.argv:
        _compile_worker()


@pytest.mark.parametrize("chip", CHIPS)
def test_a_window_only_call_over_an_fp8_cache_keeps_16_bit_dots(chip, monkeypatch):
    """A sliding layer (no extra list) over an FP8 cache plans bf16 dots (e_dot 2): the extra list's placeholder
    once counted as a second dtype and put these calls on float32 tiles."""
    from deepinfer.ops.sparse_attention import sparse_attention as ref_sparse_attention

    from triton_mode import kernel_module

    monkeypatch.setenv("DEEPINFER_ASCEND_SIM_CHIP", chip)
    sa = kernel_module("deepinfer_ascend.kernels.sparse_attention")
    e_dots = []
    real = sa.plan
    monkeypatch.setattr(sa, "plan", lambda *a, **k: e_dots.append(a[5]) or real(*a, **k))
    gen = torch.Generator().manual_seed(37)
    kv = _fp8_rows(gen, (40, 48))
    indices = torch.randint(0, 40, (3, 20), generator=gen, dtype=torch.int32)
    q, sinks = torch.randn(3, 5, 48, generator=gen).to(BF16), torch.randn(5, generator=gen)
    out = sa.launch_sparse_attention(q, kv, indices, sinks, 48**-0.5)
    assert e_dots == [2]
    _close(out, ref_sparse_attention(q.double(), kv, indices, sinks, softmax_scale=48**-0.5), (BF16,), 20)
