"""The cuda backend's mla_decode and kv_cache_write kernels against the op references.

Runs the Triton kernels under the interpreter (TRITON_INTERPRET=1, numpy on the CPU) unless the
environment says otherwise and a GPU is present. Shapes stay small (latent 64 + rope 16 mostly) so
the interpreter is quick; the conformance golden set covers latent 512 + rope 64. The cases reach
what the golden set does not: page sizes 16/32/64 (a tile inside one page, and a tile spanning
pages), seq_lens 1, 63, 64, 65 and more, S = 1..4 with causality among the new tokens, sliding
windows, several row tiles (S*H > 64), latent widths that are not powers of two, mixed q/cache
dtypes, and forced splits so the combine kernel merges many partials (empty ones included).

tests/triton_mode.py decides where the kernels run and fails these tests loudly if they can run
nowhere: in the interpreter on CPU tensors (tests/conftest.py's default, TRITON_INTERPRET=1), or
compiled on the GPU with TRITON_INTERPRET=0 and a CUDA device.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from deepinfer.ops.attention import kv_cache_write as ref_kv_cache_write
from deepinfer.ops.attention import mla_decode as ref_mla_decode

from triton_mode import kernel_module, require_interpreter_or_gpu


class _Kernels:
    mla = None
    kvw = None
    device = None  # where the inputs go: the CPU under the interpreter, else the GPU


K = _Kernels()


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    """The kernel modules, checked to be decorated for this process's mode (interpreter or GPU)."""
    K.device = require_interpreter_or_gpu()
    K.mla = kernel_module("deepinfer_cuda.kernels.mla_decode")
    K.kvw = kernel_module("deepinfer_cuda.kernels.kv_cache")


TOL = {torch.float32: (1.3e-6, 1e-6), torch.bfloat16: (1.6e-2, 1e-3), torch.float16: (1e-3, 1e-4)}


def _inputs(gen, dtype, *, seq_lens, queries, heads, latent=64, rope=16, page=16, q_dtype=None, spare=3, extra_cols=1):
    pages = [-(-n // page) for n in seq_lens]
    num_blocks = sum(pages) + spare
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(pages) + extra_cols, dtype=torch.int32)  # padding columns: page 0
    start = 0
    for b, count in enumerate(pages):
        table[b, :count] = order[start : start + count]
        start += count
    batch = len(seq_lens)
    q_dtype = q_dtype or dtype
    return {
        "q_nope": torch.randn(batch, queries, heads, latent, generator=gen).to(q_dtype),
        "q_rope": torch.randn(batch, queries, heads, rope, generator=gen).to(q_dtype),
        "kv_cache": torch.randn(num_blocks, page, latent + rope, generator=gen).to(dtype),
        "block_table": table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
    }


def _check_mla(inputs, *, window=None, scale=0.125, **kernel_kw):
    on_device = {k: v.to(K.device) for k, v in inputs.items()}
    out = K.mla._mla_decode(
        on_device["q_nope"], on_device["q_rope"], on_device["kv_cache"], on_device["block_table"], on_device["seq_lens"],
        scale, window, **kernel_kw,
    ).cpu()
    ref = ref_mla_decode(
        inputs["q_nope"].double(), inputs["q_rope"].double(), inputs["kv_cache"].double(), inputs["block_table"], inputs["seq_lens"],
        softmax_scale=scale, sliding_window=window,
    )
    q_dtype = inputs["q_nope"].dtype
    assert out.dtype == q_dtype and out.shape == inputs["q_nope"].shape
    assert torch.isfinite(out).all()
    coarsest = max((q_dtype, inputs["kv_cache"].dtype), key=lambda d: TOL[d][0])
    rtol, atol = TOL[coarsest]
    length = int(inputs["seq_lens"].max())
    err = (out.double() - ref).abs()
    bound = atol * length + rtol * ref.abs()
    assert (err <= bound).all(), f"max err {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "seq_lens, queries, heads, page, kw",
    [
        ([1, 63, 64, 65], 1, 4, 16, {}),  # tiles span pages (BLOCK_N 64 > page 16): per-token page lookup
        ([1, 63, 64, 65], 1, 4, 64, {"tokens_per_split": 16, "overrides": {"BLOCK_N": 16}}),  # 5 splits, tile inside a page
        ([2, 70, 33], 2, 3, 32, {"tokens_per_split": 32, "overrides": {"BLOCK_N": 16}}),  # MTP, S*H=6 rows padded to 16
        ([4, 97], 4, 2, 16, {"num_splits": 3, "overrides": {"BLOCK_N": 16}}),  # S=4, combine with empty splits
        ([4, 97], 4, 2, 16, {"num_splits": 3, "overrides": {"BLOCK_N": 16, "fused_combine": False}}),  # the same, combine kernel
        ([1, 63, 64, 65], 1, 4, 64, {"tokens_per_split": 16, "overrides": {"BLOCK_N": 16, "fused_combine": False}}),
        ([3, 40], 3, 2, 32, {"overrides": {"BLOCK_N": 16, "evict": "evict_first"}}),  # one split (direct output), S=3
    ],
)
def test_mla_decode_shapes(dtype, seq_lens, queries, heads, page, kw):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((dtype, seq_lens, queries, heads, page)).encode()))
    _check_mla(_inputs(gen, dtype, seq_lens=seq_lens, queries=queries, heads=heads, page=page), **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 40])
