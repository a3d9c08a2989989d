"""The cuda backend's attention kernels (mla_decode, kv_cache_write, prefill) against the op references.

mla_decode and kv_cache_write run under the interpreter (TRITON_INTERPRET=1, numpy on the CPU)
unless the environment says otherwise and a GPU is present; prefill runs under the interpreter
only (on a GPU: `TRITON_INTERPRET=0 pytest tests/cuda/test_attention_kernels.py -k "not prefill"`).

mla_decode: shapes stay small (latent 64 + rope 16 mostly) so the interpreter is quick; the
conformance golden set covers latent 512 + rope 64 and 96 + 32, in pages of 64. The cases reach what
the golden set does not: page sizes 16/32 (a tile spanning pages), S = 3..4 with causality among the
new tokens, several row tiles (S*H > 64), other latent widths, mixed q/cache dtypes, and forced
splits so the combine kernel merges many partials (empty ones included).

prefill: random var-len batches beyond the golden set: q_len 1, cached prefixes, lengths at block
boundaries (63/64/65/128), an empty request, sliding windows, float32 and bfloat16, Dqk 192 / Dv 128
and 64/64, odd head dims; small tiles so that one request spans many query and key blocks
(window-edge, mask-free and diagonal phases), and the TMA-descriptor path.

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
from deepinfer.ops.attention import prefill as ref_prefill
from deepinfer.registry import OPS, check_signature

from triton_mode import kernel_module, require_interpreter, require_interpreter_or_gpu


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


def _mla_inputs(gen, dtype, *, seq_lens, queries, heads, latent=64, rope=16, page=16, q_dtype=None, spare=3, extra_cols=1):
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
    out = K.mla.launch_mla_decode(
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
        ([4, 97], 4, 2, 16, {"num_splits": 3, "overrides": {"BLOCK_N": 16, "wide_combine": False}}),  # S=4, fused merge of empty splits
        ([4, 97], 4, 2, 16, {"num_splits": 3, "overrides": {"BLOCK_N": 16, "wide_min_splits": 2}}),  # the same, wide combine (2 requests < the CPU's 4 "SMs")
        ([700, 5], 1, 4, 16, {"tokens_per_split": 16, "overrides": {"BLOCK_N": 16}}),  # wide combine of 44 splits: two chunks of 32
        ([4, 97], 4, 2, 16, {"num_splits": 3, "overrides": {"BLOCK_N": 16, "fused_combine": False}}),  # the same, combine kernel
        ([1, 63, 64, 65], 1, 4, 64, {"tokens_per_split": 16, "overrides": {"BLOCK_N": 16, "fused_combine": False}}),
        ([3, 40], 3, 2, 32, {"overrides": {"BLOCK_N": 16, "evict": "evict_first"}}),  # one split (direct output), S=3
    ],
)
def test_mla_decode_shapes(dtype, seq_lens, queries, heads, page, kw):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((dtype, seq_lens, queries, heads, page)).encode()))
    _check_mla(_mla_inputs(gen, dtype, seq_lens=seq_lens, queries=queries, heads=heads, page=page), **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 40])
def test_mla_decode_sliding_window(dtype, window):
    gen = torch.Generator().manual_seed(window)
    inputs = _mla_inputs(gen, dtype, seq_lens=[3, 65, 130], queries=2, heads=2, page=32)
    _check_mla(inputs, window=window, tokens_per_split=32, overrides={"BLOCK_N": 16})


def test_mla_decode_row_tiles_and_odd_widths():
    """S*H = 2*40 = 80 rows -> two 64-row tiles; latent 48 / rope 16 (masked columns); split combine."""
    gen = torch.Generator().manual_seed(7)
    inputs = _mla_inputs(gen, torch.float32, seq_lens=[17, 50], queries=2, heads=40, latent=48, rope=16, page=16)
    _check_mla(inputs, tokens_per_split=32, overrides={"BLOCK_N": 16})


def test_mla_decode_mixed_dtypes():
    """float32 queries over a bf16 cache: the cache is upcast, the dot runs in float32."""
    gen = torch.Generator().manual_seed(11)
    inputs = _mla_inputs(gen, torch.bfloat16, seq_lens=[20, 64], queries=1, heads=4, q_dtype=torch.float32, page=16)
    _check_mla(inputs)


def test_mla_decode_full_width_default_plan():
    """DeepSeek-V3's latent 512 + rope 64 through the registered wrapper (its own split plan)."""
    gen = torch.Generator().manual_seed(3)
    inputs = _mla_inputs(gen, torch.bfloat16, seq_lens=[65, 5], queries=1, heads=16, latent=512, rope=64, page=64)
    d = {k: v.to(K.device) for k, v in inputs.items()}
    out = K.mla.mla_decode(d["q_nope"], d["q_rope"], d["kv_cache"], d["block_table"], d["seq_lens"], softmax_scale=0.07).cpu()
    q_nope, q_rope, kv_cache = (inputs[name].double() for name in ("q_nope", "q_rope", "kv_cache"))
    ref = ref_mla_decode(q_nope, q_rope, kv_cache, inputs["block_table"], inputs["seq_lens"], softmax_scale=0.07)
    assert ((out.double() - ref).abs() <= 1e-3 * 65 + 1.6e-2 * ref.abs()).all()


