"""The SM90 Gluon sparse_attention over bf16 caches (kernels/sparse_attention_gluon.py; its GPU cases passed on an H200, 2026-12-07): on a CPU,
which calls it serves, its split plan and tiles, and its fallback to the tl kernel (the backend option that chooses
it: tests/cuda/test_sparse_attention_path.py); on an SM90 GPU (TRITON_INTERPRET=0 pytest
tests/cuda/test_sparse_attention_gluon.py), its output against the reference op (deepinfer/ops/sparse_attention.py) on
V4-Flash decode shapes the golden set has no room for (B1 and B64, window lists with top-512 CSA or HCA lists cut by
extra_lengths, splits and their combine, the sink, the output rotated back, 16 and 128 heads, rows listed -1, a query
listing none), with both tiles and both stage releases; the fused combine and the persistent variant (not yet run on a
GPU) likewise, and the fused combine's counters across calls and CUDA-graph replays. Its compilation for sm90 is
tests/cuda/test_compile_check.py's."""

from __future__ import annotations

import pytest
import torch

import deepinfer_cuda.kernels.sparse_attention_gluon as g  # (imports without Gluon too: GLUON_IMPORT_ERROR says why, below)
from deepinfer.ops.sparse_attention import sparse_attention as reference
from deepinfer_cuda.kernels.sparse_attention_gluon_common import SparseGluonPlan

from triton_mode import GPU, mode

if g.GLUON_IMPORT_ERROR is not None:
    pytest.skip(f"no Gluon for Hopper in this Triton (runs with Triton >= 3.5: CI, the GPU machine): {g.GLUON_IMPORT_ERROR}", allow_module_level=True)


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _call(t=4, heads=64, dim=512, kv=None, extra=512, idx_dtype=torch.int32, rope=64, q_dtype=torch.bfloat16):
    """not_served's arguments for V4-Flash decode shapes over bf16 caches on meta tensors (each part replaceable)."""
    cache = _meta(4096, dim) if kv is None else kv
    return dict(
        q=_meta(t, heads, dim, dtype=q_dtype), kv=cache, indices=_meta(t, 128, dtype=idx_dtype),
        extra_kv=_meta(4096, dim) if extra else None, extra_indices=_meta(t, extra, dtype=idx_dtype) if extra else None,
        out_cos_sin_cache=_meta(1000, rope, dtype=torch.float32) if rope else None,
    )  # fmt: skip


def test_calls_it_does_not_serve_say_why():
    for kw in (dict(), dict(extra=0), dict(rope=0), dict(rope=32), dict(heads=16), dict(heads=1), dict(heads=128), dict(t=256)):
        assert g.not_served(**_call(**kw)) is None, kw
    assert "bfloat16" in g.not_served(**_call(q_dtype=torch.float32))
    assert "D = 128" in g.not_served(**_call(dim=128))
    assert "H = 96" in g.not_served(**_call(heads=96))
    fp8 = _meta(4096, 528, dtype=torch.float8_e4m3fn)
    assert "kv is torch.float8_e4m3fn, not a bfloat16 cache" in g.not_served(**_call(kv=fp8))
    mixed = _call()
    mixed["extra_kv"] = fp8
    assert "extra_kv is torch.float8_e4m3fn" in g.not_served(**mixed)
    assert "not a bfloat16 cache" in g.not_served(**_call(kv=_meta(4096, 512, dtype=torch.float16)))
    assert "int32" in g.not_served(**_call(idx_dtype=torch.int64))
    assert g.not_served(**_call(rope=256)) is None and "R = 320" in g.not_served(**_call(rope=320))
    assert "T = 65536" in g.not_served(**_call(t=65536))
    strided = _meta(4096, 516)[:, :512]  # 1032-byte rows: not 16-byte aligned
    assert "16-byte aligned" in g.not_served(**_call(kv=strided))
    assert g.not_served(**_call(kv=_meta(4096, 1024)[:, :512])) is None  # every other row of a wider buffer: aligned
    cpu = _call()
    cpu["q"] = torch.zeros(4, 64, 512, dtype=torch.bfloat16)
    assert "not on a GPU" in g.not_served(**cpu)