def test_mla_decode_sliding_window(dtype, window):
    gen = torch.Generator().manual_seed(window)
    inputs = _inputs(gen, dtype, seq_lens=[3, 65, 130], queries=2, heads=2, page=32)
    _check_mla(inputs, window=window, tokens_per_split=32, overrides={"BLOCK_N": 16})


def test_mla_decode_row_tiles_and_odd_widths():
    """S*H = 2*40 = 80 rows -> two 64-row tiles; latent 48 / rope 16 (masked columns); split combine."""
    gen = torch.Generator().manual_seed(7)
    inputs = _inputs(gen, torch.float32, seq_lens=[17, 50], queries=2, heads=40, latent=48, rope=16, page=16)
    _check_mla(inputs, tokens_per_split=32, overrides={"BLOCK_N": 16})


def test_mla_decode_mixed_dtypes():
    """float32 queries over a bf16 cache: the cache is upcast, the dot runs in float32."""
    gen = torch.Generator().manual_seed(11)
    inputs = _inputs(gen, torch.bfloat16, seq_lens=[20, 64], queries=1, heads=4, q_dtype=torch.float32, page=16)
    _check_mla(inputs)


def test_mla_decode_full_width_default_plan():
    """DeepSeek-V3's latent 512 + rope 64 through the registered wrapper (its own split plan)."""
    gen = torch.Generator().manual_seed(3)
    inputs = _inputs(gen, torch.bfloat16, seq_lens=[65, 5], queries=1, heads=16, latent=512, rope=64, page=64)
    d = {k: v.to(K.device) for k, v in inputs.items()}
    out = K.mla.mla_decode(d["q_nope"], d["q_rope"], d["kv_cache"], d["block_table"], d["seq_lens"], softmax_scale=0.07).cpu()
    ref = ref_mla_decode(inputs["q_nope"].double(), inputs["q_rope"].double(), inputs["kv_cache"].double(), inputs["block_table"], inputs["seq_lens"], softmax_scale=0.07)
    assert ((out.double() - ref).abs() <= 1e-3 * 65 + 1.6e-2 * ref.abs()).all()


def test_mla_decode_is_deterministic():
    gen = torch.Generator().manual_seed(5)
    inputs = {k: v.to(K.device) for k, v in _inputs(gen, torch.float32, seq_lens=[40, 90], queries=1, heads=4).items()}
    args = (inputs["q_nope"], inputs["q_rope"], inputs["kv_cache"], inputs["block_table"], inputs["seq_lens"], 0.1)
    a = K.mla._mla_decode(*args, tokens_per_split=16, overrides={"BLOCK_N": 16})
    b = K.mla._mla_decode(*args, tokens_per_split=16, overrides={"BLOCK_N": 16})
    assert torch.equal(a, b)
    # The last split program merges in split order, as the combine kernel does: the same values.
    c = K.mla._mla_decode(*args, tokens_per_split=16, overrides={"BLOCK_N": 16, "fused_combine": False})
    torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)