def test_mla_decode_is_deterministic():
    gen = torch.Generator().manual_seed(5)
    inputs = {k: v.to(K.device) for k, v in _mla_inputs(gen, torch.float32, seq_lens=[40, 90], queries=1, heads=4).items()}
    args = (inputs["q_nope"], inputs["q_rope"], inputs["kv_cache"], inputs["block_table"], inputs["seq_lens"], 0.1)
    a = K.mla.launch_mla_decode(*args, tokens_per_split=16, overrides={"BLOCK_N": 16})
    b = K.mla.launch_mla_decode(*args, tokens_per_split=16, overrides={"BLOCK_N": 16})
    assert torch.equal(a, b)
    # The last split program merges in split order, as the combine kernel does: the same values.
    c = K.mla.launch_mla_decode(*args, tokens_per_split=16, overrides={"BLOCK_N": 16, "fused_combine": False})
    torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)


def test_the_compiled_handle_comes_back_with_the_output():
    """The bench reads the split kernel's registers and spills from what the launch returns (no
    module state): the same output as launch_mla_decode, and a handle wherever kernels compile."""
    gen = torch.Generator().manual_seed(8)
    inputs = {k: v.to(K.device) for k, v in _mla_inputs(gen, torch.float32, seq_lens=[40, 9], queries=1, heads=4).items()}
    args = (inputs["q_nope"], inputs["q_rope"], inputs["kv_cache"], inputs["block_table"], inputs["seq_lens"], 0.1)
    out, handle = K.mla.launch_mla_decode_with_handle(*args, num_splits=2, overrides={"BLOCK_N": 16})
    assert torch.equal(out, K.mla.launch_mla_decode(*args, num_splits=2, overrides={"BLOCK_N": 16}))
    assert handle is not None or K.device.type == "cpu"  # (the interpreter compiles nothing)
    assert not hasattr(K.mla, "_LAST_LAUNCH")


def test_fused_combine_counters_are_left_at_zero():
    """Each (row tile, request) counter is reset by the program that merged it: the next launch
    (or CUDA-graph replay) starts from zero."""
    gen = torch.Generator().manual_seed(6)
    inputs = {k: v.to(K.device) for k, v in _mla_inputs(gen, torch.float32, seq_lens=[40, 90, 7], queries=1, heads=4).items()}
    args = (inputs["q_nope"], inputs["q_rope"], inputs["kv_cache"], inputs["block_table"], inputs["seq_lens"], 0.1)
    for _ in range(2):
        K.mla.launch_mla_decode(*args, tokens_per_split=16, overrides={"BLOCK_N": 16, "fused_combine": True, "wide_combine": False})
        assert int(K.mla.arrival_counters(K.device, "mla_decode").count_nonzero()) == 0


def test_split_plan_uses_shapes_only():
    """The split count depends on B, the block table's width and S*H, and stays within its bounds."""
    from deepinfer.triton_common import pick_splits

    plan = K.mla.plan
    cpu = torch.device("cpu")
    _, block_m, tiles, per_split, splits = plan(128, 16, 4096, cpu, None, None)
    assert block_m == 16 and tiles == 1 and splits >= 1 and per_split * splits >= 4096
    _, block_m, tiles, per_split, splits = plan(2, 128, 4096, cpu, None, None)
    assert tiles == 128 // block_m and per_split * splits >= 4096
    _, _, _, per_split, splits = plan(1, 16, 64, cpu, 1000, None)
    assert splits == 1  # never more splits than tiles
    # On an H200 (132 SMs): 16 heads (2 CTAs/SM) -> 2 splits fill one wave of 264 slots; 128 heads
    # (2 row tiles, 1 CTA/SM) -> 256 programs, no split; one request -> as many as the context allows.
    assert pick_splits(128, 264, 16) == 2
    assert pick_splits(256, 132, 16) == 1
    assert pick_splits(1, 264, 16) == 16


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


# ---------------------------------------------------------------------------------------------
# prefill (interpreter only)


@pytest.fixture(scope="module")
def prefill_kernels():
    require_interpreter()
    return kernel_module("deepinfer_cuda.kernels.prefill")


def _prefill_batch(q_lens, prefixes, heads, d_qk, d_v, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k_lens = [q + p for q, p in zip(q_lens, prefixes)]
    cu_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), heads, d_qk, generator=g).to(dtype)
    k = torch.randn(sum(k_lens), heads, d_qk, generator=g).to(dtype)
    v = torch.randn(sum(k_lens), heads, d_v, generator=g).to(dtype)
    return q, k, v, cu_q, cu_k


