"""The SM90 Gluon sparse_attention over FP8 caches: on a CPU, which calls it serves, its split plan and its fallback to the
tl kernel (the backend option that chooses it: tests/cuda/test_sparse_attention_path.py); on an SM90 GPU (TRITON_INTERPRET=0 pytest
tests/cuda/test_sparse_attention_fp8_gluon.py), its output against the tl kernel's on V4-Flash decode shapes the golden
set has no room for (top-512 CSA and HCA lists with extra_lengths, splits and their combine, the output rotated back,
16 and 128 heads, rows listed -1, a query listing none). Its compilation for sm90 is tests/cuda/test_compile_check.py's;
its golden cases are `deepinfer conformance --backend cuda --op sparse_attention --backend-option sparse_attention_path=gluon`'s."""

from __future__ import annotations

import pytest
import torch

import deepinfer_cuda.kernels.sparse_attention_fp8_gluon as g  # (imports without Gluon too: GLUON_IMPORT_ERROR says why, below)
from deepinfer.ops import kv_cache_format
from deepinfer_cuda.kernels.sparse_attention_gluon_common import SparseGluonPlan

from triton_mode import GPU, mode

if g.GLUON_IMPORT_ERROR is not None:
    pytest.skip(f"no Gluon for Hopper in this Triton (runs with Triton >= 3.5: CI, the GPU machine): {g.GLUON_IMPORT_ERROR}", allow_module_level=True)

FP8 = torch.float8_e4m3fn


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _call(t=4, heads=64, dim=512, kv=None, extra=512, idx_dtype=torch.int32, rope=64, q_dtype=torch.bfloat16):
    """not_served's arguments for V4-Flash decode shapes on meta tensors (each part replaceable)."""
    cache = _meta(4096, dim + 16, dtype=FP8) if kv is None else kv
    return dict(
        q=_meta(t, heads, dim, dtype=q_dtype), kv=cache, indices=_meta(t, 128, dtype=idx_dtype),
        extra_kv=_meta(4096, dim + 16, dtype=FP8) if extra else None, extra_indices=_meta(t, extra, dtype=idx_dtype) if extra else None,
        out_cos_sin_cache=_meta(1000, rope, dtype=torch.float32) if rope else None,
    )  # fmt: skip


def test_calls_it_does_not_serve_say_why():
    for kw in (dict(), dict(extra=0), dict(rope=0), dict(rope=32), dict(heads=16), dict(heads=1), dict(heads=128), dict(t=256)):
        assert g.not_served(**_call(**kw)) is None, kw
    assert "bfloat16" in g.not_served(**_call(q_dtype=torch.float32))
    assert "D = 128" in g.not_served(**_call(dim=128))
    assert "H = 96" in g.not_served(**_call(heads=96))
    assert "kv is not an FP8 cache" in g.not_served(**_call(kv=_meta(4096, 512)))
    mixed = _call()
    mixed["extra_kv"] = _meta(4096, 512)
    assert "extra_kv is not an FP8 cache" in g.not_served(**mixed)
    assert "int32" in g.not_served(**_call(idx_dtype=torch.int64))
    assert g.not_served(**_call(rope=256)) is None and "R = 320" in g.not_served(**_call(rope=320))
    assert "T = 65536" in g.not_served(**_call(t=65536))
    strided = _meta(4096, 536, dtype=FP8)[:, :528]  # 536-byte rows: not 16-byte aligned
    assert "16-byte aligned" in g.not_served(**_call(kv=strided))
    cpu = _call()
    cpu["q"] = torch.zeros(4, 64, 512, dtype=torch.bfloat16)
    assert "not on a GPU" in g.not_served(**cpu)


def test_the_plan_splits_as_the_tl_kernel_does(monkeypatch):
    """Host shapes only: few queries split down to one 64-row tile a split (B1: one program per tile of its 640 rows),
    more fill the 132 SMs with splits of at least 128 rows, B256 runs one split (the output written directly); a forced
    count is clamped to the query's tiles."""
    monkeypatch.setattr(g, "num_sms", lambda device: 132)
    meta = torch.device("meta")
    assert g.plan(1, 64, 128, 512, meta) == SparseGluonPlan(head_tiles=1, num_splits=10)
    assert g.plan(64, 64, 128, 512, meta).num_splits == 2  # 128 programs of 5 tiles
    assert g.plan(256, 64, 128, 512, meta).direct
    assert g.plan(1, 64, 128, 0, meta).num_splits == 2  # the window alone: two tiles
    hca = g.plan(8, 64, 128, 8192, meta)  # an HCA list padded to E_max: splits from its width (the ids past a length are never read)
    assert hca.num_splits * 8 <= 2 * 132 and hca.num_splits > 1
    assert g.plan(2, 128, 128, 512, meta).head_tiles == 2 and g.plan(2, 16, 128, 512, meta).head_tiles == 1
    assert g.plan(2, 64, 128, 512, meta, num_splits=100).num_splits == 10
    assert g.plan(2, 64, 128, 512, meta, num_splits=3).num_splits == 3
    assert g.plan(2, 64, 128, 512, meta, num_splits=0).direct