def test_the_plan_splits_as_the_tl_kernel_does_below_half_the_sms(monkeypatch):
    """Host shapes only, as the FP8 kernel's plan (64-row tiles, two stages): few queries split down to one tile a split,
    more fill the 132 SMs with splits of at least 128 rows; from ONE_SPLIT_FROM of the SMs' worth of programs (B64 on
    132 SMs) one split; 32-row tiles run four stages and split as 64-row ones (B1: 64 rows a split, not one 32-row tile:
    the split's partial outweighs its reads); a forced count is clamped to the query's tiles; other tiles are refused."""
    monkeypatch.setattr(g, "num_sms", lambda device: 132)
    meta = torch.device("meta")
    assert g.plan(1, 64, 128, 512, meta) == SparseGluonPlan(head_tiles=1, num_splits=10, block_n=64, stages=2)
    assert g.plan(32, 64, 128, 512, meta).num_splits == 4  # the tl kernel's rule
    assert g.plan(63, 64, 128, 512, meta).num_splits == 2
    assert g.plan(64, 64, 128, 512, meta).direct and g.plan(32, 128, 128, 512, meta).direct  # 64 programs: one split
    assert g.plan(256, 64, 128, 512, meta).direct
    assert g.plan(64, 64, 128, 512, meta, num_splits=2).num_splits == 2  # a forced count still wins
    assert g.plan(1, 64, 128, 512, meta, tile_rows=32) == SparseGluonPlan(head_tiles=1, num_splits=10, block_n=32, stages=4)
    assert g.plan(32, 64, 128, 512, meta, tile_rows=32).num_splits == 4
    assert g.plan(256, 64, 128, 512, meta, tile_rows=32).direct
    hca = g.plan(8, 64, 128, 8192, meta)  # an HCA list padded to E_max: splits from its width (the ids past a length are never read)
    assert hca.num_splits * 8 <= 2 * 132 and hca.num_splits > 1
    assert g.plan(2, 128, 128, 512, meta).head_tiles == 2 and g.plan(2, 16, 128, 512, meta).head_tiles == 1
    assert g.plan(2, 64, 128, 512, meta, num_splits=100).num_splits == 10
    assert g.plan(2, 64, 128, 512, meta, num_splits=100, tile_rows=32).num_splits == 20
    assert g.plan(2, 64, 128, 512, meta, num_splits=3).num_splits == 3
    assert g.plan(2, 64, 128, 512, meta, num_splits=0).direct
    with pytest.raises(ValueError, match="tile_rows=48"):
        g.plan(2, 64, 128, 512, meta, tile_rows=48)


def test_the_tiles_fit_one_block_s_shared_memory():
    """Each tile's stages beside q (64 KiB), p (two [64, rows] bf16) and the row marks stay under the 227 KiB an SM90
    block may have (the compile check reads the exact figure)."""
    for rows, stages in g.TILES.items():
        kib = (64 * 512 * 2 + stages * rows * 512 * 2 + 2 * 64 * rows * 2 + stages * rows * 4) / 1024
        assert kib < 227, (rows, stages, kib)


@pytest.mark.skipif(mode() == GPU, reason="the CPU's fallback (on a GPU the Gluon kernel serves this call)")
def test_a_call_it_does_not_serve_runs_on_the_tl_kernel():
    """Under the interpreter the launch declines (not a GPU) and sparse_attention_path=gluon's op runs sparse_attention.py's
    tl kernel: its bits."""
    from deepinfer_cuda.kernels import sparse_attention as tl_sparse
    from deepinfer_cuda.kernels import sparse_attention_path as paths

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 64, generator=gen).bfloat16()
    kv = torch.randn(40, 64, generator=gen).bfloat16()
    idx = torch.randint(-1, 40, (3, 16), generator=gen, dtype=torch.int32)
    sinks = torch.randn(4, generator=gen)
    assert g.launch_sparse_attention_gluon(q, kv, idx, sinks, 0.125) is None
    got = paths.sparse_attention(q, kv, idx, sinks, softmax_scale=0.125)
    assert torch.equal(got, tl_sparse.launch_sparse_attention(q, kv, idx, sinks, 0.125))


