"""The SM90 Gluon fp8_block kernel's host side on a CPU: which calls it serves, its tiles, stages, K splits and persistent
grid, its TMA descriptors, and its registration under backend option fp8_path=gluon. Its compilation for sm90 is
tests/cuda/test_compile_check.py's; its numbers are a GPU's (`deepinfer conformance --backend cuda --backend-option
fp8_path=gluon --op linear --op grouped_gemm` on an H100/H200: not run here)."""

from __future__ import annotations

import pytest
import torch

import deepinfer_cuda.kernels.gemm_fp8_gluon as gg  # (imports without Gluon too: GLUON_IMPORT_ERROR says why, below)
from deepinfer.ops import quant
from deepinfer.registry import Registry, ResolveContext
from deepinfer_cuda.bench.compile_check import arch_config
from deepinfer_cuda.options import FP8_PATH

from triton_mode import GPU, mode

if gg.GLUON_IMPORT_ERROR is not None:
    pytest.skip(f"no Gluon for Hopper in this Triton (runs with Triton >= 3.5: CI, the GPU machine): {gg.GLUON_IMPORT_ERROR}", allow_module_level=True)

SM90 = lambda variant: arch_config("gemm", variant, "sm90")  # noqa: E731
F8 = quant.FP8_DTYPE


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _plan(x, w, layout):
    return gg.plan_gluon(x, w, layout, SM90, sms=132)


def test_prefill_tiles_fill_every_sm_with_persistent_programs():
    # V4-Flash's wq_a + wkv at 8192 tokens: the 128 x 128 tile, two consumer warpgroups, 6 stages of 32 KiB, no K split
    p = _plan(_meta(8192, 4096), _meta(1536, 4096, dtype=F8), gg._LINEAR)
    assert (p.block_m, p.block_n, p.consumers, p.num_stages, p.split) == (128, 128, 2, 6, 1)
    assert (p.num_m_tiles, p.num_n, p.total_kb, p.units, p.grid) == (64, 12, 32, 768, (132,))
    # the grouped prefill, 8 experts x 4096 tokens: row tiles + one partial per expert (gemm.plan_gemm's bound)
    p = _plan(_meta(8 * 4096, 7168), _meta(8, 4096, 7168, dtype=F8), gg._CONTIGUOUS)
    assert (p.block_m, p.split, p.num_m_tiles, p.num_n, p.total_kb, p.grid) == (128, 1, 256 + 8, 32, 56, (132,))


def test_decode_batches_split_k_where_the_tiles_leave_sms_idle():
    # 256 rows x 4096 columns: 2 x 32 tiles of 128 x 128 and two K splits, 128 units on 132 SMs
    p = _plan(_meta(256, 4096), _meta(4096, 4096, dtype=F8), gg._LINEAR)
    assert (p.block_m, p.block_n, p.consumers, p.tiles, p.split, p.kb_per_split, p.grid) == (128, 128, 2, 64, 2, 16, (128,))
    # 128 rows x 1536 columns: 12 tiles, so more K splits (float32 partials), one unit per program
    p = _plan(_meta(128, 4096), _meta(1536, 4096, dtype=F8), gg._LINEAR)
    assert p.tiles == 12 and p.split > 4 and p.units <= 132 and p.grid == (p.units,)
    assert p.split * p.kb_per_split >= p.total_kb > (p.split - 1) * p.kb_per_split  # no empty split
    # the masked decode layout (32 rows per expert): 64 x 128, one consumer warpgroup; 8 x 32 tiles need no split
    p = _plan(_meta(8, 32, 7168), _meta(8, 4096, 7168, dtype=F8), gg._MASKED)
    assert (p.block_m, p.block_n, p.consumers, p.split, p.tiles, p.grid) == (64, 128, 1, 1, 256, (132,))
    # batch 1: 32 tiles, K 7168 in splits of at least 2 groups
    p = _plan(_meta(1, 7168), _meta(4096, 7168, dtype=F8), gg._LINEAR)
    assert p.block_m == 64 and p.tiles == 32 and 1 < p.split <= 56 // 2 and p.units <= 132