@pytest.mark.skipif(mode() == GPU, reason="the CPU's fallback (on a GPU the Gluon kernel serves this call)")
def test_a_call_it_does_not_serve_runs_on_the_tl_kernel():
    """Under the interpreter the launch declines (not a GPU) and the op runs sparse_attention.py's tl kernel: its bits."""
    from deepinfer_cuda.kernels import sparse_attention as tl_sparse
    from deepinfer_cuda.kernels import sparse_attention_path as paths

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 64, generator=gen).bfloat16()
    kv = kv_cache_format.quantize_rows(torch.randn(40, 64, generator=gen))
    idx = torch.randint(-1, 40, (3, 16), generator=gen, dtype=torch.int32)
    sinks = torch.randn(4, generator=gen)
    assert g.launch_sparse_attention_fp8_gluon(q, kv, idx, sinks, 0.125) is None
    got = paths.sparse_attention(q, kv, idx, sinks, softmax_scale=0.125)
    assert torch.equal(got, tl_sparse.launch_sparse_attention(q, kv, idx, sinks, 0.125))


def _v4_decode_inputs(t, heads, extra, lengths, rope, gen):
    """V4-Flash decode inputs on the GPU: window lists of 128 rows (a few -1, query 0 listing none), a second list (csa:
    top 512 of a compressed pool; hca: E_max 384 entries, the first extra_lengths valid, garbage ids after), an inverse
    rope table of `rope` channels (V4: 64; 0: no rotation)."""
    dev = "cuda"
    kv = kv_cache_format.quantize_rows(torch.randn(4096, 512, device=dev, generator=gen))
    idx = torch.randint(0, 4096, (t, 128), device=dev, generator=gen, dtype=torch.int32)
    idx[torch.rand(t, 128, device=dev, generator=gen) < 0.1] = -1
    kw = {}
    if extra:
        pool = kv_cache_format.quantize_rows(torch.randn(2048, 512, device=dev, generator=gen) * 2)
        width = 512 if extra == "csa" else 384
        xidx = torch.randint(0, 2048, (t, width), device=dev, generator=gen, dtype=torch.int32)
        kw = dict(extra_kv=pool, extra_indices=xidx)
        if lengths:  # below the width: the last column, an id past the pool, is never read
            kw["extra_lengths"] = torch.randint(0, width, (t,), device=dev, generator=gen, dtype=torch.int32)
            kw["extra_lengths"][-1] = width - 1
            xidx[:, -1] = 1 << 30
    idx[0] = -1
    if extra:
        kw["extra_indices"][0] = -1
    if rope:
        angle = torch.rand(4096, rope // 2, device=dev, generator=gen) * 6.3
        kw.update(out_positions=torch.randint(0, 4096, (t,), device=dev, generator=gen), out_cos_sin_cache=torch.cat((angle.cos(), -angle.sin()), -1))
    q = torch.randn(t, heads, 512, device=dev, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(heads, device=dev, generator=gen)
    return q, kv, idx, sinks, kw


@pytest.mark.skipif(
    mode() != GPU or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="runs on an SM90 GPU only (TRITON_INTERPRET=0 pytest tests/cuda/test_sparse_attention_fp8_gluon.py)",
)
@pytest.mark.parametrize("t, heads, extra, lengths, rope, splits", [
    (4, 64, "csa", False, 64, None), (4, 64, "csa", False, 64, 1), (4, 64, "csa", False, 0, 3), (3, 64, "hca", True, 64, 1),
    (3, 64, "hca", True, 64, None), (2, 16, None, False, 64, 1), (2, 128, "csa", False, 64, None), (40, 64, "csa", False, 64, None),
    (3, 64, "csa", False, 128, 1), (3, 64, "csa", False, 32, 1),
])  # fmt: skip
@pytest.mark.parametrize("l2_prefetch", [False, True], ids=["", "l2_prefetch"])
def test_matches_the_tl_kernel_on_the_gpu(t, heads, extra, lengths, rope, splits, l2_prefetch):
    from deepinfer_cuda.kernels import sparse_attention as tl_sparse

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, kv, idx, sinks, kw = _v4_decode_inputs(t, heads, extra, lengths, rope, gen)
    want = tl_sparse.launch_sparse_attention(q, kv, idx, sinks, 512**-0.5, **kw)
    got = g.launch_sparse_attention_fp8_gluon(q, kv, idx, sinks, 512**-0.5, **kw, num_splits=splits, l2_prefetch=l2_prefetch)
    assert got is not None and not got.isnan().any()
    assert torch.equal(got[0], torch.zeros_like(got[0]))  # a query that lists no row: zeros (rotated zeros too)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 1.6e-2 * max(1.0, want.float().abs().max().item()), err  # bf16 rounding of outputs ~1