def _v4_decode_inputs(t, heads, extra, lengths, rope, gen):
    """V4-Flash decode inputs on the GPU over bf16 caches: window lists of 128 rows (a few -1; of several queries, query 0
    lists none), a
    second list (csa: top 512 of a compressed pool; hca: E_max 384 entries, the first extra_lengths valid, garbage ids
    after), an inverse rope table of `rope` channels (V4: 64; 0: no rotation). The caches are views of wider buffers
    (every row of a [rows, 576] buffer's first 512 values): a row stride that is not the row's width."""
    dev = "cuda"
    kv = torch.randn(4096, 576, device=dev, generator=gen).to(torch.bfloat16)[:, :512]
    idx = torch.randint(0, 4096, (t, 128), device=dev, generator=gen, dtype=torch.int32)
    idx[torch.rand(t, 128, device=dev, generator=gen) < 0.1] = -1
    kw = {}
    if extra:
        pool = (torch.randn(2048, 512, device=dev, generator=gen) * 2).to(torch.bfloat16)
        width = 512 if extra == "csa" else 384
        xidx = torch.randint(0, 2048, (t, width), device=dev, generator=gen, dtype=torch.int32)
        kw = dict(extra_kv=pool, extra_indices=xidx)
        if lengths:  # below the width: the last column, an id past the pool, is never read
            kw["extra_lengths"] = torch.randint(0, width, (t,), device=dev, generator=gen, dtype=torch.int32)
            kw["extra_lengths"][-1] = width - 1
            xidx[:, -1] = 1 << 30
    if t > 1:
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
    reason="runs on an SM90 GPU only (TRITON_INTERPRET=0 pytest tests/cuda/test_sparse_attention_gluon.py)",
)
@pytest.mark.parametrize("tile_rows, early_release, fused_combine, persistent, l2_prefetch", [
    (64, True, False, False, False), (32, True, False, False, False), (64, False, False, False, False), (32, False, False, False, False),
    (64, True, True, False, False), (32, True, True, False, False), (64, False, True, False, False), (64, True, False, True, False),
    (64, True, True, True, False), (32, True, True, True, False),
    pytest.param(64, True, False, False, True, id="l2_prefetch-64"), pytest.param(32, True, False, False, True, id="l2_prefetch-32"),
])  # fmt: skip
@pytest.mark.parametrize("t, heads, extra, lengths, rope, splits", [
    (1, 64, "csa", False, 64, None), (1, 64, "csa", False, 0, 1), (64, 64, "csa", False, 64, None), (64, 64, "csa", False, 64, 1),
    (4, 64, "csa", False, 0, 3), (3, 64, "hca", True, 64, 1), (3, 64, "hca", True, 64, None), (2, 16, None, False, 64, 1),
    (2, 128, "csa", False, 64, None), (3, 64, "csa", False, 128, 1), (3, 64, "csa", False, 32, 1),
])  # fmt: skip
def test_matches_the_reference_on_the_gpu(t, heads, extra, lengths, rope, splits, tile_rows, early_release, fused_combine, persistent, l2_prefetch):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, kv, idx, sinks, kw = _v4_decode_inputs(t, heads, extra, lengths, rope, gen)
    want = reference(q, kv, idx, sinks, softmax_scale=512**-0.5, **kw)
    got = g.launch_sparse_attention_gluon(q, kv, idx, sinks, 512**-0.5, **kw, num_splits=splits, tile_rows=tile_rows, early_release=early_release,
                                          fused_combine=fused_combine, persistent=persistent, l2_prefetch=l2_prefetch)
    assert got is not None and not got.isnan().any()
    if t > 1:
        assert torch.equal(got[0], torch.zeros_like(got[0]))  # a query that lists no row: zeros (rotated zeros too)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 1.6e-2 * max(1.0, want.float().abs().max().item()), err  # bf16 rounding of outputs ~1


@pytest.mark.skipif(
    mode() != GPU or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="runs on an SM90 GPU only (TRITON_INTERPRET=0 pytest tests/cuda/test_sparse_attention_gluon.py)",
)
@pytest.mark.parametrize("splits, persistent", [(None, False), (3, False), (10, False), (None, True), (5, True)])
def test_the_fused_combine_leaves_its_counters_zero_and_replays_in_a_cuda_graph(splits, persistent):
    """The fused combine's counters (common.split_counters) are zero after every launch (each query's last split resets
    them), so eager calls and CUDA-graph replays of it give the combine kernel's result again and again (the persistent
    variant's too, whose programs run several items each)."""
    from deepinfer_cuda.kernels import sparse_attention_gluon_common as common

    gen = torch.Generator(device="cuda").manual_seed(1)
    q, kv, idx, sinks, kw = _v4_decode_inputs(64, 64, "csa", False, 64, gen)

    def call(fused):
        return g.launch_sparse_attention_gluon(q, kv, idx, sinks, 512**-0.5, **kw, num_splits=splits, fused_combine=fused, persistent=persistent)

    want = call(False)
    for _ in range(3):
        got = call(True)
        assert (got.float() - want.float()).abs().max().item() <= 1e-2
    counters = common.split_counters(q.device, 0)
    assert int(counters.abs().sum()) == 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = call(True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert (replayed.float() - want.float()).abs().max().item() <= 1e-2
    assert int(common.split_counters(q.device, 0).abs().sum()) == 0