def test_fused_combine_counters_are_left_at_zero():
    """Each (row tile, request) counter is reset by the program that merged it: the next launch
    (or CUDA-graph replay) starts from zero."""
    gen = torch.Generator().manual_seed(6)
    inputs = {k: v.to(K.device) for k, v in _inputs(gen, torch.float32, seq_lens=[40, 90, 7], queries=1, heads=4).items()}
    args = (inputs["q_nope"], inputs["q_rope"], inputs["kv_cache"], inputs["block_table"], inputs["seq_lens"], 0.1)
    for _ in range(2):
        K.mla._mla_decode(*args, tokens_per_split=16, overrides={"BLOCK_N": 16, "fused_combine": True})
        assert int(K.mla._arrivals(K.device).count_nonzero()) == 0


def test_split_plan_uses_shapes_only():
    """The split count depends on B, the block table's width and S*H, and stays within its bounds."""
    plan = K.mla._plan
    cpu = torch.device("cpu")
    _, block_m, tiles, per_split, splits = plan(128, 16, 4096, cpu, None, None)
    assert block_m == 16 and tiles == 1 and splits >= 1 and per_split * splits >= 4096
    _, block_m, tiles, per_split, splits = plan(2, 128, 4096, cpu, None, None)
    assert tiles == 128 // block_m and per_split * splits >= 4096
    _, _, _, per_split, splits = plan(1, 16, 64, cpu, 1000, None)
    assert splits == 1  # never more splits than tiles
    # On an H200 (132 SMs): 16 heads (2 CTAs/SM) -> 2 splits fill one wave of 264 slots; 128 heads
    # (2 row tiles, 1 CTA/SM) -> 256 programs, no split; one request -> as many as the context allows.
    assert K.mla._pick_splits(128, 264, 16) == 2
    assert K.mla._pick_splits(256, 132, 16) == 1
    assert K.mla._pick_splits(1, 264, 16) == 16


def test_registrations_match_the_op_signatures():
    from deepinfer.registry import Registry

    reg = Registry()
    for module in (K.mla, K.kvw):
        for r in module.REGISTRATIONS:
            reg.register_kernel("cuda", r.op, r.fn, formats=r.formats, dtypes=r.dtypes, note=r.note)
    assert set(reg.kernels["cuda"]) == {"mla_decode", "kv_cache_write"}


@pytest.mark.parametrize("src_dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_kv_cache_write(src_dtype, cache_dtype):
    gen = torch.Generator().manual_seed(1)
    page, blocks, latent, rope = 16, 5, 48, 16
    slots = torch.randperm(blocks * page, generator=gen)[:9].to(torch.int64)
    slots[[2, 6]] = -1
    kv_c = torch.randn(9, latent, generator=gen).to(src_dtype)
    k_pe = torch.randn(9, rope, generator=gen).to(src_dtype)
    cache = torch.randn(blocks, page, latent + rope, generator=gen).to(cache_dtype)
    want = ref_kv_cache_write(kv_c, k_pe, cache.clone(), slots)
    got_dev = cache.clone().to(K.device)
    ret = K.kvw.kv_cache_write(kv_c.to(K.device), k_pe.to(K.device), got_dev, slots.to(K.device))
    assert ret.data_ptr() == got_dev.data_ptr()
    assert torch.equal(got_dev.cpu(), want)


def test_kv_cache_write_strided_inputs():
    """kv_c and k_pe as column slices of one projection output (row stride > width)."""
    gen = torch.Generator().manual_seed(2)
    page, blocks, latent, rope = 16, 3, 64, 16
    fused = torch.randn(5, latent + rope + 8, generator=gen)
    kv_c, k_pe = fused[:, :latent], fused[:, latent : latent + rope]
    slots = torch.tensor([47, 0, -1, 16, 15])
    cache = torch.randn(blocks, page, latent + rope, generator=gen)
    want = ref_kv_cache_write(kv_c, k_pe, cache.clone(), slots)
    got = K.kvw.kv_cache_write(kv_c.to(K.device), k_pe.to(K.device), cache.clone().to(K.device), slots.to(K.device)).cpu()
    assert torch.equal(got, want)