def test_the_split_is_chosen_for_the_row_bucket():
    """As gemm.plan_gemm: every row count of a power-of-two bucket compiles the same kernel (PARTIAL is a constexpr)."""
    w = _meta(1536, 4096, dtype=F8)
    splits = {_plan(_meta(rows, 4096), w, gg._LINEAR).split for rows in (65, 100, 128)}
    assert len(splits) == 1 and splits.pop() > 1


def test_choose_split():
    cfg = SM90("fp8_gluon_medium")
    assert gg.choose_split(132, 32, 132, cfg) == 1  # the tiles fill the SMs
    assert gg.choose_split(8, 32, 132, SM90("fp8_gluon_large")) == 1  # the prefill entry never splits
    for tiles in (1, 8, 24, 48, 100):
        for total_kb in (1, 3, 8, 32, 56):
            split = gg.choose_split(tiles, total_kb, 132, cfg)
            kps = -(-total_kb // split)
            assert 1 <= split <= gg.MAX_SPLIT and -(-total_kb // kps) == split  # every split has groups
            assert split == 1 or split <= total_kb // cfg["min_kb_per_split"]
    assert gg.choose_split(24, 32, 132, cfg) >= 4  # 24 tiles: most SMs stream the weight
    assert gg.choose_split(24, 2, 132, cfg) == 1  # too few groups to split


def test_stages_shrink_to_fit_shared_memory():
    assert gg.fit_stages(128, 128, 6) == 6  # 6 x 32 KiB
    assert gg.fit_stages(128, 128, 8) == 6
    assert gg.fit_stages(64, 64, 8, ctas_per_sm=2) == 6  # two programs per SM share it
    assert gg.fit_stages(256, 256, 4) == 3 and gg.fit_stages(512, 512, 4) == 2  # at least 2


def test_tuning_entries_are_what_the_kernel_takes():
    for name in ("fp8_gluon_small", "fp8_gluon_medium", "fp8_gluon_large"):
        cfg = SM90(name)
        assert cfg["BLOCK_M"] == 64 * cfg["consumers"] and 128 % cfg["BLOCK_N"] == 0, name
    with pytest.raises(ValueError, match="64 rows per consumer"):
        gg.plan_gluon(_meta(8192, 4096), _meta(1536, 4096, dtype=F8), gg._LINEAR, lambda v: {**SM90(v), "BLOCK_M": 256}, sms=132)
    with pytest.raises(ValueError, match="divide 128"):
        gg.plan_gluon(_meta(8192, 4096), _meta(1536, 4096, dtype=F8), gg._LINEAR, lambda v: {**SM90(v), "BLOCK_N": 256}, sms=132)


def test_calls_it_does_not_serve_say_why():
    w = torch.zeros(2, 64, 256, dtype=F8)
    x = torch.zeros(5, 256, dtype=torch.bfloat16)
    assert gg.not_served(x, w, gg._CONTIGUOUS) is None
    assert gg.not_served(x.half(), w, gg._CONTIGUOUS) is None
    assert "float32" in gg.not_served(x.float(), w, gg._CONTIGUOUS)
    assert "multiple of 16" in gg.not_served(x[:, :200], w[..., :200], gg._CONTIGUOUS)
    assert "contiguous" in gg.not_served(x, w.transpose(1, 2).contiguous().transpose(1, 2), gg._CONTIGUOUS)
    xt = torch.zeros(5, 2, 256, dtype=torch.bfloat16).transpose(0, 1)  # [E, max_m, K] laid out expert-minor
    assert "expert-minor" in gg.not_served(xt, w, gg._MASKED)


def test_descriptors_view_the_operands_as_2d_tiles():
    e, n, k, rows = 3, 192, 320, 40
    xq = torch.zeros(rows, k, dtype=F8)
    w = torch.zeros(e, n, k, dtype=F8)
    plan = gg.plan_gluon(torch.zeros(rows, k, dtype=torch.bfloat16), w, gg._CONTIGUOUS, SM90, sms=132)
    xd, wd = gg.descriptors(plan, xq, w)
    assert (xd.shape, xd.strides, xd.block_shape) == ([rows, k], [k, 1], [plan.block_m, 128])
    assert (wd.shape, wd.strides, wd.block_shape) == ([e * n, k], [k, 1], [plan.block_n, 128])
    assert xd.layout.swizzle_byte_width == 128 and wd.layout.swizzle_byte_width == 128  # K-major e4m3 rows of 128 bytes


def _chosen(monkeypatch, path, sm90, fmt="fp8_block", dtype=torch.bfloat16):
    import deepinfer_cuda.kernels.gemm as kg

    monkeypatch.setattr(gg, "is_sm90", lambda device: sm90)
    registry = Registry()
    registry.register_all("cuda", kg.REGISTRATIONS + gg.REGISTRATIONS)
    ctx = ResolveContext("cuda", dtype=dtype, options={} if path is None else {"fp8_path": path})
    return registry.choose(ctx, "grouped_gemm", fmt).fn, registry.choose(ctx, "linear", fmt).fn


def test_option_gluon_picks_it_only_on_sm90_for_fp8_block(monkeypatch):
    import deepinfer_cuda.kernels.gemm as kg

    assert FP8_PATH.choices == ("auto", "tl", "gluon", "cublas") and FP8_PATH.default == "auto"
    assert _chosen(monkeypatch, "gluon", True) == (gg.grouped_gemm, gg.linear)
    assert _chosen(monkeypatch, "gluon", True, dtype=torch.float16) == (gg.grouped_gemm, gg.linear)
    # auto is the tl kernel until the Gluon kernel has passed conformance on a GPU; tl is the tl kernel
    for path in (None, "auto", "tl"):
        assert _chosen(monkeypatch, path, True) == (kg.grouped_gemm, kg.linear), path
    assert _chosen(monkeypatch, "gluon", False) == (kg.grouped_gemm, kg.linear)  # not SM90
    assert _chosen(monkeypatch, "gluon", True, dtype=torch.float32) == (kg.grouped_gemm, kg.linear)
    assert _chosen(monkeypatch, "gluon", True, fmt="mxfp4")[0] is not gg.grouped_gemm


@pytest.mark.skipif(mode() == GPU, reason="runs in CI under the interpreter (CPU tensors, interpreted kernels); on a GPU the comparisons below cover it")
def test_calls_it_does_not_serve_run_the_tl_kernel():
    """float32 x and K 200 (not a multiple of 16): the wrapper hands the calls to gemm.py's kernel, interpreted here."""
    import deepinfer_cuda.kernels.gemm as kg

    gen = torch.Generator().manual_seed(0)
    w, s = quant.quantize_weight_fp8_block(torch.randn(2, 96, 256, generator=gen) * 0.05)
    x = torch.randn(2, 8, 256, generator=gen)
    mm = torch.tensor([8, 3], dtype=torch.int32)
    got = gg.grouped_gemm(x, w, masked_m=mm, weight_scale=s, fmt="fp8_block")
    want = kg.launch_gemm(x, w, s, "fp8_block", kg._MASKED, masked_m=mm)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1, :3], want[1, :3])
    w, s = quant.quantize_weight_fp8_block(torch.randn(64, 200, generator=gen) * 0.05)
    x = torch.randn(3, 200, generator=gen).bfloat16()
    assert "multiple of 16" in gg.not_served(x, w, gg._LINEAR)
    got = gg.linear(x, w, weight_scale=s, fmt="fp8_block", out_dtype=torch.float32)
    want = kg.launch_gemm(x, w, s, "fp8_block", kg._LINEAR, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, want)