def _check_prefill(out, q, k, v, cu_q, cu_k, scale, window):
    ref = ref_prefill(q.double(), k.double(), v.double(), cu_q, cu_k, softmax_scale=scale, sliding_window=window)
    assert out.dtype == q.dtype and out.shape == ref.shape
    spec = OPS["prefill"]
    tol = spec.tolerance(q.dtype)
    length = spec.reduction_length({"cu_seqlens_k": cu_k})
    err = (out.double() - ref).abs()
    bound = tol.atol * length + tol.rtol * ref.abs()
    assert torch.isfinite(out).all()
    assert bool((err <= bound).all()), f"max err {float(err.max()):.3g}, worst err/bound {float((err / bound).max()):.3g}"


def test_prefill_signature_matches_the_op(prefill_kernels):
    check_signature(OPS["prefill"], prefill_kernels.prefill, "cuda")
    check_signature(OPS["prefill"], prefill_kernels.prefill_invariant, "cuda")
    # the default kernel, and deterministic mode's (every key block masked)
    assert [(r.op, r.batch_invariant) for r in prefill_kernels.REGISTRATIONS] == [("prefill", False), ("prefill", True)]


@pytest.mark.parametrize(
    "dtype, d_qk, d_v, window",
    [
        (torch.float32, 192, 128, None),
        (torch.bfloat16, 192, 128, None),
        (torch.float32, 64, 64, 37),
        (torch.bfloat16, 64, 64, 37),
    ],
)
def test_prefill_varlen_batch_table_config(prefill_kernels, dtype, d_qk, d_v, window):
    # q_len 1 after a prefix, block-boundary lengths with and without prefixes, an empty request.
    q_lens, prefixes = [1, 63, 64, 0, 65, 128], [40, 0, 70, 9, 1, 3]
    q, k, v, cu_q, cu_k = _prefill_batch(q_lens, prefixes, 2, d_qk, d_v, dtype, seed=d_qk + (window or 0))
    scale = d_qk**-0.5
    out = prefill_kernels.prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, sliding_window=window)
    _check_prefill(out, q, k, v, cu_q, cu_k, scale, window)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("window", [None, 1, 21])
def test_prefill_small_tiles_many_blocks(prefill_kernels, tma, window):
    # 16 x 16 tiles: each request spans several query blocks and the window-edge, mask-free and
    # diagonal key-block phases all run.
    q_lens, prefixes = [47, 1, 33, 16], [50, 17, 0, 16]
    q, k, v, cu_q, cu_k = _prefill_batch(q_lens, prefixes, 2, 192, 128, torch.float32, seed=7 + (window or 0))
    scale = 0.07
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "tma": tma}
    out = prefill_kernels.launch_prefill(q, k, v, cu_q, cu_k, scale, window, cfg=cfg)
    _check_prefill(out, q, k, v, cu_q, cu_k, scale, window)


def test_prefill_gpu_tile_sizes_with_descriptors_bf16(prefill_kernels):
    # The SM90 table's tiles (128 x 64) and the TMA path, on a prefix that crosses key blocks.
    q_lens, prefixes = [130, 5], [70, 200]
    q, k, v, cu_q, cu_k = _prefill_batch(q_lens, prefixes, 1, 192, 128, torch.bfloat16, seed=3)
    scale = 192**-0.5
    cfg = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "tma": True}
    out = prefill_kernels.launch_prefill(q, k, v, cu_q, cu_k, scale, None, cfg=cfg)
    _check_prefill(out, q, k, v, cu_q, cu_k, scale, None)


@pytest.mark.parametrize("d_qk, d_v", [(80, 48), (112, 96)])
def test_prefill_odd_head_dims(prefill_kernels, d_qk, d_v):
    # Dqk split into a power of two plus a padded remainder; Dv padded with masks.
    q_lens, prefixes = [20, 3], [9, 30]
    q, k, v, cu_q, cu_k = _prefill_batch(q_lens, prefixes, 3, d_qk, d_v, torch.float32, seed=d_qk)
    scale = d_qk**-0.5
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
    out = prefill_kernels.launch_prefill(q, k, v, cu_q, cu_k, scale, 11, cfg=cfg)
    _check_prefill(out, q, k, v, cu_q, cu_k, scale, 11)


def test_prefill_negative_scale_and_strided_inputs(prefill_kernels):
    # A negative softmax_scale takes the plain (non-FMA) path; q/k/v as column slices of wider
    # tensors (non-packed heads) take the pointer path.
    q_lens, prefixes = [17], [5]
    qw, kw, vw, cu_q, cu_k = _prefill_batch(q_lens, prefixes, 2, 96, 80, torch.float32, seed=11)
    q, k, v = qw[..., :64], kw[..., :64], vw[..., :64]
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "tma": True}
    out = prefill_kernels.launch_prefill(q, k, v, cu_q, cu_k, -0.2, None, cfg=cfg)
    _check_prefill(out, q, k, v, cu_q, cu_k, -0.2, None)


def test_prefill_rejects_bad_window(prefill_kernels):
    q, k, v, cu_q, cu_k = _prefill_batch([2], [0], 1, 64, 64, torch.float32, seed=0)
    with pytest.raises(ValueError):
        prefill_kernels.prefill(q, k, v, cu_q, cu_k, softmax_scale=0.1, sliding_window=0)
